//! `bandwidth`: H2D, D2H and both at once, per kind of host memory, against a raw baseline
//! that calls the sys layer directly in the same run.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_pinned::{
    CudaHost, DeviceBuffer, Error, Event, HostLocked, MemoryKind, PinnedAllocator, PinnedVec,
    Registered, Result, Stream, VirtualHost,
};
use cuda_pinned_sys::{cudaError, cudaMemcpyKind, cudart};
use pinned_pool::Pool;

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};
use crate::stats::{gbps, median};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Direction {
    HostToDevice,
    DeviceToHost,
}

impl Direction {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::HostToDevice => "H2D",
            Self::DeviceToHost => "D2H",
        }
    }
}

/// Sizes measured.
pub fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![64 << 10, 1 << 20, 16 << 20, 64 << 20]
    } else {
        vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    }
}

/// Memory kinds measured, the raw baseline first.
pub const KINDS: [&str; 8] = [
    "raw (sys)",
    "pageable Vec",
    "cudaHostAlloc",
    "registered",
    "registered in 12 MiB chunks",
    "virtual (cuMemCreate)",
    "pool",
    "mlock",
];

/// Work items, for the progress bar.
pub fn steps(quick: bool) -> usize {
    sizes(quick).len() * KINDS.len() + 5
}

/// Copies timed per size: fewer for large ones, which vary less.
pub(crate) fn reps(bytes: usize, quick: bool) -> usize {
    match (bytes >= 16 << 20, quick) {
        (true, true) => 3,
        (true, false) => 7,
        (false, true) => 10,
        (false, false) => 30,
    }
}

/// Holds a stream until opened, so that the start event, the copy and the end event are all
/// queued before the device reaches them: a timing then measures the device's work alone, not
/// how quickly the host queued it (which differs between the raw calls and the tracked API).
struct Gate(Arc<AtomicBool>);

impl Gate {
    fn close(stream: &Stream) -> Result<Self> {
        let open = Arc::new(AtomicBool::new(false));
        let flag = open.clone();
        stream.launch_host_fn(move || {
            while !flag.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
        })?;
        Ok(Self(open))
    }
}

impl Drop for Gate {
    /// Opens the gate (also on early returns: a stream is never left blocked).
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// One kind of host memory with its own device buffer: times one copy in a direction.
type Copier<'a> = Box<dyn FnMut(Direction) -> Result<f64> + 'a>;

/// Times one copy queued by `copy` between two events on `stream`, in milliseconds.
///
/// `gate`: hold the stream while queuing (only for page-locked memory: a pageable copy blocks
/// the calling thread until the stream is idle, so it would wait for the gate forever).
fn time_one(
    stream: &Stream,
    events: &mut (Event, Event),
    gate: bool,
    copy: impl FnOnce() -> Result<()>,
) -> Result<f64> {
    let (start, end) = events;
    let held = gate.then(|| Gate::close(stream)).transpose()?;
    start.record(stream)?;
    copy()?;
    end.record(stream)?;
    drop(held);
    end.synchronize()?;
    Ok(f64::from(end.elapsed_ms_since(start)?))
}

/// A copy through the sys layer, bypassing the safe API: the baseline.
///
/// # Safety
///
/// - `host` and `device` are valid for `bytes` in the direction's sense until the stream
///   is synchronised, which `time_one` does before returning.
pub(crate) unsafe fn raw_copy(
    stream: &Stream,
    host: *mut u8,
    device: u64,
    bytes: usize,
    direction: Direction,
) -> Result<()> {
    let copy = cudart()?.cudaMemcpyAsync()?;
    let (dst, src, kind): (*mut c_void, *const c_void, _) = match direction {
        Direction::HostToDevice => (
            device as *mut _,
            host as *const _,
            cudaMemcpyKind::cudaMemcpyHostToDevice,
        ),
        Direction::DeviceToHost => (
            host.cast(),
            device as *const _,
            cudaMemcpyKind::cudaMemcpyDeviceToHost,
        ),
    };
    // SAFETY: forwarded from the caller.
    let status = unsafe { copy(dst, src, bytes, kind, stream.as_raw()) };
    if status == cudaError::cudaSuccess {
        Ok(())
    } else {
        Err(Error::Unsupported("cudaMemcpyAsync failed"))
    }
}

/// Host memory for the raw baseline: `cudaHostAlloc`ed through the sys layer, or a pageable
/// `Vec`. Filled like the other kinds' buffers, so that every kind starts cache-hot.
struct RawHost {
    ptr: *mut u8,
    pinned: bool,
    _pageable: Vec<u8>,
}

impl RawHost {
    fn new(bytes: usize, pinned: bool) -> Result<Self> {
        let mut pageable = Vec::new();
        let ptr = if pinned {
            let alloc = cudart()?.cudaHostAlloc()?;
            let mut ptr = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            if unsafe { alloc(&mut ptr, bytes, cuda_pinned_sys::cudaHostAllocDefault) }
                != cudaError::cudaSuccess
            {
                return Err(Error::Unsupported("cudaHostAlloc failed"));
            }
            // SAFETY: `bytes` writable bytes just allocated.
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0x5A, bytes) };
            ptr.cast()
        } else {
            pageable.resize(bytes, 0x5Au8);
            pageable.as_mut_ptr()
        };
        Ok(Self {
            ptr,
            pinned,
            _pageable: pageable,
        })
    }
}

impl Drop for RawHost {
    fn drop(&mut self) {
        if self.pinned
            && let Ok(Ok(free)) = cudart().map(|rt| rt.cudaFreeHost())
        {
            // SAFETY: allocated in `new`; every copy using it was synchronised.
            unsafe { free(self.ptr.cast()) };
        }
    }
}

fn raw_copier(stream: &Stream, bytes: usize, pinned: bool) -> Result<Copier<'_>> {
    let host = RawHost::new(bytes, pinned)?;
    let device = DeviceBuffer::<u8>::zeroed(bytes)?;
    let mut events = (Event::new()?, Event::new()?);
    Ok(Box::new(move |direction| {
        // Name `host` whole: a closure that only read `host.ptr` would capture just that
        // field, and the buffer would be freed when this function returns.
        let host = &host;
        // SAFETY: `host` and `device` hold `bytes` and outlive the copy, which `time_one`
        // waits for.
        time_one(stream, &mut events, pinned, || unsafe {
            raw_copy(stream, host.ptr, device.as_raw(), bytes, direction)
        })
    }))
}

/// Copies through the safe, tracked API: the buffer goes with each copy and comes back.
fn tracked_copier<'a, A: PinnedAllocator + 'a>(
    stream: &'a Stream,
    allocator: A,
    bytes: usize,
) -> Result<Copier<'a>> {
    let mut buffer = PinnedVec::with_capacity_in(bytes, allocator)?;
    buffer.resize(bytes, 0x5A);
    let gate = buffer.memory_kind().is_some_and(MemoryKind::is_cuda_pinned);
    let mut buffer = Some(buffer);
    let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
    let mut events = (Event::new()?, Event::new()?);
    Ok(Box::new(move |direction| {
        let mut in_flight = None;
        let ms = time_one(stream, &mut events, gate, || {
            let host = buffer.take().expect("the buffer is back");
            in_flight = Some(match direction {
                Direction::HostToDevice => stream.copy_to_device(host, &mut device)?,
                Direction::DeviceToHost => stream.copy_from_device(&device, host)?,
            });
            Ok(())
        });
        if let Some(transfer) = in_flight {
            buffer = Some(transfer.wait()?);
        }
        ms
    }))
}

/// The two directions every kind is timed in, in this order.
const DIRECTIONS: [Direction; 2] = [Direction::HostToDevice, Direction::DeviceToHost];

/// Runs the bandwidth section: for each size, every kind's copies interleaved rep by rep, so
/// that drift on the machine touches all kinds alike.
pub fn run(quick: bool, progress: &mut Progress) -> Result<Section> {
    let stream = Stream::new()?;
    let pool = Pool::new();
    let mut section = Section::new(
        "bandwidth",
        "Copy bandwidth (median of event-timed copies, kinds interleaved; % of the raw sys-layer copy)",
        &["direction", "size", "memory", "GB/s", "% of raw"],
    );
    for bytes in sizes(quick) {
        let mut copiers = copiers(&stream, &pool, bytes, &mut section, progress);
        let times = time_copiers(&mut copiers, bytes, quick, &mut section);
        drop(copiers);
        size_rows(&times, bytes, &mut section);
        pool.empty_cache();
    }
    bidirectional(quick, &pool, &mut section, progress)?;
    Ok(section)
}

/// One copier of `bytes` per kind, in [`KINDS`]' order; a kind that cannot be set up gets a
/// note and `None`, so the table keeps its row.
fn copiers<'a>(
    stream: &'a Stream,
    pool: &'a Pool,
    bytes: usize,
    section: &mut Section,
    progress: &mut Progress,
) -> Vec<(&'static str, Option<Copier<'a>>)> {
    let mut copiers: Vec<(&str, Option<Copier<'_>>)> = Vec::new();
    for kind in KINDS {
        progress.step(&format!("bandwidth {kind} {}", size_label(bytes as u64)));
        let copier = match kind {
            "raw (sys)" => raw_copier(stream, bytes, true),
            "pageable Vec" => raw_copier(stream, bytes, false),
            "cudaHostAlloc" => tracked_copier(stream, CudaHost::new(), bytes),
            "registered" => tracked_copier(stream, Registered::new(), bytes),
            "registered in 12 MiB chunks" => tracked_copier(
                stream,
                Registered::new().register_in_chunks(12 << 20),
                bytes,
            ),
            "virtual (cuMemCreate)" => tracked_copier(stream, VirtualHost::new(), bytes),
            "pool" => tracked_copier(stream, pool, bytes),
            _ => tracked_copier(stream, HostLocked, bytes),
        };
        match copier {
            Ok(c) => copiers.push((kind, Some(c))),
            Err(e) => {
                section.notes.push(format!(
                    "{kind} at {}: {e}",
                    size_label(bytes as u64),
                    e = cuda_pinned::ErrorChain(&e)
                ));
                copiers.push((kind, None));
            }
        }
    }
    copiers
}

/// The measurement loop: every copier in both directions, rep by rep (rep 0 warms up);
/// returns milliseconds per kind and direction. A copier that fails gets a note and stops.
fn time_copiers(
    copiers: &mut [(&str, Option<Copier<'_>>)],
    bytes: usize,
    quick: bool,
    section: &mut Section,
) -> Vec<[Vec<f64>; 2]> {
    let mut times = vec![[Vec::new(), Vec::new()]; copiers.len()];
    for rep in 0..=reps(bytes, quick) {
        for (k, (kind, copier)) in copiers.iter_mut().enumerate() {
            let Some(time) = copier else { continue };
            for (d, &direction) in DIRECTIONS.iter().enumerate() {
                match time(direction) {
                    Ok(ms) if rep > 0 => times[k][d].push(ms), // rep 0 warms up
                    Ok(_) => {}
                    Err(e) => {
                        section.notes.push(format!(
                            "{kind} at {}: {e}",
                            size_label(bytes as u64),
                            e = cuda_pinned::ErrorChain(&e)
                        ));
                        *copier = None;
                        break;
                    }
                }
            }
        }
    }
    times
}

/// One size's rows, direction by direction and kind by kind, each against the raw copy.
fn size_rows(times: &[[Vec<f64>; 2]], bytes: usize, section: &mut Section) {
    for (d, direction) in DIRECTIONS.into_iter().enumerate() {
        let rate = |k: usize| {
            (!times[k][d].is_empty()).then(|| gbps(bytes, median(times[k][d].clone()) * 1e-3))
        };
        let baseline = rate(0);
        for (k, kind) in KINDS.iter().enumerate() {
            let value = rate(k);
            section.row(vec![
                Value::Text(direction.label().into()),
                Value::Text(size_label(bytes as u64)),
                Value::Text((*kind).into()),
                value.map_or(Value::Missing, |v| Value::Num(v, 2)),
                match (value, baseline) {
                    (Some(v), Some(b)) if b > 0.0 => Value::Num(100.0 * v / b, 1),
                    _ => Value::Missing,
                },
            ]);
        }
    }
}

/// H2D on one stream and D2H on another at once; GB/s counts both directions.
fn bidirectional(
    quick: bool,
    pool: &Pool,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    let bytes = if quick { 64 << 20 } else { 256 << 20 };
    let reps = if quick { 3 } else { 7 };
    let (up, down) = (Stream::new()?, Stream::new()?);
    let mut device_in = DeviceBuffer::<u8>::zeroed(bytes)?;
    let device_out = DeviceBuffer::<u8>::zeroed(bytes)?;
    let mut raw_total = None;
    for kind in [
        "raw (sys)",
        "cudaHostAlloc",
        "registered",
        "virtual (cuMemCreate)",
        "pool",
    ] {
        progress.step(&format!("bidirectional {kind}"));
        let measured = both_kind(
            kind,
            pool,
            [&up, &down],
            &mut device_in,
            &device_out,
            bytes,
            reps,
        );
        let value = match measured {
            Ok(v) => Some(v),
            Err(e) => {
                section.notes.push(format!(
                    "bidirectional {kind}: {e}",
                    e = cuda_pinned::ErrorChain(&e)
                ));
                None
            }
        };
        if kind == "raw (sys)" {
            raw_total = value;
        }
        section.row(vec![
            Value::Text("both".into()),
            Value::Text(size_label(bytes as u64)),
            Value::Text(kind.into()),
            value.map_or(Value::Missing, |v| Value::Num(v, 2)),
            match (value, raw_total) {
                (Some(v), Some(b)) => Value::Num(100.0 * v / b, 1),
                _ => Value::Missing,
            },
        ]);
    }
    Ok(())
}

/// One kind's both-ways GB/s: picks the memory `kind` names and times it, so
/// [`bidirectional`]'s loop is about rows, not allocators.
fn both_kind(
    kind: &str,
    pool: &Pool,
    [up, down]: [&Stream; 2],
    device_in: &mut DeviceBuffer<u8>,
    device_out: &DeviceBuffer<u8>,
    bytes: usize,
    reps: usize,
) -> Result<f64> {
    match kind {
        "raw (sys)" => both_raw(up, down, device_in, device_out, bytes, reps),
        "cudaHostAlloc" => both_tracked(
            CudaHost::new(),
            up,
            down,
            device_in,
            device_out,
            bytes,
            reps,
        ),
        "registered" => both_tracked(
            Registered::new(),
            up,
            down,
            device_in,
            device_out,
            bytes,
            reps,
        ),
        "virtual (cuMemCreate)" => both_tracked(
            VirtualHost::new(),
            up,
            down,
            device_in,
            device_out,
            bytes,
            reps,
        ),
        _ => both_tracked(pool, up, down, device_in, device_out, bytes, reps),
    }
}

/// Times `queue` (which queues one copy on each stream) from an event on `up` to the end of
/// both streams' work; `finish` runs after that end, to collect what `queue` left in flight.
fn time_both(
    up: &Stream,
    down: &Stream,
    bytes: usize,
    reps: usize,
    mut queue: impl FnMut() -> Result<()>,
    mut finish: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let (mut start, mut down_done, mut end) = (Event::new()?, Event::new()?, Event::new()?);
    let mut times = Vec::new();
    for rep in 0..=reps {
        let gate = Gate::close(up)?;
        start.record(up)?;
        down.wait_event(&start)?;
        queue()?;
        down_done.record(down)?;
        up.wait_event(&down_done)?;
        end.record(up)?;
        drop(gate);
        end.synchronize()?;
        finish()?;
        if rep > 0 {
            times.push(end.elapsed_ms_since(&start)? as f64);
        }
    }
    Ok(gbps(2 * bytes, median(times) * 1e-3))
}

fn both_raw(
    up: &Stream,
    down: &Stream,
    device_in: &DeviceBuffer<u8>,
    device_out: &DeviceBuffer<u8>,
    bytes: usize,
    reps: usize,
) -> Result<f64> {
    let (source, sink) = (RawHost::new(bytes, true)?, RawHost::new(bytes, true)?);
    let queue = || {
        // SAFETY: the host and device buffers hold `bytes` and outlive the copies, which
        // `time_both` waits for before returning.
        unsafe {
            raw_copy(
                up,
                source.ptr,
                device_in.as_raw(),
                bytes,
                Direction::HostToDevice,
            )?;
            raw_copy(
                down,
                sink.ptr,
                device_out.as_raw(),
                bytes,
                Direction::DeviceToHost,
            )
        }
    };
    time_both(up, down, bytes, reps, queue, || Ok(()))
}

fn both_tracked<A: PinnedAllocator + Clone>(
    allocator: A,
    up: &Stream,
    down: &Stream,
    device_in: &mut DeviceBuffer<u8>,
    device_out: &DeviceBuffer<u8>,
    bytes: usize,
    reps: usize,
) -> Result<f64> {
    use std::cell::RefCell;
    let mut source = PinnedVec::with_capacity_in(bytes, allocator.clone())?;
    source.resize(bytes, 1);
    let buffers = RefCell::new(Some((source, PinnedVec::zeroed_in(bytes, allocator)?)));
    let in_flight = RefCell::new(None);
    let device_in = RefCell::new(device_in);
    let queue = || {
        let (source, sink) = buffers.borrow_mut().take().expect("buffers are back");
        let upload = up.copy_to_device(source, &mut **device_in.borrow_mut())?;
        let download = down.copy_from_device(device_out, sink)?;
        *in_flight.borrow_mut() = Some((upload, download));
        Ok(())
    };
    // Runs after both streams' work has ended: the waits return at once.
    let finish = || {
        let (upload, download) = in_flight.borrow_mut().take().expect("copies queued");
        *buffers.borrow_mut() = Some((upload.wait()?, download.wait()?));
        Ok(())
    };
    time_both(up, down, bytes, reps, queue, finish)
}
