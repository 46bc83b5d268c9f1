//! Finding and opening libcudart at run time.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::bindings::Symbols;

/// The environment variable that names libcudart by full path. When set, it is the only
/// candidate tried, so a wrong path is reported rather than silently replaced by another library.
pub const CUDART_PATH_VAR: &str = "CUDA_PINNED_CUDART";

/// Shared-object names tried through the dynamic linker's own search (`LD_LIBRARY_PATH`, the
/// ldconfig cache, `RUNPATH`), newest first. The unversioned name exists only where a
/// development package is installed.
const SONAMES: &[&str] = &[
    "libcudart.so.13",
    "libcudart.so.12",
    "libcudart.so.11.0",
    "libcudart.so",
];

/// Variables naming a CUDA toolkit root, in the order other CUDA crates read them.
const TOOLKIT_VARS: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_ROOT",
    "CUDA_TOOLKIT_ROOT_DIR",
];

#[cfg(target_arch = "aarch64")]
const TARGET_LIB: &str = "targets/sbsa-linux/lib";
#[cfg(not(target_arch = "aarch64"))]
const TARGET_LIB: &str = "targets/x86_64-linux/lib";

/// The loaded CUDA runtime library.
///
/// Obtained from [`cudart()`]; lives for the rest of the process. Each bound function is a
/// method of the same name returning its function pointer, resolved on first use.
pub struct Cudart {
    library: libloading::Library,
    path: PathBuf,
    pub(crate) symbols: Symbols,
}

impl fmt::Debug for Cudart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cudart")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// One library candidate that was tried, and why it was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// A shared-object name or a full path.
    pub candidate: OsString,
    /// What failed: the dynamic linker's message, or "not present".
    pub reason: String,
}

/// Why the CUDA runtime could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// The file named by [`CUDART_PATH_VAR`] could not be loaded.
    ExplicitPath {
        /// The path from the environment.
        path: PathBuf,
        /// The dynamic linker's message.
        reason: String,
    },
    /// No candidate could be loaded; every one tried is listed in search order.
    NotFound {
        /// Every candidate tried and why it failed.
        attempts: Vec<Attempt>,
    },
    /// The library loaded but does not export a function that was asked for (it is older
    /// than the bindings, or not a real libcudart).
    MissingSymbol {
        /// The symbol looked up.
        symbol: &'static str,
        /// The library it was looked up in.
        library: PathBuf,
    },
    /// The driver does not provide a function asked for through the runtime's entry-point
    /// query (the runtime or the driver is older than the function).
    MissingDriverEntryPoint {
        /// The driver function looked up.
        symbol: &'static str,
        /// Why it is not available.
        reason: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ExplicitPath { path, reason } => write!(
                f,
                "cannot load the CUDA runtime from {} (set by {CUDART_PATH_VAR}): {reason}",
                path.display()
            ),
            Self::NotFound { attempts } => {
                write!(
                    f,
                    "CUDA runtime library (libcudart) not found; set {CUDART_PATH_VAR} to its \
                     full path. Tried {} candidates:",
                    attempts.len()
                )?;
                for attempt in attempts {
                    write!(
                        f,
                        "\n  {}: {}",
                        attempt.candidate.to_string_lossy(),
                        attempt.reason
                    )?;
                }
                Ok(())
            }
            Self::MissingSymbol { symbol, library } => write!(
                f,
                "{} does not export {symbol}: the CUDA runtime is older than this function",
                library.display()
            ),
            Self::MissingDriverEntryPoint { symbol, reason } => {
                write!(
                    f,
                    "the CUDA driver function {symbol} is not available: {reason}"
                )
            }
        }
    }
}

impl std::error::Error for LoadError {}

static CUDART: OnceLock<Result<Cudart, LoadError>> = OnceLock::new();

/// The CUDA runtime, loaded on the first call (thread-safe, once per process).
///
/// Search order: the file named by [`CUDART_PATH_VAR`] (alone, when set); the versioned
/// sonames `libcudart.so.13`, `.so.12`, `.so.11.0` and `libcudart.so` through the dynamic
/// linker; `lib64`, `lib` and `targets/<arch>/lib` under `CUDA_HOME`, `CUDA_PATH`,
/// `CUDA_ROOT` and `CUDA_TOOLKIT_ROOT_DIR`; `/usr/local/cuda/lib64`; the pip wheel layouts
/// (`nvidia/cu13/lib`, `nvidia/cuda_runtime/lib`) under the Python environments in sight
/// (`VIRTUAL_ENV`, `CONDA_PREFIX`, `PYTHONPATH`, the prefixes of `PATH`'s `bin` folders).
///
/// # Errors
///
/// A [`LoadError`] listing every candidate tried; the same error on every later call.
pub fn cudart() -> Result<&'static Cudart, LoadError> {
    CUDART.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Whether the CUDA runtime library can be loaded (it says nothing of devices).
pub fn is_available() -> bool {
    cudart().is_ok()
}

fn load() -> Result<Cudart, LoadError> {
    // Miri cannot run foreign code: there the runtime is absent, as on a machine without CUDA,
    // and the code above takes its CPU-only paths.
    if cfg!(miri) {
        return Err(LoadError::NotFound {
            attempts: vec![Attempt {
                candidate: "libcudart.so".into(),
                reason: "not loaded under Miri, which cannot run foreign code".into(),
            }],
        });
    }
    if let Some(path) = std::env::var_os(CUDART_PATH_VAR).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        return open(path.as_os_str()).map_err(|reason| LoadError::ExplicitPath { path, reason });
    }
    let mut attempts = Vec::new();
    for candidate in candidates() {
        let is_path = Path::new(&candidate).components().count() > 1;
        if is_path && !Path::new(&candidate).exists() {
            attempts.push(Attempt {
                candidate,
                reason: "not present".into(),
            });
            continue;
        }
        match open(&candidate) {
            Ok(cudart) => return Ok(cudart),
            Err(reason) => attempts.push(Attempt { candidate, reason }),
        }
    }
    Err(LoadError::NotFound { attempts })
}

fn open(candidate: &OsStr) -> Result<Cudart, String> {
    // SAFETY: loading runs the library's initialisers. libcudart's only set up its own
    // state; we load it once per process and never unload it (it lives in a static).
    let library = unsafe { libloading::Library::new(candidate) }.map_err(|e| with_sources(&e))?;
    let path = loaded_path(&library).unwrap_or_else(|| PathBuf::from(candidate));
    let cudart = Cudart {
        library,
        path,
        symbols: Symbols::new(),
    };
    // A library without this entry point is not a CUDA runtime (a stub or a stray file).
    cudart
        .cudaGetErrorName()
        .map_err(|_| "not a CUDA runtime (no cudaGetErrorName)".to_owned())?;
    Ok(cudart)
}

/// An error's message followed by those of its sources (libloading keeps dlerror's text in
/// the source).
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text = format!("{text}: {inner}");
        source = inner.source();
    }
    text
}

/// The file the dynamic linker actually opened, found through the address of one of its
/// symbols (a soname says nothing of the directory).
fn loaded_path(library: &libloading::Library) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: the symbol is only used as an address, never called or dereferenced.
    let symbol = unsafe { library.get::<*const libc::c_void>(b"cudaGetErrorName\0") }.ok()?;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: `info` is valid for writes; dladdr only reads the address.
    let found = unsafe { libc::dladdr(*symbol, info.as_mut_ptr()) };
    // SAFETY: zero-initialised and, when dladdr succeeds, filled in.
    let info = unsafe { info.assume_init() };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set dli_fname to a NUL-terminated string owned by the dynamic linker,
    // valid while the library stays loaded; we copy it at once.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(OsStr::from_bytes(name.to_bytes())))
}

/// Every candidate, in search order, without duplicates (the explicit path excepted).
pub fn candidates() -> Vec<OsString> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let mut list: Vec<OsString> = SONAMES.iter().map(OsString::from).collect();
    let versioned = &SONAMES[..3];
    for var in TOOLKIT_VARS {
        if let Some(root) = env(var) {
            for dir in ["lib64", "lib", TARGET_LIB] {
                for name in SONAMES {
                    list.push(Path::new(&root).join(dir).join(name).into_os_string());
                }
            }
        }
    }
    for name in versioned {
        list.push(
            Path::new("/usr/local/cuda/lib64")
                .join(name)
                .into_os_string(),
        );
    }
    for site in python_site_dirs(&env) {
        list.push(
            site.join("nvidia/cu13/lib/libcudart.so.13")
                .into_os_string(),
        );
        for name in &versioned[1..] {
            list.push(
                site.join("nvidia/cuda_runtime/lib")
                    .join(name)
                    .into_os_string(),
            );
        }
    }
    let mut seen = std::collections::HashSet::new();
    list.retain(|c| seen.insert(c.clone()));
    list
}

/// `site-packages` folders of the Python environments a user has in sight.
fn python_site_dirs(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        prefixes.extend(env(var).map(PathBuf::from));
    }
    if let Some(path) = env("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.file_name() == Some(OsStr::new("bin")) {
                prefixes.extend(dir.parent().map(Path::to_path_buf));
            }
        }
    }
    if let Some(home) = env("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    let mut sites: Vec<PathBuf> = env("PYTHONPATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for python in pythons {
            sites.push(python.join("site-packages"));
            sites.push(python.join("dist-packages"));
        }
    }
    // `/lib` is often a link to `/usr/lib`: keep each real folder once.
    let mut seen = std::collections::HashSet::new();
    sites.retain(|s| s.is_dir() && seen.insert(s.canonicalize().unwrap_or_else(|_| s.clone())));
    sites
}

impl Cudart {
    /// The file the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// # Safety
    ///
    /// `F` must be the C prototype of the symbol `name`.
    pub(crate) unsafe fn resolve<F: Copy>(&self, name: &str) -> Option<F> {
        // SAFETY: the caller guarantees `F` matches the symbol's prototype; the library
        // outlives the copied pointer because it is never unloaded.
        unsafe { self.library.get::<F>(name.as_bytes()) }
            .ok()
            .map(|symbol| *symbol)
    }

    pub(crate) fn missing_symbol(&self, symbol: &'static str) -> LoadError {
        LoadError::MissingSymbol {
            symbol,
            library: self.path.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_versioned_sonames_and_have_no_duplicates() {
        let list = candidates();
        assert_eq!(list[0], OsString::from("libcudart.so.13"));
        assert_eq!(list[1], OsString::from("libcudart.so.12"));
        let unique: std::collections::HashSet<_> = list.iter().collect();
        assert_eq!(unique.len(), list.len());
        assert!(list.contains(&OsString::from("/usr/local/cuda/lib64/libcudart.so.13")));
    }

    #[test]
    fn not_found_message_lists_every_attempt() {
        let error = LoadError::NotFound {
            attempts: vec![
                Attempt {
                    candidate: "libcudart.so.13".into(),
                    reason: "no such file".into(),
                },
                Attempt {
                    candidate: "/opt/x/libcudart.so.12".into(),
                    reason: "not present".into(),
                },
            ],
        };
        let text = error.to_string();
        assert!(text.contains("Tried 2 candidates"), "{text}");
        assert!(text.contains("libcudart.so.13: no such file"), "{text}");
        assert!(
            text.contains("/opt/x/libcudart.so.12: not present"),
            "{text}"
        );
        assert!(text.contains(CUDART_PATH_VAR), "{text}");
    }

    #[test]
    fn opening_a_file_that_is_not_a_library_is_an_error() {
        let dir = std::env::temp_dir().join(format!("cuda-pinned-sys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("libcudart.so.13");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        let result = open(fake.as_os_str());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(result.is_err());
    }
}
