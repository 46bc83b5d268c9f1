//! The loader's iterator: host batches of 64 images of 3×224×224 bytes and their labels,
//! gathered at random from 1,024 in memory, by worker count (device loaders: `pinned-bench
//! loader`). Criterion's `thrpt` is batches per second.

#![allow(
    missing_docs,
    reason = "criterion's macros generate undocumented items"
)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pinned_loader::{BoxError, Dataset, Field, Loader, LoaderConfig};

const IMAGE: usize = 3 * 224 * 224;

struct Images {
    pixels: Vec<u8>,
}

impl Dataset for Images {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        1024
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(IMAGE), Field::new(1))
    }
    fn write(&self, i: usize, (image, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        pinned_loader::copy_streaming(image, &self.pixels[i * IMAGE..(i + 1) * IMAGE]);
        label[0] = i as i64;
        Ok(())
    }
}

fn host_batches(c: &mut Criterion) {
    let images = Arc::new(Images {
        pixels: (0..1024 * IMAGE).map(|i| i as u8).collect(),
    });
    let mut group = c.benchmark_group("loader/host_batches");
    group.throughput(Throughput::Elements(1));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for workers in [1usize, 4, 8, 16]
        .into_iter()
        .filter(|&w| w <= cores.max(2))
    {
        let config = LoaderConfig::new(64)
            .workers(workers)
            .shuffle(1)
            .persistent_workers(true)
            .prefetch_next_epoch(true);
        let mut loader = Loader::new(images.clone(), config).expect("loader");
        group.bench_with_input(BenchmarkId::from_parameter(workers), &workers, |b, _| {
            let mut epoch = 0;
            b.iter_custom(|batches| {
                let start = std::time::Instant::now();
                let mut left = batches;
                while left > 0 {
                    for batch in loader.epoch(epoch).take(left as usize) {
                        black_box(batch.expect("batch").fields());
                        left -= 1;
                    }
                    epoch += 1;
                }
                start.elapsed()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, host_batches);
criterion_main!(benches);
