//! What a pool's threads share under its lock, and its map of blocks.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use cuda_pinned::{Allocation, Error, PinnedAllocator};
use parking_lot::Mutex;

use super::Pool;
use crate::completion::Completion;
use crate::local::{Amount, Cached, LocalData, magazine_has_room};
use crate::size_class::slots;
use crate::stats::{DurationStat, Stat};

/// The shared part of a pool.
pub(crate) struct Central {
    /// Idle blocks by class that no thread keeps: spilled from full thread stacks, and
    /// pending blocks whose device work has finished.
    pub(crate) depot: Box<[Vec<Cached>]>,
    /// Peaks of blocks and bytes handed out, pool-wide. Every thread's ceiling is within
    /// them (their sum is at most the peak), so no total can pass them unseen.
    pub(crate) peak: Amount,
    pub(crate) allocations: Stat,
    pub(crate) allocated_bytes: Stat,
    pub(crate) host_alloc_time: DurationStat,
    pub(crate) host_free_time: DurationStat,
    /// Blocks pinned ahead, and what the reserve thread is asked and has met.
    pub(crate) ahead: Ahead,
}

impl Central {
    pub(crate) fn new(nodes: usize) -> Self {
        Self {
            depot: (0..slots(nodes)).map(|_| Vec::new()).collect(),
            peak: Amount::default(),
            allocations: Stat::default(),
            allocated_bytes: Stat::default(),
            host_alloc_time: DurationStat::default(),
            host_free_time: DurationStat::default(),
            ahead: Ahead::new(nodes),
        }
    }

    /// Takes a block of `class` and moves more into `data`'s stack, filling it halfway.
    pub(crate) fn refill(
        &mut self,
        data: &mut LocalData,
        class: usize,
        size: usize,
    ) -> Option<Cached> {
        let taken = self.depot[class].pop()?;
        let stack = &mut data.magazine[class];
        while magazine_has_room(stack.len() * 2 + 1, size) {
            let Some(more) = self.depot[class].pop() else {
                break;
            };
            stack.push(more);
        }
        Some(taken)
    }

    /// Moves the older half of `data`'s full stack of `class` here.
    pub(crate) fn spill(&mut self, data: &mut LocalData, class: usize) {
        let stack = &mut data.magazine[class];
        let half = stack.len().div_ceil(2);
        self.depot[class].extend(stack.drain(..half));
    }
}

/// Every thread cache paused (see [`Pool::pause_all`]); resumes them when dropped.
pub(crate) struct Paused<'a, B: PinnedAllocator, C: Completion> {
    pub(crate) pool: &'a Pool<B, C>,
}

impl<B: PinnedAllocator, C: Completion> Drop for Paused<'_, B, C> {
    fn drop(&mut self) {
        for local in self.pool.caches() {
            local.resume();
        }
    }
}

pub(crate) fn raise(stat: &mut Stat, amount: u64) {
    stat.current += amount;
    stat.allocated += amount;
    stat.peak = stat.peak.max(stat.current);
}

pub(crate) fn lower(stat: &mut Stat, amount: u64) {
    stat.current -= amount;
    stat.freed += amount;
}

/// Hashes block addresses: distinct integers that no adversary chooses, for which one
/// multiplication does what SipHash would at a fraction of the cost (every new block inserts
/// one).
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

pub(crate) type BuildAddressHasher = BuildHasherDefault<AddressHasher>;

/// Blocks by address: the backend's description of each, with the slot it serves.
pub(crate) type BlockMap = Mutex<HashMap<usize, (Allocation, usize), BuildAddressHasher>>;

impl Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        // The full product, folded: every bit of the address reaches the low bits the table
        // indexes by, which a plain product takes from the address's (mostly zero) low bits
        // alone. The constant added keeps a run of zeros from hashing like nothing.
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let product = u128::from(self.0.rotate_left(5) ^ n) * u128::from(K);
        self.0 = ((product as u64) ^ ((product >> 64) as u64)).wrapping_add(K);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A block pinned ahead: as the pool hands it out (the class size, tagged with its slot),
/// with the bytes the backend pinned. The backend's own description is in the block map.
pub(crate) type Ready = (Allocation, usize);

/// What the reserve thread and the pool share: part of the pool's [`Central`], under its lock.
pub(crate) struct Ahead {
    /// Blocks to keep ready, by slot.
    pub(crate) target: Vec<usize>,
    /// Blocks ready, by slot.
    pub(crate) ready: Vec<Vec<Ready>>,
    /// Their bytes.
    pub(crate) ready_bytes: usize,
    /// Bytes of the block being pinned, if any.
    pub(crate) pinning_bytes: usize,
    /// The first error met since it was last taken, and how many in all.
    pub(crate) error: Option<Error>,
    pub(crate) failures: u64,
    /// Slots given up on after an error, until the next `reserve` or take.
    pub(crate) stalled: Vec<bool>,
    pub(crate) stop: bool,
    /// The thread waits for a wake-up (else it looks at the targets again by itself).
    pub(crate) sleeping: bool,
}

impl Ahead {
    pub(crate) fn new(nodes: usize) -> Self {
        let slots = slots(nodes);
        Self {
            target: vec![0; slots],
            ready: (0..slots).map(|_| Vec::new()).collect(),
            ready_bytes: 0,
            pinning_bytes: 0,
            error: None,
            failures: 0,
            stalled: vec![false; slots],
            stop: false,
            sleeping: false,
        }
    }

    /// Bytes of the blocks ready.
    pub(crate) fn ready_bytes(&self) -> usize {
        self.ready_bytes
    }

    /// Those, and a block being pinned: what the reserve holds of the pinned-bytes count.
    pub(crate) fn held_bytes(&self) -> usize {
        self.ready_bytes + self.pinning_bytes
    }

    /// Errors met in all.
    pub(crate) fn failures(&self) -> u64 {
        self.failures
    }

    /// The first error met since the last call.
    pub(crate) fn take_error(&mut self) -> Option<Error> {
        self.error.take()
    }

    /// The first slot short of its target, not given up on.
    pub(crate) fn short(&self) -> Option<usize> {
        (0..self.target.len())
            .find(|&slot| !self.stalled[slot] && self.ready[slot].len() < self.target[slot])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_addresses_spread_over_the_low_bits() {
        // Blocks at strides from a page to a TiB, as many as a 47-bit address space holds up
        // to 4,096: their hashes' low 12 bits (the index of a table that size) should take
        // most values, as random ones would (4,096 random values take about 63% of them).
        for (shift, blocks, least) in [
            (12, 4096, 2400),
            (21, 4096, 2400),
            (30, 4096, 2400),
            (40, 128, 120),
        ] {
            let distinct: std::collections::HashSet<u64> = (0..blocks)
                .map(|k: u64| {
                    let mut hasher = AddressHasher::default();
                    hasher.write_usize((0x7f00_0000_0000 - (k << shift)) as usize);
                    hasher.finish() & 0xfff
                })
                .collect();
            assert!(
                distinct.len() >= least,
                "stride 2^{shift}: {} of {blocks}",
                distinct.len()
            );
        }
        // Zeros are not nothing.
        let hash = |bytes: &[u8]| {
            let mut hasher = AddressHasher::default();
            hasher.write(bytes);
            hasher.finish()
        };
        assert_ne!(hash(&[0]), hash(&[0, 0]));
    }
}
