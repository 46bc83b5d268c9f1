//! The allocator containers use unless told otherwise.

use std::alloc::Layout;
use std::sync::OnceLock;

use crate::error::Result;
use crate::memory::allocator::{Allocation, MemoryKind, PinnedAllocator};
use crate::memory::cuda_host::CudaHost;
use crate::memory::host_locked::HostLocked;
use crate::memory::registered::Registered;

/// The allocator containers use unless told otherwise: the best kind this machine has.
///
/// That is the fast registration path ([`Registered`]) where CUDA and a device are present and
/// support it, `cudaHostAlloc` where registration is not supported, and `mlock`ed memory
/// ([`HostLocked`]) without CUDA, so code and its tests run on CPU-only machines. The choice is
/// made once per process; [`MemoryKind`] on each buffer says which it got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DefaultPinned;

#[derive(Debug)]
enum Backend {
    Registered(Registered),
    CudaHost(CudaHost),
    HostLocked(HostLocked),
}

fn backend() -> &'static Backend {
    static BACKEND: OnceLock<Backend> = OnceLock::new();
    BACKEND.get_or_init(|| {
        let device = crate::gpu::device::is_available().then(crate::Device::current);
        match device {
            Some(Ok(device)) if device.supports_host_registration().unwrap_or(false) => {
                Backend::Registered(Registered::new())
            }
            Some(_) => Backend::CudaHost(CudaHost::new()),
            None => Backend::HostLocked(HostLocked::new()),
        }
    })
}

impl DefaultPinned {
    /// The bytes a block for `layout` spans (as the backend rounds it).
    pub(crate) fn layout_bytes(layout: Layout) -> Option<usize> {
        match backend() {
            Backend::Registered(a) => a.layout_bytes(layout),
            Backend::CudaHost(_) => Some(layout.size()),
            Backend::HostLocked(_) => HostLocked::layout_bytes(layout),
        }
    }

    /// The kind of memory this process's default allocator hands out.
    pub fn kind() -> MemoryKind {
        match backend() {
            Backend::Registered(_) => MemoryKind::Registered,
            Backend::CudaHost(a) => MemoryKind::CudaHost(a.flags()),
            Backend::HostLocked(_) => MemoryKind::HostLocked,
        }
    }
}

// SAFETY: forwards to one of three allocators, chosen once per process, so every allocation
// is given back to the allocator that made it.
unsafe impl PinnedAllocator for DefaultPinned {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        match backend() {
            Backend::Registered(a) => a.allocate(layout),
            Backend::CudaHost(a) => a.allocate(layout),
            Backend::HostLocked(a) => a.allocate(layout),
        }
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: the same backend made it (fixed per process); the caller's guarantees hold.
        unsafe {
            match backend() {
                Backend::Registered(a) => a.deallocate(allocation),
                Backend::CudaHost(a) => a.deallocate(allocation),
                Backend::HostLocked(a) => a.deallocate(allocation),
            }
        }
    }

    fn numa_nodes(&self) -> usize {
        // Answered without choosing the backend (which starts CUDA) where there is one node:
        // a pool asks when it is made, perhaps before a fork.
        if crate::os::online_numa_nodes() <= 1 {
            return 1;
        }
        match backend() {
            Backend::Registered(a) => a.numa_nodes(),
            _ => 1,
        }
    }

    fn numa_node(&self) -> usize {
        match backend() {
            Backend::Registered(a) => a.numa_node(),
            _ => 0,
        }
    }
}
