//! Pinning ahead of need: a thread of the pool's own keeps blocks of chosen classes pinned and
//! ready, so an allocation that finds its class empty takes one instead of waiting for the
//! driver (PyTorch's `pinned_reserve_segment_size_mb`, per size class). The ready blocks are
//! in the pool's block map already and listed under the pool's own lock, so an allocation
//! takes one in the hold of the lock that found its class empty, as it would a cached block.

use crate::system_memory::{SystemMemory, refusal};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use cuda_pinned::{Allocation, Error, PinnedAllocator};
use parking_lot::{Condvar, Mutex};

use crate::pool::central::{Ahead, BlockMap, Central, Ready};
use crate::size_class::{PAGE, SLOT_STRIDE, class_size};
/// The reserve thread, stopped and joined when dropped; what it held is handed back through
/// [`Reserve::drain`] first. Its ready blocks are in the pool's block map: whoever takes one
/// from the lists (an allocation, or the pool releasing it) owns that entry.
pub(crate) struct Reserve {
    central: Arc<Mutex<Central>>,
    /// Wakes the thread: a target raised, a block taken, or stop.
    wake: Arc<Condvar>,
    /// The first slot of the NUMA node the thread pins on (as its backend said at start).
    pub(crate) slot_base: usize,
    thread: Option<JoinHandle<()>>,
}

impl Reserve {
    /// Starts the thread, pinning from `backend`, counting each block against `pinned` within
    /// `limit` before pinning it, and entering it in `blocks` and the lists of `central` once
    /// pinned. One pool starts one thread (the lists have one writer).
    pub(crate) fn start<B>(
        backend: B,
        nodes: usize,
        pinned: Arc<AtomicUsize>,
        limit: Option<usize>,
        memory: (SystemMemory, u32),
        blocks: Arc<BlockMap>,
        central: Arc<Mutex<Central>>,
    ) -> std::io::Result<Self>
    where
        B: PinnedAllocator + Send + 'static,
    {
        let wake = Arc::new(Condvar::new());
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
            let thread = Pinner {
                central: central.clone(),
                wake: wake.clone(),
                blocks,
                pinned,
                limit,
                memory,
            };
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
                        thread.run(&backend);
                    }
                })?
        };
        let node = node
            .recv()
            .map_err(|_| std::io::Error::other("the reserve thread ended before it started"))?;
        Ok(Self {
            central,
            wake,
            slot_base: node * SLOT_STRIDE,
            thread: Some(thread),
        })
    }

    /// Keeps `blocks` blocks of `slot` ready from now on; returns the ready blocks past that,
    /// for the pool to release (still counted against the pinned bytes, still in the map).
    pub(crate) fn set_target(&self, ahead: &mut Ahead, slot: usize, blocks: usize) -> Vec<Ready> {
        ahead.target[slot] = blocks;
        ahead.stalled[slot] = false;
        let keep = ahead.ready[slot].len().min(blocks);
        let excess: Vec<_> = ahead.ready[slot].drain(keep..).collect();
        ahead.ready_bytes -= excess.len() * class_size(slot);
        self.wake.notify_one();
        excess
    }

    /// A ready block of `slot`, if there is one; the thread pins another in its place.
    #[inline]
    pub(crate) fn take(&self, ahead: &mut Ahead, slot: usize) -> Option<Ready> {
        let block = ahead.ready[slot].pop()?;
        ahead.ready_bytes -= class_size(slot);
        // Written only when set: the thread reads these flags, and a write would take the
        // cache line from it.
        if ahead.stalled[slot] {
            ahead.stalled[slot] = false;
        }
        // A busy thread sees the shortfall itself: the allocating thread pays no wake-up.
        if ahead.sleeping && ahead.target[slot] > 0 {
            self.wake.notify_one();
        }
        Some(block)
    }

    /// Stops the thread and returns every ready block, already counted against the pinned
    /// bytes and in the map.
    pub(crate) fn drain(&mut self) -> Vec<Ready> {
        self.stop();
        let mut central = self.central.lock();
        let ahead = &mut central.ahead;
        let mut blocks = Vec::new();
        for ready in &mut ahead.ready {
            blocks.append(ready);
        }
        ahead.ready_bytes = 0;
        blocks
    }

    fn stop(&mut self) {
        self.central.lock().ahead.stop = true;
        self.wake.notify_all();
        if let Some(thread) = self.thread.take()
            && let Err(payload) = thread.join()
        {
            // A panic ended the thread early; what it pinned is still listed. The payload is
            // leaked: its own drop may panic.
            std::mem::forget(payload);
        }
    }
}

impl Drop for Reserve {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the thread holds.
struct Pinner {
    central: Arc<Mutex<Central>>,
    wake: Arc<Condvar>,
    blocks: Arc<BlockMap>,
    pinned: Arc<AtomicUsize>,
    limit: Option<usize>,
    /// The machine's memory, and the millionths of it to keep available.
    memory: (SystemMemory, u32),
}

impl Pinner {
    /// The thread: pins a block for the first slot short of its target, until told to stop.
    fn run<B: PinnedAllocator>(&self, backend: &B) {
        while let Some(slot) = self.next_short() {
            let size = class_size(slot);
            let pinned_block = self.pin(backend, size);
            let mut central = self.central.lock();
            let ahead = &mut central.ahead;
            ahead.pinning_bytes = 0;
            match pinned_block {
                Ok(block) if ahead.ready[slot].len() < ahead.target[slot] => {
                    let handed = Allocation::new(block.ptr(), size, block.kind(), slot);
                    let bytes = block.bytes();
                    // Entered in the map here, off the allocating threads' path.
                    self.blocks
                        .lock()
                        .insert(block.ptr().as_ptr() as usize, (block, slot));
                    ahead.ready[slot].push((handed, bytes));
                    ahead.ready_bytes += size;
                }
                Ok(block) => {
                    // The target fell while the block was being pinned: it is not wanted.
                    drop(central);
                    self.release_unwanted(backend, block, size);
                }
                Err(error) => {
                    ahead.error.get_or_insert(error);
                    ahead.failures += 1;
                    ahead.stalled[slot] = true;
                }
            }
        }
    }

    /// The next slot short of its target (its bytes then being pinned), waiting until there
    /// is one; `None` once told to stop.
    fn next_short(&self) -> Option<usize> {
        let mut central = self.central.lock();
        loop {
            let ahead = &mut central.ahead;
            if ahead.stop {
                return None;
            }
            if let Some(slot) = ahead.short() {
                ahead.pinning_bytes = class_size(slot);
                return Some(slot);
            }
            ahead.sleeping = true;
            self.wake.wait(&mut central);
            central.ahead.sleeping = false;
        }
    }

    /// A block of `size` bytes from `backend`, counted against the cap first (and given back
    /// to it on failure). A panicking backend is an error like any other: the thread goes on.
    fn pin<B: PinnedAllocator>(&self, backend: &B, size: usize) -> Result<Allocation, Error> {
        let _span = tracing::debug_span!("reserve top-up", bytes = size).entered();
        if let Some(short) = self.memory.0.short_for(size, self.memory.1) {
            let pinned = self.pinned.load(Ordering::Relaxed);
            return Err(refusal(size, short, "this pool's reserve", pinned));
        }
        if let Err(error) = count(&self.pinned, size, self.limit) {
            tracing::warn!(bytes = size, error = %cuda_pinned::ErrorChain(&error), "reserve refused");
            return Err(error);
        }
        let layout =
            std::alloc::Layout::from_size_align(size, PAGE).map_err(|_| Error::CapacityOverflow);
        let block = layout.and_then(|layout| {
            std::panic::catch_unwind(AssertUnwindSafe(|| backend.allocate(layout))).unwrap_or_else(
                |payload| {
                    // Leaked, not dropped: a payload's own drop may panic, and the thread must
                    // go on (and give the count back, below).
                    std::mem::forget(payload);
                    Err(Error::Unsupported("the backend panicked"))
                },
            )
        });
        if let Err(error) = &block {
            tracing::warn!(bytes = size, error = %cuda_pinned::ErrorChain(error), "reserve refused");
            self.pinned.fetch_sub(size, Ordering::Relaxed);
        }
        block
    }

    /// Gives a block pinned for a target that fell meanwhile back to `backend`. Should the
    /// backend panic, whether the block was freed is unknown: its bytes stay counted (the cap
    /// errs on the safe side), the failure is reported, and the thread goes on.
    fn release_unwanted<B: PinnedAllocator>(&self, backend: &B, block: Allocation, size: usize) {
        let released = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: pinned by this thread from the backend and never handed out.
            unsafe { backend.deallocate(block) }
        }));
        if let Err(payload) = released {
            std::mem::forget(payload);
            let ahead = &mut self.central.lock().ahead;
            ahead.error.get_or_insert(Error::Unsupported(
                "the backend panicked releasing a block pinned ahead",
            ));
            ahead.failures += 1;
        } else {
            self.pinned.fetch_sub(size, Ordering::Relaxed);
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
