//! Pinning ahead of need, as the pool's callers ask it (the thread is `pinner`).

use std::sync::atomic::Ordering;

use cuda_pinned::{Error, PinnedAllocator, Result};

use super::Pool;
use super::central::Ready;
use crate::completion::Completion;
use crate::pinner::Reserve;
use crate::size_class::{class_of, class_size};

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// Keeps `blocks` blocks of `block_bytes` pinned ahead of need, on a thread of the pool's own.
    ///
    /// This is PyTorch's `pinned_reserve_segment_size_mb`, per size class (`block_bytes` is rounded
    /// up to its class). A thread of the pool's own pins them in the background and pins another
    /// each time an allocation takes one, so an allocation that finds its class empty (and no block
    /// whose device work has finished) takes a ready block instead of waiting for the driver. Call
    /// it again to change the count: ready blocks past it are released (0 releases them all). The
    /// thread starts on the first call, with that caller's current device (so memory is placed near
    /// it), and is stopped and joined when the pool drops; on a machine with several NUMA nodes its
    /// blocks serve allocations on that device's node only, whichever thread calls later. Blocks
    /// pinned ahead count against `max_pinned_bytes`, are released with the pool, and not by
    /// [`empty_cache`](Self::empty_cache). They enter `allocations` and `allocated_bytes` when an
    /// allocation takes them; until then they are
    /// [`PoolStats::reserve_ready_bytes`](crate::PoolStats::reserve_ready_bytes).
    ///
    /// Errors the thread meets (the backend's, or the pinned cap) stop it pinning that class
    /// until the next call or the next block taken; they are counted in
    /// [`PoolStats::reserve_failures`](crate::PoolStats::reserve_failures) and the first is kept for
    /// [`take_reserve_error`](Self::take_reserve_error).
    ///
    /// ```
    /// use cuda_pinned::HostLocked;
    /// use pinned_pool::{Pool, PoolConfig};
    ///
    /// let pool = Pool::with_backend(HostLocked, PoolConfig::new());
    /// pool.reserve(1 << 20, 4)?; // four 1 MiB blocks, pinned in the background
    /// let batch = pool.with_capacity(1 << 20)?; // a ready block once the thread got to it
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for blocks of 0 bytes; [`Error::CapacityOverflow`] above the
    /// largest class, or for more blocks than memory can be counted in;
    /// [`Error::LimitExceeded`] when the blocks together pass
    /// [`PoolConfig::max_pinned_bytes`](crate::PoolConfig::max_pinned_bytes), or the machine's memory where no cap is set;
    /// [`Error::Os`] when the thread cannot be started.
    pub fn reserve(&self, block_bytes: usize, blocks: usize) -> Result<()>
    where
        B: Clone + Send + 'static,
    {
        if block_bytes == 0 {
            return Err(Error::Unsupported("a reserve of blocks of 0 bytes"));
        }
        let (class, _) = class_of(block_bytes).ok_or(Error::CapacityOverflow)?;
        let total = class_size(class)
            .checked_mul(blocks)
            .ok_or(Error::CapacityOverflow)?;
        let limit = self.config.max_pinned_bytes.unwrap_or_else(physical_memory);
        if total > limit {
            return Err(Error::LimitExceeded {
                requested: total,
                pinned: self.reserved.load(Ordering::Relaxed),
                limit,
            });
        }
        let ahead = match self.ahead.get() {
            Some(ahead) => ahead,
            None => {
                let starting = self.starting.lock();
                if self.ahead.get().is_none() {
                    let started = Reserve::start(
                        self.backend.clone(),
                        self.nodes,
                        self.reserved.clone(),
                        self.config.max_pinned_bytes,
                        (self.watch.memory.clone(), self.config.keep_available_ppm),
                        self.blocks.clone(),
                        self.central.clone(),
                    )
                    .map_err(|source| Error::Os {
                        call: "pthread_create",
                        source,
                    })?;
                    let _ = self.ahead.set(started);
                }
                drop(starting);
                self.ahead.get().expect("set above")
            }
        };
        let class = class + ahead.slot_base;
        let excess = ahead.set_target(&mut self.central.lock().ahead, class, blocks);
        for ready in excess {
            self.release_ahead(ready);
        }
        Ok(())
    }

    /// Gives a block pinned ahead and never handed out back to the backend.
    pub(super) fn release_ahead(&self, (handed, _): Ready) {
        let Some((block, slot)) = self.blocks.lock().remove(&(handed.ptr().as_ptr() as usize))
        else {
            return;
        };
        self.reserved.fetch_sub(class_size(slot), Ordering::Relaxed);
        // SAFETY: pinned ahead from the backend, never handed out, and out of the map now.
        unsafe { self.backend.deallocate(block) };
    }

    /// Starts the reserve that the pool's configuration asks for.
    ///
    /// Starts what the configuration asks to keep pinned ahead ([`PoolConfig::reserve`](crate::PoolConfig::reserve)), as
    /// [`reserve`](Self::reserve) would for each size. A failure to start (a size above the
    /// largest class, no thread to be had) is kept for
    /// [`take_reserve_error`](Self::take_reserve_error).
    pub fn start_configured_reserve(&self)
    where
        B: Clone + Send + 'static,
    {
        for &(block_bytes, blocks) in &self.config.reserve {
            if let Err(error) = self.reserve(block_bytes, blocks) {
                self.reserve_start_error.lock().get_or_insert(error);
            }
        }
    }

    /// The first error the reserve thread met since the last call, if any.
    ///
    /// See [`reserve`](Self::reserve). The error may also say why the configured reserve could not
    /// start; `None` when there was none.
    pub fn take_reserve_error(&self) -> Option<Error> {
        let start_error = self.reserve_start_error.lock().take();
        start_error.or_else(|| self.central.lock().ahead.take_error())
    }
}

/// The machine's memory in bytes (`usize::MAX` where it cannot be told): more than this can
/// never be pinned ahead.
fn physical_memory() -> usize {
    if cfg!(miri) {
        // Miri does not know this `sysconf` name.
        return usize::MAX;
    }
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (usize::try_from(pages), usize::try_from(page)) {
        (Ok(pages), Ok(page)) if pages > 0 && page > 0 => pages.saturating_mul(page),
        _ => usize::MAX,
    }
}
