//! The crew's device: CUDA, through cuda-pinned's streams, events and raw copies.

use cuda_pinned::{Device, Event, RawCopy, RawCopy2d, Stream};

use super::{Bases, Dma};
use crate::error::Result;
use crate::plan::ChunkCopy;

/// CUDA, on one device.
pub(crate) struct Cuda {
    pub(crate) device: Device,
}

impl Dma for Cuda {
    type Stream = Stream;
    type Event = Event;

    fn event(&self) -> Result<Event> {
        Ok(Event::untimed_on(self.device)?)
    }

    unsafe fn copy(
        &self,
        stream: &Stream,
        chunk: *const u8,
        copies: &[ChunkCopy],
        bases: &Bases,
    ) -> Result<()> {
        let address = |copy: &ChunkCopy| chunk.wrapping_add(copy.from) as u64;
        let dense: Vec<RawCopy> = copies
            .iter()
            .filter(|copy| copy.rows == 1)
            .map(|copy| RawCopy {
                dst: bases.of(copy.target) + copy.dst,
                src: address(copy),
                bytes: copy.width,
            })
            .collect();
        // SAFETY: each source lies in the chunk's filled bytes, left alone until the chunk's
        // event completes; each destination is device memory the job's owner lent (the
        // contract); the chunk is page-locked.
        unsafe { stream.copy_batch_raw(&dense) }?;
        for copy in copies.iter().filter(|copy| copy.rows > 1) {
            let strided = RawCopy2d {
                dst: bases.of(copy.target) + copy.dst,
                dst_pitch: copy.width,
                src: address(copy),
                src_pitch: copy.pitch,
                width: copy.width,
                rows: copy.rows,
            };
            // SAFETY: as above, for every row.
            unsafe { stream.copy_2d_raw(&strided) }?;
        }
        Ok(())
    }

    fn record(&self, event: &mut Event, stream: &Stream) -> Result<()> {
        Ok(event.record(stream)?)
    }

    fn wait(&self, event: &Event) -> Result<()> {
        Ok(event.synchronize()?)
    }

    fn wait_stream(&self, stream: &Stream) -> Result<()> {
        Ok(stream.synchronize()?)
    }

    fn use_device(&self) -> Result<()> {
        Ok(self.device.set_current()?)
    }
}
