//! The raw layer: one CUDA call, one `Result` function, grouped by CUDA concept (the shape of
//! cudarc's `result` module). No policy lives here: which context is current, the capture
//! mode and where copies are cut are the callers' business.
//!
//! Every function turns a missing library or symbol into [`Error::Unavailable`] and a
//! non-success code into [`Error::Cuda`] (runtime) or [`Error::Driver`] (driver), clearing
//! the runtime's per-thread last error so a failure here does not resurface in a user's
//! next, unrelated CUDA call. Where the driver's own entry points can be reached (through the
//! runtime, from CUDA 12.5), the hot calls use them: they skip the runtime's layer.

use std::sync::OnceLock;

use cuda_pinned_sys::driver::CUresult;
use cuda_pinned_sys::{cudaError, cudart};

use crate::error::{CudaError, DriverError, Error, Result};

/// Calls one runtime function and checks its status.
///
/// Every use site is inside an `unsafe fn` of this module whose `# Safety` section (or a safe
/// fn whose body) establishes the C function's preconditions for the given arguments.
macro_rules! cuda {
    ($name:ident($($arg:expr),* $(,)?)) => {{
        let function = $crate::sys::cudart()?.$name()?;
        // SAFETY: see the macro's documentation: the enclosing function guarantees the
        // arguments satisfy the C function's contract.
        let status = unsafe { function($($arg),*) };
        $crate::raw::check(stringify!($name), status)
    }};
}

/// Calls one driver function (reached through the runtime) and checks its status; the same
/// contract as [`cuda!`].
macro_rules! driver {
    ($name:ident($($arg:expr),* $(,)?)) => {{
        let function = $crate::sys::driver::driver()?.$name()?;
        // SAFETY: as for `cuda!`: the enclosing function guarantees the arguments satisfy
        // the C function's contract.
        $crate::raw::driver_status(stringify!($name), unsafe { function($($arg),*) })
    }};
}

/// A driver function resolved once per process: `None` where the runtime or the driver does
/// not provide it (runtimes before 12.5), so that callers fall back to the runtime's call
/// without asking again.
macro_rules! driver_fn {
    ($name:ident: $type:ty) => {{
        static RESOLVED: std::sync::OnceLock<Option<$type>> = std::sync::OnceLock::new();
        *RESOLVED.get_or_init(|| {
            $crate::raw::runtime_calls_not_asked()
                .then(|| {
                    $crate::sys::driver::driver()
                        .and_then($crate::sys::driver::Driver::$name)
                        .ok()
                })
                .flatten()
        })
    }};
}

pub(crate) mod context;
pub(crate) mod copy;
pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod memory;
pub(crate) mod stream;
pub(crate) mod vmm;

/// The environment variable that makes hot calls go through the runtime, not the driver.
///
/// Copies, events and pointer lookups then use the runtime's calls even where the driver's can be
/// reached: what runtimes before 12.5 do, to compare or test that path. Read once.
pub const RUNTIME_CALLS_VAR: &str = "CUDA_PINNED_RUNTIME_CALLS";

/// Whether [`RUNTIME_CALLS_VAR`] is unset (or empty).
pub(crate) fn runtime_calls_not_asked() -> bool {
    static NOT_ASKED: OnceLock<bool> = OnceLock::new();
    *NOT_ASKED.get_or_init(|| std::env::var_os(RUNTIME_CALLS_VAR).is_none_or(|v| v.is_empty()))
}

/// A driver call's status as a `Result`.
pub(crate) fn driver_status(call: &'static str, status: CUresult) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(DriverError::new(call, status)))
    }
}

pub(crate) fn check(call: &'static str, status: cudaError) -> Result<()> {
    if status == cudaError::cudaSuccess {
        return Ok(());
    }
    // Reset the per-thread "last error" so it does not poison later, unrelated calls.
    if let Ok(Ok(clear)) = cudart().map(|rt| rt.cudaGetLastError()) {
        // SAFETY: cudaGetLastError takes no arguments and only resets thread-local state.
        unsafe { clear() };
    }
    Err(Error::Cuda(CudaError::new(call, status)))
}

/// Like [`check`] for a call whose `NotReady` answer is a normal outcome.
pub(crate) fn query(call: &'static str, status: cudaError) -> Result<bool> {
    if status == cudaError::cudaErrorNotReady {
        return Ok(false);
    }
    check(call, status).map(|()| true)
}
