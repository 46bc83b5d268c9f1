//! Copies cut where buffers registered in chunks end: CUDA refuses a copy that spans two
//! registrations, so every copy this crate queues goes through here.

use std::ffi::c_void;

use cuda_pinned_sys as sys;

use crate::error::Result;
use crate::memory::chunks;
use crate::raw::copy::{self as raw, Direction};

/// Queues a copy between host and device memory on `stream`, cut where buffers registered in
/// chunks end (a copy may not span two registrations).
///
/// # Safety
///
/// - `src` is readable and `dst` writable for `bytes` bytes, in the memory the direction
///   names, until the copy finishes on `stream` (which stays alive until then);
/// - nothing else writes `dst` or `src` (or reads `dst`) while the copy is pending;
/// - the calling thread's current context is the primary context of `stream`'s device (as
///   `context::on_device` leaves it): the driver checks device addresses against it, and it decides
///   which stream a default-stream handle names.
pub(crate) unsafe fn queue(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    direction: Direction,
    stream: sys::cudaStream_t,
) -> Result<()> {
    let host = match direction {
        Direction::HostToDevice => src as usize,
        Direction::DeviceToHost => dst as usize,
    };
    for (offset, piece) in chunks::pieces(host, bytes) {
        // Plain address arithmetic: one side is a device address, no Rust allocation.
        let (dst, src) = (dst.wrapping_byte_add(offset), src.wrapping_byte_add(offset));
        // SAFETY: forwarded from the caller, for a part of the copy.
        unsafe { raw::copy_once(dst, src, piece, direction, stream)? };
    }
    Ok(())
}

/// `(offset, len)` pieces of a copy of `bytes` from `src` to `dst` such that neither side of a
/// piece spans two registrations of buffers registered in chunks. Pieces of a copy queued
/// one after another on one stream run in order, as the whole copy would.
fn copy_pieces(dst: usize, src: usize, bytes: usize) -> impl Iterator<Item = (usize, usize)> {
    chunks::pieces(src, bytes).flat_map(move |(offset, len)| {
        chunks::pieces(dst + offset, len).map(move |(inner, len)| (offset + inner, len))
    })
}

/// As [`queue`], the direction told by unified addressing: either side host or device memory.
///
/// # Safety
///
/// As [`queue`].
pub(crate) unsafe fn queue_default(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: sys::cudaStream_t,
) -> Result<()> {
    for (offset, piece) in copy_pieces(dst as usize, src as usize, bytes) {
        // Plain address arithmetic: either side may be a device address.
        let (dst, src) = (dst.wrapping_byte_add(offset), src.wrapping_byte_add(offset));
        // SAFETY: forwarded from the caller, for a part of the copy.
        unsafe { raw::copy_default(dst, src, piece, stream)? };
    }
    Ok(())
}

/// Queues `dsts.len()` copies at once (see `raw::copy_batch`), each cut into one entry per
/// chunk it crosses.
///
/// # Safety
///
/// - the three slices have one length, and `raw::has_memcpy_batch` said yes;
/// - as [`queue`] for each `(dsts[i], srcs[i], sizes[i])`.
pub(crate) unsafe fn queue_batch(
    dsts: &[*mut c_void],
    srcs: &[*const c_void],
    sizes: &[usize],
    stream: sys::cudaStream_t,
) -> Result<()> {
    if !chunks::any() {
        // SAFETY: forwarded from the caller.
        return unsafe { raw::copy_batch(dsts, srcs, sizes, stream) };
    }
    let mut pieces = (Vec::new(), Vec::new(), Vec::new());
    for ((&dst, &src), &bytes) in dsts.iter().zip(srcs).zip(sizes) {
        for (offset, len) in copy_pieces(dst as usize, src as usize, bytes) {
            pieces.0.push(dst.wrapping_byte_add(offset));
            pieces.1.push(src.wrapping_byte_add(offset));
            pieces.2.push(len);
        }
    }
    // SAFETY: forwarded from the caller, for the pieces of the same copies.
    unsafe { raw::copy_batch(&pieces.0, &pieces.1, &pieces.2, stream) }
}
