//! The driver API calls this workspace needs (host memory through CUDA's virtual-memory API),
//! reached without linking or loading libcuda ourselves: the runtime already loaded hands out
//! driver entry points through `cudaGetDriverEntryPointByVersion` (CUDA 12.5 and later).

use std::ffi::{CStr, c_void};
use std::fmt;
use std::sync::OnceLock;

use crate::{Cudart, LoadError, cudaDriverEntryPointQueryResult, cudaError, cudart};

/// The CUDA version whose prototypes the bindings describe, as the entry-point query takes it
/// (major × 1000 + minor × 10): the driver returns the function as of that version. Every
/// bound function has the prototype of the 13.0 header since 12.0; a function that changed
/// later needs this raised (and drivers older than the change refuse it).
const ABI_VERSION: u32 = 12_000;

pub use crate::driver_bindings::*;

/// The CUDA driver's functions, reached through the loaded runtime.
///
/// Obtained from [`driver()`]. Each bound function is a method of the same name returning its
/// function pointer, resolved on first use.
pub struct Driver {
    runtime: &'static Cudart,
    pub(crate) symbols: DriverSymbols,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("runtime", &self.runtime.path())
            .finish_non_exhaustive()
    }
}

/// The CUDA driver's entry points, reached through the runtime (which is loaded first).
///
/// # Errors
///
/// The runtime's [`LoadError`] when it cannot be loaded.
pub fn driver() -> Result<&'static Driver, LoadError> {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    let runtime = cudart()?;
    Ok(DRIVER.get_or_init(|| Driver {
        runtime,
        symbols: DriverSymbols::new(),
    }))
}

impl Driver {
    /// The address of the driver function `name` (NUL-terminated).
    pub(crate) fn entry_point(&self, name: &'static str) -> Result<*mut c_void, LoadError> {
        let symbol = name.trim_end_matches('\0');
        let missing = |reason: String| LoadError::MissingDriverEntryPoint { symbol, reason };
        let query = self
            .runtime
            .cudaGetDriverEntryPointByVersion()
            .map_err(|_| missing("the CUDA runtime is older than 12.5".into()))?;
        let mut address = std::ptr::null_mut();
        let mut status = cudaDriverEntryPointQueryResult::cudaDriverEntryPointSuccess;
        let name =
            CStr::from_bytes_with_nul(name.as_bytes()).map_err(|e| missing(e.to_string()))?;
        // SAFETY: `name` is NUL-terminated, both out-pointers are valid for writes, and flag 0
        // is `cudaEnableDefault`.
        let code = unsafe { query(name.as_ptr(), &mut address, ABI_VERSION, 0, &mut status) };
        if code != cudaError::cudaSuccess
            && let Ok(clear) = self.runtime.cudaGetLastError()
        {
            // SAFETY: no arguments; it only resets the thread's sticky error, which a failed
            // query would otherwise leave for the caller's next, unrelated call.
            unsafe { clear() };
        }
        if status == cudaDriverEntryPointQueryResult::cudaDriverEntryPointVersionNotSufficent {
            return Err(missing("the installed driver is too old".into()));
        }
        if code != cudaError::cudaSuccess
            || status != cudaDriverEntryPointQueryResult::cudaDriverEntryPointSuccess
            || address.is_null()
        {
            return Err(missing(format!(
                "the driver does not provide it (runtime error {}, query status {})",
                code.0, status.0
            )));
        }
        Ok(address)
    }
}
