//! What a record says about its run besides the figures: the commit, the date, and the name
//! its file takes.

use std::path::{Path, PathBuf};

use crate::report::Report;

/// The commit this tool was built from (`git rev-parse --short=7 HEAD`, `-dirty` when the
/// tree had changes, `unknown` without git).
pub const COMMIT: &str = env!("PINNED_BENCH_COMMIT");

/// Today's date (UTC) as `YYYY-MM-DD`.
pub fn today() -> String {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    date(seconds / 86_400)
}

/// The date `days` after 1970-01-01, as `YYYY-MM-DD` (the proleptic Gregorian calendar).
pub fn date(days: u64) -> String {
    // Howard Hinnant's civil_from_days, for days on or after the epoch.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The first device's name, lowercased, every run of other characters than letters and
/// digits one `-`; `cpu` where the run found no device.
pub fn gpu_slug(report: &Report) -> String {
    let Some((_, name)) = report.machine.iter().find(|(k, _)| k == "device 0") else {
        return "cpu".to_owned();
    };
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    while slug.ends_with('-') {
        slug.pop();
    }
    if slug.is_empty() {
        "cpu".to_owned()
    } else {
        slug
    }
}

/// The file name a record of `report` takes: `<date>-<gpu>-<commit>.json` for a full run,
/// `<date>-<gpu>-<commit>-<command>.json` for one command's sections (`files`, `loader`…), so
/// that records of several commands of one build sit side by side.
pub fn record_name(report: &Report, command: &str) -> String {
    let section = if command == "all" {
        String::new()
    } else {
        format!("-{command}")
    };
    format!(
        "{}-{}-{}{section}.json",
        report.date,
        gpu_slug(report),
        report.commit
    )
}

/// Where a record named `name` goes in `dir`: that name, or, where a record of that name
/// exists already (the same command run twice on one build), the first free
/// `<stem>-2.json`, `<stem>-3.json`…
pub fn record_path(dir: &Path, name: &str) -> PathBuf {
    let stem = name.strip_suffix(".json").unwrap_or(name);
    std::iter::once(dir.join(name))
        .chain((2..).map(|n| dir.join(format!("{stem}-{n}.json"))))
        .find(|path| !path.exists())
        .expect("an unbounded sequence of names has a free one")
}

/// `args` as one line a shell would read back: arguments with spaces or quotes in quotes.
pub fn command_line(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_count_from_the_epoch() {
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(59), "1970-03-01");
        assert_eq!(date(11_016), "2000-02-29");
        assert_eq!(date(20_779), "2026-11-22");
        assert_eq!(today().len(), 10);
    }

    #[test]
    fn records_are_named_by_date_gpu_and_commit() {
        let mut report = Report {
            date: "2026-11-22".into(),
            commit: "1dc3c9a-dirty".into(),
            ..Report::default()
        };
        assert_eq!(
            record_name(&report, "all"),
            "2026-11-22-cpu-1dc3c9a-dirty.json"
        );
        report
            .machine
            .push(("device 0".into(), "NVIDIA H100 80GB HBM3".into()));
        assert_eq!(
            record_name(&report, "all"),
            "2026-11-22-nvidia-h100-80gb-hbm3-1dc3c9a-dirty.json"
        );
        assert_eq!(
            record_name(&report, "files"),
            "2026-11-22-nvidia-h100-80gb-hbm3-1dc3c9a-dirty-files.json"
        );
    }

    #[test]
    fn a_second_record_of_one_name_does_not_replace_the_first() {
        let dir = tempfile::tempdir().expect("a directory");
        let first = record_path(dir.path(), "r.json");
        assert_eq!(first, dir.path().join("r.json"));
        std::fs::write(&first, "{}").expect("written");
        let second = record_path(dir.path(), "r.json");
        assert_eq!(second, dir.path().join("r-2.json"));
        std::fs::write(&second, "{}").expect("written");
        assert_eq!(
            record_path(dir.path(), "r.json"),
            dir.path().join("r-3.json")
        );
    }

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        let args = ["pinned-bench", "--plot", "my plot.svg", "it's"].map(String::from);
        assert_eq!(
            command_line(&args),
            r"pinned-bench --plot 'my plot.svg' 'it'\''s'"
        );
    }
}
