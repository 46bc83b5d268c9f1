//! The loader's knobs, with PyTorch's names and meanings.

use std::sync::Arc;

use cuda_pinned::Device;
use pinned_pool::Pool;

use crate::error::LoaderError;
use crate::sampler::Sampler;

/// How a [`Loader`](crate::Loader) cuts, orders and prepares batches.
///
/// | PyTorch `DataLoader` | here |
/// |---|---|
/// | `batch_size` | [`new(batch_size)`](Self::new) |
/// | `num_workers` | [`workers`](Self::workers) (0: the consumer's thread fills batches) |
/// | `prefetch_factor` | [`prefetch`](Self::prefetch): batches in the making per worker |
/// | `shuffle=True` + `generator.manual_seed` | [`shuffle(seed)`](Self::shuffle): a new, reproducible order each epoch |
/// | `drop_last` | [`drop_last`](Self::drop_last) |
/// | `persistent_workers` | [`persistent_workers`](Self::persistent_workers) |
/// | — | [`prefetch_next_epoch`](Self::prefetch_next_epoch): persistent workers begin the next epoch early |
/// | `DistributedSampler(rank, num_replicas)` | [`shard(rank, world_size)`](Self::shard) |
/// | `in_order` | [`in_order`](Self::in_order) (`true` by default) |
/// | `pin_memory=True` | always: batches are written straight into pinned memory |
/// | `pin_memory_device` | [`device`](Self::device): the GPU the batches are for |
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    pub(crate) batch_size: usize,
    pub(crate) workers: usize,
    pub(crate) prefetch: usize,
    pub(crate) shuffle: Option<u64>,
    pub(crate) drop_last: bool,
    pub(crate) persistent_workers: bool,
    pub(crate) prefetch_next_epoch: bool,
    pub(crate) shard: (usize, usize),
    pub(crate) in_order: bool,
    pub(crate) max_pinned_fraction: f64,
    pub(crate) pool: Option<Arc<Pool>>,
    pub(crate) device: Option<Device>,
}

impl LoaderConfig {
    /// The most workers a loader starts: more are a [`LoaderError::Config`] (each is a
    /// thread, and several batches in pinned memory).
    pub const MAX_WORKERS: usize = 1024;

    /// Batches of `batch_size` samples, with PyTorch's defaults for the rest.
    ///
    /// Batches of `batch_size` samples; no workers (the consumer fills each batch), prefetch
    /// 2, no shuffle, the last short batch kept, in order, at most half the machine's memory
    /// pinned.
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            workers: 0,
            prefetch: 2,
            shuffle: None,
            drop_last: false,
            persistent_workers: false,
            prefetch_next_epoch: false,
            shard: (0, 1),
            in_order: true,
            max_pinned_fraction: 0.5,
            pool: None,
            device: None,
        }
    }

    /// Threads that fill batches, at most [`MAX_WORKERS`](Self::MAX_WORKERS).
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// Batches each worker may have in the making ahead of the consumer (at least 1).
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = batches;
        self
    }

    /// A new order each epoch, drawn from `seed` and the epoch's number: the same on every
    /// run and every rank.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Whether to drop the last batch when it is short.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Whether workers live from one epoch to the next (otherwise each epoch starts its own
    /// and ends them).
    pub fn persistent_workers(mut self, persistent: bool) -> Self {
        self.persistent_workers = persistent;
        self
    }

    /// Whether persistent workers begin the next epoch before the current one ends.
    ///
    /// The next epoch is the one numbered one higher; it begins once all of the current one's
    /// batches are in the making, within the same `prefetch` budget (off by default; needs
    /// [`persistent_workers`](Self::persistent_workers)). An epoch otherwise starts with every
    /// worker idle and ends with the pipeline drained, which short epochs feel most. What was begun
    /// is kept if the next epoch asked for is that one, and dropped otherwise.
    ///
    /// Those batches are written before the next epoch is asked for: a dataset whose samples
    /// depend on state the program changes between epochs (an augmentation schedule read in
    /// [`Dataset::write`](crate::Dataset::write)) would write the first ones with the old
    /// state, so leave this off for it.
    pub fn prefetch_next_epoch(mut self, prefetch: bool) -> Self {
        self.prefetch_next_epoch = prefetch;
        self
    }

    /// This process's share of the samples in distributed training: rank `rank` of `world_size`.
    ///
    /// Shares are split as by `DistributedSampler` (equal counts; the order padded by wrapping
    /// around unless `drop_last`). [`Ranks::from_env`](crate::Ranks::from_env) reads them from
    /// what torchrun, an MPI launcher or Slurm set.
    pub fn shard(mut self, rank: usize, world_size: usize) -> Self {
        self.shard = (rank, world_size);
        self
    }

    /// Whether batches come out in order (the default) or as soon as each is ready.
    pub fn in_order(mut self, in_order: bool) -> Self {
        self.in_order = in_order;
        self
    }

    /// The most of the machine's memory the loader may pin (0.5 by default).
    pub fn max_pinned_fraction(mut self, fraction: f64) -> Self {
        self.max_pinned_fraction = fraction;
        self
    }

    /// Takes pinned memory from `pool` (shared with the rest of the program) instead of a
    /// pool of the loader's own.
    pub fn pool(mut self, pool: Arc<Pool>) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The GPU the batches are for (by default the device current on the thread that makes the
    /// [`Loader`](crate::Loader)).
    ///
    /// The loader's threads make it current, so its pinned memory goes on that GPU's NUMA node, and
    /// a [`DeviceLoader`](crate::DeviceLoader) uploads to it. With one loader per GPU in a process,
    /// give each its device and a [`shard`](Self::shard).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Checks the settings against a dataset of `len` samples.
    pub(crate) fn sampler(&self, len: usize) -> Result<Sampler, LoaderError> {
        let (rank, world) = self.shard;
        if self.batch_size == 0 {
            return Err(LoaderError::Config("batch size 0".into()));
        }
        if self.prefetch == 0 {
            return Err(LoaderError::Config("prefetch 0".into()));
        }
        if self.workers > Self::MAX_WORKERS {
            return Err(LoaderError::Config(format!(
                "{} workers: at most {}",
                self.workers,
                Self::MAX_WORKERS
            )));
        }
        if self.prefetch_next_epoch && !self.persistent_workers {
            return Err(LoaderError::Config(
                "prefetch_next_epoch needs persistent_workers: other workers end with their epoch"
                    .into(),
            ));
        }
        if world == 0 || rank >= world {
            return Err(LoaderError::Config(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        if world > len.max(1) {
            return Err(LoaderError::Config(format!(
                "a world of {world} ranks for {len} samples: every rank needs one"
            )));
        }
        if !(self.max_pinned_fraction > 0.0 && self.max_pinned_fraction <= 1.0) {
            return Err(LoaderError::Config(format!(
                "max_pinned_fraction {} is not in (0, 1]",
                self.max_pinned_fraction
            )));
        }
        let sampler = Sampler {
            len,
            batch_size: self.batch_size,
            shuffle: self.shuffle,
            drop_last: self.drop_last,
            shard: self.shard,
        };
        // An epoch's order holds every index, a rank's share another list of them, and its
        // batches a range each: a dataset too large for that is refused now, not by an abort
        // at the first epoch.
        let per_rank = sampler.per_rank();
        let indices = len.saturating_add(per_rank);
        let batches = per_rank.div_ceil(self.batch_size);
        let bytes = (indices.saturating_mul(size_of::<usize>()) as u64)
            .saturating_add(batches.saturating_mul(size_of::<std::ops::Range<usize>>()) as u64);
        let memory = physical_memory();
        if memory > 0 && bytes > memory {
            return Err(LoaderError::Config(format!(
                "{len} samples: an epoch's order of them would take {bytes} bytes, more than \
                 the machine's {memory}"
            )));
        }
        Ok(sampler)
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
