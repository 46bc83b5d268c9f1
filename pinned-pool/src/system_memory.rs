//! The memory this process may use, as the kernel reports it: how much is available
//! (`MemAvailable` in `/proc/meminfo`, and within the limit of the process's memory cgroup, the
//! container's), and how long tasks stalled waiting for memory (pressure stall information,
//! `/proc/pressure/memory`, where the kernel has it).
//!
//! Pinned memory is memory the machine can never swap or reclaim: a pool that keeps growing
//! under a loader's workers starves everything else on the host, which then swaps or is
//! killed. The pool asks here before it pins more, and gives its idle cache back when the
//! machine has been stalling for memory.
//!
//! In a container (Kubernetes, Docker, a Slurm job's cgroup) the machine's `MemAvailable` can
//! be far above what the container may use, and a process past its cgroup's limit is killed:
//! the cgroup's limit and use (its own and its ancestors', version 2's `memory.max` and
//! `memory.current`, or version 1's `memory.limit_in_bytes` and `memory.usage_in_bytes`) cap
//! both figures. Cache the kernel can drop (`inactive_file` of `memory.stat`) counts as
//! available, as the kernel reclaims it before it kills.

use std::path::{Path, PathBuf};

/// Where the memory files are read: `/proc` and the cgroup file system at `/sys/fs/cgroup`
/// by default; in tests, a directory holding `meminfo`, `pressure/memory`, `self/cgroup`, and
/// the cgroup file system under `cgroup/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SystemMemory {
    root: PathBuf,
    cgroup_fs: PathBuf,
}

impl Default for SystemMemory {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/proc"),
            cgroup_fs: PathBuf::from("/sys/fs/cgroup"),
        }
    }
}

/// The memory this process may use, in bytes.
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

/// One memory cgroup's limit and what it holds that the kernel cannot drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Limit {
    max: u64,
    used: u64,
}

impl SystemMemory {
    pub(crate) fn at(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            cgroup_fs: root.join("cgroup"),
        }
    }

    /// The total and available memory of the machine, each capped by the limits of the
    /// process's memory cgroups; `None` where `meminfo` cannot be read or lacks them.
    pub(crate) fn memory(&self) -> Option<Memory> {
        // Miri isolates the program from the file system (and would stop at the attempt).
        if cfg!(miri) {
            return None;
        }
        let mut memory = parse_meminfo(&std::fs::read_to_string(self.root.join("meminfo")).ok()?)?;
        for dir in self.cgroup_dirs() {
            if let Some(limit) = read_limit(&dir) {
                memory.total = memory.total.min(limit.max);
                memory.available = memory.available.min(limit.max.saturating_sub(limit.used));
            }
        }
        Some(memory)
    }

    /// The folders of the process's memory cgroups, its own first, then each ancestor's up
    /// to the file system's root: a parent's limit binds its children too.
    fn cgroup_dirs(&self) -> Vec<PathBuf> {
        let Ok(text) = std::fs::read_to_string(self.root.join("self/cgroup")) else {
            return Vec::new();
        };
        let mut dirs = Vec::new();
        for (mount, path) in memory_cgroups(&text) {
            let mount = self.cgroup_fs.join(mount);
            let mut dir = mount.join(path.trim_start_matches('/'));
            // In a container whose cgroup is not its own namespace's root, the path is the
            // host's, and the container sees its own cgroup at the mount's root.
            if !dir.is_dir() {
                dir = mount.clone();
            }
            loop {
                dirs.push(dir.clone());
                if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                    break;
                }
            }
        }
        dirs
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

/// The memory cgroups of `/proc/self/cgroup`: the folder under the cgroup file system where
/// each hierarchy is mounted as systems lay it out (`""` for version 2's unified one,
/// `memory` for version 1's), and the process's path in it.
fn memory_cgroups(text: &str) -> Vec<(&'static str, &str)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            if id == "0" && controllers.is_empty() {
                Some(("", path))
            } else if controllers.split(',').any(|c| c == "memory") {
                Some(("memory", path))
            } else {
                None
            }
        })
        .collect()
}

/// The limit of the cgroup at `dir` and its use less what the kernel can drop; `None` where
/// it sets no limit (or its files cannot be read).
fn read_limit(dir: &Path) -> Option<Limit> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let number = |text: Option<String>| text?.trim().parse::<u64>().ok();
    // Version 2 writes "max" for no limit, version 1 a number near 2^63.
    let (max, used) = match read("memory.max") {
        Some(max) => (number(Some(max))?, number(read("memory.current"))?),
        None => (
            number(read("memory.limit_in_bytes"))?,
            number(read("memory.usage_in_bytes"))?,
        ),
    };
    if max >= 1 << 62 {
        return None;
    }
    let droppable = read("memory.stat").map_or(0, |stat| inactive_file(&stat));
    Some(Limit {
        max,
        used: used.saturating_sub(droppable),
    })
}

/// The page cache a cgroup holds that the kernel reclaims first: `inactive_file` of its
/// `memory.stat` (`total_inactive_file` in version 1, counting its children).
fn inactive_file(stat: &str) -> u64 {
    let field = |name: &str| {
        stat.lines().find_map(|line| {
            let (key, value) = line.split_once(' ')?;
            (key == name).then(|| value.trim().parse::<u64>().ok())?
        })
    };
    field("total_inactive_file")
        .or_else(|| field("inactive_file"))
        .unwrap_or(0)
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

    /// A `/proc` of `MemTotal` 64 GiB and `MemAvailable` 48 GiB, and a cgroup file system
    /// under it where the process is in `/kubepods/pod/box`.
    fn fake_proc(cgroup_line: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let write = |path: &str, text: &str| {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write(
            "meminfo",
            "MemTotal: 67108864 kB\nMemAvailable: 50331648 kB\n",
        );
        write("self/cgroup", cgroup_line);
        dir
    }

    const GIB: u64 = 1 << 30;

    fn write_in(root: &Path, cgroup: &str, files: &[(&str, String)]) {
        let dir = root.join("cgroup").join(cgroup);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri isolates the program from the file system")]
    fn a_version_2_cgroup_caps_the_machines_figures_and_its_parents_too() {
        let proc = fake_proc("0::/kubepods/pod/box\n");
        let root = proc.path();
        // The container: 16 GiB, of which 10 used, 3 of them droppable cache.
        write_in(
            root,
            "kubepods/pod/box",
            &[
                ("memory.max", format!("{}\n", 16 * GIB)),
                ("memory.current", format!("{}\n", 10 * GIB)),
                (
                    "memory.stat",
                    format!("anon 1\ninactive_file {}\n", 3 * GIB),
                ),
            ],
        );
        write_in(root, "kubepods/pod", &[("memory.max", "max\n".into())]);
        let memory = SystemMemory::at(root).memory().unwrap();
        assert_eq!(
            memory,
            Memory {
                total: 16 * GIB,
                available: 9 * GIB
            }
        );
        // The pod's limit binds the container too.
        write_in(
            root,
            "kubepods/pod",
            &[
                ("memory.max", format!("{}\n", 12 * GIB)),
                ("memory.current", format!("{}\n", 11 * GIB)),
            ],
        );
        let memory = SystemMemory::at(root).memory().unwrap();
        assert_eq!(
            memory,
            Memory {
                total: 12 * GIB,
                available: GIB
            }
        );
        // So the guard refuses what the machine alone would allow.
        assert!(SystemMemory::at(root).short_for(2 << 30, 50_000).is_some());
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri isolates the program from the file system")]
    fn a_version_1_cgroup_and_a_container_that_sees_its_own_at_the_root() {
        // A host path that the container's mount does not show: its cgroup is the root.
        let proc = fake_proc("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n");
        let root = proc.path();
        write_in(
            root,
            "memory",
            &[
                ("memory.limit_in_bytes", format!("{}\n", 8 * GIB)),
                ("memory.usage_in_bytes", format!("{}\n", 6 * GIB)),
                (
                    "memory.stat",
                    format!("cache 1\ntotal_inactive_file {}\n", GIB),
                ),
            ],
        );
        let memory = SystemMemory::at(root).memory().unwrap();
        assert_eq!(
            memory,
            Memory {
                total: 8 * GIB,
                available: 3 * GIB
            }
        );
        // No limit (version 1's near 2^63): the machine's figures.
        write_in(
            root,
            "memory",
            &[("memory.limit_in_bytes", "9223372036854771712\n".into())],
        );
        let memory = SystemMemory::at(root).memory().unwrap();
        assert_eq!(
            memory,
            Memory {
                total: 64 * GIB,
                available: 48 * GIB
            }
        );
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri isolates the program from the file system")]
    fn unreadable_or_absurd_cgroup_files_leave_the_machines_figures() {
        let proc = fake_proc("0::/box\n");
        let root = proc.path();
        for (max, current) in [("max", "1"), ("-5", "1"), ("16", "lots"), ("", "")] {
            write_in(
                root,
                "box",
                &[
                    ("memory.max", max.into()),
                    ("memory.current", current.into()),
                ],
            );
            let memory = SystemMemory::at(root).memory().unwrap();
            assert_eq!(
                memory,
                Memory {
                    total: 64 * GIB,
                    available: 48 * GIB
                },
                "{max:?}"
            );
        }
        // A use above the limit leaves nothing available, without underflow.
        write_in(
            root,
            "box",
            &[
                ("memory.max", "100".into()),
                ("memory.current", "200".into()),
            ],
        );
        assert_eq!(SystemMemory::at(root).memory().unwrap().available, 0);
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
