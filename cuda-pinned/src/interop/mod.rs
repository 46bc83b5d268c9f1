//! Working with other crates: cudarc's streams and device memory, and allocator-api2's
//! collections in page-locked memory.

pub(crate) mod allocator_api2;
#[cfg(feature = "cudarc")]
pub(crate) mod cudarc;
