//! `Loader`: workers fill batches straight into pinned slots reserved before the first batch.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Instant;

use cuda_pinned::Device;
use pinned_pool::Pool;

use crate::config::LoaderConfig;
use crate::dataset::Dataset;
use crate::error::LoaderError;
use crate::fields::Fields;
use crate::sampler::Sampler;
use crate::slot::{Slot, SlotPool};
use crate::stats::{EpochStats, LoaderStats};
mod epoch;
mod workers;

use epoch::Ahead;
pub use epoch::Epoch;
pub(crate) use workers::Shared;
use workers::use_device;

use crate::config::physical_memory;

/// Batches of a [`Dataset`] in pinned memory: PyTorch's `DataLoader(pin_memory=True)`.
///
/// # Examples
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
    /// The figures of the epochs run, the latest last (at most `HISTORY`).
    history: Vec<EpochStats>,
}

/// Epochs whose figures a loader keeps.
const HISTORY: usize = 1024;

impl<D: Dataset> Loader<D> {
    /// A loader over `dataset`.
    ///
    /// Pins its working set before returning: a slot (a full batch of every field) for each batch
    /// the workers may have in the making (`workers × prefetch`, at least `prefetch`) and two for
    /// the consumer, so that no batch waits for memory to be pinned. They are one block from the
    /// pool: the driver registers it once (a registration has a fixed cost on top of its bytes, and
    /// registrations do not run in parallel). After the loader is dropped, the block waits in the
    /// pool's cache for a request of its size class, a loader of the same shape; call
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
        let set = WorkingSet::of(&sample_bytes, &config)?;
        let pool = config.pool.clone().unwrap_or_else(|| Arc::new(Pool::new()));
        // Without CUDA there is none, and nothing to choose.
        let device = config
            .device
            .or_else(|| cuda_pinned::Device::current().ok());
        let free = Arc::new(SlotPool::default());
        for slot in set.pin(&pool, device)? {
            free.give(slot);
        }
        let shared = Arc::new(Shared::new(
            dataset,
            fields,
            sample_bytes,
            set.region_bytes,
            pool,
            free,
            device,
        ));
        let counters = &shared.counters;
        counters.reserved_bytes.store(set.bytes, Ordering::Relaxed);
        counters
            .reserved_slots
            .store(set.slots as u64, Ordering::Relaxed);
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
            history: Vec::new(),
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
        let (started, at_start) = (Instant::now(), Box::new(self.stats()));
        Epoch {
            loader: self,
            started,
            at_start,
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

    /// Each epoch's figures (the latest 1,024), the latest last; an epoch counts once its
    /// iterator is dropped. [`EpochStats::verdict`] says what limited it.
    pub fn epoch_stats(&self) -> &[EpochStats] {
        &self.history
    }

    /// Remembers an epoch's figures.
    fn record_epoch(&mut self, stats: EpochStats) {
        if self.history.len() == HISTORY {
            self.history.remove(0);
        }
        self.history.push(stats);
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

/// What a loader pins before its first batch: a slot (a full batch of every field) for each
/// batch the workers may have in the making, and two for the consumer.
struct WorkingSet {
    /// Bytes of each region of a slot: a full batch of the field.
    region_bytes: Vec<usize>,
    slots: usize,
    bytes: u64,
}

impl WorkingSet {
    /// The working set of batches of `sample_bytes` samples as `config` says, within its
    /// budget of the machine's memory.
    fn of(sample_bytes: &[usize], config: &LoaderConfig) -> Result<Self, LoaderError> {
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
        let bytes = slot_bytes.saturating_mul(slots as u64);
        let total = physical_memory();
        let budget = (total as f64 * config.max_pinned_fraction) as u64;
        if total > 0 && bytes > budget {
            return Err(LoaderError::PinnedBudget {
                requested: bytes,
                budget,
                total,
            });
        }
        Ok(Self {
            region_bytes,
            slots,
            bytes,
        })
    }

    /// The slots, as one pinned allocation (one registration, not one per region), made on a
    /// thread of its own with `device` current, so that it lands on that device's node, and
    /// zeroed by several threads.
    fn pin(&self, pool: &Arc<Pool>, device: Option<Device>) -> Result<Vec<Slot>, LoaderError> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        let make = || {
            use_device(device);
            Slot::many(pool, &self.region_bytes, self.slots, threads)
        };
        let made = std::thread::scope(|scope| {
            match std::thread::Builder::new().spawn_scoped(scope, make) {
                Ok(maker) => maker
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                // No thread: this one makes them, on whatever device is current here.
                Err(_) => Slot::many(pool, &self.region_bytes, self.slots, threads),
            }
        })?;
        Ok(made)
    }
}
