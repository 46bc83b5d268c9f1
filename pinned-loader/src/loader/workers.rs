//! The loader's workers: each takes a batch's task and fills a pinned slot with its samples.

use std::collections::VecDeque;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use pinned_pool::Pool;

use crate::dataset::Dataset;
use crate::error::LoaderError;
use crate::fields::Fields;
use crate::slot::{Slot, SlotPool};
use crate::stats::Counters;
/// What the loader, its workers and its batches share.
pub(crate) struct Shared<D: Dataset> {
    pub(crate) dataset: D,
    pub(crate) fields: D::Fields,
    pub(crate) sample_bytes: Arc<[usize]>,
    /// Bytes of each region of a slot: a full batch of the field.
    pub(crate) region_bytes: Vec<usize>,
    pub(crate) pool: Arc<Pool>,
    pub(crate) slots: Arc<SlotPool>,
    /// Made current on the loader's threads (the pinned memory's NUMA node follows it).
    pub(crate) device: Option<cuda_pinned::Device>,
    pub(super) state: Mutex<State>,
    /// `state.generation`, for the check a worker makes before each sample without taking
    /// the lock (written under it): a task of an older generation is dropped.
    pub(super) generation: AtomicU64,
    /// Work was queued, or the workers should stop.
    pub(super) work: Condvar,
    /// A batch was finished.
    pub(super) done: Condvar,
    pub(crate) counters: Counters,
}

pub(super) struct State {
    /// The current epoch's: tasks and results of older generations are dropped; a newer one
    /// is the next epoch's, begun ahead.
    pub(super) generation: u64,
    /// The newest generation handed out.
    pub(super) newest: u64,
    pub(super) tasks: VecDeque<Task>,
    pub(super) finished: Vec<Finished>,
    pub(super) shutdown: bool,
    /// Worker threads running: when none is left, a consumer waiting for a batch gets an
    /// error instead of waiting for ever.
    pub(super) live_workers: usize,
}

#[derive(Clone)]
pub(super) struct Task {
    pub(super) generation: u64,
    pub(super) batch: usize,
    pub(super) indices: Arc<Vec<usize>>,
    pub(super) range: Range<usize>,
    /// Its samples named to the dataset ([`Dataset::read_ahead`]), once.
    pub(super) naming: Arc<Naming>,
}

/// A batch's samples named to the dataset, once: by the thread that fills it, or earlier by
/// a worker that took a batch queued before it. The filling thread waits for a naming under
/// way (the samples are named before any is written), and names them again where that one
/// panicked (the panic is then its own to report); a worker naming ahead leaves alone a batch
/// that another thread began naming.
pub(super) struct Naming {
    begun: AtomicBool,
    done: Once,
}

impl Task {
    pub(super) fn new(
        generation: u64,
        batch: usize,
        indices: Arc<Vec<usize>>,
        range: Range<usize>,
    ) -> Self {
        Self {
            generation,
            batch,
            indices,
            range,
            naming: Arc::new(Naming {
                begun: AtomicBool::new(false),
                done: Once::new(),
            }),
        }
    }
}

pub(super) struct Finished {
    pub(super) generation: u64,
    pub(super) batch: usize,
    pub(super) result: Result<(Slot, usize), LoaderError>,
}

/// How a fill ended early.
pub(super) enum Stop {
    Failed(LoaderError),
    /// The epoch ended meanwhile.
    Cancelled,
}

impl<D: Dataset> Shared<D> {
    /// The state a loader's workers and batches share, with no work queued yet.
    pub(super) fn new(
        dataset: D,
        fields: D::Fields,
        sample_bytes: Arc<[usize]>,
        region_bytes: Vec<usize>,
        pool: Arc<Pool>,
        slots: Arc<SlotPool>,
        device: Option<cuda_pinned::Device>,
    ) -> Self {
        Self {
            dataset,
            fields,
            sample_bytes,
            region_bytes,
            pool,
            slots,
            device,
            state: Mutex::new(State {
                generation: 0,
                newest: 0,
                tasks: VecDeque::new(),
                finished: Vec::new(),
                shutdown: false,
                live_workers: 0,
            }),
            generation: AtomicU64::new(0),
            work: Condvar::new(),
            done: Condvar::new(),
            counters: Counters::default(),
        }
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Ends the current generation and any begun ahead: their tasks and results are dropped.
    /// Returns the new generation and the results nobody claimed.
    pub(super) fn next_generation(&self) -> (u64, Vec<Finished>) {
        let mut state = self.state();
        state.newest += 1;
        let generation = state.newest;
        (generation, self.advance(&mut state, generation))
    }

    /// A generation for the next epoch's tasks, begun ahead of it.
    pub(super) fn generation_ahead(&self) -> u64 {
        let mut state = self.state();
        state.newest += 1;
        state.newest
    }

    /// Makes `generation` the current one: tasks and results of older ones are dropped (the
    /// results returned, for their slots).
    pub(super) fn advance(&self, state: &mut State, generation: u64) -> Vec<Finished> {
        state.generation = generation;
        self.generation.store(generation, Ordering::Relaxed);
        state.tasks.retain(|task| task.generation >= generation);
        let (kept, stale) = std::mem::take(&mut state.finished)
            .into_iter()
            .partition(|finished| finished.generation >= generation);
        state.finished = kept;
        stale
    }

    /// The slots of results nobody will claim.
    pub(super) fn give_back(&self, unclaimed: Vec<Finished>) {
        for finished in unclaimed {
            self.discard(finished.result);
        }
    }

    /// A result nobody will see: its slot goes back, and its error is dropped where a
    /// panicking `Drop` of the dataset's own error (inside it) cannot stop the caller.
    pub(super) fn discard(&self, result: Result<(Slot, usize), LoaderError>) {
        match result {
            Ok((slot, _)) => self.slots.give(slot),
            Err(error) => {
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drop(error))) {
                    std::mem::forget(payload);
                }
            }
        }
    }

    /// A free slot, or a new one (pinned on the hot path: counted) when the consumer holds
    /// them all.
    pub(super) fn take_slot(&self) -> Result<Slot, LoaderError> {
        if let Some(slot) = self.slots.take() {
            return Ok(slot);
        }
        self.counters.late_slots.fetch_add(1, Ordering::Relaxed);
        Ok(Slot::new(&self.pool, &self.region_bytes)?)
    }

    /// [`fill`](Self::fill), with a panic anywhere in it (a dataset's `Fields` or storage
    /// among the causes) turned into the batch's error, so that no batch is ever missing.
    pub(super) fn fill_caught(&self, task: &Task, ahead: &[Task]) -> Result<(Slot, usize), Stop> {
        catch_unwind(AssertUnwindSafe(|| self.fill(task, ahead))).unwrap_or_else(|panic| {
            let first = task.indices.get(task.range.start).copied().unwrap_or(0);
            Err(Stop::Failed(panicked(task.batch, first, panic)))
        })
    }

    /// Fills a slot with the samples of `task`, after naming them to the dataset, and those
    /// of the batches `ahead` (queued behind it) not named yet.
    pub(super) fn fill(&self, task: &Task, ahead: &[Task]) -> Result<(Slot, usize), Stop> {
        let _span =
            tracing::debug_span!("fill", batch = task.batch, samples = task.range.len()).entered();
        let start = Instant::now();
        // Before the slot, which may have to be pinned first: a cold batch's reads run
        // meanwhile.
        self.read_ahead(task);
        for ahead in ahead {
            if ahead.generation < self.generation() {
                // Its epoch ended: it will not be filled.
                break;
            }
            if ahead.naming.begun.swap(true, Ordering::AcqRel) {
                continue;
            }
            // A panic there is the batch's own filler's to report (it names them again).
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| self.read_ahead(ahead))) {
                std::mem::forget(payload);
            }
        }
        let mut slot = self.take_slot().map_err(Stop::Failed)?;
        // A panic in the dataset's `Fields` goes here; the slot goes back either way.
        let result = catch_unwind(AssertUnwindSafe(|| self.fill_slot(&mut slot, task)))
            .unwrap_or_else(|panic| {
                let first = task.indices.get(task.range.start).copied().unwrap_or(0);
                Err(Stop::Failed(panicked(task.batch, first, panic)))
            });
        match result {
            Ok(len) => {
                self.counters
                    .fill_ns
                    .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let bytes: usize = self.sample_bytes.iter().map(|b| b * len).sum();
                self.counters
                    .filled_bytes
                    .fetch_add(bytes as u64, Ordering::Relaxed);
                Ok((slot, len))
            }
            Err(stop) => {
                self.slots.give(slot);
                Err(stop)
            }
        }
    }

    pub(super) fn fill_slot(&self, slot: &mut Slot, task: &Task) -> Result<usize, Stop> {
        let indices = &task.indices[task.range.clone()];
        let mut regions = slot
            .ready(&self.pool, &self.region_bytes)
            .map_err(|e| Stop::Failed(e.into()))?;
        let pinned = self.dataset.pinned_storage();
        for (position, &index) in indices.iter().enumerate() {
            if task.generation < self.generation() {
                return Err(Stop::Cancelled);
            }
            let mut places = regions
                .iter_mut()
                .zip(self.sample_bytes.iter())
                .map(|(region, &bytes)| &mut region[position * bytes..(position + 1) * bytes]);
            let failure = |source| {
                Stop::Failed(LoaderError::Sample {
                    batch: task.batch,
                    sample: index,
                    source,
                })
            };
            if let Some(storage) = pinned {
                for (field, place) in places.enumerate() {
                    cuda_pinned::copy_streaming(place, storage.sample(index, field));
                }
                continue;
            }
            let sample = self.fields.sample(&mut places);
            match catch_unwind(AssertUnwindSafe(|| self.dataset.write(index, sample))) {
                Ok(Ok(())) => {}
                Ok(Err(source)) => return Err(failure(source)),
                Err(panic) => return Err(Stop::Failed(panicked(task.batch, index, panic))),
            }
        }
        Ok(indices.len())
    }

    /// Names `task`'s samples to the dataset (a dataset reading files starts reading them),
    /// once whichever thread asks first; returns once they are named.
    fn read_ahead(&self, task: &Task) {
        if self.dataset.pinned_storage().is_none() {
            task.naming.begun.store(true, Ordering::Release);
            task.naming.done.call_once_force(|_| {
                self.dataset.read_ahead(&task.indices[task.range.clone()]);
            });
        }
    }

    /// A worker: takes tasks until told to stop.
    pub(super) fn work(&self) {
        let mut exit = Exit {
            shared: self,
            task: None,
        };
        loop {
            let (task, ahead) = {
                let mut state = self.state();
                loop {
                    if state.shutdown {
                        return;
                    }
                    if let Some(task) = state.tasks.pop_front() {
                        // The batches queued behind it, up to one for each worker, that no
                        // thread has named yet: named with its own, so that as workers move
                        // from batch to batch the disk still has their next reads queued.
                        let ahead: Vec<Task> = (state.tasks.iter())
                            .take(state.live_workers.max(1))
                            .filter(|queued| !queued.naming.begun.load(Ordering::Acquire))
                            .cloned()
                            .collect();
                        break (task, ahead);
                    }
                    state = self
                        .work
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            exit.task = Some((task.generation, task.batch));
            let result = match self.fill_caught(&task, &ahead) {
                Ok(done) => Ok(done),
                Err(Stop::Failed(error)) => Err(error),
                Err(Stop::Cancelled) => {
                    exit.task = None;
                    continue;
                }
            };
            let mut state = self.state();
            if task.generation >= state.generation {
                state.finished.push(Finished {
                    generation: task.generation,
                    batch: task.batch,
                    result,
                });
                self.done.notify_all();
            } else {
                drop(state);
                self.discard(result);
            }
            exit.task = None;
        }
    }

    pub(super) fn spawn_workers(self: &Arc<Self>, count: usize) -> Vec<JoinHandle<()>> {
        (0..count)
            .filter_map(|i| {
                let shared = self.clone();
                self.state().live_workers += 1;
                let spawned = std::thread::Builder::new()
                    .name(format!("pinned-loader-{i}"))
                    .spawn(move || {
                        use_device(shared.device);
                        shared.work();
                    });
                if spawned.is_err() {
                    self.state().live_workers -= 1;
                }
                spawned.ok()
            })
            .collect()
    }

    pub(super) fn stop_workers(&self, workers: Vec<JoinHandle<()>>) {
        self.state().shutdown = true;
        self.work.notify_all();
        for worker in workers {
            if let Err(payload) = worker.join() {
                // A panic's payload may panic when dropped: leaked.
                std::mem::forget(payload);
            }
        }
        self.state().shutdown = false;
    }
}

/// A worker's way out, also when it unwinds (a panic past every catch): it counts the worker
/// gone, turns the batch it was filling into an error, and wakes the consumer, which would
/// otherwise wait for that batch for ever.
pub(super) struct Exit<'a, D: Dataset> {
    pub(super) shared: &'a Shared<D>,
    /// The generation and number of the batch being filled.
    pub(super) task: Option<(u64, usize)>,
}

impl<D: Dataset> Drop for Exit<'_, D> {
    fn drop(&mut self) {
        let mut state = self.shared.state();
        state.live_workers -= 1;
        if let Some((generation, batch)) = self.task {
            state.finished.push(Finished {
                generation,
                batch,
                result: Err(LoaderError::WorkerStopped { batch }),
            });
        }
        drop(state);
        self.shared.done.notify_all();
    }
}

/// Makes the loader's device current on one of its own threads. A failure is not fatal: the
/// memory then lands on another node, and uploads name their device anyway.
pub(super) fn use_device(device: Option<cuda_pinned::Device>) {
    if let Some(device) = device {
        let _ = device.set_current();
    }
}

/// The error for a panic caught while filling `batch` at `sample`. The payload is leaked, not
/// dropped: a payload's own `Drop` may panic too, and the worker must go on.
pub(super) fn panicked(
    batch: usize,
    sample: usize,
    panic: Box<dyn std::any::Any + Send>,
) -> LoaderError {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".into());
    std::mem::forget(panic);
    LoaderError::Panicked {
        batch,
        sample,
        message,
    }
}
