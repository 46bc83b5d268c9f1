//! Loading a checkpoint's tensors onto a device, each ready on its own event, and fanning
//! them out to other devices as they land.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use cuda_pinned::{Device, DeviceBuffer, DeviceSlice, Event, RawCopy, Stream};
use safetensors::Dtype;

use super::header::{Header, TensorSpec};
use super::index::ShardIndex;
use super::split::{Split, extent};
use crate::engine::crew::Crew;
use crate::engine::cuda::Cuda;
use crate::engine::{self, Destination, Job};
use crate::error::{Error, Result};
use crate::file::DataFile;
use crate::plan::{self, Span};
use crate::reader::FileReader;

/// Tensors start on this alignment in device memory (what CUDA's allocations give, and more
/// than any vectorised load wants).
const DEVICE_ALIGN: u64 = 256;

/// A safetensors checkpoint: one file, or the shards an index names; its headers read and
/// checked, its data not yet.
///
/// # Examples
///
/// ```no_run
/// use cuda_pinned::Stream;
/// use pinned_io::{Checkpoint, FileReader, LoadOptions};
///
/// let checkpoint = Checkpoint::open("model.safetensors.index.json")?;
/// let reader = FileReader::new()?;
/// let loading = checkpoint.load(&reader, &LoadOptions::new())?;
/// let stream = Stream::new()?;
/// // The first tensor is usable as soon as it has landed, while the rest still loads.
/// let embed = loading.tensor("model.embed_tokens.weight").expect("in the checkpoint");
/// let weights = embed.ready_on(&stream)?; // `stream` waits for it on the device
/// # let _ = weights;
/// let loaded = loading.wait()?; // every tensor on the device
/// # Ok::<(), pinned_io::Error>(())
/// ```
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<DataFile>,
    headers: Vec<Header>,
    /// (file, tensor) of every tensor, in the files' order and each file's offset order.
    order: Vec<(usize, usize)>,
    /// The bytes of all tensors (summed with a check: the sizes come from the files).
    bytes: u64,
}

impl Checkpoint {
    /// Opens a checkpoint: a `.safetensors` file, a sharded checkpoint's
    /// `*.safetensors.index.json`, or a directory holding either.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] for files that cannot be opened or read; [`Error::Format`] or
    /// [`Error::Truncated`] for a header or index that breaks the format (naming the file
    /// and, where one is at fault, the tensor); [`Error::Invalid`] for a directory with no
    /// checkpoint in it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            return Self::open_dir(path);
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Self::open_index(path);
        }
        Self::open_files(&[path.to_owned()], None)
    }

    fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Self::open_index(&index);
        }
        let listing = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "listing", e))?;
        let mut files = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io(dir, "listing", e))?;
            if entry.path().extension().is_some_and(|e| e == "safetensors") {
                files.push(entry.path());
            }
        }
        if files.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: no `.safetensors` file or `model.safetensors.index.json` in the directory",
                dir.display()
            )));
        }
        files.sort();
        Self::open_files(&files, None)
    }

    fn open_index(path: &Path) -> Result<Self> {
        let index = ShardIndex::read(path)?;
        let shards = index.shards().to_vec();
        Self::open_files(&shards, Some(&index))
    }

    fn open_files(paths: &[PathBuf], index: Option<&ShardIndex>) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut headers = Vec::with_capacity(paths.len());
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (shard, path) in paths.iter().enumerate() {
            let file = DataFile::open(path)?;
            let header = Header::read(file.std_file(), path)?;
            if let Some(index) = index {
                index.check_against(shard, &header)?;
            }
            files.push(file);
            headers.push(header);
        }
        for (shard, header) in headers.iter().enumerate() {
            for tensor in header.tensors() {
                if let Some(first) = seen.insert(tensor.name(), shard) {
                    return Err(Error::format(
                        header.path(),
                        Some(tensor.name()),
                        format!("also in {}", headers[first].path().display()),
                    ));
                }
            }
        }
        let order = headers
            .iter()
            .enumerate()
            .flat_map(|(f, h)| (0..h.tensors().len()).map(move |t| (f, t)))
            .collect();
        let bytes = total_bytes(&headers)?;
        Ok(Self {
            files,
            headers,
            order,
            bytes,
        })
    }

    /// The tensors, shard after shard, each in its file's order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorSpec> {
        self.order
            .iter()
            .map(|&(f, t)| &self.headers[f].tensors()[t])
    }

    /// The free-form `__metadata__` of the checkpoint's first file, where it has one.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.headers.first().and_then(Header::metadata)
    }

    /// The files the checkpoint reads.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(DataFile::path)
    }

    /// The bytes of all tensors.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Starts loading the tensors `options` selects onto `reader`'s device (and copies on
    /// the replicas' devices), and returns at once: each tensor is ready on its own event.
    ///
    /// The reader's threads read while the DMA engine copies; pinned memory is the reader's
    /// ring only, whatever the checkpoint's size. The selected tensors share one device
    /// allocation per device; while it is made (which can take milliseconds), the threads
    /// already read the first tensor into the ring. The first tensor's copies are queued
    /// before those of the tensors after it, so that it is usable as soon as it can be.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a split that does not fit a tensor; CUDA errors allocating the
    /// device memory or making the streams. Errors while loading reach the tensors and
    /// [`Loading::wait`].
    pub fn load(&self, reader: &FileReader, options: &LoadOptions) -> Result<Loading> {
        let plan = self.plan(options)?;
        let device = reader.device();
        let stream = Stream::on(device)?;
        // The reader's own device, or one named twice, holds its copy already.
        let mut others: Vec<Device> = Vec::with_capacity(options.replicas.len());
        for &other in &options.replicas {
            if other != device && !others.contains(&other) {
                others.push(other);
            }
        }
        // Each tensor's readiness on each device, the reader's first.
        let ready: Vec<Vec<Arc<Ready>>> = (0..=others.len())
            .map(|_| plan.iter().map(|_| Arc::default()).collect())
            .collect();
        // Offsets into the device memory, allocated below.
        let spans: Vec<Span> = plan
            .iter()
            .enumerate()
            .map(|(target, planned)| Span {
                file: planned.file,
                offset: planned.extent.offset,
                width: planned.extent.width,
                rows: planned.extent.rows,
                pitch: planned.extent.pitch,
                dst: planned.at,
                target,
            })
            .collect();
        let pieces = plan::cut(&spans, reader.crew.ring().capacity())?;
        // Whatever never landed when the job ends fails, so that no waiter hangs.
        let all_ready: Vec<Arc<Ready>> = ready.iter().flatten().cloned().collect();
        let done = Box::new(move |job: &Job<Cuda>| {
            let why = match job.error_message() {
                Some(error) => format!("the checkpoint's load failed: {error}"),
                None => "the checkpoint's load stopped".to_owned(),
            };
            for ready in &all_ready {
                ready.set(State::Failed(why.clone()));
            }
        });
        // The crew reads the first tensor while the device memory is allocated, which can
        // take milliseconds; what it reads waits in the ring, and goes to the device once the
        // memory is named.
        let job = Job::to_come(
            pieces,
            self.files.clone(),
            reader.config().mode,
            stream.clone(),
            plan.len(),
        )
        .when_done(done);
        let job = Arc::new(job);
        reader.crew.submit(&job);
        let coming = Coming {
            job: &job,
            crew: &reader.crew,
        };
        let (primary, replicas) = allocate(device, &others, &plan, &ready)?;
        let sink = fan_out(&primary, &replicas);
        coming.arrive(Destination {
            base: primary.memory.as_raw(),
            sink,
        });
        let (replicas, replica_streams): (Vec<OnDevice>, Vec<Stream>) =
            replicas.into_iter().unzip();
        Ok(Loading {
            primary,
            replicas,
            names: plan
                .iter()
                .enumerate()
                .map(|(i, p)| (p.name.clone(), i))
                .collect(),
            job,
            crew: reader.crew.clone(),
            stream,
            replica_streams,
        })
    }

    /// Where each selected tensor's bytes lie in its file and on the device.
    fn plan(&self, options: &LoadOptions) -> Result<Vec<Planned>> {
        let mut plan = Vec::new();
        let mut at = 0u64;
        for &(file, index) in &self.order {
            let spec = &self.headers[file].tensors()[index];
            if options.only.as_ref().is_some_and(|only| !only(spec)) {
                continue;
            }
            let split = options.split.as_ref().and_then(|split| split(spec));
            let (extent, shape) = extent(spec, split.as_ref(), self.files[file].path())?;
            plan.push(Planned {
                name: spec.name().to_owned(),
                dtype: spec.dtype(),
                shape,
                file,
                extent,
                at,
            });
            at = at
                .checked_add(extent.bytes())
                .and_then(|end| end.checked_next_multiple_of(DEVICE_ALIGN))
                .ok_or_else(|| Error::Invalid("a checkpoint's bytes overflow".into()))?;
        }
        Ok(plan)
    }
}

/// The bytes of every tensor of `headers` together; each file's were checked to fit it, but
/// several files (sparse ones, say) can claim more together than 64 bits count.
fn total_bytes(headers: &[Header]) -> Result<u64> {
    let mut total = 0u64;
    for header in headers {
        for tensor in header.tensors() {
            total = total.checked_add(tensor.bytes()).ok_or_else(|| {
                Error::format(
                    header.path(),
                    Some(tensor.name()),
                    "the checkpoint's tensors together hold more bytes than 64 bits count",
                )
            })?;
        }
    }
    Ok(total)
}

/// One selected tensor: where its bytes lie in its file and at which offset of the device
/// memory they go.
struct Planned {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    file: usize,
    extent: super::split::Extent,
    at: u64,
}

/// What a load selects and where it copies to.
#[derive(Clone, Default)]
pub struct LoadOptions {
    #[allow(clippy::type_complexity)]
    only: Option<Arc<dyn Fn(&TensorSpec) -> bool + Send + Sync>>,
    #[allow(clippy::type_complexity)]
    split: Option<Arc<dyn Fn(&TensorSpec) -> Option<Split> + Send + Sync>>,
    replicas: Vec<Device>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("only", &self.only.is_some())
            .field("split", &self.split.is_some())
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl LoadOptions {
    /// Every tensor, whole, onto the reader's device only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only the tensors `keep` says yes to.
    pub fn only(mut self, keep: impl Fn(&TensorSpec) -> bool + Send + Sync + 'static) -> Self {
        self.only = Some(Arc::new(keep));
        self
    }

    /// Each tensor's part that `split` names (a tensor-parallel rank's slice), or the whole
    /// tensor where it says `None`.
    pub fn split(
        mut self,
        split: impl Fn(&TensorSpec) -> Option<Split> + Send + Sync + 'static,
    ) -> Self {
        self.split = Some(Arc::new(split));
        self
    }

    /// Copies of every tensor on `devices` too, read from storage once: each tensor is copied
    /// device to device (over NVLink where the devices reach each other) as it lands. The
    /// reader's own device, and a device named twice, are taken once.
    pub fn replicate_to(mut self, devices: impl IntoIterator<Item = Device>) -> Self {
        self.replicas = devices.into_iter().collect();
        self
    }
}

/// A tensor's readiness: not yet queued, queued behind an event, or failed.
#[derive(Default)]
struct Ready {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
enum State {
    #[default]
    Pending,
    Queued(Arc<Event>),
    Failed(String),
}

impl Ready {
    fn set(&self, state: State) {
        let mut now = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if matches!(*now, State::Pending) {
            *now = state;
        }
        drop(now);
        self.changed.notify_all();
    }

    /// Waits until the tensor's copies are queued, then runs `then` with their event.
    fn when_queued<R>(&self, then: impl FnOnce(&Event) -> Result<R>) -> Result<R> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match &*state {
                State::Pending => {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                State::Queued(event) => return then(event),
                State::Failed(why) => return Err(Error::Invalid(why.clone())),
            }
        }
    }
}

/// The tensors on one device: their memory and their readiness.
struct OnDevice {
    device: Device,
    memory: Arc<DeviceBuffer<MaybeUninit<u8>>>,
    tensors: Vec<LoadedTensor>,
}

/// A load's job until its destination is named: dropped before (an error or a panic while
/// allocating) or while (a panic), the job is abandoned, so that its pieces do not wait for
/// memory that will not come, and no copy queued into that memory still runs when it is
/// freed.
struct Coming<'a> {
    job: &'a Job<Cuda>,
    crew: &'a Crew<Cuda>,
}

impl Coming<'_> {
    fn arrive(self, destination: Destination<Cuda>) {
        self.job.arrive(self.crew.ring(), destination);
        std::mem::forget(self);
    }
}

impl Drop for Coming<'_> {
    fn drop(&mut self) {
        let why = Error::Invalid("the load's device memory was not allocated".into());
        let ring = self.crew.ring();
        self.job.abandon(ring, why);
        // Only after a panic while naming the memory may copies into it be queued, by this
        // thread and the crew's until they find the job failed: waited for (the replicas'
        // copies are tracked by their memory). Else nothing waits for the crew.
        if self.job.named() {
            self.job.wait_finished();
            let _ = self.job.stream.synchronize();
        }
    }
}

/// Allocates the load's memory on the reader's device, and on each of `others` with a stream
/// to copy with; `ready` holds each device's tensors' readiness, the reader's first.
fn allocate(
    device: Device,
    others: &[Device],
    plan: &[Planned],
    ready: &[Vec<Arc<Ready>>],
) -> Result<(OnDevice, Vec<(OnDevice, Stream)>)> {
    let primary = OnDevice::new(device, plan, &ready[0])?;
    let mut replicas = Vec::with_capacity(others.len());
    for (&other, ready) in others.iter().zip(&ready[1..]) {
        // The replica's stream reads the reader's device's memory.
        if other.can_access_peer(device)? {
            other.enable_peer_access(device)?;
        }
        let stream = Stream::on(other)?;
        replicas.push((OnDevice::new(other, plan, ready)?, stream));
    }
    Ok((primary, replicas))
}

impl OnDevice {
    fn new(device: Device, plan: &[Planned], ready: &[Arc<Ready>]) -> Result<Self> {
        let bytes = plan.last().map_or(0, |p| p.at + p.extent.bytes());
        let bytes = usize::try_from(bytes)
            .map_err(|_| Error::Invalid("a checkpoint larger than the address space".into()))?;
        let memory = Arc::new(DeviceBuffer::<MaybeUninit<u8>>::uninit_on(device, bytes)?);
        let tensors = plan
            .iter()
            .zip(ready)
            .map(|(p, ready)| LoadedTensor {
                name: p.name.clone(),
                dtype: p.dtype,
                shape: p.shape.clone(),
                memory: memory.clone(),
                start: p.at as usize,
                bytes: p.extent.bytes() as usize,
                ready: ready.clone(),
            })
            .collect();
        Ok(Self {
            device,
            memory,
            tensors,
        })
    }
}

/// A replica's device memory, shared by its tensors and the sink that fills it.
type ReplicaMemory = Arc<DeviceBuffer<MaybeUninit<u8>>>;

/// The sink of a load: records one event behind the last copies of the tensors that landed
/// together, and copies them on to the replicas behind it.
fn fan_out(primary: &OnDevice, replicas: &[(OnDevice, Stream)]) -> Box<engine::Sink<Cuda>> {
    let device = primary.device;
    let ready: Vec<Arc<Ready>> = primary.tensors.iter().map(|t| t.ready.clone()).collect();
    let places: Vec<(u64, usize)> = primary
        .tensors
        .iter()
        .map(|t| (t.start as u64, t.bytes))
        .collect();
    let memory = primary.memory.clone();
    let base = memory.as_raw();
    let replicas: Vec<(Stream, ReplicaMemory, Vec<Arc<Ready>>)> = replicas
        .iter()
        .map(|(copy, stream)| {
            let ready = copy.tensors.iter().map(|t| t.ready.clone()).collect();
            (stream.clone(), copy.memory.clone(), ready)
        })
        .collect();
    Box::new(move |targets: &[usize], stream: &Stream| {
        let mut landed = Event::untimed_on(device)?;
        landed.record(stream)?;
        let landed = Arc::new(landed);
        // Copies through the tensors' views on other streams, and the memory's drop, wait
        // for their landing.
        memory.track_event(stream, landed.clone());
        for (replica, replica_memory, replica_ready) in &replicas {
            let replica_base = replica_memory.as_raw();
            replica.wait_event(&landed)?;
            let copies: Vec<RawCopy> = targets
                .iter()
                .map(|&target| {
                    let (at, bytes) = places[target];
                    RawCopy {
                        dst: replica_base + at,
                        src: base + at,
                        bytes,
                    }
                })
                .collect();
            // SAFETY: both ranges lie in device allocations the load keeps until its streams
            // are done (its drop waits for them); the source's bytes were queued on `stream`,
            // which the replica's stream now waits for; nothing else writes either range.
            unsafe { replica.copy_batch_raw(&copies) }?;
            let mut copied = Event::untimed_on(replica.device())?;
            copied.record(replica)?;
            let copied = Arc::new(copied);
            replica_memory.track_event(replica, copied.clone());
            for &target in targets {
                replica_ready[target].set(State::Queued(copied.clone()));
            }
        }
        for &target in targets {
            ready[target].set(State::Queued(landed.clone()));
        }
        Ok(())
    })
}

/// A checkpoint loading: its tensors, each usable once it has landed.
///
/// Dropping it stops the load and waits for the device to finish the copies already queued.
pub struct Loading {
    primary: OnDevice,
    replicas: Vec<OnDevice>,
    names: HashMap<String, usize>,
    job: Arc<Job<Cuda>>,
    /// Kept while loading: its threads do the work.
    crew: Arc<Crew<Cuda>>,
    stream: Stream,
    replica_streams: Vec<Stream>,
}

impl std::fmt::Debug for Loading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loading")
            .field("device", &self.primary.device)
            .field("tensors", &self.primary.tensors.len())
            .field("replicas", &self.replicas.len())
            .finish_non_exhaustive()
    }
}

impl Loading {
    /// The tensor named `name`, if the load selected it.
    pub fn tensor(&self, name: &str) -> Option<&LoadedTensor> {
        self.names.get(name).map(|&i| &self.primary.tensors[i])
    }

    /// The tensors, in the order they are read.
    pub fn tensors(&self) -> &[LoadedTensor] {
        &self.primary.tensors
    }

    /// The tensors' copies on `device` (the reader's or a replica's).
    pub fn tensors_on(&self, device: Device) -> Option<&[LoadedTensor]> {
        std::iter::once(&self.primary)
            .chain(&self.replicas)
            .find(|copy| copy.device == device)
            .map(|copy| copy.tensors.as_slice())
    }

    /// Waits until every tensor has landed on every device, and returns them.
    ///
    /// # Errors
    ///
    /// The first error of the load (naming the file, and the tensor where one is at fault),
    /// or the CUDA error of waiting.
    pub fn wait(mut self) -> Result<Loaded> {
        self.job.wait_finished();
        engine::finish(&self.job, self.crew.ring())?;
        self.stream.synchronize()?;
        for stream in &self.replica_streams {
            stream.synchronize()?;
        }
        let names = std::mem::take(&mut self.names);
        let mut copies = vec![std::mem::take(&mut self.primary.tensors)];
        copies.extend(
            self.replicas
                .iter_mut()
                .map(|r| std::mem::take(&mut r.tensors)),
        );
        Ok(Loaded { names, copies })
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        if !self.job.exhausted() {
            self.job.fail(Error::Invalid("the load was dropped".into()));
        }
        self.job.wait_finished();
        // No copy of the load may run once its memory can be freed: the replicas' streams
        // too, where a failed copy may have left some queued without an event.
        let _ = self.stream.synchronize();
        for stream in &self.replica_streams {
            let _ = stream.synchronize();
        }
    }
}

/// A loaded checkpoint: every tensor on every device it was loaded onto.
#[derive(Debug)]
pub struct Loaded {
    names: HashMap<String, usize>,
    /// The reader's device's tensors, then each replica's.
    copies: Vec<Vec<LoadedTensor>>,
}

impl Loaded {
    /// The tensor named `name` on the reader's device.
    pub fn tensor(&self, name: &str) -> Option<&LoadedTensor> {
        self.names.get(name).map(|&i| &self.copies[0][i])
    }

    /// The tensors on the reader's device.
    pub fn tensors(&self) -> &[LoadedTensor] {
        &self.copies[0]
    }

    /// The tensors on `device`.
    pub fn tensors_on(&self, device: Device) -> Option<&[LoadedTensor]> {
        self.copies
            .iter()
            .find(|copy| copy.first().is_some_and(|t| t.device() == device))
            .map(Vec::as_slice)
    }
}

/// One tensor of a load, on one device.
pub struct LoadedTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    memory: Arc<DeviceBuffer<MaybeUninit<u8>>>,
    start: usize,
    bytes: usize,
    ready: Arc<Ready>,
}

impl std::fmt::Debug for LoadedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("device", &self.device())
            .finish_non_exhaustive()
    }
}

impl LoadedTensor {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The type of each element.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The shape of what was loaded (a rank's part, for a split tensor).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The bytes loaded.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device it is on.
    pub fn device(&self) -> Device {
        self.memory.device()
    }

    /// Makes `stream` wait (on the device) until the tensor has landed, and returns its
    /// memory; the host waits only until the tensor's copies are queued.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the load failed before the tensor landed (the message says
    /// why), or the CUDA error of making the stream wait.
    pub fn ready_on(&self, stream: &Stream) -> Result<DeviceSlice<'_, u8>> {
        self.ready
            .when_queued(|event| Ok(stream.wait_event(event)?))?;
        Ok(self.view())
    }

    /// Waits on the host until the tensor has landed, and returns its memory.
    ///
    /// # Errors
    ///
    /// As [`ready_on`](Self::ready_on).
    pub fn wait(&self) -> Result<DeviceSlice<'_, u8>> {
        self.ready.when_queued(|event| Ok(event.synchronize()?))?;
        Ok(self.view())
    }

    /// The tensor's memory, once its copies are queued and ordered before every use of it.
    fn view(&self) -> DeviceSlice<'_, u8> {
        let range = self.memory.slice(self.start..self.start + self.bytes);
        // SAFETY: called once the tensor's copies, which write every byte of its range, are
        // queued and the event behind them is known: the caller's stream waits for it (or the
        // host did), and the buffer tracks it (the sink), so that copies through the view on
        // any other stream wait for it too.
        unsafe { range.assume_init() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header of one `U8` tensor of `bytes` bytes, in a file just long enough for it.
    fn header_of(name: &str, bytes: u64) -> Header {
        let json = format!(
            r#"{{"{name}":{{"dtype":"U8","shape":[{bytes}],"data_offsets":[0,{bytes}]}}}}"#
        );
        let path = PathBuf::from(format!("{name}.safetensors"));
        let start = 8 + json.len() as u64;
        Header::parse(&path, json.as_bytes(), start, start + bytes).unwrap()
    }

    #[test]
    fn sizes_that_overflow_together_are_refused_naming_the_tensor() {
        // The largest tensors a header takes count their bits in 64 bits: 2^60 bytes each,
        // sixteen of them overflow a 64-bit byte count together.
        let huge = 1u64 << 60;
        let headers: Vec<Header> = (0..16).map(|i| header_of(&format!("s{i}"), huge)).collect();
        assert_eq!(total_bytes(&headers[..15]).unwrap(), 15 * huge);
        let error = total_bytes(&headers).unwrap_err();
        let text = error.to_string();
        assert!(matches!(error, Error::Format { .. }), "{text}");
        assert!(text.contains("s15.safetensors: tensor `s15`"), "{text}");
        assert!(text.contains("more bytes than 64 bits count"), "{text}");
    }
}
