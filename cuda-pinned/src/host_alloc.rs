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
pub struct HostAllocFlags(FlagBits);

/// The three flag bits as one of their eight combinations. The unused values of the byte let
/// [`MemoryKind`] keep its other kinds there, so a kind is one byte, moved with one load or
/// store (two halves of a wider kind, stored apart and loaded together, stall the CPU's store
/// forwarding on the pool's fast path).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
enum FlagBits {
    B0,
    B1,
    B2,
    B3,
    B4,
    B5,
    B6,
    B7,
}

impl FlagBits {
    const fn new(bits: u32) -> Self {
        match bits & 7 {
            0 => Self::B0,
            1 => Self::B1,
            2 => Self::B2,
            3 => Self::B3,
            4 => Self::B4,
            5 => Self::B5,
            6 => Self::B6,
            _ => Self::B7,
        }
    }
}

const _: () = assert!(
    (sys::cudaHostAllocPortable | sys::cudaHostAllocMapped | sys::cudaHostAllocWriteCombined) == 7,
    "the cudaHostAlloc flags are the three low bits"
);

impl HostAllocFlags {
    /// Pinned for every CUDA context, not only the current device's: what multi-GPU programs
    /// need, and the default.
    pub const PORTABLE: Self = Self(FlagBits::new(sys::cudaHostAllocPortable));
    /// Also mapped into the device address space: kernels can read it through
    /// [`PinnedVec::device_ptr`](crate::PinnedVec::device_ptr).
    pub const MAPPED: Self = Self(FlagBits::new(sys::cudaHostAllocMapped));
    /// Write-combined: faster for the device to read over some buses, but **very slow for the
    /// CPU to read** (reads bypass the caches). Only for buffers the host writes and never reads.
    pub const WRITE_COMBINED: Self = Self(FlagBits::new(sys::cudaHostAllocWriteCombined));
    /// No flag: pinned for the current context only.
    pub const NONE: Self = Self(FlagBits::new(sys::cudaHostAllocDefault));

    /// The raw flag word.
    pub fn bits(self) -> u32 {
        self.0 as u32
    }

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.bits() & other.bits() == other.bits()
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
        Self(FlagBits::new(self.bits() | other.bits()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_combine_and_a_kind_is_one_byte() {
        let flags = HostAllocFlags::PORTABLE | HostAllocFlags::MAPPED;
        assert_eq!(
            flags.bits(),
            sys::cudaHostAllocPortable | sys::cudaHostAllocMapped
        );
        assert!(flags.contains(HostAllocFlags::MAPPED));
        assert!(!flags.contains(HostAllocFlags::WRITE_COMBINED));
        assert_eq!(flags.to_string(), "portable|mapped");
        assert_eq!(HostAllocFlags::NONE.bits(), 0);
        assert_eq!(std::mem::size_of::<MemoryKind>(), 1);
    }
}
