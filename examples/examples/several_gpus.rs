//! Feeding every GPU of the machine from one process: one loader and one training thread per
//! device, each with its shard of the data, all sharing one pinned-memory pool:
//! `cargo run --release -p cuda-pinned-examples --example several_gpus`.
//!
//! The PyTorch shape is one process per GPU with a `DistributedSampler`; here the ranks are
//! threads of one process, so they share the pool (and its cache of pinned blocks).

use std::sync::Arc;
use std::time::Instant;

use cuda_pinned::{Device, DeviceBuffer, Stream};
use pinned_loader::{
    Assembly, BoxError, Dataset, DeviceLoader, Field, Loader, LoaderConfig, LoaderError,
};
use pinned_pool::Pool;

const IMAGE: usize = 3 * 224 * 224;

/// 1,024 synthetic images with labels, in ordinary memory shared by every rank.
struct Images {
    pixels: Arc<Vec<u8>>,
}

impl Dataset for Images {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        self.pixels.len() / IMAGE
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

/// What one rank did: batches, seconds, and the upload bandwidth its loader saw.
struct Report {
    batches: usize,
    seconds: f64,
    upload_gbps: f64,
    /// What limited its last epoch.
    verdict: String,
}

/// One rank: its device's loader and training stream, for three epochs.
fn train(
    device: Device,
    rank: usize,
    world: usize,
    pixels: Arc<Vec<u8>>,
    pool: Arc<Pool>,
) -> Result<Report, LoaderError> {
    let config = LoaderConfig::new(64)
        .workers(4)
        .shuffle(0)
        .drop_last(true)
        .shard(rank, world) // this rank's share of every epoch
        .device(device) // workers pin on the GPU's NUMA node; uploads go to it
        .pool(pool); // one cache of pinned blocks for every rank
    let mut loader = DeviceLoader::new(
        Loader::new(Images { pixels }, config)?,
        Assembly::HostCollate,
    )?;
    let stream = Stream::on(device)?; // this rank's training stream
    let mut activations = DeviceBuffer::<u8>::zeroed_on(device, 1 << 20)?;
    let started = Instant::now();
    let mut batches = 0;
    for epoch in 0..3 {
        for batch in loader.epoch(epoch) {
            let mut batch = batch?;
            let (images, _labels) = batch.ready_on(&stream)?;
            // A stand-in for the training step: read the images on the stream (the batch is
            // reused only after the stream has passed this copy).
            stream.copy_device_to_device(images.slice(..1 << 20), &mut activations)?;
            batches += 1;
        }
    }
    stream.synchronize()?;
    Ok(Report {
        batches,
        seconds: started.elapsed().as_secs_f64(),
        upload_gbps: loader.stats().upload_bandwidth() / 1e9,
        verdict: loader
            .epoch_stats()
            .last()
            .map_or_else(String::new, |epoch| epoch.verdict().to_string()),
    })
}

fn main() -> Result<(), LoaderError> {
    if !cuda_pinned::is_available() {
        println!("no CUDA device: nothing to feed");
        return Ok(());
    }
    let devices = Device::all()?;
    let pixels = Arc::new(
        (0..1024 * IMAGE)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    let pool = Arc::new(Pool::new());
    let world = devices.len();
    let ranks: Vec<_> = devices
        .iter()
        .enumerate()
        .map(|(rank, &device)| {
            let (pixels, pool) = (pixels.clone(), pool.clone());
            std::thread::spawn(move || train(device, rank, world, pixels, pool))
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        let report = handle.join().expect("a rank panicked")?;
        let node = devices[rank]
            .nearest_numa_node()
            .map_or("unknown".to_string(), |n| n.to_string());
        println!(
            "device {rank} (NUMA node {node}): {} batches in {:.2} s ({:.0} batches/s), \
             uploads at {:.1} GB/s",
            report.batches,
            report.seconds,
            report.batches as f64 / report.seconds,
            report.upload_gbps
        );
        println!("  {}", report.verdict);
    }
    let stats = pool.stats();
    println!(
        "shared pool: {} MB pinned, {} hits, {} misses",
        stats.allocated_bytes.peak >> 20,
        stats.cache_hits,
        stats.cache_misses
    );
    Ok(())
}
