//! The device of a ring: the CUDA runtime, through this crate's streams and events.

use super::{Dma, RingCopy, Way};
use crate::copy::batch::{RawCopy, RawCopy2d};
use crate::error::Result;
use crate::gpu::device::Device;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;
use crate::raw::copy::Direction;

/// The CUDA runtime, on one device.
#[derive(Clone, Copy, Debug)]
pub struct Cuda {
    device: Device,
}

impl Cuda {
    /// The runtime, copying to and from `device`.
    pub fn on(device: Device) -> Self {
        Self { device }
    }
}

impl Dma for Cuda {
    type Stream = Stream;
    type Event = Event;

    fn event(&self) -> Result<Event> {
        Event::untimed_on(self.device)
    }

    fn enqueue<R>(&self, stream: &Stream, work: impl FnOnce(&Stream) -> Result<R>) -> Result<R> {
        crate::gpu::fence::enqueue(stream, work)
    }

    unsafe fn queue(&self, stream: &Stream, copies: &[RingCopy], way: Way) -> Result<()> {
        if let [copy] = copies
            && copy.rows == 1
        {
            // SAFETY: forwarded from the caller.
            return unsafe { queue_plain(stream, copy, way) };
        }
        let (plain, strided): (Vec<&RingCopy>, Vec<&RingCopy>) =
            copies.iter().partition(|copy| copy.rows == 1);
        // Several plain uploads out of one chunk (small tensors): one batch call, where the
        // runtime has it, costs the DMA engine less than a call each.
        if way == Way::Upload && plain.len() > 1 {
            let batch: Vec<RawCopy> = (plain.iter())
                .map(|copy| RawCopy {
                    dst: copy.device,
                    src: copy.host as u64,
                    bytes: copy.width,
                })
                .collect();
            // SAFETY: forwarded from the caller: each host range is page-locked and valid,
            // each device range too, until an event after them completes.
            unsafe { stream.copy_batch_raw(&batch) }?;
        } else {
            for copy in plain {
                // SAFETY: forwarded from the caller.
                unsafe { queue_plain(stream, copy, way) }?;
            }
        }
        for copy in strided {
            let (host, device) = (copy.host as u64, copy.device);
            let raw = match way {
                Way::Upload => RawCopy2d {
                    dst: device,
                    dst_pitch: copy.width,
                    src: host,
                    src_pitch: copy.host_pitch,
                    width: copy.width,
                    rows: copy.rows,
                },
                Way::Download => RawCopy2d {
                    dst: host,
                    dst_pitch: copy.host_pitch,
                    src: device,
                    src_pitch: copy.width,
                    width: copy.width,
                    rows: copy.rows,
                },
            };
            // SAFETY: as above, for every row.
            unsafe { stream.copy_2d_raw(&raw) }?;
        }
        Ok(())
    }

    fn record(&self, event: &Event, stream: &Stream) -> Result<()> {
        event.record_shared(stream)?;
        // A capture begun on the stream (by another thread) since the copies were queued
        // took in the copies and this event: the chunk is then lost.
        stream.refuse_capture()
    }

    fn wait(&self, event: &Event) -> Result<()> {
        event.synchronize()
    }

    fn seen_finished(&self, event: &Event) -> bool {
        event.seen_finished()
    }

    fn finished(&self, event: &Event) -> Result<bool> {
        event.query()
    }

    fn wait_stream(&self, stream: &Stream) -> Result<()> {
        stream.synchronize()
    }

    fn device(&self) -> i32 {
        self.device.raw()
    }

    fn use_device(&self) -> Result<()> {
        self.device.set_current()
    }
}

/// Queues one plain copy, cut where buffers registered in chunks end.
///
/// # Safety
///
/// As [`Dma::queue`], for `copy` (one row); the calling thread's current device is the
/// stream's ([`Dma::enqueue`] makes it so).
unsafe fn queue_plain(stream: &Stream, copy: &RingCopy, way: Way) -> Result<()> {
    let device = copy.device as *mut std::ffi::c_void;
    let host = copy.host.cast::<std::ffi::c_void>();
    let (dst, src, direction) = match way {
        Way::Upload => (device, host.cast_const(), Direction::HostToDevice),
        Way::Download => (host, device.cast_const(), Direction::DeviceToHost),
    };
    // SAFETY: forwarded from the caller; the stream is live while borrowed.
    unsafe { crate::copy::split::queue(dst, src, copy.width, direction, stream.as_raw()) }
}
