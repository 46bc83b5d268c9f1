//! `HostBatch`: a batch in pinned memory, as a loader delivers it.

use std::ops::Range;
use std::sync::Arc;

use crate::fields::Fields;
use crate::slot::{Region, Slot, SlotPool};

/// A batch in pinned memory, as a loader delivers it: read its fields with
/// [`fields`](Self::fields); dropping it gives its memory back to the loader for a later batch.
///
/// Its memory is part of the loader's one pinned block: a batch kept after its loader is dropped
/// keeps that whole block from going back to the pool.
pub struct HostBatch<F: Fields> {
    pub(crate) slot: Option<Slot>,
    pub(crate) len: usize,
    pub(crate) index: usize,
    /// The epoch's order, and this batch's range of it: shared, not copied per batch.
    pub(crate) order: Arc<Vec<usize>>,
    pub(crate) range: Range<usize>,
    pub(crate) fields: F,
    pub(crate) sample_bytes: Arc<[usize]>,
    pub(crate) home: Arc<SlotPool>,
}

impl<F: Fields> HostBatch<F> {
    /// Samples in the batch (the last of an epoch may be short).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch has no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The batch's number in its epoch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The dataset indices of the batch's samples, in the order the batch holds them.
    ///
    /// Sample `j` of every field is dataset sample `indices()[j]`: with shuffling, sharding
    /// or batches out of order, this is what the batch was trained on.
    pub fn indices(&self) -> &[usize] {
        &self.order[self.range.clone()]
    }

    /// The fields: for `(Field<u8>, Field<i64>)`, `(&[u8], &[i64])` of `len` samples each.
    pub fn fields(&self) -> F::Host<'_> {
        let slot = self.slot.as_ref().expect("a delivered batch has its slot");
        let mut regions = slot.regions.iter().zip(self.sample_bytes.iter()).map(
            |(region, &bytes)| match region {
                Region::Ready(part) => &part.as_slice()[..self.len * bytes],
                _ => unreachable!("a delivered batch is ready"),
            },
        );
        self.fields.host(&mut regions)
    }

    /// The fields as host buffers that async copies take by value: for `(Field<u8>,
    /// Field<i64>)`, `(FieldBuffer<u8>, FieldBuffer<i64>)` of `len` samples each.
    ///
    /// Hand them to [`Stream::copy_to_device`](cuda_pinned::Stream::copy_to_device), or to
    /// cudarc's stream through [`CudarcCopies`](cuda_pinned::CudarcCopies) (the `cudarc`
    /// feature): the batch is already pinned, so nothing is copied on the host. The loader
    /// gets the batch's memory back once every buffer is dropped and every copy of them has
    /// ended.
    ///
    /// ```no_run
    /// use cuda_pinned::{DeviceBuffer, Stream};
    /// use pinned_loader::{Dataset, Field, Loader, LoaderConfig};
    ///
    /// fn upload_all<D>(images: D) -> Result<(), Box<dyn std::error::Error>>
    /// where
    ///     D: Dataset<Fields = (Field<u8>, Field<i64>)>,
    /// {
    ///     let mut loader = Loader::new(images, LoaderConfig::new(16).drop_last(true))?;
    ///     let stream = Stream::new()?;
    ///     let mut on_device = DeviceBuffer::<u8>::zeroed(16 * 3072)?;
    ///     for batch in loader.epoch(0) {
    ///         let (images, labels) = batch?.into_buffers();
    ///         let upload = stream.copy_to_device(images, &mut on_device)?;
    ///         // ... queue work on `stream`, read `labels` on the host ...
    ///         drop(upload); // the loader gets the memory back once the copy has ended
    ///     }
    ///     Ok(())
    /// }
    /// ```
    pub fn into_buffers(mut self) -> F::Buffers {
        let slot = self.slot.take().expect("a delivered batch has its slot");
        let lens: Vec<usize> = self.sample_bytes.iter().map(|b| self.len * b).collect();
        let buffers = crate::field_buffer::lend(slot, &lens, self.home.clone());
        self.fields.buffers(&mut buffers.into_iter())
    }

    /// Takes the slot out (the batch then gives nothing back when dropped).
    pub(crate) fn into_slot(mut self) -> Slot {
        self.slot.take().expect("a delivered batch has its slot")
    }
}

impl<F: Fields> Drop for HostBatch<F> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.home.give(slot);
        }
    }
}

impl<F: Fields> std::fmt::Debug for HostBatch<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("index", &self.index)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}
