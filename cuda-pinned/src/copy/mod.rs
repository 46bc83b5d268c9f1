//! Copies between host and device: tracked async copies that hold their host buffer, batches
//! of raw copies, and the cut at chunk boundaries every copy goes through.

pub(crate) mod batch;
pub(crate) mod nontemporal;
pub(crate) mod split;
pub(crate) mod tracked;
