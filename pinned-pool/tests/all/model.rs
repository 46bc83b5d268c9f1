//! Random programs of allocate / free / free-after-events / complete / process / empty_cache /
//! trim / reset-peaks against a model of what must hold. Each operation runs on one of two
//! threads, so blocks move between thread caches and one thread frees what the other took.

use std::collections::HashMap;
use std::sync::mpsc;

use cuda_pinned::Allocation;
use pinned_pool::PoolConfig;
use proptest::prelude::*;

use crate::support::{Flag, Heap, TestPool};

#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Free(usize),
    /// Free while device work (a flag) is pending.
    FreeAfter(usize),
    Complete(usize),
    ProcessEvents,
    EmptyCache,
    Trim(usize),
    ResetPeaks,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        1usize..10_000,
        10_000usize..2_000_000,
        Just(4096),
        Just(65536)
    ];
    prop_oneof![
        6 => size.prop_map(Op::Allocate),
        3 => any::<usize>().prop_map(Op::Free),
        3 => any::<usize>().prop_map(Op::FreeAfter),
        3 => any::<usize>().prop_map(Op::Complete),
        1 => Just(Op::ProcessEvents),
        1 => Just(Op::EmptyCache),
        1 => (0usize..4_000_000).prop_map(Op::Trim),
        1 => Just(Op::ResetPeaks),
    ]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: crate::support::capped(if cfg!(miri) { 6 } else { 2000 }),
        // Miri isolates the program from the file system.
        failure_persistence: if cfg!(miri) {
            None
        } else {
            ProptestConfig::default().failure_persistence
        },
        ..ProptestConfig::default()
    }
}

struct Model {
    live: Vec<(Allocation, usize)>,
    pending: Vec<(usize, usize, Flag)>, // (address, bytes, flag)
    allocations: usize,
    /// Most blocks and bytes live at once since the start or the last reset.
    peak: (u64, u64),
}

impl Model {
    fn current(&self) -> (u64, u64) {
        (
            self.live.len() as u64,
            self.live.iter().map(|(b, _)| b.bytes() as u64).sum(),
        )
    }
}

type Job<'a> = Box<dyn FnOnce() + Send + 'a>;

/// A second thread that runs what it is given and waits for more.
struct Helper<'a> {
    jobs: mpsc::Sender<Job<'a>>,
}

impl<'a> Helper<'a> {
    fn spawn(scope: &'a std::thread::Scope<'a, '_>) -> Self {
        let (jobs, inbox) = mpsc::channel::<Job<'a>>();
        scope.spawn(move || inbox.into_iter().for_each(|job| job()));
        Self { jobs }
    }

    /// Runs `f` here or on the helper thread.
    fn run<R: Send + 'a>(&self, there: bool, f: impl FnOnce() -> R + Send + 'a) -> R {
        if !there {
            return f();
        }
        let (reply, answer) = mpsc::channel();
        self.jobs
            .send(Box::new(move || reply.send(f()).unwrap()))
            .unwrap();
        answer.recv().unwrap()
    }
}

fn check_no_overlap(ranges: &mut [(usize, usize)]) -> Result<(), TestCaseError> {
    ranges.sort();
    for pair in ranges.windows(2) {
        prop_assert!(
            pair[0].0 + pair[0].1 <= pair[1].0,
            "blocks overlap: {pair:?}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn pool_matches_its_model(ops in proptest::collection::vec((op(), any::<bool>()), 1..80)) {
        run(ops)?;
    }
}

/// Runs `ops` (each here or on a helper thread) against the pool and the model.
fn run(ops: Vec<(Op, bool)>) -> Result<(), TestCaseError> {
    let heap = Heap::new();
    let owned = TestPool::with_completion(heap.clone(), PoolConfig::new());
    let pool = &owned;
    let mut model = Model {
        live: Vec::new(),
        pending: Vec::new(),
        allocations: 0,
        peak: (0, 0),
    };
    std::thread::scope(|scope| -> Result<(), TestCaseError> {
        let helper = Helper::spawn(scope);
        for (op, there) in ops {
            match op {
                Op::Allocate(bytes) => {
                    let block = helper.run(there, move || pool.allocate_raw(bytes)).unwrap();
                    model.allocations += 1;
                    prop_assert!(block.bytes() >= bytes);
                    let address = block.ptr().as_ptr() as usize;
                    prop_assert!(
                        !model
                            .pending
                            .iter()
                            .any(|(a, _, flag)| *a == address && !flag.is_done()),
                        "handed out a block whose device work is pending"
                    );
                    model.pending.retain(|(a, _, _)| *a != address);
                    model.live.push((block, bytes));
                    let (requests, bytes) = model.current();
                    model.peak = (model.peak.0.max(requests), model.peak.1.max(bytes));
                }
                Op::Free(i) | Op::FreeAfter(i) if !model.live.is_empty() => {
                    let (block, _) = model.live.swap_remove(i % model.live.len());
                    if matches!(op, Op::Free(_)) {
                        // SAFETY: from this pool, unused from here on.
                        helper.run(there, move || unsafe { pool.free_raw(block) });
                    } else {
                        let flag = Flag::default();
                        model.pending.push((
                            block.ptr().as_ptr() as usize,
                            block.bytes(),
                            flag.clone(),
                        ));
                        // SAFETY: as above; the flag stands for the device work.
                        helper.run(there, move || unsafe { pool.free_raw_after(block, flag) });
                    }
                }
                Op::Complete(i) if !model.pending.is_empty() => {
                    let n = model.pending.len();
                    model.pending[i % n].2.finish();
                }
                Op::ProcessEvents => {
                    helper.run(there, || pool.process_events());
                    model.pending.retain(|(_, _, flag)| !flag.is_done());
                    prop_assert_eq!(pool.stats().pending_requests, model.pending.len() as u64);
                }
                Op::EmptyCache => {
                    helper.run(there, || pool.empty_cache());
                    model.pending.retain(|(_, _, flag)| !flag.is_done());
                    let stats = pool.stats();
                    prop_assert_eq!(stats.cached_bytes, 0);
                    let held: u64 = model
                        .live
                        .iter()
                        .map(|(b, _)| b.bytes() as u64)
                        .sum::<u64>()
                        + model.pending.iter().map(|(_, b, _)| *b as u64).sum::<u64>();
                    prop_assert_eq!(stats.allocated_bytes.current, held);
                }
                Op::Trim(target) => {
                    helper.run(there, move || pool.trim(target));
                    prop_assert!(pool.stats().cached_bytes <= target as u64);
                }
                Op::ResetPeaks => {
                    helper.run(there, || pool.reset_peak_stats());
                    model.peak = model.current();
                }
                _ => {}
            }
            // Invariants after every step.
            let mut ranges: Vec<(usize, usize)> = model
                .live
                .iter()
                .map(|(b, _)| (b.ptr().as_ptr() as usize, b.bytes()))
                .collect();
            ranges.extend(
                model
                    .pending
                    .iter()
                    .filter(|p| !p.2.is_done())
                    .map(|(a, b, _)| (*a, *b)),
            );
            check_no_overlap(&mut ranges)?;
            let stats = pool.stats();
            let (requests, bytes) = model.current();
            prop_assert_eq!(stats.active_requests.current, requests);
            prop_assert_eq!(stats.active_bytes.current, bytes);
            prop_assert_eq!(
                stats.active_requests.allocated - stats.active_requests.freed,
                stats.active_requests.current
            );
            prop_assert_eq!(
                stats.cache_hits + stats.cache_misses,
                model.allocations as u64
            );
            prop_assert_eq!(stats.allocations.current, heap.live() as u64);
            prop_assert_eq!(
                stats.num_host_alloc - stats.num_host_free,
                heap.live() as u64
            );
            prop_assert_eq!(
                (stats.active_requests.peak, stats.active_bytes.peak),
                model.peak
            );
            let idle = stats.allocated_bytes.current - bytes - stats.pending_bytes;
            prop_assert_eq!(stats.cached_bytes, idle);
        }
        Ok(())
    })?;
    let by_address: HashMap<usize, usize> = model
        .live
        .iter()
        .map(|(b, r)| (b.ptr().as_ptr() as usize, *r))
        .collect();
    prop_assert_eq!(by_address.len(), model.live.len());
    for (block, _) in model.live.drain(..) {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    for (_, _, flag) in &model.pending {
        flag.finish();
    }
    drop(owned);
    prop_assert_eq!(heap.live(), 0, "the pool leaked blocks");
    Ok(())
}

#[test]
fn completed_blocks_are_reused_whatever_older_blocks_wait_on() {
    let pool = TestPool::with_completion(Heap::new(), PoolConfig::new());
    let (older, newer) = (
        pool.allocate_raw(8192).unwrap(),
        pool.allocate_raw(8192).unwrap(),
    );
    let newer_address = newer.ptr();
    let (stuck, done) = (Flag::default(), Flag::default());
    // SAFETY: from this pool; the flags stand for device work.
    unsafe {
        pool.free_raw_after(older, stuck.clone());
        pool.free_raw_after(newer, done.clone());
    }
    done.finish();
    // PyTorch would stop at the older, unfinished block and pin new memory.
    let again = pool.allocate_raw(8192).unwrap();
    assert_eq!(again.ptr(), newer_address);
    assert_eq!(pool.stats().cache_hits, 1);
    // SAFETY: from this pool.
    unsafe { pool.free_raw(again) };
    stuck.finish();
}
