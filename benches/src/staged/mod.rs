//! `staged`: copies from and into ordinary (pageable) memory through `Stager`'s ring, against
//! the driver's own path from the same memory and against page-locked memory, in one run.
//! Every copy is timed on the host, from the call until the data has arrived (the device
//! holds it, or the host buffer is filled), as a program sees it.

use std::ffi::c_void;
use std::time::Instant;

use cuda_pinned::sys::driver::{CUpointer_attribute, CUresult, driver};
use cuda_pinned::sys::{cudaError, cudaEvent_t, cudaEventDisableTiming, cudart};
use cuda_pinned::{
    DefaultPinned, DeviceBuffer, Error, PinnedVec, Registered, Result, Stager, StagingConfig,
    Stream,
};

use crate::bandwidth::{Direction, raw_copy, reps};
use crate::progress::Progress;
use crate::report::{Section, Value, size_label};
use crate::stats::{Spread, gbps};

mod small;
mod sweep;

use small::{small_downloads, small_uploads};
use sweep::sweep;

fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![64 << 10, 1 << 20, 16 << 20, 256 << 20]
    } else {
        vec![
            4 << 10,
            16 << 10,
            64 << 10,
            256 << 10,
            512 << 10,
            1 << 20,
            4 << 20,
            16 << 20,
            64 << 20,
            256 << 20,
            1 << 30,
        ]
    }
}

/// Work items, for the progress bar.
pub fn steps(quick: bool) -> usize {
    sizes(quick).len() + if quick { 3 } else { 6 }
}

/// Seconds `copy` takes, on the host clock.
fn timed(copy: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    copy()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Copies of `bytes` timed together in one rep: one copy of a few microseconds timed alone
/// measures mostly what ran just before it (caches, a waking thread), so small copies run in
/// blocks of the same copy back to back, as a program copying in a loop makes them.
fn calls_per_rep(bytes: usize) -> usize {
    ((4 << 20) / bytes.max(1)).clamp(1, 64)
}

/// Seconds per call of `copy`, run `calls` times in a row.
fn timed_calls(calls: usize, mut copy: impl FnMut() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    for _ in 0..calls {
        copy()?;
    }
    Ok(start.elapsed().as_secs_f64() / calls as f64)
}

/// One raw `cudaMemcpyAsync` between `host` and `device`, waited for.
///
/// # Safety
///
/// `host` and `device` are valid for `bytes` in the direction's sense until this returns.
unsafe fn raw(
    stream: &Stream,
    host: *mut u8,
    device: u64,
    bytes: usize,
    direction: Direction,
) -> Result<()> {
    // SAFETY: forwarded from the caller; the copy is waited for before returning.
    unsafe { raw_copy(stream, host, device, bytes, direction)? };
    stream.synchronize()
}

/// The curve by size: driver path, page-locked memory and the stager, interleaved rep by rep
/// (a rep of a small size is a run of calls; see [`calls_per_rep`]).
fn by_size(
    stager: &Stager,
    quick: bool,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    let stream = Stream::new()?;
    for bytes in sizes(quick) {
        progress.step(&format!("staged {}", size_label(bytes as u64)));
        // Ordinary memory, touched (a program's data exists before it is copied).
        let source = vec![0x5Au8; bytes];
        let mut sink = vec![0xA5u8; bytes];
        let mut pinned = PinnedVec::with_capacity_in(bytes, Registered::new())?;
        pinned.resize(bytes, 0x5A);
        let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
        let calls = calls_per_rep(bytes);
        for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
            let (mut driver, mut locked, mut staged) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..=reps(bytes, quick) {
                let host = match direction {
                    Direction::HostToDevice => source.as_ptr().cast_mut(),
                    Direction::DeviceToHost => sink.as_mut_ptr(),
                };
                let d = timed_calls(calls, || {
                    // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
                    unsafe { raw(&stream, host, device.as_raw(), bytes, direction) }
                })?;
                let l = timed_calls(calls, || {
                    // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
                    unsafe {
                        raw(
                            &stream,
                            pinned.as_mut_ptr(),
                            device.as_raw(),
                            bytes,
                            direction,
                        )
                    }
                })?;
                let s = timed_calls(calls, || match direction {
                    Direction::HostToDevice => {
                        stager.copy_to_device(&stream, &source, &mut device)?.wait()
                    }
                    Direction::DeviceToHost => stager.copy_from_device(&stream, &device, &mut sink),
                })?;
                if rep > 0 {
                    driver.push(gbps(bytes, d));
                    locked.push(gbps(bytes, l));
                    staged.push(gbps(bytes, s));
                }
            }
            let spreads = [driver, locked, staged].map(Spread::of);
            section.row(row(direction.label().into(), bytes, &spreads));
        }
    }
    Ok(())
}

/// A table row: `label`, the size, the driver's and page-locked memory's medians, the
/// stager's min / median / max and its ratios to both (`[driver, locked, staged]`).
fn row(label: String, bytes: usize, [driver, locked, staged]: &[Spread; 3]) -> Vec<Value> {
    let [min, median, max] = staged.cells(2);
    vec![
        Value::Text(label),
        Value::Text(size_label(bytes as u64)),
        Value::Num(driver.median, 2),
        Value::Num(locked.median, 2),
        min,
        median,
        max,
        Value::Num(100.0 * staged.median / locked.median, 1),
        Value::Num(staged.median / driver.median, 2),
    ]
}

/// The host's own ceiling for the staged path: the stager's threads copying 1 GiB between
/// ordinary memory and ring-sized page-locked chunks (each thread its own two chunks, in
/// chunk-sized pieces), with no DMA at all. Median GB/s of `reps`, into and out of the chunks.
fn memcpy_ceiling(
    stager: &Stager,
    quick: bool,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    progress.step("staged memcpy ceiling");
    let bytes = if quick { 256 << 20 } else { 1 << 30 };
    let (threads, chunk) = (stager.config().threads, stager.config().chunk_bytes);
    let mut ordinary = vec![7u8; bytes];
    let mut ring = PinnedVec::with_capacity_in(2 * threads * chunk, Registered::new())?;
    ring.resize(2 * threads * chunk, 0);
    let share = bytes.div_ceil(threads);
    let mut rates = [Vec::new(), Vec::new()];
    for rep in 0..=5 {
        for (d, into_ring) in [true, false].into_iter().enumerate() {
            let seconds = timed(|| {
                std::thread::scope(|scope| {
                    for (part, chunks) in ordinary.chunks_mut(share).zip(ring.chunks_mut(2 * chunk))
                    {
                        scope.spawn(move || {
                            for (i, piece) in part.chunks_mut(chunk).enumerate() {
                                let slot = &mut chunks[(i % 2) * chunk..][..piece.len()];
                                if into_ring {
                                    slot.copy_from_slice(piece);
                                } else {
                                    piece.copy_from_slice(slot);
                                }
                            }
                        });
                    }
                });
                Ok(())
            })?;
            if rep > 0 {
                rates[d].push(gbps(bytes, seconds));
            }
        }
    }
    let [into, out] = rates.map(|r| Spread::of(r).median);
    section.notes.push(format!(
        "host memcpy ceiling, {threads} threads, {}, no DMA: ordinary → chunks {into:.2} GB/s, \
         chunks → ordinary {out:.2} GB/s",
        size_label(bytes as u64)
    ));
    Ok(())
}

/// 1 GiB copies one after another, as a program streaming data makes them: the driver's
/// path, then page-locked memory, then the stager, each in a block of its own (after two
/// unmeasured copies). Interleaved with other copies rep by rep (the table above), the
/// stager's threads start each copy on cores that idled through the previous one.
fn back_to_back(
    stager: &Stager,
    quick: bool,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    progress.step("staged back to back");
    let bytes = if quick { 256 << 20 } else { 1 << 30 };
    let reps = if quick { 3 } else { 8 };
    let stream = Stream::new()?;
    let source = vec![0x5Au8; bytes];
    let mut sink = vec![0xA5u8; bytes];
    let mut pinned = PinnedVec::with_capacity_in(bytes, Registered::new())?;
    pinned.resize(bytes, 0x5A);
    let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
    let block = |reps: usize, copy: &mut dyn FnMut() -> Result<()>| -> Result<Spread> {
        let mut rates = Vec::new();
        for rep in 0..reps + 2 {
            let seconds = timed(&mut *copy)?;
            if rep >= 2 {
                rates.push(gbps(bytes, seconds));
            }
        }
        Ok(Spread::of(rates))
    };
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        let host = match direction {
            Direction::HostToDevice => source.as_ptr().cast_mut(),
            Direction::DeviceToHost => sink.as_mut_ptr(),
        };
        let address = device.as_raw();
        let driver = block(reps.min(3), &mut || {
            // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
            unsafe { raw(&stream, host, address, bytes, direction) }
        })?;
        let pinned_ptr = pinned.as_mut_ptr();
        let locked = block(reps, &mut || {
            // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
            unsafe { raw(&stream, pinned_ptr, address, bytes, direction) }
        })?;
        let staged = match direction {
            Direction::HostToDevice => block(reps, &mut || {
                stager.copy_to_device(&stream, &source, &mut device)?.wait()
            })?,
            Direction::DeviceToHost => block(reps, &mut || {
                stager.copy_from_device(&stream, &device, &mut sink)
            })?,
        };
        let label = format!("{}, back to back", direction.label());
        section.row(row(label, bytes, &[driver, locked, staged]));
    }
    Ok(())
}

/// 1 GiB each way at once, on two streams from two threads sharing `stager`, against the same
/// from page-locked memory; GB/s counts both directions.
fn both_ways(
    stager: &Stager,
    quick: bool,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    progress.step("staged both directions");
    let bytes = if quick { 256 << 20 } else { 1 << 30 };
    let reps = if quick { 3 } else { 5 };
    let source = vec![1u8; bytes];
    let mut sink = vec![2u8; bytes];
    let mut pinned_source = PinnedVec::with_capacity_in(bytes, Registered::new())?;
    pinned_source.resize(bytes, 1);
    let mut pinned_sink = PinnedVec::zeroed_in(bytes, Registered::new())?;
    let mut device_in = DeviceBuffer::<u8>::zeroed(bytes)?;
    let device_out = DeviceBuffer::<u8>::zeroed(bytes)?;
    let (up, down) = (Stream::new()?, Stream::new()?);
    let (mut locked, mut staged) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let l = timed(|| {
            locked_both_ways(
                [&up, &down],
                &mut pinned_source,
                &mut pinned_sink,
                [&device_in, &device_out],
                bytes,
            )
        })?;
        let s = timed(|| {
            std::thread::scope(|scope| {
                let upload =
                    scope.spawn(|| stager.copy_to_device(&up, &source, &mut device_in)?.wait());
                let download = stager.copy_from_device(&down, &device_out, &mut sink);
                upload.join().expect("the upload thread")?;
                download
            })
        })?;
        if rep > 0 {
            locked.push(gbps(2 * bytes, l));
            staged.push(gbps(2 * bytes, s));
        }
    }
    section.row(both_row(bytes, Spread::of(locked), Spread::of(staged)));
    Ok(())
}

/// One copy each way at once from page-locked memory, the upload on a thread of its own;
/// separate so the timed closure in [`both_ways`] stays one call.
fn locked_both_ways(
    [up, down]: [&Stream; 2],
    pinned_source: &mut PinnedVec<u8, Registered>,
    pinned_sink: &mut PinnedVec<u8, Registered>,
    [device_in, device_out]: [&DeviceBuffer<u8>; 2],
    bytes: usize,
) -> Result<()> {
    // Addresses cross to the upload thread as integers (raw pointers are not `Send`).
    let source = pinned_source.as_mut_ptr() as usize;
    let sink = pinned_sink.as_mut_ptr();
    let (device_in, device_out) = (device_in.as_raw(), device_out.as_raw());
    std::thread::scope(|scope| {
        let upload = scope.spawn(move || {
            // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
            unsafe {
                raw(
                    up,
                    source as *mut u8,
                    device_in,
                    bytes,
                    Direction::HostToDevice,
                )
            }
        });
        let download =
            // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
            unsafe { raw(down, sink, device_out, bytes, Direction::DeviceToHost) };
        upload.join().expect("the upload thread")?;
        download
    })
}

/// The "both" row, which has no driver figure: kept apart from the measurement loop.
fn both_row(bytes: usize, locked: Spread, staged: Spread) -> Vec<Value> {
    let [min, median, max] = staged.cells(2);
    vec![
        Value::Text("both".into()),
        Value::Text(size_label(bytes as u64)),
        Value::Missing,
        Value::Num(locked.median, 2),
        min,
        median,
        max,
        Value::Num(100.0 * staged.median / locked.median, 1),
        Value::Missing,
    ]
}

/// Median GB/s of 30 raw driver uploads and downloads of `source` / `sink`, for the sweep's
/// last column; unlike [`round_trips`] it has no warm-up and no stager.
fn driver_round_trips(
    stream: &Stream,
    source: &[u8],
    sink: &mut [u8],
    device: &DeviceBuffer<u8>,
) -> Result<[f64; 2]> {
    let bytes = source.len();
    let mut rates = [Vec::new(), Vec::new()];
    for _ in 0..30 {
        let host = sink.as_mut_ptr();
        rates[0].push(gbps(
            bytes,
            timed(|| {
                // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
                unsafe {
                    raw(
                        stream,
                        source.as_ptr().cast_mut(),
                        device.as_raw(),
                        bytes,
                        Direction::HostToDevice,
                    )
                }
            })?,
        ));
        rates[1].push(gbps(
            bytes,
            timed(|| {
                // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
                unsafe {
                    raw(
                        stream,
                        host,
                        device.as_raw(),
                        bytes,
                        Direction::DeviceToHost,
                    )
                }
            })?,
        ));
    }
    Ok(rates.map(|r| Spread::of(r).median))
}

/// Median GB/s of `reps` uploads and downloads of `source` / `sink` (after one warm-up).
fn round_trips(
    stager: &Stager,
    stream: &Stream,
    source: &[u8],
    sink: &mut [u8],
    device: &mut DeviceBuffer<u8>,
    reps: usize,
) -> Result<[f64; 2]> {
    let bytes = source.len();
    let mut rates = [Vec::new(), Vec::new()];
    for rep in 0..=reps {
        let up = timed(|| stager.copy_to_device(stream, source, &mut *device)?.wait())?;
        let down = timed(|| stager.copy_from_device(stream, &*device, &mut *sink))?;
        if rep > 0 {
            rates[0].push(gbps(bytes, up));
            rates[1].push(gbps(bytes, down));
        }
    }
    Ok(rates.map(|r| Spread::of(r).median))
}

/// Runs the section.
pub fn run(quick: bool, progress: &mut Progress) -> Result<Section> {
    // A stager that takes no driver path first (CUDA's start-up), then the first with them
    // (its device's check), then another.
    let ring_only = StagingConfig {
        driver_uploads: Vec::new(),
        driver_downloads: Vec::new(),
        ..StagingConfig::default()
    };
    drop(Stager::with_config_in(ring_only, DefaultPinned)?);
    let made = Instant::now();
    let stager = Stager::new()?;
    let first = made.elapsed();
    let made = Instant::now();
    drop(Stager::new()?);
    let second = made.elapsed();
    let mut section = staged_section(&stager);
    let taken = |on: bool| if on { "taken" } else { "not taken" };
    section.notes.push(format!(
        "the driver's own path (checked on this device as the first stager was made): uploads \
         of {:?} bytes {}, downloads of {:?} bytes {}; making a stager took {:.1} ms the first \
         time (the check included, unless an earlier section made one), {:.1} ms the next",
        stager.config().driver_uploads,
        taken(stager.driver_uploads_taken()),
        stager.config().driver_downloads,
        taken(stager.driver_downloads_taken()),
        first.as_secs_f64() * 1e3,
        second.as_secs_f64() * 1e3,
    ));
    by_size(&stager, quick, &mut section, progress)?;
    if !quick {
        small_uploads(&stager, &mut section, progress)?;
        small_downloads(&stager, &mut section, progress)?;
    }
    back_to_back(&stager, quick, &mut section, progress)?;
    both_ways(&stager, quick, &mut section, progress)?;
    memcpy_ceiling(&stager, quick, &mut section, progress)?;
    if !quick {
        sweep(&mut section, progress)?;
    }
    Ok(section)
}

/// The section's title (which names the stager's ring) and columns, apart from `run`'s steps.
fn staged_section(stager: &Stager) -> Section {
    Section::new(
        "staged",
        &format!(
            "Copies from / into ordinary memory (host-timed, call to arrival; median GB/s; copies \
             under 4 MiB timed in runs of up to 64): the driver's path, page-locked memory, and \
             the staging ring ({} threads, {} chunks of {})",
            stager.config().threads,
            stager.config().chunks,
            size_label(stager.config().chunk_bytes as u64)
        ),
        &[
            "direction",
            "size",
            "driver",
            "pinned",
            "staged min",
            "staged median",
            "staged max",
            "% of pinned",
            "× driver",
        ],
    )
}
