//! Kind 1: `cudaHostAlloc`, with typed flags.

use std::alloc::Layout;
use std::fmt;
use std::ops::BitOr;

use cuda_pinned_sys as sys;

use crate::alloc::{Allocation, MemoryKind, PinnedAllocator, check_layout};
use crate::error::Result;
use crate::ffi;

/// Flags of `cudaHostAlloc`. The default is [`PORTABLE`](Self::PORTABLE).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostAllocFlags(u32);

impl HostAllocFlags {
    /// Pinned for every CUDA context, not only the current device's: what multi-GPU programs
    /// need, and the default.
    pub const PORTABLE: Self = Self(sys::cudaHostAllocPortable);
    /// Also mapped into the device address space: kernels can read it through
    /// [`PinnedVec::device_ptr`](crate::PinnedVec::device_ptr).
    pub const MAPPED: Self = Self(sys::cudaHostAllocMapped);
    /// Write-combined: faster for the device to read over some buses, but **very slow for the
    /// CPU to read** (reads bypass the caches). Only for buffers the host writes and never reads.
    pub const WRITE_COMBINED: Self = Self(sys::cudaHostAllocWriteCombined);
    /// No flag: pinned for the current context only.
    pub const NONE: Self = Self(sys::cudaHostAllocDefault);

    /// The raw flag word.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl Default for HostAllocFlags {
    fn default() -> Self {
        Self::PORTABLE
    }
}

impl BitOr for HostAllocFlags {
    type Output = Self;
    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

impl fmt::Display for HostAllocFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::PORTABLE, "portable"),
            (Self::MAPPED, "mapped"),
            (Self::WRITE_COMBINED, "write-combined"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, n)| *n)
            .collect();
        if set.is_empty() {
            f.write_str("default")
        } else {
            f.write_str(&set.join("|"))
        }
    }
}

impl fmt::Debug for HostAllocFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostAllocFlags({self})")
    }
}

/// Page-locked memory from `cudaHostAlloc`. Needs CUDA: without it allocation fails with
/// [`Error::Unavailable`](crate::Error::Unavailable).
///
/// Simple and universally supported, but slow to get (about 1 ms even for 4 KiB, 0.4–0.7 s
/// per GiB on an H100 host) and it holds a driver lock meanwhile; [`Registered`](crate::Registered)
/// is the fast path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaHost {
    flags: HostAllocFlags,
}

impl CudaHost {
    /// Portable pinned memory.
    pub fn new() -> Self {
        Self::default()
    }

    /// With these flags.
    pub fn with_flags(flags: HostAllocFlags) -> Self {
        Self { flags }
    }

    /// The flags used.
    pub fn flags(&self) -> HostAllocFlags {
        self.flags
    }
}

// SAFETY: cudaHostAlloc returns page-aligned memory of at least the requested size (alignment
// above a page is refused by `check_layout`), page-locked until cudaFreeHost.
unsafe impl PinnedAllocator for CudaHost {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        check_layout(layout)?;
        let ptr = ffi::host_alloc(layout.size(), self.flags.bits())?;
        Ok(Allocation::new(
            ptr,
            layout.size(),
            MemoryKind::HostAlloc(self.flags),
            0,
        ))
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: the allocation came from cudaHostAlloc and is unused, per the caller.
        let _ = unsafe { ffi::free_host(allocation.ptr()) };
    }
}
