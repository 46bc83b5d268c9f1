//! `pinned-bench`: what page-locked memory buys on this machine.

mod host;
mod info;

use std::process::ExitCode;

const USAGE: &str = "\
usage: pinned-bench [SUBCOMMAND]

subcommands:
  info     the CUDA runtime, driver and devices found, and the host's memory facts
  help     this message
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("info") if args.len() <= 1 => {
            print!("{}", info::report());
            ExitCode::SUCCESS
        }
        Some("help" | "--help" | "-h") => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("pinned-bench: unexpected arguments {args:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
