//! Pinning ahead of need: a thread of the pool's own keeps blocks of chosen classes pinned and
//! ready, so an allocation that finds its class empty takes one instead of waiting for the
//! driver (PyTorch's `pinned_reserve_segment_size_mb`, per size class). A block joins the
//! pool's block map as soon as it is pinned, so that an allocation taking it only counts it.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use cuda_pinned::{Allocation, Error, PinnedAllocator};
use parking_lot::{Condvar, Mutex};

use crate::pool::BlockMap;
use crate::size_class::{PAGE, SLOT_STRIDE, class_size, slots};

/// A block pinned ahead: as the pool hands it out (the class size, tagged with its slot),
/// with the bytes the backend pinned. The backend's own description is in the block map.
pub(crate) type Ready = (Allocation, usize);

/// What the reserve thread and the pool share.
struct Shared {
    state: Mutex<State>,
    /// Wakes the thread: a target raised, a block taken, or stop.
    wake: Condvar,
}

struct State {
    /// Blocks to keep ready, by class.
    target: Vec<usize>,
    /// Blocks ready, by class (slot).
    ready: Vec<Vec<Ready>>,
    /// Their bytes. Kept under the lock rather than in atomics of their own, so that a take
    /// touches fewer cache lines the reserve thread writes.
    ready_bytes: usize,
    /// Those, and a block being pinned: what the reserve holds of the pinned-bytes count.
    held_bytes: usize,
    /// The first error met since it was last taken, and how many in all.
    error: Option<Error>,
    failures: u64,
    /// Classes given up on after an error, until the next `reserve` or take.
    stalled: Vec<bool>,
    stop: bool,
    /// The thread waits for a wake-up (else it looks at the targets again by itself).
    sleeping: bool,
}

/// What the reserve holds and has met, at one moment.
pub(crate) struct Figures {
    /// Bytes of the blocks ready.
    pub(crate) ready_bytes: usize,
    /// Those, and a block being pinned.
    pub(crate) held_bytes: usize,
    /// Errors met in all.
    pub(crate) failures: u64,
}

/// The reserve thread, stopped and joined when dropped; what it held is handed back through
/// [`Reserve::drain`] first. Its ready blocks are in the pool's block map: whoever takes one
/// back from it (an allocation, or the pool releasing it) owns that entry.
pub(crate) struct Reserve {
    shared: Arc<Shared>,
    /// The first slot of the NUMA node the thread pins on (as its backend said at start).
    pub(crate) slot_base: usize,
    thread: Option<JoinHandle<()>>,
}

impl Reserve {
    /// Starts the thread, pinning from `backend`, counting each block against `pinned` within
    /// `limit` before pinning it, and entering it in `blocks` once pinned.
    pub(crate) fn start<B>(
        backend: B,
        nodes: usize,
        pinned: Arc<AtomicUsize>,
        limit: Option<usize>,
        blocks: Arc<BlockMap>,
    ) -> std::io::Result<Self>
    where
        B: PinnedAllocator + Send + 'static,
    {
        let slots = slots(nodes);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                target: vec![0; slots],
                ready: (0..slots).map(|_| Vec::new()).collect(),
                ready_bytes: 0,
                held_bytes: 0,
                error: None,
                failures: 0,
                stalled: vec![false; slots],
                stop: false,
                sleeping: false,
            }),
            wake: Condvar::new(),
        });
        // The thread pins for the device current where the pool was told to reserve: the
        // backends place memory near the current device. A new thread starts on device 0, so
        // only another device is set (setting one starts its context, which a pool of memory
        // unknown to CUDA should not pay for).
        let device = cuda_pinned::is_available()
            .then(cuda_pinned::Device::current)
            .and_then(Result::ok)
            .filter(|device| device.ordinal() != 0);
        // The thread says which node it pins on: its blocks serve that node's requests.
        let (node_sender, node) = std::sync::mpsc::channel();
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("pinned-pool-reserve".into())
                .spawn(move || {
                    if let Some(device) = device {
                        // Should this fail, the thread pins near device 0 and says so below.
                        let _ = device.set_current();
                    }
                    let node = if nodes > 1 {
                        backend.numa_node() % nodes
                    } else {
                        0
                    };
                    if node_sender.send(node).is_ok() {
                        shared.run(&backend, &pinned, limit, &blocks);
                    }
                })?
        };
        let node = node
            .recv()
            .map_err(|_| std::io::Error::other("the reserve thread ended before it started"))?;
        Ok(Self {
            shared,
            slot_base: node * SLOT_STRIDE,
            thread: Some(thread),
        })
    }

    /// Keeps `blocks` blocks of `class` ready from now on; returns the ready blocks past that,
    /// for the pool to release (still counted against the pinned bytes, still in the map).
    pub(crate) fn set_target(&self, class: usize, blocks: usize) -> Vec<Ready> {
        let mut state = self.shared.state.lock();
        state.target[class] = blocks;
        state.stalled[class] = false;
        let keep = state.ready[class].len().min(blocks);
        let excess: Vec<_> = state.ready[class].drain(keep..).collect();
        let bytes = excess.len() * class_size(class);
        state.ready_bytes -= bytes;
        state.held_bytes -= bytes;
        drop(state);
        self.shared.wake.notify_one();
        excess
    }

    /// A ready block of `class`, if there is one; the thread pins another in its place.
    pub(crate) fn take(&self, class: usize) -> Option<Ready> {
        let mut state = self.shared.state.lock();
        let block = state.ready[class].pop()?;
        let size = class_size(class);
        state.ready_bytes -= size;
        state.held_bytes -= size;
        // Written only when set: the thread reads these flags, and a write would take the
        // cache line from it.
        if state.stalled[class] {
            state.stalled[class] = false;
        }
        let wake = state.sleeping && state.target[class] > 0;
        drop(state);
        // A busy thread sees the shortfall itself: the allocating thread pays no wake-up.
        if wake {
            self.shared.wake.notify_one();
        }
        Some(block)
    }

    /// The first error the thread met since the last call.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.shared.state.lock().error.take()
    }

    /// Its statistics, read together.
    pub(crate) fn figures(&self) -> Figures {
        let state = self.shared.state.lock();
        Figures {
            ready_bytes: state.ready_bytes,
            held_bytes: state.held_bytes,
            failures: state.failures,
        }
    }

    /// Stops the thread and returns every ready block, already counted against the pinned
    /// bytes and in the map.
    pub(crate) fn drain(&mut self) -> Vec<Ready> {
        self.stop();
        let mut state = self.shared.state.lock();
        let mut blocks = Vec::new();
        for ready in &mut state.ready {
            blocks.append(ready);
        }
        state.ready_bytes = 0;
        state.held_bytes = 0;
        blocks
    }

    fn stop(&mut self) {
        self.shared.state.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            // A panic in the backend ended the thread early; what it pinned is still listed.
            let _ = thread.join();
        }
    }
}

impl Drop for Reserve {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    /// The thread: pins a block for the first class short of its target, until told to stop.
    fn run<B: PinnedAllocator>(
        &self,
        backend: &B,
        pinned: &AtomicUsize,
        limit: Option<usize>,
        blocks: &BlockMap,
    ) {
        loop {
            let class = {
                let mut state = self.state.lock();
                loop {
                    if state.stop {
                        return;
                    }
                    let short = (0..state.target.len()).find(|&class| {
                        !state.stalled[class] && state.ready[class].len() < state.target[class]
                    });
                    match short {
                        Some(class) => {
                            state.held_bytes += class_size(class);
                            break class;
                        }
                        None => {
                            state.sleeping = true;
                            self.wake.wait(&mut state);
                            state.sleeping = false;
                        }
                    }
                }
            };
            let size = class_size(class);
            let pinned_block = count(pinned, size, limit).and_then(|()| {
                let layout = std::alloc::Layout::from_size_align(size, PAGE)
                    .map_err(|_| Error::CapacityOverflow);
                // A panicking backend is an error like any other: the thread goes on, and
                // the count is given back.
                let block = layout.and_then(|layout| {
                    std::panic::catch_unwind(AssertUnwindSafe(|| backend.allocate(layout)))
                        .unwrap_or(Err(Error::Unsupported("the backend panicked")))
                });
                if block.is_err() {
                    pinned.fetch_sub(size, Ordering::Relaxed);
                }
                block
            });
            let mut state = self.state.lock();
            match pinned_block {
                Ok(block) if state.ready[class].len() < state.target[class] => {
                    // Entered in the map here, off the allocating threads' path (the map's
                    // lock is the innermost of all).
                    let handed = Allocation::new(block.ptr(), size, block.kind(), class);
                    let bytes = block.bytes();
                    blocks
                        .lock()
                        .insert(block.ptr().as_ptr() as usize, (block, class));
                    state.ready[class].push((handed, bytes));
                    state.ready_bytes += size;
                }
                Ok(block) => {
                    // The target fell while the block was being pinned: it is not wanted.
                    state.held_bytes -= size;
                    drop(state);
                    let released = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        // SAFETY: pinned above from the backend and never handed out.
                        unsafe { backend.deallocate(block) }
                    }));
                    if released.is_ok() {
                        pinned.fetch_sub(size, Ordering::Relaxed);
                    } else {
                        // Whether the block was freed is unknown: its bytes stay counted
                        // (the cap errs on the safe side), and the thread goes on.
                        let mut state = self.state.lock();
                        state.error.get_or_insert(Error::Unsupported(
                            "the backend panicked releasing a block pinned ahead",
                        ));
                        state.failures += 1;
                    }
                }
                Err(error) => {
                    state.held_bytes -= size;
                    state.error.get_or_insert(error);
                    state.failures += 1;
                    state.stalled[class] = true;
                }
            }
        }
    }
}

/// Counts `size` more pinned bytes within `limit`.
fn count(pinned: &AtomicUsize, size: usize, limit: Option<usize>) -> Result<(), Error> {
    let Some(limit) = limit else {
        pinned.fetch_add(size, Ordering::Relaxed);
        return Ok(());
    };
    pinned
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
            now.checked_add(size).filter(|&wanted| wanted <= limit)
        })
        .map(drop)
        .map_err(|now| Error::LimitExceeded {
            requested: size,
            pinned: now,
            limit,
        })
}
