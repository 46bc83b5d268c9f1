//! Kind 2: memory this crate maps itself, backs with huge pages, pre-faults in parallel and
//! registers with `cudaHostRegister` — the fast cold path.

use std::alloc::Layout;
use std::fmt;
use std::ops::BitOr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};

use cuda_pinned_sys as sys;

use crate::alloc::{Allocation, MemoryKind, PinnedAllocator, check_layout};
use crate::error::{Error, Result};
use crate::{Device, chunked, ffi, os};

/// Flags of `cudaHostRegister`. The default is [`PORTABLE`](Self::PORTABLE).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterFlags(u32);

impl RegisterFlags {
    /// Pinned for every CUDA context (the default).
    pub const PORTABLE: Self = Self(sys::cudaHostRegisterPortable);
    /// Also mapped into the device address space.
    pub const MAPPED: Self = Self(sys::cudaHostRegisterMapped);
    /// The device only reads the memory (needed for read-only host mappings).
    pub const READ_ONLY: Self = Self(sys::cudaHostRegisterReadOnly);
    /// No flag.
    pub const NONE: Self = Self(sys::cudaHostRegisterDefault);

    /// The raw flag word.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl Default for RegisterFlags {
    fn default() -> Self {
        Self::PORTABLE
    }
}

impl BitOr for RegisterFlags {
    type Output = Self;
    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

/// The pause between the registrations of two chunks (see `register_chunked`).
const REGISTRATION_GAP: std::time::Duration = std::time::Duration::from_micros(50);

/// Page-locked memory obtained the fast way: an anonymous `mmap`, `MADV_HUGEPAGE` for sizes
/// of 2 MiB and more, every page faulted in by several threads, then one `cudaHostRegister`.
///
/// On an H100 host this pins 1 GiB in about 50 ms, against 0.4–0.7 s for `cudaHostAlloc`.
/// Registration holds the driver's lock for its whole range (25–30 ms for 1 GiB), and other
/// threads' copies wait that long; [`register_in_chunks`](Self::register_in_chunks) bounds
/// that wait and overlaps faulting with registering. Needs CUDA and a device that supports
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

    /// Threads that fault pages in before registration (at least 1).
    pub fn prefault_threads(self, threads: usize) -> Self {
        Self {
            prefault_threads: threads.max(1),
            ..self
        }
    }

    /// Places the pages on this NUMA node (`mbind`, preferred: another node when it is full)
    /// instead of the current device's. Allocation fails if the kernel refuses: a node the
    /// machine does not have, a kernel without NUMA support, or a sandbox that forbids
    /// `mbind`.
    pub fn node(self, node: u32) -> Self {
        Self {
            node: Some(node),
            ..self
        }
    }

    /// Registers blocks larger than `bytes` (rounded up to 2 MiB) as consecutive chunks of
    /// that size: the threads fault in the next chunk while the previous one registers, and
    /// the driver's lock is taken for one chunk at a time, with a 50 µs pause between chunks
    /// so that other threads' copies get their turn. Measured on an H100 host while 1 GiB
    /// was pinned: 16 MiB chunks kept another thread's copy under 1 ms (0.6–0.7 ms) but took
    /// 57–61 ms; 32 MiB chunks, 1.3–1.4 ms and 50–52 ms; one registration, 20 ms and 48 ms.
    ///
    /// Copies queued through this crate split at the chunk boundaries (one buffer, one
    /// [`Transfer`](crate::Transfer)). A copy queued by other code must stay within one
    /// chunk, since CUDA refuses a copy that spans two registrations: a raw pointer handed
    /// to another library, and cudarc's `memcpy_htod` / `memcpy_dtoh` given the buffer
    /// (use `CudarcCopies`, which splits, instead). `0` turns chunking off (the default).
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

    /// Faults in and registers `ptr..ptr + bytes` in chunks of `chunk` bytes, the crew of
    /// threads faulting chunk k + 1 while this thread registers chunk k. On failure every
    /// chunk registered here is unregistered again; the flag with the error says whether
    /// that worked (if not, the mapping must be leaked, not unmapped).
    ///
    /// # Safety
    ///
    /// - `ptr..ptr + bytes` is a fresh mapping of ours, not yet in use; with `huge`, it and
    ///   `bytes` are multiples of the huge page.
    unsafe fn register_chunked(
        &self,
        ptr: NonNull<u8>,
        bytes: usize,
        chunk: usize,
        huge: bool,
    ) -> Result<(), (Error, bool)> {
        let chunks = bytes.div_ceil(chunk);
        // Two cores stay free: one for this thread's registrations, one for the rest of the
        // program, whose copies would otherwise wait for a time slice.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Threads split chunks at whole huge pages: two threads faulting one huge page wait
        // for each other. A chunk of fewer pages than threads would leave some idle.
        let page = if huge { os::HUGE_PAGE } else { os::page_size() };
        let crew = self
            .prefault_threads
            .min(cores.saturating_sub(2))
            .min(chunk / page)
            .max(1);
        // Slices of each chunk that the crew has faulted in.
        let faulted: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
        let (progress, wake) = (Mutex::new(()), Condvar::new());
        let stop = AtomicBool::new(false);
        let base = os::Base(ptr);
        let slice_of = |k: usize, t: usize| {
            let (start, end) = (k * chunk, ((k + 1) * chunk).min(bytes));
            let pages = (end - start) / page;
            let (first, last) = (pages * t / crew, pages * (t + 1) / crew);
            (start + first * page, (last - first) * page)
        };
        let notify = || {
            let _guard = progress.lock().unwrap_or_else(PoisonError::into_inner);
            wake.notify_all();
        };
        let fault = |t: usize| {
            let mut k = 0;
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                while k < chunks && !stop.load(Ordering::Relaxed) {
                    let (offset, len) = slice_of(k, t);
                    // SAFETY: a slice of chunk k, inside the fresh mapping; slices are
                    // disjoint.
                    unsafe { os::touch_pages(base.at(offset), len) };
                    faulted[k].fetch_add(1, Ordering::Release);
                    notify();
                    k += 1;
                }
            }));
            if let Err(panic) = outcome {
                // The slices left count as done (registration faults missing pages itself),
                // so the registering thread is not left waiting for this one.
                stop.store(true, Ordering::Relaxed);
                for done in &faulted[k..] {
                    done.fetch_add(1, Ordering::Release);
                }
                notify();
                std::panic::resume_unwind(panic);
            }
        };
        let registered = std::thread::scope(|scope| {
            let mut helpers = 0;
            for t in 1..crew {
                if os::spawn(scope, move || fault(t)).is_ok() {
                    helpers += 1;
                } else {
                    break;
                }
            }
            // Slices whose thread could not start are faulted here, chunk by chunk, before
            // each registration.
            let mut registered = 0;
            let result = (|| {
                for (k, done) in faulted.iter().enumerate() {
                    for t in helpers + 1..crew {
                        let (offset, len) = slice_of(k, t);
                        // SAFETY: as in `fault`; nobody else has this slice.
                        unsafe { os::touch_pages(base.at(offset), len) };
                    }
                    let (offset, len) = slice_of(k, 0);
                    // SAFETY: as above; slice 0 is this thread's.
                    unsafe { os::touch_pages(base.at(offset), len) };
                    let guard = progress.lock().unwrap_or_else(PoisonError::into_inner);
                    drop(
                        wake.wait_while(guard, |()| done.load(Ordering::Acquire) < helpers)
                            .unwrap_or_else(PoisonError::into_inner),
                    );
                    let start = k * chunk;
                    let len = chunk.min(bytes - start);
                    // SAFETY: chunk k lies in the mapping, which stays until `deallocate`
                    // (or the cleanup below) unregisters it.
                    unsafe { ffi::host_register(ptr.add(start), len, self.flags.bits())? };
                    registered += 1;
                    if registered < chunks {
                        // A pause between registrations lets threads waiting for the driver's
                        // lock take it: released and taken again at once, it stays here.
                        std::thread::sleep(REGISTRATION_GAP);
                    }
                }
                Ok(())
            })();
            stop.store(true, Ordering::Relaxed);
            result.map_err(|e| (e, registered))
        });
        registered.map_err(|(error, registered)| {
            let clean = (0..registered).fold(true, |clean, k| {
                // SAFETY: registered above, never handed out.
                clean & unsafe { ffi::host_unregister(ptr.add(k * chunk)) }.is_ok()
            });
            (error, clean)
        })
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
                // SAFETY: a fresh mapping of `bytes` bytes, not yet shared, huge-page aligned
                // and sized when `huge` (`os::map` and `mapped_size`).
                unsafe { self.register_chunked(ptr, bytes, chunk, huge) }
                    .map(|()| chunked::insert(ptr.as_ptr() as usize, bytes, chunk))
            }
            _ => {
                // SAFETY: a fresh mapping of `bytes` bytes, not yet shared.
                unsafe { os::prefault(ptr, bytes, self.prefault_threads) };
                // SAFETY: the mapping stays until `deallocate` unregisters it first.
                unsafe { ffi::host_register(ptr, bytes, self.flags.bits()) }
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
        let unregistered = match chunked::remove(ptr.as_ptr() as usize) {
            Some((bytes, chunk)) => (0..bytes).step_by(chunk).fold(true, |ok, offset| {
                // SAFETY: chunk by chunk as registered by `allocate`; no device work uses the
                // block, per the caller.
                ok & unsafe { ffi::host_unregister(ptr.add(offset)) }.is_ok()
            }),
            // SAFETY: registered in one piece by `allocate`; unused, per the caller.
            None => unsafe { ffi::host_unregister(ptr) }.is_ok(),
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
