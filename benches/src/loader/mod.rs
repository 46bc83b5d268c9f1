//! `loader`: batches of 64 images of 3×224×224 bytes and 64 `i64` labels, gathered at random
//! from 1,024 images in memory, fed to the GPU with a little device work each step, as
//! PyTorch's loader benchmarks do; host collate by worker count, device gather, and the
//! host's `memcpy` bandwidth in the same run (host collate cannot beat it); the same images read
//! from a `.npy` file, warm and cold, against memory and the disk's random-read ceiling.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_pinned::{CudarcCopies, DeviceBuffer, Stream};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use pinned_loader::{
    Assembly, BoxError, Dataset, DeviceLoader, Field, Loader, LoaderConfig, LoaderError,
    LoaderStats, NpyDataset, PinnedSamples,
};

// The rows of the cold epochs and of the disk's ceiling, named as the goals read them.
use pinned_bench::goals::{
    LOADER_COLD_CEILING_ROW as COLD_CEILING_ROW, LOADER_COLD_ROW as COLD_ROW,
    LOADER_MEMORY_PER_CORE_ROW as MEMORY_PER_CORE_ROW, LOADER_MEMORY_ROW as MEMORY_ROW,
    LOADER_NPY_PER_CORE_ROW as NPY_PER_CORE_ROW, LOADER_NPY_ROW as NPY_ROW,
    LOADER_PER_CORE_CAP as PER_CORE_CAP,
};

use crate::progress::Progress;
use crate::report::{Section, Value};
use crate::stats::{Spread, gbps};

mod files;

use files::file_rows;

const IMAGE: usize = 3 * 224 * 224;
const IMAGES: usize = 1024;
const BATCH: usize = 64;
const BATCH_BYTES: f64 = (BATCH * (IMAGE + 8)) as f64;
/// Batches before steady state is timed.
const WARM: usize = 30;
/// The first batches, timed from construction on: the span the hand-written loader's anchor
/// (1,207 b/s) was measured over.
const FIRST: usize = 300;

/// 1,024 images and labels in ordinary memory, written into batches with plain or with
/// non-temporal stores.
struct Images {
    pixels: Vec<u8>,
    labels: Vec<i64>,
    streaming: bool,
}

impl Images {
    fn new(streaming: bool) -> Self {
        Self {
            pixels: (0..IMAGES * IMAGE).map(|i| (i % 251) as u8).collect(),
            labels: (0..IMAGES as i64).collect(),
            streaming,
        }
    }
}

impl Dataset for Images {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(IMAGE), Field::new(1))
    }
    fn write(&self, i: usize, (image, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        let pixels = &self.pixels[i * IMAGE..(i + 1) * IMAGE];
        if self.streaming {
            cuda_pinned::copy_streaming(image, pixels);
        } else {
            image.copy_from_slice(pixels);
        }
        label[0] = self.labels[i];
        Ok(())
    }
}

fn worker_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    [1, 4, 8, 12, 16]
        .into_iter()
        .filter(|&w| w <= cores.max(2))
        .collect()
}

/// Work items, for the progress bar.
pub fn steps(cuda: bool, traced: bool) -> usize {
    worker_counts().len() + 4 + usize::from(cuda) * 3 + usize::from(traced)
}

/// One run's figures: batches/s once warm, over the whole run from construction on, and over
/// its first batches from construction on.
struct Run {
    steady: f64,
    whole: f64,
    first: f64,
    construction_ms: f64,
    late_slots: u64,
    /// A worker's mean time to fill one batch, ms (host collate).
    fill_ms: f64,
    /// The share of the run the consumer spent waiting for batches, %.
    waited: f64,
    /// GB/s of the uploads while they ran on the device.
    upload: f64,
    /// The process's CPU time over the run's wall time: cores kept busy.
    cores: f64,
}

/// CPU time the process has used so far, all threads.
fn process_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write; the clock id is a constant the kernel knows.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Runs the section.
pub fn run(quick: bool, trace: Option<&Path>, progress: &mut Progress) -> Vec<Section> {
    let cuda = cuda_pinned::is_available();
    let batches = if quick { 400 } else { 3_000 };
    let reps = if quick { 3 } else { 5 };
    let mut section = loader_section(cuda);
    // Written as the guide recommends, with non-temporal stores.
    let images = Arc::new(Images::new(true));
    collate_rows(&images, batches, reps, cuda, progress, &mut section);
    file_rows(&images, batches, reps, cuda, progress, &mut section);
    if cuda {
        device_rows(&images, batches, reps, progress, &mut section);
    }
    progress.step("loader, host memcpy");
    memcpy_and_notes(batches, reps, &mut section);
    if let Some(path) = trace {
        progress.step("loader, traced run");
        match traced_run(&images, cuda, path) {
            Ok(()) => section.notes.push(format!(
                "a traced run (host collate, 8 workers, {TRACED} batches) is in {}",
                path.display()
            )),
            Err(e) => section
                .notes
                .push(format!("traced run: {e}", e = cuda_pinned::ErrorChain(&*e))),
        }
    }
    vec![section]
}

/// Batches of the traced run.
const TRACED: usize = 300;

/// One run of host collate with 8 workers, traced into a Chrome trace at `path`: the workers'
/// fills, the uploads, the consumer's waits, the copies and waits below them.
fn traced_run(images: &Arc<Images>, cuda: bool, path: &Path) -> Result<(), BoxError> {
    use tracing_subscriber::layer::SubscriberExt;
    let (chrome, flush) = tracing_chrome::ChromeLayerBuilder::new()
        .file(path)
        .include_args(true)
        .build();
    // The loader's workers are threads of their own: the subscriber is the process's.
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(chrome))?;
    let run = collate_run(images.clone(), collate_config(8, 0), TRACED, cuda);
    drop(flush);
    run?;
    Ok(())
}

/// The section's title and columns, kept apart so `run` reads as the order of measurements.
fn loader_section(cuda: bool) -> Section {
    Section::new(
        "loader",
        &format!(
            "Loader: {BATCH} x 3x224x224 u8 + {BATCH} i64 per batch, random from {IMAGES} \
             images, {}",
            if cuda {
                "to the GPU with a little device work each step"
            } else {
                "host batches (no CUDA here)"
            }
        ),
        &[
            "mode",
            "steady b/s min",
            "median",
            "max",
            "whole run b/s median",
            "first 300 b/s median",
            "GB/s (steady median)",
            "build ms (median)",
            "late slots",
            "fill ms/batch",
            "consumer waited %",
            "upload GB/s",
            "CPU cores busy",
        ],
    )
}

/// Adds one mode's row from its runs, or a note if a run failed; shared by every loader mode.
fn push_row(name: String, runs: Vec<Result<Run, LoaderError>>, section: &mut Section) {
    let runs: Vec<Run> = match runs.into_iter().collect() {
        Ok(runs) => runs,
        Err(e) => {
            section
                .notes
                .push(format!("{name}: {e}", e = cuda_pinned::ErrorChain(&e)));
            return;
        }
    };
    let steady = Spread::of(runs.iter().map(|r| r.steady).collect());
    let mut cells = vec![Value::Text(name)];
    cells.extend(steady.cells(0));
    for figure in [|r: &Run| r.whole, |r: &Run| r.first] {
        cells.push(Value::Num(
            Spread::of(runs.iter().map(figure).collect()).median,
            0,
        ));
    }
    cells.push(Value::Num(steady.median * BATCH_BYTES / 1e9, 1));
    cells.push(Value::Num(
        Spread::of(runs.iter().map(|r| r.construction_ms).collect()).median,
        1,
    ));
    cells.push(Value::Int(
        runs.iter().map(|r| r.late_slots).max().unwrap_or(0),
    ));
    for figure in [
        |r: &Run| r.fill_ms,
        |r: &Run| r.waited,
        |r: &Run| r.upload,
        |r: &Run| r.cores,
    ] {
        cells.push(Value::Num(
            Spread::of(runs.iter().map(figure).collect()).median,
            2,
        ));
    }
    section.row(cells);
}

/// The host-collate loader's configuration, the same for every host-collate row.
fn collate_config(workers: usize, rep: usize) -> LoaderConfig {
    // Workers that persist begin each epoch's first batches while the last ones of the
    // epoch before are consumed: epochs here are 16 batches, and a pipeline drained at each
    // epoch's end lost about a third of the batches per second.
    LoaderConfig::new(BATCH)
        .workers(workers)
        .shuffle(rep as u64)
        .persistent_workers(true)
        .prefetch_next_epoch(true)
}

/// Measures host collate by worker count, then plain against streaming stores; these rows
/// run with or without CUDA.
fn collate_rows(
    images: &Arc<Images>,
    batches: usize,
    reps: usize,
    cuda: bool,
    progress: &mut Progress,
    section: &mut Section,
) {
    for workers in worker_counts() {
        progress.step(&format!("loader, {workers} workers"));
        let runs = (0..reps)
            .map(|rep| collate_run(images.clone(), collate_config(workers, rep), batches, cuda))
            .collect();
        push_row(format!("host collate, {workers} workers"), runs, section);
    }
    // Plain stores into the batch against non-temporal ones, run for run: the batch is read
    // next by the DMA engine, not the CPU.
    progress.step("loader, plain stores");
    let plain_images = Arc::new(Images::new(false));
    let (mut plain, mut streaming) = (Vec::new(), Vec::new());
    for rep in 0..reps {
        plain.push(collate_run(
            plain_images.clone(),
            collate_config(8, rep),
            batches,
            cuda,
        ));
        streaming.push(collate_run(
            images.clone(),
            collate_config(8, rep),
            batches,
            cuda,
        ));
    }
    drop(plain_images);
    push_row(
        "host collate, 8 workers, copy_from_slice (alternating)".into(),
        plain,
        section,
    );
    push_row(
        "host collate, 8 workers, copy_streaming (alternating)".into(),
        streaming,
        section,
    );
    if cuda {
        // A cudarc program's loop, safe (the batch ready on cudarc's stream, its images
        // copied into cudarc's memory by a tracked copy) against the raw-address step, run
        // for run.
        progress.step("loader, cudarc shape");
        let (mut raw, mut cudarc) = (Vec::new(), Vec::new());
        for rep in 0..reps {
            for (shape, runs) in [(Shape::Raw, &mut raw), (Shape::Cudarc, &mut cudarc)] {
                runs.push(collate_run_shaped(
                    images.clone(),
                    collate_config(8, rep),
                    batches,
                    cuda,
                    shape,
                ));
            }
        }
        push_row(
            "host collate, 8 workers, raw-address step (alternating)".into(),
            raw,
            section,
        );
        push_row(
            "host collate, 8 workers, cudarc step, no unsafe (alternating)".into(),
            cudarc,
            section,
        );
    }
}

/// Measures device gather and the one-contiguous-copy reference; these need CUDA.
fn device_rows(
    images: &Arc<Images>,
    batches: usize,
    reps: usize,
    progress: &mut Progress,
    section: &mut Section,
) {
    progress.step("loader, device gather");
    match PinnedSamples::from_dataset(&**images) {
        Ok(pinned) => {
            let pinned = Arc::new(pinned);
            let runs = (0..reps)
                .map(|rep| gather_run(pinned.clone(), batches, rep as u64))
                .collect();
            push_row("device gather".into(), runs, section);
        }
        Err(e) => section.notes.push(format!(
            "device gather: {e}",
            e = cuda_pinned::ErrorChain(&e)
        )),
    }
    progress.step("loader, contiguous copy");
    match contiguous_copies(batches, reps) {
        Ok(spread) => {
            let mut cells = vec![Value::Text(
                "one contiguous copy per batch (reference)".into(),
            )];
            cells.extend(spread.cells(0));
            cells.extend([
                Value::Missing,
                Value::Missing,
                Value::Num(spread.median * BATCH_BYTES / 1e9, 1),
                Value::Missing,
                Value::Missing,
                Value::Missing,
                Value::Missing,
                Value::Missing,
                Value::Missing,
            ]);
            section.row(cells);
        }
        Err(e) => section.notes.push(format!(
            "contiguous copy: {e}",
            e = cuda_pinned::ErrorChain(&e)
        )),
    }
}

/// Measures the host's memcpy bandwidth and writes the notes under the table; the memcpy
/// figure is only ever a note, never a row.
fn memcpy_and_notes(batches: usize, reps: usize, section: &mut Section) {
    let [memcpy, streaming] = host_memcpy(reps);
    let best = memcpy.median.max(streaming.median);
    section.notes.push(format!(
        "host memcpy into pinned memory, 8 threads, this run: {:.1} GB/s median with plain \
         stores, {:.1} with streaming stores; the better = {:.0} batches/s (host collate \
         cannot beat it)",
        memcpy.median,
        streaming.median,
        best * 1e9 / BATCH_BYTES
    ));
    section.notes.push(format!(
        "{reps} runs of {batches} batches; steady = after the first {WARM}; whole run = from \
         Loader::new (pinning its working set) to the last batch; first {FIRST} = from \
         Loader::new to batch {FIRST}; prefetch 2 per worker, persistent workers that prefetch the \
         next epoch; host collate writes images with copy_streaming unless the row says \
         otherwise"
    ));
    section.notes.push(
        "anchors (H100): PyTorch DataLoader 184-672 b/s; hand-tuned PyTorch 2,967; a loader \
         hand-written on this API 3,928 steady, 1,207 over its first 300; the link ~5,700"
            .into(),
    );
}

/// How the consumer's step reaches the batch: through a stream of this workspace and the
/// batch's raw address (the reference), or as a cudarc program does, safely.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Raw,
    Cudarc,
}

/// Device work for each step: the consumer's stream rewrites a scratch buffer from the batch.
struct Consumer {
    stream: Stream,
    scratch: DeviceBuffer<u8>,
    /// cudarc's stream (adopted as `stream`) and scratch memory, for the cudarc shape.
    cudarc: Option<(Arc<CudaStream>, CudaSlice<u8>)>,
}

impl Consumer {
    fn new(shape: Shape) -> Result<Self, LoaderError> {
        let scratch = DeviceBuffer::zeroed(1 << 20)?;
        Ok(match shape {
            Shape::Raw => Self {
                stream: Stream::new()?,
                scratch,
                cudarc: None,
            },
            Shape::Cudarc => {
                let cudarc = CudaContext::new(0)
                    .and_then(|ctx| ctx.new_stream())
                    .map_err(cuda_pinned::Error::from)?;
                let theirs = cudarc
                    .alloc_zeros::<u8>(1 << 20)
                    .map_err(cuda_pinned::Error::from)?;
                Self {
                    stream: Stream::from_cudarc(&cudarc)?,
                    scratch,
                    cudarc: Some((cudarc, theirs)),
                }
            }
        })
    }

    /// Queues a 1 MiB device-to-device copy from the batch's images.
    fn work(&mut self, images: cuda_pinned::DeviceSlice<'_, u8>) -> Result<(), LoaderError> {
        let bytes = (1 << 20).min(images.len());
        if let Some((cudarc, theirs)) = &mut self.cudarc {
            cudarc.copy_device_to_cudarc(images.slice(..bytes), &mut theirs.slice_mut(..bytes))?;
            return Ok(());
        }
        let copy = cuda_pinned::RawCopy {
            dst: self.scratch.as_raw(),
            src: images.as_raw(),
            bytes,
        };
        // SAFETY: both ranges are device memory of that length, the source ready on this
        // stream (it waited for the batch), the scratch buffer used by this stream alone.
        unsafe { self.stream.copy_batch_raw(&[copy])? };
        Ok(())
    }
}

fn collate_run<D: Dataset<Fields = (Field<u8>, Field<i64>)>>(
    images: D,
    config: LoaderConfig,
    batches: usize,
    cuda: bool,
) -> Result<Run, LoaderError> {
    collate_run_shaped(images, config, batches, cuda, Shape::Raw)
}

/// As [`collate_run`], with the consumer's step reaching the batch as `shape` says.
fn collate_run_shaped<D: Dataset<Fields = (Field<u8>, Field<i64>)>>(
    images: D,
    config: LoaderConfig,
    batches: usize,
    cuda: bool,
    shape: Shape,
) -> Result<Run, LoaderError> {
    let started = Started::now();
    let loader = Loader::new(images, config)?;
    let construction_ms = started.at.elapsed().as_secs_f64() * 1e3;
    if cuda {
        let mut device = DeviceLoader::new(loader, Assembly::HostCollate)?;
        let marks = drive(&mut device, batches, shape)?;
        let stats = device.stats();
        Ok(started.finish(marks, batches, construction_ms, &stats))
    } else {
        let mut loader = loader;
        let mut marks = Marks::default();
        let mut done = 0;
        'host: for epoch in 0.. {
            for batch in loader.epoch(epoch) {
                std::hint::black_box(batch?.fields());
                done += 1;
                marks.note(done, || Ok(()))?;
                if done == batches {
                    break 'host;
                }
            }
        }
        let stats = loader.stats();
        Ok(started.finish(marks, batches, construction_ms, &stats))
    }
}

fn gather_run<D: Dataset<Fields = (Field<u8>, Field<i64>)>>(
    dataset: D,
    batches: usize,
    seed: u64,
) -> Result<Run, LoaderError> {
    let started = Started::now();
    let loader = Loader::new(dataset, LoaderConfig::new(BATCH).shuffle(seed))?;
    let mut device = DeviceLoader::new(loader, Assembly::DeviceGather)?;
    let construction_ms = started.at.elapsed().as_secs_f64() * 1e3;
    let marks = drive(&mut device, batches, Shape::Raw)?;
    let stats = device.stats();
    Ok(started.finish(marks, batches, construction_ms, &stats))
}

/// When a run passed `WARM` and `FIRST` batches (its consumer's work included).
#[derive(Default)]
struct Marks {
    warm: Option<Instant>,
    first: Option<Instant>,
}

impl Marks {
    /// Notes the time after `done` batches, once `wait` has seen the consumer's work end.
    fn note(
        &mut self,
        done: usize,
        wait: impl FnOnce() -> Result<(), LoaderError>,
    ) -> Result<(), LoaderError> {
        if done == WARM || done == FIRST {
            wait()?;
            let now = Some(Instant::now());
            if done == WARM {
                self.warm = now;
            } else {
                self.first = now;
            }
        }
        Ok(())
    }
}

/// Takes `batches` device batches (over as many epochs as needed), each used by a consumer
/// stream's work; returns when steady state began (after `WARM` batches) and when the first
/// `FIRST` were done.
fn drive<D: Dataset<Fields = (Field<u8>, Field<i64>)>>(
    device: &mut DeviceLoader<D>,
    batches: usize,
    shape: Shape,
) -> Result<Marks, LoaderError> {
    let mut consumer = Consumer::new(shape)?;
    let mut marks = Marks::default();
    let mut done = 0;
    'epochs: for epoch in 0.. {
        for batch in device.epoch(epoch) {
            let mut batch = batch?;
            let (images, _labels) = batch.ready_on(&consumer.stream)?;
            consumer.work(images)?;
            done += 1;
            marks.note(done, || Ok(consumer.stream.synchronize()?))?;
            if done == batches {
                break 'epochs;
            }
        }
    }
    consumer.stream.synchronize()?;
    Ok(marks)
}

/// When a run began, on the wall clock and in the process's CPU time.
struct Started {
    at: Instant,
    cpu: Duration,
}

impl Started {
    fn now() -> Self {
        Self {
            at: Instant::now(),
            cpu: process_cpu_time(),
        }
    }

    /// The run's figures, now that its last batch is done.
    fn finish(
        &self,
        marks: Marks,
        batches: usize,
        construction_ms: f64,
        stats: &LoaderStats,
    ) -> Run {
        let start = self.at;
        let warm_at = marks.warm.unwrap_or(start);
        let first = marks
            .first
            .map_or(f64::NAN, |at| FIRST as f64 / (at - start).as_secs_f64());
        let wall = start.elapsed().as_secs_f64();
        Run {
            steady: (batches - WARM) as f64 / warm_at.elapsed().as_secs_f64(),
            whole: batches as f64 / wall,
            first,
            construction_ms,
            late_slots: stats.late_slots,
            fill_ms: stats.fill_time.as_secs_f64() * 1e3 / stats.batches.max(1) as f64,
            waited: 100.0 * stats.consumer_wait.as_secs_f64() / wall,
            upload: stats.upload_bandwidth() / 1e9,
            cores: process_cpu_time().saturating_sub(self.cpu).as_secs_f64() / wall,
        }
    }
}

/// Batches/s of one contiguous pinned upload of a batch's bytes, with the same device work:
/// the link's limit for this batch, measured in the same run.
fn contiguous_copies(batches: usize, reps: usize) -> Result<Spread, LoaderError> {
    let bytes = BATCH * (IMAGE + 8);
    let mut consumer = Consumer::new(Shape::Raw)?;
    let copy = Stream::new()?;
    let mut source = Some(cuda_pinned::PinnedVec::<u8>::zeroed(bytes)?);
    let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
    let mut rates = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        for _ in 0..batches {
            let upload = copy.copy_to_device(source.take().expect("returned"), &mut device)?;
            consumer.stream.wait_event(upload.event())?;
            consumer.work(device.slice(..))?;
            source = Some(upload.wait()?);
        }
        consumer.stream.synchronize()?;
        rates.push(batches as f64 / start.elapsed().as_secs_f64());
    }
    Ok(Spread::of(rates))
}

/// GB/s of 8 threads copying 8 MiB each from ordinary into pinned memory (ordinary memory
/// where none can be pinned), with plain and with non-temporal stores, rep for rep. The
/// threads start once and copy between two barriers, so that starting them is not timed.
fn host_memcpy(reps: usize) -> [Spread; 2] {
    const PER_THREAD: usize = 8 << 20;
    const THREADS: usize = 8;
    let total = PER_THREAD * THREADS;
    let source = vec![7u8; total];
    let mut pinned = cuda_pinned::PinnedVec::<u8>::zeroed(total).ok();
    let mut plain = vec![0u8; if pinned.is_some() { 0 } else { total }];
    let target: &mut [u8] = match pinned.as_mut() {
        Some(pinned) => pinned,
        None => &mut plain,
    };
    let barrier = std::sync::Barrier::new(THREADS + 1);
    let mut rates = [Vec::new(), Vec::new()];
    std::thread::scope(|scope| {
        for (from, into) in source.chunks(PER_THREAD).zip(target.chunks_mut(PER_THREAD)) {
            let barrier = &barrier;
            scope.spawn(move || {
                for rep in 0..2 * reps {
                    barrier.wait();
                    if rep % 2 == 0 {
                        into.copy_from_slice(from);
                    } else {
                        cuda_pinned::copy_streaming(into, from);
                    }
                    barrier.wait();
                }
            });
        }
        for rep in 0..2 * reps {
            barrier.wait();
            let start = Instant::now();
            barrier.wait();
            rates[rep % 2].push(gbps(total, start.elapsed().as_secs_f64()));
        }
    });
    rates.map(Spread::of)
}
