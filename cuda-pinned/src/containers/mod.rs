//! Containers of page-locked memory from any allocator: the `Vec` and `Box` of this crate,
//! and the block of memory they own.

pub(crate) mod block;
pub(crate) mod boxed;
mod fill;
pub(crate) mod pin_memory;
pub(crate) mod vec;
