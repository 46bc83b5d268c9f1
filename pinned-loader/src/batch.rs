//! `HostBatch`: a batch in pinned memory, the slots batches are made in, and a batch's fields
//! as host buffers that copies take by value.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use bytemuck::Pod;
use cuda_pinned::{HostBuffer, PendingUses, Transfer};
use pinned_pool::Pool;

use crate::arena::{Arena, Part};
use crate::fields::Fields;

/// One field's pinned region of a slot: ready for the host, still being read by an upload,
/// given back by a user's copy that may still run, or lost (to a failed upload; made anew when
/// the slot is next filled).
pub(crate) enum Region {
    Ready(Part),
    Uploading(Transfer<Part>),
    Released(Released),
    Lost,
}

/// The pinned memory one batch is made in: a region per field, each with room for a full
/// batch. Slots are made before the first batch and recycled, so the hot path pins nothing.
pub(crate) struct Slot {
    pub(crate) regions: Vec<Region>,
}

impl Slot {
    /// `count` slots of zeroed regions of `bytes[k]` each, all from one pinned allocation
    /// (zeroed on up to `threads` threads).
    pub(crate) fn many(
        pool: &Arc<Pool>,
        bytes: &[usize],
        count: usize,
        threads: usize,
    ) -> cuda_pinned::Result<Vec<Self>> {
        let sizes: Vec<usize> = (0..count).flat_map(|_| bytes.iter().copied()).collect();
        let mut parts = Arena::parts(pool, &sizes, threads)?.into_iter();
        Ok((0..count)
            .map(|_| Self {
                regions: parts
                    .by_ref()
                    .take(bytes.len())
                    .map(Region::Ready)
                    .collect(),
            })
            .collect())
    }

    /// One slot, pinned on its own.
    pub(crate) fn new(pool: &Arc<Pool>, bytes: &[usize]) -> cuda_pinned::Result<Self> {
        let mut slots = Self::many(pool, bytes, 1, 1)?;
        Ok(slots.pop().expect("one slot was made"))
    }

    /// The regions, each `bytes[k]` long, once every upload from them has finished. A region
    /// whose upload cannot be waited for (the device failed) is lost, and a new one pinned;
    /// the lost one's block is then never given back (it may still be read), and with it
    /// every slot made alongside.
    pub(crate) fn ready(
        &mut self,
        pool: &Arc<Pool>,
        bytes: &[usize],
    ) -> cuda_pinned::Result<Vec<&mut [u8]>> {
        for (region, &full) in self.regions.iter_mut().zip(bytes) {
            let part = match std::mem::replace(region, Region::Lost) {
                Region::Ready(part) => Some(part),
                Region::Uploading(upload) => upload.wait().ok(),
                Region::Released(released) => released.wait(),
                Region::Lost => None,
            };
            let mut part = match part {
                Some(part) => part,
                None => Arena::parts(pool, &[full], 1)?
                    .pop()
                    .expect("one part was made"),
            };
            // A short batch's upload sent less; the region is whole again.
            part.set_len(part.room());
            *region = Region::Ready(part);
        }
        Ok(self
            .regions
            .iter_mut()
            .map(|region| match region {
                Region::Ready(part) => part.as_mut_slice(),
                _ => unreachable!("every region was made ready above"),
            })
            .collect())
    }
}

/// Free slots, shared by the workers, the consumer's batches and the uploads.
#[derive(Default)]
pub(crate) struct SlotPool {
    free: Mutex<Vec<Slot>>,
}

impl SlotPool {
    pub(crate) fn take(&self) -> Option<Slot> {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    pub(crate) fn give(&self, slot: Slot) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
    }

    /// Drops every free slot. The pool gets a block back, after any pending upload, once
    /// every slot cut from it is gone: batches still held keep theirs.
    pub(crate) fn clear(&self) {
        let slots = std::mem::take(&mut *self.free.lock().unwrap_or_else(PoisonError::into_inner));
        drop(slots);
    }
}

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
        let lent = Arc::new(Lent {
            regions: Mutex::new(slot.regions.iter().map(|_| Region::Lost).collect()),
            home: self.home.clone(),
        });
        let samples = self.len;
        let mut buffers = slot
            .regions
            .into_iter()
            .zip(self.sample_bytes.iter())
            .enumerate()
            .map(|(index, (region, &bytes))| {
                let Region::Ready(mut part) = region else {
                    unreachable!("a delivered batch is ready")
                };
                part.set_len(samples * bytes);
                FieldBuffer {
                    part: Some(part),
                    index,
                    lent: lent.clone(),
                    _element: PhantomData,
                }
            });
        self.fields.buffers(&mut buffers)
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

/// One field of a [`HostBatch`] as a host buffer of its own ([`HostBatch::into_buffers`]):
/// `len` samples of the field in pinned memory, which async copies take by value.
///
/// The batch's memory goes back to its loader once every field buffer of the batch is dropped,
/// after the copies that used them.
pub struct FieldBuffer<T> {
    /// `None` only once given back.
    part: Option<Part>,
    index: usize,
    lent: Arc<Lent>,
    _element: PhantomData<T>,
}

/// The regions of a slot whose fields are lent out as buffers; the slot goes home when the
/// last buffer is gone.
struct Lent {
    regions: Mutex<Vec<Region>>,
    home: Arc<SlotPool>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        let regions = std::mem::take(
            self.regions
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        self.home.give(Slot { regions });
    }
}

impl FieldBuffer<u8> {
    /// The same bytes as elements of `T`.
    pub(crate) fn cast<T: Pod>(mut self) -> FieldBuffer<T> {
        let bytes = self.part().as_slice();
        assert!(
            bytes.len().is_multiple_of(size_of::<T>().max(1))
                && (bytes.as_ptr() as usize).is_multiple_of(align_of::<T>()),
            "a field's region holds whole, aligned elements"
        );
        FieldBuffer {
            part: self.part.take(),
            index: self.index,
            lent: self.lent.clone(),
            _element: PhantomData,
        }
    }
}

impl<T: Pod> FieldBuffer<T> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        bytemuck::cast_slice(self.part().as_slice())
    }

    /// The elements, writable (a download lands here; a transform before an upload).
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.part_mut().as_mut_slice())
    }
}

impl<T> FieldBuffer<T> {
    fn part(&self) -> &Part {
        self.part
            .as_ref()
            .expect("a field buffer has its part until it is given back")
    }

    fn part_mut(&mut self) -> &mut Part {
        self.part
            .as_mut()
            .expect("a field buffer has its part until it is given back")
    }

    /// Puts the region back into its slot.
    fn give_back(&mut self, region: impl FnOnce(Part) -> Region) {
        if let Some(part) = self.part.take() {
            let mut regions = self
                .lent
                .regions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            regions[self.index] = region(part);
        }
    }
}

impl<T> Drop for FieldBuffer<T> {
    fn drop(&mut self) {
        self.give_back(Region::Ready);
    }
}

impl<T> std::fmt::Debug for FieldBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FieldBuffer")
            .field(
                "bytes",
                &self.part.as_ref().map_or(0, |part| part.as_slice().len()),
            )
            .finish_non_exhaustive()
    }
}

// SAFETY: the buffer owns its part: `len` initialised bytes of page-locked memory that nothing
// else reaches, on the heap (moving the buffer moves no bytes), holding whole, aligned `T`s
// (checked when it was cast), and any bit pattern is a `T` (`Pod`). Released, the part goes
// back to its slot with `pending` (`Released`), which the loader waits for before it writes the
// region again; should waiting fail, or the slot be dropped first, the uses go to the arena,
// which waits for them before its block goes back to the pool, or leaks it.
unsafe impl<T: Pod> HostBuffer for FieldBuffer<T> {
    type Elem = T;

    fn host_parts(&mut self) -> (*mut T, usize) {
        let elements = self.as_mut_slice();
        (elements.as_mut_ptr(), elements.len())
    }

    fn release_after(mut self, pending: PendingUses) {
        self.give_back(|part| Region::Released(Released(Some((part, pending)))));
    }
}

/// A region given back by a user's copy that may still use it. Waited for before the loader
/// writes it again; dropped unwaited (the slot dropped with its loader), it hands the uses to
/// the arena, which waits for them before its block goes back to the pool.
pub(crate) struct Released(pub(crate) Option<(Part, PendingUses)>);

impl Released {
    /// The part once the uses have ended; `None` (the uses handed to the arena) if waiting failed.
    fn wait(mut self) -> Option<Part> {
        let (part, uses) = self.0.take().expect("taken once");
        match uses.wait() {
            Ok(()) => Some(part),
            Err(_) => {
                part.release_after(uses);
                None
            }
        }
    }
}

impl Drop for Released {
    fn drop(&mut self) {
        if let Some((part, uses)) = self.0.take() {
            part.release_after(uses);
        }
    }
}
