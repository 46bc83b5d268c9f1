//! The atomics of the thread caches' pause hand-off, from std, or from loom when the crate is
//! built for its model checker (`RUSTFLAGS="--cfg loom"`).

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering, fence};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering, fence};

/// One turn of a wait loop.
#[inline]
pub(crate) fn spin(spins: u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    if spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}
