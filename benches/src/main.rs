//! `pinned-bench`: what page-locked memory buys on this machine — copy bandwidth per kind of
//! memory, what getting pinned memory costs, and the caching pool — like NVIDIA's
//! bandwidthTest, with allocation too.

mod alloc;
mod bandwidth;
mod devices;
mod files;
mod host;
mod info;
mod loader;
mod memcpy;
mod pool;
mod progress;
mod staged;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pinned_bench::{context, plot, report, results, stats};
use progress::Progress;
use report::Report;

/// What page-locked memory buys on this machine: copies, allocation, the pool.
#[derive(Debug, Parser, PartialEq, Eq)]
#[command(name = "pinned-bench", version)]
struct Options {
    /// What to measure (everything this machine supports by default).
    #[command(subcommand)]
    command: Option<Command>,
    /// A short run (fewer sizes and repetitions).
    #[arg(long, global = true)]
    quick: bool,
    /// Print one JSON document instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Also draw bandwidth and allocation latency against size, as SVG.
    #[arg(long, global = true, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Also write the JSON record to DIR/<date>-<gpu>-<commit>[-<command>].json.
    #[arg(long, global = true, value_name = "DIR")]
    record: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Eq, Subcommand)]
enum Command {
    /// Everything this machine supports but `files` (the default).
    All,
    /// The CUDA runtime, driver and devices found, and the host's memory facts.
    Info,
    /// H2D, D2H and both at once, 4 KiB to 1 GiB, per kind of memory, against raw CUDA; then
    /// the staged rows.
    Bandwidth,
    /// Each GPU's H2D bandwidth alone and all GPUs at once; each GPU from each NUMA node.
    Devices,
    /// Copies from ordinary memory through the staging ring, against the driver's path and
    /// page-locked memory; a sweep of chunk sizes and thread counts.
    Staged,
    /// Cost of getting pinned memory per kind and size; another thread's stall.
    Alloc,
    /// The caching pool: warm latency, threads, memory waste.
    Pool,
    /// The data loader: batches/s to the GPU by workers, device gather.
    Loader {
        /// Also trace one run (host collate, 8 workers, 300 batches) into FILE, a Chrome
        /// trace (open it at ui.perfetto.dev or chrome://tracing).
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
    },
    /// Safetensors checkpoints from a file to the GPU, warm and cold, against the disk's
    /// ceiling, an mmap, a `Vec` and PyTorch.
    Files {
        /// Where the checkpoints are written (on the disk to measure).
        #[arg(long, value_name = "DIR", default_value_os_t = std::env::temp_dir())]
        dir: PathBuf,
    },
    /// Writes benches/RESULTS.md, benches/RESULTS.svg and the README's figures from a record.
    Results {
        /// The records (JSON written by --record): the sections of a later one replace those
        /// of the same name in an earlier one (`pinned-bench` and `pinned-bench files` make
        /// two).
        #[arg(required = true)]
        records: Vec<PathBuf>,
        /// The workspace to write into (the one this tool was built from by default).
        #[arg(long, value_name = "DIR")]
        root: Option<PathBuf>,
    },
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Info => "info",
            Self::Bandwidth => "bandwidth",
            Self::Devices => "devices",
            Self::Staged => "staged",
            Self::Alloc => "alloc",
            Self::Pool => "pool",
            Self::Loader { .. } => "loader",
            Self::Files { .. } => "files",
            Self::Results { .. } => "results",
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let options = Options::parse_from(&args);
    if let Some(Command::Results { records, root }) = &options.command {
        return write_results(records, root.as_ref());
    }
    let command = options.command.as_ref().unwrap_or(&Command::All).name();
    let files_dir = match &options.command {
        Some(Command::Files { dir }) => dir.clone(),
        _ => std::env::temp_dir(),
    };
    let trace = match &options.command {
        Some(Command::Loader { trace }) => trace.clone(),
        _ => None,
    };
    let mut report = run(command, options.quick, &files_dir, trace.as_deref());
    report.date = context::today();
    report.commit = context::COMMIT.to_owned();
    report.command = context::command_line(&args);
    if options.json {
        print!("{}", report.to_json());
    } else {
        print_tables(&report, command, options.quick);
    }
    write_files(&options, &report, command)
}

/// The `results` subcommand, which measures nothing: writes the results files from `records`.
fn write_results(records: &[PathBuf], root: Option<&PathBuf>) -> ExitCode {
    let root = root
        .cloned()
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    match results::write(records, &root) {
        Ok(()) => {
            let names: Vec<_> = records.iter().map(|r| r.display().to_string()).collect();
            println!(
                "RESULTS.md, RESULTS.svg and the README's figures written from {}",
                names.join(" and ")
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pinned-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The report as text tables (what is printed without `--json`).
fn print_tables(report: &Report, command: &str, quick: bool) {
    if command != "info" {
        println!(
            "pinned-bench {command}{}",
            if quick { " --quick" } else { "" }
        );
    }
    print!("{}", info::render(&report.machine));
    for section in &report.sections {
        print!("{}", section.render());
    }
    for skipped in &report.skipped {
        println!("\n{skipped}");
    }
}

/// Writes the plot and the record where `--plot` and `--record` ask, after the report is
/// printed; the exit status says whether they could be written.
fn write_files(options: &Options, report: &Report, command: &str) -> ExitCode {
    if let Some(path) = &options.plot {
        if let Err(e) = std::fs::write(path, plot::svg(report)) {
            eprintln!(
                "pinned-bench: cannot write {}: {e}",
                path.display(),
                e = cuda_pinned::ErrorChain(&e)
            );
            return ExitCode::FAILURE;
        }
        if !options.json {
            println!("\nplot written to {}", path.display());
        }
    }
    if let Some(dir) = &options.record {
        let path = context::record_path(dir, &context::record_name(report, command));
        if let Err(e) =
            std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, report.to_json()))
        {
            eprintln!(
                "pinned-bench: cannot write {}: {e}",
                path.display(),
                e = cuda_pinned::ErrorChain(&e)
            );
            return ExitCode::FAILURE;
        }
        if !options.json {
            println!("\nrecord written to {}", path.display());
        }
    }
    ExitCode::SUCCESS
}

fn run(command: &str, quick: bool, files_dir: &Path, trace: Option<&Path>) -> Report {
    let mut report = Report {
        machine: info::facts(),
        ..Report::default()
    };
    if command == "info" {
        return report;
    }
    let cuda = cuda_pinned::is_available();
    let all = command == "all";
    let staged = all || command == "bandwidth" || command == "staged";
    let mut progress = Progress::new(steps(command, quick, cuda, trace));
    if !cuda && (staged || command == "alloc" || command == "devices") {
        let why = why_no_gpu();
        report.skipped.push(format!("GPU parts skipped: {why}"));
    }
    if (all || command == "bandwidth") && cuda {
        match bandwidth::run(quick, &mut progress) {
            Ok(section) => report.sections.push(section),
            Err(e) => report.skipped.push(format!(
                "bandwidth failed: {e}",
                e = cuda_pinned::ErrorChain(&e)
            )),
        }
    }
    if (all || command == "devices") && cuda {
        match devices::run(quick, &mut progress) {
            Ok(section) => report.sections.push(section),
            Err(e) => report.skipped.push(format!(
                "devices failed: {e}",
                e = cuda_pinned::ErrorChain(&e)
            )),
        }
    }
    if staged && cuda {
        match staged::run(quick, &mut progress) {
            Ok(section) => report.sections.push(section),
            Err(e) => report.skipped.push(format!(
                "staged copies failed: {e}",
                e = cuda_pinned::ErrorChain(&e)
            )),
        }
    }
    if all || command == "alloc" {
        report
            .sections
            .extend(alloc::run(quick, cuda, &mut progress));
    }
    if all && !cuda {
        report.sections.push(memcpy::run(quick, &mut progress));
    }
    if all || command == "pool" {
        report.sections.extend(pool::run(quick, &mut progress));
    }
    if all || command == "loader" {
        report
            .sections
            .extend(loader::run(quick, trace, &mut progress));
    }
    // Not part of `all`: it writes checkpoints of several GiB, and drops the page cache.
    if command == "files" && cuda {
        match files::run(quick, files_dir, &mut progress) {
            Ok(sections) => report.sections.extend(sections),
            Err(e) => report.skipped.push(format!("files failed: {e}")),
        }
    }
    progress.finish();
    report
}

/// Work items `command` will run, for the progress bar, counted before anything runs.
fn steps(command: &str, quick: bool, cuda: bool, trace: Option<&Path>) -> usize {
    let all = command == "all";
    let mut steps = 0;
    if (all || command == "bandwidth") && cuda {
        steps += bandwidth::steps(quick);
    }
    let gpus = cuda_pinned::device_count().unwrap_or(0);
    if (all || command == "devices") && cuda {
        steps += devices::steps(gpus, host::online_numa_nodes().len());
    }
    let staged = all || command == "bandwidth" || command == "staged";
    if staged && cuda {
        steps += staged::steps(quick);
    }
    if command == "files" && cuda {
        steps += files::steps();
    }
    if all || command == "alloc" {
        steps += alloc::steps(quick, cuda);
    }
    if all || command == "pool" {
        steps += pool::steps();
    }
    if all && !cuda {
        steps += memcpy::steps();
    }
    if all || command == "loader" {
        steps += loader::steps(cuda, trace.is_some());
    }
    steps
}

/// Why the GPU parts are skipped, in words, for the report's skipped list.
fn why_no_gpu() -> String {
    match cuda_pinned::device_count() {
        Ok(_) => "the CUDA runtime found no device".to_owned(),
        Err(cuda_pinned::Error::Unavailable(cuda_pinned::LoadError::NotFound { attempts })) => {
            format!(
                "the CUDA runtime (libcudart) was not found in {} places (listed above)",
                attempts.len()
            )
        }
        Err(e) => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from(["pinned-bench"].iter().chain(args))
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Options::command().debug_assert();
    }

    #[test]
    fn parses_subcommands_and_options() {
        let o = parse(&["pool", "--quick", "--plot", "x.svg"]).unwrap();
        assert_eq!(
            o,
            Options {
                command: Some(Command::Pool),
                quick: true,
                json: false,
                plot: Some("x.svg".into()),
                record: None,
            }
        );
        assert_eq!(parse(&[]).unwrap().command, None);
        assert!(parse(&["--json"]).unwrap().json);
        let o = parse(&["--record", "benches/results", "loader"]).unwrap();
        assert_eq!(o.record, Some("benches/results".into()));
        assert_eq!(o.command, Some(Command::Loader { trace: None }));
        let o = parse(&["loader", "--trace", "loader.json"]).unwrap();
        assert_eq!(
            o.command,
            Some(Command::Loader {
                trace: Some("loader.json".into())
            })
        );
        let o = parse(&["results", "r.json", "files.json"]).unwrap();
        assert_eq!(
            o.command,
            Some(Command::Results {
                records: vec!["r.json".into(), "files.json".into()],
                root: None
            })
        );
        assert!(parse(&["results"]).is_err(), "a record is needed");
        let o = parse(&["files", "--dir", "/data"]).unwrap();
        assert_eq!(
            o.command,
            Some(Command::Files {
                dir: "/data".into()
            })
        );
    }

    #[test]
    fn rejects_bad_arguments() {
        use clap::error::ErrorKind;
        let kind = |args: &[&str]| parse(args).unwrap_err().kind();
        assert_eq!(kind(&["bogus"]), ErrorKind::InvalidSubcommand);
        assert_eq!(kind(&["--plot"]), ErrorKind::InvalidValue);
        assert_eq!(kind(&["--fast"]), ErrorKind::UnknownArgument);
        assert_eq!(kind(&["pool", "alloc"]), ErrorKind::UnknownArgument);
        assert_eq!(kind(&["--help"]), ErrorKind::DisplayHelp);
    }
}
