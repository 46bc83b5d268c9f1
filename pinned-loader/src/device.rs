//! `DeviceLoader`: batches on the device, uploaded on a stream of the loader's own; the
//! consumer's stream waits for each on the device (PyTorch's `non_blocking=True`).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use cuda_pinned::{Device, DeviceBuffer, DeviceSlice, Event, PinnedVec, RawCopy, Stream, Transfer};

use crate::batch::HostBatch;
use crate::dataset::Dataset;
use crate::error::LoaderError;
use crate::fields::Fields;
use crate::loader::{Epoch, Loader};
use crate::slot::Region;
use crate::stats::{EpochStats, LoaderStats};

/// How a device batch is assembled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assembly {
    /// Workers write samples into a pinned batch on the host; one upload per field.
    HostCollate,
    /// The samples already sit in pinned memory ([`PinnedSamples`](crate::PinnedSamples)):
    /// the DMA engine copies each straight into its place in the device batch, all in one
    /// batched copy. No host `memcpy`, no workers.
    DeviceGather,
}

/// Device memory for one batch: a buffer per field, and the consumer's events after which
/// it may be written again.
struct DeviceSlot {
    buffers: Vec<DeviceBuffer<u8>>,
    /// The batch's sample indices, where the loader uploads them
    /// ([`DeviceLoader::with_indices`]); made at the slot's first use.
    indices: Option<IndexSlot>,
    released: Vec<Event>,
    /// Events around the last upload into it and its bytes, for the upload time.
    timing: Option<(Event, Event, usize)>,
}

/// A slot's sample indices: filled on the host in page-locked memory, uploaded with the
/// fields. The host buffer travels with its upload and comes back when the upload is done,
/// so that it is never refilled while the DMA reads it.
struct IndexSlot {
    host: IndexHost,
    device: DeviceBuffer<i64>,
}

enum IndexHost {
    Uploading(Transfer<PinnedVec<i64>>),
    /// An upload that failed to be queued or waited for: a new buffer comes next time.
    Lost,
}

impl Drop for DeviceSlot {
    fn drop(&mut self) {
        // The consumer's work may still read the buffers: they are freed after it, or leaked
        // when that cannot be known.
        if !self.released.iter().all(|e| e.synchronize().is_ok()) {
            std::mem::forget(std::mem::take(&mut self.buffers));
            std::mem::forget(self.indices.take());
        }
    }
}

type DeviceSlots = Arc<Mutex<Vec<DeviceSlot>>>;

/// Batches of a [`Dataset`] on the device, ready when a stream's work reaches them:
///
/// ```no_run
/// # use pinned_loader::*;
/// # fn run<D: Dataset<Fields = (Field<u8>, Field<i64>)>>(loader: Loader<D>) -> Result<(), LoaderError> {
/// let stream = cuda_pinned::Stream::new()?;
/// let mut device = DeviceLoader::new(loader, Assembly::HostCollate)?;
/// for batch in device.epoch(0) {
///     let mut batch = batch?;
///     let (images, labels) = batch.ready_on(&stream)?; // the stream waits; the host does not
///     // ... queue work on `stream` reading `images` and `labels` ...
/// } // each batch's memory is reused only after `stream` has passed its work
/// # Ok(()) }
/// ```
pub struct DeviceLoader<D: Dataset> {
    /// Dropped only once the stream has finished (its gathers read the dataset's memory).
    loader: std::mem::ManuallyDrop<Loader<D>>,
    stream: Stream,
    assembly: Assembly,
    /// Batches uploaded ahead of the consumer.
    ahead: usize,
    slots: DeviceSlots,
    /// Whether each batch's sample indices go to the device too.
    indices: bool,
}

impl<D: Dataset> DeviceLoader<D> {
    /// A device loader over `loader`, with its own copy stream and device memory.
    ///
    /// Its device memory holds the batches it uploads ahead (two) and those the consumer holds (two
    /// more), on the loader's [`device`](crate::LoaderConfig::device). The calling thread's current
    /// device is left as it was.
    ///
    /// # Errors
    ///
    /// [`LoaderError::NotPinned`] for [`Assembly::DeviceGather`] over a dataset not in pinned
    /// memory; the CUDA error (no device, out of device memory).
    pub fn new(loader: Loader<D>, assembly: Assembly) -> Result<Self, LoaderError> {
        if assembly == Assembly::DeviceGather {
            gathered_storage(&loader.shared)?;
        }
        let device = match loader.shared.device {
            Some(device) => device,
            None => Device::current()?,
        };
        let stream = Stream::on(device)?;
        let ahead = 2;
        let slots = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..ahead + 2 {
            let slot = new_slot(&loader.shared, device)?;
            slots
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(slot);
        }
        Ok(Self {
            loader: std::mem::ManuallyDrop::new(loader),
            stream,
            assembly,
            ahead,
            slots,
            indices: false,
        })
    }

    /// Uploads each batch's dataset indices too, as `i64` (the index type of PyTorch and
    /// candle), for kernels that need them ([`DeviceBatch::indices_on`]); ordered like the
    /// fields, and ready with them.
    pub fn with_indices(mut self) -> Self {
        self.indices = true;
        self
    }

    /// The stream the uploads run on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device the batches go to.
    pub fn device(&self) -> Device {
        self.stream.device()
    }

    /// The host loader behind it.
    pub fn loader(&self) -> &Loader<D> {
        &self.loader
    }

    /// What the loader has done so far, uploads included.
    pub fn stats(&self) -> LoaderStats {
        self.loader.stats()
    }

    /// Each epoch's figures, uploads included, the latest last ([`Loader::epoch_stats`]).
    pub fn epoch_stats(&self) -> &[EpochStats] {
        self.loader.epoch_stats()
    }

    /// The batches of epoch `epoch` on the device.
    pub fn epoch(&mut self, epoch: u64) -> DeviceEpoch<'_, D> {
        let shared = self.loader.shared.clone();
        let Self {
            loader,
            stream,
            assembly,
            ahead,
            slots,
            indices: upload_indices,
        } = self;
        let source = match assembly {
            Assembly::HostCollate => Source::Host(loader.epoch(epoch)),
            Assembly::DeviceGather => {
                let indices = Arc::new(loader.sampler.indices(epoch));
                let batches = loader.sampler.batches(indices.len()).into();
                Source::Gather {
                    indices,
                    batches,
                    next: 0,
                }
            }
        };
        DeviceEpoch {
            stream,
            slots,
            shared,
            source,
            ready: VecDeque::new(),
            depth: *ahead,
            upload_indices: *upload_indices,
        }
    }
}

impl<D: Dataset> Drop for DeviceLoader<D> {
    fn drop(&mut self) {
        // Gathers read the dataset's pinned memory: they end before it can go, and when that
        // cannot be known the loader and its dataset are leaked.
        if self.stream.synchronize().is_ok() {
            // SAFETY: dropped once, here; `self.loader` is not used afterwards.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.loader) };
        }
    }
}

/// The dataset's pinned storage, if its samples have the sizes the loader's device memory is
/// made for (a storage of other sizes would have the DMA write past the buffers).
fn gathered_storage<D: Dataset>(
    shared: &crate::loader::Shared<D>,
) -> Result<&crate::dataset::PinnedStorage, LoaderError> {
    let storage = shared
        .dataset
        .pinned_storage()
        .ok_or(LoaderError::NotPinned)?;
    if storage.sample_bytes() != &shared.sample_bytes[..] || storage.len() < shared.dataset.len() {
        return Err(LoaderError::Config(format!(
            "the pinned storage holds {} samples of {:?} bytes, the dataset {} of {:?}",
            storage.len(),
            storage.sample_bytes(),
            shared.dataset.len(),
            &shared.sample_bytes[..]
        )));
    }
    Ok(storage)
}

fn new_slot<D: Dataset>(
    shared: &crate::loader::Shared<D>,
    device: Device,
) -> Result<DeviceSlot, LoaderError> {
    let buffers = shared
        .region_bytes
        .iter()
        .map(|&bytes| DeviceBuffer::zeroed_on(device, bytes))
        .collect::<Result<_, _>>()?;
    Ok(DeviceSlot {
        buffers,
        indices: None,
        released: Vec::new(),
        timing: None,
    })
}

/// Where an epoch's batches come from.
enum Source<'a, D: Dataset> {
    Host(Epoch<'a, D>),
    Gather {
        indices: Arc<Vec<usize>>,
        batches: VecDeque<Range<usize>>,
        next: usize,
    },
}

/// A batch's number in its epoch and its samples: a range of the epoch's order, shared by
/// every batch of the epoch.
struct Placed {
    index: usize,
    order: Arc<Vec<usize>>,
    range: Range<usize>,
}

/// One epoch's batches on the device: an iterator of `Result<DeviceBatch, LoaderError>`.
/// Uploads run ahead of the consumer (two batches), on the loader's stream.
pub struct DeviceEpoch<'a, D: Dataset> {
    stream: &'a Stream,
    slots: &'a DeviceSlots,
    shared: Arc<crate::loader::Shared<D>>,
    source: Source<'a, D>,
    ready: VecDeque<Result<DeviceBatch<D::Fields>, LoaderError>>,
    depth: usize,
    upload_indices: bool,
}

impl<D: Dataset> DeviceEpoch<'_, D> {
    /// Device memory for a batch: a free slot, or a new one when the consumer holds them
    /// all. The stream waits (on the device) for the consumer's last use of it.
    fn take_slot(&self) -> Result<DeviceSlot, LoaderError> {
        let free = self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut slot = match free {
            Some(slot) => slot,
            None => new_slot(&self.shared, self.stream.device())?,
        };
        for event in &slot.released {
            if let Err(error) = self.stream.wait_event(event) {
                // Nobody can tell when the consumer is done with it (its event was taken by
                // a capture, or the device is in an error state): out of use for good.
                std::mem::forget(slot);
                return Err(error.into());
            }
        }
        slot.released.clear();
        if let Some((start, end, bytes)) = slot.timing.take()
            && let Ok(ms) = end.elapsed_ms_since(&start)
        {
            let counters = &self.shared.counters;
            counters
                .upload_ns
                .fetch_add((f64::from(ms) * 1e6) as u64, Ordering::Relaxed);
            counters
                .timed_bytes
                .fetch_add(bytes as u64, Ordering::Relaxed);
        }
        Ok(slot)
    }

    /// Uploads a host batch into device memory; its pinned slot goes back to the workers
    /// with the uploads, which they wait for before refilling it.
    fn upload(
        &mut self,
        batch: HostBatch<D::Fields>,
    ) -> Result<DeviceBatch<D::Fields>, LoaderError> {
        let (len, index) = (batch.len(), batch.index());
        let _span = tracing::debug_span!("upload", batch = index, samples = len).entered();
        let (order, range) = (batch.order.clone(), batch.range.clone());
        let mut device = self.take_slot()?;
        let start = match self.stream.record_event() {
            Ok(start) => start,
            Err(error) => {
                self.abandon(device);
                return Err(error.into());
            }
        };
        let mut host = batch.into_slot();
        let mut bytes_moved = 0;
        let mut result = Ok(());
        for ((region, buffer), &sample_bytes) in host
            .regions
            .iter_mut()
            .zip(&mut device.buffers)
            .zip(self.shared.sample_bytes.iter())
        {
            let bytes = len * sample_bytes;
            let Region::Ready(mut part) = std::mem::replace(region, Region::Lost) else {
                unreachable!("a delivered batch is ready");
            };
            part.set_len(bytes);
            match self.stream.copy_to_device(part, buffer.slice_mut(..bytes)) {
                Ok(upload) => *region = Region::Uploading(upload),
                Err(error) => {
                    // The region is lost (given back once nothing can use it); the slot pins
                    // a new one when it is next filled.
                    result = Err(error);
                    break;
                }
            }
            bytes_moved += bytes;
        }
        self.shared.slots.give(host);
        let result = result.and_then(|()| self.upload_indices(&mut device, &order[range.clone()]));
        if let Err(error) = result {
            self.abandon(device);
            return Err(error.into());
        }
        let batch = Placed {
            index,
            order,
            range,
        };
        self.finish(device, start, batch, bytes_moved)
    }

    /// Gathers a batch's samples from pinned memory straight into device memory.
    fn gather(&mut self, batch: Placed) -> Result<DeviceBatch<D::Fields>, LoaderError> {
        let indices = &batch.order[batch.range.clone()];
        let shared = self.shared.clone();
        let storage = gathered_storage(&shared)?;
        let mut device = self.take_slot()?;
        let start = match self.stream.record_event() {
            Ok(start) => start,
            Err(error) => {
                self.abandon(device);
                return Err(error.into());
            }
        };
        let mut copies = Vec::with_capacity(indices.len() * device.buffers.len());
        let mut bytes_moved = 0;
        for (field, buffer) in device.buffers.iter().enumerate() {
            let bytes = storage.sample_bytes()[field];
            for (position, &sample) in indices.iter().enumerate() {
                copies.push(RawCopy {
                    dst: buffer.as_raw() + (position * bytes) as u64,
                    src: storage.address(sample, field),
                    bytes,
                });
                bytes_moved += bytes;
            }
        }
        // Copies the consumer made of an earlier batch in this slot on streams of its own
        // (tracked by the buffers) come before these writes, as they do before a collated
        // batch's uploads.
        let ordered = device
            .buffers
            .iter()
            .try_for_each(|buffer| buffer.order_after_copies(self.stream));
        // SAFETY: each source is a sample in the dataset's page-locked storage, which is
        // never written and outlives the copies (the device loader owns the dataset and
        // waits for its stream before dropping it); each destination lies inside a buffer of
        // this slot (position < batch size; the storage's sample sizes are the buffers',
        // checked above), which nothing else uses until the batch is delivered, and the
        // consumer's earlier uses were waited for: those on the streams it named in
        // `take_slot`, its tracked copies just above.
        let queued = ordered
            .and_then(|()| unsafe { self.stream.copy_batch_raw(&copies) })
            .and_then(|()| self.upload_indices(&mut device, indices));
        match queued {
            Ok(()) => self.finish(device, start, batch, bytes_moved),
            Err(error) => {
                self.abandon(device);
                Err(error.into())
            }
        }
    }

    /// Queues the upload of a batch's sample `indices` into the slot, where the loader
    /// uploads them.
    fn upload_indices(
        &self,
        slot: &mut DeviceSlot,
        indices: &[usize],
    ) -> Result<(), cuda_pinned::Error> {
        if !self.upload_indices {
            return Ok(());
        }
        // A full batch, as the fields' regions hold one (at least these indices).
        let capacity = (self
            .shared
            .region_bytes
            .iter()
            .zip(self.shared.sample_bytes.iter()))
        .find(|&(_, &sample)| sample > 0)
        .map_or(0, |(&region, &sample)| region / sample)
        .max(indices.len());
        let index = match slot.indices.take() {
            Some(index) if index.device.len() >= indices.len() => index,
            _ => IndexSlot {
                host: IndexHost::Lost,
                device: DeviceBuffer::zeroed_on(self.stream.device(), capacity)?,
            },
        };
        let IndexSlot { host, mut device } = index;
        let mut host = match host {
            // Done long ago, as a rule: it was queued before the batch this slot last held.
            IndexHost::Uploading(upload) => upload.wait()?,
            IndexHost::Lost => PinnedVec::with_capacity(capacity)?,
        };
        host.clear();
        host.extend(indices.iter().map(|&i| i as i64));
        let len = host.len();
        let upload = self.stream.copy_to_device(host, device.slice_mut(..len));
        let host = match upload {
            Ok(upload) => IndexHost::Uploading(upload),
            Err(error) => {
                slot.indices = Some(IndexSlot {
                    host: IndexHost::Lost,
                    device,
                });
                return Err(error);
            }
        };
        slot.indices = Some(IndexSlot { host, device });
        Ok(())
    }

    /// Gives up on a slot whose copies may be queued: freed once the stream has finished,
    /// leaked when that cannot be known.
    fn abandon(&self, device: DeviceSlot) {
        if self.stream.synchronize().is_err() {
            std::mem::forget(device);
        }
    }

    fn finish(
        &mut self,
        mut device: DeviceSlot,
        start: Event,
        batch: Placed,
        bytes: usize,
    ) -> Result<DeviceBatch<D::Fields>, LoaderError> {
        let events = self
            .stream
            .record_event()
            .and_then(|end| Ok((end, Arc::new(self.stream.record_event()?))));
        let (end, ready) = match events {
            Ok(events) => events,
            Err(error) => {
                self.abandon(device);
                return Err(error.into());
            }
        };
        device.timing = Some((start, end, bytes));
        // Copies through the fields' views on other streams (`to_vec` among them) wait for
        // the batch too, gathered by raw copies or not.
        for buffer in &device.buffers {
            buffer.track_event(self.stream, ready.clone());
        }
        if let Some(indices) = &device.indices {
            indices.device.track_event(self.stream, ready.clone());
        }
        let counters = &self.shared.counters;
        counters.uploads.fetch_add(1, Ordering::Relaxed);
        counters
            .uploaded_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(DeviceBatch {
            slot: Some(device),
            ready,
            len: batch.range.len(),
            index: batch.index,
            order: batch.order,
            range: batch.range,
            fields: self.shared.fields.clone(),
            sample_bytes: self.shared.sample_bytes.clone(),
            streams: Vec::new(),
            home: self.slots.clone(),
        })
    }

    /// Queues the next batch's upload; `false` when there is nothing (ready) to queue.
    fn queue_one(&mut self, block: bool) -> bool {
        let next = match &mut self.source {
            Source::Host(epoch) => match epoch.poll(block) {
                Some(Some(Ok(batch))) => Some(Ok(Ok(batch))),
                Some(Some(Err(error))) => Some(Err(error)),
                Some(None) | None => None,
            },
            Source::Gather {
                indices,
                batches,
                next,
            } => batches.pop_front().map(|range| {
                let index = *next;
                *next += 1;
                Ok(Err(Placed {
                    index,
                    order: indices.clone(),
                    range,
                }))
            }),
        };
        let Some(next) = next else {
            return false;
        };
        let batch = match next {
            Ok(Ok(host)) => self.upload(host),
            Ok(Err(placed)) => {
                let samples = placed.range.len();
                let batch = self.gather(placed);
                if batch.is_ok() {
                    let counters = &self.shared.counters;
                    counters.batches.fetch_add(1, Ordering::Relaxed);
                    counters
                        .samples
                        .fetch_add(samples as u64, Ordering::Relaxed);
                }
                batch
            }
            Err(error) => Err(error),
        };
        self.ready.push_back(batch);
        true
    }
}

impl<D: Dataset> Iterator for DeviceEpoch<'_, D> {
    type Item = Result<DeviceBatch<D::Fields>, LoaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        // Keep `depth` uploads queued ahead, waiting only when none is.
        if self.ready.is_empty() {
            self.queue_one(true);
        }
        while self.ready.len() <= self.depth && self.queue_one(false) {}
        self.ready.pop_front()
    }
}

/// A batch in device memory.
///
/// Its fields are reached through [`ready_on`](Self::ready_on), which makes a stream wait for the
/// upload on the device; when the batch drops, its memory is reused only after every such stream
/// has passed the work queued on it so far.
pub struct DeviceBatch<F: Fields> {
    slot: Option<DeviceSlot>,
    ready: Arc<Event>,
    len: usize,
    index: usize,
    order: Arc<Vec<usize>>,
    range: Range<usize>,
    fields: F,
    sample_bytes: Arc<[usize]>,
    streams: Vec<Stream>,
    home: DeviceSlots,
}

impl<F: Fields> DeviceBatch<F> {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch has no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The batch's number in its epoch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The dataset indices of the batch's samples, in the order the batch holds them.
    ///
    /// As [`HostBatch::indices`]: sample `j` of every field is dataset sample `indices()[j]`.
    pub fn indices(&self) -> &[usize] {
        &self.order[self.range.clone()]
    }

    /// The event that completes when the batch is on the device.
    pub fn ready_event(&self) -> &Event {
        &self.ready
    }

    /// The device the batch is on.
    pub fn device(&self) -> Device {
        self.ready.device()
    }

    /// Makes `stream` wait (on the device, the host does not block) until the batch is there, and
    /// returns its fields for work queued on `stream`.
    ///
    /// Use them on no other stream unless it too was passed here. Copies through them on the
    /// host's behalf ([`DeviceSlice::to_vec`](cuda_pinned::DeviceSlice::to_vec),
    /// `copy_to_host`) wait for the batch by themselves.
    ///
    /// # Errors
    ///
    /// [`cuda_pinned::Error::DeviceMismatch`] for a stream of another device than the
    /// batch's (CUDA would let it wait, but its work could read the batch only through peer
    /// access, which this crate does not set up: a batch per device is the way), or the
    /// CUDA error.
    pub fn ready_on(&mut self, stream: &Stream) -> Result<F::Device<'_>, LoaderError> {
        if stream.device() != self.device() {
            return Err(cuda_pinned::Error::DeviceMismatch {
                what: "the consumer's stream",
                expected: self.device().ordinal(),
                found: stream.device().ordinal(),
            }
            .into());
        }
        stream.wait_event(&self.ready)?;
        if !self.streams.contains(stream) {
            self.streams.push(stream.clone());
        }
        let slot = self.slot.as_ref().expect("a delivered batch has its slot");
        let mut regions = slot
            .buffers
            .iter()
            .zip(self.sample_bytes.iter())
            .map(|(buffer, &bytes)| buffer.slice(..self.len * bytes));
        Ok(self.fields.device(&mut regions))
    }
}

impl<F: Fields> DeviceBatch<F> {
    /// Makes `stream` wait as [`ready_on`](Self::ready_on) does, and returns the batch's
    /// dataset indices on the device: element `j` is the index of sample `j` of every field
    /// ([`indices`](Self::indices) on the host), as `i64`.
    ///
    /// # Errors
    ///
    /// [`LoaderError::Config`] unless the loader uploads indices
    /// ([`DeviceLoader::with_indices`]); then as [`ready_on`](Self::ready_on).
    pub fn indices_on(&mut self, stream: &Stream) -> Result<DeviceSlice<'_, i64>, LoaderError> {
        let uploaded = self
            .slot
            .as_ref()
            .is_some_and(|slot| slot.indices.is_some());
        if !uploaded {
            return Err(LoaderError::Config(
                "the batch's indices are not on the device: ask the loader for them with \
                 `DeviceLoader::with_indices`"
                    .into(),
            ));
        }
        self.ready_on(stream)?;
        let slot = self.slot.as_ref().expect("a delivered batch has its slot");
        let indices = slot.indices.as_ref().expect("checked above");
        Ok(indices.device.slice(..self.len))
    }
}

impl<F: Fields> Drop for DeviceBatch<F> {
    fn drop(&mut self) {
        let Some(mut slot) = self.slot.take() else {
            return;
        };
        // A graph captured on a consumer's stream may read the slot at any launch (and a
        // loader stream waiting on an event of the capture would join it): such a slot is
        // kept out of use for good. Asked before any event is recorded, and again after each.
        let capturing = |stream: &Stream| matches!(stream.is_capturing(), Ok(true));
        if self.streams.iter().any(capturing) {
            std::mem::forget(slot);
            return;
        }
        for stream in &self.streams {
            match stream.record_event() {
                Ok(event) if capturing(stream) => {
                    slot.released.push(event);
                    std::mem::forget(slot);
                    return;
                }
                Ok(event) => slot.released.push(event),
                Err(_) if stream.synchronize().is_ok() => {}
                Err(_) => {
                    // Nobody can tell when the stream is done with the memory: keep it out
                    // of use for good.
                    std::mem::forget(slot);
                    return;
                }
            }
        }
        self.home
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
    }
}

impl<F: Fields> std::fmt::Debug for DeviceBatch<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("index", &self.index)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}
