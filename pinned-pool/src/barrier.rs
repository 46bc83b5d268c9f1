//! An asymmetric memory barrier. Every allocate and free pays the light side, a compiler
//! fence; the rare thread that pauses all thread caches (to read or drain them) pays the heavy
//! side, a `membarrier(2)` system call that makes every running thread of the process execute
//! a full fence. Together they order a thread's "I am inside my cache" store before its load
//! of "paused", against the pauser's store of "paused" before its load of "inside", like a
//! full fence on both sides would (Dekker's pattern), without a fence on the common side.
//!
//! Where the call is missing (not Linux, kernels before 4.14, a sandbox that filters it, Miri,
//! the loom model) both sides are full fences: correct everywhere, a few nanoseconds slower
//! per operation.

use std::sync::OnceLock;
use std::sync::atomic::compiler_fence;

use crate::sync::{Ordering, fence};

/// The two sides of the barrier; which kind is chosen once per process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Barrier {
    expedited: bool,
}

impl Barrier {
    /// The barrier of this process: registers for expedited `membarrier` on first use.
    pub(crate) fn new() -> Self {
        static EXPEDITED: OnceLock<bool> = OnceLock::new();
        Self {
            expedited: *EXPEDITED.get_or_init(membarrier::register),
        }
    }

    /// The full-fence barrier, as where `membarrier` is missing.
    #[cfg(loom)]
    pub(crate) fn fences() -> Self {
        Self { expedited: false }
    }

    /// The common side: after a store, before a load that must not pass it.
    #[inline(always)]
    pub(crate) fn light(self) {
        if self.expedited {
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// The rare side: a fence in every running thread of the process.
    pub(crate) fn heavy(self) {
        if self.expedited {
            membarrier::expedited();
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// Whether the light side is only a compiler fence.
    pub(crate) fn is_expedited(self) -> bool {
        self.expedited
    }
}

#[cfg(all(target_os = "linux", not(miri), not(loom)))]
mod membarrier {
    // From the kernel's uapi `linux/membarrier.h`; the libc crate does not carry them.
    const CMD_QUERY: libc::c_long = 0;
    const CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    fn call(command: libc::c_long) -> libc::c_long {
        // SAFETY: membarrier takes two integer arguments (command, flags) and a CPU id that
        // only the RSEQ commands read; it touches no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                command,
                0 as libc::c_long,
                0 as libc::c_long,
            )
        }
    }

    /// Registers the process for expedited barriers; `false` when the kernel lacks them.
    pub(super) fn register() -> bool {
        let supported = call(CMD_QUERY);
        supported >= 0
            && supported & CMD_PRIVATE_EXPEDITED != 0
            && call(CMD_REGISTER_PRIVATE_EXPEDITED) == 0
            // One real barrier proves the call works before any thread relies on it.
            && call(CMD_PRIVATE_EXPEDITED) == 0
    }

    /// Whether the kernel offers expedited private barriers.
    #[cfg(test)]
    pub(super) fn offered() -> bool {
        let supported = call(CMD_QUERY);
        supported >= 0 && supported & CMD_PRIVATE_EXPEDITED != 0
    }

    pub(super) fn expedited() {
        // After a successful registration the kernel fails this only for invalid arguments;
        // carrying on without the barrier would let a pauser read a cache in use.
        let result = call(CMD_PRIVATE_EXPEDITED);
        assert_eq!(result, 0, "membarrier failed after registration");
    }
}

#[cfg(not(all(target_os = "linux", not(miri), not(loom))))]
mod membarrier {
    pub(super) fn register() -> bool {
        false
    }

    /// Whether expedited barriers are used here: never.
    #[cfg(test)]
    pub(super) fn offered() -> bool {
        false
    }

    pub(super) fn expedited() {
        unreachable!("never registered")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_run() {
        let barrier = Barrier::new();
        barrier.light();
        barrier.heavy();
        // The fast path goes fence-free exactly where the kernel offers expedited barriers.
        assert_eq!(barrier.is_expedited(), membarrier::offered());
    }
}
