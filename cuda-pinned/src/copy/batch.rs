//! Many copies queued at once.

use std::ffi::c_void;

use crate::error::Result;
use crate::gpu::stream::Stream;

/// One copy of a batch queued with [`Stream::copy_batch_raw`]: `bytes` bytes from `src` to
/// `dst`, host or device addresses either way (unified addressing tells which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawCopy {
    /// Where the bytes go.
    pub dst: u64,
    /// Where they come from.
    pub src: u64,
    /// How many.
    pub bytes: usize,
}

/// A strided copy queued with [`Stream::copy_2d_raw`]: `rows` rows of `width` bytes, whose
/// starts lie `src_pitch` bytes apart at the source and `dst_pitch` apart at the destination;
/// host or device addresses either way (unified addressing tells which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawCopy2d {
    /// Where the first row goes.
    pub dst: u64,
    /// Bytes between row starts at the destination.
    pub dst_pitch: usize,
    /// Where the first row comes from.
    pub src: u64,
    /// Bytes between row starts at the source.
    pub src_pitch: usize,
    /// Bytes per row.
    pub width: usize,
    /// Rows.
    pub rows: usize,
}

impl Stream {
    /// Queues many copies at once: one `cudaMemcpyBatchAsync` where the runtime has it (CUDA 13 and
    /// later), one `cudaMemcpyAsync` each otherwise.
    ///
    /// Gathering many small pieces (the samples of a batch) this way runs at the link's speed where
    /// separate calls reach half of it. Copies that continue one another at both ends (each
    /// next one's source and destination start where the last one's end) go as one copy.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`](crate::Error::Capturing) on a stream capturing a graph (nothing
    /// is queued), or the CUDA error; copies queued before it stay queued.
    ///
    /// # Safety
    ///
    /// - each `src` is readable and each `dst` writable for its `bytes`, until the copies
    ///   have finished on this stream; host memory among them is page-locked or stays put;
    /// - nothing else writes any of the ranges (or reads a destination) meanwhile.
    pub unsafe fn copy_batch_raw(&self, copies: &[RawCopy]) -> Result<()> {
        let copies = coalesced(copies);
        if copies.is_empty() {
            return Ok(());
        }
        // A graph would copy at each launch, after the memory may be gone: refused, and fenced
        // against a capture that other code begins on an adopted stream meanwhile.
        crate::gpu::fence::enqueue(self, |stream| {
            if copies.len() > 1 && crate::raw::copy::has_memcpy_batch() {
                let dsts: Vec<_> = copies.iter().map(|c| c.dst as *mut c_void).collect();
                let srcs: Vec<_> = copies.iter().map(|c| c.src as *const c_void).collect();
                let sizes: Vec<_> = copies.iter().map(|c| c.bytes).collect();
                // SAFETY: one length for the three lists, the batch call exists with this
                // signature (checked), and the caller vouches for every range.
                return unsafe {
                    crate::copy::split::queue_batch(&dsts, &srcs, &sizes, stream.as_raw())
                };
            }
            for copy in &copies {
                // SAFETY: the caller vouches for the ranges; the default kind lets unified
                // addressing tell the direction.
                unsafe {
                    crate::copy::split::queue_default(
                        copy.dst as *mut c_void,
                        copy.src as *const c_void,
                        copy.bytes,
                        stream.as_raw(),
                    )?
                };
            }
            Ok(())
        })
    }

    /// Queues a strided copy (`cudaMemcpy2DAsync`): a slice of a tensor's columns, rows
    /// gathered into a dense block or scattered from one.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) for a pitch shorter than the width
    /// or a span past the address space (nothing is queued),
    /// [`Error::Capturing`](crate::Error::Capturing) on a stream capturing a graph (nothing
    /// is queued), or the CUDA error; rows queued before it stay queued.
    ///
    /// # Safety
    ///
    /// - every source row is readable and every destination row writable for `width` bytes,
    ///   until the copy has finished on this stream; host memory among them is page-locked
    ///   or stays put;
    /// - nothing else writes any of the rows (or reads a destination row) meanwhile.
    pub unsafe fn copy_2d_raw(&self, copy: &RawCopy2d) -> Result<()> {
        if copy.width == 0 || copy.rows == 0 {
            return Ok(());
        }
        let span = |pitch: usize| {
            (copy.rows - 1)
                .checked_mul(pitch)
                .and_then(|rows| rows.checked_add(copy.width))
        };
        let (Some(src_span), Some(dst_span)) = (span(copy.src_pitch), span(copy.dst_pitch)) else {
            return Err(crate::Error::Unsupported(
                "a strided copy's rows span more than the address space",
            ));
        };
        if copy.src_pitch < copy.width || copy.dst_pitch < copy.width {
            return Err(crate::Error::Unsupported(
                "a strided copy's pitches must be at least its width",
            ));
        }
        let whole = |addr: u64, span: usize| {
            crate::memory::chunks::pieces(addr as usize, span).count() == 1
        };
        crate::gpu::fence::enqueue(self, |stream| {
            let (dst, src) = (copy.dst as *mut c_void, copy.src as *const c_void);
            if whole(copy.src, src_span) && whole(copy.dst, dst_span) {
                // SAFETY: the caller vouches for every row; neither side spans two chunk
                // registrations (checked), and the pitches are at least the width (checked).
                return unsafe {
                    crate::raw::copy::copy_2d(
                        dst,
                        copy.dst_pitch,
                        src,
                        copy.src_pitch,
                        copy.width,
                        copy.rows,
                        stream.as_raw(),
                    )
                };
            }
            // A side crosses registrations: row by row, each cut where they end.
            for row in 0..copy.rows {
                // Plain address arithmetic: either side may be a device address.
                let (dst, src) = (
                    dst.wrapping_byte_add(row * copy.dst_pitch),
                    src.wrapping_byte_add(row * copy.src_pitch),
                );
                // SAFETY: the caller vouches for every row; the default kind lets unified
                // addressing tell the direction.
                unsafe {
                    crate::copy::split::queue_default(dst, src, copy.width, stream.as_raw())?
                };
            }
            Ok(())
        })
    }
}

/// `copies` without the empty ones, and each run of copies that continue one another at both
/// ends (the next one's source and destination start where the last one's end) made one: the
/// copy engine pays for every copy it starts, and neighbours (the small tensors of a
/// checkpoint, read together) often form such runs.
fn coalesced(copies: &[RawCopy]) -> Vec<RawCopy> {
    let mut out: Vec<RawCopy> = Vec::with_capacity(copies.len());
    for &copy in copies.iter().filter(|c| c.bytes > 0) {
        if let Some(last) = out.last_mut() {
            let continues = |from: u64, to: u64| {
                u64::try_from(last.bytes)
                    .ok()
                    .and_then(|bytes| from.checked_add(bytes))
                    == Some(to)
            };
            if continues(last.src, copy.src)
                && continues(last.dst, copy.dst)
                && let Some(bytes) = last.bytes.checked_add(copy.bytes)
            {
                last.bytes = bytes;
                continue;
            }
        }
        out.push(copy);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The bytes each destination address ends up with, copying from a source whose byte at
    /// address `a` is `a`'s low byte.
    fn landed(copies: &[RawCopy]) -> std::collections::BTreeMap<u64, u8> {
        let mut out = std::collections::BTreeMap::new();
        for copy in copies {
            for i in 0..copy.bytes as u64 {
                out.insert(copy.dst + i, (copy.src + i) as u8);
            }
        }
        out
    }

    fn copy(dst: u64, src: u64, bytes: usize) -> RawCopy {
        RawCopy { dst, src, bytes }
    }

    #[test]
    fn neighbours_at_both_ends_become_one_copy() {
        let copies = [
            copy(1000, 0, 10),
            copy(1010, 10, 5),
            copy(1015, 15, 0),
            copy(1015, 15, 5),
            // A gap at the destination (an aligned start): a new copy.
            copy(1024, 20, 4),
            // Continuing at the destination but not at the source.
            copy(1028, 30, 4),
        ];
        assert_eq!(
            coalesced(&copies),
            [copy(1000, 0, 20), copy(1024, 20, 4), copy(1028, 30, 4)]
        );
        assert_eq!(coalesced(&[copy(5, 5, 0)]), []);
        // No sum past the address space.
        let edge = [copy(0, u64::MAX - 3, 4), copy(4, u64::MAX, 1)];
        assert_eq!(coalesced(&edge), edge);
    }

    proptest! {
        #[test]
        fn coalescing_moves_the_same_bytes_in_fewer_copies(
            parts in prop::collection::vec((0u64..3, 0u64..3, 0usize..40), 0..24),
        ) {
            // Copies laid one after another at both ends, with gaps here and there.
            let (mut dst, mut src) = (10_000u64, 0u64);
            let mut copies = Vec::new();
            for (dst_gap, src_gap, bytes) in parts {
                dst += dst_gap * 8;
                src += src_gap * 8;
                copies.push(copy(dst, src, bytes));
                dst += bytes as u64;
                src += bytes as u64;
            }
            let merged = coalesced(&copies);
            prop_assert_eq!(landed(&merged), landed(&copies));
            prop_assert!(merged.len() <= copies.len());
            prop_assert!(merged.iter().all(|c| c.bytes > 0));
            for pair in merged.windows(2) {
                prop_assert!(
                    pair[0].src + pair[0].bytes as u64 != pair[1].src
                        || pair[0].dst + pair[0].bytes as u64 != pair[1].dst,
                    "{:?} could have been one copy", pair
                );
            }
        }
    }
}
