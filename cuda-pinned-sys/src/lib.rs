//! Raw bindings of the CUDA runtime API calls that page-locked host memory needs, with
//! libcudart loaded at run time.
//!
//! Nothing here links against CUDA: the crate builds on machines without the toolkit (CI,
//! docs.rs, laptops), and a program using it starts on CPU-only hosts, where [`cudart()`]
//! returns a [`LoadError`] that lists every path it tried.
//!
//! ```no_run
//! use cuda_pinned_sys::{cudaError, cudart};
//!
//! let rt = cudart()?;                       // loads libcudart once per process
//! let get_count = rt.cudaGetDeviceCount()?; // resolves the symbol on first use
//! let mut count = 0;
//! // SAFETY: `count` is a valid out-pointer for the call.
//! let status = unsafe { get_count(&mut count) };
//! assert_eq!(status, cudaError::cudaSuccess);
//! # Ok::<(), cuda_pinned_sys::LoadError>(())
//! ```
//!
//! - Types, enums and `#define`d flags are bindgen's output from the CUDA 13 headers,
//!   committed in `src/bindings.rs` and reproducible with `scripts/regen-bindings`.
//!   Enums such as [`cudaError`] are newtypes, so codes a newer runtime returns stay valid.
//! - Functions are methods of [`Cudart`] named after the C functions; each returns the
//!   function pointer or [`LoadError::MissingSymbol`]. Nothing in this crate panics.
//! - A few driver API functions (host memory through CUDA's virtual-memory API) live in
//!   [`driver`]: the runtime hands out their entry points, so libcuda is never opened here.
//! - Versioned symbols (`#define cudaX cudaX_v2` in a header) are bound under the plain name
//!   and resolve the symbol the library exports.
//!
//! The safe layer is the `cuda-pinned` crate.

#![deny(unsafe_op_in_unsafe_fn)]

#[macro_use]
mod api;
mod loader;

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    clippy::undocumented_unsafe_blocks,
    unsafe_op_in_unsafe_fn,
    reason = "bindgen output, named and shaped after the C headers"
)]
// Generated and committed as generated: the drift check compares it byte for byte.
#[rustfmt::skip]
mod bindings;
pub mod driver;
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    clippy::undocumented_unsafe_blocks,
    unsafe_op_in_unsafe_fn,
    reason = "bindgen output, named and shaped after the C headers"
)]
#[rustfmt::skip]
mod driver_bindings;

pub use bindings::*;
pub use loader::{Attempt, CUDART_PATH_VAR, Cudart, LoadError, candidates, cudart, is_available};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_attributes_layout_matches_the_c_struct() {
        // Offsets from cuda_runtime_api.h on LP64: enum, int, two pointers, eight longs.
        assert_eq!(std::mem::size_of::<cudaPointerAttributes>(), 88);
        assert_eq!(
            std::mem::offset_of!(cudaPointerAttributes, devicePointer),
            8
        );
        assert_eq!(std::mem::offset_of!(cudaPointerAttributes, hostPointer), 16);
    }

    #[test]
    fn error_codes_are_open_newtypes() {
        // A code the bindings do not name is still a value, not undefined behaviour.
        let unknown = cudaError(123_456);
        assert_ne!(unknown, cudaError::cudaSuccess);
        assert_eq!(cudaError::cudaErrorNotReady.0, 600);
    }
}
