//! The allocator trait behind every pinned container, and the record of work that may still
//! use a buffer when it is dropped.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::event::Event;
use crate::memory::flags::HostAllocFlags;

/// Which kind of page-locked memory an allocation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// `cudaHostAlloc` with these flags.
    CudaHost(HostAllocFlags),
    /// Memory this crate mapped (huge pages, pre-faulted) and registered with
    /// `cudaHostRegister`.
    Registered,
    /// A caller's memory, registered with `cudaHostRegister` for as long as it is borrowed.
    Registration,
    /// `mlock`ed host memory on a machine without CUDA: page-locked, but unknown to any GPU,
    /// so copies from it are staged by the driver like pageable memory.
    HostLocked,
    /// Host memory created through CUDA's virtual-memory API (`cuMemCreate`) on a host NUMA
    /// node, in chunks mapped into one reserved range ([`VirtualHost`](crate::VirtualHost)).
    VirtualHost,
}

impl MemoryKind {
    /// Whether a CUDA device can DMA directly from or to this memory.
    pub fn is_cuda_pinned(self) -> bool {
        !matches!(self, Self::HostLocked)
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CudaHost(flags) => write!(f, "cudaHostAlloc({flags})"),
            Self::Registered => f.write_str("registered"),
            Self::Registration => f.write_str("user-registered"),
            Self::HostLocked => f.write_str("mlock"),
            Self::VirtualHost => f.write_str("cuMemCreate(host NUMA node)"),
        }
    }
}

/// One block of page-locked memory handed out by a [`PinnedAllocator`].
#[derive(Debug, PartialEq, Eq)]
pub struct Allocation {
    ptr: NonNull<u8>,
    bytes: usize,
    kind: MemoryKind,
    tag: usize,
}

// SAFETY: an `Allocation` is a description of memory (address, size, kind); it grants no
// access by itself, and every use of the address goes through unsafe code with its own proof.
unsafe impl Send for Allocation {}

// SAFETY: as above; `&Allocation` only reads plain fields.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// Describes `bytes` bytes at `ptr` of the given kind. `tag` is the allocator's own word
    /// (a block index, say) and is handed back on deallocation.
    #[inline]
    pub const fn new(ptr: NonNull<u8>, bytes: usize, kind: MemoryKind, tag: usize) -> Self {
        Self {
            ptr,
            bytes,
            kind,
            tag,
        }
    }

    /// The start of the block.
    #[inline]
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Usable bytes: at least what was asked for.
    #[inline]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The kind of memory.
    #[inline]
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The allocator's own word.
    #[inline]
    pub fn tag(&self) -> usize {
        self.tag
    }

    /// The block's address in the device's address space.
    ///
    /// It serves kernels that read or write host memory directly: mapped memory, or any CUDA-pinned
    /// memory on systems with unified addressing.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for `mlock`ed memory; the CUDA error when the memory is not
    /// mapped.
    pub fn device_ptr(&self) -> Result<u64> {
        if !self.kind.is_cuda_pinned() {
            return Err(Error::Unsupported("mlock-ed memory has no device address"));
        }
        crate::context::on_current_device(|| crate::raw::memory::host_device_pointer(self.ptr))
    }
}

/// A source of page-locked memory for [`PinnedVec`](crate::PinnedVec),
/// [`PinnedBox`](crate::PinnedBox) and the pool.
///
/// # Safety
///
/// Implementors promise that:
/// - a successful [`allocate`](Self::allocate) returns memory that is valid for reads and
///   writes of [`Allocation::bytes`] ≥ `layout.size()` bytes, aligned to `layout.align()`,
///   page-locked as its [`MemoryKind`] says, and used by nobody else until it is given back;
/// - a successful [`grow_in_place`](Self::grow_in_place) that returns `Some(grown)` leaves the
///   memory where it was (`grown.ptr()` is the old address) with its contents kept, and
///   `grown` describes ≥ `layout.size()` bytes valid as above, none of them used by anybody
///   else or by pending device work; `grown` replaces the old allocation from then on;
/// - the memory stays valid until it is passed to [`deallocate`](Self::deallocate) or
///   [`deallocate_after`](Self::deallocate_after), and is not reused before the
///   [`PendingUses`] given with it have completed;
/// - no method calls back into the container that is allocating or freeing.
pub unsafe trait PinnedAllocator {
    /// Allocates page-locked memory for `layout` (`layout.size() > 0`).
    ///
    /// # Errors
    ///
    /// Whatever the kind of memory can fail with: no CUDA, out of memory, the memlock limit,
    /// an alignment above the page size.
    fn allocate(&self, layout: Layout) -> Result<Allocation>;

    /// Gives memory back at once.
    ///
    /// # Safety
    ///
    /// - `allocation` came from `allocate` (or the latest `grow_in_place` of it) on this
    ///   allocator (or a clone of it);
    /// - no work on any device still uses it, and nothing uses it afterwards.
    unsafe fn deallocate(&self, allocation: Allocation);

    /// Gives memory back once `pending` work is done. The default waits for it, then
    /// deallocates; if waiting fails (the device is in an error state) the memory is leaked,
    /// since a device that may still be writing it must not see it reused. A caching
    /// allocator keeps the block aside instead and reuses it once the work has finished.
    ///
    /// # Safety
    ///
    /// - `allocation` came from `allocate` (or the latest `grow_in_place` of it) on this
    ///   allocator (or a clone of it);
    /// - `pending` covers every use by device work that is not yet known to be finished;
    ///   nothing on the host uses the memory afterwards.
    unsafe fn deallocate_after(&self, allocation: Allocation, pending: PendingUses) {
        if pending.wait().is_ok() {
            // SAFETY: the pending work finished; the caller's guarantees cover the rest.
            unsafe { self.deallocate(allocation) };
        }
    }

    /// Makes `allocation` hold `layout.size()` bytes without moving it, if this allocator can:
    /// `Ok(Some(grown))` describes the same memory, now larger, with its contents kept, and
    /// replaces `allocation` (which must not be given back itself); `Ok(None)` means it cannot
    /// (a container then allocates anew and copies). The default cannot.
    ///
    /// # Errors
    ///
    /// What getting the extra memory failed with; `allocation` is unchanged.
    ///
    /// # Safety
    ///
    /// - `allocation` came from `allocate` (or an earlier growth) on this allocator and has not
    ///   been given back;
    /// - `layout` has `allocation`'s alignment.
    unsafe fn grow_in_place(
        &self,
        allocation: &Allocation,
        layout: Layout,
    ) -> Result<Option<Allocation>> {
        let _ = (allocation, layout);
        Ok(None)
    }

    /// How many NUMA nodes this allocator places memory on, numbered `0..numa_nodes()`: 1
    /// (the default) when it does not choose, or the machine has one. A caching pool keeps
    /// blocks of each node apart.
    fn numa_nodes(&self) -> usize {
        1
    }

    /// The node (below [`numa_nodes`](Self::numa_nodes)) that an allocation made now, from
    /// the calling thread, goes on: with the crate's allocators, the node nearest the
    /// current device.
    fn numa_node(&self) -> usize {
        0
    }
}

/// Work on devices that may still read or write a buffer: events recorded after its last use
/// on each stream. Handed to [`PinnedAllocator::deallocate_after`] when a buffer is dropped.
#[derive(Debug, Default)]
pub struct PendingUses {
    events: Vec<Arc<Event>>,
}

impl PendingUses {
    /// Nothing pending.
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether no event is left to wait for.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Forgets the events that have finished; `Ok(true)` when none is left.
    ///
    /// # Errors
    ///
    /// A CUDA error from querying an event; the events stay.
    pub fn poll(&mut self) -> Result<bool> {
        let mut first_error = None;
        self.events.retain(|event| match event.query() {
            Ok(done) => !done,
            Err(e) => {
                first_error.get_or_insert(e);
                true
            }
        });
        match first_error {
            Some(e) => Err(e),
            None => Ok(self.events.is_empty()),
        }
    }

    /// Blocks until every event has finished.
    ///
    /// # Errors
    ///
    /// A CUDA error from waiting.
    pub fn wait(&self) -> Result<()> {
        self.events.iter().try_for_each(|event| event.synchronize())
    }

    pub(crate) fn push(&mut self, event: Arc<Event>) {
        self.events.push(event);
    }

    /// Adds every event of `other`.
    pub(crate) fn extend(&mut self, other: PendingUses) {
        self.events.extend(other.events);
    }

    pub(crate) fn from_event(event: Arc<Event>) -> Self {
        Self {
            events: vec![event],
        }
    }
}

/// Implements [`PinnedAllocator`] for a pointer to an allocator by forwarding every method
/// to the allocator it points to.
macro_rules! forward_allocator {
    ($pointer:ty) => {
        // SAFETY: every call goes to the one allocator the pointer reaches (the referent of a
        // `&A`, the shared value of every clone of an `Arc<A>`), so an allocation is given
        // back to the allocator that made it, under that allocator's own contract.
        unsafe impl<A: PinnedAllocator + ?Sized> PinnedAllocator for $pointer {
            #[inline]
            fn allocate(&self, layout: Layout) -> Result<Allocation> {
                (**self).allocate(layout)
            }

            #[inline]
            unsafe fn deallocate(&self, allocation: Allocation) {
                // SAFETY: forwarded from the caller.
                unsafe { (**self).deallocate(allocation) }
            }

            #[inline]
            unsafe fn deallocate_after(&self, allocation: Allocation, pending: PendingUses) {
                // SAFETY: forwarded from the caller.
                unsafe { (**self).deallocate_after(allocation, pending) }
            }

            #[inline]
            unsafe fn grow_in_place(
                &self,
                allocation: &Allocation,
                layout: Layout,
            ) -> Result<Option<Allocation>> {
                // SAFETY: forwarded from the caller.
                unsafe { (**self).grow_in_place(allocation, layout) }
            }

            #[inline]
            fn numa_nodes(&self) -> usize {
                (**self).numa_nodes()
            }

            #[inline]
            fn numa_node(&self) -> usize {
                (**self).numa_node()
            }
        }
    };
}

forward_allocator!(&A);
forward_allocator!(Arc<A>);

/// Checks what every kind needs of a layout: a size, and an alignment it can give.
pub(crate) fn check_layout(layout: Layout) -> Result<()> {
    if layout.size() == 0 {
        return Err(Error::Unsupported(
            "zero-sized allocation (containers never ask for one)",
        ));
    }
    if layout.align() > crate::os::page_size() {
        return Err(Error::Unsupported("alignment above the page size"));
    }
    Ok(())
}
