//! Copies between device memory: within a device, or from one device to another, tracked on
//! both sides like every other copy.

use std::ffi::c_void;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::stream::Stream;
use crate::gpu::views::{DeviceRange, DeviceSlice, DeviceSliceMut};

impl Stream {
    /// Queues a copy of `src` into `dst` on this stream, both device memory: of one device, or
    /// of two (a peer copy, direct over NVLink or PCIe where the devices can reach each other,
    /// staged by CUDA where they cannot).
    ///
    /// The copy is ordered after the copies of both buffers on other streams (and after the
    /// work on streams they [recorded](crate::DeviceBuffer::record_stream)); later copies of
    /// either buffer on other streams wait for it, and neither buffer is freed before it ends.
    /// The call returns once the copy is queued.
    ///
    /// ```no_run
    /// use cuda_pinned::{DeviceBuffer, Stream};
    /// let stream = Stream::new()?;
    /// let weights = DeviceBuffer::from_slice(&[0.5f32; 1024])?;
    /// let mut copy = DeviceBuffer::<f32>::zeroed(1024)?;
    /// stream.copy_device_to_device(&weights, &mut copy)?;
    /// stream.copy_device_to_device(weights.slice(..16), copy.slice_mut(1008..))?;
    /// assert_eq!(copy.to_vec()?[1008], 0.5);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LengthsDiffer`] when the lengths differ, [`Error::DeviceMismatch`] for a
    /// stream on neither buffer's device, [`Error::Capturing`] on a stream capturing a graph,
    /// or on which either buffer [recorded](crate::DeviceBuffer::record_stream) a stream that
    /// is capturing one (nothing is queued), or the CUDA error.
    pub fn copy_device_to_device<'s, 'd, T: Copy + 's + 'd>(
        &self,
        src: impl Into<DeviceSlice<'s, T>>,
        dst: impl Into<DeviceSliceMut<'d, T>>,
    ) -> Result<()> {
        let (src, dst) = (src.into().range, dst.into().range);
        if src.len != dst.len {
            return Err(Error::LengthsDiffer {
                src: src.len,
                dst: dst.len,
            });
        }
        let stream_device = self.device().raw();
        if stream_device != src.device {
            crate::gpu::device::check_same_device("the stream", dst.device, stream_device)?;
        }
        let bytes = src.len * size_of::<T>();
        // SAFETY: both ranges lie in live device allocations borrowed for this call, each
        // `bytes` long (the lengths match); `dst` is borrowed uniquely, so it is neither
        // `src` nor overlapping it, and nothing else writes it meanwhile. Both buffers
        // record the copy's event and are freed only after it.
        unsafe { queue_tracked(self, dst.address, src.address, bytes, &[src, dst]) }
    }
}

/// Queues a copy of `bytes` from `src` to `dst` (device addresses, or any that unified
/// addressing tells apart) on `stream`, ordered after the copies of `ranges` on other streams,
/// which then record its event. A copy that fails after it may have been queued is waited for.
///
/// # Safety
///
/// `src` is readable and `dst` writable for `bytes` until the copy has finished, the two do
/// not overlap, and nothing else writes either meanwhile: the ranges given cover the memory of
/// this crate's buffers among them, and other memory is the caller's to keep.
pub(crate) unsafe fn queue_tracked(
    stream: &Stream,
    dst: u64,
    src: u64,
    bytes: usize,
    ranges: &[DeviceRange<'_>],
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let _span = tracing::debug_span!(
        "copy",
        direction = %"device to device",
        bytes,
        memory = %"device",
        stream = ?stream.as_raw(),
        device = stream.device().raw(),
    )
    .entered();
    // The copy's event once it is recorded and tracked, for the error paths.
    let mut ended = None;
    let queued = crate::gpu::fence::enqueue(stream, |stream| {
        for range in ranges {
            range.pending.order_before(stream)?;
        }
        // SAFETY: as the caller promised; the default kind lets unified addressing tell the
        // memory apart (a peer copy between devices).
        let copied = unsafe {
            crate::raw::copy::copy_default(
                dst as *mut c_void,
                src as *const c_void,
                bytes,
                stream.as_raw(),
            )
        };
        match copied.and_then(|()| stream.record_event_untimed()) {
            Ok(event) => {
                let event = Arc::new(event);
                for range in ranges {
                    range.pending.track(stream, event.clone());
                }
                ended = Some(event);
                Ok(())
            }
            Err(error) => {
                // Queued or not, nothing records the copy: it is waited for before the
                // buffers' borrows end. (Should even that fail, the device's context is lost
                // and runs nothing more.)
                let _ = stream.synchronize();
                Err(error)
            }
        }
    });
    if queued.is_err()
        && let Some(event) = ended
    {
        // The copy was queued and tracked on this crate's buffers, but the fence around it
        // failed: the caller's stream was not made to wait for it, so memory that only that
        // stream orders (cudarc's) is kept until the copy ends here.
        let _ = event.synchronize();
    }
    queued
}
