//! `Loader`: workers fill batches straight into pinned slots reserved before the first batch.

use std::collections::VecDeque;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pinned_pool::Pool;

use crate::batch::{HostBatch, Slot, SlotPool};
use crate::config::LoaderConfig;
use crate::dataset::Dataset;
use crate::error::LoaderError;
use crate::fields::Fields;
use crate::sampler::Sampler;
use crate::stats::{Counters, LoaderStats};

/// Batches of a [`Dataset`] in pinned memory: PyTorch's `DataLoader(pin_memory=True)`.
///
/// ```
/// use pinned_loader::{BoxError, Field, Loader, LoaderConfig, SampleDataset};
///
/// struct Numbers;
/// impl SampleDataset for Numbers {
///     type Sample = ([f32; 4], i64);
///     type Fields = (Field<f32>, Field<i64>);
///     fn len(&self) -> usize { 1000 }
///     fn fields(&self) -> Self::Fields { (Field::new(4), Field::new(1)) }
///     fn get(&self, i: usize) -> Result<Self::Sample, BoxError> { Ok(([i as f32; 4], i as i64)) }
/// }
///
/// let mut loader = Loader::new(Numbers, LoaderConfig::new(64).workers(2).shuffle(7))?;
/// for epoch in 0..2 {
///     for batch in loader.epoch(epoch) {
///         let batch = batch?;
///         let (features, labels) = batch.fields();
///         assert_eq!(features.len(), 4 * labels.len());
///     }
/// }
/// assert_eq!(loader.stats().batches, 32);
/// # Ok::<(), pinned_loader::LoaderError>(())
/// ```
pub struct Loader<D: Dataset> {
    pub(crate) shared: Arc<Shared<D>>,
    pub(crate) config: LoaderConfig,
    pub(crate) sampler: Sampler,
    /// Workers that outlive epochs (`persistent_workers`).
    workers: Vec<JoinHandle<()>>,
    /// The next epoch's batches, begun while the last one ended.
    ahead: Option<Ahead>,
}

/// Batches of the epoch after the current one, begun once the current one had all of its own
/// in the making ([`LoaderConfig::prefetch_next_epoch`]): its first batches are ready when it
/// starts, not one batch's fill time later. Kept only if that epoch is the one asked for next.
struct Ahead {
    epoch: u64,
    generation: u64,
    indices: Arc<Vec<usize>>,
    batches: Vec<Range<usize>>,
    dispatched: usize,
}

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
    state: Mutex<State>,
    /// `state.generation`, for the check a worker makes before each sample without taking
    /// the lock (written under it): a task of an older generation is dropped.
    generation: AtomicU64,
    /// Work was queued, or the workers should stop.
    work: Condvar,
    /// A batch was finished.
    done: Condvar,
    pub(crate) counters: Counters,
}

struct State {
    /// The current epoch's: tasks and results of older generations are dropped; a newer one
    /// is the next epoch's, begun ahead.
    generation: u64,
    /// The newest generation handed out.
    newest: u64,
    tasks: VecDeque<Task>,
    finished: Vec<Finished>,
    shutdown: bool,
    /// Worker threads running: when none is left, a consumer waiting for a batch gets an
    /// error instead of waiting for ever.
    live_workers: usize,
}

struct Task {
    generation: u64,
    batch: usize,
    indices: Arc<Vec<usize>>,
    range: Range<usize>,
}

struct Finished {
    generation: u64,
    batch: usize,
    result: Result<(Slot, usize), LoaderError>,
}

/// How a fill ended early.
enum Stop {
    Failed(LoaderError),
    /// The epoch ended meanwhile.
    Cancelled,
}

impl<D: Dataset> Shared<D> {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Ends the current generation and any begun ahead: their tasks and results are dropped.
    /// Returns the new generation and the results nobody claimed.
    fn next_generation(&self) -> (u64, Vec<Finished>) {
        let mut state = self.state();
        state.newest += 1;
        let generation = state.newest;
        (generation, self.advance(&mut state, generation))
    }

    /// A generation for the next epoch's tasks, begun ahead of it.
    fn generation_ahead(&self) -> u64 {
        let mut state = self.state();
        state.newest += 1;
        state.newest
    }

    /// Makes `generation` the current one: tasks and results of older ones are dropped (the
    /// results returned, for their slots).
    fn advance(&self, state: &mut State, generation: u64) -> Vec<Finished> {
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
    fn give_back(&self, unclaimed: Vec<Finished>) {
        for finished in unclaimed {
            if let Ok((slot, _)) = finished.result {
                self.slots.give(slot);
            }
        }
    }

    /// A free slot, or a new one (pinned on the hot path: counted) when the consumer holds
    /// them all.
    fn take_slot(&self) -> Result<Slot, LoaderError> {
        if let Some(slot) = self.slots.take() {
            return Ok(slot);
        }
        self.counters.late_slots.fetch_add(1, Ordering::Relaxed);
        Ok(Slot::new(&self.pool, &self.region_bytes)?)
    }

    /// [`fill`](Self::fill), with a panic anywhere in it (a dataset's `Fields` or storage
    /// among the causes) turned into the batch's error, so that no batch is ever missing.
    fn fill_caught(&self, task: &Task) -> Result<(Slot, usize), Stop> {
        catch_unwind(AssertUnwindSafe(|| self.fill(task))).unwrap_or_else(|panic| {
            let first = task.indices.get(task.range.start).copied().unwrap_or(0);
            Err(Stop::Failed(panicked(task.batch, first, panic)))
        })
    }

    /// Fills a slot with the samples of `task`.
    fn fill(&self, task: &Task) -> Result<(Slot, usize), Stop> {
        let start = Instant::now();
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

    fn fill_slot(&self, slot: &mut Slot, task: &Task) -> Result<usize, Stop> {
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

    /// A worker: takes tasks until told to stop.
    fn work(&self) {
        let mut exit = Exit {
            shared: self,
            task: None,
        };
        loop {
            let task = {
                let mut state = self.state();
                loop {
                    if state.shutdown {
                        return;
                    }
                    if let Some(task) = state.tasks.pop_front() {
                        break task;
                    }
                    state = self
                        .work
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            exit.task = Some((task.generation, task.batch));
            let result = match self.fill_caught(&task) {
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
            } else if let Ok((slot, _)) = result {
                self.slots.give(slot);
            }
            exit.task = None;
        }
    }

    fn spawn_workers(self: &Arc<Self>, count: usize) -> Vec<JoinHandle<()>> {
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

    fn stop_workers(&self, workers: Vec<JoinHandle<()>>) {
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
struct Exit<'a, D: Dataset> {
    shared: &'a Shared<D>,
    /// The generation and number of the batch being filled.
    task: Option<(u64, usize)>,
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
fn use_device(device: Option<cuda_pinned::Device>) {
    if let Some(device) = device {
        let _ = device.set_current();
    }
}

/// The error for a panic caught while filling `batch` at `sample`. The payload is leaked, not
/// dropped: a payload's own `Drop` may panic too, and the worker must go on.
fn panicked(batch: usize, sample: usize, panic: Box<dyn std::any::Any + Send>) -> LoaderError {
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

/// The machine's memory in bytes.
pub(crate) fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}

impl<D: Dataset> Loader<D> {
    /// A loader over `dataset`. Pins its working set before returning: a slot (a full batch
    /// of every field) for each batch the workers may have in the making (`workers ×
    /// prefetch`, at least `prefetch`) and two for the consumer, so that no batch waits for
    /// memory to be pinned. They are one block from the pool: the driver registers it once
    /// (a registration costs a fixed ~0.4 ms on top of its bytes, and registrations do not
    /// run in parallel). After the loader is dropped, the block waits in the pool's cache for
    /// a request of its size class, a loader of the same shape; call
    /// [`Pool::empty_cache`](pinned_pool::Pool::empty_cache) to unpin it sooner.
    ///
    /// # Errors
    ///
    /// [`LoaderError::Config`] for settings that cannot work,
    /// [`LoaderError::PinnedBudget`] when the working set passes the stated fraction of the
    /// machine's memory, and the pool's error when pinning fails (its limit among them).
    pub fn new(dataset: D, config: LoaderConfig) -> Result<Self, LoaderError> {
        let start = Instant::now();
        let sampler = config.sampler(dataset.len())?;
        let fields = dataset.fields();
        let sample_bytes: Arc<[usize]> = fields.sample_bytes().into();
        let region_bytes: Vec<usize> = sample_bytes
            .iter()
            .map(|b| b.checked_mul(config.batch_size))
            .collect::<Option<_>>()
            .ok_or(cuda_pinned::Error::CapacityOverflow)?;
        let slot_bytes = region_bytes
            .iter()
            .fold(0u64, |sum, &b| sum.saturating_add(b as u64));
        let slots = (config.workers.max(1))
            .checked_mul(config.prefetch)
            .and_then(|n| n.checked_add(2))
            .ok_or_else(|| {
                LoaderError::Config(format!(
                    "{} workers with {} batches each in the making",
                    config.workers, config.prefetch
                ))
            })?;
        let requested = slot_bytes.saturating_mul(slots as u64);
        let total = physical_memory();
        let budget = (total as f64 * config.max_pinned_fraction) as u64;
        if total > 0 && requested > budget {
            return Err(LoaderError::PinnedBudget {
                requested,
                budget,
                total,
            });
        }
        let pool = config.pool.clone().unwrap_or_else(|| Arc::new(Pool::new()));
        // Without CUDA there is none, and nothing to choose.
        let device = config
            .device
            .or_else(|| cuda_pinned::Device::current().ok());
        let free = Arc::new(SlotPool::default());
        // The whole working set is one pinned allocation (one registration, not one per
        // region), made on a thread of its own with the loader's device current, so that it
        // lands on that device's node; it is zeroed by several threads.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        let make = || {
            use_device(device);
            Slot::many(&pool, &region_bytes, slots, threads)
        };
        let made = std::thread::scope(|scope| {
            match std::thread::Builder::new().spawn_scoped(scope, make) {
                Ok(maker) => maker
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                // No thread: this one makes them, on whatever device is current here.
                Err(_) => Slot::many(&pool, &region_bytes, slots, threads),
            }
        })?;
        for slot in made {
            free.give(slot);
        }
        let shared = Arc::new(Shared {
            dataset,
            fields,
            sample_bytes,
            region_bytes,
            pool,
            slots: free,
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
        });
        shared
            .counters
            .reserved_bytes
            .store(requested, Ordering::Relaxed);
        shared
            .counters
            .reserved_slots
            .store(slots as u64, Ordering::Relaxed);
        let workers = if config.persistent_workers {
            shared.spawn_workers(config.workers)
        } else {
            Vec::new()
        };
        shared
            .counters
            .construction_ns
            .store(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(Self {
            shared,
            config,
            sampler,
            workers,
            ahead: None,
        })
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.shared.dataset
    }

    /// The pool the batches' memory comes from.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    /// Batches in an epoch, for this rank.
    pub fn batches_per_epoch(&self) -> usize {
        self.sampler.batches(self.sampler.indices(0).len()).len()
    }

    /// The batches of epoch `epoch` (its number seeds the shuffle), as an iterator of
    /// `Result<HostBatch, LoaderError>`. Dropping it mid-way stops the workers' work on it.
    pub fn epoch(&mut self, epoch: u64) -> Epoch<'_, D> {
        // The batches begun ahead if this is the epoch they were begun for (the previous
        // epoch ended and made their generation current); otherwise a generation of its own,
        // which drops them (and whatever an epoch leaked without its drop left).
        let (indices, batches, dispatched, generation) = match self.ahead.take() {
            Some(ahead) if ahead.epoch == epoch => (
                ahead.indices,
                ahead.batches,
                ahead.dispatched,
                ahead.generation,
            ),
            _ => {
                let indices = Arc::new(self.sampler.indices(epoch));
                let batches = self.sampler.batches(indices.len());
                let (generation, stale) = self.shared.next_generation();
                self.shared.give_back(stale);
                (indices, batches, 0, generation)
            }
        };
        let own_workers = if self.config.persistent_workers {
            Vec::new()
        } else {
            self.shared.spawn_workers(self.config.workers)
        };
        Epoch {
            loader: self,
            epoch,
            indices,
            batches,
            dispatched,
            delivered: 0,
            generation,
            ahead: None,
            own_workers,
        }
    }

    /// What the loader has done so far.
    pub fn stats(&self) -> LoaderStats {
        self.shared.counters.read()
    }
}

impl<D: Dataset> Drop for Loader<D> {
    fn drop(&mut self) {
        // Work begun for an epoch that will not come stops at its next sample (a later
        // result is given back by its worker), and what is done goes with the free slots.
        self.shared.give_back(self.shared.next_generation().1);
        let workers = std::mem::take(&mut self.workers);
        self.shared.stop_workers(workers);
        // The block the slots were cut from goes back to the pool once the batches still
        // out are dropped too.
        self.shared.slots.clear();
    }
}

/// One epoch's batches: an iterator of `Result<HostBatch, LoaderError>`, in order unless the
/// loader was told otherwise. A batch whose sample failed comes out as an error naming both;
/// the next batch follows.
pub struct Epoch<'l, D: Dataset> {
    loader: &'l mut Loader<D>,
    epoch: u64,
    indices: Arc<Vec<usize>>,
    batches: Vec<Range<usize>>,
    dispatched: usize,
    delivered: usize,
    generation: u64,
    /// The next epoch's batches begun, once all of this one's are in the making.
    ahead: Option<Ahead>,
    own_workers: Vec<JoinHandle<()>>,
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
        Task {
            generation: self.generation,
            batch,
            indices: self.indices.clone(),
            range: self.batches[batch].clone(),
        }
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
            let task = Task {
                generation: ahead.generation,
                batch: ahead.dispatched,
                indices: ahead.indices.clone(),
                range: ahead.batches[ahead.dispatched].clone(),
            };
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
            match shared.fill_caught(&task) {
                Ok(done) => Ok(done),
                Err(Stop::Failed(error)) => Err(error),
                Err(Stop::Cancelled) => unreachable!("the consumer holds its own epoch"),
            }
            .map(|(slot, len)| (self.delivered, slot, len))
        } else {
            self.dispatch();
            let in_order = self.loader.config.in_order;
            let next = self.delivered;
            let waited = Instant::now();
            let mut state = shared.state();
            let found = loop {
                let position = state.finished.iter().position(|f| {
                    f.generation == self.generation && (!in_order || f.batch == next)
                });
                if let Some(position) = position {
                    break state.finished.swap_remove(position);
                }
                if !block {
                    return None;
                }
                if state.live_workers == 0 {
                    // Nobody is left to fill it.
                    break Finished {
                        generation: self.generation,
                        batch: next,
                        result: Err(LoaderError::WorkerStopped { batch: next }),
                    };
                }
                state = shared
                    .done
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            };
            drop(state);
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
                fields: shared.fields.clone(),
                sample_bytes: shared.sample_bytes.clone(),
                home: shared.slots.clone(),
            }
        })))
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
        let workers = std::mem::take(&mut self.own_workers);
        if !workers.is_empty() {
            shared.stop_workers(workers);
        }
    }
}

/// Nanoseconds as a `Duration`.
pub(crate) fn nanos(counter: &AtomicU64) -> Duration {
    Duration::from_nanos(counter.load(Ordering::Relaxed))
}
