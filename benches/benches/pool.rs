//! The pool: warm allocate+free by size, throughput by thread count, and the mixed set.
//! Anchors (PyTorch 2.11's host allocator from C++ on the H100 host): 200 ns a warm pair,
//! 2.07 M pairs/s in total at 2–16 threads, reserved/requested 1.85 on the mixed set.

#![allow(
    missing_docs,
    reason = "criterion's macros generate undocumented items"
)]

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cuda_pinned::PinnedVec;
use pinned_pool::Pool;

fn warm_pair(c: &mut Criterion) {
    let pool = Pool::new();
    let mut group = c.benchmark_group("pool/warm_alloc_free");
    for bytes in [64usize, 4096, 1 << 20, 64 << 20] {
        // Warm the cache: the first allocation of a class pins memory.
        drop(pool.with_capacity(bytes).expect("pin"));
        // The block goes straight back, as in a program; a `black_box` around it would time
        // a trip through the stack that only the harness makes.
        group.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
            b.iter(|| {
                let block = pool.allocate_raw(black_box(bytes)).expect("cached block");
                // SAFETY: straight from this pool, unused.
                unsafe { pool.free_raw(block) };
            })
        });
    }
    group.finish();
}

/// The same through what users write: `PinnedVec::with_capacity_in(n, &pool)`, then drop.
fn vec_pair(c: &mut Criterion) {
    let pool = Pool::new();
    let mut group = c.benchmark_group("pool/vec_alloc_drop");
    for bytes in [64usize, 4096, 1 << 20, 64 << 20] {
        drop(pool.with_capacity(bytes).expect("pin"));
        group.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
            b.iter(|| {
                let buffer = PinnedVec::<u8, _>::with_capacity_in(black_box(bytes), &pool)
                    .expect("cached block");
                drop(buffer);
            })
        });
    }
    group.finish();
}

/// Filling a 9.6 MB batch (64 images of 3x224x224 bytes) in 224-byte rows, the way a loader
/// worker does: `Vec::extend_from_slice` (the reference), `PinnedVec::extend_from_slice`, and
/// in place through `spare_capacity_mut`.
fn fill(c: &mut Criterion) {
    const BATCH: usize = 64 * 3 * 224 * 224;
    const ROW: usize = 224;
    let pool = Pool::new();
    let source: Vec<u8> = (0..BATCH).map(|i| i as u8).collect();
    let mut group = c.benchmark_group("fill_9.6MB_in_224B_rows");
    group.throughput(Throughput::Bytes(BATCH as u64));
    let mut vec = Vec::with_capacity(BATCH);
    group.bench_function("Vec::extend_from_slice", |b| {
        b.iter(|| {
            vec.clear();
            for row in source.chunks(ROW) {
                vec.extend_from_slice(black_box(row));
            }
        })
    });
    let mut pinned = PinnedVec::<u8, _>::with_capacity_in(BATCH, &pool).expect("pin");
    group.bench_function("PinnedVec::extend_from_slice", |b| {
        b.iter(|| {
            pinned.clear();
            for row in source.chunks(ROW) {
                pinned.extend_from_slice(black_box(row));
            }
        })
    });
    group.bench_function("PinnedVec::spare_capacity_mut", |b| {
        b.iter(|| {
            pinned.clear();
            let spare = &mut pinned.spare_capacity_mut()[..BATCH];
            for (slot, row) in spare.chunks_mut(ROW).zip(source.chunks(ROW)) {
                slot.copy_from_slice(as_uninit(black_box(row)));
            }
            // SAFETY: every byte up to BATCH was written above.
            unsafe { pinned.set_len(BATCH) };
        })
    });
    group.finish();
}

/// `row` as `MaybeUninit` bytes, for `copy_from_slice` into spare capacity.
fn as_uninit(row: &[u8]) -> &[std::mem::MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and initialised bytes are valid ones.
    unsafe { std::slice::from_raw_parts(row.as_ptr().cast(), row.len()) }
}

fn threads(c: &mut Criterion) {
    let pool = Pool::new();
    let mut group = c.benchmark_group("pool/threads");
    group.measurement_time(Duration::from_secs(3));
    let max = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16);
    for threads in [1usize, 2, 4, 8, 16].into_iter().filter(|&t| t <= max) {
        group.throughput(Throughput::Elements(threads as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                // One iteration: every thread does one allocate+free pair of 4 KiB. Each
                // thread reads the clock itself; the span runs from the first start to the
                // last end.
                b.iter_custom(|iters| {
                    let start_line = Barrier::new(threads);
                    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
                        let workers: Vec<_> = (0..threads)
                            .map(|_| {
                                scope.spawn(|| {
                                    drop(pool.with_capacity(4096).expect("warm"));
                                    start_line.wait();
                                    let start = Instant::now();
                                    for _ in 0..iters {
                                        let block =
                                            pool.allocate_raw(black_box(4096)).expect("block");
                                        // SAFETY: straight from this pool, unused.
                                        unsafe { pool.free_raw(block) };
                                    }
                                    (start, Instant::now())
                                })
                            })
                            .collect();
                        workers
                            .into_iter()
                            .map(|w| w.join().expect("worker"))
                            .collect()
                    });
                    let first = spans.iter().map(|s| s.0).min().expect("threads");
                    let last = spans.iter().map(|s| s.1).max().expect("threads");
                    last - first
                })
            },
        );
    }
    group.finish();
}

fn mixed_set(c: &mut Criterion) {
    // 1.1 GiB + 300 MiB + 3 MB + 5 KB, as measured against PyTorch.
    let sizes = [1_181_116_006usize, 314_572_800, 3_000_000, 5_000];
    let pool = Pool::new();
    let blocks: Vec<_> = sizes.iter().map(|&s| pool.allocate_raw(s)).collect();
    if blocks.iter().any(Result::is_err) {
        eprintln!("mixed set: cannot pin 1.4 GiB here (memlock limit?); skipped");
        return;
    }
    let reserved = pool.stats().allocated_bytes.current as f64;
    let requested: usize = sizes.iter().sum();
    eprintln!(
        "mixed set: reserved/requested = {:.3} (PyTorch 1.849)",
        reserved / requested as f64
    );
    for block in blocks.into_iter().flatten() {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    c.bench_function("pool/mixed_set_warm", |b| {
        b.iter(|| {
            let blocks: Vec<_> = sizes
                .iter()
                .map(|&s| pool.allocate_raw(black_box(s)).expect("cached"))
                .collect();
            for block in blocks {
                // SAFETY: from this pool, unused.
                unsafe { pool.free_raw(block) };
            }
        })
    });
}

criterion_group!(benches, warm_pair, vec_pair, fill, threads, mixed_set);
criterion_main!(benches);
