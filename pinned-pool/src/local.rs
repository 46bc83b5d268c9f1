//! One thread's cache in a pool: a short stack of idle blocks per size class and the thread's
//! share of the counters. Only its thread touches it, without a lock or an atomic
//! read-modify-write, except while the pool has paused every cache (see `Pool::pause_all`).

use std::cell::UnsafeCell;
use std::ops::{Add, Deref, DerefMut, Sub};
use std::ptr::NonNull;
use std::time::Instant;

use cuda_pinned::{Allocation, MemoryKind};

use crate::barrier::Barrier;
use crate::size_class::{class_size, slots};
use crate::sync::{AtomicBool, AtomicI64, AtomicU64, Ordering, spin};

/// An idle block of a class known from the list holding it and, when the pool releases idle
/// blocks, since when it has been idle. Smaller than an [`Allocation`], so the fast path
/// moves less.
#[derive(Debug)]
pub(crate) struct Cached {
    ptr: NonNull<u8>,
    kind: MemoryKind,
    pub(crate) idle_since: Option<Instant>,
}

// SAFETY: like `Allocation`, a description of memory that grants no access by itself.
unsafe impl Send for Cached {}

impl Cached {
    #[inline]
    pub(crate) fn new(allocation: &Allocation, idle_since: Option<Instant>) -> Self {
        Self {
            ptr: allocation.ptr(),
            kind: allocation.kind(),
            idle_since,
        }
    }

    /// The block as handed out: class size, slot (class on a NUMA node) as the tag.
    #[inline]
    pub(crate) fn into_allocation(self, class: usize) -> Allocation {
        Allocation::new(self.ptr, class_size(class), self.kind, class)
    }
}

/// Blocks and bytes. Signed: a thread that frees blocks other threads allocated counts below
/// zero, and only the sum over threads is the pool's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Amount {
    pub(crate) requests: i64,
    pub(crate) bytes: i64,
}

impl Amount {
    #[inline]
    pub(crate) fn block(bytes: usize) -> Self {
        Self {
            requests: 1,
            bytes: bytes as i64,
        }
    }

    /// Whether both parts are at most `other`'s.
    #[inline]
    pub(crate) fn within(self, other: Self) -> bool {
        self.requests <= other.requests && self.bytes <= other.bytes
    }

    #[inline]
    pub(crate) fn min(self, other: Self) -> Self {
        Self {
            requests: self.requests.min(other.requests),
            bytes: self.bytes.min(other.bytes),
        }
    }

    #[inline]
    pub(crate) fn max(self, other: Self) -> Self {
        Self {
            requests: self.requests.max(other.requests),
            bytes: self.bytes.max(other.bytes),
        }
    }
}

impl Add for Amount {
    type Output = Self;
    #[inline]
    fn add(self, other: Self) -> Self {
        Self {
            requests: self.requests + other.requests,
            bytes: self.bytes + other.bytes,
        }
    }
}

impl Sub for Amount {
    type Output = Self;
    #[inline]
    fn sub(self, other: Self) -> Self {
        Self {
            requests: self.requests - other.requests,
            bytes: self.bytes - other.bytes,
        }
    }
}

impl std::iter::Sum for Amount {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), Add::add)
    }
}

/// Most blocks of one class a thread keeps (more go to the pool's shared lists).
const MAGAZINE_BLOCKS: usize = 16;
/// Most bytes of one class a thread keeps, unless that is less than one block.
const MAGAZINE_BYTES: usize = 1 << 20;

/// Bytes of the idle blocks in `lists` (indexed by slot; slots between two nodes' classes
/// stay empty).
pub(crate) fn idle_bytes(lists: &[Vec<Cached>]) -> u64 {
    lists
        .iter()
        .enumerate()
        .filter(|(_, list)| !list.is_empty())
        .map(|(slot, list)| (list.len() * class_size(slot)) as u64)
        .sum()
}

/// Whether a thread's stack of `held` blocks of `size` bytes has room for one more.
#[inline]
pub(crate) fn magazine_has_room(held: usize, size: usize) -> bool {
    held == 0 || (held < MAGAZINE_BLOCKS && (held + 1) * size <= MAGAZINE_BYTES)
}

/// What a thread's cache holds.
#[derive(Debug)]
pub(crate) struct LocalData {
    /// Idle blocks by class, the most recently freed last.
    pub(crate) magazine: Box<[Vec<Cached>]>,
    /// How far above `active` a free leaves the ceiling: the most this thread has needed at
    /// once, so its next round of allocations does not have to ask again.
    pub(crate) keep: Amount,
}

/// What a thread's cache has counted. Only the thread using the cache writes them (inside
/// `enter`, or under the pool's lock), each with a plain load and store; any thread may read
/// them at any time, which is what makes the pool's approximate statistics free.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Blocks (and their bytes) handed out here less those given back here.
    active_requests: AtomicI64,
    active_bytes: AtomicI64,
    /// Blocks handed out here from a cache, and newly pinned ones.
    hits: AtomicU64,
    misses: AtomicU64,
    /// Their bytes. What was given back here is what was handed out less `active`, so a
    /// free updates no counter of its own.
    handed_bytes: AtomicU64,
}

/// A reading of one cache's counters.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counted {
    pub(crate) active: Amount,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) handed_bytes: u64,
}

/// Adds `by` to a counter only one thread writes at a time: a load and a store, no
/// read-modify-write.
#[inline]
fn bump_u64(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Ordering::Relaxed) + by, Ordering::Relaxed);
}

#[inline]
fn bump_i64(counter: &AtomicI64, by: i64) {
    counter.store(counter.load(Ordering::Relaxed) + by, Ordering::Relaxed);
}

/// One thread's cache, on cache lines of its own.
///
/// `ceiling` makes the pool-wide peaks exact without a shared counter: a thread may hand out
/// blocks without asking while its `active` stays within its ceiling, and the pool keeps the
/// sum of all ceilings within the recorded peak. So the true total, which is at most the sum
/// of ceilings, cannot pass the peak unseen; raising a ceiling past what the peak allows
/// takes the pool's lock, and a new peak is recorded only from an exact total (see
/// `Pool::make_room`).
#[repr(align(128))]
pub(crate) struct Local {
    /// The owner is inside `enter`.
    busy: AtomicBool,
    /// A pauser owns the data; the owner must take the pool's lock instead.
    paused: AtomicBool,
    ceiling_requests: AtomicI64,
    ceiling_bytes: AtomicI64,
    /// Bytes of the block the owner is waiting for the pool's lock to take, if any: a pause
    /// counts it as taken and grants it, so that threads waiting for room are not starved of
    /// it (which would keep them from ever being counted at a new peak).
    wanted_bytes: AtomicI64,
    counters: Counters,
    data: UnsafeCell<LocalData>,
}

// SAFETY: `data` is reached by the owning thread between `busy` stores that a pauser waits
// out, or under the pool's lock by the owner or by a pauser that has seen `busy` false after
// setting `paused` (see `enter` and `Pool::pause_all`); the allocations in it may move
// between threads.
unsafe impl Sync for Local {}

impl Local {
    /// A new cache, with a stack per slot of `nodes` NUMA nodes, starts paused: its first use
    /// takes the pool's lock, so a pauser that ran while it was being created can never race
    /// with it.
    pub(crate) fn new(nodes: usize) -> Self {
        Self {
            busy: AtomicBool::new(false),
            paused: AtomicBool::new(true),
            ceiling_requests: AtomicI64::new(0),
            ceiling_bytes: AtomicI64::new(0),
            wanted_bytes: AtomicI64::new(0),
            counters: Counters::default(),
            data: UnsafeCell::new(LocalData {
                magazine: (0..slots(nodes)).map(|_| Vec::new()).collect(),
                keep: Amount::default(),
            }),
        }
    }

    /// The owning thread's way in, with no lock: `None` while the cache is paused.
    #[inline]
    pub(crate) fn enter(&self, barrier: Barrier) -> Option<Entered<'_>> {
        self.busy.store(true, Ordering::Relaxed);
        // Pairs with the pauser's heavy barrier between its `paused` store and `busy` load:
        // either it sees `busy` and waits for this use to end, or this load sees `paused`.
        barrier.light();
        if self.paused.load(Ordering::Acquire) {
            self.busy.store(false, Ordering::Release);
            return None;
        }
        Some(Entered { local: self })
    }

    /// Stops the owner's lock-free use: the first half of a pause, before the heavy barrier.
    pub(crate) fn pause(&self) {
        self.paused.store(true, Ordering::Relaxed);
    }

    /// Waits until the owner has left `enter`: the second half, after the heavy barrier.
    pub(crate) fn wait_idle(&self) {
        let mut spins = 0u32;
        while self.busy.load(Ordering::Acquire) {
            spins = spins.saturating_add(1);
            spin(spins);
        }
    }

    /// Lets the owner back in (the pauser's writes happen before its next use).
    pub(crate) fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// The data, for a caller holding the pool's lock.
    ///
    /// # Safety
    ///
    /// The caller holds the pool's lock and either is the owning thread (outside `enter`) or
    /// has paused this cache and waited for it to be idle; and it holds no other reference
    /// to this data.
    #[allow(
        clippy::mut_from_ref,
        reason = "exclusivity comes from the lock and the pause"
    )]
    pub(crate) unsafe fn data(&self) -> &mut LocalData {
        // SAFETY: exclusive by the caller's contract.
        unsafe { &mut *self.data.get() }
    }

    /// The data, through exclusive access (no lock needed).
    pub(crate) fn data_mut(&mut self) -> &mut LocalData {
        self.data.get_mut()
    }

    /// Blocks and bytes handed out here less those given back here.
    #[inline]
    pub(crate) fn active(&self) -> Amount {
        Amount {
            requests: self.counters.active_requests.load(Ordering::Relaxed),
            bytes: self.counters.active_bytes.load(Ordering::Relaxed),
        }
    }

    /// The counters as they are now (exact when the cache is paused or is this thread's).
    pub(crate) fn counted(&self) -> Counted {
        Counted {
            active: self.active(),
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            handed_bytes: self.counters.handed_bytes.load(Ordering::Relaxed),
        }
    }

    /// How much this thread may hand out without asking.
    #[inline]
    pub(crate) fn ceiling(&self) -> Amount {
        Amount {
            requests: self.ceiling_requests.load(Ordering::Relaxed),
            bytes: self.ceiling_bytes.load(Ordering::Relaxed),
        }
    }

    /// Sets the ceiling: to raise it, the caller holds the pool's lock and keeps the sum of
    /// ceilings within the peak; lowering is always allowed.
    #[inline]
    pub(crate) fn set_ceiling(&self, ceiling: Amount) {
        self.ceiling_requests
            .store(ceiling.requests, Ordering::Relaxed);
        self.ceiling_bytes.store(ceiling.bytes, Ordering::Relaxed);
    }

    /// Says that the owner is about to take a block of `size` on its slow path (zero: no
    /// longer).
    pub(crate) fn want(&self, size: usize) {
        self.wanted_bytes.store(size as i64, Ordering::Relaxed);
    }

    /// The block the owner is about to take, if any.
    pub(crate) fn wanted(&self) -> Amount {
        let bytes = self.wanted_bytes.load(Ordering::Relaxed);
        Amount {
            requests: (bytes > 0) as i64,
            bytes,
        }
    }

    /// Hands out an idle block of `class` if there is one and the ceiling allows it.
    #[inline]
    pub(crate) fn take(&self, data: &mut LocalData, class: usize, size: usize) -> Option<Cached> {
        let after = self.active() + Amount::block(size);
        if !after.within(self.ceiling()) {
            return None;
        }
        let cached = data.magazine[class].pop()?;
        self.count_handed(size, true);
        Some(cached)
    }

    /// Counts a block of `size` handed out: from a cache (`hit`) or newly pinned. The
    /// caller, the cache's one writer now, has checked the ceiling.
    #[inline]
    pub(crate) fn count_handed(&self, size: usize, hit: bool) {
        let counters = &self.counters;
        bump_i64(&counters.active_requests, 1);
        bump_i64(&counters.active_bytes, size as i64);
        bump_u64(
            if hit {
                &counters.hits
            } else {
                &counters.misses
            },
            1,
        );
        bump_u64(&counters.handed_bytes, size as u64);
    }

    /// Keeps a freed block of `class` if the stack has room, counting it given back;
    /// `false`, doing nothing, otherwise. (Taking the block by reference lets it be written
    /// straight into the stack: a copy built beforehand costs a store-forwarding stall.)
    #[inline]
    pub(crate) fn give(
        &self,
        data: &mut LocalData,
        allocation: &Allocation,
        idle_since: Option<Instant>,
        class: usize,
        size: usize,
    ) -> bool {
        let stack = &mut data.magazine[class];
        if !magazine_has_room(stack.len(), size) {
            return false;
        }
        stack.push(Cached::new(allocation, idle_since));
        self.count_returned(data, size);
        true
    }

    /// Counts a block of `size` given back, and lowers the ceiling to `keep` above what is
    /// left, so that other threads can raise theirs without pausing this one. The caller is
    /// the cache's one writer now.
    #[inline]
    pub(crate) fn count_returned(&self, data: &LocalData, size: usize) {
        let counters = &self.counters;
        bump_i64(&counters.active_requests, -1);
        bump_i64(&counters.active_bytes, -(size as i64));
        let ceiling = self.ceiling();
        let lowered = ceiling.min(self.active() + data.keep);
        if lowered != ceiling {
            self.set_ceiling(lowered);
        }
    }
}

/// The owner inside its cache; leaving (drop) lets a waiting pauser in.
pub(crate) struct Entered<'a> {
    local: &'a Local,
}

impl Deref for Entered<'_> {
    type Target = LocalData;
    #[inline]
    fn deref(&self) -> &LocalData {
        // SAFETY: between the owner's `busy` stores, with `paused` seen false, no pauser
        // touches the data (it waits for `busy` to clear) and the owner holds no other
        // reference (it enters once at a time and never under the pool's lock).
        unsafe { &*self.local.data.get() }
    }
}

impl DerefMut for Entered<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut LocalData {
        // SAFETY: as in `deref`, and `&mut self` makes this the only use of the guard.
        unsafe { &mut *self.local.data.get() }
    }
}

impl Drop for Entered<'_> {
    #[inline]
    fn drop(&mut self) {
        self.local.busy.store(false, Ordering::Release);
    }
}

/// The pause hand-off under the loom model checker: whatever the interleaving and the
/// memory model allow, the owner inside `enter` and a pauser past `wait_idle` never touch the
/// cache's data at once. A loom cell stands in for the data and reports any such overlap.
///
/// Loom models the fallback barrier (a `SeqCst` fence on both sides); the expedited one
/// replaces the fast side's fence by a `membarrier(2)` call on the pauser's side that runs a
/// full fence on every running thread of the process, which loom cannot express.
///
/// `RUSTFLAGS="--cfg loom" cargo test -p pinned-pool --release --lib loom`
#[cfg(all(test, loom))]
mod loom_model {
    use loom::cell::UnsafeCell as Witness;
    use loom::sync::Arc;

    use super::Local;
    use crate::barrier::Barrier;

    #[test]
    fn loom_pause_and_owner_never_overlap() {
        loom::model(|| {
            let barrier = Barrier::fences();
            let local = Arc::new(Local::new(1));
            // Let out of its initial pause, as the owner's first (locked) use does.
            local.resume();
            let data = Arc::new(Witness::new(0u32));
            let owner = {
                let (local, data) = (local.clone(), data.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if let Some(entered) = local.enter(barrier) {
                            // SAFETY: loom checks that no pauser holds the data meanwhile.
                            data.with_mut(|value| unsafe { *value += 1 });
                            drop(entered);
                        }
                    }
                })
            };
            local.pause();
            barrier.heavy();
            local.wait_idle();
            // SAFETY: loom checks that the owner is not inside `enter` meanwhile.
            data.with_mut(|value| unsafe { *value += 10 });
            local.resume();
            owner.join().unwrap();
        });
    }
}
