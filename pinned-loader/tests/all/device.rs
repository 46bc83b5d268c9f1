//! Loaders feeding a device (ignored without one): every batch arrives intact, a slot is not
//! refilled while its upload is pending, the consumer's stream sees the data without a host
//! synchronisation, and uploads run while the consumer's stream is busy.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cuda_pinned::{PinnedVec, Stream};
use pinned_loader::{
    Assembly, BoxError, Dataset, DeviceLoader, Field, Loader, LoaderConfig, PinnedSamples,
};

pub(crate) const IMAGE: usize = 3 * 32 * 32;

/// Sample `i`: an image of bytes `(i * 7 + k) % 251`, and the label `i`.
pub(crate) struct Images {
    pub(crate) len: usize,
}

pub(crate) fn image(i: usize) -> Vec<u8> {
    (0..IMAGE).map(|k| ((i * 7 + k) % 251) as u8).collect()
}

impl Dataset for Images {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        self.len
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(IMAGE), Field::new(1))
    }
    fn write(&self, i: usize, (pixels, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        pixels.copy_from_slice(&image(i));
        label[0] = i as i64;
        Ok(())
    }
}

/// Copies a batch back on `stream` (which waited for it) and checks every sample.
fn check_batch(
    stream: &Stream,
    (pixels, labels): (
        cuda_pinned::DeviceSlice<'_, u8>,
        cuda_pinned::DeviceSlice<'_, i64>,
    ),
) -> Vec<i64> {
    // Tracked copies on the consumer's stream: ordered after the batch without a host wait.
    let labels = stream
        .copy_from_device(labels, PinnedVec::<i64>::zeroed(labels.len()).unwrap())
        .unwrap();
    let pixels = stream
        .copy_from_device(pixels, PinnedVec::<u8>::zeroed(pixels.len()).unwrap())
        .unwrap();
    let (labels, pixels) = (labels.wait().unwrap(), pixels.wait().unwrap());
    for (label, sample) in labels.iter().zip(pixels.chunks(IMAGE)) {
        assert!(
            sample == image(*label as usize),
            "sample {label} arrived damaged"
        );
    }
    labels.to_vec()
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_batch_arrives_intact_both_ways() {
    let consumer = Stream::new().unwrap();
    for assembly in [Assembly::HostCollate, Assembly::DeviceGather] {
        let dataset = PinnedSamples::from_dataset(&Images { len: 300 }).unwrap();
        let config = LoaderConfig::new(32).workers(4).shuffle(3);
        let mut device =
            DeviceLoader::new(Loader::new(dataset, config).unwrap(), assembly).unwrap();
        for epoch in 0..2 {
            let mut seen = Vec::new();
            for batch in device.epoch(epoch) {
                let mut batch = batch.unwrap();
                let fields = batch.ready_on(&consumer).unwrap();
                seen.extend(check_batch(&consumer, fields));
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..300).collect::<Vec<i64>>(), "{assembly:?}");
        }
        let stats = device.stats();
        assert_eq!(stats.uploads, 20, "{assembly:?}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_slot_is_not_refilled_while_its_upload_is_pending() {
    let consumer = Stream::new().unwrap();
    // Few slots: the workers must reuse them while uploads from them are held back.
    let config = LoaderConfig::new(16).workers(2).prefetch(1);
    let mut device = DeviceLoader::new(
        Loader::new(Images { len: 320 }, config).unwrap(),
        Assembly::HostCollate,
    )
    .unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let flag = released.clone();
    device
        .stream()
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(300));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    // All 20 batches are taken while the copy stream is held: their uploads queue up behind
    // the hold, and their host slots go back to the workers with the uploads pending.
    let mut batches: Vec<_> = device.epoch(0).map(Result::unwrap).collect();
    assert_eq!(batches.len(), 20);
    let mut seen = Vec::new();
    for batch in &mut batches {
        let fields = batch.ready_on(&consumer).unwrap();
        seen.extend(check_batch(&consumer, fields));
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..320).collect::<Vec<i64>>());
    assert!(released.load(Ordering::SeqCst));
}

#[test]
#[ignore = "needs a CUDA device"]
fn uploads_run_while_the_consumer_stream_is_busy() {
    let consumer = Stream::new().unwrap();
    // The consumer's "training step": a memset of 16 GiB, milliseconds of device work.
    let mut work = cuda_pinned::DeviceBuffer::<u8>::zeroed(16 << 30).unwrap();
    let mut device = DeviceLoader::new(
        Loader::new(Images { len: 4096 }, LoaderConfig::new(16).workers(2)).unwrap(),
        Assembly::HostCollate,
    )
    .unwrap();
    let mut epoch = device.epoch(0);
    let mut overlapped = 0;
    let mut seen = Vec::new();
    // Other tests' device-wide calls (a `cudaFree`) can stall any stream for a while: try a
    // few rounds, one overlap suffices.
    for _ in 0..20 {
        if overlapped > 0 {
            break;
        }
        let mut batch = epoch.next().unwrap().unwrap();
        let _ = batch.ready_on(&consumer).unwrap();
        // Done with the batch before the long work: its memory may be reused meanwhile (a
        // batch dropped after the work would hold its memory back until the work ended).
        drop(batch);
        let start = consumer.record_event().unwrap();
        work.slice_mut(..).set_bytes_async(1, &consumer).unwrap();
        let end = consumer.record_event().unwrap();
        // The next batches upload meanwhile, on the loader's stream.
        let next: Vec<_> = (0..3).map(|_| epoch.next().unwrap().unwrap()).collect();
        consumer.synchronize().unwrap();
        let work_ms = end.elapsed_ms_since(&start).unwrap();
        for batch in &next {
            batch.ready_event().synchronize().unwrap();
            let ready_ms = batch.ready_event().elapsed_ms_since(&start).unwrap();
            // Uploads queued after the work began and done before it ended overlapped it.
            seen.push((ready_ms, work_ms));
            if ready_ms > 0.0 && ready_ms < work_ms {
                overlapped += 1;
            }
        }
    }
    assert!(
        overlapped > 0,
        "no upload ran while the consumer's stream worked"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_batches_of_a_loader_copy_to_the_device() {
    let stream = Stream::new().unwrap();
    let mut loader = Loader::new(Images { len: 64 }, LoaderConfig::new(64).workers(3)).unwrap();
    let batch = loader.epoch(0).next().unwrap().unwrap();
    let (pixels, labels) = batch.fields();
    let mut device = cuda_pinned::DeviceBuffer::<u8>::zeroed(pixels.len()).unwrap();
    device.copy_from_host(pixels).unwrap();
    let back = device.to_vec().unwrap();
    for (label, sample) in labels.iter().zip(back.chunks(IMAGE)) {
        assert!(sample == image(*label as usize));
    }
    drop(stream);
}

/// Host batches' fields go to tracked copies as they are, without pinning again: every
/// upload lands intact, and a batch whose upload was dropped unwaited while its stream was
/// held is not refilled under it (few slots force the reuse).
#[test]
#[ignore = "needs a CUDA device"]
fn host_batch_fields_upload_as_tracked_buffers() {
    let stream = Stream::new().unwrap();
    let config = LoaderConfig::new(16).workers(2).prefetch(1);
    let mut loader = Loader::new(Images { len: 16 * 12 }, config).unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let flag = released.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(300));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    let mut devices = Vec::new();
    for batch in loader.epoch(0) {
        let (pixels, labels) = batch.unwrap().into_buffers();
        let mut on_device = (
            cuda_pinned::DeviceBuffer::<u8>::zeroed(pixels.len()).unwrap(),
            cuda_pinned::DeviceBuffer::<i64>::zeroed(labels.len()).unwrap(),
        );
        // Dropped unwaited: the loader may refill the memory only after the copies.
        drop(stream.copy_to_device(pixels, &mut on_device.0).unwrap());
        drop(stream.copy_to_device(labels, &mut on_device.1).unwrap());
        devices.push(on_device);
    }
    assert_eq!(devices.len(), 12);
    let mut seen = Vec::new();
    for (pixels, labels) in &devices {
        let (pixels, labels) = (pixels.to_vec().unwrap(), labels.to_vec().unwrap());
        for (label, sample) in labels.iter().zip(pixels.chunks(IMAGE)) {
            assert!(
                sample == image(*label as usize),
                "sample {label} arrived damaged"
            );
        }
        seen.extend(labels);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..16 * 12).collect::<Vec<i64>>());
    assert!(released.load(Ordering::SeqCst));
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_loader_per_device_sharing_a_pool_delivers_every_sample_once() {
    let devices = cuda_pinned::Device::all().unwrap();
    let world = devices.len();
    let pool = Arc::new(pinned_pool::Pool::new());
    // The consumer thread stays on device 0 whichever device each loader feeds.
    devices[0].set_current().unwrap();
    for assembly in [Assembly::HostCollate, Assembly::DeviceGather] {
        let mut seen = Vec::new();
        for (rank, &device) in devices.iter().enumerate() {
            let dataset = PinnedSamples::from_dataset(&Images { len: 250 }).unwrap();
            let config = LoaderConfig::new(16)
                .workers(2)
                .shuffle(5)
                .shard(rank, world)
                .drop_last(true)
                .pool(pool.clone())
                .device(device);
            let mut loader =
                DeviceLoader::new(Loader::new(dataset, config).unwrap(), assembly).unwrap();
            assert_eq!(loader.device(), device);
            let consumer = Stream::on(device).unwrap();
            for batch in loader.epoch(1) {
                let mut batch = batch.unwrap();
                assert_eq!(batch.device(), device);
                let fields = batch.ready_on(&consumer).unwrap();
                seen.extend(check_batch(&consumer, fields));
            }
            assert_eq!(cuda_pinned::Device::current().unwrap(), devices[0]);
        }
        // Each rank gets 250 / world samples (drop_last), all distinct, none damaged.
        let per_rank = 250 / world;
        let before = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            before,
            seen.len(),
            "{assembly:?}: a sample went to two devices"
        );
        assert_eq!(seen.len(), per_rank / 16 * 16 * world, "{assembly:?}");
    }
    assert_eq!(pool.stats().active_requests.current, 0);
}

/// A copy of a batch's field that the consumer queued on a stream of its own (tracked by the
/// field's device buffer) reads that batch, not a later one written into the same slot after
/// the batch was dropped, whichever way batches are assembled.
#[test]
#[ignore = "needs a CUDA device"]
fn a_dropped_batch_is_not_overwritten_under_a_copy_still_reading_it() {
    for assembly in [Assembly::HostCollate, Assembly::DeviceGather] {
        let dataset = PinnedSamples::from_dataset(&Images { len: 16 * 40 }).unwrap();
        let loader = Loader::new(dataset, LoaderConfig::new(16).workers(2)).unwrap();
        let mut device = DeviceLoader::new(loader, assembly).unwrap();
        let consumer = Stream::new().unwrap();
        let other = Stream::new().unwrap();
        let mut epoch = device.epoch(0);
        let mut first = epoch.next().unwrap().unwrap();
        // `other` is held back, then downloads the labels once the batch is ready.
        other
            .launch_host_fn(|| std::thread::sleep(Duration::from_millis(300)))
            .unwrap();
        other.wait_event(first.ready_event()).unwrap();
        let (_, labels) = first.ready_on(&consumer).unwrap();
        let download = other
            .copy_from_device(labels, PinnedVec::<i64>::zeroed(16).unwrap())
            .unwrap();
        drop(first);
        // The next batches take slots (the freed one first) while `other` is held.
        let rest: Vec<_> = epoch.by_ref().take(6).map(Result::unwrap).collect();
        let labels = download.wait().unwrap();
        assert_eq!(
            &labels[..],
            &(0..16).collect::<Vec<i64>>()[..],
            "{assembly:?}: the download read another batch"
        );
        drop(rest);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn indices_on_the_device_match_the_host_ones_and_the_labels_both_ways() {
    let consumer = Stream::new().unwrap();
    for assembly in [Assembly::HostCollate, Assembly::DeviceGather] {
        let dataset = PinnedSamples::from_dataset(&Images { len: 203 }).unwrap();
        let config = LoaderConfig::new(16).workers(3).shuffle(11);
        let loader = Loader::new(dataset, config).unwrap();
        let mut device = DeviceLoader::new(loader, assembly).unwrap().with_indices();
        let mut seen = 0;
        for batch in device.epoch(1) {
            let mut batch = batch.unwrap();
            let host: Vec<i64> = batch.indices().iter().map(|&i| i as i64).collect();
            let on_device = batch.indices_on(&consumer).unwrap().to_vec().unwrap();
            assert_eq!(on_device, host, "{assembly:?} batch {}", batch.index());
            // The label of sample j is its dataset index: the same order as the fields.
            let (_, labels) = batch.ready_on(&consumer).unwrap();
            assert_eq!(labels.to_vec().unwrap(), host, "{assembly:?}");
            seen += host.len();
        }
        assert_eq!(seen, 203);
    }
    // Not asked for: a clear error, not a hang or a panic.
    let dataset = PinnedSamples::from_dataset(&Images { len: 8 }).unwrap();
    let loader = Loader::new(dataset, LoaderConfig::new(4)).unwrap();
    let mut device = DeviceLoader::new(loader, Assembly::DeviceGather).unwrap();
    let mut batch = device.epoch(0).next().unwrap().unwrap();
    let error = batch.indices_on(&consumer).unwrap_err();
    assert!(error.to_string().contains("with_indices"), "{error}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_fields_to_vec_waits_for_a_gathered_batch_without_a_stream_of_its_own() {
    // Gathers are raw batched copies: `to_vec` on another stream must still wait for them.
    let consumer = Stream::new().unwrap();
    let dataset = PinnedSamples::from_dataset(&Images { len: 4096 }).unwrap();
    let loader = Loader::new(dataset, LoaderConfig::new(1024)).unwrap();
    let mut device = DeviceLoader::new(loader, Assembly::DeviceGather).unwrap();
    for batch in device.epoch(0) {
        let mut batch = batch.unwrap();
        let (pixels, labels) = batch.ready_on(&consumer).unwrap();
        let labels = labels.to_vec().unwrap();
        let pixels = pixels.to_vec().unwrap();
        for (label, sample) in labels.iter().zip(pixels.chunks(IMAGE)) {
            assert!(
                sample == image(*label as usize),
                "sample {label} read early"
            );
        }
    }
}
