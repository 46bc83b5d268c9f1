//! The machine's memory, as the kernel reports it: how much is available (`MemAvailable` in
//! `/proc/meminfo`), and how long tasks stalled waiting for memory (pressure stall information,
//! `/proc/pressure/memory`, where the kernel has it).
//!
//! Pinned memory is memory the machine can never swap or reclaim: a pool that keeps growing
//! under a loader's workers starves everything else on the host, which then swaps or is
//! killed. The pool asks here before it pins more, and gives its idle cache back when the
//! machine has been stalling for memory.

use std::path::{Path, PathBuf};

/// Where the memory files are read: `/proc` by default, another directory holding `meminfo`
/// and `pressure/memory` in tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SystemMemory {
    root: PathBuf,
}

impl Default for SystemMemory {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/proc"),
        }
    }
}

/// The machine's memory in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Memory {
    pub(crate) total: u64,
    pub(crate) available: u64,
}

/// Shares of time (percent) in which some task stalled for memory, averaged over the last
/// 10 and 60 seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Stall {
    pub(crate) avg10: f64,
    pub(crate) avg60: f64,
}

impl SystemMemory {
    pub(crate) fn at(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
        }
    }

    /// The machine's total and available memory; `None` where the file cannot be read or
    /// lacks them.
    pub(crate) fn memory(&self) -> Option<Memory> {
        // Miri isolates the program from the file system (and would stop at the attempt).
        if cfg!(miri) {
            return None;
        }
        parse_meminfo(&std::fs::read_to_string(self.root.join("meminfo")).ok()?)
    }

    /// The machine's memory and the bytes to keep available, where pinning `size` more would
    /// leave less than `keep_ppm` millionths of it available; `None` where it would not, or
    /// the memory cannot be read.
    pub(crate) fn short_for(&self, size: usize, keep_ppm: u32) -> Option<(Memory, u64)> {
        if keep_ppm == 0 {
            return None;
        }
        let memory = self.memory()?;
        let keep = (u128::from(memory.total) * u128::from(keep_ppm) / 1_000_000) as u64;
        let left = memory.available.checked_sub(size as u64);
        left.is_none_or(|left| left < keep)
            .then_some((memory, keep))
    }

    /// How much tasks stalled for memory lately; `None` where the kernel does not say
    /// (no pressure stall information, or a file that cannot be read).
    pub(crate) fn stall(&self) -> Option<Stall> {
        if cfg!(miri) {
            return None;
        }
        parse_pressure(&std::fs::read_to_string(self.root.join("pressure/memory")).ok()?)
    }
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo`, in bytes.
pub(crate) fn parse_meminfo(text: &str) -> Option<Memory> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let mut words = rest.split_whitespace();
            let value: u64 = words.next()?.parse().ok()?;
            match words.next() {
                Some("kB") => value.checked_mul(1024),
                None => Some(value),
                Some(_) => None,
            }
        })
    };
    Some(Memory {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
    })
}

/// The `some` line of `/proc/pressure/memory`:
/// `some avg10=0.00 avg60=0.00 avg300=0.00 total=0`.
pub(crate) fn parse_pressure(text: &str) -> Option<Stall> {
    let line = text.lines().find(|line| line.starts_with("some "))?;
    let value = |key: &str| {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))?
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    Some(Stall {
        avg10: value("avg10")?,
        avg60: value("avg60")?,
    })
}

/// The error of a refusal: `size` more bytes asked of an allocator holding `pinned`.
pub(crate) fn refusal(
    size: usize,
    (memory, keep): (Memory, u64),
    pinner: &'static str,
    pinned: usize,
) -> cuda_pinned::Error {
    tracing::warn!(
        requested = size,
        available = memory.available,
        total = memory.total,
        keep,
        pinned,
        pinner,
        "pinning refused: the machine is short of memory"
    );
    cuda_pinned::Error::MemoryPressure {
        requested: size,
        available: memory.available,
        total: memory.total,
        keep,
        pinner,
        pinned,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_the_kernels_formats() {
        let meminfo =
            "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   16384000 kB\n";
        assert_eq!(
            parse_meminfo(meminfo),
            Some(Memory {
                total: 32_768_000 * 1024,
                available: 16_384_000 * 1024
            })
        );
        assert_eq!(parse_meminfo("MemTotal: 10 kB\n"), None, "no MemAvailable");
        assert_eq!(
            parse_meminfo("MemTotal: 10 MB\nMemAvailable: 5 kB\n"),
            None,
            "unknown unit"
        );
        let pressure = "some avg10=12.50 avg60=3.25 avg300=1.00 total=123456\nfull avg10=1.00 avg60=0.50 avg300=0.10 total=999\n";
        assert_eq!(
            parse_pressure(pressure),
            Some(Stall {
                avg10: 12.5,
                avg60: 3.25
            })
        );
        assert_eq!(parse_pressure("full avg10=1.00 avg60=0.50\n"), None);
        assert_eq!(parse_pressure("some avg10=NaN avg60=1\n"), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri isolates the program from the file system")]
    fn a_directory_without_the_files_says_nothing() {
        let empty = tempfile::tempdir().unwrap();
        let memory = SystemMemory::at(empty.path());
        assert_eq!((memory.memory(), memory.stall()), (None, None));
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: if cfg!(miri) { 4 } else { 256 },
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Whatever the files hold, reading them never panics, and what they say is what was
        /// written.
        #[test]
        fn parsing_never_panics_and_reads_back_what_was_written(
            noise in ".{0,200}",
            total in 0u64..1 << 40,
            available in 0u64..1 << 40,
            avg10 in 0.0f64..100.0,
            avg60 in 0.0f64..100.0,
        ) {
            let _ = parse_meminfo(&noise);
            let _ = parse_pressure(&noise);
            let meminfo = format!("MemTotal: {total} kB\nMemAvailable: {available} kB\n");
            prop_assert_eq!(
                parse_meminfo(&meminfo),
                Some(Memory { total: total * 1024, available: available * 1024 })
            );
            let pressure = format!("some avg10={avg10:.2} avg60={avg60:.2} avg300=0.00 total=1\n");
            let stall = parse_pressure(&pressure).unwrap();
            prop_assert!((stall.avg10 - avg10).abs() < 0.006 && (stall.avg60 - avg60).abs() < 0.006);
        }
    }
}
