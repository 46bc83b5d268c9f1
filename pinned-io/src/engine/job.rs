//! One read: its pieces and files, and the parts that track it — what to read next, the
//! lead, the open pieces, the destination's arrival, the outcome.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cuda_pinned::ring::{CrewJob, Dma};

use super::arrival::{Arrival, Destination, Sink};
use super::lead::Lead;
use super::outcome::{Complete, Outcome};
use super::parts::OpenPieces;
use super::ring::ReadRing;
use super::worker::Worker;
use crate::error::{Error, Result};
use crate::file::{DataFile, ReadMode};
use crate::plan::{Piece, pieces_per_target};

/// Called once when every piece of a job has been moved or skipped (after a failure).
pub(crate) type Done<D> = dyn Fn(&Job<D>) + Send + Sync + 'static;

/// Where a job's threads spent their time, all threads together: reading files, and waiting
/// for a chunk's copies to the device to finish before filling it again.
#[derive(Debug, Default)]
pub(crate) struct Timing {
    reading: AtomicU64,
    waiting_for_copies: AtomicU64,
}

impl Timing {
    pub(crate) fn reading(&self) -> Duration {
        Duration::from_nanos(self.reading.load(Ordering::Relaxed))
    }

    pub(crate) fn waiting_for_copies(&self) -> Duration {
        Duration::from_nanos(self.waiting_for_copies.load(Ordering::Relaxed))
    }

    /// Runs `work`, adding its time to the reading count.
    pub(super) fn read<R>(&self, work: impl FnOnce() -> R) -> R {
        Self::time(&self.reading, work)
    }

    /// Runs `work`, adding its time to the count of waits for copies.
    pub(super) fn wait<R>(&self, work: impl FnOnce() -> R) -> R {
        Self::time(&self.waiting_for_copies, work)
    }

    fn time<R>(counter: &AtomicU64, work: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let result = work();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
        result
    }
}

/// One read: its pieces, the files they come from, and what completes as they land.
pub(crate) struct Job<D: Dma> {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) files: Vec<DataFile>,
    pub(crate) mode: ReadMode,
    pub(crate) stream: D::Stream,
    /// The next piece to take.
    pub(super) next: AtomicUsize,
    /// Pieces each target still waits for.
    remaining: Vec<AtomicUsize>,
    /// Targets without bytes (no piece to wait for).
    empty: Vec<usize>,
    pub(super) lead: Lead<D::Event>,
    pub(super) open: OpenPieces<D::Event>,
    pub(super) arrival: Arrival<D>,
    pub(super) outcome: Outcome,
    done: Option<Box<Done<D>>>,
    pub(super) timing: Timing,
    /// Called with the piece and the part before a part is read (a test's fault).
    #[cfg(test)]
    pub(crate) part_hook: Option<Box<dyn Fn(usize, usize) + Send + Sync>>,
}

impl<D: Dma> Job<D> {
    /// A job for `pieces` of `files` toward `targets` targets, whose copies' `dst` are
    /// addresses; targets without bytes reach `sink` when the job starts.
    pub(crate) fn new(
        pieces: Vec<Piece>,
        files: Vec<DataFile>,
        mode: ReadMode,
        stream: D::Stream,
        targets: usize,
        sink: Box<Sink<D>>,
    ) -> Self {
        let destination = Destination {
            bases: super::Bases::One(0),
            sink,
        };
        Self::with(
            pieces,
            files,
            mode,
            stream,
            targets,
            Arrival::known(destination),
        )
    }

    /// A job for `pieces` of `files` toward `targets` targets whose destination is not known
    /// yet: its threads read the lead's pieces only, which wait in their chunks until the
    /// destination is named (or the job abandoned).
    pub(crate) fn to_come(
        pieces: Vec<Piece>,
        files: Vec<DataFile>,
        mode: ReadMode,
        stream: D::Stream,
        targets: usize,
    ) -> Self {
        Self::with(pieces, files, mode, stream, targets, Arrival::to_come())
    }

    fn with(
        pieces: Vec<Piece>,
        files: Vec<DataFile>,
        mode: ReadMode,
        stream: D::Stream,
        targets: usize,
        arrival: Arrival<D>,
    ) -> Self {
        let counts = pieces_per_target(&pieces, targets);
        let empty = (counts.iter().enumerate())
            .filter(|&(_, &count)| count == 0)
            .map(|(target, _)| target)
            .collect();
        let remaining = counts.into_iter().map(AtomicUsize::new).collect();
        let first = pieces.first().and_then(|piece| piece.copies.first());
        let lead = first.map_or(0, |first| {
            1 + (pieces.iter())
                .rposition(|piece| piece.copies.iter().any(|c| c.target == first.target))
                .unwrap_or(0)
        });
        Self {
            pieces,
            files,
            mode,
            stream,
            next: AtomicUsize::new(0),
            remaining,
            empty,
            lead: Lead::new(lead),
            open: OpenPieces::default(),
            arrival,
            outcome: Outcome::default(),
            done: None,
            timing: Timing::default(),
            #[cfg(test)]
            part_hook: None,
        }
    }

    /// The job, with `done` called once when every piece is moved or skipped.
    pub(crate) fn when_done(mut self, done: Box<Done<D>>) -> Self {
        self.done = Some(done);
        self
    }

    /// Completes the targets that wait for no piece (and the job, if it has none), where the
    /// destination is known (else naming it does). Called once, before any thread works; an
    /// error fails the job.
    pub(crate) fn start(&self) {
        if let Some(destination) = self.arrival.get() {
            self.complete_empty(destination);
        }
    }

    pub(super) fn complete_empty(&self, destination: &Destination<D>) {
        // Not the targets' counts: once the destination is known, other targets may reach
        // none as their pieces land.
        if !self.empty.is_empty() {
            // A panic here is the job's failure, as in a crew thread: the job still goes to
            // the crew, whose threads skip its pieces, so that it completes.
            let sunk = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                (destination.sink)(&self.empty, &self.stream)
            }));
            match sunk {
                Ok(Ok(())) => {}
                Ok(Err(error)) => self.fail(error),
                Err(payload) => {
                    // A panic's payload may panic when dropped: leaked.
                    std::mem::forget(payload);
                    self.fail(panicked());
                }
            }
        }
        if self.pieces.is_empty() {
            self.count_finished(0);
        }
    }

    /// Whether the job's destination is known.
    pub(crate) fn named(&self) -> bool {
        self.arrival.get().is_some()
    }

    /// Lets a job made by [`to_come`](Self::to_come) complete (once named or abandoned),
    /// completing it if every piece is counted already.
    pub(super) fn release_unnamed(&self) {
        if self.arrival.release() {
            self.count_finished(0);
        }
    }

    /// Whether every piece has been taken by a thread.
    pub(crate) fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.pieces.len()
    }

    /// Whether piece `index` may be taken: any once the destination is known (or the job
    /// failed, its pieces then skipped), else the lead's only.
    fn may_take(&self, index: usize) -> bool {
        self.lead.holds(index) || self.named() || self.outcome.failed()
    }

    /// Takes the next piece, if it may be taken.
    pub(super) fn claim_piece(&self) -> Option<usize> {
        (self.next)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
                self.may_take(next).then_some(next + 1)
            })
            .ok()
    }

    /// Takes piece `index + taken` along with the pieces before it, if nobody has taken it
    /// yet and it may be taken.
    pub(super) fn take_along(&self, index: usize, taken: usize) -> bool {
        self.may_take(index + taken)
            && (self.next)
                .compare_exchange(
                    index + taken,
                    index + taken + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Whether `piece` is read past the page cache.
    pub(super) fn reads_direct(&self, piece: &Piece) -> bool {
        self.files[piece.file].reads_direct(self.mode, piece.offset, piece.len)
    }

    /// Counts `pieces` more pieces finished; the first count that reaches every piece calls
    /// `done` and wakes the waiters.
    pub(super) fn count_finished(&self, pieces: usize) {
        let all = self.pieces.len();
        if !(self.outcome).count(pieces, all, || self.arrival.waited_for()) {
            return;
        }
        // Complete however `done` ends, a panic included: no waiter hangs.
        let _complete = Complete(&self.outcome);
        if let Some(done) = &self.done {
            done(self);
        }
    }

    /// Where the job's threads spent their time so far.
    pub(crate) fn timing(&self) -> &Timing {
        &self.timing
    }

    /// Waits until every piece is moved or skipped and `done` has run.
    pub(crate) fn wait_finished(&self) {
        self.outcome.wait_complete();
    }

    /// Records `error` as the job's (the first one wins) and stops the other threads.
    pub(crate) fn fail(&self, error: Error) {
        self.outcome.fail(error);
        self.arrival.wake();
    }

    /// A copy of the job's error, if a piece failed, shared by every caller (the error itself
    /// stays the job's, for [`take_error`](Self::take_error)).
    pub(crate) fn error(&self) -> Option<Arc<Error>> {
        self.outcome.error()
    }

    /// The job's error, taken out (the failure stays recorded).
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.outcome.take_error()
    }

    /// Counts the piece toward its targets and completes those it was the last of.
    pub(super) fn landed(&self, piece: &Piece) -> Result<()> {
        let mut targets: Vec<usize> = piece.copies.iter().map(|c| c.target).collect();
        targets.sort_unstable();
        targets.dedup();
        // AcqRel: the thread that counts the last piece sees every other piece's copies
        // queued before it records behind them.
        targets.retain(|&target| self.remaining[target].fetch_sub(1, Ordering::AcqRel) == 1);
        if targets.is_empty() {
            return Ok(());
        }
        let destination = (self.arrival.get()).expect("known before any copy is queued");
        (destination.sink)(&targets, &self.stream)
    }
}

impl<D: Dma> CrewJob<ReadRing<D>> for Job<D> {
    fn exhausted(&self) -> bool {
        Job::exhausted(self)
    }

    fn work(&self, ring: &ReadRing<D>, _worker: usize) {
        Worker { job: self, ring }.work();
    }
}

/// The error of a job whose thread panicked.
pub(super) fn panicked() -> Error {
    Error::Cuda(cuda_pinned::Error::Panicked { what: "a reading" })
}

/// The job's outcome once its threads are done: after a failure, the stream is waited for so
/// that no copy of the job still runs when the caller frees its destinations.
pub(crate) fn finish<D: Dma>(job: &Job<D>, ring: &ReadRing<D>) -> Result<()> {
    match job.take_error() {
        None => Ok(()),
        Some(error) => {
            let _ = ring.dma().wait_stream(&job.stream);
            Err(error)
        }
    }
}
