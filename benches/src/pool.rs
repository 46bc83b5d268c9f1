//! `pool`: warm allocate+free by size (the raw pair and the `PinnedVec` path users take),
//! throughput by threads, blocks freed by another thread, what reading the statistics costs
//! the threads that allocate, and memory waste on the mixed set — each against PyTorch's
//! figures on the H100 host, every figure the spread of repeated runs.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, mpsc};
use std::time::{Duration, Instant};

use cuda_pinned::PinnedVec;
use pinned_pool::Pool;

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};
use crate::stats::Spread;

const SIZES: [usize; 4] = [64, 4096, 1 << 20, 64 << 20];
/// The set PyTorch reserves 1.85× for: 1.1 GiB + 300 MiB + 3 MB + 5 KB.
const MIXED: [usize; 4] = [1_181_116_006, 314_572_800, 3_000_000, 5_000];
/// Repetitions behind every figure.
const REPS: usize = 7;

fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    [1, 2, 4, 8, 16]
        .into_iter()
        .filter(|&t| t <= cores.max(2))
        .collect()
}

/// Work items, for the progress bar.
pub fn steps() -> usize {
    SIZES.len() + thread_counts().len() + 3
}

/// Runs the pool sections.
pub fn run(quick: bool, progress: &mut Progress) -> Vec<Section> {
    let rounds: u64 = if quick { 100_000 } else { 1_000_000 };
    let spread = ["min", "median", "max"];
    let mut latency = Section::new(
        "pool_latency",
        "Pool: warm allocate+free on one thread, ns per pair",
        &["size", "path", spread[0], spread[1], spread[2]],
    );
    let mut threads = Section::new(
        "pool_threads",
        "Pool: 4 KiB allocate+free pairs, all threads together, M pairs/s",
        &["threads", spread[0], spread[1], spread[2]],
    );
    let mut stats = Section::new(
        "pool_stats",
        "Pool: reading the statistics every 100 us while other threads allocate",
        &[
            "reader",
            "us per call (median)",
            "others M pairs/s min",
            "median",
            "max",
        ],
    );
    let pool = Pool::new();
    measure_latency(&pool, rounds, &mut latency, progress);
    measure_threads(&pool, rounds, &mut threads, progress);
    measure_cross_thread(&pool, rounds, &mut threads, progress);
    measure_stats_cost(&pool, &mut stats, progress);
    if !pool.has_fence_free_fast_path() {
        latency
            .notes
            .push("no membarrier(2) here: each allocate and free pays a full fence".into());
    }
    latency.notes.push(format!(
        "{REPS} runs of {rounds} pairs each; raw = allocate_raw + free_raw, PinnedVec = \
         PinnedVec::with_capacity_in(n, &pool) + drop (PyTorch's 200 ns is this path)"
    ));
    latency.notes.push(
        "anchor: PyTorch 2.11 host allocator, warm pair from C++: 200-210 ns; goal <= 25 ns".into(),
    );
    threads.notes.push(format!(
        "{REPS} runs each; cross-thread: one thread allocates, another frees (batches of 64 \
         handed over a channel)"
    ));
    threads
        .notes
        .push("anchor: PyTorch 2.07 M pairs/s at 2-16 threads; goal >= 200 M/s at 16".into());
    stats.notes.push(
        "stats() pauses every thread's cache for an exact snapshot; approximate_stats() reads \
         their counters as they are"
            .into(),
    );
    vec![latency, threads, stats, mixed_set(progress)]
}

/// Nanoseconds per item of `run(items)`, `REPS` times.
fn repeat_ns(items: u64, mut run: impl FnMut(u64)) -> Spread {
    run(items / 4); // warm-up, untimed
    Spread::of(
        (0..REPS)
            .map(|_| {
                let start = Instant::now();
                run(items);
                start.elapsed().as_secs_f64() * 1e9 / items as f64
            })
            .collect(),
    )
}

fn measure_latency(pool: &Pool, rounds: u64, section: &mut Section, progress: &mut Progress) {
    for bytes in SIZES {
        progress.step(&format!("pool latency {}", size_label(bytes as u64)));
        if let Err(e) = pool.allocate_raw(bytes).map(|block| {
            // SAFETY: from this pool, unused.
            unsafe { pool.free_raw(block) }
        }) {
            section.notes.push(format!(
                "{}: {e}",
                size_label(bytes as u64),
                e = cuda_pinned::ErrorChain(&e)
            ));
            continue;
        }
        let raw = repeat_ns(rounds, |n| raw_pairs(pool, bytes, n));
        let vec = repeat_ns(rounds, |n| vec_pairs(pool, bytes, n));
        for (path, spread) in [("raw", raw), ("PinnedVec", vec)] {
            let mut row = vec![
                Value::Text(size_label(bytes as u64)),
                Value::Text(path.into()),
            ];
            row.extend(spread.cells(1));
            section.row(row);
        }
    }
}

fn measure_threads(pool: &Pool, rounds: u64, section: &mut Section, progress: &mut Progress) {
    for count in thread_counts() {
        progress.step(&format!("pool threads {count}"));
        let per_thread = rounds / 2;
        let rates = (0..REPS)
            .map(|_| {
                let elapsed = threads_span(count, || {
                    // Warm up, untimed: the pool pins each thread's block and learns how
                    // many blocks are in use at once (see the crate's note on exact peaks).
                    raw_pairs(pool, 4096, per_thread / 4);
                    move || raw_pairs(pool, 4096, per_thread)
                });
                (per_thread * count as u64) as f64 / elapsed.as_secs_f64() / 1e6
            })
            .collect();
        let mut row = vec![Value::Text(count.to_string())];
        row.extend(Spread::of(rates).cells(1));
        section.row(row);
    }
}

/// Runs `count` threads: each calls `prepare` (untimed) for its work, waits for the others,
/// then times the work itself. The span runs from the first start to the last end, so a
/// late-scheduled main thread neither shortens nor stretches it.
fn threads_span<W: FnOnce()>(count: usize, prepare: impl Fn() -> W + Sync) -> Duration {
    let start_line = Barrier::new(count);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..count)
            .map(|_| {
                scope.spawn(|| {
                    let work = prepare();
                    start_line.wait();
                    let start = Instant::now();
                    work();
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
}

/// One thread allocates 4 KiB blocks and hands them over in batches of 64; another frees them.
fn measure_cross_thread(pool: &Pool, rounds: u64, section: &mut Section, progress: &mut Progress) {
    progress.step("pool cross-thread");
    const BATCH: u64 = 64;
    let batches = (rounds / BATCH).max(1);
    let run = || {
        let (tx, rx) = mpsc::sync_channel::<Vec<_>>(4);
        let start = Instant::now();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                for _ in 0..batches {
                    let blocks = (0..BATCH)
                        .map(|_| pool.allocate_raw(black_box(4096)).expect("block"))
                        .collect();
                    tx.send(blocks).expect("the freeing thread is there");
                }
            });
            for blocks in rx {
                for block in blocks {
                    // SAFETY: from this pool, unused; handed over by the allocating thread.
                    unsafe { pool.free_raw(block) };
                }
            }
        });
        (batches * BATCH) as f64 / start.elapsed().as_secs_f64() / 1e6
    };
    run(); // warm-up
    let mut row = vec![Value::Text("1 allocates, 1 frees".into())];
    row.extend(Spread::of((0..REPS).map(|_| run()).collect()).cells(1));
    section.row(row);
}

/// A way of reading a pool's statistics.
type Reader = fn(&Pool);

/// Other threads' allocation rate while this one reads the statistics every 100 µs (or not at
/// all), and what each read costs.
fn measure_stats_cost(pool: &Pool, section: &mut Section, progress: &mut Progress) {
    progress.step("pool statistics cost");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = cores.saturating_sub(1).clamp(1, 4);
    let readers: [(&str, Option<Reader>); 3] = [
        ("nobody (reference)", None),
        (
            "approximate_stats()",
            Some(|p: &Pool| {
                black_box(p.approximate_stats());
            }),
        ),
        (
            "stats()",
            Some(|p: &Pool| {
                black_box(p.stats());
            }),
        ),
    ];
    for (name, read) in readers {
        let mut call_us = Vec::new();
        let mut rates = Vec::new();
        for _ in 0..REPS {
            let (rate, costs) = read_while_allocating(pool, workers, read);
            rates.push(rate);
            if !costs.is_empty() {
                call_us.push(Spread::of(costs).median);
            }
        }
        let cost = if call_us.is_empty() {
            Value::Missing
        } else {
            Value::Num(Spread::of(call_us).median, 2)
        };
        let mut row = vec![Value::Text(name.into()), cost];
        row.extend(Spread::of(rates).cells(1));
        section.row(row);
    }
    section.notes.push(format!(
        "{workers} threads allocate 4 KiB pairs meanwhile; {REPS} runs of 100 ms"
    ));
}

/// One run of 100 ms: `workers` threads allocate 4 KiB pairs while this one reads the
/// statistics with `read` every 100 µs (or sleeps); their rate in M pairs/s, and each read's
/// cost in µs.
fn read_while_allocating(pool: &Pool, workers: usize, read: Option<Reader>) -> (f64, Vec<f64>) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let counters: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    raw_pairs(pool, 4096, 10_000);
                    let start = Instant::now();
                    let mut pairs = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        raw_pairs(pool, 4096, 1000);
                        pairs += 1000;
                    }
                    pairs as f64 / start.elapsed().as_secs_f64() / 1e6
                })
            })
            .collect();
        let mut costs = Vec::new();
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            if let Some(read) = read {
                let start = Instant::now();
                read(pool);
                costs.push(start.elapsed().as_secs_f64() * 1e6);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        stop.store(true, Ordering::Relaxed);
        let rate: f64 = counters
            .into_iter()
            .map(|c| c.join().expect("worker"))
            .sum();
        (rate, costs)
    })
}

/// `rounds` warm allocate+free pairs of `bytes` on this thread. The block goes straight
/// back, as in a program that fills it and frees it; hiding it behind `black_box` would add a
/// trip through the stack that only the harness makes.
fn raw_pairs(pool: &Pool, bytes: usize, rounds: u64) {
    for _ in 0..rounds {
        let block = pool.allocate_raw(black_box(bytes)).expect("block");
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
}

/// The same through what users write: a `PinnedVec` with room for `bytes`, then dropped.
fn vec_pairs(pool: &Pool, bytes: usize, rounds: u64) {
    for _ in 0..rounds {
        let buffer = PinnedVec::<u8, _>::with_capacity_in(black_box(bytes), pool).expect("block");
        drop(buffer);
    }
}

fn mixed_set(progress: &mut Progress) -> Section {
    let mut waste = Section::new(
        "pool_waste",
        "Pool: reserved / requested for 1.1 GiB + 300 MiB + 3 MB + 5 KB",
        &["requested bytes", "reserved bytes", "ratio"],
    );
    progress.step("pool mixed set");
    let pool = Pool::new();
    match MIXED
        .iter()
        .map(|&s| pool.allocate_raw(s))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(blocks) => {
            let requested: usize = MIXED.iter().sum();
            let reserved = pool.stats().allocated_bytes.current;
            waste.row(vec![
                Value::Int(requested as u64),
                Value::Int(reserved),
                Value::Num(reserved as f64 / requested as f64, 3),
            ]);
            for block in blocks {
                // SAFETY: from this pool, unused.
                unsafe { pool.free_raw(block) };
            }
        }
        Err(e) => waste.notes.push(format!(
            "cannot pin the mixed set here: {e}",
            e = cuda_pinned::ErrorChain(&e)
        )),
    }
    waste
        .notes
        .push("anchor: PyTorch 1.849; goal <= 1.10".into());
    waste
}
