//! `--plot FILE.svg`: bandwidth against size (a line per kind of memory) and allocation
//! latency against size (a line per kind), as one SVG file drawn with plotters.

use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::report::{Report, Section, size_label};

const PANEL_W: u32 = 520;
const PANEL_H: u32 = 340;

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

/// Draws one panel on `area`: x on a log2 axis of bytes, y linear or log10; a note where
/// nothing was measured.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    y_label: &str,
    lines: &[Series],
    log_y: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    // On a log2 axis of bytes; a log y axis shows positive values only.
    let lines: Vec<(&str, Vec<(f64, f64)>)> = (lines.iter())
        .map(|(name, points)| {
            let mut points: Vec<(f64, f64)> = (points.iter())
                .filter(|&&(x, y)| x > 0.0 && (!log_y || y > 0.0))
                .map(|&(x, y)| (x.log2(), y))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            (name.as_str(), points)
        })
        .filter(|(_, points)| !points.is_empty())
        .collect();
    let points = || lines.iter().flat_map(|(_, points)| points.iter().copied());
    if lines.is_empty() {
        area.titled(title, ("sans-serif", 15))?.draw(&Text::new(
            "not measured on this machine",
            (PANEL_W as i32 / 2 - 90, PANEL_H as i32 / 2),
            ("sans-serif", 13),
        ))?;
        return Ok(());
    }
    let (x_min, x_max) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (x, _)| {
        (lo.min(x.floor()), hi.max(x.ceil()))
    });
    let (y_min, y_max) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, y)| {
        (lo.min(y), hi.max(y))
    });
    let mut chart = ChartBuilder::on(area);
    chart
        .caption(title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50);
    let x_range = x_min..x_max.max(x_min + 1.0);
    if log_y {
        let chart = chart.build_cartesian_2d(x_range, (y_min..y_max * 1.5).log_scale())?;
        draw_lines(chart, lines, y_label)
    } else {
        let chart = chart.build_cartesian_2d(x_range, 0.0..y_max * 1.1)?;
        draw_lines(chart, lines, y_label)
    }
}

/// The axes, a line per series (its points marked) and the legend, on `chart`.
fn draw_lines<'a, DB: DrawingBackend + 'a, Y>(
    mut chart: ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    lines: Vec<(&str, Vec<(f64, f64)>)>,
    y_label: &str,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let size = |x: &f64| size_label(2f64.powf(*x).round() as u64);
    chart
        .configure_mesh()
        .x_label_formatter(&size)
        .y_desc(y_label)
        .draw()?;
    for (i, (name, points)) in lines.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)).point_size(3))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
    }
    chart.configure_series_labels().border_style(BLACK).draw()
}

/// The SVG document for `report`.
pub fn svg(report: &Report) -> String {
    let bandwidth = report
        .section("bandwidth")
        .map(|s| {
            series(s, 2, 1, 3, |r| {
                r[0] == crate::report::Value::Text("H2D".into())
            })
        })
        .unwrap_or_default();
    let latency = report
        .section("alloc")
        .map(|s| series(s, 0, 1, 2, |_| true))
        .unwrap_or_default();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (2 * PANEL_W, PANEL_H)).into_drawing_area();
        let (left, right) = root.split_horizontally(PANEL_W);
        // Drawing into a string fails only on a plotting error of a panel (a range plotters
        // cannot draw): that panel is left as far as it got, the other still drawn.
        let _ = root.fill(&WHITE);
        let _ = panel(&left, "Host to device bandwidth", "GB/s", &bandwidth, false);
        let _ = panel(&right, "Getting pinned memory", "µs (log)", &latency, true);
        let _ = root.present();
    }
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
        // A line per kind (drawn two pixels wide, unlike the axes and the legend's marks),
        // each named in the legend.
        let lines = svg.lines().filter(|l| l.starts_with("<polyline"));
        assert_eq!(
            lines.filter(|l| l.contains(r#"stroke-width="2""#)).count(),
            2,
            "{svg}"
        );
        assert!(svg.contains("\npool\n</text>"), "{svg}");
        assert!(
            svg.contains("not measured on this machine"),
            "the latency panel has no data"
        );
        assert_eq!(parse_size("1.5 KiB"), Some(1536.0));
    }
}
