//! `indices()`: a batch names the dataset samples it holds, in order, however the loader cut
//! and ordered them.

use pinned_loader::{BoxError, Field, Loader, LoaderConfig, SampleDataset};

/// Sample `i` is the label `i`.
struct Labels(usize);

impl SampleDataset for Labels {
    type Sample = u64;
    type Fields = Field<u64>;
    fn len(&self) -> usize {
        self.0
    }
    fn fields(&self) -> Field<u64> {
        Field::new(1)
    }
    fn get(&self, i: usize) -> Result<u64, BoxError> {
        Ok(i as u64)
    }
}

#[test]
fn indices_name_each_batchs_samples_in_every_configuration() {
    let len = 53;
    for workers in [0, 3] {
        for shuffle in [None, Some(5)] {
            for drop_last in [false, true] {
                for in_order in [true, false] {
                    for (rank, world) in [(0, 1), (1, 3)] {
                        let mut config = LoaderConfig::new(8)
                            .workers(workers)
                            .drop_last(drop_last)
                            .in_order(in_order)
                            .shard(rank, world)
                            .persistent_workers(true)
                            .prefetch_next_epoch(true);
                        if let Some(seed) = shuffle {
                            config = config.shuffle(seed);
                        }
                        let mut loader = Loader::new(Labels(len), config).unwrap();
                        let per_rank = if drop_last {
                            len / world
                        } else {
                            len.div_ceil(world)
                        };
                        for epoch in 0..2 {
                            let mut count = 0;
                            let mut numbers = Vec::new();
                            for batch in loader.epoch(epoch) {
                                let batch = batch.unwrap();
                                let labels: Vec<usize> =
                                    batch.fields().iter().map(|&l| l as usize).collect();
                                assert_eq!(batch.indices(), labels);
                                assert_eq!(batch.indices().len(), batch.len());
                                if drop_last {
                                    assert_eq!(batch.len(), 8);
                                }
                                count += batch.len();
                                numbers.push(batch.index());
                            }
                            numbers.sort_unstable();
                            assert_eq!(numbers, (0..numbers.len()).collect::<Vec<_>>());
                            let expected = if drop_last {
                                per_rank / 8 * 8
                            } else {
                                per_rank
                            };
                            assert_eq!(count, expected);
                        }
                    }
                }
            }
        }
    }
}
