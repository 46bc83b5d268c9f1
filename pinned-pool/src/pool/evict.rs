//! Giving idle blocks back to the backend: on request, past the cap on idle bytes (counted
//! here as blocks enter and leave the caches), after idling.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Instant;

use cuda_pinned::{Allocation, PinnedAllocator};

use super::central::lower;
use super::{Pool, keep_first};
use crate::completion::Completion;
use crate::local::{Cached, idle_bytes};
use crate::size_class::{CLASSES, SLOT_STRIDE, class_size};

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// Counts `size` idle bytes more in the caches, under a cap on them, *before* they enter
    /// one; whether the caches are then over the cap (and want [`trim_to_cap`](Self::trim_to_cap)
    /// once the bytes are in).
    #[inline]
    pub(super) fn cache_grows(&self, size: usize) -> bool {
        self.config
            .max_cached_bytes
            .is_some_and(|max| self.cached.fetch_add(size, Ordering::Relaxed) + size > max)
    }

    /// Trims the caches to the cap on idle bytes.
    #[cold]
    pub(super) fn trim_to_cap(&self) {
        if let Some(max) = self.config.max_cached_bytes {
            self.trim(max);
        }
    }

    /// Counts `size` idle bytes fewer in the caches, under a cap on them, *after* they have
    /// left them.
    #[inline]
    pub(super) fn cache_shrank(&self, size: usize) {
        if self.config.max_cached_bytes.is_some() {
            self.cached.fetch_sub(size, Ordering::Relaxed);
        }
    }

    /// Releases every idle block to the backend (PyTorch's `empty_cache`). Blocks in use or
    /// waiting for device work stay.
    pub fn empty_cache(&self) {
        self.process_events();
        self.evict(|holders| {
            let mut victims = Vec::new();
            for lists in holders {
                for (class, list) in lists.iter_mut().enumerate() {
                    victims.extend(list.drain(..).map(|cached| cached.into_allocation(class)));
                }
            }
            victims
        });
    }

    /// Releases idle blocks, largest first, until at most `target_bytes` stay cached.
    pub fn trim(&self, target_bytes: usize) {
        self.shed(|cached| cached.saturating_sub(target_bytes as u64));
    }

    /// Releases idle blocks, largest first, until the excess `excess_of(cached bytes)` says
    /// is gone (or nothing idle is left).
    pub(super) fn shed(&self, excess_of: impl FnOnce(u64) -> u64) {
        self.evict(|holders| {
            let cached = holders.iter().map(|lists| idle_bytes(lists)).sum();
            let mut excess = excess_of(cached);
            let mut victims = Vec::new();
            // Largest class first, on every node.
            let slots = (0..CLASSES)
                .rev()
                .flat_map(|class| (0..self.nodes).map(move |node| node * SLOT_STRIDE + class));
            for slot in slots {
                let size = class_size(slot) as u64;
                for lists in holders.iter_mut() {
                    while excess > 0 {
                        let Some(cached) = lists[slot].pop() else {
                            break;
                        };
                        excess = excess.saturating_sub(size);
                        victims.push(cached.into_allocation(slot));
                    }
                }
            }
            victims
        });
    }

    /// Releases blocks idle for longer than the configured
    /// [`idle_release`](crate::PoolConfig::idle_release); nothing without one.
    pub fn release_idle(&self) {
        let Some(after) = self.config.idle_release else {
            return;
        };
        let now = Instant::now();
        let expired = |cached: &Cached| {
            cached
                .idle_since
                .is_some_and(|t| now.duration_since(t) >= after)
        };
        self.evict(|holders| {
            let mut victims = Vec::new();
            for lists in holders {
                for (class, list) in lists.iter_mut().enumerate() {
                    let idle = list.extract_if(.., |c| expired(c));
                    victims.extend(idle.map(|c| c.into_allocation(class)));
                }
            }
            victims
        });
    }

    /// Releases the idle blocks `select` takes out of the shared lists and every thread's
    /// stacks (all paused meanwhile), with no lock held during the backend calls.
    pub(super) fn evict(&self, select: impl FnOnce(&mut [IdleLists<'_>]) -> Vec<Allocation>) {
        let victims = {
            let mut central = self.central.lock();
            let paused = self.pause_all(&mut central);
            let central = &mut *central;
            let mut holders = vec![&mut central.depot[..]];
            for local in self.caches() {
                // SAFETY: every cache is paused and the lock is held; each is borrowed once.
                holders.push(&mut unsafe { local.data() }.magazine[..]);
            }
            let victims = select(&mut holders);
            drop(holders);
            drop(paused);
            victims
        };
        let bytes = victims.iter().map(|a| class_size(a.tag())).sum();
        if !victims.is_empty() {
            tracing::debug!(blocks = victims.len(), bytes, "cache trimmed");
        }
        self.cache_shrank(bytes);
        self.release(victims);
    }

    /// Gives blocks back to the backend; takes no pool lock during the backend calls. A
    /// backend that panics on one block keeps that block's bytes counted (whether it was
    /// freed is unknown, and the cap errs on the safe side); the other blocks are released
    /// before the panic goes on.
    pub(super) fn release(&self, victims: Vec<Allocation>) {
        let mut panicked = None;
        for handed in victims {
            let Some((block, _)) = self.blocks.lock().remove(&(handed.ptr().as_ptr() as usize))
            else {
                continue;
            };
            let bytes = block.bytes() as u64;
            let start = Instant::now();
            let released = std::panic::catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the block came from the backend, is idle (in no list, not in use,
                // its device work finished) and is forgotten by the pool from here on.
                unsafe { self.backend.deallocate(block) }
            }));
            if let Err(payload) = released {
                keep_first(&mut panicked, Some(payload));
                continue;
            }
            let elapsed = start.elapsed();
            self.reserved
                .fetch_sub(class_size(handed.tag()), Ordering::Relaxed);
            let mut central = self.central.lock();
            central.host_free_time.record(elapsed);
            lower(&mut central.allocations, 1);
            lower(&mut central.allocated_bytes, bytes);
        }
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
    }
}

/// One holder's idle blocks, by class.
type IdleLists<'a> = &'a mut [Vec<Cached>];
