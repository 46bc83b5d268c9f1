//! A range of a host buffer as a copy's host side, the whole buffer travelling with it.

use std::fmt;
use std::ops::{Range, RangeBounds};

use crate::copy::tracked::HostBuffer;
use crate::gpu::views::bounds;
use crate::memory::allocator::PendingUses;

/// A range of a host buffer that async copies take as their host side, owning the whole buffer.
///
/// Uploading the tail of a [`PinnedVec`](crate::PinnedVec), or downloading into the middle
/// of one, needs no buffer of exactly that length (each odd length a new size class in a pool,
/// pinned afresh): the window moves into the [`Transfer`](crate::Transfer) with the buffer it
/// belongs to, so the buffer cannot be touched, reused or freed until the copy is done, and
/// comes back whole with [`into_inner`](Self::into_inner).
///
/// ```no_run
/// use cuda_pinned::{DeviceBuffer, PinnedVec, Stream, Window};
/// let stream = Stream::new()?;
/// let samples = PinnedVec::from_slice(&[1u16; 10_000])?;
/// let mut device = DeviceBuffer::<u16>::zeroed(2_000)?;
/// // The last 2,000 samples; the vector travels with the copy and comes back whole.
/// let window = Window::new(samples, 8_000..);
/// let samples = stream.copy_to_device(window, &mut device)?.wait()?.into_inner();
/// assert_eq!(samples.len(), 10_000);
/// # Ok::<(), cuda_pinned::Error>(())
/// ```
///
/// The buffer cannot be used while a window holds it:
///
/// ```compile_fail
/// use cuda_pinned::{PinnedVec, Window};
/// let mut samples = PinnedVec::from_slice(&[1u16; 16]).unwrap();
/// let window = Window::new(samples, 8..);
/// samples[0] = 2; // moved into the window
/// ```
pub struct Window<B: HostBuffer> {
    buffer: B,
    start: usize,
    len: usize,
}

impl<B: HostBuffer> Window<B> {
    /// The elements of `buffer` in `range`.
    ///
    /// # Panics
    ///
    /// When the range is out of the buffer's bounds or decreasing, as slice indexing does.
    #[track_caller]
    pub fn new(buffer: B, range: impl RangeBounds<usize>) -> Self {
        let mut window = Self {
            buffer,
            start: 0,
            len: 0,
        };
        window.set_range(range);
        window
    }

    /// Moves the window to `range` of the buffer.
    ///
    /// # Panics
    ///
    /// As [`new`](Self::new).
    #[track_caller]
    pub fn set_range(&mut self, range: impl RangeBounds<usize>) {
        let total = self.buffer.host_parts().1;
        let (start, end) = bounds(&range, total);
        assert!(
            start <= end && end <= total,
            "range {start}..{end} out of bounds for {total}"
        );
        (self.start, self.len) = (start, end - start);
    }

    /// The window's range of the buffer.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// The whole buffer.
    pub fn buffer(&self) -> &B {
        &self.buffer
    }

    /// The whole buffer back.
    pub fn into_inner(self) -> B {
        self.buffer
    }
}

impl<B: HostBuffer> fmt::Debug for Window<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("range", &self.range())
            .finish_non_exhaustive()
    }
}

// SAFETY: the window owns the buffer, whose memory meets the contract (`B: HostBuffer`), and
// reports a range inside it: the range was checked against the buffer's length, which cannot
// change while the window holds it (only `&B` is lent), and is clamped to it again here.
// Released, the whole buffer waits for `pending` as its own contract says.
unsafe impl<B: HostBuffer> HostBuffer for Window<B> {
    type Elem = B::Elem;

    fn host_parts(&mut self) -> (*mut B::Elem, usize) {
        let (ptr, total) = self.buffer.host_parts();
        let start = self.start.min(total);
        let len = self.len.min(total - start);
        // `wrapping_add`: in bounds (`start <= total`), but the buffer may be empty.
        (ptr.wrapping_add(start), len)
    }

    fn release_after(self, pending: PendingUses) {
        self.buffer.release_after(pending);
    }
}
