//! Kind 5: page-locked host memory created through CUDA's virtual-memory API, in chunks mapped
//! into one reserved address range — the kind that never stalls other threads' copies and
//! grows without moving.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::OnceLock;

use crate::context::relaxed;
use crate::error::Error;
use crate::error::Result;
use crate::gpu::device::Device;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::allocator::check_layout;
use crate::os;
use crate::raw::vmm;

/// Page-locked host memory from `cuMemCreate` on a host NUMA node, mapped chunk by chunk into
/// an address range reserved with room to spare.
///
/// - **Never stalls other threads.** Each chunk is created and mapped on its own, so the
///   driver's lock is held for one chunk at a time, and another thread's small copy waits
///   far less than behind one registration or `cudaHostAlloc` of the same size.
/// - **Grows in place.** A [`PinnedVec`](crate::PinnedVec) of this kind grows by mapping more
///   chunks after its end: no copy, and the address stays. Each block reserves address space
///   to grow into (8× its size or 1 GiB, whichever is more: reserving takes microseconds and
///   no memory, but the unified address space it comes from is finite, about 10⁵ such
///   ranges); past it, growth falls back to a new block and a copy. A pool, whose blocks
///   never grow, should use [`fixed_size`](Self::fixed_size).
/// - **On the GPU's NUMA node.** The memory goes on the node nearest the current device
///   (CUDA's `HostNumaId`, else the kernel's), or on [`node`](Self::node).
/// - **One buffer, one copy.** A copy may span any number of chunks at full speed; every
///   device of the process that supports this kind can copy to and from it.
///
/// The cost: creating it is several times slower than registration, and sizes round up to the driver's granularity (2 MiB on x86-64 hosts; a
/// pool over this kind pins 2 MiB for each block of a smaller class, though its
/// `max_pinned_bytes` counts the class size). So [`DefaultPinned`](crate::DefaultPinned)
/// keeps registration, and this kind is for memory that is created ahead of need (a pool's
/// reserve), grows, or is made while other threads copy.
///
/// Needs CUDA 12.5 or newer, runtime and driver (the runtime hands out the driver's entry
/// points), and a device that supports host memory through the virtual-memory API
/// ([`Device::supports_virtual_host_memory`]); elsewhere allocation fails with an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtualHost {
    node: Option<u32>,
    chunk_bytes: usize,
    address_room: usize,
    room_factor: usize,
    prefault_threads: usize,
}

impl Default for VirtualHost {
    fn default() -> Self {
        Self::new()
    }
}

/// Chunks of 32 MiB bound how long one driver call holds its lock; larger ones create
/// slightly faster (`docs/tuning.md`).
const DEFAULT_CHUNK: usize = 32 << 20;
/// Address space reserved per block at least: a vector starting small grows to 1 GiB in place.
const DEFAULT_ROOM: usize = 1 << 30;
/// Address space reserved per block, as a multiple of its size.
const ROOM_FACTOR: usize = 8;
/// A block's tag is its reserved room (a multiple of the granularity, at least 4 KiB) with the
/// host NUMA node in the low bits.
const NODE_BITS_MASK: usize = 0xfff;

fn tag(room: usize, node: u32) -> usize {
    room | node as usize
}

fn room_of(tag: usize) -> usize {
    tag & !NODE_BITS_MASK
}

fn node_of(tag: usize) -> u32 {
    (tag & NODE_BITS_MASK) as u32
}

/// A failed map: the error, and whether the memory mapped before it was unmapped again (if
/// not, the range must not be given back).
struct MapFailure {
    error: Error,
    clean: bool,
}

/// What the process's devices and driver offer, found once.
#[derive(Debug)]
struct Platform {
    /// Devices that can use the memory; each gets access to every chunk.
    devices: Vec<i32>,
    /// The driver's allocation granularity for host memory.
    granularity: usize,
}

fn platform() -> Result<&'static Platform> {
    static PLATFORM: OnceLock<Platform> = OnceLock::new();
    if let Some(platform) = PLATFORM.get() {
        return Ok(platform);
    }
    // Not cached on failure: the error is rebuilt (and cheap) each time.
    let mut devices = Vec::new();
    for device in Device::all()? {
        if device.supports_virtual_host_memory()? {
            devices.push(device.ordinal() as i32);
        }
    }
    if devices.is_empty() {
        return Err(Error::Unsupported(
            "no device supports host memory through CUDA's virtual-memory API \
             (CUDA 12.5 or newer and a device that supports it are needed)",
        ));
    }
    // At least a page (4 KiB): the tag's low 12 bits are free for the node.
    let granularity = vmm::host_granularity(0)?.max(os::page_size());
    Ok(PLATFORM.get_or_init(|| Platform {
        devices,
        granularity,
    }))
}

impl VirtualHost {
    /// Growable memory on the current device's node, in chunks of 32 MiB.
    ///
    /// Memory on the current device's NUMA node, in chunks of 32 MiB, each block with room
    /// to grow in place to 8× its size or 1 GiB, whichever is more; pages are touched by up
    /// to 16 threads before the block is handed out.
    pub fn new() -> Self {
        Self {
            node: None,
            chunk_bytes: DEFAULT_CHUNK,
            address_room: DEFAULT_ROOM,
            room_factor: ROOM_FACTOR,
            prefault_threads: os::default_prefault_threads(),
        }
    }

    /// Places the memory on this host NUMA node (below 4096) instead of the current device's.
    pub fn node(self, node: u32) -> Self {
        Self {
            node: Some(node),
            ..self
        }
    }

    /// Creates and maps memory in chunks of this size (rounded to the granularity).
    ///
    /// The size is in bytes, rounded up to the granularity. Smaller chunks hold the driver's lock
    /// for less time, larger ones create a little faster.
    pub fn chunk_bytes(self, bytes: usize) -> Self {
        Self {
            chunk_bytes: bytes.max(1),
            ..self
        }
    }

    /// Address space each block reserves at least, so that it can grow in place up to it
    /// (a block also reserves 8× its size when that is more).
    pub fn address_room(self, bytes: usize) -> Self {
        Self {
            address_room: bytes,
            ..self
        }
    }

    /// Blocks reserve no room to grow: for a pool, whose blocks keep their size.
    pub fn fixed_size(self) -> Self {
        Self {
            address_room: 0,
            room_factor: 1,
            ..self
        }
    }

    /// Threads that touch every page of new memory before it is handed out (0: leave the first
    /// touch to the user).
    ///
    /// The CPU's view of this memory fills slowly on first touch; touching it here moves that cost
    /// off the first writes.
    pub fn prefault_threads(self, threads: usize) -> Self {
        Self {
            prefault_threads: threads,
            ..self
        }
    }

    /// The block size for `bytes`: rounded up to the granularity.
    fn block_bytes(bytes: usize, granularity: usize) -> Option<usize> {
        os::round_up(bytes, granularity)
    }

    /// The address space reserved for a block of `bytes`.
    fn room_for(&self, bytes: usize, granularity: usize) -> Option<usize> {
        let room = bytes
            .saturating_mul(self.room_factor)
            .max(self.address_room)
            .min(isize::MAX as usize / 2);
        os::round_up(room.max(bytes), granularity)
    }

    /// The allocation that `allocate` returned at `ptr` for a size up to its block, before any
    /// growth (for allocator-api2, which gives back a pointer and a layout).
    pub(crate) fn allocation_at(&self, ptr: NonNull<u8>, layout: Layout) -> Option<Allocation> {
        let granularity = platform().ok()?.granularity;
        let bytes = Self::block_bytes(layout.size(), granularity)?;
        let room = self.room_for(bytes, granularity)?;
        // Deallocation does not read the node.
        Some(Allocation::new(ptr, bytes, MemoryKind::VirtualHost, room))
    }

    /// The host NUMA node new memory goes on.
    fn target_node(&self) -> u32 {
        self.node.or_else(Device::current_numa_node).unwrap_or(0)
    }

    /// Creates and maps `bytes` at `at`, chunk by chunk, then touches the pages; on failure
    /// nothing of it stays mapped, unless unmapping failed too (`clean` says).
    ///
    /// # Safety
    ///
    /// - `at..at + bytes` lies inside a reserved range with nothing mapped there, both
    ///   multiples of the granularity.
    unsafe fn map(
        &self,
        platform: &Platform,
        at: NonNull<u8>,
        bytes: usize,
        node: u32,
    ) -> Result<(), MapFailure> {
        let chunk = os::round_up(self.chunk_bytes, platform.granularity).unwrap_or(bytes);
        let mut mapped = 0;
        while mapped < bytes {
            let piece = chunk.min(bytes - mapped);
            // SAFETY: `at + mapped` is inside the range (mapped < bytes) and unmapped;
            // offsets and pieces are multiples of the granularity.
            let start = unsafe { at.add(mapped) };
            // SAFETY: as above.
            let result = unsafe { map_host_memory(start, piece, node) }.and_then(|()| {
                mapped += piece;
                // SAFETY: the piece was just mapped.
                unsafe { vmm::open_host_memory(start, piece, node, &platform.devices) }
            });
            if let Err(error) = result {
                // SAFETY: what this call mapped, never handed out.
                let clean = mapped == 0 || unsafe { vmm::unmap(at, mapped) }.is_ok();
                return Err(MapFailure { error, clean });
            }
        }
        if self.prefault_threads > 0 {
            // SAFETY: freshly mapped, writable by the host, not yet handed out.
            unsafe { os::prefault(at, bytes, self.prefault_threads) };
        }
        Ok(())
    }
}

/// The driver's out-of-memory answer as the crate's [`Error::OutOfMemory`].
fn out_of_memory(error: Error, requested: usize) -> Error {
    match error {
        Error::Driver(e) if e.is_out_of_memory() => Error::OutOfMemory { requested },
        other => other,
    }
}

// SAFETY: the memory is created, mapped and opened to the host and every capable device
// before it is handed out (the reserved range is granularity-aligned, so page-aligned); it is
// unmapped and its range released only in `deallocate`. Growth in place maps new memory after
// the block's end inside its own reserved range and leaves the old bytes where they are.
unsafe impl PinnedAllocator for VirtualHost {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        check_layout(layout)?;
        let platform = platform()?;
        let granularity = platform.granularity;
        let bytes = Self::block_bytes(layout.size(), granularity).ok_or(Error::CapacityOverflow)?;
        let room = self
            .room_for(bytes, granularity)
            .ok_or(Error::CapacityOverflow)?;
        let node = self.target_node();
        if node as usize > NODE_BITS_MASK {
            return Err(Error::Unsupported("host NUMA nodes above 4095"));
        }
        // Relaxed: CUDA refuses these calls while another thread captures in global mode.
        let ptr = relaxed(|| vmm::address_reserve(room, granularity))?;
        // SAFETY: a fresh reservation of `room` ≥ `bytes`, granularity-aligned.
        if let Err(failure) = relaxed(|| unsafe { self.map(platform, ptr, bytes, node) }) {
            if failure.clean {
                // SAFETY: nothing is mapped in the range any more; it was never handed out.
                let _ = relaxed(|| unsafe { vmm::address_free(ptr, room) });
            }
            return Err(out_of_memory(failure.error, layout.size()));
        }
        Ok(Allocation::new(
            ptr,
            bytes,
            MemoryKind::VirtualHost,
            tag(room, node),
        ))
    }

    fn numa_nodes(&self) -> usize {
        os::numa_node_bound()
    }

    fn numa_node(&self) -> usize {
        (self.target_node() as usize).min(self.numa_nodes() - 1)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: mapped by `allocate` (and growth) over exactly `bytes`; unused, per the
        // caller. The tag holds the reserved room, given back once nothing is mapped in it.
        relaxed(|| unsafe {
            if vmm::unmap(allocation.ptr(), allocation.bytes()).is_ok() {
                let _ = vmm::address_free(allocation.ptr(), room_of(allocation.tag()));
            }
        });
        // If unmapping failed the memory may still be mapped: leaking it is the safe choice.
    }

    unsafe fn grow_in_place(
        &self,
        allocation: &Allocation,
        layout: Layout,
    ) -> Result<Option<Allocation>> {
        if allocation.kind() != MemoryKind::VirtualHost {
            return Ok(None);
        }
        let platform = platform()?;
        let Some(bytes) = Self::block_bytes(layout.size(), platform.granularity) else {
            return Ok(None);
        };
        let (old, room, node) = (
            allocation.bytes(),
            room_of(allocation.tag()),
            node_of(allocation.tag()),
        );
        let grown = Allocation::new(
            allocation.ptr(),
            bytes.max(old),
            allocation.kind(),
            allocation.tag(),
        );
        if bytes <= old {
            return Ok(Some(grown));
        }
        if bytes > room {
            return Ok(None);
        }
        // SAFETY: `old..bytes` lies inside the block's reserved room (bytes ≤ room), past
        // everything mapped so far; both ends are multiples of the granularity.
        let mapped =
            relaxed(|| unsafe { self.map(platform, allocation.ptr().add(old), bytes - old, node) });
        // A growth that failed and could not unmap what it added leaves the block larger
        // than it says: its room is then never given back (`deallocate` unmaps only `bytes`,
        // and the driver refuses to free a range with memory mapped in it).
        mapped.map_err(|failure| out_of_memory(failure.error, layout.size()))?;
        Ok(Some(grown))
    }
}

/// Creates `bytes` of page-locked memory on `node` and maps it at `at`; on failure nothing is
/// mapped. The memory handle is released at once: the mapping keeps the memory until it is
/// unmapped (the driver's rule), so nothing else needs to be remembered. The memory is not
/// accessible until opened (`raw::vmm::open_host_memory`).
///
/// # Safety
///
/// - `at..at + bytes` lies inside a range from `raw::vmm::address_reserve` with nothing
///   mapped there, and `at` and `bytes` are multiples of the host granularity.
unsafe fn map_host_memory(at: NonNull<u8>, bytes: usize, node: u32) -> Result<()> {
    let handle = vmm::create(bytes, node)?;
    // SAFETY: forwarded from the caller; `handle` holds `bytes`.
    let mapped = unsafe { vmm::map(at, bytes, handle) };
    // The mapping holds the memory now (or the map failed): the handle is not needed either
    // way. A failed release only leaks the handle's bookkeeping.
    let _ = vmm::release(handle);
    mapped
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn blocks_round_to_the_granularity_and_reserve_room_to_grow() {
        let v = VirtualHost::new();
        assert_eq!(VirtualHost::block_bytes(1, 2 * MIB), Some(2 * MIB));
        assert_eq!(
            VirtualHost::block_bytes(2 * MIB + 1, 2 * MIB),
            Some(4 * MIB)
        );
        assert_eq!(VirtualHost::block_bytes(usize::MAX, 2 * MIB), None);
        assert_eq!(v.room_for(2 * MIB, 2 * MIB), Some(1 << 30));
        assert_eq!(v.room_for(512 * MIB, 2 * MIB), Some(4 << 30));
        assert_eq!(v.address_room(0).room_for(2 * MIB, 2 * MIB), Some(16 * MIB));
        assert_eq!(v.fixed_size().room_for(6 * MIB, 2 * MIB), Some(6 * MIB));
        // The node rides in the tag's low bits, under the room.
        let t = tag(6 * MIB, 4095);
        assert_eq!((room_of(t), node_of(t)), (6 * MIB, 4095));
        // Huge requests reserve what the address space allows, never less than the block.
        let huge = 1 << 46;
        assert!(v.room_for(huge, 2 * MIB).unwrap() >= huge);
    }

    #[test]
    fn without_cuda_allocation_is_an_error_not_a_panic() {
        if crate::is_available() {
            return;
        }
        let error = VirtualHost::new()
            .allocate(Layout::from_size_align(4096, 8).unwrap())
            .unwrap_err();
        assert!(matches!(error, Error::Unavailable(_)), "{error}");
    }
}
