//! What a run found: sections of rows, rendered as terminal tables or one JSON document.

use comfy_table::{CellAlignment, Table};
use serde::{Deserialize, Serialize};

/// One cell. In JSON: text as a string, a measurement as `[value, decimals]`, a count as a
/// number, and `null` for what was not measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Value {
    /// Free text.
    Text(String),
    /// A measurement, shown with this many decimals.
    Num(#[serde(with = "finite")] f64, usize),
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

    /// The number in the cell, if any.
    pub fn number(&self) -> Option<f64> {
        match self {
            Self::Num(v, _) => Some(*v),
            Self::Int(v) => Some(*v as f64),
            _ => None,
        }
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

/// comfy-table's preset: no borders and no lines but the one under the header.
const PRESET: &str = "     -             ";

/// A table of results.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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

    /// The table as text, columns aligned: the first to the left, the others to the right.
    pub fn render(&self) -> String {
        let mut table = Table::new();
        // No borders or colors: columns apart by two spaces, the header underlined.
        table
            .load_preset(PRESET)
            .set_header(&self.columns)
            .add_rows(
                self.rows
                    .iter()
                    .map(|r| r.iter().map(Value::display).collect::<Vec<_>>()),
            );
        for (i, column) in table.column_iter_mut().enumerate() {
            column.set_padding((2, 0));
            if i > 0 {
                column.set_cell_alignment(CellAlignment::Right);
            }
        }
        let mut out = format!("\n{}\n", self.title);
        for line in table.lines() {
            // The header's line starts under the first column's text, not its padding.
            let line = match line.strip_prefix("--") {
                Some(rest) => format!("  {rest}"),
                None => line,
            };
            out.push_str(line.trim_end());
            out.push('\n');
        }
        for note in &self.notes {
            out.push_str("  ");
            out.push_str(note);
            out.push('\n');
        }
        out
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The date of the run, `YYYY-MM-DD`.
    #[serde(default)]
    pub date: String,
    /// The commit the tool was built from, `-dirty` when the tree was (the build script's).
    #[serde(default)]
    pub commit: String,
    /// The command line as run.
    #[serde(default)]
    pub command: String,
    /// Facts about the machine (`info`), as key/value pairs.
    #[serde(with = "pairs")]
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

    /// The whole report as one JSON document (a record: [`Report::from_json`] reads it back).
    pub fn to_json(&self) -> String {
        let mut json = serde_json::to_string(self).expect("a report serializes");
        json.push('\n');
        json
    }

    /// A report from a JSON document written by [`Report::to_json`].
    pub fn from_json(json: &str) -> serde_json::Result<Self> {
        serde_json::from_str(json)
    }
}

/// (key, value) pairs as a JSON object, in their order.
mod pairs {
    use std::fmt;

    use serde::de::{MapAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(pairs: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(pairs.iter().map(|(k, v)| (k, v)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
        struct Pairs;
        impl<'de> Visitor<'de> for Pairs {
            type Value = Vec<(String, String)>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of strings")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut pairs = Vec::new();
                while let Some(pair) = map.next_entry()? {
                    pairs.push(pair);
                }
                Ok(pairs)
            }
        }
        d.deserialize_map(Pairs)
    }
}

/// A measurement as a JSON number; one that is not finite as `null` (read back as NaN).
mod finite {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, s: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            s.serialize_f64(*value)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> Report {
        let mut section = Section::new("s", "A \"title\"", &["kind", "GB/s"]);
        section.row(vec![Value::Text("raw".into()), Value::Num(55.123, 1)]);
        section.row(vec![Value::Text("pageable".into()), Value::Missing]);
        section.row(vec![Value::Text("count".into()), Value::Int(7)]);
        section.notes.push("two\nlines".into());
        Report {
            date: "2026-11-22".into(),
            commit: "1dc3c9a".into(),
            command: "pinned-bench --quick".into(),
            machine: vec![("gpu".into(), "H100".into()), ("cpus".into(), "16".into())],
            sections: vec![section],
            skipped: vec!["GPU parts skipped".into()],
        }
    }

    #[test]
    fn tables_align() {
        let text = example().sections[0].render();
        assert!(text.starts_with("\nA \"title\"\n"), "{text}");
        assert!(
            text.contains("  raw       55.1\n  pageable     -\n  count        7\n"),
            "{text}"
        );
        assert!(text.ends_with("  two\nlines\n"), "{text}");
    }

    #[test]
    fn json_escapes_and_reads_back() {
        let report = example();
        let json = report.to_json();
        assert!(json.contains(r#""title":"A \"title\"""#), "{json}");
        assert!(
            json.contains(r#"[["raw",[55.123,1]],["pageable",null],["count",7]]"#),
            "{json}"
        );
        assert!(json.contains(r#""notes":["two\nlines"]"#), "{json}");
        assert!(
            json.starts_with(
                r#"{"date":"2026-11-22","commit":"1dc3c9a","command":"pinned-bench --quick","machine":{"gpu":"H100","cpus":"16"}"#
            ),
            "{json}"
        );
        assert_eq!(Report::from_json(&json).unwrap(), report);
    }

    #[test]
    fn measurements_that_are_not_finite_are_null() {
        let mut section = Section::new("s", "t", &["x"]);
        section.row(vec![Value::Num(f64::NAN, 1)]);
        let report = Report {
            sections: vec![section],
            ..Report::default()
        };
        let json = report.to_json();
        assert!(json.contains("[[[null,1]]]"), "{json}");
        let back = Report::from_json(&json).unwrap();
        assert!(matches!(back.sections[0].rows[0][0], Value::Num(v, 1) if v.is_nan()));
    }

    #[test]
    fn sizes_read_like_people_write_them() {
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(1 << 30), "1 GiB");
        assert_eq!(size_label(1536), "1.5 KiB");
    }
}
