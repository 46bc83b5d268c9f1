//! The flag words of `cudaHostAlloc` and `cudaHostRegister`.

use std::fmt;
use std::ops::BitOr;

use cuda_pinned_sys as sys;

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

/// Flags of `cudaHostRegister`. The default is [`PORTABLE`](Self::PORTABLE).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterFlags(u32);

impl RegisterFlags {
    /// Pinned for every CUDA context (the default).
    pub const PORTABLE: Self = Self(sys::cudaHostRegisterPortable);
    /// Also mapped into the device address space.
    pub const MAPPED: Self = Self(sys::cudaHostRegisterMapped);
    /// The device only reads the memory (needed for read-only host mappings).
    pub const READ_ONLY: Self = Self(sys::cudaHostRegisterReadOnly);
    /// No flag.
    pub const NONE: Self = Self(sys::cudaHostRegisterDefault);

    /// The raw flag word.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl Default for RegisterFlags {
    fn default() -> Self {
        Self::PORTABLE
    }
}

impl BitOr for RegisterFlags {
    type Output = Self;
    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}
