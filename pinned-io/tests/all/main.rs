//! The crate's integration tests, one binary. GPU tests are ignored without a device.

mod gpu;
mod headers;
mod landing;
mod special_files;
