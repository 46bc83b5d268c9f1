//! `PinMemory`: pinning a host value, PyTorch's `pin_memory()` for your own batch types.

use crate::containers::vec::PinnedVec;
use crate::error::Result;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::default::DefaultPinned;

/// A host value that can be copied into page-locked memory, like a PyTorch batch's `pin_memory()`.
///
/// Implemented for slices, `Vec`, arrays, `Option` and tuples of up to four, so a batch type needs
/// a few lines:
///
/// ```
/// use cuda_pinned::{PinMemory, PinnedAllocator, PinnedVec, Result};
///
/// struct Batch { images: Vec<u8>, labels: Vec<i64> }
/// struct PinnedBatch<A: PinnedAllocator> { images: PinnedVec<u8, A>, labels: PinnedVec<i64, A> }
///
/// impl PinMemory for Batch {
///     type Pinned<A: PinnedAllocator + Clone> = PinnedBatch<A>;
///     fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<PinnedBatch<A>> {
///         Ok(PinnedBatch {
///             images: self.images.pin_memory_in(allocator.clone())?,
///             labels: self.labels.pin_memory_in(allocator)?,
///         })
///     }
/// }
///
/// let batch = Batch { images: vec![7; 3 * 32 * 32], labels: vec![1, 2, 3] };
/// let pinned = batch.pin_memory()?;
/// assert_eq!(pinned.labels, [1, 2, 3][..]);
/// # Ok::<(), cuda_pinned::Error>(())
/// ```
pub trait PinMemory {
    /// The pinned counterpart, with memory from `A`.
    type Pinned<A: PinnedAllocator + Clone>;

    /// Copies the value into memory from `allocator` (`&pool`, an `Arc` of a pool, or any
    /// other allocator: cloned for each buffer).
    ///
    /// # Errors
    ///
    /// The allocator's error.
    fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<Self::Pinned<A>>;

    /// Copies the value into memory from [`DefaultPinned`].
    ///
    /// # Errors
    ///
    /// The allocator's error.
    fn pin_memory(&self) -> Result<Self::Pinned<DefaultPinned>> {
        self.pin_memory_in(DefaultPinned)
    }
}

impl<T: Clone> PinMemory for [T] {
    type Pinned<A: PinnedAllocator + Clone> = PinnedVec<T, A>;
    fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<PinnedVec<T, A>> {
        PinnedVec::from_slice_in(self, allocator)
    }
}

impl<T: Clone> PinMemory for Vec<T> {
    type Pinned<A: PinnedAllocator + Clone> = PinnedVec<T, A>;
    fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<PinnedVec<T, A>> {
        self.as_slice().pin_memory_in(allocator)
    }
}

impl<T: Clone, const N: usize> PinMemory for [T; N] {
    type Pinned<A: PinnedAllocator + Clone> = PinnedVec<T, A>;
    fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<PinnedVec<T, A>> {
        self.as_slice().pin_memory_in(allocator)
    }
}

impl<T: PinMemory> PinMemory for Option<T> {
    type Pinned<A: PinnedAllocator + Clone> = Option<T::Pinned<A>>;
    fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<Self::Pinned<A>> {
        self.as_ref()
            .map(|value| value.pin_memory_in(allocator))
            .transpose()
    }
}

macro_rules! pin_tuple {
    ($($name:ident),+) => {
        impl<$($name: PinMemory),+> PinMemory for ($($name,)+) {
            type Pinned<A: PinnedAllocator + Clone> = ($($name::Pinned<A>,)+);
            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn pin_memory_in<A: PinnedAllocator + Clone>(&self, allocator: A) -> Result<Self::Pinned<A>> {
                let ($($name,)+) = self;
                Ok(($($name.pin_memory_in(allocator.clone())?,)+))
            }
        }
    };
}

pin_tuple!(T1);
pin_tuple!(T1, T2);
pin_tuple!(T1, T2, T3);
pin_tuple!(T1, T2, T3, T4);
