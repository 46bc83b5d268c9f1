//! `bandwidth`: H2D, D2H and both at once, per kind of host memory, against a raw baseline
//! that calls the sys layer directly in the same run.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_pinned::{
    CudaHost, DeviceBuffer, Error, Event, HostBuffer, HostLocked, MemoryKind, PinnedAllocator,
    PinnedVec, Registered, Result, Stream,
};
use cuda_pinned_sys::{cudaError, cudaMemcpyKind, cudart};
use pinned_pool::Pool;

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Direction {
    HostToDevice,
    DeviceToHost,
}

impl Direction {
    fn label(self) -> &'static str {
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
pub const KINDS: [&str; 6] = [
    "raw (sys)",
    "pageable Vec",
    "cudaHostAlloc",
    "registered",
    "pool",
    "mlock",
];

/// Work items, for the progress bar.
pub fn steps(quick: bool) -> usize {
    sizes(quick).len() * KINDS.len() + 4
}

fn reps(bytes: usize, quick: bool) -> usize {
    match (bytes >= 16 << 20, quick) {
        (true, true) => 3,
        (true, false) => 7,
        (false, true) => 10,
        (false, false) => 30,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
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

/// Times `reps` copies queued by `copy` between two events on `stream`; median GB/s.
///
/// `gate`: hold the stream while queuing (only for page-locked memory: a pageable copy blocks
/// the calling thread until the stream is idle, so it would wait for the gate forever).
fn time_raw(
    stream: &Stream,
    bytes: usize,
    reps: usize,
    gate: bool,
    mut copy: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let (start, end) = (Event::new()?, Event::new()?);
    copy()?; // warm-up
    stream.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let held = gate.then(|| Gate::close(stream)).transpose()?;
        start.record(stream)?;
        copy()?;
        end.record(stream)?;
        drop(held);
        end.synchronize()?;
        times.push(end.elapsed_ms_since(&start)? as f64);
    }
    Ok(gbps(bytes, median(times)))
}

/// A copy through the sys layer, bypassing the safe API: the baseline.
///
/// # Safety
///
/// - `host` and `device` are valid for `bytes` in the direction's sense until the stream
///   is synchronised, which `time_raw` does before returning.
unsafe fn raw_copy(
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

/// Times copies through the safe, tracked API: the buffer goes with each copy and comes back.
/// `gate` as for [`time_raw`].
fn time_tracked<B: HostBuffer<Elem = u8>>(
    stream: &Stream,
    mut buffer: B,
    device: &mut DeviceBuffer<u8>,
    bytes: usize,
    direction: Direction,
    reps: usize,
    gate: bool,
) -> Result<(B, f64)> {
    let (start, end) = (Event::new()?, Event::new()?);
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let held = gate.then(|| Gate::close(stream)).transpose()?;
        start.record(stream)?;
        let transfer = match direction {
            Direction::HostToDevice => stream.copy_to_device(buffer, device)?,
            Direction::DeviceToHost => stream.copy_from_device(device, buffer)?,
        };
        end.record(stream)?;
        drop(held);
        buffer = transfer.wait()?;
        end.synchronize()?;
        if rep > 0 {
            times.push(end.elapsed_ms_since(&start)? as f64);
        }
    }
    Ok((buffer, gbps(bytes, median(times))))
}

fn tracked<A: PinnedAllocator>(
    allocator: A,
    stream: &Stream,
    device: &mut DeviceBuffer<u8>,
    bytes: usize,
    reps: usize,
) -> Result<[f64; 2]> {
    let mut buffer = PinnedVec::with_capacity_in(bytes, allocator)?;
    buffer.resize(bytes, 0x5A);
    let gate = buffer.memory_kind().is_some_and(MemoryKind::is_cuda_pinned);
    let (buffer, h2d) = time_tracked(
        stream,
        buffer,
        device,
        bytes,
        Direction::HostToDevice,
        reps,
        gate,
    )?;
    let (_, d2h) = time_tracked(
        stream,
        buffer,
        device,
        bytes,
        Direction::DeviceToHost,
        reps,
        gate,
    )?;
    Ok([h2d, d2h])
}

/// Raw copies from memory the sys layer allocated (`cudaHostAlloc`) or from a pageable `Vec`.
fn raw(
    pinned: bool,
    stream: &Stream,
    device: &DeviceBuffer<u8>,
    bytes: usize,
    reps: usize,
) -> Result<[f64; 2]> {
    let mut pageable = Vec::new();
    let host = if pinned {
        let alloc = cudart()?.cudaHostAlloc()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let status = unsafe { alloc(&mut ptr, bytes, cuda_pinned_sys::cudaHostAllocDefault) };
        if status != cudaError::cudaSuccess {
            return Err(Error::Unsupported("cudaHostAlloc failed"));
        }
        ptr.cast::<u8>()
    } else {
        pageable.resize(bytes, 0x5Au8);
        pageable.as_mut_ptr()
    };
    let mut results = [0.0; 2];
    for (slot, direction) in [Direction::HostToDevice, Direction::DeviceToHost]
        .into_iter()
        .enumerate()
    {
        // SAFETY: `host` and the device buffer hold `bytes`; `time_raw` synchronises before
        // returning, and both outlive this loop.
        results[slot] = time_raw(stream, bytes, reps, pinned, || unsafe {
            raw_copy(stream, host, device.as_raw(), bytes, direction)
        })?;
    }
    if pinned {
        let free = cudart()?.cudaFreeHost()?;
        // SAFETY: allocated above; the stream is idle (time_raw synchronised).
        unsafe { free(host.cast()) };
    }
    Ok(results)
}

/// Runs the bandwidth section.
pub fn run(quick: bool, progress: &mut Progress) -> Result<Section> {
    let stream = Stream::new()?;
    let pool = Pool::new();
    let mut section = Section::new(
        "bandwidth",
        "Copy bandwidth (median of event-timed copies; % of the raw sys-layer copy in the same run)",
        &["direction", "size", "memory", "GB/s", "% of raw"],
    );
    for bytes in sizes(quick) {
        let reps = reps(bytes, quick);
        let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
        let mut results: Vec<(&str, Option<[f64; 2]>)> = Vec::new();
        for kind in KINDS {
            progress.step(&format!("bandwidth {kind} {}", size_label(bytes as u64)));
            let measured = match kind {
                "raw (sys)" => raw(true, &stream, &device, bytes, reps),
                "pageable Vec" => raw(false, &stream, &device, bytes, reps),
                "cudaHostAlloc" => tracked(CudaHost::new(), &stream, &mut device, bytes, reps),
                "registered" => tracked(Registered::new(), &stream, &mut device, bytes, reps),
                "pool" => tracked(&pool, &stream, &mut device, bytes, reps),
                _ => tracked(HostLocked, &stream, &mut device, bytes, reps),
            };
            match measured {
                Ok(r) => results.push((kind, Some(r))),
                Err(e) => {
                    section
                        .notes
                        .push(format!("{kind} at {}: {e}", size_label(bytes as u64)));
                    results.push((kind, None));
                }
            }
        }
        for (slot, direction) in [Direction::HostToDevice, Direction::DeviceToHost]
            .into_iter()
            .enumerate()
        {
            let baseline = results[0].1.map(|r| r[slot]);
            for (kind, result) in &results {
                let value = result.map(|r| r[slot]);
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
        pool.empty_cache();
    }
    bidirectional(quick, &pool, &mut section, progress)?;
    Ok(section)
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
    for kind in ["raw (sys)", "cudaHostAlloc", "registered", "pool"] {
        progress.step(&format!("bidirectional {kind}"));
        let measured = match kind {
            "raw (sys)" => both_raw(&up, &down, &device_in, &device_out, bytes, reps),
            "cudaHostAlloc" => both_tracked(
                CudaHost::new(),
                &up,
                &down,
                &mut device_in,
                &device_out,
                bytes,
                reps,
            ),
            "registered" => both_tracked(
                Registered::new(),
                &up,
                &down,
                &mut device_in,
                &device_out,
                bytes,
                reps,
            ),
            _ => both_tracked(pool, &up, &down, &mut device_in, &device_out, bytes, reps),
        };
        let value = match measured {
            Ok(v) => Some(v),
            Err(e) => {
                section.notes.push(format!("bidirectional {kind}: {e}"));
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
    let (start, down_done, end) = (Event::new()?, Event::new()?, Event::new()?);
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
    Ok(gbps(2 * bytes, median(times)))
}

fn both_raw(
    up: &Stream,
    down: &Stream,
    device_in: &DeviceBuffer<u8>,
    device_out: &DeviceBuffer<u8>,
    bytes: usize,
    reps: usize,
) -> Result<f64> {
    let alloc = cudart()?.cudaHostAlloc()?;
    let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-pointers.
    let ok = unsafe {
        alloc(&mut a, bytes, 0) == cudaError::cudaSuccess
            && alloc(&mut b, bytes, 0) == cudaError::cudaSuccess
    };
    if !ok {
        return Err(Error::Unsupported("cudaHostAlloc failed"));
    }
    // SAFETY: both host buffers and device buffers hold `bytes`; `time_both` waits for the
    // copies before returning.
    let queue = || unsafe {
        raw_copy(
            up,
            a.cast(),
            device_in.as_raw(),
            bytes,
            Direction::HostToDevice,
        )?;
        raw_copy(
            down,
            b.cast(),
            device_out.as_raw(),
            bytes,
            Direction::DeviceToHost,
        )
    };
    let result = time_both(up, down, bytes, reps, queue, || Ok(()));
    let free = cudart()?.cudaFreeHost()?;
    // SAFETY: allocated above; the streams are idle.
    unsafe {
        free(a);
        free(b);
    }
    result
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
        let upload = up.copy_to_device(source, &mut device_in.borrow_mut())?;
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
