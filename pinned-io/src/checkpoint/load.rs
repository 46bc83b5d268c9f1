//! Starting a checkpoint's load: which tensors go where (the plan), the device memory (the
//! load's own, or memory the caller lends), and the sink that marks each tensor landed and
//! fans it out to other devices.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use cuda_pinned::{Device, DeviceBuffer, Event, LentDeviceMemory, RawCopy, Stream};
use safetensors::Dtype;

use super::TensorSpec;
use super::loading::{Arrivals, LoadedTensor, Loading, OnDevice, Ready, State};
use super::open::Checkpoint;
use super::report::Meter;
use super::split::{Extent, Split, extent};
use crate::engine::{self, Bases, Destination, Job, Reading};
use crate::error::{Error, Result};
use crate::plan::{self, Span};
use crate::reader::FileReader;
use cuda_pinned::ring::Cuda;

/// Tensors start on this alignment in device memory (what CUDA's allocations give, and more
/// than any vectorised load wants).
const DEVICE_ALIGN: u64 = 256;

/// A block's memory, as the load holds it.
type Memory = Arc<DeviceBuffer<MaybeUninit<u8>>>;

/// The element type of each block and its bytes.
type Blocks = Vec<(Dtype, u64)>;

/// One allocation of a load on one device: the memory of its tensors of one element type,
/// laid out in the order they are read, each at [`LoadedTensor::offset`]; or of one large
/// tensor alone ([`LoadOptions::own_block_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    index: usize,
    device: Device,
    dtype: Dtype,
    bytes: usize,
    tensors: usize,
}

impl Block {
    /// Its number among its device's blocks: the [`LoadedTensor::block`] of the tensors in it.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The device the memory must be on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type of the block's tensors.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The bytes the memory must hold at least (a multiple of the element's size).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The tensors in it: one for a tensor with a block of its own.
    pub fn tensors(&self) -> usize {
        self.tensors
    }
}

impl Checkpoint {
    /// Starts loading the tensors `options` selects onto `reader`'s device (and copies on
    /// the replicas' devices), and returns at once: each tensor is ready on its own event.
    ///
    /// The reader's threads read while the DMA engine copies; pinned memory is the reader's
    /// ring only, whatever the checkpoint's size. The tensors of each element type share one
    /// device allocation per device (a [`Block`]); while they are made (which can take
    /// milliseconds), the threads already read the first tensor into the ring. The first
    /// tensor's copies are queued before those of the tensors after it, so that it is usable
    /// as soon as it can be.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a split that does not fit a tensor; CUDA errors allocating the
    /// device memory or making the streams. Errors while loading reach the tensors and
    /// [`Loading::wait`].
    pub fn load(&self, reader: &FileReader, options: &LoadOptions) -> Result<Loading> {
        self.start_load(reader, options, &mut |blocks| {
            (blocks.iter())
                .map(|block| {
                    Ok(Arc::new(DeviceBuffer::uninit_on(
                        block.device,
                        block.bytes,
                    )?))
                })
                .collect()
        })
    }

    /// Starts loading as [`load`](Self::load) does, into device memory the caller allocates
    /// and will free: `memory` is called once for each device (the reader's, then each
    /// replica's), while the threads already read, with the device's [`Block`]s that hold
    /// bytes, and returns memory for each of them in their order: of that device, holding at
    /// least the block's bytes. All at once, so that the caller can allocate them together.
    ///
    /// The load keeps that memory until its copies are done (the [`Loading`] and
    /// [`Loaded`](super::Loaded) keep it, and drop it when they drop), so that a framework
    /// that owns it (candle's tensors, cudarc's slices) frees it as it frees its own: nothing
    /// is copied again once the tensors have landed.
    ///
    /// # Errors
    ///
    /// As [`load`](Self::load); the error `memory` returns; [`Error::Invalid`] for memory of
    /// another device or too few bytes.
    pub fn load_into<M: LentDeviceMemory>(
        &self,
        reader: &FileReader,
        options: &LoadOptions,
        mut memory: impl FnMut(&[Block]) -> Result<Vec<M>>,
    ) -> Result<Loading> {
        self.start_load(reader, options, &mut |blocks| {
            let lent = memory(blocks)?;
            if lent.len() != blocks.len() {
                return Err(Error::Invalid(format!(
                    "{} allocations were lent for {} blocks",
                    lent.len(),
                    blocks.len()
                )));
            }
            (lent.into_iter().zip(blocks))
                .map(|(lent, block)| {
                    if !lent.address().is_multiple_of(DEVICE_ALIGN) {
                        return Err(Error::Invalid(format!(
                            "the memory lent for the {:?} tensors starts at {:#x}, not on a \
                             multiple of {DEVICE_ALIGN} bytes as the tensors in it must",
                            block.dtype,
                            lent.address()
                        )));
                    }
                    if lent.device() != block.device || lent.bytes() < block.bytes {
                        return Err(Error::Invalid(format!(
                            "the memory lent for the {:?} tensors is {} bytes on device {}; \
                             they need {} on device {}",
                            block.dtype,
                            lent.bytes(),
                            lent.device().ordinal(),
                            block.bytes,
                            block.device.ordinal()
                        )));
                    }
                    Ok(Arc::new(DeviceBuffer::from_lent(lent)?))
                })
                .collect()
        })
    }

    fn start_load(
        &self,
        reader: &FileReader,
        options: &LoadOptions,
        allocate: &mut dyn FnMut(&[Block]) -> Result<Vec<Memory>>,
    ) -> Result<Loading> {
        let device = reader.device();
        let stream = Stream::on(device)?;
        let (plan, blocks) = self.plan(options)?;
        let bytes = plan.iter().map(|p| p.extent.bytes()).sum::<u64>();
        let _span = tracing::debug_span!(
            "load",
            tensors = plan.len(),
            bytes,
            blocks = blocks.len(),
            device = device.ordinal(),
            replicas = options.replicas.len(),
        )
        .entered();
        let meter = Arc::new(Meter::start(
            &stream,
            &self.files,
            (plan.len(), bytes),
            (reader.pinned_bytes(), reader.config().threads),
        )?);
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
        // Offsets into each tensor's block, allocated below; read in the plan's order.
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
        let pieces = plan::cut_by(&spans, reader.piece_bytes(), |span| span.target as u64)?;
        let arrivals = Arc::new(Arrivals::default());
        let done = when_done(&ready, &arrivals, &meter);
        let reading = reader.start(pieces, self.files.clone(), &stream, plan.len(), done);
        let coming = Coming { reading: &reading };
        let allocating = Instant::now();
        let (primary, replicas) =
            allocate_all(device, &others, (&plan, &blocks), &ready, allocate)?;
        meter.allocated_in(allocating.elapsed());
        let bases = plan
            .iter()
            .map(|p| primary.blocks[p.block].as_raw())
            .collect();
        let sink = fan_out(&primary, &replicas, &plan, &arrivals, &meter);
        coming.arrive(Destination {
            bases: Bases::PerTarget(bases),
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
            reading,
            stream,
            replica_streams,
            arrivals,
            meter,
        })
    }

    /// Where each selected tensor's bytes lie in its file and in its block, in the order they
    /// are read; and each block's element type and bytes.
    fn plan(&self, options: &LoadOptions) -> Result<(Vec<Planned>, Blocks)> {
        let mut plan = Vec::new();
        for &(file, index) in &self.order {
            let spec = &self.headers[file].tensors()[index];
            if options.only.as_ref().is_some_and(|only| !only(spec)) {
                continue;
            }
            let split = options.split.as_ref().and_then(|split| split(spec));
            let (extent, shape) = extent(spec, split.as_ref(), self.files[file].path())?;
            plan.push(Planned {
                name: spec.name().into(),
                dtype: spec.dtype(),
                shape,
                file,
                extent,
                split,
                rank: options.order.as_ref().map_or(0, |order| order(spec)),
                block: 0,
                at: 0,
            });
        }
        // Stable: the checkpoint's own order among tensors of one rank.
        plan.sort_by_key(|p| p.rank);
        let mut blocks: Blocks = Vec::new();
        // The shared block of each element type, once it has one.
        let mut shared: Vec<(Dtype, usize)> = Vec::new();
        let own_from = options.own_block_from.unwrap_or(u64::MAX);
        for planned in &mut plan {
            let own = planned.extent.bytes() >= own_from;
            let found = shared.iter().find(|&&(dtype, _)| dtype == planned.dtype);
            let block = match found {
                Some(&(_, block)) if !own => block,
                _ => {
                    blocks.push((planned.dtype, 0));
                    if !own {
                        shared.push((planned.dtype, blocks.len() - 1));
                    }
                    blocks.len() - 1
                }
            };
            let end = &mut blocks[block].1;
            planned.block = block;
            planned.at = *end;
            *end = end
                .checked_add(planned.extent.bytes())
                .and_then(|end| end.checked_next_multiple_of(DEVICE_ALIGN))
                .ok_or_else(|| Error::Invalid("a checkpoint's bytes overflow".into()))?;
        }
        Ok((plan, blocks))
    }
}

/// One selected tensor: where its bytes lie in its file, and at which offset of which block
/// they go.
struct Planned {
    name: Arc<str>,
    dtype: Dtype,
    shape: Vec<usize>,
    file: usize,
    extent: Extent,
    /// The part of it the options named, if any.
    split: Option<Split>,
    /// Its place in the load's order ([`LoadOptions::order_by`]).
    rank: u64,
    block: usize,
    at: u64,
}

/// What a load selects, in which order, and where it copies to.
#[derive(Clone, Default)]
pub struct LoadOptions {
    #[allow(clippy::type_complexity)]
    only: Option<Arc<dyn Fn(&TensorSpec) -> bool + Send + Sync>>,
    #[allow(clippy::type_complexity)]
    split: Option<Arc<dyn Fn(&TensorSpec) -> Option<Split> + Send + Sync>>,
    #[allow(clippy::type_complexity)]
    order: Option<Arc<dyn Fn(&TensorSpec) -> u64 + Send + Sync>>,
    own_block_from: Option<u64>,
    replicas: Vec<Device>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("only", &self.only.is_some())
            .field("split", &self.split.is_some())
            .field("order", &self.order.is_some())
            .field("own_block_from", &self.own_block_from)
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl LoadOptions {
    /// Every tensor, whole, in the checkpoint's order, onto the reader's device only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only the tensors `keep` says yes to (and every earlier `only` of these options).
    pub fn only(mut self, keep: impl Fn(&TensorSpec) -> bool + Send + Sync + 'static) -> Self {
        self.only = Some(match self.only.take() {
            Some(earlier) => Arc::new(move |tensor: &TensorSpec| earlier(tensor) && keep(tensor)),
            None => Arc::new(keep),
        });
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

    /// Reads the tensors in the order of `key`, the smallest first (the checkpoint's own
    /// order among tensors of one key): the first tensor read is the first to land, and the
    /// others follow roughly in this order.
    ///
    /// An inference server that starts work on the embeddings and the first layers while
    /// the rest loads asks for them first:
    ///
    /// ```
    /// use pinned_io::LoadOptions;
    /// let layer = |name: &str| -> Option<u64> {
    ///     name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
    /// };
    /// let options = LoadOptions::new().order_by(move |tensor| {
    ///     match tensor.name() {
    ///         name if name.contains("embed") => 0,
    ///         name => layer(name).map_or(u64::MAX, |layer| layer + 1),
    ///     }
    /// });
    /// # let _ = options;
    /// ```
    ///
    /// The files are then read out of their order where the keys say so: from the page cache
    /// that costs nothing, from storage past it some speed.
    pub fn order_by(mut self, key: impl Fn(&TensorSpec) -> u64 + Send + Sync + 'static) -> Self {
        self.order = Some(Arc::new(key));
        self
    }

    /// Gives each tensor of at least `bytes` bytes a [`Block`] (an allocation) of its own;
    /// smaller ones share their element type's. By default every tensor of one element type
    /// shares one block: the fewest allocations.
    ///
    /// For memory that the caller's framework frees tensor by tensor, or reads back whole: a
    /// framework whose tensors own their memory (candle's copy a whole allocation back to the
    /// host) keeps each large weight in one of its own.
    pub fn own_block_from(mut self, bytes: u64) -> Self {
        self.own_block_from = Some(bytes);
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

/// Called when the load's job has moved or skipped every piece: marks the end of its copies,
/// or fails whatever never landed, so that no waiter hangs.
fn when_done(
    ready: &[Vec<Arc<Ready>>],
    arrivals: &Arc<Arrivals>,
    meter: &Arc<Meter>,
) -> Box<engine::Done<Cuda>> {
    let all_ready: Vec<Arc<Ready>> = ready.iter().flatten().cloned().collect();
    let (arrivals, meter) = (arrivals.clone(), meter.clone());
    Box::new(move |job: &Job<Cuda>| {
        let cause = match job.error() {
            None if job.named() => {
                // Without the mark the report counts no time: nothing to fail over.
                let _ = meter.ended(&job.stream);
                arrivals.end(Ok(()));
                return;
            }
            Some(error) => error,
            None => Arc::new(Error::Stopped("its device memory was not allocated")),
        };
        for ready in &all_ready {
            ready.set(State::Failed(cause.clone()));
        }
        arrivals.end(Err(cause));
    })
}

/// A load's job until its destination is named: dropped before (an error or a panic while
/// allocating) or while (a panic), the job is abandoned, so that its pieces do not wait for
/// memory that will not come, and no copy queued into that memory still runs when it is
/// freed.
struct Coming<'a> {
    reading: &'a Reading<Cuda>,
}

impl Coming<'_> {
    fn arrive(self, destination: Destination<Cuda>) {
        self.reading.arrive(destination);
        std::mem::forget(self);
    }
}

impl Drop for Coming<'_> {
    fn drop(&mut self) {
        let why = Error::Stopped("its device memory was not allocated");
        self.reading.abandon(why);
        // Only after a panic while naming the memory may copies into it be queued, by this
        // thread and the crew's until they find the job failed: waited for (the replicas'
        // copies are tracked by their memory). Else nothing waits for the crew.
        let job = self.reading.job();
        if job.named() {
            self.reading.wait();
            let _ = job.stream.synchronize();
        }
    }
}

/// Allocates the load's blocks on the reader's device, and on each of `others` with a stream
/// to copy with; `ready` holds each device's tensors' readiness, the reader's first.
fn allocate_all(
    device: Device,
    others: &[Device],
    (plan, blocks): (&[Planned], &[(Dtype, u64)]),
    ready: &[Vec<Arc<Ready>>],
    allocate: &mut dyn FnMut(&[Block]) -> Result<Vec<Memory>>,
) -> Result<(OnDevice, Vec<(OnDevice, Stream)>)> {
    let primary = on_device(device, plan, blocks, &ready[0], allocate)?;
    let mut replicas = Vec::with_capacity(others.len());
    for (&other, ready) in others.iter().zip(&ready[1..]) {
        // The replica's stream reads the reader's device's memory.
        if other.can_access_peer(device)? {
            other.enable_peer_access(device)?;
        }
        let stream = Stream::on(other)?;
        replicas.push((on_device(other, plan, blocks, ready, allocate)?, stream));
    }
    Ok((primary, replicas))
}

/// The blocks of `device` and its tensors in them.
fn on_device(
    device: Device,
    plan: &[Planned],
    blocks: &[(Dtype, u64)],
    ready: &[Arc<Ready>],
    allocate: &mut dyn FnMut(&[Block]) -> Result<Vec<Memory>>,
) -> Result<OnDevice> {
    let mut counts = vec![0; blocks.len()];
    for planned in plan {
        counts[planned.block] += 1;
    }
    let mut sized = Vec::with_capacity(blocks.len());
    for (index, &(dtype, bytes)) in blocks.iter().enumerate() {
        let bytes = usize::try_from(bytes)
            .map_err(|_| Error::Invalid("a checkpoint larger than the address space".into()))?;
        sized.push(Block {
            index,
            device,
            dtype,
            bytes,
            tensors: counts[index],
        });
    }
    // Blocks of no bytes (of empty tensors) need nothing allocated, nor asked of a caller.
    let asked: Vec<Block> = sized.iter().filter(|b| b.bytes > 0).copied().collect();
    let mut given = allocate(&asked)?.into_iter();
    let memories = (sized.iter())
        .map(|block| match block.bytes {
            0 => Ok(Arc::new(DeviceBuffer::uninit_on(device, 0)?)),
            _ => given
                .next()
                .ok_or_else(|| Error::Invalid("fewer allocations than blocks".into())),
        })
        .collect::<Result<Vec<Memory>>>()?;
    let tensors = plan
        .iter()
        .zip(ready)
        .map(|(p, ready)| LoadedTensor {
            name: p.name.clone(),
            dtype: p.dtype,
            shape: p.shape.clone(),
            split: p.split,
            block: p.block,
            memory: memories[p.block].clone(),
            start: p.at as usize,
            bytes: p.extent.bytes() as usize,
            ready: ready.clone(),
        })
        .collect();
    Ok(OnDevice {
        device,
        blocks: memories,
        tensors,
    })
}

/// The sink of a load: records one event behind the last copies of the tensors that landed
/// together, and copies them on to the replicas behind it.
fn fan_out(
    primary: &OnDevice,
    replicas: &[(OnDevice, Stream)],
    plan: &[Planned],
    arrivals: &Arc<Arrivals>,
    meter: &Arc<Meter>,
) -> Box<engine::Sink<Cuda>> {
    let device = primary.device;
    let ready: Vec<Arc<Ready>> = primary.tensors.iter().map(|t| t.ready.clone()).collect();
    // Each tensor's block and place in it.
    let places: Vec<(usize, u64, usize)> = plan
        .iter()
        .map(|p| (p.block, p.at, p.extent.bytes() as usize))
        .collect();
    let blocks = primary.blocks.clone();
    let replicas: Vec<(Stream, Vec<Memory>, Vec<Arc<Ready>>)> = replicas
        .iter()
        .map(|(copy, stream)| {
            let ready = copy.tensors.iter().map(|t| t.ready.clone()).collect();
            (stream.clone(), copy.blocks.clone(), ready)
        })
        .collect();
    let (arrivals, meter) = (arrivals.clone(), meter.clone());
    // Engine threads sink at once. A block tracks one event per stream, the latest it is given:
    // recorded and given in one order, so that the one it keeps is the one recorded last.
    let in_order = Mutex::new(());
    Box::new(move |targets: &[usize], stream: &Stream| {
        let _in_order = in_order.lock().unwrap_or_else(PoisonError::into_inner);
        let mut landed = Event::untimed_on(device)?;
        landed.record(stream)?;
        // Tensors of no bytes wait for nothing, and come first: not the load's first tensor.
        if targets.iter().any(|&target| places[target].2 > 0) {
            meter.landed(stream)?;
        }
        let landed = Arc::new(landed);
        // The blocks these tensors are in.
        let mut touched: Vec<usize> = targets.iter().map(|&t| places[t].0).collect();
        touched.sort_unstable();
        touched.dedup();
        // Copies through the tensors' views on other streams, and the memory's drop, wait
        // for their landing.
        for &block in &touched {
            blocks[block].track_event(stream, landed.clone());
        }
        for (replica, replica_blocks, replica_ready) in &replicas {
            replica.wait_event(&landed)?;
            let copies: Vec<RawCopy> = targets
                .iter()
                .map(|&target| {
                    let (block, at, bytes) = places[target];
                    RawCopy {
                        dst: replica_blocks[block].as_raw() + at,
                        src: blocks[block].as_raw() + at,
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
            for &block in &touched {
                replica_blocks[block].track_event(replica, copied.clone());
            }
            for &target in targets {
                replica_ready[target].set(State::Queued(copied.clone()));
            }
        }
        for &target in targets {
            ready[target].set(State::Queued(landed.clone()));
        }
        arrivals.landed(targets);
        Ok(())
    })
}
