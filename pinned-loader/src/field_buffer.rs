//! A batch's fields as host buffers of their own, which async copies take by value; the slot
//! goes back to the loader once the last of them is gone.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

use bytemuck::Pod;
use cuda_pinned::{HostBuffer, PendingUses};

use crate::arena::Part;
use crate::slot::{Region, Released, Slot, SlotPool};

/// One field of a [`HostBatch`](crate::HostBatch) as a host buffer of its own ([`HostBatch::into_buffers`](crate::HostBatch::into_buffers)):
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

/// The regions of `slot` as buffers of bytes, `lens[k]` bytes of region `k` each; the slot goes
/// back to `home` once every buffer is gone.
pub(crate) fn lend(slot: Slot, lens: &[usize], home: Arc<SlotPool>) -> Vec<FieldBuffer<u8>> {
    let lent = Arc::new(Lent {
        regions: Mutex::new(slot.regions.iter().map(|_| Region::Lost).collect()),
        home,
    });
    slot.regions
        .into_iter()
        .zip(lens)
        .enumerate()
        .map(|(index, (region, &len))| {
            let Region::Ready(mut part) = region else {
                unreachable!("a delivered batch is ready")
            };
            part.set_len(len);
            FieldBuffer {
                part: Some(part),
                index,
                lent: lent.clone(),
                _element: PhantomData,
            }
        })
        .collect()
}
