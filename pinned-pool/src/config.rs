//! Pool configuration: a builder, and the `CUDA_PINNED_POOL_CONF` environment variable in the
//! style of `PYTORCH_ALLOC_CONF` (`key:value,key:value`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The environment variable [`PoolConfig::from_env`] reads.
pub const POOL_CONF_VAR: &str = "CUDA_PINNED_POOL_CONF";

/// How a pool behaves. Every cap is off by default, like PyTorch's allocator; what is on is
/// the machine's own guard: the pool pins nothing that would leave less than 5% of the
/// machine's memory available, and gives its idle cache back when tasks stalled for memory
/// 10% of the last minute ([`keep_available`](Self::keep_available),
/// [`release_under_pressure`](Self::release_under_pressure)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub(crate) max_cached_bytes: Option<usize>,
    pub(crate) max_pinned_bytes: Option<usize>,
    pub(crate) max_block_cached_bytes: Option<usize>,
    pub(crate) idle_release: Option<Duration>,
    /// Blocks to keep pinned ahead of need: `(block bytes, blocks)` per size.
    pub(crate) reserve: Vec<(usize, usize)>,
    /// The share of the machine's memory kept available, in millionths (0: no guard).
    pub(crate) keep_available_ppm: u32,
    /// The share of the last minute tasks stalled for memory from which idle cache is given
    /// back, in hundredths of a percent (0: never).
    pub(crate) release_stall: u32,
    /// Where `meminfo` and `pressure/memory` are read (`/proc` when `None`).
    pub(crate) memory_files: Option<PathBuf>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_cached_bytes: None,
            max_pinned_bytes: None,
            max_block_cached_bytes: None,
            idle_release: None,
            reserve: Vec::new(),
            keep_available_ppm: 50_000,
            release_stall: 1_000,
            memory_files: None,
        }
    }
}

/// What is wrong with a configuration string.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// An entry is not `key:value`.
    Malformed {
        /// The entry.
        entry: String,
    },
    /// A key the pool does not know.
    UnknownKey {
        /// The key.
        key: String,
    },
    /// A value that does not parse for its key.
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What the key takes.
        expected: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Malformed { entry } => write!(f, "{POOL_CONF_VAR}: {entry:?} is not key:value"),
            Self::UnknownKey { key } => write!(
                f,
                "{POOL_CONF_VAR}: unknown key {key:?}; known keys: {}",
                KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
            ),
            Self::BadValue {
                key,
                value,
                expected,
            } => {
                write!(f, "{POOL_CONF_VAR}: {key}:{value} — expected {expected}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Keys of the configuration string and what their values are.
const KEYS: &[(&str, &str)] = &[
    ("max_cached_mb", "idle bytes kept for reuse, in MiB"),
    ("max_pinned_mb", "total pinned bytes, in MiB"),
    (
        "max_block_cached_mb",
        "blocks above this size are released instead of cached, in MiB",
    ),
    (
        "idle_release_ms",
        "blocks idle longer than this are released, in milliseconds",
    ),
    (
        "reserve_mb",
        "blocks kept pinned ahead of need, as MiBxCOUNT (16x64: 64 blocks of 16 MiB); once per size",
    ),
    (
        "keep_available_percent",
        "the share of the machine's memory pinning must leave available, in percent (0: off)",
    ),
    (
        "release_stall_percent",
        "idle cache is given back when tasks stalled for memory this share of the last minute, \
         in percent (0: never)",
    ),
];

impl PoolConfig {
    /// The defaults: no caps; 5% of the machine's memory kept available, idle cache given back
    /// under sustained memory pressure.
    pub fn new() -> Self {
        Self::default()
    }

    /// Caps idle cached bytes: freeing beyond it releases idle blocks, oldest first.
    pub fn max_cached_bytes(mut self, bytes: usize) -> Self {
        self.max_cached_bytes = Some(bytes);
        self
    }

    /// Caps the bytes pinned by the pool (in use, pending and cached).
    ///
    /// An allocation that would pass it first releases idle cache, then fails with
    /// [`Error::LimitExceeded`](cuda_pinned::Error::LimitExceeded).
    pub fn max_pinned_bytes(mut self, bytes: usize) -> Self {
        self.max_pinned_bytes = Some(bytes);
        self
    }

    /// Blocks larger than this are given back to the system when freed instead of cached
    /// (PyTorch's `pinned_max_cached_size_mb`).
    pub fn max_block_cached_bytes(mut self, bytes: usize) -> Self {
        self.max_block_cached_bytes = Some(bytes);
        self
    }

    /// Releases blocks idle for longer than `after` (checked when the pool takes its slow
    /// path, and by [`Pool::release_idle`](crate::Pool::release_idle)).
    pub fn idle_release(mut self, after: Duration) -> Self {
        self.idle_release = Some(after);
        self
    }

    /// Keeps `blocks` blocks of `block_bytes` pinned ahead of need (see `Pool::reserve`).
    ///
    /// The pool's reserve thread pins them (see [`Pool::reserve`](crate::Pool::reserve)), like
    /// PyTorch's `pinned_reserve_segment_size_mb`; give it once per size class (a later size of the
    /// same class replaces an earlier one). Pools made by
    /// [`Pool::with_config`](crate::Pool::with_config) and
    /// [`Pool::from_env`](crate::Pool::from_env) start it at once; others when
    /// [`Pool::start_configured_reserve`](crate::Pool::start_configured_reserve) is called.
    pub fn reserve(mut self, block_bytes: usize, blocks: usize) -> Self {
        // One entry per size class: a later size of the same class replaces an earlier one.
        let class = |bytes| crate::size_class::class_of(bytes).map(|(class, _)| class);
        self.reserve
            .retain(|&(bytes, _)| bytes != block_bytes && class(bytes) != class(block_bytes));
        self.reserve.push((block_bytes, blocks));
        self
    }

    /// Refuses to pin memory that would leave less than `share` (0 to 1) of the machine's memory
    /// available (the kernel's `MemAvailable`), after giving idle cache back: the allocation
    /// fails with [`Error::MemoryPressure`](cuda_pinned::Error::MemoryPressure), which says how
    /// much this pool holds. 0 turns the guard off; the default is 0.05.
    ///
    /// Pinned pages can never be swapped out or reclaimed: workers × prefetch × batch bytes
    /// pinned on a machine already short of memory make the rest of it swap, or the kernel
    /// kill a process.
    ///
    /// In a container, the memory counted is what its cgroup's limit allows (see
    /// [`memory_files`](Self::memory_files)).
    ///
    /// # Panics
    ///
    /// When `share` is NaN (which would turn the guard off unnoticed).
    #[track_caller]
    pub fn keep_available(mut self, share: f64) -> Self {
        assert!(
            !share.is_nan(),
            "PoolConfig::keep_available: the share is NaN"
        );
        self.keep_available_ppm = (share.clamp(0.0, 1.0) * 1e6).round() as u32;
        self
    }

    /// Gives idle cached blocks back to the system when tasks stalled for memory at least
    /// `percent` of the last minute (the `some avg60` of `/proc/pressure/memory`, where the
    /// kernel has pressure stall information), looked at no more than once a second as the pool
    /// pins new memory and by [`Pool::relieve_pressure`](crate::Pool::relieve_pressure). 0
    /// turns it off; the default is 10.
    ///
    /// # Panics
    ///
    /// When `percent` is NaN.
    #[track_caller]
    pub fn release_under_pressure(mut self, percent: f64) -> Self {
        assert!(
            !percent.is_nan(),
            "PoolConfig::release_under_pressure: the percentage is NaN"
        );
        self.release_stall = (percent.clamp(0.0, 100.0) * 100.0).round() as u32;
        self
    }

    /// Reads the machine's memory from `dir/meminfo` and `dir/pressure/memory` instead of
    /// `/proc`'s, and the process's memory cgroups as `dir/self/cgroup` names them, under
    /// `dir/cgroup` instead of `/sys/fs/cgroup` (another view of the machine, or a test's).
    ///
    /// By default the cgroups' limits (a container's: Kubernetes, Docker, a Slurm job) cap
    /// the machine's figures: the pool counts only the memory the process may use.
    pub fn memory_files(mut self, dir: impl AsRef<Path>) -> Self {
        self.memory_files = Some(dir.as_ref().to_owned());
        self
    }

    /// Parses `key:value,key:value` (whitespace around entries is ignored).
    ///
    /// Keys: `max_cached_mb`, `max_pinned_mb`, `max_block_cached_mb`, `idle_release_ms`,
    /// `reserve_mb` as `MiBxCOUNT` (`reserve_mb:16x64` keeps 64 blocks of 16 MiB ready; once
    /// per size), `keep_available_percent` and `release_stall_percent`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the first malformed entry, unknown key or bad value.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (key, value) = entry
                .split_once(':')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| ConfigError::Malformed {
                    entry: entry.to_owned(),
                })?;
            let number = |expected| {
                value.parse::<u64>().map_err(|_| ConfigError::BadValue {
                    key: key.to_owned(),
                    value: value.to_owned(),
                    expected,
                })
            };
            let mib = |expected| -> Result<usize, ConfigError> {
                number(expected)?
                    .checked_mul(1 << 20)
                    .and_then(|b| usize::try_from(b).ok())
                    .ok_or(ConfigError::BadValue {
                        key: key.to_owned(),
                        value: value.to_owned(),
                        expected,
                    })
            };
            match key {
                "max_cached_mb" => config.max_cached_bytes = Some(mib("a whole number of MiB")?),
                "max_pinned_mb" => config.max_pinned_bytes = Some(mib("a whole number of MiB")?),
                "max_block_cached_mb" => {
                    config.max_block_cached_bytes = Some(mib("a whole number of MiB")?)
                }
                "idle_release_ms" => {
                    config.idle_release = Some(Duration::from_millis(number(
                        "a whole number of milliseconds",
                    )?))
                }
                "keep_available_percent" | "release_stall_percent" => {
                    let percent = value
                        .parse::<f64>()
                        .ok()
                        .filter(|p| (0.0..=100.0).contains(p))
                        .ok_or_else(|| ConfigError::BadValue {
                            key: key.to_owned(),
                            value: value.to_owned(),
                            expected: "a percentage from 0 to 100",
                        })?;
                    config = if key == "keep_available_percent" {
                        config.keep_available(percent / 100.0)
                    } else {
                        config.release_under_pressure(percent)
                    };
                }
                "reserve_mb" => {
                    let expected = "MiBxCOUNT, such as 16x64, with a block size the pool has";
                    let bad = || ConfigError::BadValue {
                        key: key.to_owned(),
                        value: value.to_owned(),
                        expected,
                    };
                    let (size, count) = value.split_once('x').ok_or_else(bad)?;
                    let bytes = size
                        .trim()
                        .parse::<usize>()
                        .ok()
                        .and_then(|mib| mib.checked_mul(1 << 20))
                        .filter(|&bytes| bytes > 0 && crate::size_class::class_of(bytes).is_some())
                        .ok_or_else(bad)?;
                    let blocks = count.trim().parse::<usize>().map_err(|_| bad())?;
                    config = config.reserve(bytes, blocks);
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        key: key.to_owned(),
                    });
                }
            }
        }
        Ok(config)
    }

    /// The configuration in [`POOL_CONF_VAR`], or the defaults when it is unset or empty.
    ///
    /// # Errors
    ///
    /// As [`parse`](Self::parse).
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(POOL_CONF_VAR) {
            Ok(text) => Self::parse(&text),
            Err(_) => Ok(Self::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let config = PoolConfig::parse(
            " max_cached_mb:64, max_pinned_mb:1024,max_block_cached_mb:8,idle_release_ms:1500 ",
        )
        .unwrap();
        assert_eq!(config.max_cached_bytes, Some(64 << 20));
        assert_eq!(config.max_pinned_bytes, Some(1 << 30));
        assert_eq!(config.max_block_cached_bytes, Some(8 << 20));
        assert_eq!(config.idle_release, Some(Duration::from_millis(1500)));
        assert_eq!(PoolConfig::parse("").unwrap(), PoolConfig::default());
        let config =
            PoolConfig::parse("reserve_mb:16x64, reserve_mb:2x8, reserve_mb:16x4").unwrap();
        assert_eq!(config.reserve, [(2 << 20, 8), (16 << 20, 4)]);
        let config =
            PoolConfig::parse("keep_available_percent:12.5,release_stall_percent:0").unwrap();
        assert_eq!(
            (config.keep_available_ppm, config.release_stall),
            (125_000, 0)
        );
        let defaults = PoolConfig::default();
        assert_eq!(
            (defaults.keep_available_ppm, defaults.release_stall),
            (50_000, 1_000)
        );
        assert!(matches!(
            PoolConfig::parse("keep_available_percent:101"),
            Err(ConfigError::BadValue { .. })
        ));
    }

    #[test]
    #[should_panic(expected = "the share is NaN")]
    fn a_nan_share_is_refused_not_taken_as_no_guard() {
        let _ = PoolConfig::new().keep_available(f64::NAN);
    }

    #[test]
    fn a_nan_percentage_is_refused_in_text_and_in_code() {
        for key in ["keep_available_percent", "release_stall_percent"] {
            let error = PoolConfig::parse(&format!("{key}:NaN")).unwrap_err();
            assert!(matches!(error, ConfigError::BadValue { .. }), "{error}");
        }
        let refused =
            std::panic::catch_unwind(|| PoolConfig::new().release_under_pressure(f64::NAN));
        assert!(refused.is_err());
    }

    #[test]
    fn reports_what_is_wrong() {
        assert_eq!(
            PoolConfig::parse("max_cached_mb:64,colour:blue"),
            Err(ConfigError::UnknownKey {
                key: "colour".into()
            })
        );
        assert!(matches!(
            PoolConfig::parse("max_pinned_mb:lots"),
            Err(ConfigError::BadValue { key, .. }) if key == "max_pinned_mb"
        ));
        assert!(matches!(
            PoolConfig::parse("idle_release_ms:-1"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            PoolConfig::parse("max_cached_mb"),
            Err(ConfigError::Malformed { .. })
        ));
        for bad in [
            "reserve_mb:16",
            "reserve_mb:x4",
            "reserve_mb:16xmany",
            "reserve_mb:999999999x1",
        ] {
            assert!(
                matches!(PoolConfig::parse(bad), Err(ConfigError::BadValue { .. })),
                "{bad}"
            );
        }
        let text = PoolConfig::parse("nope:1").unwrap_err().to_string();
        assert!(text.contains("known keys: max_cached_mb"), "{text}");
    }
}
