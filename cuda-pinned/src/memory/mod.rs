//! The kinds of page-locked memory: each kind is an allocator of its own under the contract
//! that names no kind ([`allocator`]), and [`default`] picks one for the machine.

pub(crate) mod allocator;
pub(crate) mod chunks;
pub(crate) mod cuda_host;
pub(crate) mod default;
pub(crate) mod flags;
pub(crate) mod host_locked;
pub(crate) mod registered;
pub(crate) mod registration;
pub(crate) mod virtual_host;
