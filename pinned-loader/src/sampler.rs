//! Which samples each batch of an epoch takes: PyTorch's `RandomSampler` (seeded, a new order
//! each epoch), `DistributedSampler` (a shard per rank) and `BatchSampler` (`drop_last`).

use std::ops::Range;

/// The order of an epoch and its cut into batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Sampler {
    pub(crate) len: usize,
    pub(crate) batch_size: usize,
    pub(crate) shuffle: Option<u64>,
    pub(crate) drop_last: bool,
    /// `(rank, world_size)`.
    pub(crate) shard: (usize, usize),
}

impl Sampler {
    /// The indices of `epoch` for this rank, in order.
    pub(crate) fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if let Some(seed) = self.shuffle {
            // Every rank draws the same permutation, then takes its own share of it.
            let mut rng = SplitMix(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for i in (1..order.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        let (rank, world) = self.shard;
        if world > 1 && !order.is_empty() {
            // As `DistributedSampler`: every rank gets the same count, the order padded by
            // wrapping around (or cut, with `drop_last`), and rank r takes every world-th
            // index from the r-th.
            order = (0..self.per_rank())
                .map(|k| order[(rank + k * world) % order.len()])
                .collect();
        }
        order
    }

    /// Indices each rank gets an epoch.
    pub(crate) fn per_rank(&self) -> usize {
        let world = self.shard.1;
        if self.drop_last {
            self.len / world
        } else {
            self.len.div_ceil(world)
        }
    }

    /// The batches of `count` indices: ranges into them.
    pub(crate) fn batches(&self, count: usize) -> Vec<Range<usize>> {
        let full = count / self.batch_size;
        let mut batches: Vec<_> = (0..full)
            .map(|b| b * self.batch_size..(b + 1) * self.batch_size)
            .collect();
        if !self.drop_last && !count.is_multiple_of(self.batch_size) {
            batches.push(full * self.batch_size..count);
        }
        batches
    }
}

/// SplitMix64: small, fast and good enough to shuffle, and the same on every platform.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(
        len: usize,
        shuffle: Option<u64>,
        drop_last: bool,
        shard: (usize, usize),
    ) -> Sampler {
        Sampler {
            len,
            batch_size: 4,
            shuffle,
            drop_last,
            shard,
        }
    }

    #[test]
    fn shuffles_deterministically_and_differently_per_epoch() {
        let s = sampler(100, Some(7), false, (0, 1));
        assert_eq!(s.indices(3), s.indices(3));
        assert_ne!(s.indices(3), s.indices(4));
        let mut sorted = s.indices(3);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(sampler(5, None, false, (0, 1)).indices(9), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn shards_cover_everything_with_equal_counts() {
        let world = 3;
        let shards: Vec<Vec<usize>> = (0..world)
            .map(|rank| sampler(10, Some(1), false, (rank, world)).indices(0))
            .collect();
        assert!(shards.iter().all(|s| s.len() == 4));
        let mut all: Vec<usize> = shards.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        let cut: Vec<usize> = (0..world)
            .flat_map(|rank| sampler(10, Some(1), true, (rank, world)).indices(0))
            .collect();
        assert_eq!(cut.len(), 9);
    }

    #[test]
    fn batches_keep_or_drop_the_tail() {
        assert_eq!(
            sampler(10, None, false, (0, 1)).batches(10),
            [0..4, 4..8, 8..10]
        );
        assert_eq!(sampler(10, None, true, (0, 1)).batches(10), [0..4, 4..8]);
        assert!(sampler(0, None, false, (0, 1)).batches(0).is_empty());
    }
}
