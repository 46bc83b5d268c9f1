//! A load under way and its result: the tensors on each device, each ready on its own event,
//! the order they landed in, and the load's figures.

use std::mem::MaybeUninit;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use cuda_pinned::{Device, DeviceBuffer, DeviceSlice, Event, Stream};
use safetensors::Dtype;

use super::report::{LoadReport, Meter};
use crate::engine::Reading;
use crate::error::{Error, Result};
use cuda_pinned::ring::Cuda;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Each tensor's index by name.
pub(super) type Names = foldhash::HashMap<Arc<str>, usize>;

/// A tensor's readiness: not yet queued, queued behind an event, or failed.
#[derive(Default)]
pub(super) struct Ready {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
pub(super) enum State {
    #[default]
    Pending,
    Queued(Arc<Event>),
    Failed(Arc<Error>),
}

impl Ready {
    pub(super) fn set(&self, state: State) {
        let mut now = lock(&self.state);
        if matches!(*now, State::Pending) {
            *now = state;
        }
        drop(now);
        self.changed.notify_all();
    }

    /// Waits until the tensor's copies are queued, and returns the event behind them.
    fn queued(&self) -> Result<Arc<Event>> {
        let mut state = lock(&self.state);
        loop {
            match &*state {
                State::Pending => {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                State::Queued(event) => return Ok(event.clone()),
                State::Failed(cause) => return Err(Error::Failed(cause.clone())),
            }
        }
    }
}

/// The order in which the reader's device's tensors landed (their copies queued), for the
/// iterator over them; closed when the load ends, with why where it failed.
#[derive(Default)]
pub(super) struct Arrivals {
    state: Mutex<ArrivalState>,
    changed: Condvar,
}

#[derive(Default)]
struct ArrivalState {
    order: Vec<usize>,
    /// `Some` once the load has ended: `Ok` when everything landed, else why not.
    ended: Option<std::result::Result<(), Arc<Error>>>,
}

impl Arrivals {
    pub(super) fn landed(&self, targets: &[usize]) {
        lock(&self.state).order.extend_from_slice(targets);
        self.changed.notify_all();
    }

    pub(super) fn end(&self, outcome: std::result::Result<(), Arc<Error>>) {
        lock(&self.state).ended.get_or_insert(outcome);
        self.changed.notify_all();
    }

    /// The `index`th tensor to land, waiting for it; `None` once the load has ended with
    /// fewer, with why where it failed.
    fn nth(&self, index: usize) -> Option<std::result::Result<usize, Arc<Error>>> {
        let mut state = lock(&self.state);
        loop {
            if let Some(&target) = state.order.get(index) {
                return Some(Ok(target));
            }
            match &state.ended {
                Some(Ok(())) => return None,
                Some(Err(why)) => return Some(Err(why.clone())),
                None => {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }
}

/// The tensors on one device: the memory of each block and each tensor's readiness.
pub(super) struct OnDevice {
    pub(super) device: Device,
    pub(super) blocks: Vec<Arc<DeviceBuffer<MaybeUninit<u8>>>>,
    pub(super) tensors: Vec<LoadedTensor>,
}

/// A checkpoint loading: its tensors, each usable once it has landed.
///
/// Tensors of no bytes come first: they wait for nothing. Tensors are read in the order
/// [`tensors`](Self::tensors) lists them: the checkpoint's own
/// (shard after shard, each file's tensors by offset) unless
/// [`LoadOptions::order_by`](super::LoadOptions::order_by) chose another. The first listed is
/// the first to land: pieces read before it wait in the reader's ring and go to the device
/// after it, up to half the ring's chunks (past that a piece goes at once, so that the ring
/// keeps room for the first tensor's own). The others land roughly in order (several threads
/// read at once); [`landed`](Self::landed) yields them as they do.
///
/// Dropping it stops the load and waits for the device to finish the copies already queued.
pub struct Loading {
    pub(super) primary: OnDevice,
    pub(super) replicas: Vec<OnDevice>,
    pub(super) names: Names,
    /// The read: the reader's crew does the work.
    pub(super) reading: Reading<Cuda>,
    pub(super) stream: Stream,
    pub(super) replica_streams: Vec<Stream>,
    pub(super) arrivals: Arc<Arrivals>,
    pub(super) meter: Arc<Meter>,
}

impl std::fmt::Debug for Loading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loading")
            .field("device", &self.primary.device)
            .field("tensors", &self.primary.tensors.len())
            .field("blocks", &self.primary.blocks.len())
            .field("replicas", &self.replicas.len())
            .finish_non_exhaustive()
    }
}

impl Loading {
    /// The tensor named `name`, if the load selected it.
    pub fn tensor(&self, name: &str) -> Option<&LoadedTensor> {
        self.names.get(name).map(|&i| &self.primary.tensors[i])
    }

    /// The tensors, in the order they are read (see [`Loading`]).
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

    /// The reader's device's tensors in the order they land: each is yielded once its copies
    /// are queued, ready for [`LoadedTensor::ready_on`] (a stream's wait on the device) or
    /// [`LoadedTensor::wait`].
    ///
    /// The iterator ends after the last tensor; if the load fails first, it yields the
    /// failure once ([`Error::Failed`], the load's error its source) and ends.
    ///
    /// ```no_run
    /// # use pinned_io::{Checkpoint, FileReader, LoadOptions};
    /// # let (checkpoint, reader) = (Checkpoint::open("m.safetensors")?, FileReader::new()?);
    /// let stream = cuda_pinned::Stream::new()?;
    /// let loading = checkpoint.load(&reader, &LoadOptions::new())?;
    /// for tensor in loading.landed() {
    ///     let tensor = tensor?;
    ///     let bytes = tensor.ready_on(&stream)?; // `stream` waits for this one alone
    ///     // ... queue work on `bytes` while the rest still loads ...
    /// #   let _ = bytes;
    /// }
    /// # Ok::<(), pinned_io::Error>(())
    /// ```
    pub fn landed(&self) -> Landed<'_> {
        Landed {
            loading: self,
            next: 0,
            failed: false,
        }
    }

    /// Waits until every tensor has landed on every device, and returns them.
    ///
    /// # Errors
    ///
    /// The first error of the load (naming the file, and the tensor where one is at fault),
    /// or the CUDA error of waiting.
    pub fn wait(mut self) -> Result<Loaded> {
        self.reading.finish()?;
        let report = self.meter.report(self.reading.job(), &self.stream)?;
        for stream in &self.replica_streams {
            stream.synchronize()?;
        }
        tracing::debug!(
            tensors = self.primary.tensors.len(),
            bytes = report.bytes,
            first_tensor_ms = report.first_tensor.as_secs_f64() * 1e3,
            last_tensor_ms = report.last_tensor.as_secs_f64() * 1e3,
            limit = %report.verdict(),
            "load done"
        );
        let names = std::mem::take(&mut self.names);
        let mut copies = vec![std::mem::take(&mut self.primary.tensors)];
        copies.extend(
            self.replicas
                .iter_mut()
                .map(|r| std::mem::take(&mut r.tensors)),
        );
        Ok(Loaded {
            names,
            copies,
            report,
        })
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        self.reading.stop(Error::Stopped("it was dropped"));
        self.reading.wait();
        // No copy of the load may run once its memory can be freed: the replicas' streams
        // too, where a failed copy may have left some queued without an event. Copies of
        // pieces whose tensors never completed have no event the memory tracks: where a
        // stream cannot be waited for, the memory is leaked rather than freed (or handed back
        // to its lender) under them.
        let mut settled = self.stream.synchronize().is_ok();
        for stream in &self.replica_streams {
            settled &= stream.synchronize().is_ok();
        }
        if !settled {
            for copy in std::iter::once(&mut self.primary).chain(&mut self.replicas) {
                std::mem::forget(std::mem::take(&mut copy.blocks));
                std::mem::forget(std::mem::take(&mut copy.tensors));
            }
        }
    }
}

/// The reader's device's tensors of a [`Loading`] in the order they land
/// ([`Loading::landed`]).
#[derive(Debug)]
pub struct Landed<'a> {
    loading: &'a Loading,
    next: usize,
    failed: bool,
}

impl<'a> Iterator for Landed<'a> {
    type Item = Result<&'a LoadedTensor>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.loading.arrivals.nth(self.next)? {
            Ok(target) => {
                self.next += 1;
                Some(Ok(&self.loading.primary.tensors[target]))
            }
            Err(cause) => {
                self.failed = true;
                Some(Err(Error::Failed(cause)))
            }
        }
    }
}

/// A loaded checkpoint: every tensor on every device it was loaded onto, and the load's
/// figures.
#[derive(Debug)]
pub struct Loaded {
    names: Names,
    /// The reader's device's tensors, then each replica's.
    copies: Vec<Vec<LoadedTensor>>,
    report: LoadReport,
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

    /// What the load took and moved, and what limited it.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }
}

/// One tensor of a load, on one device.
pub struct LoadedTensor {
    pub(super) name: Arc<str>,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) split: Option<super::Split>,
    pub(super) block: usize,
    /// The memory of its block (the load's tensors of its element type, on its device).
    pub(super) memory: Arc<DeviceBuffer<MaybeUninit<u8>>>,
    pub(super) start: usize,
    pub(super) bytes: usize,
    pub(super) ready: Arc<Ready>,
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

    /// The tensor-parallel part loaded, where the options named one
    /// ([`LoadOptions::split`](super::LoadOptions::split)); `None` for the whole tensor.
    pub fn split(&self) -> Option<super::Split> {
        self.split
    }

    /// Its block: the number, among its device's blocks, of the memory that holds it (the
    /// [`Block::index`](super::Block::index) that
    /// [`Checkpoint::load_into`](super::Checkpoint::load_into)'s caller was asked for; a
    /// tensor of no bytes may be in a block of none, which nobody is asked for).
    pub fn block(&self) -> usize {
        self.block
    }

    /// Where its bytes start in its block.
    pub fn offset(&self) -> usize {
        self.start
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
    /// [`Error::Failed`] when the load failed before the tensor landed (the load's error its
    /// source), or the CUDA error of making the stream wait.
    pub fn ready_on(&self, stream: &Stream) -> Result<DeviceSlice<'_, u8>> {
        stream.wait_event(&*self.ready.queued()?)?;
        Ok(self.view())
    }

    /// Waits on the host until the tensor has landed, and returns its memory.
    ///
    /// # Errors
    ///
    /// As [`ready_on`](Self::ready_on).
    pub fn wait(&self) -> Result<DeviceSlice<'_, u8>> {
        self.ready.queued()?.synchronize()?;
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
