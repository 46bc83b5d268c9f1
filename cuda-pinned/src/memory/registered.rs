//! Kind 2: memory this crate maps itself, backs with huge pages, pre-faults in parallel and
//! registers with `cudaHostRegister` — the fast cold path.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::error::Result;
use crate::gpu::device::Device;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::allocator::check_layout;
use crate::memory::flags::RegisterFlags;
use crate::os;
/// How long the driver's lock is left free between the registrations of two chunks (see
/// `register_chunked`): long enough for a thread woken from waiting on the lock to take it
/// (`docs/tuning.md`).
const REGISTRATION_GAP: Duration = Duration::from_micros(60);

/// The sleeps that make the gap: the kernel's default timer slack (50 µs) stretches one to
/// about the whole gap, and a thread with less slack sleeps several times.
const REGISTRATION_PAUSE: Duration = Duration::from_micros(10);

/// How long the registering thread spins waiting for the faulting crew before it sleeps.
const CREW_SPIN: Duration = Duration::from_micros(200);

/// Page-locked memory obtained the fast way: an anonymous `mmap`, `MADV_HUGEPAGE` for sizes
/// of 2 MiB and more, every page faulted in by several threads, then one `cudaHostRegister`.
///
/// It pins about ten times faster than `cudaHostAlloc`. Registration holds the driver's lock
/// for its whole range, and other threads' copies wait that long;
/// [`register_in_chunks`](Self::register_in_chunks) bounds that wait and overlaps faulting with
/// registering. Needs CUDA and a device that supports
/// registration ([`Device::supports_host_registration`]).
///
/// On a machine with several NUMA nodes the pages go on the node nearest the current device
/// (or on [`node`](Self::node)); on one node, where the kernel puts them.
///
/// Sizes are rounded up to the page (4 KiB), or to 2 MiB where huge pages are used (only
/// where that adds at most 12.5%); the extra is usable capacity.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    flags: RegisterFlags,
    huge_pages: bool,
    prefault_threads: usize,
    chunk_bytes: Option<usize>,
    node: Option<u32>,
}

impl fmt::Debug for Registered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered")
            .field("flags", &self.flags)
            .field("huge_pages", &self.huge_pages)
            .field("prefault_threads", &self.prefault_threads)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("node", &self.node)
            .finish()
    }
}

impl Default for Registered {
    fn default() -> Self {
        Self::new()
    }
}

impl Registered {
    /// Portable, huge pages where possible, pre-fault on up to 16 threads, one registration
    /// per block, pages on the current device's NUMA node where there are several.
    pub fn new() -> Self {
        Self {
            flags: RegisterFlags::default(),
            huge_pages: true,
            prefault_threads: os::default_prefault_threads(),
            chunk_bytes: None,
            node: None,
        }
    }

    /// With these registration flags.
    pub fn flags(self, flags: RegisterFlags) -> Self {
        Self { flags, ..self }
    }

    /// Whether to ask for transparent huge pages for blocks of 2 MiB and more.
    pub fn huge_pages(self, huge_pages: bool) -> Self {
        Self { huge_pages, ..self }
    }

    /// Threads that fault pages in before registration (at least 1). Registration in chunks
    /// leaves three cores free of them (see [`register_in_chunks`](Self::register_in_chunks)).
    pub fn prefault_threads(self, threads: usize) -> Self {
        Self {
            prefault_threads: threads.max(1),
            ..self
        }
    }

    /// Places the pages on this NUMA node (`mbind`, preferred: another node when it is full)
    /// instead of the current device's.
    ///
    /// Allocation fails if the kernel refuses: a node the machine does not have, a kernel without
    /// NUMA support, or a sandbox that forbids `mbind`.
    pub fn node(self, node: u32) -> Self {
        Self {
            node: Some(node),
            ..self
        }
    }

    /// Registers blocks larger than `bytes` (rounded up to 2 MiB) in consecutive chunks of
    /// that size, each as soon as the crew of faulting threads has faulted it in.
    ///
    /// The driver's lock is taken for one chunk at a time, with a pause between chunks so
    /// that other threads' copies get their turn; the crew (up to
    /// [`prefault_threads`](Self::prefault_threads), at most all cores but three) goes on
    /// with the next chunk meanwhile. Smaller chunks hold the lock for less time but pin more
    /// slowly; 12 MiB was the best trade-off on the hosts measured (`docs/tuning.md`).
    ///
    /// Copies queued through this crate split at the chunk boundaries (one buffer, one
    /// [`Transfer`](crate::Transfer)). A copy queued by other code must stay within one
    /// chunk, since CUDA refuses a copy that spans two registrations: a raw pointer handed
    /// to another library, say (with cudarc, use `CudarcCopies`, which splits). `0` turns
    /// chunking off (the default).
    pub fn register_in_chunks(self, bytes: usize) -> Self {
        Self {
            chunk_bytes: (bytes > 0).then(|| os::round_up(bytes, os::HUGE_PAGE).unwrap_or(bytes)),
            ..self
        }
    }

    /// The bytes mapped for a request, and whether huge pages back them. Huge pages are used
    /// only where rounding up to 2 MiB adds at most an eighth (a 3 MiB buffer stays on 4 KiB
    /// pages rather than take 4 MiB). The decision depends on the page-rounded size alone, so
    /// every size between a request and the block it got maps to the same block.
    fn mapped_size(&self, bytes: usize) -> Option<(usize, bool)> {
        let pages = os::round_up(bytes, os::page_size())?;
        let huge_size = os::round_up(pages, os::HUGE_PAGE)?;
        let huge = self.huge_pages && pages >= os::HUGE_PAGE && huge_size - pages <= pages / 8;
        Some(if huge {
            (huge_size, true)
        } else {
            (pages, false)
        })
    }

    pub(crate) fn layout_bytes(&self, layout: Layout) -> Option<usize> {
        self.mapped_size(layout.size()).map(|(bytes, _)| bytes)
    }

    /// The NUMA node to place a new block on: the one asked for, else the current device's
    /// where the machine has several nodes; `None` to leave placement to the kernel.
    fn target_node(&self) -> Option<u32> {
        self.node.or_else(|| {
            (os::online_numa_nodes() > 1)
                .then(Device::current_numa_node)
                .flatten()
        })
    }

    /// Faults in and registers `ptr..ptr + bytes` in chunks of `chunk` bytes (see
    /// [`fault_and_register`]). On failure every chunk registered here is unregistered again;
    /// the flag with the error says whether that worked (if not, the mapping must be leaked,
    /// not unmapped).
    ///
    /// # Safety
    ///
    /// - `ptr..ptr + bytes` is a fresh mapping of ours, not yet in use; `chunk` is a multiple
    ///   of 2 MiB.
    unsafe fn register_chunked(
        &self,
        ptr: NonNull<u8>,
        bytes: usize,
        chunk: usize,
    ) -> Result<(), (Error, bool)> {
        // The crew leaves three cores where there are more than four: one for this thread,
        // which registers (and faults only what the crew has not reached), two for the rest
        // of the program, whose copies would otherwise wait for a time slice.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let helpers = self.prefault_threads.min(cores.saturating_sub(3)).max(1);
        let register = |offset: usize, len: usize| {
            // SAFETY: the chunk lies in the mapping, which stays until `deallocate` (or the
            // cleanup below) unregisters it.
            crate::context::on_current_device(|| unsafe {
                crate::raw::memory::host_register(ptr.add(offset), len, self.flags.bits())
            })
        };
        // SAFETY: forwarded from the caller.
        let registered = unsafe { fault_and_register(ptr, bytes, chunk, helpers, register) };
        registered.map_err(|(error, registered)| {
            let clean = (0..registered).fold(true, |clean, k| {
                // SAFETY: registered above, never handed out.
                clean
                    & crate::context::on_current_device(|| unsafe {
                        crate::raw::memory::host_unregister(ptr.add(k * chunk))
                    })
                    .is_ok()
            });
            (error, clean)
        })
    }
}

/// Faults `ptr..ptr + bytes` in on up to `helpers` threads besides this one, 2 MiB at a time
/// and in order, and calls `register(offset, len)` for each chunk of `chunk` bytes, in order,
/// as soon as all of it is faulted in, leaving a gap between calls. Stops at the first
/// error, returned with the number of chunks registered before it.
///
/// One function, a little long: the crew's closures share its locals.
///
/// # Safety
///
/// - `ptr..ptr + bytes` is a fresh writable mapping of ours that nobody else uses (the first
///   byte of each page becomes zero); `chunk` is a nonzero multiple of 2 MiB.
unsafe fn fault_and_register(
    ptr: NonNull<u8>,
    bytes: usize,
    chunk: usize,
    helpers: usize,
    mut register: impl FnMut(usize, usize) -> Result<()>,
) -> Result<(), (Error, usize)> {
    // Faulting is handed out in 2 MiB units, a huge page each where huge pages back the
    // range: two threads faulting one huge page would wait for each other.
    const UNIT: usize = os::HUGE_PAGE;
    debug_assert_eq!(chunk % UNIT, 0, "chunks are whole units");
    let (chunks, units) = (bytes.div_ceil(chunk), bytes.div_ceil(UNIT));
    let units_in = |k: usize| ((k + 1) * chunk).min(bytes).div_ceil(UNIT) - k * chunk / UNIT;
    let helpers = helpers.min(units);
    let next = AtomicUsize::new(0);
    // Units of each chunk faulted in so far.
    let faulted: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
    let (progress, wake) = (Mutex::new(()), Condvar::new());
    let stop = AtomicBool::new(false);
    let base = os::Base(ptr);
    // Faults in a claimed unit and counts it.
    let fault = |unit: usize| {
        let (offset, k) = (unit * UNIT, unit * UNIT / chunk);
        // Writing pages does not unwind; should it ever, the unit is left to registration,
        // which faults missing pages itself, rather than leave registered chunks behind.
        let touched = std::panic::catch_unwind(|| {
            // SAFETY: unit `unit` lies inside the fresh mapping, and it is ours alone:
            // every unit is claimed once.
            unsafe { os::touch_pages(base.at(offset), UNIT.min(bytes - offset)) }
        });
        // A payload may panic when dropped: leaked.
        std::mem::forget(touched);
        if faulted[k].fetch_add(1, Ordering::Release) + 1 == units_in(k) {
            let _guard = progress.lock().unwrap_or_else(PoisonError::into_inner);
            wake.notify_all();
        }
    };
    // A helper's loop: claims units in order until none is left.
    let fault_all = || loop {
        let unit = next.fetch_add(1, Ordering::Relaxed);
        if unit >= units || stop.load(Ordering::Relaxed) {
            return;
        }
        fault(unit);
    };
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            if os::spawn(scope, fault_all).is_err() {
                break;
            }
        }
        // The crew stops however this thread leaves, an unwinding `register` included.
        let _stop_crew = StopOnDrop(&stop);
        let mut registered = 0;
        let mut released: Option<Instant> = None;
        let result = (|| {
            for (k, done) in faulted.iter().enumerate() {
                // Units of chunk k not yet claimed are faulted here (all of them if no
                // helper could start); then wait for the ones the crew has in hand.
                let end = ((k + 1) * chunk).min(bytes).div_ceil(UNIT);
                while let Ok(unit) = next.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    (n < end).then_some(n + 1)
                }) {
                    fault(unit);
                }
                wait_for_crew(
                    || done.load(Ordering::Acquire) >= units_in(k),
                    &progress,
                    &wake,
                );
                leave_the_gap(released);
                let start = k * chunk;
                let len = chunk.min(bytes - start);
                register(start, len)?;
                released = Some(Instant::now());
                registered += 1;
            }
            Ok(())
        })();
        result.map_err(|e| (e, registered))
    })
}

/// Waits until `ready`, spinning for a while before sleeping on `wake`: the crew is usually
/// close, and a wake-up costs more than the wait.
fn wait_for_crew(ready: impl Fn() -> bool, progress: &Mutex<()>, wake: &Condvar) {
    let spin = Instant::now();
    while !ready() {
        if spin.elapsed() > CREW_SPIN {
            let guard = progress.lock().unwrap_or_else(PoisonError::into_inner);
            drop(
                wake.wait_while(guard, |()| !ready())
                    .unwrap_or_else(PoisonError::into_inner),
            );
        }
        std::hint::spin_loop();
    }
}

/// Leaves the driver's lock free for the gap after the registration `released` ended (the
/// wait for the crew may have done so already): released and taken again at once, it would
/// stay with this thread. Sleeping, not spinning, leaves this core to a woken waiter.
fn leave_the_gap(released: Option<Instant>) {
    while released.is_some_and(|t| t.elapsed() < REGISTRATION_GAP) {
        std::thread::sleep(REGISTRATION_PAUSE);
    }
}

/// Raises its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

// SAFETY: the memory is a fresh private mapping of `bytes` ≥ the request, page-aligned (2 MiB
// with huge pages), registered (page-locked) before it is handed out — in one piece, or in
// chunks recorded with the chunk layout so that every copy the crate queues stays inside one
// registration — and unregistered and unmapped only in `deallocate`.
unsafe impl PinnedAllocator for Registered {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        check_layout(layout)?;
        let (bytes, huge) = self
            .mapped_size(layout.size())
            .ok_or(Error::CapacityOverflow)?;
        // CUDA is asked for first: without it, mapping and faulting the memory would cost
        // seconds and gigabytes before the registration could fail.
        crate::raw::device::current_device()?;
        let ptr = os::map(bytes, huge)?;
        if let Some(node) = self.target_node() {
            // SAFETY: our fresh mapping, not touched yet.
            let placed = unsafe { os::prefer_node(ptr, bytes, node) };
            // The nearest node is advice; a node asked for by name must exist.
            if let (Err(error), Some(_)) = (placed, self.node) {
                // SAFETY: not handed out; nobody uses it.
                unsafe { os::unmap(ptr, bytes) };
                return Err(error);
            }
        }
        let registered = match self.chunk_bytes {
            Some(chunk) if bytes > chunk => {
                // SAFETY: a fresh mapping of `bytes` bytes, not yet shared; `chunk` is rounded
                // to 2 MiB by `register_in_chunks`.
                unsafe { self.register_chunked(ptr, bytes, chunk) }
                    .map(|()| crate::memory::chunks::insert(ptr.as_ptr() as usize, bytes, chunk))
            }
            _ => {
                // SAFETY: a fresh mapping of `bytes` bytes, not yet shared.
                unsafe { os::prefault(ptr, bytes, self.prefault_threads) };
                // SAFETY: the mapping stays until `deallocate` unregisters it first.
                crate::context::on_current_device(|| unsafe {
                    crate::raw::memory::host_register(ptr, bytes, self.flags.bits())
                })
                .map_err(|error| (error, true))
            }
        };
        if let Err((error, clean)) = registered {
            if clean {
                // SAFETY: nothing of it is registered any more, and it was never handed out.
                unsafe { os::unmap(ptr, bytes) };
            }
            // Otherwise the driver may still hold pages of it: the mapping is leaked.
            return Err(error);
        }
        Ok(Allocation::new(ptr, bytes, MemoryKind::Registered, 0))
    }

    fn numa_nodes(&self) -> usize {
        if os::online_numa_nodes() > 1 {
            os::numa_node_bound()
        } else {
            1
        }
    }

    fn numa_node(&self) -> usize {
        let node = if os::online_numa_nodes() > 1 {
            self.target_node().map_or(0, |node| node as usize)
        } else {
            0
        };
        node.min(self.numa_nodes() - 1)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        let ptr = allocation.ptr();
        let unregistered = match crate::memory::chunks::remove(ptr.as_ptr() as usize) {
            Some((bytes, chunk)) => (0..bytes).step_by(chunk).fold(true, |ok, offset| {
                // SAFETY: chunk by chunk as registered by `allocate`; no device work uses the
                // block, per the caller.
                ok & crate::context::on_current_device(|| unsafe {
                    crate::raw::memory::host_unregister(ptr.add(offset))
                })
                .is_ok()
            }),
            // SAFETY: registered in one piece by `allocate`; unused, per the caller.
            None => crate::context::on_current_device(|| unsafe {
                crate::raw::memory::host_unregister(ptr)
            })
            .is_ok(),
        };
        if unregistered {
            // SAFETY: our mapping of exactly `bytes` bytes, now unregistered and unused.
            unsafe { os::unmap(ptr, allocation.bytes()) };
        }
        // If unregistering failed the driver may still consider the pages pinned; leaking
        // the mapping is the safe choice.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// Whether every page of `ptr + offset .. + len` is resident (always true under Miri,
    /// which has no `mincore`).
    fn resident(ptr: NonNull<u8>, offset: usize, len: usize) -> bool {
        // SAFETY: `offset` lies in the caller's mapping.
        cfg!(miri) || os::resident(unsafe { ptr.add(offset) }, len)
    }

    #[test]
    fn every_chunk_is_registered_once_in_order_after_it_is_faulted_in() {
        let page = os::page_size();
        // (bytes, chunk, helpers): a partial last unit and chunk, no helper at all, more
        // helpers than units, one chunk.
        let cases: &[(usize, usize, usize)] = if cfg!(miri) {
            &[(5 * MIB + 3 * page, 2 * MIB, 2)]
        } else {
            &[
                (5 * MIB + 3 * page, 2 * MIB, 0),
                (5 * MIB + 3 * page, 2 * MIB, 3),
                (64 * MIB, 6 * MIB, 2),
                (7 * MIB, 4 * MIB, 16),
                (page, 2 * MIB, 1),
            ]
        };
        for &(bytes, chunk, helpers) in cases {
            let ptr = os::map(bytes, false).unwrap();
            let mut calls = Vec::new();
            // SAFETY: a fresh mapping of `bytes`, used by nobody else; 2 MiB chunk multiples.
            let result = unsafe {
                fault_and_register(ptr, bytes, chunk, helpers, |offset, len| {
                    assert!(
                        resident(ptr, offset, len),
                        "{offset} + {len} not faulted in"
                    );
                    calls.push((offset, len));
                    Ok(())
                })
            };
            assert!(result.is_ok());
            let expected: Vec<_> = (0..bytes)
                .step_by(chunk)
                .map(|offset| (offset, chunk.min(bytes - offset)))
                .collect();
            assert_eq!(calls, expected, "{bytes} bytes in {chunk}-byte chunks");
            // SAFETY: ours, and nothing uses it any more.
            unsafe { os::unmap(ptr, bytes) };
        }
    }

    #[test]
    fn registration_stops_at_the_first_error_and_says_how_far_it_got() {
        let bytes = if cfg!(miri) { 6 * MIB } else { 32 * MIB };
        let ptr = os::map(bytes, false).unwrap();
        let mut calls = 0;
        // SAFETY: a fresh mapping of `bytes`, used by nobody else; 2 MiB chunks.
        let result = unsafe {
            fault_and_register(ptr, bytes, 2 * MIB, 2, |_, _| {
                calls += 1;
                if calls == 3 {
                    Err(Error::Unsupported("refused"))
                } else {
                    Ok(())
                }
            })
        };
        assert!(matches!(result, Err((Error::Unsupported("refused"), 2))));
        assert_eq!(calls, 3, "nothing is registered after the error");
        // SAFETY: ours; the helpers were joined before the call returned.
        unsafe { os::unmap(ptr, bytes) };
    }

    #[test]
    fn a_registration_that_unwinds_stops_the_crew() {
        // One helper would take a tenth of a second or more to fault the range; the unwind
        // takes microseconds, and the helper stops after its unit in hand.
        let bytes = if cfg!(miri) { 8 * MIB } else { 1024 * MIB };
        let ptr = os::map(bytes, false).unwrap();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: a fresh mapping of `bytes`, used by nobody else; 2 MiB chunks.
            unsafe {
                fault_and_register(ptr, bytes, 2 * MIB, 1, |_, _| {
                    // Unwinds without the panic hook, whose message (and backtrace, where
                    // one is asked for) could take longer than the crew's whole range.
                    std::panic::resume_unwind(Box::new("a registration that unwinds"))
                })
            }
        }));
        assert!(unwound.is_err());
        // SAFETY: the last MiB of the mapping.
        let tail = unsafe { ptr.add(bytes - MIB) };
        assert!(
            cfg!(miri) || !os::resident(tail, MIB),
            "the crew went on faulting after the registering thread unwound"
        );
        // SAFETY: ours; the helper was joined before the unwind left the call.
        unsafe { os::unmap(ptr, bytes) };
    }

    #[test]
    fn huge_pages_only_where_rounding_is_cheap() {
        let r = Registered::new();
        let mib = 1 << 20;
        assert_eq!(r.mapped_size(3 * mib), Some((3 * mib, false)));
        assert_eq!(r.mapped_size(320 * mib - 5), Some((320 * mib, true)));
        assert_eq!(r.mapped_size(17 * mib), Some((18 * mib, true)));
        assert_eq!(r.mapped_size(1), Some((os::page_size(), false)));
        assert_eq!(
            r.huge_pages(false).mapped_size(320 * mib),
            Some((320 * mib, false))
        );
        // Every size between a request and its block maps to the same block.
        for request in [2 * mib - 100, 15 * mib + 1, 16 * mib - 4097, 100 * mib + 3] {
            let (block, _) = r.mapped_size(request).unwrap();
            for size in [request, request + 1, block - 1, block] {
                assert_eq!(r.mapped_size(size).unwrap().0, block, "{request} / {size}");
            }
        }
    }
}
