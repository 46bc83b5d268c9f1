//! The crate's integration tests, one binary. GPU tests are ignored without a device; the
//! GPU bundle runs them with `--include-ignored`.

mod support;

mod api2;
mod boxed;
mod errors;
mod gpu;
mod gpu_devices;
mod gpu_views;
mod gpu_virtual;
mod pin;
mod staging;
mod unwind;
mod vec_model;
#[cfg(feature = "cudarc")]
mod with_cudarc;
