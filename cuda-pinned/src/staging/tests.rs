//! The staging engine against a fake device: one queue executed by a thread of its own, a
//! little late (as a DMA engine behind other work), that checks each chunk still holds what
//! it held when its copy was queued, and fails calls on demand.

use std::alloc::Layout;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use proptest::prelude::*;

use super::dma::Dma;
use super::engine::Engine;
use super::job::cut;
use super::ring::Address;
use super::{StagingConfig, lock, wait};
use crate::error::Error;
use crate::error::Result;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::host_locked::HostLocked;
use crate::raw::copy::Direction;

#[derive(Default)]
struct FakeEvent {
    /// (tickets recorded, tickets completed)
    state: Mutex<(u64, u64)>,
    done: Condvar,
    /// A wait or query saw the last ticket completed.
    seen: AtomicBool,
}

enum Op {
    Copy {
        direction: Direction,
        host: Address,
        device: usize,
        bytes: usize,
        /// What the host side held when the copy was queued (host → device).
        queued: Vec<u8>,
    },
    Signal(Arc<FakeEvent>, u64),
    Stop,
}

/// Which call fails: the n-th `queue` or `wait` (counting from 1), and whether waiting for
/// the whole stream fails too.
#[derive(Default)]
struct Faults {
    /// A worker thread (never the caller) panics in its next `queue`.
    worker_panics: AtomicBool,
    queue_at: AtomicUsize,
    wait_at: AtomicUsize,
    stream_wait_fails: AtomicBool,
    /// `record` records, then says the stream is capturing a graph (one began meanwhile).
    records_capturing: AtomicBool,
    queues: AtomicUsize,
    waits: AtomicUsize,
    stream_waits: AtomicUsize,
    queries: AtomicUsize,
}

fn injected() -> Error {
    Error::Unsupported("injected fault")
}

fn hit(count: &AtomicUsize, at: &AtomicUsize) -> bool {
    count.fetch_add(1, Ordering::Relaxed) + 1 == at.load(Ordering::Relaxed)
}

struct Device {
    memory: Mutex<Vec<u8>>,
    ops: Mutex<VecDeque<Op>>,
    posted: Condvar,
    /// A chunk changed between queueing its copy and the copy: reused before its event.
    overwritten: AtomicBool,
    /// Host addresses copies were queued from or into (the chunks used).
    chunks: Mutex<std::collections::HashSet<usize>>,
    faults: Faults,
    /// The queue is held back (as behind other work) until released.
    held: Mutex<bool>,
    released: Condvar,
    executor: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Clone)]
struct Fake(Arc<Device>);

impl Fake {
    fn new(device_bytes: usize) -> Self {
        let device = Arc::new(Device {
            memory: Mutex::new(vec![0; device_bytes]),
            ops: Mutex::new(VecDeque::new()),
            posted: Condvar::new(),
            overwritten: AtomicBool::new(false),
            chunks: Mutex::default(),
            faults: Faults::default(),
            held: Mutex::new(false),
            released: Condvar::new(),
            executor: Mutex::new(None),
        });
        let executor = device.clone();
        *lock(&device.executor) = Some(std::thread::spawn(move || executor.execute()));
        Self(device)
    }

    fn push(&self, op: Op) {
        lock(&self.0.ops).push_back(op);
        self.0.posted.notify_one();
    }

    fn stop(&self) {
        self.push(Op::Stop);
        if let Some(executor) = lock(&self.0.executor).take() {
            executor.join().unwrap();
        }
    }

    /// Holds the queue back: nothing queued from now runs until `release`.
    fn hold(&self) {
        *lock(&self.0.held) = true;
    }

    fn release(&self) {
        *lock(&self.0.held) = false;
        self.0.released.notify_all();
    }

    fn device_bytes(&self) -> Vec<u8> {
        lock(&self.0.memory).clone()
    }
}

impl Device {
    fn execute(&self) {
        loop {
            let op = {
                let mut ops = lock(&self.ops);
                loop {
                    if let Some(op) = ops.pop_front() {
                        break op;
                    }
                    ops = wait(&self.posted, ops);
                }
            };
            let mut held = lock(&self.held);
            while *held {
                held = wait(&self.released, held);
            }
            drop(held);
            match op {
                Op::Stop => return,
                Op::Signal(event, ticket) => {
                    lock(&event.state).1 = ticket;
                    event.done.notify_all();
                }
                Op::Copy {
                    direction,
                    host,
                    device,
                    bytes,
                    queued,
                } => {
                    // Late, so that the host side runs ahead as it would behind real work.
                    std::thread::sleep(Duration::from_micros(50));
                    let mut memory = lock(&self.memory);
                    let device = &mut memory[device..device + bytes];
                    // SAFETY: the engine keeps the chunk allocated, and the host threads away
                    // from it, until this copy's event has been signalled (what this fake
                    // checks); it is `bytes` long.
                    let chunk = unsafe { std::slice::from_raw_parts_mut(host.0, bytes) };
                    match direction {
                        Direction::HostToDevice => {
                            if chunk != queued.as_slice() {
                                self.overwritten.store(true, Ordering::Relaxed);
                            }
                            device.copy_from_slice(chunk);
                        }
                        Direction::DeviceToHost => chunk.copy_from_slice(device),
                    }
                }
            }
        }
    }
}

impl Dma for Fake {
    type Stream = ();
    type Event = Arc<FakeEvent>;

    fn event(&self) -> Result<Arc<FakeEvent>> {
        Ok(Arc::default())
    }

    unsafe fn queue(
        &self,
        _stream: &(),
        host: *mut u8,
        device: u64,
        bytes: usize,
        direction: Direction,
    ) -> Result<()> {
        let faults = &self.0.faults;
        if hit(&faults.queues, &faults.queue_at) {
            return Err(injected());
        }
        let worker = std::thread::current()
            .name()
            .is_some_and(|name| name.starts_with("pinned-staging"));
        if worker && faults.worker_panics.swap(false, Ordering::Relaxed) {
            panic!("injected panic in a copy thread");
        }
        lock(&self.0.chunks).insert(host as usize);
        let queued = match direction {
            // SAFETY: the caller keeps the chunk readable for the copy.
            Direction::HostToDevice => unsafe { std::slice::from_raw_parts(host, bytes) }.to_vec(),
            Direction::DeviceToHost => Vec::new(),
        };
        self.push(Op::Copy {
            direction,
            host: Address(host),
            device: device as usize,
            bytes,
            queued,
        });
        Ok(())
    }

    fn record(&self, event: &Arc<FakeEvent>, _stream: &()) -> Result<()> {
        let mut state = lock(&event.state);
        state.0 += 1;
        event.seen.store(false, Ordering::Relaxed);
        self.push(Op::Signal(event.clone(), state.0));
        if self.0.faults.records_capturing.load(Ordering::Relaxed) {
            return Err(Error::Capturing);
        }
        Ok(())
    }

    fn wait(&self, event: &Arc<FakeEvent>) -> Result<()> {
        let faults = &self.0.faults;
        if hit(&faults.waits, &faults.wait_at) {
            return Err(injected());
        }
        let mut state = lock(&event.state);
        let target = state.0;
        while state.1 < target {
            state = wait(&event.done, state);
        }
        event.seen.store(true, Ordering::Release);
        Ok(())
    }

    fn seen_finished(&self, event: &Arc<FakeEvent>) -> bool {
        event.seen.load(Ordering::Acquire)
    }

    fn finished(&self, event: &Arc<FakeEvent>) -> Result<bool> {
        self.0.faults.queries.fetch_add(1, Ordering::Relaxed);
        let state = lock(&event.state);
        let finished = state.1 >= state.0;
        event.seen.store(finished, Ordering::Release);
        Ok(finished)
    }

    fn wait_stream(&self, _stream: &()) -> Result<()> {
        self.0.faults.stream_waits.fetch_add(1, Ordering::Relaxed);
        if self.0.faults.stream_wait_fails.load(Ordering::Relaxed) {
            return Err(injected());
        }
        let event = Arc::new(FakeEvent::default());
        let mut state = lock(&event.state);
        state.0 += 1;
        self.push(Op::Signal(event.clone(), state.0));
        drop(state);
        let mut state = lock(&event.state);
        while state.1 < state.0 {
            state = wait(&event.done, state);
        }
        Ok(())
    }

    fn device(&self) -> i32 {
        0
    }

    fn use_device(&self) -> Result<()> {
        Ok(())
    }
}

/// Page-locked memory (under Miri, which cannot lock pages, the heap) that counts its live
/// allocations.
#[derive(Clone, Default)]
struct Counted(Arc<AtomicUsize>);

// SAFETY: forwards to `HostLocked`, or takes heap memory of the layout (page-aligned) and
// gives it back with the same layout; counts both.
unsafe impl PinnedAllocator for Counted {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let allocation = if cfg!(miri) {
            let layout = layout.align_to(4096).map_err(|_| Error::CapacityOverflow)?;
            // SAFETY: the size is non-zero (containers never ask for 0).
            let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) }).ok_or(
                Error::OutOfMemory {
                    requested: layout.size(),
                },
            )?;
            Allocation::new(ptr, layout.size(), crate::MemoryKind::Locked, 0)
        } else {
            HostLocked.allocate(layout)?
        };
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(allocation)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        if cfg!(miri) {
            let layout = Layout::from_size_align(allocation.bytes(), 4096).unwrap();
            // SAFETY: allocated above with this layout; given back once.
            unsafe { std::alloc::dealloc(allocation.ptr().as_ptr(), layout) };
        } else {
            // SAFETY: forwarded from the caller; the allocation came from `HostLocked`.
            unsafe { HostLocked.deallocate(allocation) }
        }
    }
}

fn config(chunk_bytes: usize, threads: usize, slots: usize) -> StagingConfig {
    StagingConfig {
        chunk_bytes,
        threads,
        slots,
        single_thread_bytes: chunk_bytes,
        min_piece_bytes: 64,
        driver_uploads: Vec::new(),
        driver_downloads: Vec::new(),
        upload_slot_bytes: 0,
        upload_slots: 0,
        streaming_stores: true,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Host → device → host through the engine: `(offset, data)` written at `offset`, read back.
fn round_trip(engine: &Engine<Fake, Counted>, offset: usize, data: &[u8]) -> Result<Vec<u8>> {
    // SAFETY: `data` is readable for its length and not written meanwhile; the fake's device
    // memory covers the range (checked by its slicing).
    unsafe {
        engine.run(
            Direction::HostToDevice,
            data.as_ptr().cast_mut(),
            offset as u64,
            data.len(),
            &(),
        )?
    };
    let mut back = vec![0u8; data.len()];
    // SAFETY: `back` is writable for its length and borrowed uniquely.
    unsafe {
        engine.run(
            Direction::DeviceToHost,
            back.as_mut_ptr(),
            offset as u64,
            back.len(),
            &(),
        )?
    };
    Ok(back)
}

const CASES: u32 = if cfg!(miri) { 3 } else { 48 };

/// `cases` cases; under Miri, which isolates the program from the file system, failures are
/// not written down.
fn cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: if cfg!(miri) {
            None
        } else {
            ProptestConfig::default().failure_persistence
        },
        ..ProptestConfig::default()
    }
}
const MAX_LEN: usize = if cfg!(miri) { 3000 } else { 20_000 };

proptest! {
    #![proptest_config(cases(CASES))]

    /// Any size (zero, below, at and past a chunk, not a multiple of it), any chunk size,
    /// thread and slot count: the bytes arrive in place, no chunk is touched before its
    /// event, and the ring's memory is given back.
    #[test]
    fn copies_arrive_intact_whatever_the_cut(
        len in 0usize..MAX_LEN,
        offset in 0usize..64,
        chunk in 64usize..3000,
        threads in 1usize..5,
        slots in 1usize..5,
        single_thread in any::<bool>(),
    ) {
        let fake = Fake::new(MAX_LEN + 64);
        let allocator = Counted::default();
        let mut config = config(chunk, threads, slots);
        if !single_thread {
            config.single_thread_bytes = 0;
        }
        let engine = Engine::new(fake.clone(), config, allocator.clone()).unwrap();
        let data = pattern(len, offset as u8);
        let back = round_trip(&engine, offset, &data).unwrap();
        prop_assert_eq!(&back, &data);
        prop_assert_eq!(&fake.device_bytes()[offset..offset + len], data.as_slice());
        prop_assert!(!fake.0.overwritten.load(Ordering::Relaxed));
        drop(engine);
        prop_assert_eq!(allocator.0.load(Ordering::Relaxed), 0);
        fake.stop();
    }
}

proptest! {
    #![proptest_config(cases(if cfg!(miri) { 8 } else { 512 }))]

    /// Pieces cover the copy exactly, in order, none empty or larger than a chunk; on one
    /// thread they are whole chunks.
    #[test]
    fn pieces_cover_the_copy_in_order(
        bytes in 0usize..1 << 24,
        chunk in 1usize..1 << 20,
        threads in 1usize..20,
        min_piece in 0usize..1 << 20,
        spread in any::<bool>(),
    ) {
        let config = StagingConfig { min_piece_bytes: min_piece, ..config(chunk, threads, 1) };
        let cuts = cut(bytes, &config, spread);
        let mut end = 0;
        for &(offset, len) in &cuts {
            prop_assert_eq!(offset, end);
            prop_assert!(len > 0 && len <= chunk);
            end += len;
        }
        prop_assert_eq!(end, bytes);
        if !spread {
            prop_assert_eq!(cuts.len(), bytes.div_ceil(chunk));
        }
    }
}

#[test]
fn one_chunk_is_reused_only_after_each_copy() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), config(512, 3, 1), Counted::default()).unwrap();
    let data = pattern(40_000, 7);
    assert_eq!(round_trip(&engine, 100, &data).unwrap(), data);
    assert!(!fake.0.overwritten.load(Ordering::Relaxed));
    drop(engine);
    fake.stop();
}

#[test]
fn a_copy_on_one_thread_cycles_through_the_chunks() {
    let fake = Fake::new(1 << 16);
    let config = StagingConfig {
        single_thread_bytes: usize::MAX,
        ..config(256, 1, 4)
    };
    let engine = Engine::new(fake.clone(), config, Counted::default()).unwrap();
    let data = pattern(4096, 5);
    assert_eq!(round_trip(&engine, 0, &data).unwrap(), data);
    // 16 pieces each way: every chunk takes part, so one piece's DMA overlaps the next copy.
    assert_eq!(lock(&fake.0.chunks).len(), 4);
    drop(engine);
    fake.stop();
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_panicking_copy_thread_fails_the_copy_without_a_hang() {
    let fake = Fake::new(1 << 16);
    let allocator = Counted::default();
    let config = StagingConfig {
        single_thread_bytes: 0,
        ..config(256, 4, 4)
    };
    let engine = Engine::new(fake.clone(), config, allocator.clone()).unwrap();
    let data = pattern(40_000, 6);
    fake.0.faults.worker_panics.store(true, Ordering::Relaxed);
    let result = round_trip(&engine, 0, &data);
    // The caller may finish every piece before a worker wakes: then nothing panicked.
    if fake.0.faults.worker_panics.load(Ordering::Relaxed) {
        assert_eq!(result.unwrap(), data);
    } else {
        let error = result.unwrap_err();
        assert!(error.to_string().contains("panicked"), "{error}");
    }
    // The engine goes on with the threads and chunks it has left.
    fake.0.faults.worker_panics.store(false, Ordering::Relaxed);
    assert_eq!(round_trip(&engine, 0, &data).unwrap(), data);
    drop(engine);
    fake.stop();
}

#[test]
fn copies_from_several_threads_at_once_share_the_workers() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), config(1024, 4, 3), Counted::default()).unwrap();
    std::thread::scope(|scope| {
        for part in 0..4usize {
            let engine = &engine;
            scope.spawn(move || {
                let data = pattern(8000 + part, part as u8);
                assert_eq!(round_trip(engine, part * 16_000, &data).unwrap(), data);
            });
        }
    });
    assert!(!fake.0.overwritten.load(Ordering::Relaxed));
    drop(engine);
    fake.stop();
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn an_error_midway_is_reported_and_the_engine_stays_usable() {
    for (queue_at, wait_at) in [(3, 0), (0, 4), (1, 0)] {
        let fake = Fake::new(1 << 16);
        fake.0.faults.queue_at.store(queue_at, Ordering::Relaxed);
        fake.0.faults.wait_at.store(wait_at, Ordering::Relaxed);
        let allocator = Counted::default();
        let engine = Engine::new(fake.clone(), config(1000, 3, 4), allocator.clone()).unwrap();
        let data = pattern(10_000, 1);
        let error = round_trip(&engine, 0, &data).unwrap_err();
        assert!(error.to_string().contains("injected"), "{error}");
        // The ring is intact (or short of the chunk whose wait failed): copies go on.
        assert_eq!(round_trip(&engine, 0, &data).unwrap(), data);
        drop(engine);
        let freed = allocator.0.load(Ordering::Relaxed) == 0;
        // A chunk whose last copy could not be waited for is never reused, so the ring's
        // memory is leaked rather than freed under a DMA that may still run.
        assert_eq!(freed, wait_at == 0, "queue_at {queue_at} wait_at {wait_at}");
        fake.stop();
    }
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_ring_that_lost_every_chunk_says_so_instead_of_hanging() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), config(1000, 2, 1), Counted::default()).unwrap();
    fake.0.faults.wait_at.store(1, Ordering::Relaxed);
    assert!(round_trip(&engine, 0, &pattern(5000, 2)).is_err());
    let error = round_trip(&engine, 0, &pattern(5000, 2)).unwrap_err();
    assert!(error.to_string().contains("lost"), "{error}");
    drop(engine);
    fake.stop();
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_copy_queued_whose_event_is_unknown_waits_for_the_stream_or_loses_the_chunk() {
    for stream_wait_fails in [false, true] {
        let fake = Fake::new(1 << 16);
        let allocator = Counted::default();
        let engine = Engine::new(fake.clone(), config(4096, 1, 2), allocator.clone()).unwrap();
        // A fresh ring's chunks have no DMA to wait for: the first wait is the piece's own,
        // after its copy was queued.
        fake.0.faults.wait_at.store(1, Ordering::Relaxed);
        fake.0
            .faults
            .stream_wait_fails
            .store(stream_wait_fails, Ordering::Relaxed);
        let mut back = vec![0u8; 4096];
        // SAFETY: `back` is writable for its length.
        let result =
            unsafe { engine.run(Direction::DeviceToHost, back.as_mut_ptr(), 0, 4096, &()) };
        assert!(result.is_err());
        drop(engine);
        assert_eq!(allocator.0.load(Ordering::Relaxed) == 0, !stream_wait_fails);
        fake.stop();
    }
}

/// A capture that began on the stream while a piece was queued took in its copy: the chunk is
/// lost without waiting for the stream (which would break the capture), and the copy fails
/// saying so.
#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_piece_taken_in_by_a_capture_loses_its_chunk_without_waiting() {
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        let fake = Fake::new(1 << 16);
        let allocator = Counted::default();
        let engine = Engine::new(fake.clone(), config(4096, 1, 2), allocator.clone()).unwrap();
        fake.0
            .faults
            .records_capturing
            .store(true, Ordering::Relaxed);
        let mut host = vec![0u8; 4096];
        // SAFETY: `host` is readable and writable for its length.
        let result = unsafe { engine.run(direction, host.as_mut_ptr(), 0, 4096, &()) };
        assert!(matches!(result, Err(Error::Capturing)), "{result:?}");
        assert_eq!(fake.0.faults.stream_waits.load(Ordering::Relaxed), 0);
        let lost: Vec<usize> = lock(&fake.0.chunks).drain().collect();
        assert_eq!(lost.len(), 1);
        // The other chunk still works; the lost one is never handed out again.
        fake.0
            .faults
            .records_capturing
            .store(false, Ordering::Relaxed);
        for _ in 0..3 {
            // SAFETY: as above.
            unsafe { engine.run(direction, host.as_mut_ptr(), 0, 4096, &()) }.unwrap();
        }
        let used: Vec<usize> = lock(&fake.0.chunks).iter().copied().collect();
        assert_eq!(used.len(), 1);
        assert_ne!(used, lost);
        drop(engine);
        assert_ne!(
            allocator.0.load(Ordering::Relaxed),
            0,
            "a lost chunk's ring was freed"
        );
        fake.stop();
    }
}

#[test]
fn configurations_without_room_are_refused() {
    let too_many = StagingConfig::MAX_THREADS + 1;
    for (chunk, threads, slots) in [
        (0, 1, 1),
        (1, 0, 1),
        (1, 1, 0),
        (1, too_many, 1),
        (1, usize::MAX, 1),
    ] {
        let fake = Fake::new(0);
        let result = Engine::new(
            fake.clone(),
            config(chunk, threads, slots),
            Counted::default(),
        );
        assert!(matches!(result, Err(Error::Unsupported(_))));
        fake.stop();
    }
    let fake = Fake::new(0);
    let result = Engine::new(fake.clone(), config(usize::MAX, 1, 2), Counted::default());
    assert!(matches!(result, Err(Error::CapacityOverflow)));
    fake.stop();
}

#[test]
#[allow(clippy::reversed_empty_ranges)]
fn driver_sizes_out_of_order_or_past_the_checked_size_are_refused() {
    let reversed = (16 << 10)..=0;
    let backwards = [
        StagingConfig {
            driver_uploads: vec![0..=4096, reversed.clone()],
            ..config(4096, 1, 1)
        },
        StagingConfig {
            driver_downloads: vec![reversed],
            ..config(4096, 1, 1)
        },
    ];
    for config in backwards {
        let fake = Fake::new(0);
        let result = Engine::new(fake.clone(), config, Counted::default());
        assert!(matches!(result, Err(Error::Unsupported(_))));
        fake.stop();
    }
    // Past the largest size checked.
    let fake = Fake::new(0);
    let unbounded = StagingConfig {
        driver_uploads: vec![1..=usize::MAX],
        ..config(4096, 1, 1)
    };
    let result = Engine::new(fake.clone(), unbounded, Counted::default());
    assert!(matches!(result, Err(Error::Unsupported(_))));
    fake.stop();
    // Overlapping and single-size ranges up to that size are fine.
    let fake = Fake::new(0);
    let fine = StagingConfig {
        driver_uploads: vec![0..=4096, 4096..=4096, 1..=(4 << 20)],
        driver_downloads: vec![0..=0],
        ..config(4096, 1, 1)
    };
    let engine = Engine::new(fake.clone(), fine, Counted::default()).unwrap();
    drop(engine);
    fake.stop();
}

/// Downloads through the engine in pieces large enough for non-temporal stores, from one to
/// five threads, into destinations at every alignment.
#[test]
#[cfg_attr(miri, ignore = "many rounds; the plain copy is covered above")]
fn streaming_downloads_through_the_engine_are_exact() {
    for round in 0..200usize {
        let chunk = 4096 + (round * 977) % 20_000;
        let threads = 1 + round % 5;
        let fake = Fake::new(1 << 20);
        let mut config = config(chunk, threads, 1 + round % 4);
        config.single_thread_bytes = if round % 2 == 0 { 0 } else { usize::MAX };
        config.min_piece_bytes = 4096;
        let engine = Engine::new(fake.clone(), config, Counted::default()).unwrap();
        let len = 10_000 + (round * 7919) % 200_000;
        let offset = round % 61;
        let data = pattern(len, round as u8);
        let mut host = vec![0u8; len + 64];
        round_trip_into(&engine, &data, &mut host[offset..offset + len]);
        assert_eq!(&host[offset..offset + len], &data[..], "round {round}");
        assert!(host[..offset].iter().all(|&b| b == 0));
        assert!(host[offset + len..].iter().all(|&b| b == 0));
        drop(engine);
        fake.stop();
    }
}

/// Uploads `data` at device offset 0, then downloads it into `into`.
fn round_trip_into(engine: &Engine<Fake, Counted>, data: &[u8], into: &mut [u8]) {
    // SAFETY: `data` is readable and `into` writable for their lengths, neither touched
    // meanwhile; the fake's device memory covers both copies (checked by its slicing).
    unsafe {
        engine
            .run(
                Direction::HostToDevice,
                data.as_ptr().cast_mut(),
                0,
                data.len(),
                &(),
            )
            .unwrap();
        engine
            .run(
                Direction::DeviceToHost,
                into.as_mut_ptr(),
                0,
                into.len(),
                &(),
            )
            .unwrap();
    }
}

/// An upload through a slot as the stager makes it, its event recorded by `end` (which fails
/// with `end_fails` instead, after the copy was queued); `None` when no slot was taken.
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn upload_in_slot(
    engine: &Engine<Fake, Counted>,
    fake: &Fake,
    offset: usize,
    data: &[u8],
    end_fails: Option<Error>,
) -> Option<Result<Arc<Arc<FakeEvent>>>> {
    let end = || match end_fails {
        Some(error) => Err(error),
        None => recorded(fake),
    };
    // SAFETY: `data` is readable for its length during the call; the fake's device memory
    // covers the range (checked by its slicing).
    unsafe { engine.upload_in_slot(data.as_ptr(), offset as u64, data.len(), &(), end) }
}

/// A new event recorded on the fake's queue.
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn recorded(fake: &Fake) -> Result<Arc<Arc<FakeEvent>>> {
    let event = Arc::new(fake.event()?);
    fake.record(&event, &())?;
    Ok(event)
}

/// Uploads `data` at `offset` as the stager does: through a slot, ended by the event `end`
/// records, or else through the ring. The slot's event, when a slot was taken.
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn through_a_slot_or_the_ring(
    engine: &Engine<Fake, Counted>,
    offset: usize,
    data: &[u8],
    end: impl FnOnce() -> Result<Arc<Arc<FakeEvent>>>,
) -> Option<Arc<Arc<FakeEvent>>> {
    let (host, len) = (data.as_ptr(), data.len());
    // SAFETY: `data` is readable for its length during the call; the fake's device memory
    // covers the range (checked by its slicing).
    if let Some(ended) = unsafe { engine.upload_in_slot(host, offset as u64, len, &(), end) } {
        return Some(ended.unwrap());
    }
    // SAFETY: as above; an upload only reads its host side.
    unsafe {
        engine.run(
            Direction::HostToDevice,
            host.cast_mut(),
            offset as u64,
            len,
            &(),
        )
    }
    .unwrap();
    None
}

fn with_upload_slots(slot_bytes: usize, slots: usize) -> StagingConfig {
    StagingConfig {
        upload_slot_bytes: slot_bytes,
        upload_slots: slots,
        ..config(1024, 1, 1)
    }
}

/// Small uploads from a source rewritten after each call: each takes a slot whose last copy
/// has finished or falls back to the ring, no slot is written before its copy has run, and
/// everything arrives as it was when its call returned; with slots of 256 bytes and of 40 KiB
/// (filled with streaming stores from 32 KiB).
#[test]
fn upload_slots_are_reused_only_after_their_copy() {
    const UPLOADS: usize = if cfg!(miri) { 12 } else { 60 };
    for slot in [256, 40 << 10] {
        let fake = Fake::new(UPLOADS * slot);
        let allocator = Counted::default();
        let engine =
            Engine::new(fake.clone(), with_upload_slots(slot, 2), allocator.clone()).unwrap();
        let mut events = Vec::new();
        let mut in_slots = 0;
        let mut expected = vec![0u8; UPLOADS * slot];
        let mut source = vec![0u8; slot];
        for i in 0..UPLOADS {
            let len = slot - (i * 37) % slot;
            let offset = i * slot;
            source[..len].copy_from_slice(&pattern(len, i as u8));
            expected[offset..offset + len].copy_from_slice(&source[..len]);
            if let Some(ended) =
                through_a_slot_or_the_ring(&engine, offset, &source[..len], || recorded(&fake))
            {
                events.push(ended);
                in_slots += 1;
            }
            source.fill(0xEE);
            if i % 3 == 0
                && let Some(event) = events.last()
            {
                // Waited for: its slot is known free without asking the device.
                fake.wait(event).unwrap();
            }
        }
        assert!(
            in_slots >= UPLOADS / 3,
            "{in_slots} of {UPLOADS} uploads took a slot"
        );
        for event in &events {
            fake.wait(event).unwrap();
        }
        let queries = fake.0.faults.queries.load(Ordering::Relaxed);
        assert!(upload_in_slot(&engine, &fake, 0, &expected[..10], None).is_some());
        assert_eq!(fake.0.faults.queries.load(Ordering::Relaxed), queries);
        assert!(!fake.0.overwritten.load(Ordering::Relaxed));
        drop(engine);
        assert_eq!(fake.device_bytes()[10..], expected[10..]);
        assert_eq!(allocator.0.load(Ordering::Relaxed), 0);
        fake.stop();
    }
}

#[test]
fn uploads_that_fit_no_slot_are_left_to_the_other_paths() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), with_upload_slots(256, 1), Counted::default()).unwrap();
    assert!(upload_in_slot(&engine, &fake, 0, &[], None).is_none());
    assert!(upload_in_slot(&engine, &fake, 0, &[1; 257], None).is_none());
    // The one slot's copy is held back: no slot is ready.
    fake.hold();
    let ended = upload_in_slot(&engine, &fake, 0, &[1; 256], None)
        .unwrap()
        .unwrap();
    let while_held = upload_in_slot(&engine, &fake, 0, &[2; 256], None);
    // Released before asserting: a failure must not leave the engine's drop waiting.
    fake.release();
    assert!(while_held.is_none());
    fake.wait(&ended).unwrap();
    assert!(upload_in_slot(&engine, &fake, 0, &[3; 256], None).is_some());
    drop(engine);
    let none = Engine::new(fake.clone(), with_upload_slots(0, 4), Counted::default()).unwrap();
    assert!(upload_in_slot(&none, &fake, 0, &[1], None).is_none());
    drop(none);
    fake.stop();
}

/// A slot whose copy no event covers (the copy call or the event failed) is reused after the
/// stream has been waited for, and lost when that fails too, or when a capture took the copy
/// in (waiting would break the capture): its memory is then leaked, not freed.
#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_slot_whose_copy_is_unknown_waits_for_the_stream_or_is_lost() {
    let cases = [
        (1, None, false, true),
        (0, Some(injected()), false, true),
        (0, Some(injected()), true, false),
        (0, Some(Error::Capturing), false, false),
    ];
    for (queue_at, end_fails, stream_wait_fails, reused) in cases {
        let fake = Fake::new(1 << 16);
        let allocator = Counted::default();
        let engine =
            Engine::new(fake.clone(), with_upload_slots(256, 1), allocator.clone()).unwrap();
        fake.0.faults.queue_at.store(queue_at, Ordering::Relaxed);
        fake.0
            .faults
            .stream_wait_fails
            .store(stream_wait_fails, Ordering::Relaxed);
        let capturing = matches!(end_fails, Some(Error::Capturing));
        let failed = upload_in_slot(&engine, &fake, 0, &[1; 100], end_fails).unwrap();
        assert!(failed.is_err());
        let waits = fake.0.faults.stream_waits.load(Ordering::Relaxed);
        assert_eq!(waits, usize::from(!capturing), "stream waits");
        fake.0
            .faults
            .stream_wait_fails
            .store(false, Ordering::Relaxed);
        let again = upload_in_slot(&engine, &fake, 0, &[2; 100], None);
        assert_eq!(again.is_some(), reused);
        if let Some(ended) = again {
            fake.wait(&ended.unwrap()).unwrap();
        }
        drop(engine);
        assert_eq!(allocator.0.load(Ordering::Relaxed) == 0, reused);
        assert!(!fake.0.overwritten.load(Ordering::Relaxed));
        fake.stop();
    }
}

/// Three threads upload through three slots with events recycled as the stager recycles them
/// (one is reused once nobody else holds it), dropping some ended events at once, keeping,
/// waiting for, or handing others to a thread that queries them (as a device buffer or a
/// pool would): no slot is written before its copy has run, and every upload arrives.
#[test]
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn slots_and_recycled_events_hold_under_several_threads() {
    const THREADS: usize = 3;
    const SLOT: usize = 128;
    const BLOCKS: usize = 8;
    let iterations = if cfg!(miri) { 30 } else { 400 };
    let fake = Fake::new(THREADS * BLOCKS * SLOT);
    let allocator = Counted::default();
    let config = StagingConfig {
        threads: 2,
        slots: 2,
        ..with_upload_slots(SLOT, 3)
    };
    let engine = Engine::new(fake.clone(), config, allocator.clone()).unwrap();
    let recycled: Mutex<Vec<Arc<Arc<FakeEvent>>>> = Mutex::new(Vec::new());
    let end_event = || {
        let mut events = lock(&recycled);
        if let Some(event) = events.iter().find(|event| Arc::strong_count(event) == 1) {
            std::sync::atomic::fence(Ordering::Acquire);
            return event.clone();
        }
        let event = Arc::new(fake.event().unwrap());
        if events.len() < 16 {
            events.push(event.clone());
        }
        event
    };
    let queried: Mutex<Vec<Arc<Arc<FakeEvent>>>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let expected: Vec<Mutex<Vec<u8>>> = (0..THREADS)
        .map(|_| Mutex::new(vec![0; BLOCKS * SLOT]))
        .collect();
    let in_slots = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let events: Vec<_> = lock(&queried).drain(..).collect();
                for event in &events {
                    let _ = fake.finished(event);
                }
                std::thread::yield_now();
            }
        });
        let uploaders: Vec<_> = (0..THREADS)
            .map(|t| {
                let (engine, fake, end_event) = (&engine, &fake, &end_event);
                let (queried, expected, in_slots) = (&queried, &expected[t], &in_slots);
                scope.spawn(move || {
                    let mut kept = VecDeque::new();
                    let mut source = [0u8; SLOT];
                    for i in 0..iterations {
                        let len = 1 + (i * 53 + t * 7) % SLOT;
                        let block = i % BLOCKS;
                        let offset = (t * BLOCKS + block) * SLOT;
                        source[..len].copy_from_slice(&pattern(len, (i + t * 31) as u8));
                        lock(expected)[block * SLOT..block * SLOT + len]
                            .copy_from_slice(&source[..len]);
                        let end = || {
                            let event = end_event();
                            fake.record(&event, &())?;
                            Ok(event)
                        };
                        if let Some(ended) =
                            through_a_slot_or_the_ring(engine, offset, &source[..len], end)
                        {
                            in_slots.fetch_add(1, Ordering::Relaxed);
                            match i % 4 {
                                0 => drop(ended),
                                1 => kept.push_back(ended),
                                2 => lock(queried).push(ended),
                                _ => fake.wait(&ended).unwrap(),
                            }
                        }
                        source.fill(0xEE);
                        if kept.len() > 4 {
                            let _ = fake.finished(&kept.pop_front().unwrap());
                        }
                    }
                })
            })
            .collect();
        for uploader in uploaders {
            uploader.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    drop(engine);
    assert!(!fake.0.overwritten.load(Ordering::Relaxed));
    assert!(in_slots.load(Ordering::Relaxed) > 0);
    let device = fake.device_bytes();
    for (t, expected) in expected.iter().enumerate() {
        let blocks = &device[t * BLOCKS * SLOT..(t + 1) * BLOCKS * SLOT];
        assert!(blocks == &lock(expected)[..], "thread {t}'s uploads");
    }
    assert_eq!(allocator.0.load(Ordering::Relaxed), 0);
    fake.stop();
}

/// Claims any amount of page-locked memory without mapping any: for configurations whose
/// memory is never touched.
#[derive(Clone, Copy)]
struct Pretend;

// SAFETY: never used for reads or writes (the one test using it copies nothing); the address
// handed out is page-aligned and never dereferenced or freed.
unsafe impl PinnedAllocator for Pretend {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let page = std::ptr::NonNull::new(std::ptr::without_provenance_mut(4096)).unwrap();
        Ok(Allocation::new(
            page,
            layout.size(),
            crate::MemoryKind::Locked,
            0,
        ))
    }

    unsafe fn deallocate(&self, _allocation: Allocation) {}
}

/// A configuration with more upload slots than the slot list can hold (its memory granted)
/// is refused with an error, not an abort.
#[test]
fn too_many_upload_slots_are_an_error() {
    let fake = Fake::new(16);
    let config = with_upload_slots(1, 1 << 60);
    let error = Engine::new(fake.clone(), config, Pretend).err();
    assert!(
        matches!(error, Some(Error::OutOfMemory { .. })),
        "{error:?}"
    );
    fake.stop();
}
