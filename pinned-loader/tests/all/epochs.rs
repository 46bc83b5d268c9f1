//! Loaders on the CPU: every sample once, order, determinism, sharding, errors and panics,
//! dropping mid-epoch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pinned_loader::{
    BoxError, Dataset, Field, Loader, LoaderConfig, LoaderError, PinnedSamples, SampleDataset,
};
use pinned_pool::Pool;
use proptest::prelude::*;

/// Sample `i` is `[i, i, i]` as u32 plus `i` as i64; fails or panics at chosen samples, and
/// may take a while to write.
#[derive(Default)]
struct Indexed {
    len: usize,
    fail_at: Option<usize>,
    panic_at: Option<usize>,
    pause: Duration,
    writes: AtomicUsize,
}

impl Indexed {
    fn new(len: usize) -> Self {
        Self {
            len,
            ..Self::default()
        }
    }
}

impl Dataset for Indexed {
    type Fields = (Field<u32>, Field<i64>);
    fn len(&self) -> usize {
        self.len
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(3), Field::new(1))
    }
    fn write(&self, i: usize, (a, b): (&mut [u32], &mut [i64])) -> Result<(), BoxError> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.pause);
        if self.fail_at == Some(i) {
            return Err(format!("sample {i} is unreadable").into());
        }
        assert_ne!(self.panic_at, Some(i), "sample {i} panicked (on purpose)");
        a.fill(i as u32);
        b[0] = i as i64;
        Ok(())
    }
}

/// Every batch's labels, in delivery order, checking each batch's fields agree.
fn run_epoch<D: Dataset<Fields = (Field<u32>, Field<i64>)>>(
    loader: &mut Loader<D>,
    epoch: u64,
) -> Vec<Vec<i64>> {
    loader
        .epoch(epoch)
        .map(|batch| {
            let batch = batch.unwrap();
            let (a, b) = batch.fields();
            assert_eq!(a.len(), 3 * b.len());
            assert_eq!(b.len(), batch.len());
            for (sample, label) in a.chunks(3).zip(b) {
                assert!(sample.iter().all(|&x| i64::from(x) == *label));
            }
            b.to_vec()
        })
        .collect()
}

fn config(batch: usize, workers: usize) -> LoaderConfig {
    LoaderConfig::new(batch).workers(workers)
}

#[test]
fn every_sample_once_per_epoch_with_and_without_shuffle() {
    for (workers, shuffle) in [(0, None), (3, None), (3, Some(9)), (1, Some(9))] {
        let mut cfg = config(7, workers);
        if let Some(seed) = shuffle {
            cfg = cfg.shuffle(seed);
        }
        let mut loader = Loader::new(Indexed::new(50), cfg).unwrap();
        for epoch in 0..2 {
            let batches = run_epoch(&mut loader, epoch);
            assert_eq!(batches.len(), 8);
            assert_eq!(batches.last().unwrap().len(), 1);
            let mut all: Vec<i64> = batches.concat();
            if shuffle.is_none() {
                assert_eq!(all, (0..50).collect::<Vec<_>>(), "in order without shuffle");
            }
            all.sort_unstable();
            assert_eq!(all, (0..50).collect::<Vec<_>>());
        }
    }
}

#[test]
fn drop_last_drops_the_short_batch() {
    let mut loader = Loader::new(Indexed::new(50), config(7, 2).drop_last(true)).unwrap();
    let batches = run_epoch(&mut loader, 0);
    assert_eq!(batches.len(), 7);
    assert!(batches.iter().all(|b| b.len() == 7));
    assert_eq!(loader.batches_per_epoch(), 7);
}

#[test]
fn a_seed_gives_the_same_order_and_epochs_differ() {
    let order = |seed| {
        let mut loader = Loader::new(Indexed::new(40), config(8, 3).shuffle(seed)).unwrap();
        (run_epoch(&mut loader, 0), run_epoch(&mut loader, 1))
    };
    let (first, second) = order(5);
    assert_eq!(order(5), (first.clone(), second.clone()));
    assert_ne!(first, second);
    assert_ne!(order(6).0, first);
}

#[test]
fn shards_split_an_epoch_between_ranks() {
    let world = 3;
    let mut seen = Vec::new();
    for rank in 0..world {
        let cfg = config(4, 2).shuffle(1).shard(rank, world);
        let mut loader = Loader::new(Indexed::new(30), cfg).unwrap();
        let mine: Vec<i64> = run_epoch(&mut loader, 0).concat();
        assert_eq!(mine.len(), 10);
        seen.extend(mine);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..30).collect::<Vec<_>>());
    assert!(matches!(
        Loader::new(Indexed::new(30), config(4, 0).shard(3, 3)),
        Err(LoaderError::Config(_))
    ));
}

#[test]
fn unordered_delivery_still_delivers_everything() {
    let mut loader = Loader::new(Indexed::new(64), config(4, 4).in_order(false)).unwrap();
    let mut all: Vec<i64> = run_epoch(&mut loader, 0).concat();
    all.sort_unstable();
    assert_eq!(all, (0..64).collect::<Vec<_>>());
}

#[test]
fn errors_and_panics_name_batch_and_sample_and_the_loader_goes_on() {
    for workers in [0, 2] {
        let dataset = Indexed {
            len: 20,
            fail_at: Some(5),
            panic_at: Some(13),
            ..Indexed::default()
        };
        let mut loader = Loader::new(dataset, config(4, workers)).unwrap();
        let results: Vec<_> = loader.epoch(0).collect();
        assert_eq!(results.len(), 5);
        match &results[1] {
            Err(LoaderError::Sample {
                batch,
                sample,
                source,
            }) => {
                assert_eq!((*batch, *sample), (1, 5));
                assert!(source.to_string().contains("unreadable"));
            }
            other => panic!("{other:?}"),
        }
        match &results[3] {
            Err(LoaderError::Panicked {
                batch,
                sample,
                message,
            }) => {
                assert_eq!((*batch, *sample), (3, 13));
                assert!(message.contains("on purpose"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            results[1]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("batch 1, sample 5")
        );
        let good = [0, 2, 4];
        assert!(good.iter().all(|&b| results[b].is_ok()));
        drop(results);
        // The next epoch runs as usual.
        assert_eq!(loader.epoch(1).filter(Result::is_ok).count(), 3);
    }
}

#[test]
fn dropping_mid_epoch_stops_the_workers_and_gives_every_block_back() {
    let pool = Arc::new(Pool::new());
    for persistent in [false, true] {
        let cfg = config(8, 4)
            .prefetch(3)
            .pool(pool.clone())
            .persistent_workers(persistent);
        let mut loader = Loader::new(Indexed::new(1000), cfg).unwrap();
        let reserved = loader.stats().reserved_slots;
        assert_eq!(reserved, 4 * 3 + 2);
        {
            let mut epoch = loader.epoch(0);
            let held = epoch.next().unwrap().unwrap();
            let _second = epoch.next().unwrap().unwrap();
            drop(epoch);
            assert_eq!(held.len(), 8, "a batch outlives its epoch");
        }
        let writes = loader.dataset().writes.load(Ordering::Relaxed);
        assert!(
            writes < 1000,
            "the workers stopped early ({writes} samples written)"
        );
        drop(loader);
        assert_eq!(
            pool.stats().active_requests.current,
            0,
            "persistent={persistent}"
        );
    }
}

/// Sample `i` is `[i, i, epoch]`, the epoch read from state the program sets between epochs.
struct Stamped {
    len: usize,
    epoch: AtomicU64,
    writes: AtomicUsize,
}

impl Dataset for Stamped {
    type Fields = (Field<u32>, Field<i64>);
    fn len(&self) -> usize {
        self.len
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(3), Field::new(1))
    }
    fn write(&self, i: usize, (a, b): (&mut [u32], &mut [i64])) -> Result<(), BoxError> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        a.copy_from_slice(&[i as u32, i as u32, self.epoch.load(Ordering::SeqCst) as u32]);
        b[0] = i as i64;
        Ok(())
    }
}

/// Runs epochs 0 and 1 of 50 samples, setting the dataset's epoch before asking for each and,
/// when `ahead`, waiting for workers to begin epoch 1 first; returns the epoch stamps epoch 1
/// delivered, and checks that it delivered every sample once.
fn stamps_of_epoch_one(ahead: bool) -> Vec<u32> {
    let dataset = Stamped {
        len: 50,
        epoch: AtomicU64::new(0),
        writes: AtomicUsize::new(0),
    };
    let cfg = config(7, 3)
        .shuffle(4)
        .persistent_workers(true)
        .prefetch_next_epoch(ahead);
    let mut loader = Loader::new(dataset, cfg).unwrap();
    assert_eq!(loader.epoch(0).count(), 8);
    if ahead {
        let start = Instant::now();
        while loader.dataset().writes.load(Ordering::Relaxed) <= 50 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "nothing of epoch 1 was begun"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    loader.dataset().epoch.store(1, Ordering::SeqCst);
    let (mut labels, mut stamps) = (Vec::new(), Vec::new());
    for batch in loader.epoch(1) {
        let batch = batch.unwrap();
        let (a, b) = batch.fields();
        labels.extend_from_slice(b);
        stamps.extend(a.chunks(3).map(|sample| sample[2]));
    }
    labels.sort_unstable();
    assert_eq!(labels, (0..50).collect::<Vec<_>>());
    stamps
}

/// With `prefetch_next_epoch`, persistent workers begin the next epoch before it is asked for,
/// and what they wrote is delivered (written with the state of the epoch before); without
/// it, nothing of an epoch is written before it is asked for.
#[test]
fn the_next_epoch_is_begun_early_only_when_asked() {
    let early = stamps_of_epoch_one(true);
    assert!(
        early.contains(&0),
        "the batches begun ahead were not the ones delivered"
    );
    assert!(stamps_of_epoch_one(false).iter().all(|&stamp| stamp == 1));
}

/// A loader dropped while its workers write batches of the next epoch stops them at their
/// next sample (not at the end of their batches), and gives every block back.
#[test]
fn dropping_a_loader_stops_the_next_epochs_batches_at_once() {
    let pool = Arc::new(Pool::new());
    let dataset = Arc::new(Indexed {
        len: 40,
        pause: Duration::from_millis(2),
        ..Indexed::default()
    });
    let workers = 2;
    let cfg = config(10, workers)
        .persistent_workers(true)
        .prefetch_next_epoch(true)
        .pool(pool.clone());
    let mut loader = Loader::new(dataset.clone(), cfg).unwrap();
    assert_eq!(run_epoch(&mut loader, 0).concat().len(), 40);
    let start = Instant::now();
    while dataset.writes.load(Ordering::Relaxed) <= 40 {
        assert!(start.elapsed() < Duration::from_secs(60), "nothing begun");
        std::thread::sleep(Duration::from_micros(100));
    }
    let before = dataset.writes.load(Ordering::Relaxed);
    drop(loader);
    // Each worker may start one more sample before it sees the loader going; batches of ten
    // would take up to nine more each.
    let more = dataset.writes.load(Ordering::Relaxed) - before;
    assert!(
        more <= workers,
        "{more} samples written after the drop began"
    );
    assert_eq!(pool.stats().active_requests.current, 0);
}

/// The working set is pinned as one block (one registration), whatever the slot count.
#[test]
fn the_working_set_is_one_pinned_block() {
    let pool = Arc::new(Pool::new());
    let loader = Loader::new(Indexed::new(100), config(5, 4).pool(pool.clone())).unwrap();
    assert_eq!(loader.stats().reserved_slots, 4 * 2 + 2);
    assert_eq!(pool.stats().active_requests.current, 1);
    drop(loader);
    assert_eq!(pool.stats().active_requests.current, 0);
}

/// A batch kept past its loader stays readable, and keeps the block until it is dropped.
#[test]
fn a_batch_kept_past_its_loader_keeps_the_block() {
    let pool = Arc::new(Pool::new());
    let mut loader = Loader::new(Indexed::new(100), config(5, 4).pool(pool.clone())).unwrap();
    let batch = loader.epoch(0).next().unwrap().unwrap();
    drop(loader);
    assert_eq!(pool.stats().active_requests.current, 1);
    assert_eq!(batch.len(), 5);
    drop(batch);
    assert_eq!(pool.stats().active_requests.current, 0);
}

#[test]
fn a_consumer_holding_every_batch_gets_more_slots_not_a_hang() {
    let mut loader = Loader::new(Indexed::new(100), config(5, 2).prefetch(1)).unwrap();
    let held: Vec<_> = loader.epoch(0).map(Result::unwrap).collect();
    assert_eq!(held.len(), 20);
    assert!(loader.stats().late_slots > 0);
    assert_eq!(loader.stats().batches, 20);
}

#[test]
fn prefetching_the_next_epoch_without_persistent_workers_is_a_clear_error() {
    let cfg = config(4, 2).prefetch_next_epoch(true);
    let error = Loader::new(Indexed::new(10), cfg).err().unwrap();
    assert!(matches!(error, LoaderError::Config(_)), "{error}");
    assert!(error.to_string().contains("persistent_workers"), "{error}");
}

#[test]
fn worker_counts_and_sizes_that_overflow_are_clear_errors() {
    let too_many = LoaderConfig::MAX_WORKERS + 1;
    for cfg in [
        config(4, too_many),
        config(4, usize::MAX / 2 + 1),
        config(4, 8).prefetch(usize::MAX),
    ] {
        let error = Loader::new(Indexed::new(10), cfg).err().unwrap();
        assert!(matches!(error, LoaderError::Config(_)), "{error}");
    }
    struct Vast;
    impl Dataset for Vast {
        type Fields = (Field<u64>, Field<u64>);
        fn len(&self) -> usize {
            10
        }
        fn fields(&self) -> Self::Fields {
            (Field::new(usize::MAX / 4), Field::new(usize::MAX / 4))
        }
        fn write(&self, _: usize, _: (&mut [u64], &mut [u64])) -> Result<(), BoxError> {
            Ok(())
        }
    }
    // Refused as an error, whether for its size or for the memory budget.
    assert!(Loader::new(Vast, config(1, 0)).is_err());
}

#[test]
fn a_working_set_past_the_budget_is_a_clear_error() {
    struct Huge;
    impl Dataset for Huge {
        type Fields = Field<u8>;
        fn len(&self) -> usize {
            10
        }
        fn fields(&self) -> Field<u8> {
            Field::new(1 << 40)
        }
        fn write(&self, _: usize, _: &mut [u8]) -> Result<(), BoxError> {
            Ok(())
        }
    }
    let error = Loader::new(Huge, config(4, 2)).err().unwrap();
    assert!(matches!(error, LoaderError::PinnedBudget { .. }), "{error}");
    assert!(error.to_string().contains("max_pinned_fraction"), "{error}");
}

#[test]
fn sample_datasets_are_collated_and_pinned_samples_copied() {
    struct Pairs;
    impl SampleDataset for Pairs {
        type Sample = (Vec<u32>, i64);
        type Fields = (Field<u32>, Field<i64>);
        fn len(&self) -> usize {
            12
        }
        fn fields(&self) -> Self::Fields {
            (Field::new(3), Field::new(1))
        }
        fn get(&self, i: usize) -> Result<Self::Sample, BoxError> {
            Ok((vec![i as u32; 3], i as i64))
        }
    }
    let mut loader = Loader::new(Pairs, config(5, 2)).unwrap();
    assert_eq!(
        run_epoch(&mut loader, 0).concat(),
        (0..12).collect::<Vec<_>>()
    );

    let pinned = PinnedSamples::from_dataset(&Pairs).unwrap();
    assert_eq!(pinned.pinned_bytes(), 12 * 20);
    let mut loader = Loader::new(pinned, config(5, 2).shuffle(3)).unwrap();
    let mut all = run_epoch(&mut loader, 0).concat();
    all.sort_unstable();
    assert_eq!(all, (0..12).collect::<Vec<_>>());

    struct Wrong;
    impl SampleDataset for Wrong {
        type Sample = Vec<u8>;
        type Fields = Field<u8>;
        fn len(&self) -> usize {
            1
        }
        fn fields(&self) -> Field<u8> {
            Field::new(4)
        }
        fn get(&self, _: usize) -> Result<Vec<u8>, BoxError> {
            Ok(vec![0; 3])
        }
    }
    let mut loader = Loader::new(Wrong, config(1, 0)).unwrap();
    let error = loader.epoch(0).next().unwrap().unwrap_err();
    let chain = cuda_pinned::ErrorChain(&error).to_string();
    assert!(chain.contains("3 elements"), "{chain}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn any_shape_delivers_each_sample_once(
        len in 0usize..60,
        batch in 1usize..9,
        workers in 0usize..4,
        prefetch in 1usize..3,
        shuffle in proptest::option::of(any::<u64>()),
        drop_last in any::<bool>(),
        in_order in any::<bool>(),
        persistent in any::<bool>(),
    ) {
        let mut cfg = config(batch, workers)
            .prefetch(prefetch)
            .drop_last(drop_last)
            .in_order(in_order)
            .persistent_workers(persistent)
            .prefetch_next_epoch(persistent);
        if let Some(seed) = shuffle {
            cfg = cfg.shuffle(seed);
        }
        let mut loader = Loader::new(Indexed::new(len), cfg.clone()).unwrap();
        // Epoch 1 follows 0 (begun ahead with persistent workers); 3 follows 1 (what was
        // begun of 2 is dropped).
        for epoch in [0, 1, 3] {
            let batches = run_epoch(&mut loader, epoch);
            let expected = if drop_last { len / batch } else { len.div_ceil(batch) };
            prop_assert_eq!(batches.len(), expected);
            if in_order {
                // The same batches as a loader that starts at this epoch.
                let mut fresh = Loader::new(Indexed::new(len), cfg.clone()).unwrap();
                prop_assert_eq!(&batches, &run_epoch(&mut fresh, epoch));
            }
            let mut all: Vec<i64> = batches.concat();
            all.sort_unstable();
            all.dedup();
            prop_assert_eq!(all.len(), if drop_last { expected * batch } else { len });
        }
        // No slot was lost to batches begun ahead and dropped.
        prop_assert_eq!(loader.stats().late_slots, 0);
    }
}

/// A dataset whose pinned storage has other sample sizes than its fields declare.
struct Mismatched {
    storage: PinnedSamples<Field<u8>>,
}

impl Dataset for Mismatched {
    type Fields = Field<u8>;
    fn len(&self) -> usize {
        4
    }
    fn fields(&self) -> Field<u8> {
        Field::new(8)
    }
    fn write(&self, _: usize, sample: &mut [u8]) -> Result<(), BoxError> {
        sample.fill(1);
        Ok(())
    }
    fn pinned_storage(&self) -> Option<&pinned_loader::PinnedStorage> {
        self.storage.pinned_storage()
    }
}

struct Big;
impl Dataset for Big {
    type Fields = Field<u8>;
    fn len(&self) -> usize {
        4
    }
    fn fields(&self) -> Field<u8> {
        Field::new(4096)
    }
    fn write(&self, _: usize, _: &mut [u8]) -> Result<(), BoxError> {
        Ok(())
    }
}

#[test]
fn storage_of_other_sizes_is_refused_for_gathering_and_fails_batches_not_the_loader() {
    let make = || Mismatched {
        storage: PinnedSamples::from_dataset(&Big).unwrap(),
    };
    // Gathering would have the DMA write past the device buffers: refused before any CUDA.
    let error = pinned_loader::DeviceLoader::new(
        Loader::new(make(), config(2, 0)).unwrap(),
        pinned_loader::Assembly::DeviceGather,
    )
    .err()
    .unwrap();
    assert!(matches!(error, LoaderError::Config(_)), "{error}");
    // On the host the copy of a wrong-sized sample panics inside a worker: each batch comes
    // out as an error (no hang), and the loader goes on.
    for workers in [0, 2] {
        let mut loader = Loader::new(make(), config(2, workers)).unwrap();
        let results: Vec<_> = loader.epoch(0).collect();
        assert_eq!(results.len(), 2);
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(LoaderError::Panicked { .. }))),
            "{results:?}"
        );
    }
}

/// A panic payload whose own `Drop` panics with another `Bomb` as long as the count lasts.
struct Bomb(Arc<AtomicUsize>);

impl Drop for Bomb {
    fn drop(&mut self) {
        if self.0.fetch_sub(1, Ordering::SeqCst) > 0 {
            std::panic::panic_any(Bomb(self.0.clone()));
        }
    }
}

/// Panics at sample 0 with a [`Bomb`] as the payload.
struct Bombing {
    len: usize,
    drops_that_panic: Arc<AtomicUsize>,
}

impl Dataset for Bombing {
    type Fields = (Field<u32>, Field<i64>);
    fn len(&self) -> usize {
        self.len
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(3), Field::new(1))
    }
    fn write(&self, i: usize, (a, b): (&mut [u32], &mut [i64])) -> Result<(), BoxError> {
        if i == 0 {
            std::panic::panic_any(Bomb(self.drops_that_panic.clone()));
        }
        a.fill(i as u32);
        b[0] = i as i64;
        Ok(())
    }
}

/// Runs `f` on a thread of its own; `None` if it has not returned within a minute (a hang).
fn within_a_minute<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    receiver.recv_timeout(Duration::from_secs(60)).ok()
}

/// A dataset panicking with a payload that panics again on every drop neither kills a worker
/// nor hangs the epoch: the batch is an error and the others follow.
#[test]
fn a_payload_that_panics_when_dropped_is_an_error_not_a_hang() {
    for workers in [0, 1, 3] {
        let results = within_a_minute(move || {
            let dataset = Bombing {
                len: 64,
                drops_that_panic: Arc::new(AtomicUsize::new(usize::MAX)),
            };
            let mut loader = Loader::new(dataset, config(8, workers)).unwrap();
            let epoch: Vec<_> = loader.epoch(0).map(|b| b.map(|b| b.len())).collect();
            epoch
                .into_iter()
                .map(|b| b.map_err(|e| e.to_string()))
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|| panic!("the epoch hung ({workers} workers)"));
        assert_eq!(results.len(), 8);
        assert!(results[0].as_ref().is_err_and(|e| e.contains("panicked")));
        assert!(results[1..].iter().all(|r| r == &Ok(8)), "{results:?}");
    }
}

/// The batch whose dataset panicked gives its slot back even when the payload's drop panics
/// once: holding the other batches needs no slot pinned late.
#[test]
fn a_payload_that_panics_once_when_dropped_loses_no_slot() {
    let dataset = Bombing {
        len: 32,
        drops_that_panic: Arc::new(AtomicUsize::new(1)),
    };
    // Three slots: one in the worker's hands and two the consumer holds.
    let mut loader = Loader::new(dataset, config(8, 1).prefetch(1)).unwrap();
    let held: Vec<_> = loader.epoch(0).collect();
    assert!(held[0].is_err());
    assert_eq!(held.iter().filter(|b| b.is_ok()).count(), 3);
    drop(held);
    assert_eq!(loader.stats().late_slots, 0);
}

/// A world larger than the dataset is refused when the loader is made, not by an abort when
/// the first epoch allocates its order.
#[test]
fn a_world_larger_than_the_dataset_is_a_configuration_error() {
    for (len, world) in [(10, 11), (10, 1 << 40), (0, 2)] {
        let result = Loader::new(Indexed::new(len), config(4, 1).shard(0, world));
        assert!(
            matches!(result, Err(LoaderError::Config(_))),
            "{len} samples, world {world}"
        );
    }
    let mut loader = Loader::new(Indexed::new(10), config(4, 1).shard(9, 10)).unwrap();
    assert_eq!(run_epoch(&mut loader, 0).concat().len(), 1);
}

/// A dataset error whose drop panics on the loader's own threads.
#[derive(Debug)]
struct PanicsWhenDroppedByTheLoader;

impl std::fmt::Display for PanicsWhenDroppedByTheLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an error that panics when the loader drops it")
    }
}

impl std::error::Error for PanicsWhenDroppedByTheLoader {}

impl Drop for PanicsWhenDroppedByTheLoader {
    fn drop(&mut self) {
        let name = std::thread::current().name().unwrap_or("").to_owned();
        if name.starts_with("pinned-loader") {
            panic!("dropped by {name} (on purpose)");
        }
    }
}

/// Fails every sample with [`PanicsWhenDroppedByTheLoader`].
struct FailsEverySample;

impl Dataset for FailsEverySample {
    type Fields = (Field<u32>, Field<i64>);
    fn len(&self) -> usize {
        64
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(3), Field::new(1))
    }
    fn write(&self, _: usize, _: (&mut [u32], &mut [i64])) -> Result<(), BoxError> {
        // Long enough for the epoch to be abandoned while the workers hold its batches.
        std::thread::sleep(Duration::from_millis(20));
        Err(Box::new(PanicsWhenDroppedByTheLoader))
    }
}

/// Results of an abandoned epoch are dropped by the workers; an error among them whose drop
/// panics stops no worker, and the next epoch is served in full.
#[test]
fn errors_that_panic_when_dropped_by_a_worker_stop_no_worker() {
    let config = config(8, 2).persistent_workers(true).prefetch(4);
    let mut loader = Loader::new(FailsEverySample, config).unwrap();
    for epoch in 0..3 {
        let mut abandoned = loader.epoch(epoch);
        // The first batch dispatches the others, which are abandoned mid-write.
        assert!(abandoned.next().unwrap().is_err());
        std::thread::sleep(Duration::from_millis(5));
        drop(abandoned);
        std::thread::sleep(Duration::from_millis(40));
    }
    let results: Vec<_> = loader.epoch(9).collect();
    assert_eq!(results.len(), 8);
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Err(LoaderError::Sample { .. }))),
        "{results:?}"
    );
}

/// A batch's fields as buffers hold the batch's samples; the loader gets the memory back once
/// every buffer is gone, in any order, and keeps delivering with few slots; buffers kept past
/// the loader keep its block until they go.
#[test]
fn batches_as_buffers_give_their_memory_back_when_the_last_goes() {
    let pool = Arc::new(Pool::new());
    let cfg = config(8, 2).prefetch(1).pool(pool.clone());
    let mut loader = Loader::new(Indexed::new(200), cfg).unwrap();
    let mut kept = None;
    for epoch in 0..3 {
        let mut labels_seen = Vec::new();
        for (k, batch) in loader.epoch(epoch).enumerate() {
            let batch = batch.unwrap();
            let expected = batch.indices().to_vec();
            let (mut a, b) = batch.into_buffers();
            assert_eq!((a.len(), b.len()), (3 * expected.len(), expected.len()));
            for (sample, label) in a.as_slice().chunks(3).zip(b.as_slice()) {
                assert!(sample.iter().all(|&x| i64::from(x) == *label));
            }
            assert!(b.as_slice().iter().map(|&l| l as usize).eq(expected));
            labels_seen.extend_from_slice(b.as_slice());
            a.as_mut_slice().fill(u32::MAX); // the buffers are the caller's to write
            match k % 3 {
                0 => drop((a, b)),
                1 => drop((b, a)),
                _ if kept.is_none() => kept = Some(b),
                _ => drop(b),
            }
        }
        labels_seen.sort_unstable();
        assert_eq!(labels_seen, (0..200).collect::<Vec<i64>>(), "epoch {epoch}");
    }
    drop(loader);
    assert_eq!(
        pool.stats().active_requests.current,
        1,
        "a kept buffer holds the block"
    );
    drop(kept);
    assert_eq!(pool.stats().active_requests.current, 0);
}

/// The verdicts, a line each.
fn lines(verdicts: &[pinned_loader::Verdict]) -> String {
    verdicts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Each epoch leaves its figures, and the verdict names what held it back: slow samples
/// make data loading the limit, a slow consumer makes itself the limit.
#[test]
fn each_epoch_has_figures_and_a_verdict() {
    let mut slow_data = Indexed::new(64);
    slow_data.pause = Duration::from_millis(2);
    let mut loader = Loader::new(slow_data, config(8, 2)).unwrap();
    for epoch in 0..2 {
        assert_eq!(run_epoch(&mut loader, epoch).len(), 8);
    }
    let stats = loader.epoch_stats();
    assert_eq!(stats.len(), 2);
    assert_eq!(
        (
            stats[1].epoch,
            stats[1].totals.batches,
            stats[1].totals.samples
        ),
        (1, 8, 64)
    );
    assert_eq!(stats[1].workers, 2);
    // A stall of the whole process (other tests' device-wide work, a busy host) can leave the
    // workers idle for a while: the slow samples are judged on up to three epochs.
    let loading = |verdict: &pinned_loader::Verdict| {
        verdict.limit == pinned_loader::Limit::DataLoading
            && verdict.stats.workers_busy_share() > 0.5
    };
    let mut verdicts = vec![stats[1].verdict()];
    for epoch in 2..=3 {
        if verdicts.last().is_some_and(loading) {
            break;
        }
        assert_eq!(run_epoch(&mut loader, epoch).len(), 8);
        let stats = loader.epoch_stats().last().expect("the epoch's figures");
        verdicts.push(stats.verdict());
    }
    assert!(verdicts.last().is_some_and(loading), "{}", lines(&verdicts));

    let mut loader = Loader::new(Indexed::new(64), config(8, 2)).unwrap();
    // The first epoch pins the slots, which on a GPU can wait behind other threads'
    // registrations: the slow consumer is judged on the next. A stall of the whole process
    // (other tests' device-wide work, a busy host) can still hold one batch back for longer
    // than the consumer's own work, so it is judged on up to three epochs.
    assert_eq!(run_epoch(&mut loader, 0).len(), 8);
    let mut verdicts = Vec::new();
    for epoch in 1..=3 {
        for batch in loader.epoch(epoch) {
            drop(batch.unwrap());
            std::thread::sleep(Duration::from_millis(20));
        }
        let verdict = loader
            .epoch_stats()
            .last()
            .expect("the epoch's figures")
            .verdict();
        let consumer = verdict.limit == pinned_loader::Limit::Consumer;
        verdicts.push(verdict);
        if consumer {
            break;
        }
    }
    let verdict = verdicts.last().expect("one epoch at least");
    assert_eq!(
        verdict.limit,
        pinned_loader::Limit::Consumer,
        "{}",
        lines(&verdicts)
    );
    assert!(verdict.to_string().starts_with(&format!(
        "epoch {}: the consumer limits it",
        verdict.stats.epoch
    )));
}
