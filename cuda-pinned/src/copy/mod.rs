//! Copies: tracked async copies that hold their host buffer, copies between device memory,
//! blocking copies between a device view and any host memory, batches of raw copies, and the
//! cut at chunk boundaries every copy goes through.

pub(crate) mod batch;
pub(crate) mod device;
pub(crate) mod host;
pub(crate) mod split;
pub(crate) mod tracked;
pub(crate) mod window;
