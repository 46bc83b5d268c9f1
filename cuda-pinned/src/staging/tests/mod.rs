//! The staging engine against a fake device: one queue executed by a thread of its own, a
//! little late (as a DMA engine behind other work), that checks each chunk still holds what
//! it held when its copy was queued, and fails calls on demand.

use std::alloc::Layout;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::StagingConfig;
use super::engine::Engine;
use super::job::cut;
use super::slots::Address;
use crate::error::Error;
use crate::error::Result;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::host_locked::HostLocked;
use crate::raw::copy::Direction;
use crate::ring::{Dma, RingCopy, Way, lock, wait};

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

    unsafe fn queue(&self, _stream: &(), copies: &[RingCopy], way: Way) -> Result<()> {
        let [copy] = copies else {
            panic!("the stager queues one plain copy at a time");
        };
        assert_eq!(copy.rows, 1);
        let (host, device, bytes) = (copy.host, copy.device, copy.width);
        let direction = match way {
            Way::Upload => Direction::HostToDevice,
            Way::Download => Direction::DeviceToHost,
        };
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

    fn enqueue<R>(&self, stream: &(), work: impl FnOnce(&()) -> Result<R>) -> Result<R> {
        work(stream)
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
            Allocation::new(ptr, layout.size(), crate::MemoryKind::HostLocked, 0)
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

fn config(chunk_bytes: usize, threads: usize, chunks: usize) -> StagingConfig {
    StagingConfig {
        chunk_bytes,
        threads,
        chunks,
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

mod ring;
mod slots;
