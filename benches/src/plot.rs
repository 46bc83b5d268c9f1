//! `--plot FILE.svg`: bandwidth against size (a line per kind of memory) and allocation
//! latency against size (a line per kind), as one SVG file with no dependencies.

use std::fmt::Write as _;

use crate::report::{Report, Section, size_label};

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const PANEL_W: f64 = 520.0;
const PANEL_H: f64 = 340.0;
const MARGIN: f64 = 60.0;

/// A series: name and (x, y) points.
type Series = (String, Vec<(f64, f64)>);

/// Lines of `section` grouped by the text in column `series`, x from column `x` (a size
/// label turned back into bytes), y from column `y`; rows must pass `keep`.
fn series(
    section: &Section,
    series: usize,
    x: usize,
    y: usize,
    keep: impl Fn(&[crate::report::Value]) -> bool,
) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for row in section.rows.iter().filter(|r| keep(r)) {
        let (crate::report::Value::Text(name), crate::report::Value::Text(size)) =
            (&row[series], &row[x])
        else {
            continue;
        };
        let (Some(bytes), Some(value)) = (parse_size(size), row[y].number()) else {
            continue;
        };
        match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, points)) => points.push((bytes, value)),
            None => out.push((name.clone(), vec![(bytes, value)])),
        }
    }
    out
}

/// `1 MiB` → 1048576.0: a size label (see [`crate::report::size_label`]) read back.
pub fn parse_size(label: &str) -> Option<f64> {
    let (number, unit) = label.split_once(' ')?;
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(number.parse::<f64>().ok()? * scale)
}

/// Draws one panel at horizontal offset `left`: x on a log2 axis of bytes, y linear or log10.
fn panel(svg: &mut String, left: f64, title: &str, y_label: &str, lines: &[Series], log_y: bool) {
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="24" font-size="15" text-anchor="middle">{title}</text>"#,
        left + PANEL_W / 2.0
    );
    let points: Vec<(f64, f64)> = lines
        .iter()
        .flat_map(|(_, p)| p.iter().copied())
        .filter(|&(_, y)| !log_y || y > 0.0)
        .collect();
    if points.is_empty() {
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#666">not measured on this machine</text>"##,
            left + PANEL_W / 2.0,
            PANEL_H / 2.0
        );
        return;
    }
    let frame = Frame::new(left, &points, log_y);
    axes(svg, &frame, left, y_label);
    draw_lines(svg, &frame, lines);
}

/// A panel's plotting area and the ranges its axes cover: what maps a point to SVG
/// coordinates, shared by the axes and the lines.
struct Frame {
    log_y: bool,
    x_min: f64,
    x_max: f64,
    x_span: f64,
    y_min: f64,
    y_span: f64,
    plot_l: f64,
    plot_r: f64,
    plot_t: f64,
    plot_b: f64,
}

impl Frame {
    /// Fits the axes to `points` (none of them empty) in the panel at offset `left`.
    fn new(left: f64, points: &[(f64, f64)], log_y: bool) -> Self {
        let fy = |y: f64| if log_y { y.log10() } else { y };
        let (x_min, x_max) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), &(x, _)| {
            (a.min(x.log2()), b.max(x.log2()))
        });
        let (mut y_min, mut y_max) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), &(_, y)| {
            (a.min(fy(y)), b.max(fy(y)))
        });
        if log_y {
            (y_min, y_max) = (y_min.floor(), y_max.ceil());
        } else {
            (y_min, y_max) = (0.0, (y_max * 1.1).max(1.0));
        }
        let x_span = (x_max - x_min).max(1.0);
        let y_span = (y_max - y_min).max(1e-9);
        let (plot_l, plot_r, plot_t, plot_b) =
            (left + MARGIN, left + PANEL_W - 20.0, 40.0, PANEL_H - 40.0);
        Self {
            log_y,
            x_min,
            x_max,
            x_span,
            y_min,
            y_span,
            plot_l,
            plot_r,
            plot_t,
            plot_b,
        }
    }

    /// A y value on the axis's scale (log10 on a log axis).
    fn fy(&self, y: f64) -> f64 {
        if self.log_y { y.log10() } else { y }
    }

    /// The SVG x of a size in bytes.
    fn sx(&self, x: f64) -> f64 {
        self.plot_l + (x.log2() - self.x_min) / self.x_span * (self.plot_r - self.plot_l)
    }

    /// The SVG y of a value.
    fn sy(&self, y: f64) -> f64 {
        self.plot_b - (self.fy(y) - self.y_min) / self.y_span * (self.plot_b - self.plot_t)
    }
}

/// The plotting area's border, ticks, grid and axis labels, drawn before the lines so these
/// lie on top.
fn axes(svg: &mut String, frame: &Frame, left: f64, y_label: &str) {
    let &Frame {
        plot_l,
        plot_r,
        plot_t,
        plot_b,
        ..
    } = frame;
    let _ = writeln!(
        svg,
        r##"<rect x="{plot_l}" y="{plot_t}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        plot_r - plot_l,
        plot_b - plot_t
    );
    ticks(svg, frame);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle" transform="rotate(-90 {} {})">{y_label}</text>"#,
        left + 14.0,
        (plot_t + plot_b) / 2.0,
        left + 14.0,
        (plot_t + plot_b) / 2.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">size</text>"#,
        (plot_l + plot_r) / 2.0,
        PANEL_H - 8.0
    );
}

/// The x ticks (sizes) and the y gridlines with their labels, in the frame's scales.
fn ticks(svg: &mut String, frame: &Frame) {
    let &Frame {
        log_y,
        x_min,
        x_max,
        y_min,
        y_span,
        plot_l,
        plot_r,
        plot_t,
        plot_b,
        ..
    } = frame;
    // x ticks at every power of four.
    let mut tick = x_min.ceil() as i32;
    while f64::from(tick) <= x_max {
        if tick % 2 == 0 {
            let x = frame.sx(2f64.powi(tick));
            let _ = writeln!(
                svg,
                r##"<line x1="{x}" y1="{plot_b}" x2="{x}" y2="{}" stroke="#999"/><text x="{x}" y="{}" font-size="11" text-anchor="middle">{}</text>"##,
                plot_b + 4.0,
                plot_b + 16.0,
                size_label(2f64.powi(tick) as u64)
            );
        }
        tick += 1;
    }
    for i in 0..=4 {
        let v = y_min + y_span * f64::from(i) / 4.0;
        let y = plot_b - f64::from(i) / 4.0 * (plot_b - plot_t);
        let label = if log_y {
            format!("{}", 10f64.powf(v))
        } else {
            format!("{v:.0}")
        };
        let _ = writeln!(
            svg,
            r##"<line x1="{}" y1="{y}" x2="{plot_r}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" font-size="11" text-anchor="end">{label}</text>"##,
            plot_l,
            plot_l - 4.0,
            y + 4.0
        );
    }
}

/// One polyline with its points and a legend entry per series, in the series' order.
fn draw_lines(svg: &mut String, frame: &Frame, lines: &[Series]) {
    let (log_y, plot_l, plot_t) = (frame.log_y, frame.plot_l, frame.plot_t);
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut pts: Vec<(f64, f64)> = pts
            .iter()
            .copied()
            .filter(|&(_, y)| !log_y || y > 0.0)
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", frame.sx(x), frame.sy(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for &(x, y) in &pts {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                frame.sx(x),
                frame.sy(y)
            );
        }
        let ly = plot_t + 14.0 + 15.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}" font-size="11">{name}</text>"#,
            plot_l + 8.0,
            plot_l + 24.0,
            plot_l + 28.0,
            ly + 4.0
        );
    }
}

/// The SVG document for `report`.
pub fn svg(report: &Report) -> String {
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{PANEL_H}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>
"#,
        2.0 * PANEL_W
    );
    let bandwidth = report
        .section("bandwidth")
        .map(|s| {
            series(s, 2, 1, 3, |r| {
                r[0] == crate::report::Value::Text("H2D".into())
            })
        })
        .unwrap_or_default();
    panel(
        &mut svg,
        0.0,
        "Host to device bandwidth",
        "GB/s",
        &bandwidth,
        false,
    );
    let latency = report
        .section("alloc")
        .map(|s| series(s, 0, 1, 2, |_| true))
        .unwrap_or_default();
    panel(
        &mut svg,
        PANEL_W,
        "Getting pinned memory",
        "µs (log)",
        &latency,
        true,
    );
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Value;

    #[test]
    fn draws_a_line_per_kind() {
        let mut s = Section::new(
            "bandwidth",
            "t",
            &["direction", "size", "memory", "GB/s", "%"],
        );
        for (kind, v) in [("raw", 50.0), ("pool", 49.0)] {
            for size in ["64 KiB", "1 MiB"] {
                s.row(vec![
                    Value::Text("H2D".into()),
                    Value::Text(size.into()),
                    Value::Text(kind.into()),
                    Value::Num(v, 1),
                    Value::Missing,
                ]);
            }
        }
        let report = Report {
            sections: vec![s],
            ..Report::default()
        };
        let svg = svg(&report);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">pool</text>"));
        assert!(
            svg.contains("not measured on this machine"),
            "the latency panel has no data"
        );
        assert_eq!(parse_size("1.5 KiB"), Some(1536.0));
    }
}
