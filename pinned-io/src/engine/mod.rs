//! The crew: threads that read pieces of files into the chunks of a pinned ring while the
//! DMA engine drains them.
//!
//! A thread takes the next piece, takes a free chunk (its previous copies finished: the
//! chunk's event), reads the piece into it, queues the piece's copies out of it and records
//! the chunk's event behind them. A target (a tensor, a whole read) is complete once every
//! piece holding its bytes has queued its copies: the thread that queues the last one calls
//! the job's sink, which records the target's own event on the stream, after all of them.
//!
//! A piece read through the page cache is read in parts by whichever threads are free: the
//! thread that took it opens it, the others read its parts before they take pieces of their
//! own, and the one that finishes the last part queues the piece's copies. So copies stay
//! large (the DMA engine pays for each one it starts) while reads stay small (a thread reads
//! the page cache fastest into memory its caches still hold).
//!
//! A job's first target goes to the device first. Until every piece holding its bytes has
//! queued its copies, a filled piece after them waits in its chunk, and the thread that
//! queues the lead's last piece queues the waiting ones, in order. Otherwise a piece of the
//! first target read a little late queues behind the copies of the pieces after it, and a
//! load's first tensor, which its caller may be waiting for, lands later than it has to. At
//! most half the ring waits so: the lead's own pieces always find a chunk.
//!
//! A job may also start before its destination exists (a load's device memory, whose
//! allocation can take milliseconds): its threads then read the lead's pieces only, which
//! wait in their chunks until the thread that names the destination queues them. Only the
//! lead: that thread queues them before it returns, and each copy call costs microseconds.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::file::{DIRECT_ALIGN, DataFile, ReadMode};
use crate::plan::{ChunkCopy, Piece, pieces_per_target};

pub(crate) mod crew;
pub(crate) mod cuda;
mod ring;
#[cfg(test)]
mod tests;

use ring::Chunk;
pub(crate) use ring::Ring;

/// What the crew needs from a device: CUDA, or a fake in the tests.
pub(crate) trait Dma: Send + Sync + 'static {
    type Stream: Send + Sync;
    type Event: Send + Sync;

    fn event(&self) -> Result<Self::Event>;
    /// Queues `copies` out of `chunk` on `stream`, each to its target's base plus its `dst`.
    ///
    /// # Safety
    ///
    /// Each copy's source rows lie in `chunk`'s filled bytes, which stay untouched until an
    /// event recorded after the copies completes; each destination is memory the job's owner
    /// lent for writing.
    unsafe fn copy(
        &self,
        stream: &Self::Stream,
        chunk: *const u8,
        copies: &[ChunkCopy],
        bases: &Bases,
    ) -> Result<()>;
    fn record(&self, event: &mut Self::Event, stream: &Self::Stream) -> Result<()>;
    fn wait(&self, event: &Self::Event) -> Result<()>;
    fn wait_stream(&self, stream: &Self::Stream) -> Result<()>;
    /// Makes the device current on a crew thread.
    fn use_device(&self) -> Result<()>;
}

/// A piece read through the page cache part by part, by any thread, into its chunk.
struct Open<E> {
    /// The piece's index in its job.
    piece: usize,
    /// The address of the piece's first byte in the chunk.
    start: usize,
    /// Held until the last part is finished.
    chunk: Chunk<E>,
    parts: usize,
    /// Parts handed out, and parts not finished yet.
    claimed: usize,
    unfinished: usize,
    /// Whether a part was not read (an error, a panic, or a failed job).
    failed: bool,
}

/// A filled piece, in its chunk from `start`, waiting for the job's destination or for the
/// lead's copies to be queued.
struct Parked<E> {
    piece: usize,
    start: usize,
    chunk: Chunk<E>,
    /// Whether the ring counts it (a piece waiting for the lead, not for the destination).
    counted: bool,
}

/// What becomes of filled pieces: queued now (to the destination at these bases), parked,
/// or given back unqueued (the job failed before its destination was known).
enum Turn<'a> {
    Now(&'a Bases),
    Parked,
    Skipped,
}

/// The job's lead pieces not yet queued, and the pieces waiting for them.
struct Lead<E> {
    left: usize,
    parked: Vec<Parked<E>>,
}

/// Part `index` of open piece `piece`, whose first byte is at `start`.
struct Part {
    piece: usize,
    index: usize,
    start: usize,
}

/// Pieces read past the page cache in one call, at most (each into a chunk of its own), and
/// the most bytes such a call asks for when it takes more than one piece.
const DIRECT_RUN: usize = 4;
const DIRECT_RUN_BYTES: usize = 8 << 20;

/// A chunk out of the ring for `job`: given back, or else, when dropped (an error or a
/// panic), given back if no copy out of it can be running and lost if one may be.
struct Taken<'a, D: Dma> {
    ring: &'a Ring<D>,
    job: &'a Job<D>,
    chunk: Option<Chunk<D::Event>>,
}

impl<D: Dma> Taken<'_, D> {
    fn give_back(&mut self) {
        if let Some(chunk) = self.chunk.take() {
            self.ring.give_back(chunk);
        }
    }
}

impl<D: Dma> Drop for Taken<'_, D> {
    fn drop(&mut self) {
        if let Some(chunk) = self.chunk.take() {
            if chunk.pending {
                // A thread that the loss wakes finds the job failed, its panic the cause.
                if std::thread::panicking() {
                    self.job.fail(panicked());
                }
                self.ring.lose(chunk);
            } else {
                self.ring.give_back(chunk);
            }
        }
    }
}

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

    /// Runs `work`, adding its time to `counter`.
    fn time<R>(counter: &AtomicU64, work: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let result = work();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
        result
    }
}

/// Called once when every piece of a job has been moved or skipped (after a failure).
pub(crate) type Done<D> = dyn Fn(&Job<D>) + Send + Sync + 'static;

/// One read: its pieces, the files they come from, and what completes as they land.
pub(crate) struct Job<D: Dma> {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) files: Vec<DataFile>,
    pub(crate) mode: ReadMode,
    pub(crate) stream: D::Stream,
    next: AtomicUsize,
    /// Pieces each target still waits for.
    remaining: Vec<AtomicUsize>,
    /// Targets without bytes (no piece to wait for).
    empty: Vec<usize>,
    /// Pieces `0..lead` hold the first target's bytes (the target the first piece starts).
    lead: usize,
    lead_state: Mutex<Lead<D::Event>>,
    /// Whether every lead piece is queued (`lead_state`'s `left` reached none): nothing of the
    /// job parks for the lead any more.
    lead_done: AtomicBool,
    /// Set once (after the job is shared, under `lead_state`'s lock).
    destination: OnceLock<Destination<D>>,
    /// Whether the job waits to be named or abandoned: it does not complete before, so that
    /// `done` sees what naming it does.
    unnamed: AtomicBool,
    /// Where threads wait, while the destination is unknown, for something to do: the
    /// destination, a failure, or an opened piece's parts.
    gate: Mutex<()>,
    news: Condvar,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    /// Pieces read through the page cache part by part, oldest first, until the last part
    /// is finished.
    open: Mutex<Vec<Open<D::Event>>>,
    finished: Mutex<Progress>,
    all_finished: Condvar,
    done: Option<Box<Done<D>>>,
    timing: Timing,
    /// Called with the piece and the part before a part is read (a test's fault).
    #[cfg(test)]
    part_hook: Option<Box<dyn Fn(usize, usize) + Send + Sync>>,
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
        let mut job = Self::to_come(pieces, files, mode, stream, targets);
        // No other thread has the job yet.
        let _ = job.destination.set(Destination {
            bases: Bases::One(0),
            sink,
        });
        job.unnamed = AtomicBool::new(false);
        job
    }

    /// A job for `pieces` of `files` toward `targets` targets whose destination is not known
    /// yet: its threads read the lead's pieces only, which wait in their chunks until
    /// [`arrive`](Self::arrive) names it (or [`abandon`](Self::abandon) gives it up).
    pub(crate) fn to_come(
        pieces: Vec<Piece>,
        files: Vec<DataFile>,
        mode: ReadMode,
        stream: D::Stream,
        targets: usize,
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
            lead,
            lead_state: Mutex::new(Lead {
                left: lead,
                parked: Vec::new(),
            }),
            lead_done: AtomicBool::new(false),
            destination: OnceLock::new(),
            unnamed: AtomicBool::new(true),
            gate: Mutex::new(()),
            news: Condvar::new(),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            open: Mutex::new(Vec::new()),
            finished: Mutex::new(Progress::default()),
            all_finished: Condvar::new(),
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
    /// destination is known (else [`arrive`](Self::arrive) does). Called once, before any
    /// thread works; an error fails the job.
    pub(crate) fn start(&self) {
        if let Some(destination) = self.destination.get() {
            self.complete_empty(destination);
        }
    }

    fn complete_empty(&self, destination: &Destination<D>) {
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

    /// Names the destination of a job made by [`to_come`](Self::to_come) (once), completes
    /// its targets without bytes, and queues the pieces that waited for it, on the calling
    /// thread, in order. An error fails the job.
    pub(crate) fn arrive(&self, ring: &Ring<D>, destination: Destination<D>) {
        let parked = {
            let mut lead = lock(&self.lead_state);
            if self.destination.set(destination).is_err() {
                return;
            }
            std::mem::take(&mut lead.parked)
        };
        self.wake();
        // The job may complete once this is over, however it ends.
        let _named = Named { job: self };
        // Every crew thread may have left the job, its pieces all read: after a failure (a
        // panic included), nobody else releases what waits for a lead no longer queued.
        let _leaving = Leaving { job: self, ring };
        // Before the pieces are counted, so that `done` sees a failure of the sink; a panic
        // in it is caught, so that nothing strands the pieces taken out of the lead.
        self.complete_empty(self.destination.get().expect("just set"));
        self.queue_parked(ring, parked);
    }

    /// Whether the job's destination is known.
    pub(crate) fn named(&self) -> bool {
        self.destination.get().is_some()
    }

    /// Fails a job whose destination will never come, with `error`, and gives back the
    /// chunks of the pieces that waited for it.
    pub(crate) fn abandon(&self, ring: &Ring<D>, error: Error) {
        self.fail(error);
        self.release_parked(ring);
        self.release_unnamed();
    }

    /// Lets a job made by [`to_come`](Self::to_come) complete (once named or abandoned),
    /// completing it if every piece is counted already.
    fn release_unnamed(&self) {
        if self.unnamed.swap(false, Ordering::Relaxed) {
            // The count's lock orders this with the threads' counts.
            self.count_finished(0);
        }
    }

    /// Whether every piece has been taken by a thread.
    pub(crate) fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.pieces.len()
    }

    /// Takes pieces and moves them through `ring` until none is left, reading the parts of
    /// open pieces first; after a failure the rest are skipped.
    ///
    /// A piece read past the page cache takes the pieces after it along, up to
    /// [`DIRECT_RUN`] in all, while chunks are free and nobody has taken them yet: they are
    /// read in one call, and one large read keeps more of the storage busy than several small
    /// ones.
    pub(crate) fn work(&self, ring: &Ring<D>) {
        let _leaving = Leaving { job: self, ring };
        loop {
            if let Some(part) = self.claim_part() {
                self.read_part(ring, part);
                continue;
            }
            if self.exhausted() {
                return;
            }
            let Some(index) = self.claim_piece() else {
                self.await_destination();
                continue;
            };
            if index >= self.pieces.len() {
                continue;
            }
            // Counted as finished however it ends, a panic included, with the pieces taken
            // along (an opened piece is counted by its last part instead).
            let mut counted = Counted {
                job: self,
                pieces: 1,
            };
            if !self.failed.load(Ordering::Relaxed) {
                self.move_pieces(ring, index, &mut counted.pieces);
            }
            drop(counted);
        }
    }

    /// Whether piece `index` may be taken: any once the destination is known (or the job
    /// failed, its pieces then skipped), else the lead's only.
    fn may_take(&self, index: usize) -> bool {
        index < self.lead || self.destination.get().is_some() || self.failed.load(Ordering::Relaxed)
    }

    /// Takes the next piece, if it may be taken.
    fn claim_piece(&self) -> Option<usize> {
        (self.next)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
                self.may_take(next).then_some(next + 1)
            })
            .ok()
    }

    /// Waits, while the destination is unknown, until there is news (see
    /// [`wake`](Self::wake)).
    fn await_destination(&self) {
        let gate = lock(&self.gate);
        // Checked under the gate: news comes through it.
        let unknown = self.destination.get().is_none() && !self.failed.load(Ordering::Relaxed);
        if unknown
            && !lock(&self.open)
                .iter()
                .any(|open| open.claimed < open.parts)
        {
            drop(self.news.wait(gate).unwrap_or_else(PoisonError::into_inner));
        }
    }

    /// Wakes the threads waiting for the destination: it is known, the job failed, or a piece
    /// was opened. Called after the change.
    fn wake(&self) {
        // Taken and let go: a waiter has either seen the change or waits, and is woken.
        drop(lock(&self.gate));
        self.news.notify_all();
    }

    /// Whether `piece` is read past the page cache (as [`DataFile::read_at`] decides).
    fn reads_direct(&self, piece: &Piece) -> bool {
        let file = &self.files[piece.file];
        file.can_read_direct()
            && match self.mode {
                ReadMode::Buffered => false,
                ReadMode::Direct => true,
                ReadMode::Auto => !file.is_cached(piece.offset, piece.len),
            }
    }

    /// Takes piece `index + taken` along with the pieces before it, if nobody has taken it
    /// yet and it may be taken.
    fn take_along(&self, index: usize, taken: usize) -> bool {
        self.may_take(index + taken)
            && self
                .next
                .compare_exchange(
                    index + taken,
                    index + taken + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Counts `pieces` more pieces finished; the first count that reaches every piece calls
    /// `done` and wakes the waiters.
    fn count_finished(&self, pieces: usize) {
        let mut finished = lock(&self.finished);
        finished.pieces += pieces;
        if finished.pieces < self.pieces.len()
            || finished.closing
            || self.unnamed.load(Ordering::Relaxed)
        {
            return;
        }
        finished.closing = true;
        drop(finished);
        // Complete however `done` ends, a panic included: no waiter hangs.
        let _complete = Complete { job: self };
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
        let mut finished = lock(&self.finished);
        while !finished.complete {
            finished = self
                .all_finished
                .wait(finished)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Records `error` as the job's (the first one wins) and stops the other threads.
    pub(crate) fn fail(&self, error: Error) {
        self.failed.store(true, Ordering::Relaxed);
        lock(&self.error).get_or_insert(error);
        self.wake();
    }

    /// The job's error, if a piece failed.
    pub(crate) fn take_error(&self) -> Option<Error> {
        lock(&self.error).take()
    }

    /// The job's error as text, if a piece failed (the error stays the job's).
    pub(crate) fn error_message(&self) -> Option<String> {
        lock(&self.error)
            .as_ref()
            .map(|error| cuda_pinned::ErrorChain(error).to_string())
    }

    /// Moves piece `index` through a chunk of `ring`, with the pieces after it that can be
    /// read in the same call past the page cache, each into a chunk of its own that is free
    /// now; `claimed` counts the pieces taken, as they are taken. A piece read through the
    /// page cache in more than one part is opened instead, and counted by its last part. A
    /// failure is the job's.
    fn move_pieces(&self, ring: &Ring<D>, index: usize, claimed: &mut usize) {
        let chunk = match ring.take() {
            Ok(chunk) => chunk,
            Err(error) => return self.fail(error),
        };
        let mut taken = vec![Taken {
            ring,
            job: self,
            chunk: Some(chunk),
        }];
        // Asked once per piece (the page cache's residency is a system call), and passed on.
        let direct = self.reads_direct(&self.pieces[index]);
        if direct && index + 1 < self.pieces.len() {
            let mut bytes = self.pieces[index].len;
            while taken.len() < DIRECT_RUN
                && index + taken.len() < self.pieces.len()
                && follows(
                    &self.pieces[index + taken.len() - 1],
                    &self.pieces[index + taken.len()],
                )
                && bytes + self.pieces[index + taken.len()].len <= DIRECT_RUN_BYTES
                && let Some(chunk) = ring.try_take()
            {
                if !self.take_along(index, taken.len()) {
                    ring.give_back(chunk);
                    break;
                }
                bytes += self.pieces[index + taken.len()].len;
                *claimed += 1;
                taken.push(Taken {
                    ring,
                    job: self,
                    chunk: Some(chunk),
                });
            }
        }
        let pieces = &self.pieces[index..index + taken.len()];
        // The failure is recorded before `taken` may drop chunks as lost: a thread that a
        // loss wakes then finds the job failed, its first error the cause.
        let Some(starts) = self.settle(ring, &mut taken, pieces) else {
            return;
        };
        if !direct && pieces[0].len > ring.part {
            let chunk = taken[0].chunk.take().expect("taken");
            let parts = pieces[0].len.div_ceil(ring.part);
            lock(&self.open).push(Open {
                piece: index,
                start: starts[0] as usize,
                chunk,
                parts,
                claimed: 0,
                unfinished: parts,
                failed: false,
            });
            if self.destination.get().is_none() {
                self.wake();
            }
            *claimed -= 1;
            return;
        }
        match self.fill_and_queue(ring, &mut taken, index, &starts, direct) {
            // Counted by the thread that queues them.
            Ok(true) => *claimed -= taken.len(),
            Ok(false) => {}
            Err(error) => self.fail(error),
        }
    }

    /// Waits until no copy out of the taken chunks may still run, and returns where each of
    /// `pieces` starts in its chunk (congruent to its offset modulo [`DIRECT_ALIGN`]). A
    /// failed wait is the job's: that chunk is then lost and the others are given back once
    /// settled.
    fn settle(
        &self,
        ring: &Ring<D>,
        taken: &mut [Taken<'_, D>],
        pieces: &[Piece],
    ) -> Option<Vec<*mut u8>> {
        let mut starts = Vec::with_capacity(pieces.len());
        for i in 0..taken.len() {
            let chunk = taken[i].chunk.as_mut().expect("taken");
            if chunk.pending {
                let waited = Timing::time(&self.timing.waiting_for_copies, || {
                    ring.dma.wait(&chunk.event)
                });
                if let Err(error) = waited {
                    // Recorded first: a thread that the loss wakes finds the job failed.
                    self.fail(error);
                    // This chunk's copies are unknown: lost; the others are given back once
                    // theirs are known to be over.
                    if let Some(chunk) = taken[i].chunk.take() {
                        ring.lose(chunk);
                    }
                    give_back_settled(ring, taken);
                    return None;
                }
                chunk.pending = false;
            }
            let skew = (pieces[i].offset % DIRECT_ALIGN as u64) as usize;
            starts.push((ring.base + chunk.offset + skew) as *mut u8);
        }
        Some(starts)
    }

    /// Fills the taken chunks (settled, at `starts`) with the pieces from `first` on, one
    /// each, read past the page cache if `direct`, and queues their copies (or parks them:
    /// see [`queue`](Self::queue)).
    fn fill_and_queue(
        &self,
        ring: &Ring<D>,
        taken: &mut [Taken<'_, D>],
        first: usize,
        starts: &[*mut u8],
        direct: bool,
    ) -> Result<bool> {
        let pieces = &self.pieces[first..first + taken.len()];
        let file = &self.files[pieces[0].file];
        let _span = tracing::debug_span!(
            "read",
            mode = if direct { "direct" } else { "cached" },
            pieces = pieces.len(),
            bytes = pieces.iter().map(|piece| piece.len).sum::<usize>(),
            offset = pieces[0].offset,
        )
        .entered();
        // SAFETY: each chunk is this thread's alone (taken from the free list) and its last
        // copies are over (settled); it spans `capacity + 2 * DIRECT_ALIGN` bytes, so the
        // `skew < DIRECT_ALIGN` bytes before its start and the `capacity - len +
        // DIRECT_ALIGN ≥ DIRECT_ALIGN` after its piece's `len ≤ capacity` bytes lie in it;
        // each start is congruent to its piece's offset (the chunk's start is aligned); the
        // pieces follow one another in the file on block boundaries (`follows`).
        let read = Timing::time(&self.timing.reading, || unsafe {
            read_pieces(file, starts, pieces, direct)
        });
        if let Err(error) = read {
            give_back_settled(ring, taken);
            return Err(error);
        }
        self.queue(ring, taken, first, starts)
    }

    /// Queues the copies of the pieces from `first` on, filled at `starts` in the taken
    /// chunks, one each; gives each chunk back where its copies are accounted for (else it is
    /// lost when dropped), then counts the pieces toward their targets.
    ///
    /// Pieces that come before the destination is known, and pieces past the lead that come
    /// before the lead's pieces are all queued (where there is room), are parked instead: then
    /// the result is `true`, and the thread that names the destination or queues the lead's
    /// last piece queues them, and counts them finished. Pieces that come after the job
    /// failed, its destination unknown, are given back unqueued.
    fn queue(
        &self,
        ring: &Ring<D>,
        taken: &mut [Taken<'_, D>],
        first: usize,
        starts: &[*mut u8],
    ) -> Result<bool> {
        let bases = match self.turn(ring, taken, first, starts) {
            Turn::Now(bases) => bases,
            Turn::Parked => return Ok(true),
            Turn::Skipped => {
                // No copies were queued out of them.
                taken.iter_mut().for_each(Taken::give_back);
                return Ok(false);
            }
        };
        let pieces = &self.pieces[first..first + taken.len()];
        let _span = tracing::debug_span!(
            "queue copies",
            pieces = pieces.len(),
            copies = pieces.iter().map(|piece| piece.copies.len()).sum::<usize>(),
        )
        .entered();
        for ((taken, piece), &start) in taken.iter_mut().zip(pieces).zip(starts) {
            let chunk = taken.chunk.as_mut().expect("taken");
            // From here on copies out of the chunk may be queued: lost if dropped.
            chunk.pending = true;
            // SAFETY: the copies read the piece's bytes, filled at `start` by the caller (or,
            // for a parked piece, by the thread that parked it, its chunk held untouched
            // since); the chunk is left alone until its event, recorded next, completes (or,
            // if that fails, it is lost). They write at their targets' bases plus their
            // offsets, into the destination the job's owner lent for it (at creation, or
            // naming it).
            let queued = unsafe { ring.dma.copy(&self.stream, start, &piece.copies, bases) }
                .and_then(|()| ring.dma.record(&mut chunk.event, &self.stream));
            if let Err(error) = queued {
                // Copies may be queued that no event covers: reused only once the stream is
                // known to be done with them, else lost when dropped. The chunks of the
                // pieces after it, filled and not queued, are given back when dropped.
                if ring.dma.wait_stream(&self.stream).is_ok() {
                    chunk.pending = false;
                }
                return Err(error);
            }
            taken.give_back();
        }
        // Every chunk is back before the targets complete (the sink runs): nothing is held
        // if it fails or panics.
        pieces.iter().try_for_each(|piece| self.landed(piece))?;
        self.lead_queued(ring, first, pieces.len());
        Ok(false)
    }

    /// What becomes of the filled pieces from `first` on (see [`queue`](Self::queue)); when
    /// parked, their chunks are taken out of `taken`.
    fn turn(
        &self,
        ring: &Ring<D>,
        taken: &mut [Taken<'_, D>],
        first: usize,
        starts: &[*mut u8],
    ) -> Turn<'_> {
        // Without the lock where nothing can park: the destination known, and a lead piece
        // or a lead all queued (a stale flag only takes the way below).
        if let Some(destination) = self.destination.get()
            && (first < self.lead || self.lead_done.load(Ordering::Relaxed))
        {
            return Turn::Now(&destination.bases);
        }
        let mut lead = lock(&self.lead_state);
        let failed = self.failed.load(Ordering::Relaxed);
        let counted = match self.destination.get() {
            // Nobody names the destination of a failed job.
            None if failed => return Turn::Skipped,
            None => false,
            // Not once the job has failed: the lead may never be queued then.
            Some(destination) => {
                if first < self.lead || lead.left == 0 || failed || !ring.park(taken.len()) {
                    return Turn::Now(&destination.bases);
                }
                true
            }
        };
        for (i, (taken, &start)) in taken.iter_mut().zip(starts).enumerate() {
            lead.parked.push(Parked {
                piece: first + i,
                start: start as usize,
                chunk: taken.chunk.take().expect("taken"),
                counted,
            });
        }
        Turn::Parked
    }

    /// Counts the lead's pieces among the `count` from `first` on as queued; the thread that
    /// queues the lead's last piece then queues the parked pieces.
    fn lead_queued(&self, ring: &Ring<D>, first: usize, count: usize) {
        let queued = self.lead.saturating_sub(first).min(count);
        if queued == 0 {
            return;
        }
        let parked = {
            let mut lead = lock(&self.lead_state);
            lead.left -= queued;
            if lead.left > 0 {
                return;
            }
            self.lead_done.store(true, Ordering::Relaxed);
            std::mem::take(&mut lead.parked)
        };
        self.queue_parked(ring, parked);
    }

    /// Queues `parked` in the pieces' order (see [`queue_filled`](Self::queue_filled)).
    fn queue_parked(&self, ring: &Ring<D>, mut parked: Vec<Parked<D::Event>>) {
        if parked.is_empty() {
            return;
        }
        ring.unpark(parked.iter().filter(|parked| parked.counted).count());
        parked.sort_unstable_by_key(|parked| parked.piece);
        let filled = parked.into_iter();
        self.queue_filled(ring, filled.map(|p| (p.chunk, p.piece, Some(p.start))));
    }

    /// Queues filled pieces in the order given, each a chunk, its piece, and where the piece
    /// starts in the chunk (`None`: a part of it was not read, so it is not queued), until
    /// the job fails; counts them finished however that ends, but for those parked again
    /// (for the lead). An error fails the job before they are counted, so that `done` sees
    /// it.
    fn queue_filled(
        &self,
        ring: &Ring<D>,
        filled: impl ExactSizeIterator<Item = (Chunk<D::Event>, usize, Option<usize>)>,
    ) {
        let mut counted = Counted {
            job: self,
            pieces: filled.len(),
        };
        // Every chunk in a guard before anything can fail or panic: dropped before the
        // pieces are counted, each given back (none has copies queued yet) or, once its
        // copies are queued, given back or lost as they allow.
        let mut held: Vec<(Taken<'_, D>, usize, Option<usize>)> = filled
            .map(|(chunk, piece, start)| {
                let taken = Taken {
                    ring,
                    job: self,
                    chunk: Some(chunk),
                };
                (taken, piece, start)
            })
            .collect();
        for (taken, piece, start) in &mut held {
            let Some(start) = *start else {
                continue;
            };
            if self.failed.load(Ordering::Relaxed) {
                break;
            }
            let starts = [start as *mut u8];
            match self.queue(ring, std::slice::from_mut(taken), *piece, &starts) {
                // Counted by the thread that queues it.
                Ok(true) => counted.pieces -= 1,
                Ok(false) => {}
                Err(error) => {
                    self.fail(error);
                    break;
                }
            }
        }
    }

    /// After a failure, gives back the chunks of the parked pieces (none has copies queued)
    /// and counts the pieces finished: nobody comes to queue them.
    fn release_parked(&self, ring: &Ring<D>) {
        let parked = std::mem::take(&mut lock(&self.lead_state).parked);
        if parked.is_empty() {
            return;
        }
        let count = parked.len();
        ring.unpark(parked.iter().filter(|parked| parked.counted).count());
        for parked in parked {
            ring.give_back(parked.chunk);
        }
        self.count_finished(count);
    }

    /// The next unread part of the oldest open piece, claimed, if any piece has one.
    fn claim_part(&self) -> Option<Part> {
        let mut open = lock(&self.open);
        let entry = open.iter_mut().find(|open| open.claimed < open.parts)?;
        entry.claimed += 1;
        Some(Part {
            piece: entry.piece,
            index: entry.claimed - 1,
            start: entry.start,
        })
    }

    /// Reads `part` of an open piece through the page cache (unless the job failed), and
    /// counts it finished however that ends.
    fn read_part(&self, ring: &Ring<D>, part: Part) {
        let mut finished = PartFinished {
            job: self,
            ring,
            piece: part.piece,
            read: false,
        };
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        #[cfg(test)]
        if let Some(hook) = &self.part_hook {
            hook(part.piece, part.index);
        }
        let piece = &self.pieces[part.piece];
        let from = part.index * ring.part;
        let len = ring.part.min(piece.len - from);
        let _span = tracing::debug_span!(
            "read",
            mode = "cached",
            pieces = 1,
            bytes = len,
            offset = piece.offset + from as u64,
        )
        .entered();
        // SAFETY: the piece's chunk stays with its open entry until every part is finished,
        // and its last copies are over (settled before it was opened); the piece's bytes lie
        // in the chunk from `start`, and this part's `from..from + len` of them is this
        // thread's alone (each part is claimed once). No scratch is claimed around it.
        let read = Timing::time(&self.timing.reading, || unsafe {
            self.files[piece.file].read_at(
                (part.start + from) as *mut u8,
                len,
                piece.offset + from as u64,
                ReadMode::Buffered,
                false,
            )
        });
        match read {
            Ok(()) => finished.read = true,
            Err(error) => self.fail(error),
        }
    }

    /// Counts a part of open piece `piece` finished, `read` or not, and closes the piece if
    /// it was the last (see [`close`](Self::close)).
    fn finish_part(&self, ring: &Ring<D>, piece: usize, read: bool) {
        let closed = {
            let mut open = lock(&self.open);
            // Every part is finished once, and the entry goes only with the last one.
            if let Some(entry) = open.iter_mut().find(|open| open.piece == piece) {
                entry.unfinished -= 1;
                entry.failed |= !read;
            }
            self.take_closed(&mut open)
        };
        self.close(ring, closed);
    }

    /// After a failure, skips the parts of open pieces that no thread has claimed (a thread
    /// that panicked has left the job, and may have been the one to come back for them), and
    /// closes the pieces that no thread reads any more.
    fn skip_unclaimed_parts(&self, ring: &Ring<D>) {
        let closed = self.take_closed(&mut lock(&self.open));
        self.close(ring, closed);
    }

    /// Takes out of `open` the pieces with no part left unfinished; after a failure, skips
    /// the unclaimed parts first.
    fn take_closed(&self, open: &mut Vec<Open<D::Event>>) -> Vec<Open<D::Event>> {
        if self.failed.load(Ordering::Relaxed) {
            for entry in open.iter_mut() {
                entry.unfinished -= entry.parts - entry.claimed;
                entry.claimed = entry.parts;
                entry.failed = true;
            }
        }
        open.extract_if(.., |entry| entry.unfinished == 0).collect()
    }

    /// Closes open pieces whose parts are all finished: queues the copies of each whose parts
    /// were all read (unless the job failed), gives the chunks back, then counts the pieces
    /// finished.
    fn close(&self, ring: &Ring<D>, closed: Vec<Open<D::Event>>) {
        if closed.is_empty() {
            return;
        }
        let filled = closed.into_iter();
        self.queue_filled(
            ring,
            filled.map(|open| (open.chunk, open.piece, (!open.failed).then_some(open.start))),
        );
    }

    /// Counts the piece toward its targets and completes those it was the last of.
    fn landed(&self, piece: &Piece) -> Result<()> {
        let mut targets: Vec<usize> = piece.copies.iter().map(|c| c.target).collect();
        targets.sort_unstable();
        targets.dedup();
        // AcqRel: the thread that counts the last piece sees every other piece's copies
        // queued before it records behind them.
        targets.retain(|&target| self.remaining[target].fetch_sub(1, Ordering::AcqRel) == 1);
        if targets.is_empty() {
            return Ok(());
        }
        let destination = (self.destination.get()).expect("known before any copy is queued");
        (destination.sink)(&targets, &self.stream)
    }
}

/// Reads `pieces` into the chunk memory at `starts`: one piece past the page cache if
/// `direct`, else through it; several past it in one call (what that leaves unread, through
/// the cache).
///
/// # Safety
///
/// As [`DataFile::read_at`] with scratch, for each piece at its start; the pieces follow
/// one another in the file on block boundaries.
unsafe fn read_pieces(
    file: &DataFile,
    starts: &[*mut u8],
    pieces: &[Piece],
    direct: bool,
) -> Result<()> {
    if let [piece] = pieces {
        let mode = if direct {
            ReadMode::Direct
        } else {
            ReadMode::Buffered
        };
        // SAFETY: forwarded from the caller.
        return unsafe { file.read_at(starts[0], piece.len, piece.offset, mode, true) };
    }
    let parts: Vec<(*mut u8, usize)> = starts
        .iter()
        .zip(pieces)
        .map(|(&start, piece)| (start, piece.len))
        .collect();
    // SAFETY: forwarded from the caller.
    let filled = unsafe { file.read_direct_parts(&parts, pieces[0].offset) }?;
    for ((&start, piece), filled) in starts.iter().zip(pieces).zip(filled) {
        if filled < piece.len {
            // SAFETY: the rest of the piece's memory, writable and ours (the contract).
            unsafe {
                file.read_through_cache(
                    start.wrapping_add(filled),
                    piece.len - filled,
                    piece.offset + filled as u64,
                )
            }?;
        }
    }
    Ok(())
}

/// How far a job is.
#[derive(Default)]
struct Progress {
    /// Pieces moved or skipped.
    pieces: usize,
    /// Whether `done` was called, and whether it has returned (the job is complete).
    closing: bool,
    complete: bool,
}

/// Marks a job complete when dropped, and wakes its waiters.
struct Complete<'a, D: Dma> {
    job: &'a Job<D>,
}

impl<D: Dma> Drop for Complete<'_, D> {
    fn drop(&mut self) {
        lock(&self.job.finished).complete = true;
        self.job.all_finished.notify_all();
    }
}

/// A thread leaving a job (out of [`Job::work`], or out of [`Job::arrive`]): fails the job if
/// it panics, and skips the parts it might have been the only one to read; releases parked
/// pieces when the job has failed.
struct Leaving<'a, D: Dma> {
    job: &'a Job<D>,
    ring: &'a Ring<D>,
}

impl<D: Dma> Drop for Leaving<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.job.fail(panicked());
            self.job.skip_unclaimed_parts(self.ring);
        }
        // Every thread leaves through here, so the last to leave a failed job finds every
        // piece parked for a lead that is no longer queued.
        if self.job.failed.load(Ordering::Relaxed) {
            self.job.release_parked(self.ring);
        }
    }
}

/// Counts a part of an open piece finished when dropped; a panic while reading it fails the
/// job.
struct PartFinished<'a, D: Dma> {
    job: &'a Job<D>,
    ring: &'a Ring<D>,
    piece: usize,
    read: bool,
}

impl<D: Dma> Drop for PartFinished<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.job.fail(panicked());
        }
        self.job.finish_part(self.ring, self.piece, self.read);
    }
}

/// Lets a named job complete when dropped (see [`Job::arrive`]).
struct Named<'a, D: Dma> {
    job: &'a Job<D>,
}

impl<D: Dma> Drop for Named<'_, D> {
    fn drop(&mut self) {
        self.job.release_unnamed();
    }
}

/// Counts pieces finished when dropped; a panic while moving them fails the job.
struct Counted<'a, D: Dma> {
    job: &'a Job<D>,
    pieces: usize,
}

impl<D: Dma> Drop for Counted<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.job.fail(panicked());
        }
        // None for an opened piece: its last part counts it.
        if self.pieces > 0 {
            self.job.count_finished(self.pieces);
        }
    }
}

/// Gives back the chunks of `taken` once no copy out of them may still run (waiting for
/// those with copies queued); a chunk whose wait fails is lost when dropped.
fn give_back_settled<D: Dma>(ring: &Ring<D>, taken: &mut [Taken<'_, D>]) {
    for taken in taken {
        let Some(chunk) = taken.chunk.as_mut() else {
            continue;
        };
        if chunk.pending && ring.dma.wait(&chunk.event).is_ok() {
            chunk.pending = false;
        }
        if !chunk.pending {
            taken.give_back();
        }
    }
}

/// Whether `next` can be read in the same call as `piece`, past the page cache: it starts
/// where `piece` ends, in the same file, on a block boundary.
fn follows(piece: &Piece, next: &Piece) -> bool {
    next.file == piece.file
        && next.offset == piece.end()
        && next.offset.is_multiple_of(DIRECT_ALIGN as u64)
}

/// The job's outcome once its threads are done: after a failure, the stream is waited for so
/// that no copy of the job still runs when the caller frees its destinations.
pub(crate) fn finish<D: Dma>(job: &Job<D>, ring: &Ring<D>) -> Result<()> {
    match job.take_error() {
        None => Ok(()),
        Some(error) => {
            let _ = ring.dma.wait_stream(&job.stream);
            Err(error)
        }
    }
}

/// The error of a job whose thread panicked.
fn panicked() -> Error {
    Error::Invalid("a reading thread panicked".into())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
