//! How a job ends: its pieces counted as they are moved or skipped, the first error, and the
//! waiters woken once it is complete.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::error::Error;

/// How far a job is.
#[derive(Default)]
struct Progress {
    /// Pieces moved or skipped.
    pieces: usize,
    /// Whether the job's end was begun (its `done` called), and whether it is over.
    closing: bool,
    complete: bool,
}

/// A job's outcome: its failure, if any, and its progress toward completion.
#[derive(Default)]
pub(super) struct Outcome {
    failed: AtomicBool,
    /// The first error, for the job's owner.
    error: Mutex<Option<Error>>,
    /// A copy of it, made once, for whoever waits on part of the job (every tensor of a
    /// failed load gets it as its cause).
    shared: Mutex<Option<Arc<Error>>>,
    progress: Mutex<Progress>,
    completed: Condvar,
}

impl Outcome {
    /// Whether the job failed (the other threads then skip its pieces).
    pub(super) fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Records `error` as the job's; the first one wins.
    pub(super) fn fail(&self, error: Error) {
        self.failed.store(true, Ordering::Relaxed);
        self.error.lock().get_or_insert(error);
    }

    /// A copy of the job's error, if a piece failed, shared by every caller.
    pub(super) fn error(&self) -> Option<Arc<Error>> {
        let error = self.error.lock();
        let mut shared = self.shared.lock();
        if shared.is_none() {
            *shared = error.as_ref().map(|error| Arc::new(error.clone()));
        }
        shared.clone()
    }

    /// The job's error, taken out (the failure stays recorded).
    pub(super) fn take_error(&self) -> Option<Error> {
        self.error.lock().take()
    }

    /// Counts `pieces` more moved or skipped; `true` for the one count that finds `all`
    /// counted while nobody is `waited_for` to name the job: the caller then ends the job,
    /// and [`complete`](Self::complete)s it.
    pub(super) fn count(
        &self,
        pieces: usize,
        all: usize,
        waited_for: impl FnOnce() -> bool,
    ) -> bool {
        let mut progress = self.progress.lock();
        progress.pieces += pieces;
        // Checked under the lock, which orders it with the threads' counts.
        if progress.pieces < all || progress.closing || waited_for() {
            return false;
        }
        progress.closing = true;
        true
    }

    /// Pieces counted so far.
    #[cfg(test)]
    pub(super) fn pieces(&self) -> usize {
        self.progress.lock().pieces
    }

    /// Marks the job complete and wakes its waiters.
    pub(super) fn complete(&self) {
        self.progress.lock().complete = true;
        self.completed.notify_all();
    }

    /// Waits until the job is complete.
    pub(super) fn wait_complete(&self) {
        let mut progress = self.progress.lock();
        while !progress.complete {
            self.completed.wait(&mut progress);
        }
    }
}

/// Completes an outcome when dropped, however the job's end went (a panic included): no
/// waiter hangs.
pub(super) struct Complete<'a>(pub(super) &'a Outcome);

impl Drop for Complete<'_> {
    fn drop(&mut self) {
        self.0.complete();
    }
}
