//! `pinned-bench`: what page-locked memory buys on this machine — copy bandwidth per kind of
//! memory, what getting pinned memory costs, and the caching pool — like NVIDIA's
//! bandwidthTest, with allocation too.

mod alloc;
mod bandwidth;
mod devices;
mod host;
mod info;
mod loader;
mod memcpy;
mod plot;
mod pool;
mod progress;
mod report;
mod staged;

use std::process::ExitCode;

use progress::Progress;
use report::Report;

const USAGE: &str = "\
usage: pinned-bench [SUBCOMMAND] [--quick] [--json] [--plot FILE.svg]

subcommands:
  all        everything this machine supports (the default)
  info       the CUDA runtime, driver and devices found, and the host's memory facts
  bandwidth  H2D, D2H and both at once, 4 KiB to 1 GiB, per kind of memory, against raw CUDA;
             then the staged rows
  devices    each GPU's H2D bandwidth alone and all GPUs at once; each GPU from each NUMA node
  staged     copies from ordinary memory through the staging ring, against the driver's path
             and page-locked memory; a sweep of chunk sizes and thread counts
  alloc      cost of getting pinned memory per kind and size; another thread's stall
  pool       the caching pool: warm latency, threads, memory waste
  loader     the data loader: batches/s to the GPU by workers, device gather
  help       this message

options:
  --quick          a short run (fewer sizes and repetitions)
  --json           print one JSON document instead of tables
  --plot FILE.svg  also draw bandwidth and allocation latency against size
";

#[derive(Debug, PartialEq, Eq)]
struct Options {
    command: String,
    quick: bool,
    json: bool,
    plot: Option<String>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        command: "all".into(),
        quick: false,
        json: false,
        plot: None,
    };
    let mut command = None;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--json" => options.json = true,
            "--plot" => options.plot = Some(rest.next().ok_or("--plot needs a file name")?.clone()),
            "-h" | "--help" => command = Some("help".to_owned()),
            flag if flag.starts_with('-') => return Err(format!("unknown option {flag}")),
            name => {
                if command.is_some() {
                    return Err(format!("unexpected argument {name}"));
                }
                if ![
                    "all",
                    "info",
                    "bandwidth",
                    "devices",
                    "staged",
                    "alloc",
                    "pool",
                    "loader",
                    "help",
                ]
                .contains(&name)
                {
                    return Err(format!("unknown subcommand {name}"));
                }
                command = Some(name.to_owned());
            }
        }
    }
    if let Some(command) = command {
        options.command = command;
    }
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("pinned-bench: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if options.command == "help" {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let report = run(&options);
    if options.json {
        print!("{}", report.to_json());
    } else {
        if options.command != "info" {
            println!(
                "pinned-bench {}{}",
                options.command,
                if options.quick { " --quick" } else { "" }
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
    if let Some(path) = &options.plot {
        if let Err(e) = std::fs::write(path, plot::svg(&report)) {
            eprintln!("pinned-bench: cannot write {path}: {e}");
            return ExitCode::FAILURE;
        }
        if !options.json {
            println!("\nplot written to {path}");
        }
    }
    ExitCode::SUCCESS
}

fn run(options: &Options) -> Report {
    let mut report = Report {
        machine: info::facts(),
        ..Report::default()
    };
    if options.command == "info" {
        return report;
    }
    let cuda = cuda_pinned::is_available();
    let (all, command) = (options.command == "all", options.command.as_str());
    let mut steps = 0;
    if (all || command == "bandwidth") && cuda {
        steps += bandwidth::steps(options.quick);
    }
    let gpus = cuda_pinned::device_count().unwrap_or(0);
    if (all || command == "devices") && cuda {
        steps += devices::steps(gpus, host::online_numa_nodes().len());
    }
    let staged = all || command == "bandwidth" || command == "staged";
    if staged && cuda {
        steps += staged::steps(options.quick);
    }
    if all || command == "alloc" {
        steps += alloc::steps(options.quick, cuda);
    }
    if all || command == "pool" {
        steps += pool::steps();
    }
    if all && !cuda {
        steps += memcpy::steps();
    }
    if all || command == "loader" {
        steps += loader::steps(cuda);
    }
    let mut progress = Progress::new(steps);
    if !cuda && (staged || command == "alloc" || command == "devices") {
        let why = match cuda_pinned::device_count() {
            Ok(_) => "the CUDA runtime found no device".to_owned(),
            Err(cuda_pinned::Error::Unavailable(cuda_pinned::LoadError::NotFound { attempts })) => {
                format!(
                    "the CUDA runtime (libcudart) was not found in {} places (listed above)",
                    attempts.len()
                )
            }
            Err(e) => e.to_string(),
        };
        report.skipped.push(format!("GPU parts skipped: {why}"));
    }
    if (all || command == "bandwidth") && cuda {
        match bandwidth::run(options.quick, &mut progress) {
            Ok(section) => report.sections.push(section),
            Err(e) => report.skipped.push(format!("bandwidth failed: {e}")),
        }
    }
    if (all || command == "devices") && cuda {
        match devices::run(options.quick, &mut progress) {
            Ok(section) => report.sections.push(section),
            Err(e) => report.skipped.push(format!("devices failed: {e}")),
        }
    }
    if staged && cuda {
        match staged::run(options.quick, &mut progress) {
            Ok(section) => report.sections.push(section),
            Err(e) => report.skipped.push(format!("staged copies failed: {e}")),
        }
    }
    if all || command == "alloc" {
        report
            .sections
            .extend(alloc::run(options.quick, cuda, &mut progress));
    }
    if all && !cuda {
        report
            .sections
            .push(memcpy::run(options.quick, &mut progress));
    }
    if all || command == "pool" {
        report
            .sections
            .extend(pool::run(options.quick, &mut progress));
    }
    if all || command == "loader" {
        report
            .sections
            .extend(loader::run(options.quick, &mut progress));
    }
    progress.finish();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn parses_subcommands_and_options() {
        let o = parse(&args(&["pool", "--quick", "--plot", "x.svg"])).unwrap();
        assert_eq!(
            o,
            Options {
                command: "pool".into(),
                quick: true,
                json: false,
                plot: Some("x.svg".into())
            }
        );
        assert_eq!(parse(&[]).unwrap().command, "all");
        assert!(parse(&args(&["--json"])).unwrap().json);
    }

    #[test]
    fn rejects_bad_arguments() {
        assert!(
            parse(&args(&["bogus"]))
                .unwrap_err()
                .contains("unknown subcommand")
        );
        assert!(parse(&args(&["--plot"])).unwrap_err().contains("file name"));
        assert!(
            parse(&args(&["--fast"]))
                .unwrap_err()
                .contains("unknown option")
        );
        assert!(
            parse(&args(&["pool", "alloc"]))
                .unwrap_err()
                .contains("unexpected")
        );
    }
}
