//! The crate's integration tests, one binary, a module per feature. GPU tests are ignored
//! without a device; the GPU bundle runs them with `--include-ignored`.

mod support;

mod allocator_api2;
mod boxed;
mod copies;
mod device_copies;
mod devices;
mod errors;
mod fill;
mod pin;
mod staging;
mod unwind;
mod vec_model;
mod views;
mod virtual_host;
#[cfg(feature = "cudarc")]
mod with_cudarc;
