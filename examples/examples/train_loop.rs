//! The training-loop shape PyTorch users know, fed by `pinned-loader`:
//! `cargo run --release -p cuda-pinned-examples --example train_loop [-- --trace FILE] [--nvtx]`.
//!
//! It ends with each epoch's verdict: what limited it (data loading, uploads or the training
//! step) and the figures behind the call. `--trace FILE` also writes a timeline of the run (the
//! workers filling batches, the uploads, the consumer waiting, the copies below them) as a
//! Chrome trace, to open at <https://ui.perfetto.dev> or `chrome://tracing`; `--nvtx` shows the
//! same spans as NVTX ranges on Nsight Systems' timeline (`nsys profile … --nvtx`).
//!
//! ```text
//! for epoch in 0..epochs:
//!     for images, labels in loader:            # workers, pin_memory=True
//!         images = images.to(device, non_blocking=True)
//!         train_step(images, labels)
//! ```

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;

use cuda_pinned::{DeviceBuffer, Stream};
use pinned_loader::{
    Assembly, BoxError, Dataset, DeviceLoader, Field, Loader, LoaderConfig, LoaderError,
};

const IMAGE: usize = 3 * 224 * 224;

/// 512 synthetic images with labels, in ordinary memory.
struct Images {
    pixels: Vec<u8>,
    labels: Vec<i64>,
}

impl Dataset for Images {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(IMAGE), Field::new(1))
    }
    // Decoding and augmenting would go here; the sample lands straight in pinned memory.
    fn write(&self, i: usize, (image, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        pinned_loader::copy_streaming(image, &self.pixels[i * IMAGE..(i + 1) * IMAGE]);
        label[0] = self.labels[i];
        Ok(())
    }
}

/// The example's options.
#[derive(Parser)]
struct Options {
    /// Write a Chrome trace of the run to FILE.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Show the spans as NVTX ranges (to a profiler such as Nsight Systems).
    #[arg(long)]
    nvtx: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = Options::parse();
    use tracing_subscriber::layer::SubscriberExt;
    // Kept to the end of the run: dropping it finishes the file.
    let (chrome, _flush) = match &options.trace {
        Some(path) => {
            let (chrome, flush) = tracing_chrome::ChromeLayerBuilder::new()
                .file(path)
                .include_args(true)
                .build();
            (Some(chrome), Some(flush))
        }
        None => (None, None),
    };
    let nvtx = options.nvtx.then(cuda_pinned::nvtx::NvtxLayer::new);
    if chrome.is_some() || nvtx.is_some() {
        let subscriber = tracing_subscriber::registry().with(chrome).with(nvtx);
        tracing::subscriber::set_global_default(subscriber)?;
    }
    train()?;
    if let Some(path) = &options.trace {
        println!("trace written to {}", path.display());
    }
    Ok(())
}

fn train() -> Result<(), LoaderError> {
    let images = Images {
        pixels: (0..512 * IMAGE).map(|i| (i % 251) as u8).collect(),
        labels: (0..512).collect(),
    };
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let config = LoaderConfig::new(64)
        .workers(workers)
        .prefetch(2)
        .shuffle(0)
        .drop_last(true)
        .persistent_workers(true)
        // The next epoch's first batches are filled while this one's last are consumed.
        .prefetch_next_epoch(true);
    let loader = Loader::new(images, config)?;
    println!(
        "{workers} workers; {} MB pinned before the first batch",
        loader.stats().reserved_bytes >> 20
    );
    let started = Instant::now();
    if !cuda_pinned::is_available() {
        // Host batches only: what a CPU-only machine can do with the same loader.
        let mut loader = loader;
        for epoch in 0..3 {
            for batch in loader.epoch(epoch) {
                let batch = batch?;
                let (_images, labels) = batch.fields();
                std::hint::black_box(labels);
            }
        }
        report(loader.stats(), started);
        for epoch in loader.epoch_stats() {
            println!("{}", epoch.verdict());
        }
        return Ok(());
    }
    let stream = Stream::new()?; // the training stream
    let mut activations = DeviceBuffer::<u8>::zeroed(1 << 20)?;
    let mut device = DeviceLoader::new(loader, Assembly::HostCollate)?;
    for epoch in 0..3 {
        for batch in device.epoch(epoch) {
            let mut batch = batch?;
            // The stream waits for the upload on the device; the host goes on.
            let (images, _labels) = batch.ready_on(&stream)?;
            // A stand-in for the training step: read the images on the stream (the batch is
            // reused only after the stream has passed this copy).
            stream.copy_device_to_device(images.slice(..1 << 20), &mut activations)?;
        }
        stream.synchronize()?;
        println!("epoch {epoch} done");
    }
    report(device.stats(), started);
    // What limited each epoch: data loading, uploads or the training step, and the figures.
    for epoch in device.epoch_stats() {
        println!("{}", epoch.verdict());
    }
    Ok(())
}

fn report(stats: pinned_loader::LoaderStats, started: Instant) {
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{} batches in {seconds:.2} s ({:.0} batches/s); waited for data {:.1} ms; workers \
         filled for {:.1} ms; {} uploads, {:.1} GB/s on the device; {} slots pinned late",
        stats.batches,
        stats.batches as f64 / seconds,
        stats.consumer_wait.as_secs_f64() * 1e3,
        stats.fill_time.as_secs_f64() * 1e3,
        stats.uploads,
        stats.upload_bandwidth() / 1e9,
        stats.late_slots,
    );
}
