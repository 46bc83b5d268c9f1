//! `alloc`: what getting pinned memory costs per kind and size, cold pinning per GiB, how long
//! another thread's small copy stalls while 1 GiB is being pinned, what growing a vector to
//! 1 GiB costs, and how fast fresh memory takes its first writes.

use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cuda_pinned::{
    Allocation, CudaHost, DeviceBuffer, HostLocked, MemoryKind, PinnedAllocator, PinnedVec,
    Registered, Result, Stream, VirtualHost,
};
use pinned_pool::{Pool, PoolConfig};

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};
use crate::stats::{self, Spread, gbps};

/// Sizes measured.
pub fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 10, 1 << 20, 64 << 20]
    } else {
        vec![4 << 10, 1 << 20, 64 << 20, 1 << 30]
    }
}

/// Kinds measured with CUDA; without it only `mlock` and the pool (over `mlock`).
const KINDS: [&str; 7] = [
    "cudaHostAlloc",
    "registered",
    CHUNKS_12,
    VIRTUAL,
    "mlock",
    "pool miss",
    "pool hit",
];

/// Work items, for the progress bar.
pub fn steps(quick: bool, cuda: bool) -> usize {
    sizes(quick).len() * KINDS.len() + if cuda { 14 + 2 * GROWN.len() + 3 } else { 0 }
}

const VIRTUAL: &str = "virtual (cuMemCreate)";
/// Registration in chunks of 8, 12, 16, 32 and 64 MiB.
const CHUNKS_8: &str = "registered in 8 MiB chunks";
const CHUNKS_12: &str = "registered in 12 MiB chunks";
const CHUNKS_16: &str = "registered in 16 MiB chunks";
const CHUNKS_32: &str = "registered in 32 MiB chunks";
const CHUNKS_64: &str = "registered in 64 MiB chunks";

/// The median of `values` (see [`stats::median`]).
fn median(values: Vec<Duration>) -> Duration {
    Duration::from_secs_f64(stats::median(
        values.iter().map(Duration::as_secs_f64).collect(),
    ))
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
                CHUNKS_12 if cuda => direct(&chunks(12), bytes, reps),
                VIRTUAL if cuda => direct(&VirtualHost::new(), bytes, reps),
                "cudaHostAlloc" | "registered" | CHUNKS_12 | VIRTUAL => continue,
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
                Err(e) => latency.notes.push(format!(
                    "{kind} {}: {e}",
                    size_label(bytes as u64),
                    e = cuda_pinned::ErrorChain(&e)
                )),
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
        sections.push(growth(quick, progress));
        sections.push(first_touch(progress));
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
        CHUNKS_8,
        CHUNKS_12,
        CHUNKS_16,
        CHUNKS_32,
        CHUNKS_64,
        VIRTUAL,
        RESERVE_8,
        RESERVE_16,
        RESERVE_128,
        RESERVE_VIRTUAL,
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
            Err(e) => section
                .notes
                .push(format!("{kind}: {e}", e = cuda_pinned::ErrorChain(&e))),
        }
    }
    progress.step("stall reserve cost");
    section.notes.push(reserve_cost_note());
    section
        .notes
        .push("anchor (H100 host): cudaHostAlloc(1 GiB) stalls the other thread 350 ms".into());
    section
}

/// The note on what an allocation the reserve covers costs against a pool hit.
fn reserve_cost_note() -> String {
    match reserve_cost() {
        Ok((covered, hit)) => format!(
            "16 MiB allocations the reserve covers: {:.0} / {:.0} / {:.0} ns; pool hits of \
             the same size: {:.0} / {:.0} / {:.0} ns (min / median / max of five rounds, each \
             the median of 64; both rounds raise the pool-wide peak, with the reserve thread \
             pinning meanwhile); covered / hit {:.2}",
            covered.min,
            covered.median,
            covered.max,
            hit.min,
            hit.median,
            hit.max,
            covered.median / hit.median
        ),
        Err(e) => format!("reserve cost: {e}", e = cuda_pinned::ErrorChain(&e)),
    }
}

/// Allocations of 16 MiB taken from blocks pinned ahead against pool hits of the same size,
/// in five alternating pairs of rounds; each round is the median of 64 allocations, in ns.
/// Both rounds start from a peak of zero, so both pay alike for raising the pool-wide peak
/// (which pauses every thread cache), and in both the reserve thread is pinning: the
/// replacements of what the covered round takes, blocks of another size during the hits.
fn reserve_cost() -> Result<(Spread, Spread)> {
    const BLOCK: usize = 16 << 20;
    const OTHER: usize = 8 << 20;
    let pool = Pool::new();
    let round = |pool: &Pool| -> Result<f64> {
        pool.reset_peak_stats();
        let mut times = Vec::new();
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
        Ok(median(times).as_secs_f64() * 1e9)
    };
    let (mut covered, mut hits) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        grow_in_background(&pool, BLOCK, 64)?;
        covered.push(round(&pool)?);
        // The 64 blocks are cached now: stop pinning that size, keep the thread busy.
        pool.reserve(BLOCK, 0)?;
        pool.reserve(OTHER, 64)?;
        hits.push(round(&pool)?);
        pool.reserve(OTHER, 0)?;
        pool.empty_cache();
    }
    Ok((Spread::of(covered), Spread::of(hits)))
}

/// A pool growing by 1 GiB on its reserve thread, in blocks of 8 / 16 / 128 MiB.
const RESERVE_8: &str = "pool reserve, 128 × 8 MiB (background)";
const RESERVE_16: &str = "pool reserve, 64 × 16 MiB (background)";
const RESERVE_128: &str = "pool reserve, 8 × 128 MiB (background)";

/// A pool over host memory from the virtual-memory API, growing by 1 GiB on its reserve thread.
const RESERVE_VIRTUAL: &str = "pool reserve over virtual, 64 × 16 MiB (background)";

/// Has `pool` pin `blocks` blocks of `block` bytes ahead, and waits until they are ready.
fn grow_in_background<B: PinnedAllocator + Clone + Send + Sync + 'static>(
    pool: &Pool<B>,
    block: usize,
    blocks: usize,
) -> Result<()> {
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
        let virtual_pool =
            Pool::with_backend(VirtualHost::new().fixed_size(), PoolConfig::default());
        let pinned = match kind {
            "cudaHostAlloc" => Some(CudaHost::new().allocate(layout)),
            "registered" => Some(Registered::new().allocate(layout)),
            CHUNKS_8 => Some(chunks(8).allocate(layout)),
            CHUNKS_12 => Some(chunks(12).allocate(layout)),
            CHUNKS_16 => Some(chunks(16).allocate(layout)),
            CHUNKS_32 => Some(chunks(32).allocate(layout)),
            CHUNKS_64 => Some(chunks(64).allocate(layout)),
            VIRTUAL => Some(VirtualHost::new().allocate(layout)),
            RESERVE_8 => grow_in_background(&pool, 8 << 20, 128).err().map(Err),
            RESERVE_16 => grow_in_background(&pool, 16 << 20, 64).err().map(Err),
            RESERVE_128 => grow_in_background(&pool, 128 << 20, 8).err().map(Err),
            RESERVE_VIRTUAL => grow_in_background(&virtual_pool, 16 << 20, 64)
                .err()
                .map(Err),
            _ => {
                std::thread::sleep(Duration::from_millis(300));
                None
            }
        };
        let end = Instant::now();
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        let ops = copier.join().expect("copier thread")?;
        drop((pool, virtual_pool));
        if let Some(pinned) = pinned {
            // SAFETY: just allocated, never used by a device.
            unsafe { free_by_kind(pinned?) };
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

/// Registration in chunks of `mib` MiB.
fn chunks(mib: usize) -> Registered {
    Registered::new().register_in_chunks(mib << 20)
}

/// Gives `allocation` back to the allocator of its kind.
///
/// # Safety
///
/// - `allocation` came from `CudaHost::new()`, `Registered::new()` (chunked or not) or
///   `VirtualHost::new()` and no device work uses it.
unsafe fn free_by_kind(allocation: Allocation) {
    // SAFETY: forwarded from the caller; the kind names the allocator that made it.
    unsafe {
        match allocation.kind() {
            MemoryKind::CudaHost(_) => CudaHost::new().deallocate(allocation),
            MemoryKind::VirtualHost => VirtualHost::new().deallocate(allocation),
            _ => Registered::new().deallocate(allocation),
        }
    }
}

/// Counts what a container asks of its allocator: new blocks, and growth in place.
#[derive(Clone, Default)]
struct Counted<A> {
    allocator: A,
    blocks: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    grown: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

// SAFETY: forwards every call to the wrapped allocator, which upholds the contract.
unsafe impl<A: PinnedAllocator> PinnedAllocator for Counted<A> {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        self.blocks.fetch_add(1, Ordering::Relaxed);
        self.allocator.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.allocator.deallocate(allocation) }
    }

    unsafe fn grow_in_place(
        &self,
        allocation: &Allocation,
        layout: Layout,
    ) -> Result<Option<Allocation>> {
        // SAFETY: forwarded from the caller.
        let grown = unsafe { self.allocator.grow_in_place(allocation, layout) }?;
        if grown.is_some() {
            self.grown.fetch_add(1, Ordering::Relaxed);
        }
        Ok(grown)
    }

    fn numa_nodes(&self) -> usize {
        self.allocator.numa_nodes()
    }

    fn numa_node(&self) -> usize {
        self.allocator.numa_node()
    }
}

/// Kinds a vector is grown in, a pageable `Vec` first as the reference.
const GROWN: [&str; 4] = ["Vec (pageable)", "registered", "cudaHostAlloc", VIRTUAL];

/// How a vector is filled: `u64`s pushed one by one, or 1 MiB slices appended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fill {
    Pushes,
    Slices,
}

/// Fills a vector to `bytes`; returns the time, the blocks the allocator made and the times
/// it grew one in place.
fn grow<A: PinnedAllocator + Clone>(
    allocator: A,
    bytes: usize,
    fill: Fill,
) -> Result<(Duration, usize, usize)> {
    let counted = Counted {
        allocator,
        blocks: Default::default(),
        grown: Default::default(),
    };
    let slice = vec![7u64; (1 << 20) / 8];
    let start = Instant::now();
    let mut v = PinnedVec::<u64, _>::new_in(counted.clone());
    match fill {
        Fill::Pushes => {
            for i in 0..(bytes / 8) as u64 {
                v.try_push(i)?;
            }
        }
        Fill::Slices => {
            for _ in 0..bytes >> 20 {
                v.try_extend_from_slice(&slice)?;
            }
        }
    }
    let took = start.elapsed();
    std::hint::black_box(&v);
    Ok((
        took,
        counted.blocks.load(Ordering::Relaxed),
        counted.grown.load(Ordering::Relaxed),
    ))
}

/// Growing a vector to 1 GiB (256 MiB quick) by pushes and by appended slices: time, blocks
/// made (each after the first moved every element) and growths in place.
fn growth(quick: bool, progress: &mut Progress) -> Section {
    let bytes: usize = if quick { 256 << 20 } else { 1 << 30 };
    let runs = if quick { 1 } else { 3 };
    let mut section = Section::new(
        "grow",
        &format!(
            "Growing a vector to {} by pushing u64s or appending 1 MiB slices ({runs} runs; min / median / max)",
            size_label(bytes as u64)
        ),
        &[
            "memory",
            "filled by",
            "ms min",
            "ms median",
            "ms max",
            "blocks made",
            "grown in place",
            "bytes moved",
        ],
    );
    for (kind, fill) in GROWN
        .iter()
        .flat_map(|kind| [(*kind, Fill::Pushes), (*kind, Fill::Slices)])
    {
        progress.step(&format!("grow {kind}"));
        let (mut times, counts) = grow_runs(kind, fill, bytes, runs, &mut section);
        if times.is_empty() {
            continue;
        }
        times.sort();
        let ms = |d: Duration| Value::Num(d.as_secs_f64() * 1e3, 1);
        let (blocks, grown) = counts;
        // Each new block after the first moved the elements so far: a geometric series.
        let moved: u64 = if blocks > 1 { bytes as u64 } else { 0 };
        section.row(vec![
            Value::Text(kind.into()),
            Value::Text(
                match fill {
                    Fill::Pushes => "pushes",
                    Fill::Slices => "1 MiB slices",
                }
                .into(),
            ),
            ms(times[0]),
            ms(times[times.len() / 2]),
            ms(times[times.len() - 1]),
            Value::Int(blocks as u64),
            Value::Int(grown as u64),
            Value::Text(if moved == 0 {
                "0".into()
            } else {
                format!("≈ {}", size_label(moved))
            }),
        ]);
    }
    section.notes.push(
        "a block that grows in place keeps its address: nothing is copied and pointers into it stay valid".into(),
    );
    section
}

/// `runs` growths of memory of `kind` to `bytes`: their times, and the blocks made and grown
/// in place by the last; an error ends the runs and goes into the section's notes.
fn grow_runs(
    kind: &str,
    fill: Fill,
    bytes: usize,
    runs: usize,
    section: &mut Section,
) -> (Vec<Duration>, (usize, usize)) {
    let mut times = Vec::new();
    let mut counts = (0, 0);
    for _ in 0..runs {
        let measured = match kind {
            "Vec (pageable)" => Ok(grow_vec(bytes, fill)),
            "registered" => grow(Registered::new(), bytes, fill),
            "cudaHostAlloc" => grow(CudaHost::new(), bytes, fill),
            _ => grow(VirtualHost::new(), bytes, fill),
        };
        match measured {
            Ok((took, blocks, grown)) => {
                times.push(took);
                counts = (blocks, grown);
            }
            Err(e) => {
                section
                    .notes
                    .push(format!("{kind}: {e}", e = cuda_pinned::ErrorChain(&e)));
                break;
            }
        }
    }
    (times, counts)
}

/// [`grow`] for a pageable `Vec`, the reference (its reallocations counted as blocks).
fn grow_vec(bytes: usize, fill: Fill) -> (Duration, usize, usize) {
    let slice = vec![7u64; (1 << 20) / 8];
    let start = Instant::now();
    let mut v = Vec::<u64>::new();
    let mut blocks = 0;
    match fill {
        Fill::Pushes => {
            for i in 0..(bytes / 8) as u64 {
                if v.len() == v.capacity() {
                    blocks += 1;
                }
                v.push(i);
            }
        }
        Fill::Slices => {
            for _ in 0..bytes >> 20 {
                if v.capacity() - v.len() < slice.len() {
                    blocks += 1;
                }
                v.extend_from_slice(&slice);
            }
        }
    }
    let took = start.elapsed();
    std::hint::black_box(&v);
    (took, blocks, 0)
}

/// The first writes into fresh memory: the CPU's view of memory from the virtual-memory API
/// fills on first touch, page by page. Allocation time, then two full writes of 256 MiB.
fn first_touch(progress: &mut Progress) -> Section {
    let mut section = Section::new(
        "touch",
        "Fresh 256 MiB: allocation, then the first and second full write (one thread)",
        &[
            "memory",
            "allocate ms",
            "first write GB/s",
            "second write GB/s",
        ],
    );
    progress.step("touch registered");
    touch_row(&mut section, "registered", Registered::new());
    progress.step("touch virtual");
    touch_row(
        &mut section,
        "virtual, not pre-touched",
        VirtualHost::new().prefault_threads(0),
    );
    progress.step("touch virtual pre-touched");
    touch_row(
        &mut section,
        "virtual, pre-touched (default)",
        VirtualHost::new(),
    );
    section
}

fn touch_row<A: PinnedAllocator>(section: &mut Section, kind: &str, allocator: A) {
    const BYTES: usize = 256 << 20;
    let start = Instant::now();
    let mut v = match PinnedVec::<u8, _>::with_capacity_in(BYTES, allocator) {
        Ok(v) => v,
        Err(e) => {
            section
                .notes
                .push(format!("{kind}: {e}", e = cuda_pinned::ErrorChain(&e)));
            return;
        }
    };
    let allocated = start.elapsed();
    let mut write = |value: u8| {
        let start = Instant::now();
        v.spare_capacity_mut()[..BYTES].fill(std::mem::MaybeUninit::new(value));
        std::hint::black_box(&mut v);
        gbps(BYTES, start.elapsed().as_secs_f64())
    };
    let (first, second) = (write(1), write(2));
    section.row(vec![
        Value::Text(kind.into()),
        Value::Num(allocated.as_secs_f64() * 1e3, 1),
        Value::Num(first, 1),
        Value::Num(second, 1),
    ]);
}
