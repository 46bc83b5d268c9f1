//! What a run found: sections of rows, rendered as terminal tables or one JSON document.

use std::fmt::Write as _;

/// One cell.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Free text.
    Text(String),
    /// A measurement, shown with this many decimals.
    Num(f64, usize),
    /// A count or a size in bytes.
    Int(u64),
    /// Not measured (unsupported here, or failed).
    Missing,
}

impl Value {
    fn display(&self) -> String {
        match self {
            Self::Text(t) => t.clone(),
            Self::Num(v, decimals) => format!("{v:.decimals$}"),
            Self::Int(v) => v.to_string(),
            Self::Missing => "-".to_owned(),
        }
    }

    fn json(&self) -> String {
        match self {
            Self::Text(t) => json_string(t),
            Self::Num(v, _) if v.is_finite() => format!("{v}"),
            Self::Int(v) => v.to_string(),
            Self::Num(..) | Self::Missing => "null".to_owned(),
        }
    }

    /// The number in the cell, if any.
    pub fn number(&self) -> Option<f64> {
        match self {
            Self::Num(v, _) => Some(*v),
            Self::Int(v) => Some(*v as f64),
            _ => None,
        }
    }
}

/// The spread of repeated measurements: the smallest, the median and the largest.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// Smallest.
    pub min: f64,
    /// Median (the mean of the middle two for an even count).
    pub median: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (at least one).
    pub fn of(mut values: Vec<f64>) -> Self {
        assert!(!values.is_empty(), "a spread of nothing");
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Self {
            min: values[0],
            median,
            max: values[n - 1],
        }
    }

    /// Three cells: min, median, max, with `decimals` decimals.
    pub fn cells(self, decimals: usize) -> [Value; 3] {
        [
            Value::Num(self.min, decimals),
            Value::Num(self.median, decimals),
            Value::Num(self.max, decimals),
        ]
    }
}

/// `1048576` → `1 MiB`.
pub fn size_label(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A table of results.
#[derive(Clone, Debug, PartialEq)]
pub struct Section {
    /// Machine-readable name, such as `bandwidth`.
    pub name: String,
    /// The heading shown above the table.
    pub title: String,
    /// Column names.
    pub columns: Vec<String>,
    /// Rows, as many cells as columns.
    pub rows: Vec<Vec<Value>>,
    /// Lines shown under the table (anchors, caveats).
    pub notes: Vec<String>,
}

impl Section {
    /// An empty section.
    pub fn new(name: &str, title: &str, columns: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            title: title.to_owned(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<Value>) {
        debug_assert_eq!(cells.len(), self.columns.len());
        self.rows.push(cells);
    }

    /// The table as text, columns aligned.
    pub fn render(&self) -> String {
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| r.iter().map(Value::display).collect())
            .collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|c| {
                cells
                    .iter()
                    .map(|r| r[c].len())
                    .chain([self.columns[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = format!("\n{}\n", self.title);
        let line = |out: &mut String, row: &[String]| {
            let text: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(c, v)| {
                    if c == 0 {
                        format!("{v:<w$}", w = widths[c])
                    } else {
                        format!("{v:>w$}", w = widths[c])
                    }
                })
                .collect();
            let _ = writeln!(out, "  {}", text.join("  "));
        };
        line(&mut out, &self.columns);
        for row in &cells {
            line(&mut out, row);
        }
        for note in &self.notes {
            let _ = writeln!(out, "  {note}");
        }
        out
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Facts about the machine (`info`), as key/value pairs.
    pub machine: Vec<(String, String)>,
    /// Results.
    pub sections: Vec<Section>,
    /// What was skipped and why.
    pub skipped: Vec<String>,
}

impl Report {
    /// The section named `name`, if it was measured.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// The whole report as one JSON document.
    pub fn to_json(&self) -> String {
        let machine: Vec<String> = self
            .machine
            .iter()
            .map(|(k, v)| format!("{}:{}", json_string(k), json_string(v)))
            .collect();
        let sections: Vec<String> = self
            .sections
            .iter()
            .map(|s| {
                let columns: Vec<String> = s.columns.iter().map(|c| json_string(c)).collect();
                let rows: Vec<String> = s
                    .rows
                    .iter()
                    .map(|r| {
                        format!(
                            "[{}]",
                            r.iter().map(Value::json).collect::<Vec<_>>().join(",")
                        )
                    })
                    .collect();
                let notes: Vec<String> = s.notes.iter().map(|n| json_string(n)).collect();
                format!(
                    "{{\"name\":{},\"title\":{},\"columns\":[{}],\"rows\":[{}],\"notes\":[{}]}}",
                    json_string(&s.name),
                    json_string(&s.title),
                    columns.join(","),
                    rows.join(","),
                    notes.join(",")
                )
            })
            .collect();
        let skipped: Vec<String> = self.skipped.iter().map(|s| json_string(s)).collect();
        format!(
            "{{\"machine\":{{{}}},\"sections\":[{}],\"skipped\":[{}]}}\n",
            machine.join(","),
            sections.join(","),
            skipped.join(",")
        )
    }
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_sort_and_take_the_middle() {
        let spread = Spread::of(vec![5.0, 1.0, 3.0]);
        assert_eq!((spread.min, spread.median, spread.max), (1.0, 3.0, 5.0));
        assert_eq!(Spread::of(vec![4.0, 1.0, 2.0, 3.0]).median, 2.5);
    }

    #[test]
    fn tables_align_and_json_escapes() {
        let mut section = Section::new("s", "A \"title\"", &["kind", "GB/s"]);
        section.row(vec![Value::Text("raw".into()), Value::Num(55.123, 1)]);
        section.row(vec![Value::Text("pageable".into()), Value::Missing]);
        section.notes.push("two\nlines".into());
        let text = section.render();
        assert!(
            text.contains("  raw       55.1\n  pageable     -\n"),
            "{text}"
        );
        let report = Report {
            machine: vec![("gpu".into(), "H100".into())],
            sections: vec![section],
            skipped: vec![],
        };
        let json = report.to_json();
        assert!(json.contains(r#""title":"A \"title\"""#), "{json}");
        assert!(json.contains(r#"["raw",55.123]"#), "{json}");
        assert!(json.contains(r#"["pageable",null]"#), "{json}");
        assert!(json.contains(r#""notes":["two\nlines"]"#), "{json}");
        assert!(json.starts_with(r#"{"machine":{"gpu":"H100"}"#), "{json}");
    }

    #[test]
    fn sizes_read_like_people_write_them() {
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(1 << 30), "1 GiB");
        assert_eq!(size_label(1536), "1.5 KiB");
    }
}
