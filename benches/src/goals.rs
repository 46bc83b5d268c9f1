//! The goals a run is held to: each names the figure of the report it reads, what that figure
//! is compared with (a reference measured in the same run, or a constant anchor), and the
//! goal. `RESULTS.md` and the README's figures are generated from this list.

use crate::plot::parse_size;
use crate::report::{Report, Value};
use crate::stats::median;

/// What a row's cell in one column must hold for the row to be read.
#[derive(Clone, Copy, Debug)]
pub enum Pick {
    /// This text.
    Is(&'static str),
    /// One of these texts.
    OneOf(&'static [&'static str]),
    /// A size label of at least this many bytes.
    SizeFrom(u64),
    /// A size label from the first to the second number of bytes, both included.
    SizeIn(u64, u64),
}

impl Pick {
    fn matches(self, cell: &Value) -> bool {
        let Value::Text(text) = cell else {
            return false;
        };
        let size = || parse_size(text);
        match self {
            Self::Is(want) => text == want,
            Self::OneOf(list) => list.contains(&text.as_str()),
            Self::SizeFrom(low) => size().is_some_and(|s| s >= low as f64),
            Self::SizeIn(low, high) => size().is_some_and(|s| s >= low as f64 && s <= high as f64),
        }
    }
}

/// Which columns hold the figure.
#[derive(Clone, Copy, Debug)]
pub enum Columns {
    /// One column: the figure is the median of the rows read, from their least to their
    /// largest.
    One(&'static str),
    /// The min, median and max columns of a spread; over several rows, the median of the
    /// medians, from the least min to the largest max.
    Spread(&'static str, &'static str, &'static str),
}

/// Where a figure is in a report: the section, the rows (by the cells they hold) and the
/// columns.
#[derive(Clone, Copy, Debug)]
pub struct Read {
    /// The section's name.
    pub section: &'static str,
    /// The rows read: each (column, what its cell holds).
    pub rows: &'static [(&'static str, Pick)],
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
}

impl Read {
    /// The figure in `report`, if the run measured it.
    pub fn measure(&self, report: &Report) -> Option<Measured> {
        let section = report.section(self.section)?;
        let column = |name: &str| section.columns.iter().position(|c| c == name);
        let picks: Vec<(usize, Pick)> = self
            .rows
            .iter()
            .map(|&(name, pick)| Some((column(name)?, pick)))
            .collect::<Option<_>>()?;
        let rows = section.rows.iter().filter(|row| {
            picks
                .iter()
                .all(|&(c, pick)| row.get(c).is_some_and(|v| pick.matches(v)))
        });
        let number =
            |row: &[Value], c: usize| row.get(c).and_then(Value::number).filter(|v| v.is_finite());
        match self.columns {
            Columns::One(name) => {
                let c = column(name)?;
                let values: Vec<f64> = rows.filter_map(|row| number(row, c)).collect();
                (!values.is_empty()).then(|| Measured {
                    median: median(values.clone()),
                    min: values.iter().copied().fold(f64::INFINITY, f64::min),
                    max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                })
            }
            Columns::Spread(min, mid, max) => {
                let [min, mid, max] = [column(min)?, column(mid)?, column(max)?];
                let spreads: Vec<[f64; 3]> = rows
                    .filter_map(|row| {
                        Some([number(row, min)?, number(row, mid)?, number(row, max)?])
                    })
                    .collect();
                (!spreads.is_empty()).then(|| Measured {
                    median: median(spreads.iter().map(|s| s[1]).collect()),
                    min: spreads.iter().map(|s| s[0]).fold(f64::INFINITY, f64::min),
                    max: spreads
                        .iter()
                        .map(|s| s[2])
                        .fold(f64::NEG_INFINITY, f64::max),
                })
            }
        }
    }
}

/// How a goal's figure is made from the report.
#[derive(Clone, Copy, Debug)]
pub enum Figure {
    /// Read as it is.
    Read(Read),
    /// The first as a percentage of the second's median.
    PercentOf(Read, Read),
}

impl Figure {
    /// The figure in `report`, if the run measured it.
    pub fn measure(&self, report: &Report) -> Option<Measured> {
        match self {
            Self::Read(read) => read.measure(report),
            Self::PercentOf(part, whole) => {
                let (part, whole) = (part.measure(report)?, whole.measure(report)?.median);
                (whole > 0.0).then(|| Measured {
                    median: 100.0 * part.median / whole,
                    min: 100.0 * part.min / whole,
                    max: 100.0 * part.max / whole,
                })
            }
        }
    }
}

/// What a figure is compared with.
#[derive(Clone, Copy, Debug)]
pub enum Reference {
    /// A constant figure measured elsewhere (such as PyTorch on the same host).
    Anchor(&'static str),
    /// A figure measured in the same run: its name, where it is, its unit and decimals.
    Same(&'static str, Read, &'static str, usize),
}

/// Where the figure must be.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// At least this.
    AtLeast(f64),
    /// At most this.
    AtMost(f64),
}

impl Target {
    /// Whether `value` meets the target.
    pub fn met(self, value: f64) -> bool {
        match self {
            Self::AtLeast(low) => value >= low,
            Self::AtMost(high) => value <= high,
        }
    }
}

/// One goal: a row of `RESULTS.md`'s table.
#[derive(Clone, Copy, Debug)]
pub struct Goal {
    /// What is measured.
    pub name: &'static str,
    /// Where the figure comes from.
    pub figure: Figure,
    /// The figure's unit, as written after it.
    pub unit: &'static str,
    /// Decimals shown.
    pub decimals: usize,
    /// What it is compared with.
    pub reference: &'static [Reference],
    /// The goal, met by the figure's median.
    pub target: Target,
    /// The goal as written.
    pub goal: &'static str,
    /// Whether the README's figures table shows it.
    pub readme: bool,
}

const MIB: u64 = 1 << 20;
const DIRECTIONS: Pick = Pick::OneOf(&["H2D", "D2H"]);
/// The kinds of page-locked memory a `PinnedVec` copies from in the bandwidth section.
const PINNED: Pick = Pick::OneOf(&[
    "cudaHostAlloc",
    "registered",
    "registered in 12 MiB chunks",
    "virtual (cuMemCreate)",
    "pool",
]);

const STAGED_SPREAD: Columns = Columns::Spread("staged min", "staged median", "staged max");

const fn read(
    section: &'static str,
    rows: &'static [(&'static str, Pick)],
    columns: Columns,
) -> Read {
    Read {
        section,
        rows,
        columns,
    }
}

/// The goals, in the order of the table.
pub const GOALS: &[Goal] = &[
    Goal {
        name: "copy from `PinnedVec`, ≥ 16 MiB",
        figure: Figure::Read(read(
            "bandwidth",
            &[
                ("direction", DIRECTIONS),
                ("size", Pick::SizeFrom(16 * MIB)),
                ("memory", PINNED),
            ],
            Columns::One("% of raw"),
        )),
        unit: "% of raw",
        decimals: 1,
        reference: &[Reference::Same(
            "raw `cudaMemcpyAsync`",
            read(
                "bandwidth",
                &[
                    ("direction", DIRECTIONS),
                    ("size", Pick::SizeFrom(16 * MIB)),
                    ("memory", Pick::Is("raw (sys)")),
                ],
                Columns::One("GB/s"),
            ),
            "GB/s",
            1,
        )],
        target: Target::AtLeast(99.0),
        goal: "≥ 99%",
        readme: true,
    },
    Goal {
        name: "copy from `PinnedVec`, 64 KiB",
        figure: Figure::Read(read(
            "bandwidth",
            &[
                ("direction", DIRECTIONS),
                ("size", Pick::Is("64 KiB")),
                ("memory", PINNED),
            ],
            Columns::One("% of raw"),
        )),
        unit: "% of raw",
        decimals: 1,
        reference: &[Reference::Same(
            "raw `cudaMemcpyAsync`",
            read(
                "bandwidth",
                &[
                    ("direction", DIRECTIONS),
                    ("size", Pick::Is("64 KiB")),
                    ("memory", Pick::Is("raw (sys)")),
                ],
                Columns::One("GB/s"),
            ),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(97.0),
        goal: "≥ 97%",
        readme: false,
    },
    Goal {
        name: "pool pair, `PinnedVec::with_capacity_in(4 KiB, &pool)` + drop",
        figure: Figure::Read(read(
            "pool_latency",
            &[("size", Pick::Is("4 KiB")), ("path", Pick::Is("PinnedVec"))],
            Columns::Spread("min", "median", "max"),
        )),
        unit: "ns",
        decimals: 1,
        reference: &[Reference::Anchor("PyTorch 200 ns")],
        target: Target::AtMost(25.0),
        goal: "≤ 25 ns",
        readme: true,
    },
    Goal {
        name: "pool, 4 KiB pairs on 16 threads",
        figure: Figure::Read(read(
            "pool_threads",
            &[("threads", Pick::Is("16"))],
            Columns::Spread("min", "median", "max"),
        )),
        unit: "M pairs/s",
        decimals: 0,
        reference: &[Reference::Anchor("PyTorch 2.07 M pairs/s")],
        target: Target::AtLeast(200.0),
        goal: "≥ 200 M/s",
        readme: true,
    },
    Goal {
        name: "reserved / requested, mixed sizes",
        figure: Figure::Read(read("pool_waste", &[], Columns::One("ratio"))),
        unit: "",
        decimals: 3,
        reference: &[Reference::Anchor("PyTorch 1.849")],
        target: Target::AtMost(1.10),
        goal: "≤ 1.10",
        readme: true,
    },
    Goal {
        name: "cold pin of 1 GiB, registered in 12 MiB chunks",
        figure: Figure::Read(read(
            "alloc",
            &[
                ("memory", Pick::Is("registered in 12 MiB chunks")),
                ("size", Pick::Is("1 GiB")),
            ],
            Columns::One("allocate ms/GiB"),
        )),
        unit: "ms",
        decimals: 1,
        reference: &[COLD_CUDA_HOST_ALLOC],
        target: Target::AtMost(40.0),
        goal: "≤ 40 ms",
        readme: true,
    },
    Goal {
        name: "cold pin of 1 GiB, pool miss",
        figure: Figure::Read(read(
            "alloc",
            &[
                ("memory", Pick::Is("pool miss")),
                ("size", Pick::Is("1 GiB")),
            ],
            Columns::One("allocate ms/GiB"),
        )),
        unit: "ms",
        decimals: 1,
        reference: &[COLD_CUDA_HOST_ALLOC],
        target: Target::AtMost(40.0),
        goal: "≤ 40 ms",
        readme: false,
    },
    Goal {
        name: "another thread's 64 KiB copy while 1 GiB is pinned in 12 MiB chunks, worst wait",
        figure: Figure::Read(read(
            "stall",
            &[("pinning", Pick::Is("registered in 12 MiB chunks"))],
            Columns::One("worst copy ms"),
        )),
        unit: "ms",
        decimals: 2,
        reference: &[Reference::Same(
            "while `cudaHostAlloc` pins 1 GiB",
            read(
                "stall",
                &[("pinning", Pick::Is("cudaHostAlloc"))],
                Columns::One("worst copy ms"),
            ),
            "ms",
            1,
        )],
        target: Target::AtMost(1.0),
        goal: "≤ 1 ms",
        readme: false,
    },
    Goal {
        name: "upload of 1 GiB from a `Vec` (`Stager`)",
        figure: Figure::Read(read("staged", STAGED_UP_1G, STAGED_SPREAD)),
        unit: "GB/s",
        decimals: 1,
        reference: &[
            Reference::Same(
                "the driver's path",
                read("staged", STAGED_UP_1G, Columns::One("driver")),
                "GB/s",
                1,
            ),
            Reference::Same(
                "pinned",
                read("staged", STAGED_UP_1G, Columns::One("pinned")),
                "GB/s",
                1,
            ),
        ],
        target: Target::AtLeast(50.0),
        goal: "≥ 50 GB/s",
        readme: true,
    },
    Goal {
        name: "download of 1 GiB into a `Vec` (`Stager`)",
        figure: Figure::Read(read("staged", STAGED_DOWN_1G, STAGED_SPREAD)),
        unit: "GB/s",
        decimals: 1,
        reference: &[
            Reference::Same(
                "the driver's path",
                read("staged", STAGED_DOWN_1G, Columns::One("driver")),
                "GB/s",
                1,
            ),
            Reference::Same(
                "pinned",
                read("staged", STAGED_DOWN_1G, Columns::One("pinned")),
                "GB/s",
                1,
            ),
        ],
        target: Target::AtLeast(50.0),
        goal: "≥ 50 GB/s",
        readme: true,
    },
    Goal {
        name: "uploads of 16–256 MiB from a `Vec` (`Stager`)",
        figure: Figure::Read(read(
            "staged",
            STAGED_UP_16M_256M,
            Columns::One("% of pinned"),
        )),
        unit: "% of pinned",
        decimals: 1,
        reference: &[Reference::Same(
            "pinned",
            read("staged", STAGED_UP_16M_256M, Columns::One("pinned")),
            "GB/s",
            1,
        )],
        target: Target::AtLeast(80.0),
        goal: "≥ 80%",
        readme: false,
    },
    Goal {
        name: "loader, host collate, 8 workers",
        figure: Figure::Read(read(
            "loader",
            &[("mode", Pick::Is("host collate, 8 workers"))],
            Columns::Spread("steady b/s min", "median", "max"),
        )),
        unit: "batches/s",
        decimals: 0,
        reference: &[Reference::Anchor("hand-tuned PyTorch 2,967 batches/s")],
        target: Target::AtLeast(4000.0),
        goal: "≥ 4,000 batches/s",
        readme: true,
    },
    Goal {
        name: "loader, device gather",
        figure: Figure::PercentOf(
            read(
                "loader",
                &[("mode", Pick::Is("device gather"))],
                LOADER_SPREAD,
            ),
            read("loader", LOADER_CONTIGUOUS, LOADER_SPREAD),
        ),
        unit: "% of one copy",
        decimals: 1,
        reference: &[Reference::Same(
            "one contiguous copy per batch",
            read("loader", LOADER_CONTIGUOUS, LOADER_SPREAD),
            "batches/s",
            0,
        )],
        target: Target::AtLeast(95.0),
        goal: "≥ 95%",
        readme: false,
    },
    Goal {
        name: "loader, host collate, 8 workers, from a `.npy` file (warm)",
        figure: Figure::PercentOf(
            read("loader", LOADER_NPY, LOADER_SPREAD),
            read("loader", LOADER_MEMORY, LOADER_SPREAD),
        ),
        unit: "% of memory",
        decimals: 1,
        reference: &[
            Reference::Same(
                "the same loader over memory",
                read("loader", LOADER_MEMORY, LOADER_SPREAD),
                "batches/s",
                0,
            ),
            Reference::Same(
                "the file loader kept busy",
                read("loader", LOADER_NPY, LOADER_CORES),
                "CPU cores",
                1,
            ),
        ],
        target: Target::AtLeast(90.0),
        goal: "≥ 90%",
        readme: false,
    },
    Goal {
        name: "loader, host collate, a worker per core (at most 16), from a `.npy` file (warm)",
        figure: Figure::PercentOf(
            read("loader", LOADER_NPY_PER_CORE, LOADER_SPREAD),
            read("loader", LOADER_MEMORY_PER_CORE, LOADER_SPREAD),
        ),
        unit: "% of memory",
        decimals: 1,
        reference: &[
            Reference::Same(
                "the same loader over memory",
                read("loader", LOADER_MEMORY_PER_CORE, LOADER_SPREAD),
                "batches/s",
                0,
            ),
            Reference::Same(
                "the file loader kept busy",
                read("loader", LOADER_NPY_PER_CORE, LOADER_CORES),
                "CPU cores",
                1,
            ),
        ],
        target: Target::AtLeast(90.0),
        goal: "≥ 90%",
        readme: false,
    },
    Goal {
        name: "loader, host collate, 8 workers, from a `.npy` file (cold)",
        figure: Figure::PercentOf(
            read("loader", LOADER_NPY_COLD, LOADER_GBPS),
            read("loader", LOADER_COLD_CEILING, LOADER_GBPS),
        ),
        unit: "% of the disk",
        decimals: 1,
        reference: &[Reference::Same(
            "32 threads of one-image `pread`s at random",
            read("loader", LOADER_COLD_CEILING, LOADER_GBPS),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(90.0),
        goal: "≥ 90%",
        readme: false,
    },
    Goal {
        name: "loader, a cudarc training loop without `unsafe`",
        figure: Figure::PercentOf(
            read("loader", LOADER_CUDARC, LOADER_SPREAD),
            read("loader", LOADER_RAW_STEP, LOADER_SPREAD),
        ),
        unit: "% of the raw-address step",
        decimals: 1,
        reference: &[Reference::Same(
            "the raw-address step",
            read("loader", LOADER_RAW_STEP, LOADER_SPREAD),
            "batches/s",
            0,
        )],
        target: Target::AtLeast(95.0),
        goal: "≥ 95% (the same within noise)",
        readme: false,
    },
    Goal {
        name: "file → device, 8 GiB checkpoint, warm",
        figure: Figure::Read(read("files", FILES_WARM, FILES_SPREAD)),
        unit: "GB/s",
        decimals: 1,
        reference: &[
            Reference::Anchor("safetensors→cuda 6.61 GB/s; torch cpu+pin 35.1; C++ ring 51.0"),
            Reference::Same(
                "page-locked H2D",
                read("files", FILES_H2D, FILES_SPREAD),
                "GB/s",
                1,
            ),
        ],
        target: Target::AtLeast(50.0),
        goal: "≥ 50 GB/s",
        readme: true,
    },
    Goal {
        name: "file → device, 8 GiB checkpoint, warm, share of page-locked H2D",
        figure: Figure::PercentOf(
            read("files", FILES_WARM, FILES_SPREAD),
            read("files", FILES_H2D, FILES_SPREAD),
        ),
        unit: "%",
        decimals: 1,
        reference: &[Reference::Same(
            "page-locked H2D",
            read("files", FILES_H2D, FILES_SPREAD),
            "GB/s",
            1,
        )],
        target: Target::AtLeast(90.0),
        goal: "≥ 90%",
        readme: false,
    },
    Goal {
        name: "file → device, 8 GiB checkpoint, cold",
        figure: Figure::PercentOf(
            read("files", FILES_COLD, FILES_SPREAD),
            read("files", FILES_CEILING, FILES_SPREAD),
        ),
        unit: "% of the disk",
        decimals: 1,
        reference: &[Reference::Same(
            "16 threads of 8 MiB `O_DIRECT` reads",
            read("files", FILES_CEILING, FILES_SPREAD),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(95.0),
        goal: "≥ 95%",
        readme: true,
    },
    Goal {
        name: "file → device, first tensor usable (warm, loads back to back)",
        figure: Figure::Read(read("files", FILES_FIRST_BACK_TO_BACK, FILES_SPREAD)),
        unit: "ms",
        decimals: 2,
        reference: &[Reference::Same(
            "the device's allocation alone of the checkpoint's bytes",
            read("files", FILES_ALLOCATION_BACK_TO_BACK, FILES_SPREAD),
            "ms",
            2,
        )],
        target: Target::AtMost(5.0),
        goal: "≤ 5 ms",
        readme: false,
    },
    Goal {
        name: "file → device, first tensor usable (warm, the device settled)",
        figure: Figure::Read(read("files", FILES_FIRST_SETTLED, FILES_SPREAD)),
        unit: "ms",
        decimals: 2,
        reference: &[Reference::Same(
            "the device's allocation alone of the checkpoint's bytes",
            read("files", FILES_ALLOCATION_SETTLED, FILES_SPREAD),
            "ms",
            2,
        )],
        target: Target::AtMost(5.0),
        goal: "≤ 5 ms",
        readme: false,
    },
    Goal {
        name: "file → device, pinned memory held",
        figure: Figure::Read(read(
            "files",
            &[("path", Pick::Is("pinned memory held by the reader (MiB)"))],
            Columns::One("min"),
        )),
        unit: "MiB",
        decimals: 0,
        reference: &[],
        target: Target::AtMost(256.0),
        goal: "≤ 256 MiB",
        readme: false,
    },
    Goal {
        name: "file → several GPUs, cold, read once",
        figure: Figure::Read(read(
            FILES_SEVERAL,
            &[
                (
                    "path",
                    Pick::OneOf(&[
                        "pinned-io, cold, onto 2 GPUs (read once; % of one GPU)",
                        "pinned-io, cold, onto 4 GPUs (read once; % of one GPU)",
                        "pinned-io, cold, onto 8 GPUs (read once; % of one GPU)",
                    ]),
                ),
                ("checkpoint", FILES_LARGE),
            ],
            Columns::One("% of ref"),
        )),
        unit: "% of one GPU's rate",
        decimals: 1,
        reference: &[Reference::Same(
            "one GPU, cold",
            read(
                FILES_SEVERAL,
                &[
                    ("path", Pick::Is("pinned-io, cold, one GPU (reference)")),
                    ("checkpoint", FILES_LARGE),
                ],
                FILES_SPREAD,
            ),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(87.0),
        goal: "≥ 87% (≤ 1.15× the time)",
        readme: false,
    },
    Goal {
        name: "candle `VarBuilder` from an 8 GiB checkpoint, every tensor taken, share of pinned-io's load",
        figure: Figure::PercentOf(
            read("candle", CANDLE_OURS_LARGE, CANDLE_SPREAD),
            read("candle", CANDLE_RAW_LARGE, CANDLE_SPREAD),
        ),
        unit: "%",
        decimals: 1,
        reference: &[Reference::Same(
            "pinned-io's load",
            read("candle", CANDLE_RAW_LARGE, CANDLE_SPREAD),
            "GB/s",
            1,
        )],
        target: Target::AtLeast(90.0),
        goal: "≥ 90%",
        readme: true,
    },
    Goal {
        name: "candle `VarBuilder` from an 8 GiB checkpoint, against candle's own `from_mmaped_safetensors`",
        figure: Figure::PercentOf(
            read("candle", CANDLE_OURS_LARGE, CANDLE_SPREAD),
            read("candle", CANDLE_THEIRS_LARGE, CANDLE_SPREAD),
        ),
        unit: "% of candle's",
        decimals: 0,
        reference: &[Reference::Same(
            "candle's own",
            read("candle", CANDLE_THEIRS_LARGE, CANDLE_SPREAD),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(700.0),
        goal: "≥ 7×",
        readme: false,
    },
    Goal {
        name: "candle `VarBuilder` from a model-shaped checkpoint, share of pinned-io's load",
        figure: Figure::PercentOf(
            read("candle", CANDLE_OURS_MODEL, CANDLE_SPREAD),
            read("candle", CANDLE_RAW_MODEL, CANDLE_SPREAD),
        ),
        unit: "%",
        decimals: 1,
        reference: &[Reference::Same(
            "pinned-io's load",
            read("candle", CANDLE_RAW_MODEL, CANDLE_SPREAD),
            "GB/s",
            1,
        )],
        target: Target::AtLeast(90.0),
        goal: "≥ 90%",
        readme: false,
    },
    Goal {
        name: "candle `VarBuilder` from a model-shaped checkpoint, against candle's own",
        figure: Figure::PercentOf(
            read("candle", CANDLE_OURS_MODEL, CANDLE_SPREAD),
            read("candle", CANDLE_THEIRS_MODEL, CANDLE_SPREAD),
        ),
        unit: "% of candle's",
        decimals: 0,
        reference: &[Reference::Same(
            "candle's own",
            read("candle", CANDLE_THEIRS_MODEL, CANDLE_SPREAD),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(700.0),
        goal: "≥ 7×",
        readme: false,
    },
    Goal {
        name: "candle tensor, CPU → GPU, 1 GiB, `to_device_staged` against candle's `to_device`",
        figure: Figure::PercentOf(
            read("candle_to_device", CANDLE_UP_OURS, CANDLE_SPREAD),
            read("candle_to_device", CANDLE_UP_THEIRS, CANDLE_SPREAD),
        ),
        unit: "% of candle's",
        decimals: 0,
        reference: &[Reference::Same(
            "candle's `to_device`",
            read("candle_to_device", CANDLE_UP_THEIRS, CANDLE_SPREAD),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(200.0),
        goal: "≥ 2×",
        readme: false,
    },
    Goal {
        name: "candle tensor, GPU → CPU, 1 GiB, `to_device_staged` against candle's `to_device`",
        figure: Figure::PercentOf(
            read("candle_to_device", CANDLE_DOWN_OURS, CANDLE_SPREAD),
            read("candle_to_device", CANDLE_DOWN_THEIRS, CANDLE_SPREAD),
        ),
        unit: "% of candle's",
        decimals: 0,
        reference: &[Reference::Same(
            "candle's `to_device`",
            read("candle_to_device", CANDLE_DOWN_THEIRS, CANDLE_SPREAD),
            "GB/s",
            2,
        )],
        target: Target::AtLeast(200.0),
        goal: "≥ 2×",
        readme: false,
    },
    Goal {
        name: "candle training batches as tensors (`TensorLoader`), share of the loader's own device batches",
        figure: Figure::PercentOf(
            read("candle_loader", CANDLE_LOADER_OURS, CANDLE_SPREAD),
            read("candle_loader", CANDLE_LOADER_DEVICE, CANDLE_SPREAD),
        ),
        unit: "%",
        decimals: 1,
        reference: &[Reference::Same(
            "`DeviceLoader`, host collate",
            read("candle_loader", CANDLE_LOADER_DEVICE, CANDLE_SPREAD),
            "batches/s",
            0,
        )],
        target: Target::AtLeast(95.0),
        goal: "≥ 95% (the same within noise)",
        readme: false,
    },
];

const FILES_SPREAD: Columns = Columns::Spread("min", "median", "max");
/// The section of the checkpoints onto several GPUs (measured on machines that have them).
const FILES_SEVERAL: &str = "files, several GPUs";
const FILES_LARGE: Pick = Pick::OneOf(&["large: 205 × 40 MiB", "large: 100 × 10 MiB"]);
const FILES_WARM: &[(&str, Pick)] = &[
    ("path", Pick::Is("pinned-io, warm")),
    ("checkpoint", FILES_LARGE),
];
const FILES_H2D: &[(&str, Pick)] = &[
    ("path", Pick::Is("page-locked H2D, 1 GiB (reference)")),
    ("checkpoint", FILES_LARGE),
];
const FILES_COLD: &[(&str, Pick)] = &[
    ("path", Pick::Is("pinned-io, cold")),
    ("checkpoint", FILES_LARGE),
];
const FILES_CEILING: &[(&str, Pick)] = &[
    (
        "path",
        Pick::Is("disk ceiling: 16 threads of 8 MiB O_DIRECT reads, cold (reference)"),
    ),
    ("checkpoint", FILES_LARGE),
];
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
const FILES_ALLOCATION_BACK_TO_BACK: &[(&str, Pick)] = &[
    ("path", Pick::Is(FILES_ALLOCATION_BACK_TO_BACK_ROW)),
    ("checkpoint", FILES_LARGE),
];
const FILES_ALLOCATION_SETTLED: &[(&str, Pick)] = &[
    ("path", Pick::Is(FILES_ALLOCATION_SETTLED_ROW)),
    ("checkpoint", FILES_LARGE),
];
const FILES_FIRST_BACK_TO_BACK: &[(&str, Pick)] = &[
    ("path", Pick::Is(FILES_FIRST_BACK_TO_BACK_ROW)),
    ("checkpoint", FILES_LARGE),
];
const FILES_FIRST_SETTLED: &[(&str, Pick)] = &[
    ("path", Pick::Is(FILES_FIRST_SETTLED_ROW)),
    ("checkpoint", FILES_LARGE),
];
/// The loader section's row of warm epochs from a `.npy` file with 8 workers.
pub const LOADER_NPY_ROW: &str =
    "host collate, 8 workers, from a .npy file in the page cache (alternating)";
/// The loader section's row over memory that the row above is measured against.
pub const LOADER_MEMORY_ROW: &str = "host collate, 8 workers, from memory (alternating)";
const LOADER_NPY: &[(&str, Pick)] = &[("mode", Pick::Is(LOADER_NPY_ROW))];
/// The most workers of the loader's rows with a worker per core, so that records of machines
/// with many cores stay comparable; the rows' names below say it.
pub const LOADER_PER_CORE_CAP: usize = 16;
/// The loader section's row of warm epochs from a `.npy` file with a worker per core.
pub const LOADER_NPY_PER_CORE_ROW: &str = "host collate, a worker per core (at most 16), from a .npy file in the page cache (alternating)";
/// The loader section's row over memory that the row above is measured against.
pub const LOADER_MEMORY_PER_CORE_ROW: &str =
    "host collate, a worker per core (at most 16), from memory (alternating)";
const LOADER_NPY_PER_CORE: &[(&str, Pick)] = &[("mode", Pick::Is(LOADER_NPY_PER_CORE_ROW))];
const LOADER_MEMORY_PER_CORE: &[(&str, Pick)] = &[("mode", Pick::Is(LOADER_MEMORY_PER_CORE_ROW))];
/// The loader section's row of its cold epochs from a `.npy` file.
pub const LOADER_COLD_ROW: &str =
    "host collate, 8 workers, from a .npy file, cold page cache, one epoch";
/// The loader section's row of the disk's random-read ceiling.
pub const LOADER_COLD_CEILING_ROW: &str =
    "disk random-read ceiling: 32 threads of one-image preads, cold (reference)";
const LOADER_NPY_COLD: &[(&str, Pick)] = &[("mode", Pick::Is(LOADER_COLD_ROW))];
const LOADER_COLD_CEILING: &[(&str, Pick)] = &[("mode", Pick::Is(LOADER_COLD_CEILING_ROW))];
const LOADER_GBPS: Columns = Columns::One("GB/s (steady median)");
const LOADER_MEMORY: &[(&str, Pick)] = &[("mode", Pick::Is(LOADER_MEMORY_ROW))];
const LOADER_CORES: Columns = Columns::One("CPU cores busy");

const COLD_CUDA_HOST_ALLOC: Reference = Reference::Same(
    "`cudaHostAlloc`",
    read(
        "alloc",
        &[
            ("memory", Pick::Is("cudaHostAlloc")),
            ("size", Pick::Is("1 GiB")),
        ],
        Columns::One("allocate ms/GiB"),
    ),
    "ms",
    0,
);
const STAGED_UP_1G: &[(&str, Pick)] =
    &[("direction", Pick::Is("H2D")), ("size", Pick::Is("1 GiB"))];
const STAGED_DOWN_1G: &[(&str, Pick)] =
    &[("direction", Pick::Is("D2H")), ("size", Pick::Is("1 GiB"))];
const STAGED_UP_16M_256M: &[(&str, Pick)] = &[
    ("direction", Pick::Is("H2D")),
    ("size", Pick::SizeIn(16 * MIB, 256 * MIB)),
];
const LOADER_CUDARC: &[(&str, Pick)] = &[(
    "mode",
    Pick::Is("host collate, 8 workers, cudarc step, no unsafe (alternating)"),
)];
const LOADER_RAW_STEP: &[(&str, Pick)] = &[(
    "mode",
    Pick::Is("host collate, 8 workers, raw-address step (alternating)"),
)];
const LOADER_SPREAD: Columns = Columns::Spread("steady b/s min", "median", "max");
const LOADER_CONTIGUOUS: &[(&str, Pick)] = &[(
    "mode",
    Pick::Is("one contiguous copy per batch (reference)"),
)];

const CANDLE_SPREAD: Columns = Columns::Spread("min", "median", "max");
const CANDLE_LARGE: Pick = Pick::OneOf(&["large: 205 × 40 MiB", "large: 100 × 10 MiB"]);
const CANDLE_MODEL: Pick = Pick::Is("model-shaped: a 22-layer decoder, 1.1 B parameters");
const CANDLE_RAW_LARGE: &[(&str, Pick)] = &[
    ("path", Pick::Is("pinned-io load (reference)")),
    ("checkpoint", CANDLE_LARGE),
];
const CANDLE_OURS_LARGE: &[(&str, Pick)] = &[
    (
        "path",
        Pick::Is("pinned-candle var_builder, every tensor taken"),
    ),
    ("checkpoint", CANDLE_LARGE),
];
const CANDLE_THEIRS_LARGE: &[(&str, Pick)] = &[
    (
        "path",
        Pick::Is("candle from_mmaped_safetensors, every tensor taken"),
    ),
    ("checkpoint", CANDLE_LARGE),
];
const CANDLE_RAW_MODEL: &[(&str, Pick)] = &[
    ("path", Pick::Is("pinned-io load (reference)")),
    ("checkpoint", CANDLE_MODEL),
];
const CANDLE_OURS_MODEL: &[(&str, Pick)] = &[
    (
        "path",
        Pick::Is("pinned-candle var_builder, every tensor taken"),
    ),
    ("checkpoint", CANDLE_MODEL),
];
const CANDLE_THEIRS_MODEL: &[(&str, Pick)] = &[
    (
        "path",
        Pick::Is("candle from_mmaped_safetensors, every tensor taken"),
    ),
    ("checkpoint", CANDLE_MODEL),
];
const CANDLE_UP_OURS: &[(&str, Pick)] = &[
    ("direction", Pick::Is("H2D")),
    ("size", Pick::Is("1 GiB")),
    ("path", Pick::Is("pinned-candle to_device_staged")),
];
const CANDLE_UP_THEIRS: &[(&str, Pick)] = &[
    ("direction", Pick::Is("H2D")),
    ("size", Pick::Is("1 GiB")),
    ("path", Pick::Is("candle to_device")),
];
const CANDLE_DOWN_OURS: &[(&str, Pick)] = &[
    ("direction", Pick::Is("D2H")),
    ("size", Pick::Is("1 GiB")),
    ("path", Pick::Is("pinned-candle to_device_staged")),
];
const CANDLE_DOWN_THEIRS: &[(&str, Pick)] = &[
    ("direction", Pick::Is("D2H")),
    ("size", Pick::Is("1 GiB")),
    ("path", Pick::Is("candle to_device")),
];
const CANDLE_LOADER_OURS: &[(&str, Pick)] = &[(
    "path",
    Pick::Is("pinned-candle TensorLoader: uploads into candle's tensors"),
)];
const CANDLE_LOADER_DEVICE: &[(&str, Pick)] = &[(
    "path",
    Pick::Is(
        "pinned-loader DeviceLoader, host collate (reference: the loader's own device memory)",
    ),
)];
