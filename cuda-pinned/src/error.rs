//! Error types: a failed CUDA call, and everything else the world can do to an allocation.

use std::ffi::CStr;
use std::fmt;

use cuda_pinned_sys::driver::{CUresult, driver};
use cuda_pinned_sys::{LoadError, cudaError, cudart};

/// The crate's `Result`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A CUDA runtime call that returned an error code.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaError {
    code: cudaError,
    call: &'static str,
}

impl CudaError {
    pub(crate) fn new(call: &'static str, code: cudaError) -> Self {
        Self { code, call }
    }

    /// The numeric `cudaError_t`.
    pub fn code(&self) -> u32 {
        self.code.0
    }

    /// The raw code, for comparing with `cuda_pinned_sys::cudaError` constants.
    pub fn raw(&self) -> cudaError {
        self.code
    }

    /// The runtime function that returned it, such as `"cudaHostAlloc"`.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The code's name from the runtime (`"cudaErrorMemoryAllocation"`), or
    /// `"unrecognized error code"` when the runtime does not know it.
    pub fn name(&self) -> &'static str {
        runtime_string(self.code, |rt| rt.cudaGetErrorName()).unwrap_or("unrecognized error code")
    }

    /// The runtime's description of the code (`"out of memory"`).
    pub fn description(&self) -> &'static str {
        runtime_string(self.code, |rt| rt.cudaGetErrorString()).unwrap_or("no description")
    }

    /// Whether the runtime could not allocate memory (host or device).
    pub fn is_out_of_memory(&self) -> bool {
        self.code == cudaError::cudaErrorMemoryAllocation
    }
}

type StringFn = unsafe extern "C" fn(cudaError) -> *const std::ffi::c_char;

fn runtime_string(
    code: cudaError,
    get: impl FnOnce(&cuda_pinned_sys::Cudart) -> Result<StringFn, LoadError>,
) -> Option<&'static str> {
    let function = get(cudart().ok()?).ok()?;
    // SAFETY: both functions take any code and return NULL or a pointer to a static,
    // NUL-terminated string owned by libcudart, which is never unloaded.
    let text = unsafe { function(code) };
    if text.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(text) }.to_str().ok()
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaError")
            .field("call", &self.call)
            .field("code", &self.code.0)
            .field("name", &self.name())
            .finish()
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        failure(f, self.call, self.name(), self.code.0, self.description())
    }
}

/// `call failed: NAME (code): description`, for runtime and driver errors alike.
fn failure(
    f: &mut fmt::Formatter<'_>,
    call: &str,
    name: &str,
    code: u32,
    description: &str,
) -> fmt::Result {
    write!(f, "{call} failed: {name} ({code}): {description}")
}

impl std::error::Error for CudaError {}

/// A CUDA driver call that returned an error code.
///
/// Host memory through the virtual-memory API ([`VirtualHost`](crate::VirtualHost)) is made with
/// driver calls, and copies between host and device memory are queued and events recorded, queried
/// and waited for with the driver's own calls where its entry points can be reached (CUDA 12.5 and
/// later; see [`RUNTIME_CALLS_VAR`](crate::RUNTIME_CALLS_VAR)). An error of device work (an illegal
/// address in a kernel, say) can therefore come from a wait as a `DriverError`; its
/// [`code`](Self::code) is the driver's number for it, which is the runtime's number for the same
/// error.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DriverError {
    code: CUresult,
    call: &'static str,
}

impl DriverError {
    pub(crate) fn new(call: &'static str, code: CUresult) -> Self {
        Self { code, call }
    }

    /// The numeric `CUresult`.
    pub fn code(&self) -> u32 {
        self.code.0
    }

    /// The driver function that returned it, such as `"cuMemCreate"`.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The code's name from the driver (`"CUDA_ERROR_OUT_OF_MEMORY"`), or
    /// `"unrecognized error code"`.
    pub fn name(&self) -> &'static str {
        driver_string(self.code, |d| d.cuGetErrorName()).unwrap_or("unrecognized error code")
    }

    /// The driver's description of the code.
    pub fn description(&self) -> &'static str {
        driver_string(self.code, |d| d.cuGetErrorString()).unwrap_or("no description")
    }

    /// Whether the driver could not allocate memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

type DriverStringFn = unsafe extern "C" fn(CUresult, *mut *const std::ffi::c_char) -> CUresult;

fn driver_string(
    code: CUresult,
    get: impl FnOnce(&cuda_pinned_sys::driver::Driver) -> Result<DriverStringFn, LoadError>,
) -> Option<&'static str> {
    let function = get(driver().ok()?).ok()?;
    let mut text = std::ptr::null();
    // SAFETY: both functions take any code and an out-pointer, which they set to a static,
    // NUL-terminated string owned by the driver (never unloaded) or leave alone on failure.
    if unsafe { function(code, &mut text) } != CUresult::CUDA_SUCCESS || text.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(text) }.to_str().ok()
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverError")
            .field("call", &self.call)
            .field("code", &self.code.0)
            .field("name", &self.name())
            .finish()
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        failure(f, self.call, self.name(), self.code.0, self.description())
    }
}

impl std::error::Error for DriverError {}

/// Everything that can go wrong when page-locked memory is asked for or used.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA runtime library could not be loaded, or lacks a function.
    Unavailable(LoadError),
    /// A CUDA runtime call failed.
    Cuda(CudaError),
    /// A CUDA driver call failed.
    Driver(DriverError),
    /// Locking the pages would exceed `RLIMIT_MEMLOCK` (`ulimit -l`).
    MemlockLimit {
        /// Bytes the failed request would have locked.
        requested: usize,
        /// The process's soft limit in bytes; `None` when unlimited or unreadable.
        limit: Option<u64>,
    },
    /// The operating system had no memory for the request.
    OutOfMemory {
        /// Bytes requested.
        requested: usize,
    },
    /// The size in bytes does not fit in `isize` (or the element count overflowed).
    CapacityOverflow,
    /// An operating system call failed for another reason.
    Os {
        /// The call, such as `"mmap"`.
        call: &'static str,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The device or platform does not support the requested kind of memory.
    Unsupported(&'static str),
    /// An allocator's own cap on pinned bytes would be passed (a caching pool's limit).
    LimitExceeded {
        /// Bytes the request needed.
        requested: usize,
        /// Bytes pinned by the allocator already.
        pinned: usize,
        /// The cap.
        limit: usize,
    },
    /// Pinning more would leave the machine too little memory it can reclaim: pinned pages can
    /// never be swapped out or reclaimed, and a host short of them swaps or kills processes.
    MemoryPressure {
        /// Bytes the request needed.
        requested: usize,
        /// Bytes available to the process: the kernel's `MemAvailable`, capped by its memory
        /// cgroups' limits less their use.
        available: u64,
        /// The memory the process may use in bytes: the machine's, or its memory cgroups'
        /// lowest limit.
        total: u64,
        /// Bytes the allocator keeps available.
        keep: u64,
        /// Who pins: the allocator's name.
        pinner: &'static str,
        /// Bytes it holds pinned already.
        pinned: usize,
    },
    /// A cudarc driver call failed (with the `cudarc` feature): this crate's calls do not
    /// return it, but `?` turns cudarc's errors into it in code that uses both.
    #[cfg(feature = "cudarc")]
    Cudarc(cudarc::driver::DriverError),
    /// A copy between buffers of different lengths (in elements).
    LengthMismatch {
        /// Elements on the host side.
        host: usize,
        /// Elements on the device side.
        device: usize,
    },
    /// A copy between device memory of different lengths (in elements).
    LengthsDiffer {
        /// Elements of the source.
        src: usize,
        /// Elements of the destination.
        dst: usize,
    },
    /// Two CUDA objects of different devices were used together where CUDA needs one
    /// device: a device buffer and the stream that copies it, an event and the stream it
    /// records.
    DeviceMismatch {
        /// What is on the wrong device, such as `"the stream"`.
        what: &'static str,
        /// The device it had to be on.
        expected: usize,
        /// The device it is on.
        found: usize,
    },
    /// The stream is capturing a CUDA graph (or was, and the capture failed without ending):
    /// work queued there would run at each launch of the graph, after the host memory it
    /// reads or fills may be gone, so copies, tracked work and host functions refuse it.
    /// Queue them before the capture begins, or capture copies of memory the graph owns.
    ///
    /// The stream is asked before the work is queued, and by the stager after its copies
    /// too. A capture that another thread begins on the same stream in between is not
    /// prevented: CUDA offers no way to queue work only if a stream is not capturing. Do not
    /// begin a capture on a stream that other threads are using.
    ///
    /// Captures on other streams do not get in the way, whichever thread makes them and in
    /// whatever mode: this crate waits, queries and allocates in relaxed capture mode, which
    /// a global-mode capture does not refuse (nor is it invalidated by these calls).
    Capturing,
    /// Every chunk of a pinned ring (a [`Stager`](crate::Stager)'s, a file reader's) was lost
    /// to device errors (their copies could not be waited for, so none is reused), or every
    /// chunk left waits for one to be filled: the ring copies nothing more.
    RingLost,
    /// One of the threads working on a copy or a read panicked: the work it held is
    /// unfinished.
    Panicked {
        /// Whose thread, such as `"a staging copy"`.
        what: &'static str,
    },
    /// The system refused to start any thread of a crew that cannot work without one.
    NoThreads {
        /// Whose threads, such as `"a file reader's"`.
        what: &'static str,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unavailable(_) => f.write_str("CUDA is not available"),
            Self::Cuda(e) => e.fmt(f),
            Self::Driver(e) => e.fmt(f),
            Self::MemlockLimit { requested, limit } => {
                write!(f, "cannot lock {requested} bytes of memory: ")?;
                match limit {
                    Some(limit) => write!(f, "RLIMIT_MEMLOCK is {limit} bytes")?,
                    None => write!(f, "the memlock limit was reached")?,
                }
                write!(
                    f,
                    "; raise it with `ulimit -l unlimited`, LimitMEMLOCK= in a systemd unit, \
                     or `--ulimit memlock=-1` for a container"
                )
            }
            Self::OutOfMemory { requested } => {
                write!(f, "out of host memory allocating {requested} bytes")
            }
            Self::CapacityOverflow => write!(f, "requested size overflows the address space"),
            Self::Os { call, .. } => write!(f, "{call} failed"),
            Self::Unsupported(what) => write!(f, "not supported: {what}"),
            Self::LimitExceeded {
                requested,
                pinned,
                limit,
            } => write!(
                f,
                "pinning {requested} more bytes would pass the limit of {limit} bytes \
                 ({pinned} already pinned)"
            ),
            Self::MemoryPressure {
                requested,
                available,
                total,
                keep,
                pinner,
                pinned,
            } => write!(
                f,
                "pinning {} more would leave {} of the {} this process may use (the machine's, \
                 or its container's limit) available, under the {} kept available; {pinner} \
                 holds {} pinned (other processes' memory and this one's ordinary memory count \
                 against it too)",
                Bytes(*requested as u64),
                Bytes(available.saturating_sub(*requested as u64)),
                Bytes(*total),
                Bytes(*keep),
                Bytes(*pinned as u64),
            ),
            #[cfg(feature = "cudarc")]
            Self::Cudarc(e) => e.fmt(f),
            Self::LengthMismatch { host, device } => write!(
                f,
                "copy between {host} host elements and {device} device elements: lengths differ"
            ),
            Self::LengthsDiffer { src, dst } => write!(
                f,
                "a copy of {src} elements into {dst}: the source and destination lengths differ"
            ),
            Self::DeviceMismatch {
                what,
                expected,
                found,
            } => write!(
                f,
                "{what} belongs to device {found}, but this needs one of device {expected}"
            ),
            Self::Capturing => write!(
                f,
                "the stream is capturing a CUDA graph: copies with host memory, tracked work and \
                 host functions would run at the graph's launch, after the memory may be gone"
            ),
            Self::RingLost => f.write_str(
                "every chunk of the pinned ring was lost to device errors (or waits for a chunk \
                 that none is left to fill): it copies nothing more",
            ),
            Self::Panicked { what } => write!(f, "{what} thread panicked"),
            Self::NoThreads { what } => write!(f, "the system refused to start {what} threads"),
        }
    }
}

/// A copy, for errors handed to several waiters (the tensors of a failed load); an operating
/// system's error is copied by its code, or else by its kind and text.
impl Clone for Error {
    fn clone(&self) -> Self {
        match self {
            Self::Unavailable(e) => Self::Unavailable(e.clone()),
            Self::Cuda(e) => Self::Cuda(*e),
            Self::Driver(e) => Self::Driver(*e),
            Self::MemlockLimit { requested, limit } => Self::MemlockLimit {
                requested: *requested,
                limit: *limit,
            },
            Self::OutOfMemory { requested } => Self::OutOfMemory {
                requested: *requested,
            },
            Self::CapacityOverflow => Self::CapacityOverflow,
            Self::Os { call, source } => Self::Os {
                call,
                source: copy_io_error(source),
            },
            Self::Unsupported(what) => Self::Unsupported(what),
            Self::LimitExceeded {
                requested,
                pinned,
                limit,
            } => Self::LimitExceeded {
                requested: *requested,
                pinned: *pinned,
                limit: *limit,
            },
            Self::MemoryPressure {
                requested,
                available,
                total,
                keep,
                pinner,
                pinned,
            } => Self::MemoryPressure {
                requested: *requested,
                available: *available,
                total: *total,
                keep: *keep,
                pinner,
                pinned: *pinned,
            },
            #[cfg(feature = "cudarc")]
            Self::Cudarc(e) => Self::Cudarc(*e),
            Self::LengthMismatch { host, device } => Self::LengthMismatch {
                host: *host,
                device: *device,
            },
            Self::LengthsDiffer { src, dst } => Self::LengthsDiffer {
                src: *src,
                dst: *dst,
            },
            Self::DeviceMismatch {
                what,
                expected,
                found,
            } => Self::DeviceMismatch {
                what,
                expected: *expected,
                found: *found,
            },
            Self::Capturing => Self::Capturing,
            Self::RingLost => Self::RingLost,
            Self::Panicked { what } => Self::Panicked { what },
            Self::NoThreads { what } => Self::NoThreads { what },
        }
    }
}

/// A copy of an operating system's error: by its code where it has one, else by its kind and
/// text.
pub fn copy_io_error(error: &std::io::Error) -> std::io::Error {
    match error.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(error.kind(), error.to_string()),
    }
}

/// Each error says what failed at its own level, and gives the error that caused it as its
/// [`source`](std::error::Error::source), never in its own text too: a report of the chain
/// (anyhow's, eyre's) names each cause once. The CUDA and cudarc variants only wrap another
/// error, and are that error: its text and its source.
impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unavailable(e) => Some(e),
            Self::Cuda(e) => e.source(),
            Self::Driver(e) => e.source(),
            Self::Os { source, .. } => Some(source),
            #[cfg(feature = "cudarc")]
            Self::Cudarc(e) => e.source(),
            _ => None,
        }
    }
}

#[cfg(feature = "cudarc")]
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Self::Cudarc(e)
    }
}

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Self {
        Self::Unavailable(e)
    }
}

impl From<CudaError> for Error {
    fn from(e: CudaError) -> Self {
        Self::Cuda(e)
    }
}

/// An error and each of its sources on one line, `error: cause: its cause`: for text that
/// shows no chain of its own (a panic's message, a log line, a note in a report).
///
/// This workspace's errors keep their causes as sources, out of their own text (see
/// [`Error`]'s `source`); a report that prints only `{error}` would lose them.
///
/// ```
/// use std::io;
/// let error = cuda_pinned::Error::Os {
///     call: "mmap",
///     source: io::Error::from_raw_os_error(12),
/// };
/// let line = cuda_pinned::ErrorChain(&error).to_string();
/// assert!(line.starts_with("mmap failed: "), "{line}");
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(error) = cause {
            write!(f, ": {error}")?;
            cause = error.source();
        }
        Ok(())
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A byte count for people: `1.5 GiB`, `640 MiB`, `12 KiB`, `100 B`.
struct Bytes(u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{value:.1} {}", UNITS[unit])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each cause appears once in a report of the chain: as a source, not in the text of
    /// the error it caused too.
    #[test]
    fn a_chain_names_each_cause_once() {
        let os = Error::Os {
            call: "mmap",
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let cause = std::io::Error::from_raw_os_error(libc::ENOMEM).to_string();
        assert_eq!(os.to_string(), "mmap failed");
        assert_eq!(ErrorChain(&os).to_string(), format!("mmap failed: {cause}"));
        // A wrapper is the error it wraps: its text once, and that error's own source.
        let cuda = Error::Cuda(CudaError::new(
            "cudaMalloc",
            cudaError::cudaErrorMemoryAllocation,
        ));
        let text = cuda.to_string();
        assert!(std::error::Error::source(&cuda).is_none());
        assert_eq!(ErrorChain(&cuda).to_string(), text);
    }

    #[test]
    fn memlock_message_names_the_limit_and_a_fix() {
        let text = Error::MemlockLimit {
            requested: 1 << 20,
            limit: Some(65536),
        }
        .to_string();
        assert!(text.contains("1048576 bytes"), "{text}");
        assert!(text.contains("RLIMIT_MEMLOCK is 65536 bytes"), "{text}");
        assert!(text.contains("ulimit -l"), "{text}");
    }

    #[test]
    fn cuda_error_keeps_code_and_call() {
        let error = CudaError::new("cudaHostAlloc", cudaError::cudaErrorMemoryAllocation);
        assert_eq!(error.code(), 2);
        assert_eq!(error.call(), "cudaHostAlloc");
        assert!(error.is_out_of_memory());
        assert!(error.to_string().starts_with("cudaHostAlloc failed"));
    }

    #[test]
    fn driver_error_keeps_code_and_call() {
        let error = DriverError::new("cuMemCreate", CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(error.code(), 2);
        assert_eq!(error.call(), "cuMemCreate");
        assert!(error.is_out_of_memory());
        assert!(
            !DriverError::new("cuMemMap", CUresult::CUDA_ERROR_INVALID_VALUE).is_out_of_memory()
        );
        let text = Error::Driver(error).to_string();
        assert!(text.starts_with("cuMemCreate failed"), "{text}");
    }
}
