//! One epoch's batches, as an iterator, and the next epoch's begun ahead.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use super::Loader;
use super::workers::{Finished, Shared, Stop, Task};
use crate::batch::HostBatch;
use crate::dataset::Dataset;
use crate::error::LoaderError;
use crate::slot::Slot;
use crate::stats::{EpochStats, LoaderStats};

/// Batches of the epoch after the current one, begun once the current one had all of its own
/// in the making ([`LoaderConfig::prefetch_next_epoch`]): its first batches are ready when it
/// starts, not one batch's fill time later. Kept only if that epoch is the one asked for next.
pub(super) struct Ahead {
    pub(super) epoch: u64,
    pub(super) generation: u64,
    pub(super) indices: Arc<Vec<usize>>,
    pub(super) batches: Vec<Range<usize>>,
    pub(super) dispatched: usize,
}

/// One epoch's batches: an iterator of `Result<HostBatch, LoaderError>`, in order unless the loader
/// was told otherwise.
///
/// A batch whose sample failed comes out as an error naming both; the next batch follows.
pub struct Epoch<'l, D: Dataset> {
    pub(super) loader: &'l mut Loader<D>,
    /// When the epoch began, and the loader's figures then.
    pub(super) started: Instant,
    pub(super) at_start: Box<LoaderStats>,
    pub(super) epoch: u64,
    pub(super) indices: Arc<Vec<usize>>,
    pub(super) batches: Vec<Range<usize>>,
    pub(super) dispatched: usize,
    pub(super) delivered: usize,
    pub(super) generation: u64,
    /// The next epoch's batches begun, once all of this one's are in the making.
    pub(super) ahead: Option<Ahead>,
    pub(super) own_workers: Vec<JoinHandle<()>>,
}

impl<D: Dataset> Epoch<'_, D> {
    /// Batches in this epoch.
    pub fn batches(&self) -> usize {
        self.batches.len()
    }

    fn shared(&self) -> &Arc<Shared<D>> {
        &self.loader.shared
    }

    /// Workers running for this epoch (fewer than asked for if threads could not start;
    /// none: the consumer fills each batch itself).
    fn workers(&self) -> usize {
        if self.loader.config.persistent_workers {
            self.loader.workers.len()
        } else {
            self.own_workers.len()
        }
    }

    fn task(&self, batch: usize) -> Task {
        Task::new(
            self.generation,
            batch,
            self.indices.clone(),
            self.batches[batch].clone(),
        )
    }

    /// Queues batches until each worker has `prefetch` in the making; once all of this
    /// epoch's are, the next epoch's if the loader was told to prefetch it.
    fn dispatch(&mut self) {
        let limit = self.workers().saturating_mul(self.loader.config.prefetch);
        let mut queued = 0;
        while self.dispatched < self.batches.len() && self.dispatched - self.delivered < limit {
            let task = self.task(self.dispatched);
            self.shared().state().tasks.push_back(task);
            self.dispatched += 1;
            queued += 1;
        }
        if self.dispatched == self.batches.len() && self.loader.config.prefetch_next_epoch {
            queued += self.dispatch_ahead(limit - (self.dispatched - self.delivered).min(limit));
        }
        // One worker a task: the others stay asleep (a worker looks at the queue, under its
        // lock, before it sleeps, so none is missed).
        for _ in 0..queued.min(self.workers()) {
            self.shared().work.notify_one();
        }
    }

    /// Queues up to `room` of the next epoch's batches; returns how many.
    fn dispatch_ahead(&mut self, room: usize) -> usize {
        if room == 0 {
            return 0;
        }
        let shared = self.loader.shared.clone();
        let ahead = self.ahead.get_or_insert_with(|| {
            let epoch = self.epoch.wrapping_add(1);
            let indices = Arc::new(self.loader.sampler.indices(epoch));
            Ahead {
                epoch,
                generation: shared.generation_ahead(),
                batches: self.loader.sampler.batches(indices.len()),
                indices,
                dispatched: 0,
            }
        });
        let mut queued = 0;
        while ahead.dispatched < ahead.batches.len() && ahead.dispatched < room {
            let task = Task::new(
                ahead.generation,
                ahead.dispatched,
                ahead.indices.clone(),
                ahead.batches[ahead.dispatched].clone(),
            );
            shared.state().tasks.push_back(task);
            ahead.dispatched += 1;
            queued += 1;
        }
        queued
    }

    /// The next batch: waiting for it when `block`, `None` (outer) when it is not ready.
    pub(crate) fn poll(
        &mut self,
        block: bool,
    ) -> Option<Option<Result<HostBatch<D::Fields>, LoaderError>>> {
        if self.delivered == self.batches.len() {
            return Some(None);
        }
        let shared = self.shared().clone();
        let result = if self.workers() == 0 {
            // No workers: the consumer fills the batch itself.
            let task = self.task(self.delivered);
            fill_here(&shared, &task).map(|(slot, len)| (self.delivered, slot, len))
        } else {
            self.dispatch();
            let waited = Instant::now();
            let span = tracing::debug_span!("wait for batch", batch = self.delivered).entered();
            let found = self.wait_for_next(&shared, block)?;
            drop(span);
            shared
                .counters
                .wait_ns
                .fetch_add(waited.elapsed().as_nanos() as u64, Ordering::Relaxed);
            found.result.map(|(slot, len)| (found.batch, slot, len))
        };
        self.delivered += 1;
        Some(Some(result.map(|(index, slot, len)| {
            shared.counters.batches.fetch_add(1, Ordering::Relaxed);
            shared
                .counters
                .samples
                .fetch_add(len as u64, Ordering::Relaxed);
            HostBatch {
                slot: Some(slot),
                len,
                index,
                order: self.indices.clone(),
                range: self.batches[index].clone(),
                fields: shared.fields.clone(),
                sample_bytes: shared.sample_bytes.clone(),
                home: shared.slots.clone(),
            }
        })))
    }

    /// The next batch the workers finished (the next in order, unless the loader was told
    /// otherwise): waited for when `block`, `None` when it is not ready. When every worker
    /// stopped, this thread fills it.
    fn wait_for_next(&self, shared: &Shared<D>, block: bool) -> Option<Finished> {
        let in_order = self.loader.config.in_order;
        let next = self.delivered;
        let wanted = |generation: u64, batch: usize| {
            generation == self.generation && (!in_order || batch == next)
        };
        let mut state = shared.state();
        let task = loop {
            let position = state
                .finished
                .iter()
                .position(|f| wanted(f.generation, f.batch));
            if let Some(position) = position {
                return Some(state.finished.swap_remove(position));
            }
            if !block {
                return None;
            }
            if state.live_workers == 0 {
                // Every worker stopped: this thread fills the batch itself.
                let position = state
                    .tasks
                    .iter()
                    .position(|t| wanted(t.generation, t.batch));
                break position.and_then(|p| state.tasks.remove(p));
            }
            state = shared
                .done
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        };
        drop(state);
        Some(match task {
            Some(task) => Finished {
                generation: task.generation,
                batch: task.batch,
                result: fill_here(shared, &task),
            },
            // Neither done nor queued: it was lost with the worker that had it.
            None => Finished {
                generation: self.generation,
                batch: next,
                result: Err(LoaderError::WorkerStopped { batch: next }),
            },
        })
    }
}

/// Fills `task`'s batch on the consumer's thread, which holds the epoch: no newer generation
/// can cancel it.
fn fill_here<D: Dataset>(shared: &Shared<D>, task: &Task) -> Result<(Slot, usize), LoaderError> {
    match shared.fill_caught(task, &[]) {
        Ok(done) => Ok(done),
        Err(Stop::Failed(error)) => Err(error),
        Err(Stop::Cancelled) => unreachable!("the consumer holds its own epoch"),
    }
}

impl<D: Dataset> Iterator for Epoch<'_, D> {
    type Item = Result<HostBatch<D::Fields>, LoaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.poll(true).flatten()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.batches.len() - self.delivered;
        (left, Some(left))
    }
}

impl<D: Dataset> Drop for Epoch<'_, D> {
    fn drop(&mut self) {
        let shared = self.loader.shared.clone();
        // An epoch that delivered every batch hands what it began of the next one to the
        // loader; otherwise that goes with the rest.
        let unclaimed = match self.ahead.take() {
            Some(ahead) if self.delivered == self.batches.len() => {
                let stale = shared.advance(&mut shared.state(), ahead.generation);
                self.loader.ahead = Some(ahead);
                stale
            }
            _ => shared.next_generation().1,
        };
        shared.give_back(unclaimed);
        let stats = EpochStats {
            epoch: self.epoch,
            wall: self.started.elapsed(),
            workers: self.workers(),
            totals: self.loader.stats().since(&self.at_start),
        };
        let workers = std::mem::take(&mut self.own_workers);
        if !workers.is_empty() {
            shared.stop_workers(workers);
        }
        self.loader.record_epoch(stats);
        // Between epochs the pool's idle cache goes back if the machine stalls for memory.
        shared.pool.relieve_pressure();
    }
}
