//! The device side: devices, streams, events, device memory, and the fence that keeps work
//! queued for other code's streams out of their graph captures.

pub(crate) mod buffer;
pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod fence;
pub(crate) mod host_fn;
pub(crate) mod pending;
pub(crate) mod stream;
pub(crate) mod views;
