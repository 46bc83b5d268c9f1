//! `pool`: warm allocate+free by size, throughput by threads (for both ways of counting
//! statistics), and memory waste on the mixed set, each against PyTorch's figures on the H100
//! host.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

use cuda_pinned::DefaultPinned;
use pinned_pool::{Pool, PoolConfig};

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};

const SIZES: [usize; 4] = [64, 4096, 1 << 20, 64 << 20];
/// The set PyTorch reserves 1.85× for: 1.1 GiB + 300 MiB + 3 MB + 5 KB.
const MIXED: [usize; 4] = [1_181_116_006, 314_572_800, 3_000_000, 5_000];
/// The two ways of counting `active_*`: one shared counter (exact peaks), or per shard.
const MODES: [(&str, bool); 2] = [("exact peaks", true), ("per-shard stats", false)];

fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    [1, 2, 4, 8, 16]
        .into_iter()
        .filter(|&t| t <= cores.max(2))
        .collect()
}

/// Work items, for the progress bar.
pub fn steps() -> usize {
    MODES.len() * (SIZES.len() + thread_counts().len()) + 1
}

/// Runs the pool sections.
pub fn run(quick: bool, progress: &mut Progress) -> Vec<Section> {
    let rounds: u64 = if quick { 200_000 } else { 2_000_000 };
    let mut latency = Section::new(
        "pool_latency",
        "Pool: warm allocate+free, one thread",
        &["statistics", "size", "ns per pair"],
    );
    let mut threads = Section::new(
        "pool_threads",
        "Pool: 4 KiB allocate+free pairs, all threads together",
        &[
            "statistics",
            "threads",
            "M pairs/s",
            "ns per pair per thread",
        ],
    );
    for (mode, exact) in MODES {
        let pool = Pool::with_backend(DefaultPinned, PoolConfig::new().exact_peaks(exact));
        measure_latency(&pool, mode, rounds, &mut latency, progress);
        measure_threads(&pool, mode, rounds, &mut threads, progress);
    }
    latency.notes.push(
        "anchor: PyTorch 2.11 host allocator, warm pair from C++: 200-210 ns; goal <= 25 ns".into(),
    );
    threads
        .notes
        .push("anchor: PyTorch 2.07 M pairs/s at 2-16 threads; goal >= 200 M/s at 16".into());
    vec![latency, threads, mixed_set(progress)]
}

fn measure_latency(
    pool: &Pool,
    mode: &str,
    rounds: u64,
    section: &mut Section,
    progress: &mut Progress,
) {
    for bytes in SIZES {
        progress.step(&format!("pool latency {mode} {}", size_label(bytes as u64)));
        if let Err(e) = pool.allocate(bytes) {
            section
                .notes
                .push(format!("{}: {e}", size_label(bytes as u64)));
            continue;
        }
        let start = Instant::now();
        for _ in 0..rounds {
            let block = pool.allocate_raw(black_box(bytes)).expect("cached block");
            // SAFETY: from this pool, unused.
            unsafe { pool.free_raw(black_box(block)) };
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / rounds as f64;
        section.row(vec![
            Value::Text(mode.into()),
            Value::Text(size_label(bytes as u64)),
            Value::Num(ns, 1),
        ]);
    }
}

fn measure_threads(
    pool: &Pool,
    mode: &str,
    rounds: u64,
    section: &mut Section,
    progress: &mut Progress,
) {
    for count in thread_counts() {
        progress.step(&format!("pool threads {mode} {count}"));
        let per_thread = rounds / 2;
        let start_line = Barrier::new(count + 1);
        let elapsed = std::thread::scope(|scope| {
            for _ in 0..count {
                scope.spawn(|| {
                    drop(pool.allocate(4096).expect("warm"));
                    start_line.wait();
                    for _ in 0..per_thread {
                        let block = pool.allocate_raw(black_box(4096)).expect("block");
                        // SAFETY: from this pool, unused.
                        unsafe { pool.free_raw(black_box(block)) };
                    }
                });
            }
            start_line.wait();
            Instant::now()
        })
        .elapsed();
        let pairs = (per_thread * count as u64) as f64;
        section.row(vec![
            Value::Text(mode.into()),
            Value::Int(count as u64),
            Value::Num(pairs / elapsed.as_secs_f64() / 1e6, 1),
            Value::Num(elapsed.as_secs_f64() * 1e9 / per_thread as f64, 1),
        ]);
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
