//! Safe page-locked ("pinned") host memory for CUDA.
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(dead_code)]

mod device;
mod error;
mod ffi;

pub use cuda_pinned_sys::LoadError;
pub use device::{
    Device, Version, device_count, driver_version, is_available, runtime_path, runtime_version,
};
pub use error::{CudaError, Error, Result};
