//! `pool`: warm allocate+free by size, throughput by threads, and memory waste on the mixed
//! set, each against PyTorch's figures on the H100 host.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

use pinned_pool::Pool;

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};

const SIZES: [usize; 4] = [64, 4096, 1 << 20, 64 << 20];
/// The set PyTorch reserves 1.85× for: 1.1 GiB + 300 MiB + 3 MB + 5 KB.
const MIXED: [usize; 4] = [1_181_116_006, 314_572_800, 3_000_000, 5_000];

fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    [1, 2, 4, 8, 16]
        .into_iter()
        .filter(|&t| t <= cores.max(2))
        .collect()
}

/// Work items, for the progress bar.
pub fn steps() -> usize {
    SIZES.len() + thread_counts().len() + 1
}

/// Runs the pool sections.
pub fn run(quick: bool, progress: &mut Progress) -> Vec<Section> {
    let rounds: u64 = if quick { 200_000 } else { 2_000_000 };
    let mut latency = Section::new(
        "pool_latency",
        "Pool: warm allocate+free, one thread",
        &["size", "ns per pair"],
    );
    let mut threads = Section::new(
        "pool_threads",
        "Pool: 4 KiB allocate+free pairs, all threads together",
        &["threads", "M pairs/s", "ns per pair per thread"],
    );
    let pool = Pool::new();
    measure_latency(&pool, rounds, &mut latency, progress);
    measure_threads(&pool, rounds, &mut threads, progress);
    if !pool.has_fence_free_fast_path() {
        latency
            .notes
            .push("no membarrier(2) here: each allocate and free pays a full fence".into());
    }
    latency.notes.push(
        "anchor: PyTorch 2.11 host allocator, warm pair from C++: 200-210 ns; goal <= 25 ns".into(),
    );
    threads
        .notes
        .push("anchor: PyTorch 2.07 M pairs/s at 2-16 threads; goal >= 200 M/s at 16".into());
    vec![latency, threads, mixed_set(progress)]
}

fn measure_latency(pool: &Pool, rounds: u64, section: &mut Section, progress: &mut Progress) {
    for bytes in SIZES {
        progress.step(&format!("pool latency {}", size_label(bytes as u64)));
        if let Err(e) = pool.with_capacity(bytes) {
            section
                .notes
                .push(format!("{}: {e}", size_label(bytes as u64)));
            continue;
        }
        // Warm up: the same loop, untimed.
        pairs(pool, bytes, rounds / 4);
        let start = Instant::now();
        pairs(pool, bytes, rounds);
        let ns = start.elapsed().as_secs_f64() * 1e9 / rounds as f64;
        section.row(vec![
            Value::Text(size_label(bytes as u64)),
            Value::Num(ns, 1),
        ]);
    }
}

fn measure_threads(pool: &Pool, rounds: u64, section: &mut Section, progress: &mut Progress) {
    for count in thread_counts() {
        progress.step(&format!("pool threads {count}"));
        let per_thread = rounds / 2;
        let start_line = Barrier::new(count);
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..count)
                .map(|_| {
                    scope.spawn(|| {
                        // Warm up, untimed: the pool pins each thread's block and learns how
                        // many blocks are in use at once (see the crate's note on exact peaks).
                        pairs(pool, 4096, per_thread / 4);
                        start_line.wait();
                        let start = Instant::now();
                        pairs(pool, 4096, per_thread);
                        (start, Instant::now())
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("worker"))
                .collect()
        });
        // From the first thread's start to the last one's end: each thread reads the clock
        // itself, so a late-scheduled main thread does not shorten or stretch the span.
        let first = spans.iter().map(|s| s.0).min().expect("threads");
        let last = spans.iter().map(|s| s.1).max().expect("threads");
        let elapsed = last - first;
        let pairs = (per_thread * count as u64) as f64;
        section.row(vec![
            Value::Int(count as u64),
            Value::Num(pairs / elapsed.as_secs_f64() / 1e6, 1),
            Value::Num(elapsed.as_secs_f64() * 1e9 / per_thread as f64, 1),
        ]);
    }
}

/// `rounds` warm allocate+free pairs of `bytes` on this thread. The block goes straight
/// back, as in a program that fills it and frees it; hiding it behind `black_box` would add a
/// trip through the stack that only the harness makes.
fn pairs(pool: &Pool, bytes: usize, rounds: u64) {
    for _ in 0..rounds {
        let block = pool.allocate_raw(black_box(bytes)).expect("block");
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
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
        Err(e) => waste
            .notes
            .push(format!("cannot pin the mixed set here: {e}")),
    }
    waste
        .notes
        .push("anchor: PyTorch 1.849; goal <= 1.10".into());
    waste
}
