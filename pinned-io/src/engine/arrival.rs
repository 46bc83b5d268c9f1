//! Where a job's bytes go, and its arrival: a job may start before its destination exists.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_pinned::ring::Dma;
use parking_lot::{Condvar, Mutex};

use crate::error::Result;

/// Called once for each target, on the stream, once every copy of the target's bytes is
/// queued; targets completed by one piece come together.
pub(crate) type Sink<D> =
    dyn Fn(&[usize], &<D as Dma>::Stream) -> Result<()> + Send + Sync + 'static;

/// Where a job's bytes go: each copy's `dst` is an offset from its target's base, and `sink`
/// completes the targets.
pub(crate) struct Destination<D: Dma> {
    pub(crate) bases: Bases,
    pub(crate) sink: Box<Sink<D>>,
}

/// The address each target's offsets start from: one for all, or one per target (targets
/// in allocations of their own: a checkpoint's tensors of each element type).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Bases {
    One(u64),
    PerTarget(Vec<u64>),
}

impl Bases {
    /// Where `target`'s offsets start.
    pub(crate) fn of(&self, target: usize) -> u64 {
        match self {
            Self::One(base) => *base,
            Self::PerTarget(bases) => bases[target],
        }
    }
}

/// A job's destination, named once (at creation, or later by the thread that allocated
/// it), and the gate where threads wait for it.
pub(super) struct Arrival<D: Dma> {
    destination: OnceLock<Destination<D>>,
    /// Whether the job waits to be named or abandoned: it does not complete before, so that
    /// its end sees what naming it does.
    unnamed: AtomicBool,
    /// Where threads wait, while the destination is unknown, for something to do: the
    /// destination, a failure, or an opened piece's parts.
    gate: Mutex<()>,
    news: Condvar,
}

impl<D: Dma> Arrival<D> {
    /// A destination known from the start.
    pub(super) fn known(destination: Destination<D>) -> Self {
        let arrival = Self::to_come();
        // No other thread has it yet.
        let _ = arrival.destination.set(destination);
        arrival.unnamed.store(false, Ordering::Relaxed);
        arrival
    }

    /// A destination named later.
    pub(super) fn to_come() -> Self {
        Self {
            destination: OnceLock::new(),
            unnamed: AtomicBool::new(true),
            gate: Mutex::new(()),
            news: Condvar::new(),
        }
    }

    pub(super) fn get(&self) -> Option<&Destination<D>> {
        self.destination.get()
    }

    /// Names the destination; `false` if it was named already.
    pub(super) fn name(&self, destination: Destination<D>) -> bool {
        self.destination.set(destination).is_ok()
    }

    /// Counts the job named or abandoned; `true` the first time.
    pub(super) fn release(&self) -> bool {
        self.unnamed.swap(false, Ordering::Relaxed)
    }

    /// Whether the job still waits to be named or abandoned.
    pub(super) fn waited_for(&self) -> bool {
        self.unnamed.load(Ordering::Relaxed)
    }

    /// Waits for news (see [`wake`](Self::wake)) while `idle` holds, checked under the gate.
    pub(super) fn await_news(&self, idle: impl FnOnce() -> bool) {
        let mut gate = self.gate.lock();
        if idle() {
            self.news.wait(&mut gate);
        }
    }

    /// Holds the gate: a thread that wakes the others waits for it (a test's pause).
    #[cfg(test)]
    pub(super) fn hold_gate(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.gate.lock()
    }

    /// Wakes the threads waiting for news: the destination is known, the job failed, or a
    /// piece was opened. Called after the change.
    pub(super) fn wake(&self) {
        // Taken and let go: a waiter has either seen the change or waits, and is woken.
        drop(self.gate.lock());
        self.news.notify_all();
    }
}
