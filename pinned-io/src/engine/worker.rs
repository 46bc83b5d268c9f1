//! A thread's turn at a job: the pipeline of a piece, from a claimed chunk to copies queued
//! behind its event.
//!
//! take a piece (or a part of an open piece) → take a chunk → settle it (its last copies
//! over) → read → queue the copies and record the chunk's event, or park the piece (the lead,
//! the destination) → count the piece toward its targets, whose sink completes them.

use cuda_pinned::ring::{Chunk, Dma, RingCopy, Taken, Way};

use super::arrival::{Bases, Destination};
use super::job::{Job, panicked};
use super::lead::Parked;
use super::parts::{Open, Part};
use super::read::{DIRECT_RUN, DIRECT_RUN_BYTES, follows, read_pieces};
use super::ring::ReadRing;
use crate::error::{Error, Result};
use crate::file::{DIRECT_ALIGN, ReadMode};
use crate::plan::Piece;

/// A filled piece in its chunk: the piece, and where it starts in the chunk (`None`: a part
/// of it was not read, so it is not queued).
type Filled<'a, D> = (Held<'a, D>, usize, Option<usize>);

/// What becomes of filled pieces: queued now (to the destination at these bases), parked,
/// or given back unqueued (the job failed before its destination was known).
enum Turn<'a> {
    Now(&'a Bases),
    Parked,
    Skipped,
}

/// What queueing filled pieces did: parked them, or queued (or skipped) them, handing back
/// the pieces parked for the lead if they completed it.
enum Queued<E> {
    Parked,
    Moved(Vec<Parked<E>>),
}

/// A thread working on a job with a ring.
pub(super) struct Worker<'a, D: Dma> {
    pub(super) job: &'a Job<D>,
    pub(super) ring: &'a ReadRing<D>,
}

impl<'a, D: Dma> Worker<'a, D> {
    /// Takes pieces and moves them through the ring until none is left, reading the parts of
    /// open pieces first; after a failure the rest are skipped.
    ///
    /// A piece read past the page cache takes the pieces after it along, up to
    /// [`DIRECT_RUN`] in all, while chunks are free and nobody has taken them yet: they are
    /// read in one call, and one large read keeps more of the storage busy than several small
    /// ones.
    pub(super) fn work(&self) {
        let _leaving = Leaving { worker: self };
        loop {
            if let Some(part) = self.job.open.claim() {
                self.read_part(part);
                continue;
            }
            if self.job.exhausted() {
                return;
            }
            let Some(index) = self.job.claim_piece() else {
                self.await_destination();
                continue;
            };
            if index >= self.job.pieces.len() {
                continue;
            }
            // Counted as finished however it ends, a panic included, with the pieces taken
            // along (an opened piece is counted by its last part instead).
            let mut counted = Counted {
                job: self.job,
                pieces: 1,
            };
            if !self.job.outcome.failed() {
                self.move_pieces(index, &mut counted.pieces);
            }
            drop(counted);
        }
    }

    /// Names the destination of a job made by [`Job::to_come`] (once), completes its targets
    /// without bytes, and queues the pieces that waited for it, on the calling thread, in
    /// order. An error fails the job.
    pub(super) fn arrive(&self, destination: Destination<D>) {
        let job = self.job;
        let parked = {
            let mut waiting = job.lead.waiting();
            if !job.arrival.name(destination) {
                return;
            }
            std::mem::take(&mut waiting.parked)
        };
        job.arrival.wake();
        // The job may complete once this is over, however it ends.
        let _named = Named { job };
        // Every crew thread may have left the job, its pieces all read: after a failure (a
        // panic included), nobody else releases what waits for a lead no longer queued.
        let _leaving = Leaving { worker: self };
        // Before the pieces are counted, so that `done` sees a failure of the sink; a panic
        // in it is caught, so that nothing strands the pieces taken out of the lead.
        job.complete_empty(job.arrival.get().expect("just named"));
        let mut parked = parked;
        parked.sort_unstable_by_key(|parked| parked.piece);
        self.queue_parked(parked);
    }

    /// Fails a job whose destination will never come, with `error`, and gives back the
    /// chunks of the pieces that waited for it.
    pub(super) fn abandon(&self, error: Error) {
        self.job.fail(error);
        self.release_parked();
        self.job.release_unnamed();
    }

    /// Waits, while the destination is unknown, until there is news.
    fn await_destination(&self) {
        let job = self.job;
        // Checked under the gate: news comes through it.
        job.arrival
            .await_news(|| !job.named() && !job.outcome.failed() && !job.open.any_unclaimed());
    }

    /// Moves piece `index` through a chunk, with the pieces after it that can be read in the
    /// same call past the page cache, each into a chunk of its own that is free now;
    /// `claimed` counts the pieces taken, as they are taken. A piece read through the page
    /// cache in more than one part is opened instead, and counted by its last part. A
    /// failure is the job's.
    fn move_pieces(&self, index: usize, claimed: &mut usize) {
        let (job, ring) = (self.job, self.ring);
        let mut taken = match ring.take() {
            Ok(taken) => vec![self.held(taken)],
            Err(error) => return job.fail(error.into()),
        };
        // Asked once per piece (the page cache's residency is a system call), and passed on.
        let direct = job.reads_direct(&job.pieces[index]);
        if direct && index + 1 < job.pieces.len() {
            let mut bytes = job.pieces[index].len;
            while taken.len() < DIRECT_RUN
                && index + taken.len() < job.pieces.len()
                && follows(
                    &job.pieces[index + taken.len() - 1],
                    &job.pieces[index + taken.len()],
                )
                && bytes + job.pieces[index + taken.len()].len <= DIRECT_RUN_BYTES
                && let Some(chunk) = ring.try_take()
            {
                let mut chunk = chunk;
                if !job.take_along(index, taken.len()) {
                    chunk.give_back();
                    break;
                }
                bytes += job.pieces[index + taken.len()].len;
                *claimed += 1;
                taken.push(self.held(chunk));
            }
        }
        let pieces = &job.pieces[index..index + taken.len()];
        // The failure is recorded before `taken` may drop chunks as lost: a thread that a
        // loss wakes then finds the job failed, its first error the cause.
        let Some(starts) = self.settle(&mut taken, pieces) else {
            return;
        };
        if !direct && pieces[0].len > ring.part {
            let chunk = taken[0].taken.take_chunk();
            let parts = pieces[0].len.div_ceil(ring.part);
            job.open.open(index, starts[0] as usize, chunk, parts);
            if !job.named() {
                job.arrival.wake();
            }
            *claimed -= 1;
            return;
        }
        match self.fill_and_queue(&mut taken, index, &starts, direct) {
            // Counted by the thread that queues them.
            Ok(Queued::Parked) => *claimed -= taken.len(),
            Ok(Queued::Moved(released)) => {
                drop(taken);
                self.queue_parked(released);
            }
            Err(error) => job.fail(error),
        }
    }

    /// A chunk this job took out of the ring (parked, or opened for parts), in guards again.
    fn hold(&self, chunk: Chunk<D::Event>) -> Held<'a, D> {
        // SAFETY: the job's chunks come out of its ring alone, and a parked or open piece's
        // chunk is held by that piece alone, handed over here.
        self.held(unsafe { self.ring.hold(chunk) })
    }

    /// `taken` in a guard that fails the job if a panic drops the chunk pending.
    fn held(&self, taken: Taken<'a, D>) -> Held<'a, D> {
        Held {
            job: self.job,
            taken,
        }
    }

    /// Waits until no copy out of the taken chunks may still run, and returns where each of
    /// `pieces` starts in its chunk (congruent to its offset modulo [`DIRECT_ALIGN`]). A
    /// failed wait is the job's: that chunk is then lost and the others are given back once
    /// settled.
    fn settle(&self, taken: &mut [Held<'a, D>], pieces: &[Piece]) -> Option<Vec<*mut u8>> {
        let mut starts = Vec::with_capacity(pieces.len());
        for i in 0..taken.len() {
            let waited = self.job.timing.wait(|| taken[i].taken.settle());
            if let Err(error) = waited {
                // Recorded first: a thread that the loss wakes finds the job failed.
                self.job.fail(error.into());
                // This chunk's copies are unknown: lost (dropped pending); the others are
                // given back once theirs are known to be over.
                taken[i].taken.lose();
                give_back_settled(taken);
                return None;
            }
            let skew = (pieces[i].offset % DIRECT_ALIGN as u64) as usize;
            starts.push(taken[i].taken.start().wrapping_add(skew));
        }
        Some(starts)
    }

    /// Fills the taken chunks (settled, at `starts`) with the pieces from `first` on, one
    /// each, read past the page cache if `direct`, and queues their copies (or parks them:
    /// see [`queue`](Self::queue)).
    fn fill_and_queue(
        &self,
        taken: &mut [Held<'a, D>],
        first: usize,
        starts: &[*mut u8],
        direct: bool,
    ) -> Result<Queued<D::Event>> {
        let job = self.job;
        let pieces = &job.pieces[first..first + taken.len()];
        let file = &job.files[pieces[0].file];
        let _span = tracing::debug_span!(
            "read",
            mode = if direct { "direct" } else { "cached" },
            pieces = pieces.len(),
            bytes = pieces.iter().map(|piece| piece.len).sum::<usize>(),
            offset = pieces[0].offset,
        )
        .entered();
        // SAFETY: each chunk is this thread's alone (taken from the ring) and its last
        // copies are over (settled); it spans `capacity + 2 * DIRECT_ALIGN` bytes, so the
        // `skew < DIRECT_ALIGN` bytes before its start and the `capacity - len +
        // DIRECT_ALIGN ≥ DIRECT_ALIGN` after its piece's `len ≤ capacity` bytes lie in it;
        // each start is congruent to its piece's offset (the chunk's start is aligned); the
        // pieces follow one another in the file on block boundaries (`follows`).
        let read = job
            .timing
            .read(|| unsafe { read_pieces(file, starts, pieces, direct) });
        if let Err(error) = read {
            give_back_settled(taken);
            return Err(error);
        }
        self.queue(taken, first, starts)
    }

    /// Queues the copies of the pieces from `first` on, filled at `starts` in the taken
    /// chunks, one each; gives each chunk back where its copies are accounted for (else it is
    /// lost when dropped), then counts the pieces toward their targets.
    ///
    /// Pieces that come before the destination is known, and pieces past the lead that come
    /// before the lead's pieces are all queued (where there is room), are parked instead:
    /// the thread that names the destination or queues the lead's last piece queues them,
    /// and counts them finished. Pieces that come after the job failed, its destination
    /// unknown, are given back unqueued. When these pieces complete the lead, the pieces
    /// parked for it are handed back, for the caller to queue.
    fn queue(
        &self,
        taken: &mut [Held<'a, D>],
        first: usize,
        starts: &[*mut u8],
    ) -> Result<Queued<D::Event>> {
        let job = self.job;
        let bases = match self.turn(taken, first, starts) {
            Turn::Now(bases) => bases,
            Turn::Parked => return Ok(Queued::Parked),
            Turn::Skipped => {
                // No copies were queued out of them.
                taken.iter_mut().for_each(|held| held.taken.give_back());
                return Ok(Queued::Moved(Vec::new()));
            }
        };
        let pieces = &job.pieces[first..first + taken.len()];
        let _span = tracing::debug_span!(
            "queue copies",
            pieces = pieces.len(),
            copies = pieces.iter().map(|piece| piece.copies.len()).sum::<usize>(),
        )
        .entered();
        let dma = self.ring.dma();
        for ((held, piece), &start) in taken.iter_mut().zip(pieces).zip(starts) {
            let copies = coalesced(piece.copies.iter().map(|copy| {
                let base = bases.of(copy.target);
                let copy = RingCopy {
                    host: start.wrapping_add(copy.from),
                    host_pitch: copy.pitch,
                    device: base + copy.dst,
                    width: copy.width,
                    rows: copy.rows,
                };
                (base, copy)
            }));
            // From here on copies out of the chunk may be queued: lost if dropped.
            held.taken.chunk_mut().mark_pending();
            let taken = &held.taken;
            let queued = dma.enqueue(&job.stream, |stream| {
                // SAFETY: the copies read the piece's bytes, filled at `start` by the caller
                // (or, for a parked piece, by the thread that parked it, its chunk held
                // untouched since), in the page-locked ring; the chunk is left alone until its
                // event, recorded next, completes (or, if that fails, it is lost). They write
                // at their targets' bases plus their offsets, into the destination the job's
                // owner lent for it (at creation, or naming it). Inside `enqueue`, on its
                // stream.
                unsafe { dma.queue(stream, &copies, Way::Upload) }?;
                taken.record(stream)
            });
            if let Err(error) = queued {
                // Copies may be queued that no event covers: reused only once the stream is
                // known to be done with them, else lost when dropped. One that a capture took
                // in may run at any launch of its graph: lost without waiting for the stream,
                // which would break the capture. The chunks of the pieces after it, filled
                // and not queued, are given back when dropped.
                if !matches!(error, cuda_pinned::Error::Capturing)
                    && dma.wait_stream(&job.stream).is_ok()
                {
                    // SAFETY: the stream the copies were queued on (or joined back to, from a
                    // fence's companion) has finished its work.
                    unsafe { held.taken.chunk_mut().mark_settled() };
                }
                return Err(error.into());
            }
            held.taken.give_back();
        }
        // Every chunk is back before the targets complete (the sink runs): nothing is held
        // if it fails or panics.
        pieces.iter().try_for_each(|piece| job.landed(piece))?;
        Ok(Queued::Moved(job.lead.queued(first, pieces.len())))
    }

    /// What becomes of the filled pieces from `first` on (see [`queue`](Self::queue)); when
    /// parked, their chunks are taken out of `taken`.
    fn turn(&self, taken: &mut [Held<'a, D>], first: usize, starts: &[*mut u8]) -> Turn<'a> {
        let job = self.job;
        // Without the lock where nothing can park: the destination known, and a lead piece
        // or a lead all queued (a stale flag only takes the way below).
        if let Some(destination) = job.arrival.get()
            && (job.lead.holds(first) || job.lead.done())
        {
            return Turn::Now(&destination.bases);
        }
        let mut waiting = job.lead.waiting();
        let failed = job.outcome.failed();
        let counted = match job.arrival.get() {
            // Nobody names the destination of a failed job.
            None if failed => return Turn::Skipped,
            None => false,
            // Not once the job has failed: the lead may never be queued then.
            Some(destination) => {
                if job.lead.holds(first)
                    || waiting.left == 0
                    || failed
                    || !self.ring.park(taken.len())
                {
                    return Turn::Now(&destination.bases);
                }
                true
            }
        };
        for (i, (held, &start)) in taken.iter_mut().zip(starts).enumerate() {
            waiting.parked.push(Parked {
                piece: first + i,
                start: start as usize,
                chunk: held.taken.take_chunk(),
                counted,
            });
        }
        Turn::Parked
    }

    /// Queues parked pieces, in order (the thread that named the destination, or queued the
    /// lead's last piece, does).
    fn queue_parked(&self, parked: Vec<Parked<D::Event>>) {
        if parked.is_empty() {
            return;
        }
        let filled = self.unpark(parked);
        self.queue_filled(filled);
    }

    /// Parked pieces back in guards, out of the ring's count of parked chunks.
    fn unpark(&self, parked: Vec<Parked<D::Event>>) -> Vec<Filled<'a, D>> {
        (self.ring).unpark(parked.iter().filter(|parked| parked.counted).count());
        (parked.into_iter())
            .map(|p| (self.hold(p.chunk), p.piece, Some(p.start)))
            .collect()
    }

    /// Queues filled pieces in the order given until the job fails, and counts them finished
    /// however that ends, but for those parked again (for the lead); pieces parked for the
    /// lead that these complete are queued after them. An error fails the job before they
    /// are counted, so that `done` sees it.
    fn queue_filled(&self, filled: Vec<Filled<'a, D>>) {
        let mut pending = filled;
        while !pending.is_empty() {
            // Declared before the chunks' guards, so dropped after them: every chunk is back
            // (given back, or lost as its copies allow) before its piece is counted, a panic
            // included.
            let mut counted = Counted {
                job: self.job,
                pieces: pending.len(),
            };
            let mut released_counted = Counted {
                job: self.job,
                pieces: 0,
            };
            let mut batch = std::mem::take(&mut pending);
            let mut released = Vec::new();
            for (held, piece, start) in &mut batch {
                let Some(start) = *start else {
                    continue;
                };
                if self.job.outcome.failed() {
                    break;
                }
                let starts = [start as *mut u8];
                match self.queue(std::slice::from_mut(held), *piece, &starts) {
                    // Counted by the thread that queues it.
                    Ok(Queued::Parked) => counted.pieces -= 1,
                    Ok(Queued::Moved(parked)) => {
                        released_counted.pieces += parked.len();
                        released.extend(self.unpark(parked));
                    }
                    Err(error) => {
                        self.job.fail(error);
                        break;
                    }
                }
            }
            drop(batch);
            drop(counted);
            // Counted by the next round instead.
            released_counted.pieces = 0;
            pending = released;
        }
    }

    /// After a failure, gives back the chunks of the parked pieces (none has copies queued)
    /// and counts the pieces finished: nobody comes to queue them.
    fn release_parked(&self) {
        let parked = self.job.lead.take_parked();
        if parked.is_empty() {
            return;
        }
        let count = parked.len();
        self.ring
            .unpark(parked.iter().filter(|parked| parked.counted).count());
        for parked in parked {
            self.hold(parked.chunk).taken.give_back();
        }
        self.job.count_finished(count);
    }

    /// Reads `part` of an open piece through the page cache (unless the job failed), and
    /// counts it finished however that ends.
    fn read_part(&self, part: Part) {
        let job = self.job;
        let mut finished = PartFinished {
            worker: self,
            piece: part.piece,
            read: false,
        };
        if job.outcome.failed() {
            return;
        }
        #[cfg(test)]
        if let Some(hook) = &job.part_hook {
            hook(part.piece, part.index);
        }
        let piece = &job.pieces[part.piece];
        let part_bytes = self.ring.part;
        let from = part.index * part_bytes;
        let len = part_bytes.min(piece.len - from);
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
        let read = job.timing.read(|| unsafe {
            job.files[piece.file].read_at(
                (part.start + from) as *mut u8,
                len,
                piece.offset + from as u64,
                ReadMode::Buffered,
                false,
            )
        });
        match read {
            Ok(()) => finished.read = true,
            Err(error) => job.fail(error),
        }
    }

    /// Closes open pieces whose parts are all finished: queues the copies of each whose parts
    /// were all read (unless the job failed), gives the chunks back, then counts the pieces
    /// finished.
    fn close(&self, closed: Vec<Open<D::Event>>) {
        if closed.is_empty() {
            return;
        }
        let filled = closed
            .into_iter()
            .map(|open| {
                let start = (!open.failed).then_some(open.start);
                (self.hold(open.chunk), open.piece, start)
            })
            .collect();
        self.queue_filled(filled);
    }
}

/// `copies` (each with the base of the allocation it writes into) with each plain copy that
/// continues the one before it on both sides, in the same allocation (the next tensor of a
/// block, read from the bytes after it), folded into it: the DMA engine pays for every copy
/// it starts, and a chunk of small tensors then goes in one copy. Copies into different
/// allocations stay apart even where the allocations touch: CUDA refuses a copy across two.
fn coalesced(copies: impl Iterator<Item = (u64, RingCopy)>) -> Vec<RingCopy> {
    let mut out: Vec<RingCopy> = Vec::new();
    let mut last_base = None;
    for (base, copy) in copies {
        if let Some(last) = out.last_mut()
            && last_base == Some(base)
            && last.rows == 1
            && copy.rows == 1
            && last.host.wrapping_add(last.width) == copy.host
            && last.device + last.width as u64 == copy.device
        {
            last.width += copy.width;
            last.host_pitch = last.width;
            continue;
        }
        last_base = Some(base);
        out.push(copy);
    }
    out
}

/// A chunk taken for a job: a panic that drops it with copies pending fails the job first,
/// so that a thread the loss wakes finds the panic the cause.
struct Held<'a, D: Dma> {
    job: &'a Job<D>,
    taken: Taken<'a, D>,
}

impl<D: Dma> Drop for Held<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() && self.taken.is_held() && self.taken.chunk().pending() {
            self.job.fail(panicked());
        }
    }
}

/// Gives back the chunks of `taken` once no copy out of them may still run (waiting for
/// those with copies queued); a chunk whose wait fails is lost when dropped.
fn give_back_settled<D: Dma>(taken: &mut [Held<'_, D>]) {
    for held in taken {
        if held.taken.is_held() && held.taken.settle().is_ok() {
            held.taken.give_back();
        }
    }
}

/// A thread leaving a job (out of [`Worker::work`], or out of [`Worker::arrive`]): fails the
/// job if it panics, and skips the parts it might have been the only one to read; releases
/// parked pieces when the job has failed.
struct Leaving<'w, 'a, D: Dma> {
    worker: &'w Worker<'a, D>,
}

impl<D: Dma> Drop for Leaving<'_, '_, D> {
    fn drop(&mut self) {
        let job = self.worker.job;
        if std::thread::panicking() {
            job.fail(panicked());
            let closed = job.open.skip_unclaimed();
            self.worker.close(closed);
        }
        // Every thread leaves through here, so the last to leave a failed job finds every
        // piece parked for a lead that is no longer queued.
        if job.outcome.failed() {
            self.worker.release_parked();
        }
    }
}

/// Counts a part of an open piece finished when dropped, and closes the piece if it was the
/// last; a panic while reading it fails the job.
struct PartFinished<'w, 'a, D: Dma> {
    worker: &'w Worker<'a, D>,
    piece: usize,
    read: bool,
}

impl<D: Dma> Drop for PartFinished<'_, '_, D> {
    fn drop(&mut self) {
        let job = self.worker.job;
        if std::thread::panicking() {
            job.fail(panicked());
        }
        let closed = job.open.finish(self.piece, self.read, job.outcome.failed());
        self.worker.close(closed);
    }
}

/// Lets a named job complete when dropped (see [`Worker::arrive`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(host: usize, device: u64, width: usize, rows: usize) -> RingCopy {
        RingCopy {
            host: host as *mut u8,
            host_pitch: width + if rows > 1 { 8 } else { 0 },
            device,
            width,
            rows,
        }
    }

    #[test]
    fn copies_that_continue_each_other_on_both_sides_go_as_one() {
        let one = |copies: &[RingCopy]| coalesced(copies.iter().map(|&copy| (100, copy)));
        let merged = one(&[
            copy(0, 100, 10, 1),
            copy(10, 110, 5, 1),
            copy(15, 115, 1, 1),
        ]);
        assert_eq!(merged, [copy(0, 100, 16, 1)]);
        // A gap on either side, or a strided copy, keeps them apart.
        let apart = [
            copy(0, 100, 10, 1),
            copy(11, 110, 5, 1),
            copy(16, 116, 4, 1),
        ];
        assert_eq!(one(&apart), apart);
        let apart = [copy(0, 100, 10, 1), copy(10, 111, 5, 1)];
        assert_eq!(one(&apart), apart);
        let strided = [copy(0, 100, 10, 1), copy(10, 110, 4, 2)];
        assert_eq!(one(&strided), strided);
        // Allocations that touch: a copy each.
        let touching = [(100, copy(0, 100, 10, 1)), (110, copy(10, 110, 5, 1))];
        assert_eq!(
            coalesced(touching.into_iter()),
            touching.map(|(_, copy)| copy)
        );
    }
}
