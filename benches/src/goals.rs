//! The goals a run is held to, read from `goals.toml`: each names the figure of the report it
//! reads, what that figure is compared with (references measured in the same run, or an
//! anchor measured elsewhere), and the goal. `RESULTS.md` and the README's figures are
//! generated from them.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::Deserialize;

use crate::plot::parse_size;
use crate::report::{Report, Value};
use crate::stats::median;

/// The goals, in the order of the table.
const GOALS_TOML: &str = include_str!("../goals.toml");

/// What a row's cell in one column must hold for the row to be read: a text, one of several
/// (a list, or `$name` for a list named in the file's `[picks]`), or a size label in a range.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Pick {
    /// This text.
    Is(String),
    /// One of these texts.
    OneOf(Vec<String>),
    /// A size label in a range.
    Size(SizeRange),
}

/// Size labels from `from` on, up to `to` if given (both included).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizeRange {
    /// The least size, as a label (`"16 MiB"`).
    pub from: String,
    /// The largest size, if any.
    #[serde(default)]
    pub to: Option<String>,
}

impl Pick {
    fn matches(&self, cell: &Value) -> bool {
        let Value::Text(text) = cell else {
            return false;
        };
        match self {
            Self::Is(want) => text == want,
            Self::OneOf(list) => list.iter().any(|want| want == text),
            Self::Size(SizeRange { from, to }) => {
                let bound = |label: &str| parse_size(label).unwrap_or(f64::NAN);
                parse_size(text).is_some_and(|size| {
                    size >= bound(from) && to.as_deref().is_none_or(|to| size <= bound(to))
                })
            }
        }
    }
}

/// Which columns hold the figure.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Columns {
    /// One column: the figure is the median of the rows read, from their least to their
    /// largest.
    One(String),
    /// The min, median and max columns of a spread; over several rows, the median of the
    /// medians, from the least min to the largest max.
    Spread([String; 3]),
}

impl Columns {
    /// The columns' names.
    pub fn names(&self) -> Vec<&str> {
        match self {
            Self::One(name) => vec![name],
            Self::Spread(names) => names.iter().map(String::as_str).collect(),
        }
    }
}

/// Where a figure is in a report: the section, the rows (by what their cells hold, column by
/// column) and the columns.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Read {
    /// The section's name.
    pub section: String,
    /// The rows read: what the cell of each column named must hold.
    #[serde(default)]
    pub rows: BTreeMap<String, Pick>,
    /// The columns read.
    pub columns: Columns,
}

/// A figure as measured: its median, from its least to its largest value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// The median.
    pub median: f64,
    /// The least.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Measured {
    /// `median (min–max)` with `decimals` decimals; only the median where all are the same.
    pub fn show(&self, decimals: usize) -> String {
        let [median, min, max] =
            [self.median, self.min, self.max].map(|v| format!("{v:.decimals$}"));
        if min == max {
            median
        } else {
            format!("{median} ({min}–{max})")
        }
    }

    fn from_values(values: &[f64]) -> Option<Self> {
        (!values.is_empty()).then(|| Self {
            median: median(values.to_vec()),
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

impl Read {
    /// The figure in `report`, if the run measured it.
    pub fn measure(&self, report: &Report) -> Option<Measured> {
        let section = report.section(&self.section)?;
        let column = |name: &str| section.columns.iter().position(|c| c == name);
        let picks: Vec<(usize, &Pick)> = (self.rows.iter())
            .map(|(name, pick)| Some((column(name)?, pick)))
            .collect::<Option<_>>()?;
        let rows = section.rows.iter().filter(|row| {
            (picks.iter()).all(|&(c, pick)| row.get(c).is_some_and(|v| pick.matches(v)))
        });
        let number =
            |row: &[Value], c: usize| row.get(c).and_then(Value::number).filter(|v| v.is_finite());
        match &self.columns {
            Columns::One(name) => {
                let c = column(name)?;
                let values: Vec<f64> = rows.filter_map(|row| number(row, c)).collect();
                Measured::from_values(&values)
            }
            Columns::Spread([min, mid, max]) => {
                let [min, mid, max] = [column(min)?, column(mid)?, column(max)?];
                let spreads: Vec<[f64; 3]> = rows
                    .filter_map(|row| {
                        Some([number(row, min)?, number(row, mid)?, number(row, max)?])
                    })
                    .collect();
                (!spreads.is_empty()).then(|| Measured {
                    median: median(spreads.iter().map(|s| s[1]).collect()),
                    min: spreads.iter().map(|s| s[0]).fold(f64::INFINITY, f64::min),
                    max: (spreads.iter().map(|s| s[2])).fold(f64::NEG_INFINITY, f64::max),
                })
            }
        }
    }
}

/// What a figure is compared with.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged, deny_unknown_fields)]
pub enum Reference {
    /// A figure measured in the same run: its name, where it is, its unit and decimals.
    Same {
        /// What it is.
        name: String,
        /// Where it is.
        read: Read,
        /// Its unit, as written after it.
        #[serde(default)]
        unit: String,
        /// Decimals shown.
        decimals: usize,
    },
    /// A figure measured elsewhere, as written.
    Anchor {
        /// The figure and whose it is.
        anchor: String,
    },
}

/// One goal: a row of `RESULTS.md`'s table.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Goal {
    /// What is measured.
    pub name: String,
    /// Where the figure comes from.
    pub figure: Read,
    /// Where the figure is shown as a percentage of: the median of this.
    #[serde(default)]
    pub percent_of: Option<Read>,
    /// The figure's unit, as written after it.
    #[serde(default)]
    pub unit: String,
    /// Decimals shown.
    pub decimals: usize,
    /// What it is compared with.
    #[serde(default)]
    pub reference: Vec<Reference>,
    /// The goal, met by a median of at least this ...
    #[serde(default)]
    pub at_least: Option<f64>,
    /// ... or of at most this.
    #[serde(default)]
    pub at_most: Option<f64>,
    /// The goal as written.
    pub goal: String,
    /// Whether the README's figures table shows it.
    #[serde(default)]
    pub readme: bool,
}

impl Goal {
    /// The figure in `report`, if the run measured it.
    pub fn measure(&self, report: &Report) -> Option<Measured> {
        let part = self.figure.measure(report)?;
        let Some(whole) = &self.percent_of else {
            return Some(part);
        };
        let whole = whole.measure(report)?.median;
        (whole > 0.0).then(|| Measured {
            median: 100.0 * part.median / whole,
            min: 100.0 * part.min / whole,
            max: 100.0 * part.max / whole,
        })
    }

    /// Whether `value` meets the goal.
    pub fn met(&self, value: f64) -> bool {
        self.at_least.is_none_or(|low| value >= low)
            && self.at_most.is_none_or(|high| value <= high)
    }

    /// Every read the goal makes: its figure's, the whole's, the references'.
    pub fn reads(&self) -> impl Iterator<Item = &Read> {
        let references = self.reference.iter().filter_map(|r| match r {
            Reference::Same { read, .. } => Some(read),
            Reference::Anchor { .. } => None,
        });
        std::iter::once(&self.figure)
            .chain(&self.percent_of)
            .chain(references)
    }
}

/// The file: named lists of texts that picks name as `$name`, and the goals.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GoalsFile {
    #[serde(default)]
    picks: BTreeMap<String, Vec<String>>,
    goal: Vec<Goal>,
}

/// The goals of `text` (a `goals.toml`), with every `$name` pick resolved.
///
/// # Errors
///
/// What is wrong: the TOML, a pick named but not listed, a goal without exactly one bound.
pub fn parse(text: &str) -> Result<Vec<Goal>, String> {
    let file: GoalsFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut goals = file.goal;
    for goal in &mut goals {
        if goal.at_least.is_some() == goal.at_most.is_some() {
            return Err(format!(
                "goal {:?}: give one of at_least and at_most",
                goal.name
            ));
        }
        let name = goal.name.clone();
        let reads = std::iter::once(&mut goal.figure)
            .chain(&mut goal.percent_of)
            .chain(goal.reference.iter_mut().filter_map(|r| match r {
                Reference::Same { read, .. } => Some(read),
                Reference::Anchor { .. } => None,
            }));
        for read in reads {
            for pick in read.rows.values_mut() {
                if let Pick::Size(SizeRange { from, to }) = pick {
                    for label in std::iter::once(from.as_str()).chain(to.as_deref()) {
                        if parse_size(label).is_none() {
                            return Err(format!("goal {name:?}: {label:?} is not a size"));
                        }
                    }
                }
                if let Pick::Is(text) = pick
                    && let Some(list) = text.strip_prefix('$')
                {
                    let texts = file
                        .picks
                        .get(list)
                        .ok_or_else(|| format!("goal {name:?}: no list `{list}` under [picks]"))?;
                    *pick = Pick::OneOf(texts.clone());
                }
            }
        }
    }
    Ok(goals)
}

/// The goals, in the order of the table (`goals.toml`, checked by the tests).
pub fn goals() -> &'static [Goal] {
    static GOALS: OnceLock<Vec<Goal>> = OnceLock::new();
    GOALS.get_or_init(|| parse(GOALS_TOML).unwrap_or_else(|e| panic!("goals.toml: {e}")))
}

// The rows of the sections that goals read by name: the sections name them with these, and
// a test checks that `goals.toml` reads each.

/// The files section's row of the disk's ceiling, which its cold rows are measured against.
pub const FILES_CEILING_ROW: &str =
    "disk ceiling: 16 threads of 8 MiB O_DIRECT reads, cold (reference)";
/// The files section's reference row of its checkpoint shapes: as many bytes as the
/// checkpoint (at most 1 GiB) copied from page-locked memory.
pub const FILES_SHAPE_H2D_ROW: &str =
    "page-locked H2D, the checkpoint's bytes up to 1 GiB (reference)";
/// The files section's rows of the peers: InstantTensor and fastsafetensors reading through
/// the page cache (warm), and as they come (cold).
pub const FILES_INSTANTTENSOR_WARM_ROW: &str = "InstantTensor, buffered reads, warm";
/// See [`FILES_INSTANTTENSOR_WARM_ROW`].
pub const FILES_INSTANTTENSOR_COLD_ROW: &str = "InstantTensor, its default reads, cold";
/// See [`FILES_INSTANTTENSOR_WARM_ROW`].
pub const FILES_FASTSAFETENSORS_WARM_ROW: &str = "fastsafetensors, buffered reads, warm";
/// See [`FILES_INSTANTTENSOR_WARM_ROW`].
pub const FILES_FASTSAFETENSORS_COLD_ROW: &str = "fastsafetensors, its default reads, cold";
/// The files section's row of the first tensor's latency, loads back to back.
pub const FILES_FIRST_BACK_TO_BACK_ROW: &str =
    "pinned-io, first tensor usable, loads back to back (ms)";

/// The files section's row of the first tensor's latency, the device settled before each load.
pub const FILES_FIRST_SETTLED_ROW: &str = "pinned-io, first tensor usable, the device settled (ms)";

/// The files section's row of the device's allocation of the checkpoint's bytes, taking turns
/// with the loads back to back.
pub const FILES_ALLOCATION_BACK_TO_BACK_ROW: &str =
    "the device's allocation alone of the checkpoint's bytes, loads back to back (ms)";

/// The same, taking turns with the loads of a settled device.
pub const FILES_ALLOCATION_SETTLED_ROW: &str =
    "the device's allocation alone of the checkpoint's bytes, the device settled (ms)";

/// The loader section's row of warm epochs from a `.npy` file with 8 workers.
pub const LOADER_NPY_ROW: &str =
    "host collate, 8 workers, from a .npy file in the page cache (alternating)";

/// The loader section's row over memory that the row above is measured against.
pub const LOADER_MEMORY_ROW: &str = "host collate, 8 workers, from memory (alternating)";

/// The most workers of the loader's rows with a worker per core, so that records of machines
/// with many cores stay comparable; the rows' names below say it.
pub const LOADER_PER_CORE_CAP: usize = 16;

/// The loader section's row of warm epochs from a `.npy` file with a worker per core.
pub const LOADER_NPY_PER_CORE_ROW: &str = "host collate, a worker per core (at most 16), from a .npy file in the page cache (alternating)";

/// The loader section's row over memory that the row above is measured against.
pub const LOADER_MEMORY_PER_CORE_ROW: &str =
    "host collate, a worker per core (at most 16), from memory (alternating)";

/// The loader section's row of its cold epochs from a `.npy` file.
pub const LOADER_COLD_ROW: &str =
    "host collate, 8 workers, from a .npy file, cold page cache, one epoch";

/// The loader section's row of the disk's random-read ceiling.
pub const LOADER_COLD_CEILING_ROW: &str =
    "disk random-read ceiling: 32 threads of one-image preads, cold (reference)";
