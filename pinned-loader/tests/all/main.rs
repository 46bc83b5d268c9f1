//! The loader's integration tests, one binary, a module per feature. GPU tests are ignored
//! without a device.

mod device;
mod epochs;
mod files;
mod indices;
#[cfg(feature = "cudarc")]
mod with_cudarc;
