//! `alloc`: what getting pinned memory costs per kind and size, cold pinning per GiB, and how
//! long another thread's small copy stalls while 1 GiB is being pinned.

use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cuda_pinned::{
    CudaHost, DeviceBuffer, HostLocked, PinnedAllocator, PinnedVec, Registered, Result, Stream,
};
use pinned_pool::Pool;

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};

/// Sizes measured.
pub fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 10, 1 << 20, 64 << 20]
    } else {
        vec![4 << 10, 1 << 20, 64 << 20, 1 << 30]
    }
}

/// Kinds measured with CUDA; without it only `mlock` and the pool (over `mlock`).
const KINDS: [&str; 5] = [
    "cudaHostAlloc",
    "registered",
    "mlock",
    "pool miss",
    "pool hit",
];

/// Work items, for the progress bar.
pub fn steps(quick: bool, cuda: bool) -> usize {
    sizes(quick).len() * KINDS.len() + if cuda { 7 } else { 0 }
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

/// Median time to allocate and to free `bytes` from `allocator`, over `reps` rounds.
fn direct<A: PinnedAllocator>(
    allocator: &A,
    bytes: usize,
    reps: usize,
) -> Result<(Duration, Duration)> {
    let layout =
        Layout::from_size_align(bytes, 4096).map_err(|_| cuda_pinned::Error::CapacityOverflow)?;
    let (mut pins, mut frees) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let start = Instant::now();
        let allocation = allocator.allocate(layout)?;
        pins.push(start.elapsed());
        let start = Instant::now();
        // SAFETY: just allocated, never used by a device.
        unsafe { allocator.deallocate(allocation) };
        frees.push(start.elapsed());
    }
    Ok((median(pins), median(frees)))
}

/// A miss: a fresh pool pins the block (its release when the pool drops is the "free").
fn pool_miss(bytes: usize, reps: usize) -> Result<(Duration, Duration)> {
    let (mut pins, mut frees) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let pool = Pool::new();
        let start = Instant::now();
        let block = pool.allocate_raw(bytes)?;
        pins.push(start.elapsed());
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
        let start = Instant::now();
        drop(pool);
        frees.push(start.elapsed());
    }
    Ok((median(pins), median(frees)))
}

/// A hit: the block is cached; allocate and free it many times.
fn pool_hit(pool: &Pool, bytes: usize) -> Result<(Duration, Duration)> {
    drop(pool.with_capacity(bytes)?);
    const ROUNDS: u32 = 10_000;
    let (mut pin, mut free) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let block = pool.allocate_raw(std::hint::black_box(bytes))?;
        let middle = Instant::now();
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
        free += middle.elapsed();
        pin += middle - start;
    }
    Ok((pin / ROUNDS, free / ROUNDS))
}

/// Runs the allocation-latency section (and, with CUDA, the stall section).
pub fn run(quick: bool, cuda: bool, progress: &mut Progress) -> Vec<Section> {
    let mut latency = Section::new(
        "alloc",
        "Getting pinned memory (median; pool hit: mean of 10,000)",
        &[
            "memory",
            "size",
            "allocate µs",
            "free µs",
            "allocate ms/GiB",
        ],
    );
    let hits = Pool::new();
    for bytes in sizes(quick) {
        let reps = if bytes >= 64 << 20 {
            if quick { 1 } else { 3 }
        } else {
            5
        };
        for kind in KINDS {
            progress.step(&format!("alloc {kind} {}", size_label(bytes as u64)));
            let measured = match kind {
                "cudaHostAlloc" if cuda => direct(&CudaHost::new(), bytes, reps),
                "registered" if cuda => direct(&Registered::new(), bytes, reps),
                "cudaHostAlloc" | "registered" => continue,
                "mlock" => direct(&HostLocked, bytes, reps),
                "pool miss" => pool_miss(bytes, reps),
                _ => pool_hit(&hits, bytes),
            };
            match measured {
                Ok((pin, free)) => latency.row(vec![
                    Value::Text(kind.into()),
                    Value::Text(size_label(bytes as u64)),
                    Value::Num(pin.as_secs_f64() * 1e6, 3),
                    Value::Num(free.as_secs_f64() * 1e6, 3),
                    Value::Num(
                        pin.as_secs_f64() * 1e3 * f64::from(1u32 << 30) / bytes as f64,
                        1,
                    ),
                ]),
                Err(e) => latency
                    .notes
                    .push(format!("{kind} {}: {e}", size_label(bytes as u64))),
            }
        }
        hits.empty_cache();
    }
    latency.notes.push(
        "anchors (H100 host): cudaHostAlloc 0.40-0.68 s/GiB; PyTorch warm alloc+free 200 ns".into(),
    );
    let mut sections = vec![latency];
    if cuda {
        sections.push(stall(progress));
    }
    sections
}

/// Thread A copies 64 KiB and synchronises in a loop; thread B pins 1 GiB. How long does A's
/// worst copy take while B pins?
fn stall(progress: &mut Progress) -> Section {
    let mut section = Section::new(
        "stall",
        "Another thread's 64 KiB copy+sync while this thread pins 1 GiB (or a pool grows by 1 GiB in the background)",
        &[
            "pinning",
            "pin ms",
            "copies meanwhile",
            "worst copy ms",
            "p99 copy ms",
        ],
    );
    for kind in [
        "nothing (sleep 300 ms)",
        "cudaHostAlloc",
        "registered",
        RESERVE_8,
        RESERVE_16,
        RESERVE_128,
    ] {
        progress.step(&format!("stall {kind}"));
        match measure_stall(kind) {
            Ok((pin, latencies)) => {
                let mut sorted = latencies.clone();
                sorted.sort();
                let worst = sorted.last().copied().unwrap_or_default();
                let p99 = sorted
                    .get(sorted.len() * 99 / 100)
                    .copied()
                    .unwrap_or(worst);
                section.row(vec![
                    Value::Text(kind.into()),
                    Value::Num(pin.as_secs_f64() * 1e3, 1),
                    Value::Int(latencies.len() as u64),
                    Value::Num(worst.as_secs_f64() * 1e3, 3),
                    Value::Num(p99.as_secs_f64() * 1e3, 3),
                ]);
            }
            Err(e) => section.notes.push(format!("{kind}: {e}")),
        }
    }
    progress.step("stall reserve cost");
    match reserve_cost() {
        Ok((covered, hit)) => section.notes.push(format!(
            "a 16 MiB allocation the reserve covers: median {:.0} ns; a pool hit of the same \
             size: {:.0} ns (64 of each, both raising the pool-wide peak)",
            covered.as_secs_f64() * 1e9,
            hit.as_secs_f64() * 1e9
        )),
        Err(e) => section.notes.push(format!("reserve cost: {e}")),
    }
    section
        .notes
        .push("anchor (H100 host): cudaHostAlloc(1 GiB) stalls the other thread 350 ms".into());
    section
}

/// Median times of 64 allocations of 16 MiB taken from blocks pinned ahead (the thread pins
/// replacements meanwhile, as in use), then of 64 taken from the cache once those are freed.
/// Each round starts from a peak of zero, so both pay for raising the pool-wide peak alike.
fn reserve_cost() -> Result<(Duration, Duration)> {
    const BLOCK: usize = 16 << 20;
    let pool = Pool::new();
    grow_in_background(&pool, BLOCK, 64)?;
    let mut times = [Vec::new(), Vec::new()];
    for (round, times) in times.iter_mut().enumerate() {
        if round == 1 {
            // Hits only: release what is ready and pin no more.
            pool.reserve(BLOCK, 0)?;
        }
        let mut blocks = Vec::new();
        for _ in 0..64 {
            let start = Instant::now();
            let block = pool.allocate_raw(BLOCK)?;
            times.push(start.elapsed());
            blocks.push(block);
        }
        for block in blocks {
            // SAFETY: allocated above from this pool, never used by a device.
            unsafe { pool.free_raw(block) };
        }
        pool.reset_peak_stats();
    }
    let [covered, hit] = times;
    Ok((median(covered), median(hit)))
}

/// A pool growing by 1 GiB on its reserve thread, in blocks of 8 / 16 / 128 MiB.
const RESERVE_8: &str = "pool reserve, 128 × 8 MiB (background)";
const RESERVE_16: &str = "pool reserve, 64 × 16 MiB (background)";
const RESERVE_128: &str = "pool reserve, 8 × 128 MiB (background)";

/// Has `pool` pin `blocks` blocks of `block` bytes ahead, and waits until they are ready.
fn grow_in_background(pool: &Pool, block: usize, blocks: usize) -> Result<()> {
    pool.reserve(block, blocks)?;
    while pool.approximate_stats().reserve_ready_bytes < (block * blocks) as u64 {
        if let Some(error) = pool.take_reserve_error() {
            return Err(error);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

fn measure_stall(kind: &str) -> Result<(Duration, Vec<Duration>)> {
    const BYTES: usize = 1 << 30;
    let stream = Stream::new()?;
    let mut device = DeviceBuffer::<u8>::zeroed(64 << 10)?;
    let mut small = Some(PinnedVec::from_slice_in(&[7u8; 64 << 10], CudaHost::new())?);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let copier = scope.spawn(|| -> Result<Vec<(Instant, Duration)>> {
            let mut ops = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                let buffer = small.take().expect("buffer back");
                small = Some(stream.copy_to_device(buffer, &mut device)?.wait()?);
                ops.push((start, start.elapsed()));
            }
            Ok(ops)
        });
        std::thread::sleep(Duration::from_millis(50));
        let layout = Layout::from_size_align(BYTES, 4096).expect("layout");
        let begin = Instant::now();
        let pool = Pool::new();
        let pinned = match kind {
            "cudaHostAlloc" => Some(CudaHost::new().allocate(layout).map(|a| (a, true))),
            "registered" => Some(Registered::new().allocate(layout).map(|a| (a, false))),
            RESERVE_8 => grow_in_background(&pool, 8 << 20, 128).err().map(Err),
            RESERVE_16 => grow_in_background(&pool, 16 << 20, 64).err().map(Err),
            RESERVE_128 => grow_in_background(&pool, 128 << 20, 8).err().map(Err),
            _ => {
                std::thread::sleep(Duration::from_millis(300));
                None
            }
        };
        let end = Instant::now();
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        let ops = copier.join().expect("copier thread")?;
        drop(pool);
        if let Some(pinned) = pinned {
            let (allocation, host_alloc) = pinned?;
            // SAFETY: just allocated, never used by a device.
            unsafe {
                if host_alloc {
                    CudaHost::new().deallocate(allocation);
                } else {
                    Registered::new().deallocate(allocation);
                }
            }
        }
        // Copies that overlapped the pinning.
        let during: Vec<Duration> = ops
            .into_iter()
            .filter(|(start, took)| *start + *took >= begin && *start <= end)
            .map(|(_, took)| took)
            .collect();
        Ok((end - begin, during))
    })
}
