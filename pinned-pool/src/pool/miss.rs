//! The slow path: a thread's cache is empty or full.

use std::alloc::Layout;
use std::ptr;
use std::sync::atomic::Ordering;
use std::time::Instant;

use cuda_pinned::{Allocation, Error, PinnedAllocator, Result};

use super::Pool;
use super::central::Ready;
use super::central::{Central, Paused, raise};
use crate::completion::Completion;
use crate::local::{Amount, Cached, Local, LocalData};
use crate::pinner::Reserve;
use crate::size_class::PAGE;

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// This thread's stack when its cache was paused or the ceiling was reached, then the
    /// shared lists, then finished pending blocks, then every thread's stack, then new memory.
    ///
    /// Returns the block as a [`Cached`] so that the caller builds the [`Allocation`] from
    /// its parts on either path: a whole `Allocation` written here and copied there would
    /// stall the fast path on store forwarding.
    #[cold]
    pub(super) fn allocate_slow(
        &self,
        local: Option<&Local>,
        class: usize,
        size: usize,
    ) -> Result<Cached> {
        let Some(local) = local else {
            // Several threads may use the shared cache: a wish there would not be one
            // thread's, so it makes none.
            return self.find_or_pin(&self.shared, class, size);
        };
        local.want(size);
        // Withdraws the wish however the search ends (an unwinding backend included), so that
        // no pauser counts a block this thread never took.
        let _withdrawn = Withdraw(local);
        self.find_or_pin(local, class, size)
    }

    /// The search of [`allocate_slow`](Self::allocate_slow), while this thread's wish for a
    /// block is visible to pausers. `local` is this thread's cache or the shared one, used
    /// only under the lock.
    pub(super) fn find_or_pin(&self, local: &Local, class: usize, size: usize) -> Result<Cached> {
        // With no block pending and none released by age, nothing could come before a block
        // pinned ahead but the lists: one hold of the lock looks at both, so that an
        // allocation the reserve covers costs a hit and the adoption.
        let ahead = self
            .ahead
            .get()
            .filter(|_| self.config.idle_release.is_none());
        let listed = self.depot_adds.load(Ordering::Relaxed);
        if let Some(cached) = self.take_listed(local, class, size, ahead) {
            return Ok(cached);
        }
        self.process_events();
        if self.config.idle_release.is_some() {
            self.release_idle();
        }
        if let Some(ahead) = self.ahead.get() {
            // Blocks that reached the shared lists meanwhile (device work just finished, or
            // another thread's spill) come first, then one pinned ahead (counted against the
            // cap already): neither pauses anyone.
            if self.depot_adds.load(Ordering::Relaxed) != listed
                && let Some(cached) = self.take_listed(local, class, size, None)
            {
                return Ok(cached);
            }
            let mut central = self.central.lock();
            if let Some(ready) = ahead.take(&mut central.ahead, class) {
                // SAFETY: this thread owns `local`, is outside `enter` and holds the lock.
                let data = unsafe { self.own(local) };
                let allocation = self.count_adopted(&mut central, local, data, ready, size);
                return Ok(Cached::new(&allocation, None));
            }
        }
        {
            let mut central = self.central.lock();
            let paused = self.pause_all(&mut central);
            let cached = central.depot[class].pop().or_else(|| {
                self.caches()
                    .filter(|other| !ptr::eq(*other, local))
                    .find_map(|other| {
                        // SAFETY: every cache is paused and the lock is held; `other` is not
                        // this thread's, whose data is not borrowed yet.
                        unsafe { other.data() }.magazine[class].pop()
                    })
            });
            if let Some(cached) = cached {
                // SAFETY: this thread owns `local`, holds the lock and has paused every cache
                // (its own included, which the guard resumes).
                let data = unsafe { local.data() };
                self.hand_out(&mut central, local, data, size, true, Some(&paused));
                drop(paused);
                drop(central);
                self.cache_shrank(size);
                return Ok(cached);
            }
        }
        let block = self.pin_from_backend(size)?;
        let allocation = self.adopt(local, block, class, size);
        Ok(Cached::new(&allocation, None))
    }

    /// A block of `class` from this thread's stack (when its cache was paused or the ceiling
    /// was reached) or the shared lists, else, if no block is pending, one that `ahead`
    /// pinned; handed out under the lock.
    pub(super) fn take_listed(
        &self,
        local: &Local,
        class: usize,
        size: usize,
        ahead: Option<&Reserve>,
    ) -> Option<Cached> {
        let mut central = self.central.lock();
        // SAFETY: this thread owns `local`, is outside `enter` and holds the lock.
        let data = unsafe { self.own(local) };
        if let Some(cached) = data.magazine[class]
            .pop()
            .or_else(|| central.refill(data, class, size))
        {
            self.hand_out(&mut central, local, data, size, true, None);
            drop(central);
            self.cache_shrank(size);
            return Some(cached);
        }
        // The pending count rises before a block is listed as pending: zero means no block
        // could reach the lists by finishing its device work first.
        let ready = ahead
            .filter(|_| self.pending_requests.load(Ordering::Relaxed) == 0)?
            .take(&mut central.ahead, class)?;
        let allocation = self.count_adopted(&mut central, local, data, ready, size);
        Some(Cached::new(&allocation, None))
    }

    /// This thread's cache data under the lock, let out of its initial pause.
    ///
    /// # Safety
    ///
    /// As [`Local::data`] for the owning thread: `local` is this thread's (or the shared
    /// cache, which no thread enters), the caller holds the lock, is outside `enter`, and
    /// holds no other reference to the data.
    #[allow(clippy::mut_from_ref, reason = "exclusivity comes from the lock")]
    pub(super) unsafe fn own<'a>(&self, local: &'a Local) -> &'a mut LocalData {
        // A cache starts paused (see `Local::new`); under the lock no pause is running.
        local.resume();
        // SAFETY: forwarded from the caller.
        unsafe { local.data() }
    }

    /// Counts a block of `size` handed out by this thread, first making room for it under
    /// the thread's ceiling.
    pub(super) fn hand_out(
        &self,
        central: &mut Central,
        local: &Local,
        data: &mut LocalData,
        size: usize,
        hit: bool,
        paused: Option<&Paused<'_, B, C>>,
    ) {
        self.make_room(central, local, data, size, paused);
        local.count_handed(size, hit);
        // The wish is fulfilled: withdrawn under the lock, so that no pauser counts this
        // block both as handed out and as wanted.
        local.want(0);
    }

    /// Raises `local`'s ceiling to fit one more block of `size`, keeping the peaks exact.
    ///
    /// The sum of all ceilings stays within the peak. While the other threads' ceilings leave
    /// room under the peak, this thread takes some. Otherwise only the exact total can tell
    /// whether this allocation makes a new peak: every cache is paused and the total summed,
    /// counting the blocks that threads waiting for the lock are about to take as taken (their
    /// allocations are under way, so the total is one the pool passes through); the peak
    /// rises to it if it is higher, and is shared out again: to each thread what it holds and
    /// is about to take, then, while any is left, its usual headroom. (Should such a waiting
    /// allocation then fail, the peak has counted a block that was never handed out.)
    pub(super) fn make_room(
        &self,
        central: &mut Central,
        local: &Local,
        data: &mut LocalData,
        size: usize,
        paused: Option<&Paused<'_, B, C>>,
    ) {
        let active = local.active();
        let after = active + Amount::block(size);
        if after.within(local.ceiling()) {
            return;
        }
        let others = || self.caches().filter(|other| !ptr::eq(*other, local));
        // Room for as much again as this thread last needed, so that a loop of allocations
        // asks here a logarithmic number of times.
        let headroom = data.keep.max(Amount::block(size));
        // Other threads may be lowering their ceilings meanwhile: the sum can only be high.
        let room = central.peak - others().map(Local::ceiling).sum();
        let ceiling = if after.within(room) {
            (after + headroom).min(room)
        } else {
            let pause = match paused {
                Some(_) => None,
                None => Some(self.pause_all(central)),
            };
            let mut held = Vec::new();
            for other in others() {
                // SAFETY: every cache is paused and the lock is held; `other` is not this
                // thread's, whose data the caller holds.
                let theirs = unsafe { other.data() };
                held.push((other, other.active() + other.wanted(), theirs.keep));
            }
            let elsewhere: Amount = held.iter().map(|(_, amount, _)| *amount).sum();
            central.peak = central.peak.max(elsewhere + after);
            let mut spare = central.peak - elsewhere - after;
            let extra = headroom.min(spare);
            spare = spare - extra;
            for (other, amount, keep) in held {
                let extra = keep.min(spare);
                spare = spare - extra;
                other.set_ceiling(amount + extra);
            }
            drop(pause);
            after + extra
        };
        local.set_ceiling(ceiling);
        data.keep = data.keep.max(ceiling - active);
    }

    /// Pauses every thread cache: owners take the lock (held by the caller, as `_central`
    /// shows) instead of their lock-free path until the guard drops.
    pub(super) fn pause_all(&self, _central: &mut Central) -> Paused<'_, B, C> {
        let mine = self.locals.get();
        let mut others = false;
        for local in self.locals.iter() {
            local.pause();
            others |= !mine.is_some_and(|mine| ptr::eq(mine, local));
        }
        // The shared cache is only used under the lock: pausing it asks for no barrier.
        self.shared.pause();
        if others {
            self.barrier.heavy();
        }
        for local in self.locals.iter() {
            local.wait_idle();
        }
        Paused { pool: self }
    }

    /// Makes `block` (new, pinned for `class` and counted against the cap) one of the pool's
    /// blocks, and hands it out to `local`'s thread. No other lock is taken while the block
    /// map's is held.
    pub(super) fn adopt(
        &self,
        local: &Local,
        block: Allocation,
        class: usize,
        size: usize,
    ) -> Allocation {
        let ready = (
            Allocation::new(block.ptr(), size, block.kind(), class),
            block.bytes(),
        );
        self.blocks
            .lock()
            .insert(block.ptr().as_ptr() as usize, (block, class));
        let mut central = self.central.lock();
        // SAFETY: this thread owns `local` (the allocating thread's cache, or the shared one),
        // is outside `enter` and holds the lock.
        let data = unsafe { self.own(local) };
        self.count_adopted(&mut central, local, data, ready, size)
    }

    /// Counts a block in the block map but never handed out before as one of the pool's, and
    /// hands it out to `local`'s thread (whose data this is, under the lock). `ready` is the
    /// block as handed out, and the bytes the backend pinned.
    pub(super) fn count_adopted(
        &self,
        central: &mut Central,
        local: &Local,
        data: &mut LocalData,
        (handed, bytes): Ready,
        size: usize,
    ) -> Allocation {
        raise(&mut central.allocations, 1);
        raise(&mut central.allocated_bytes, bytes as u64);
        self.hand_out(central, local, data, size, false, None);
        handed
    }

    /// A new block of `size` from the backend, counted against the cap (retried once after
    /// releasing idle cache).
    pub(super) fn pin_from_backend(&self, size: usize) -> Result<Allocation> {
        let _span = tracing::debug_span!("pool miss", bytes = size).entered();
        self.relieve_pressure();
        self.check_memory(size)?;
        let layout = Layout::from_size_align(size, PAGE).map_err(|_| Error::CapacityOverflow)?;
        self.count_pinned(size)?;
        // Gives the count back if the backend fails, or unwinds.
        let reservation = Reservation { pool: self, size };
        let mut result = self.timed_backend_allocate(layout);
        if let Err(error) = &result
            && retryable(error)
        {
            self.empty_cache();
            result = self.timed_backend_allocate(layout);
        }
        let block = result?;
        std::mem::forget(reservation);
        Ok(block)
    }

    pub(super) fn timed_backend_allocate(&self, layout: Layout) -> Result<Allocation> {
        let start = Instant::now();
        let result = self.backend.allocate(layout);
        if result.is_ok() {
            self.central.lock().host_alloc_time.record(start.elapsed());
        }
        result
    }

    /// Counts `size` more reserved bytes, within `max_pinned_bytes`: over it, idle cache is
    /// released first.
    pub(super) fn count_pinned(&self, size: usize) -> Result<()> {
        let Some(limit) = self.config.max_pinned_bytes else {
            self.reserved.fetch_add(size, Ordering::Relaxed);
            return Ok(());
        };
        let mut trimmed = false;
        loop {
            let pinned = self.reserved.load(Ordering::Relaxed);
            let wanted = pinned.checked_add(size).ok_or(Error::CapacityOverflow)?;
            if wanted <= limit {
                if self
                    .reserved
                    .compare_exchange(pinned, wanted, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(());
                }
            } else if !trimmed {
                self.shed(|_| (wanted - limit) as u64);
                trimmed = true;
            } else {
                return Err(Error::LimitExceeded {
                    requested: size,
                    pinned,
                    limit,
                });
            }
        }
    }

    /// A free when this thread's cache was paused or its stack of the class is full.
    #[cold]
    pub(super) fn free_slow(
        &self,
        local: Option<&Local>,
        allocation: &Allocation,
        idle_since: Option<Instant>,
        class: usize,
        size: usize,
    ) {
        let local = local.unwrap_or(&self.shared);
        let mut central = self.central.lock();
        // SAFETY: this thread owns `local` (or it is the shared cache), is outside `enter`
        // and holds the lock.
        let data = unsafe { self.own(local) };
        if !local.give(data, allocation, idle_since, class, size) {
            // The stack is full: its older half and this block go to the shared lists.
            central.spill(data, class);
            central.depot[class].push(Cached::new(allocation, idle_since));
            self.depot_adds.fetch_add(1, Ordering::Relaxed);
            local.count_returned(data, size);
        }
    }

    /// Counts a block of `size` given back by this thread (`None`: by a thread without a
    /// cache of its own).
    pub(super) fn count_returned(&self, local: Option<&Local>, size: usize) {
        if let Some(local) = local
            && let Some(data) = local.enter(self.barrier)
        {
            local.count_returned(&data, size);
            return;
        }
        let local = local.unwrap_or(&self.shared);
        let _central = self.central.lock();
        // SAFETY: this thread owns `local` (or it is the shared cache), is outside `enter`
        // and holds the lock.
        local.count_returned(unsafe { self.own(local) }, size);
    }
}

/// Bytes reserved against `max_pinned_bytes` for a block being pinned; given back unless
/// forgotten once the block exists.
struct Reservation<'a, B: PinnedAllocator, C: Completion> {
    pool: &'a Pool<B, C>,
    size: usize,
}

impl<B: PinnedAllocator, C: Completion> Drop for Reservation<'_, B, C> {
    fn drop(&mut self) {
        self.pool.reserved.fetch_sub(self.size, Ordering::Relaxed);
    }
}

/// Withdraws a thread's wish for a block when dropped.
struct Withdraw<'a>(&'a Local);

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.0.want(0);
    }
}

/// Failures worth one more try after the idle cache is released: memory and limit errors.
fn retryable(error: &Error) -> bool {
    match error {
        Error::OutOfMemory { .. } | Error::MemlockLimit { .. } => true,
        Error::Cuda(e) => e.is_out_of_memory(),
        Error::Driver(e) => e.is_out_of_memory(),
        _ => false,
    }
}
