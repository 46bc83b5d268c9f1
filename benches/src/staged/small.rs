//! Small copies from and into ordinary memory: what each path costs per call.

use super::*;

/// What a small upload from ordinary memory costs, in ns per call: the driver's path as the
/// table times it (`cudaMemcpyAsync`, then the stream waited for), the least a tracked copy
/// can cost (the driver's own copy call after one pointer lookup, then an event recorded and
/// waited for: what the stager adds to the driver's path), the stager, and a stager without
/// upload slots (the driver's path, then the ring). Interleaved run by run.
pub(super) fn small_uploads(
    stager: &Stager,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    progress.step("staged small uploads");
    let driver = driver()?;
    let (Ok(lookup), Ok(upload), Ok(record), Ok(wait)) = (
        driver.cuPointerGetAttributes(),
        driver.cuMemcpyHtoDAsync(),
        driver.cuEventRecord(),
        driver.cuEventSynchronize(),
    ) else {
        section.notes.push(
            "small uploads: not measured, the driver's entry points cannot be reached (a CUDA \
             runtime before 12.5)"
                .into(),
        );
        return Ok(());
    };
    let stream = Stream::new()?;
    let event = UntimedEvent::new()?;
    let without_slots = Stager::with_config_in(
        StagingConfig {
            upload_slots: 0,
            ..stager.config().clone()
        },
        DefaultPinned,
    )?;
    let tracked = |source: &[u8], address: u64| -> Result<()> {
        let mut memory_type = u32::MAX;
        let mut attribute = CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
        let mut data = [(&raw mut memory_type).cast::<c_void>()];
        // SAFETY: one attribute, whose value `data` points to; `source` and the device
        // buffer hold `bytes` and outlive the copy, which is waited for; the event and
        // the stream are live and of the current device.
        let statuses = unsafe {
            [
                lookup(1, &mut attribute, data.as_mut_ptr(), source.as_ptr() as u64),
                upload(
                    address,
                    source.as_ptr().cast(),
                    source.len(),
                    stream.as_raw().cast(),
                ),
                record(event.0.cast(), stream.as_raw().cast()),
                wait(event.0.cast()),
            ]
        };
        if statuses.iter().all(|s| *s == CUresult::CUDA_SUCCESS) && memory_type == 0 {
            Ok(())
        } else {
            Err(Error::Unsupported("a tracked driver upload failed"))
        }
    };
    let lines = [4 << 10, 16 << 10, 64 << 10]
        .into_iter()
        .map(|bytes| small_upload_line(bytes, [stager, &without_slots], &stream, &tracked))
        .collect::<Result<Vec<_>>>()?;
    small_uploads_note(&lines, section);
    Ok(())
}

/// One size of [`small_uploads`], measured 15 runs (after one unmeasured) and written as one
/// part of the note; `tracked` is the least tracked copy of a source to a device address.
fn small_upload_line(
    bytes: usize,
    [stager, without_slots]: [&Stager; 2],
    stream: &Stream,
    tracked: &dyn Fn(&[u8], u64) -> Result<()>,
) -> Result<String> {
    let source = vec![0x5Au8; bytes];
    let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
    let address = device.as_raw();
    let calls = calls_per_rep(bytes);
    let mut ns = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for rep in 0..=15 {
        let times = [
            timed_calls(calls, || {
                // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
                unsafe {
                    raw(
                        stream,
                        source.as_ptr().cast_mut(),
                        address,
                        bytes,
                        Direction::HostToDevice,
                    )
                }
            })?,
            timed_calls(calls, || tracked(&source, address))?,
            timed_calls(calls, || {
                stager.copy_to_device(stream, &source, &mut device)?.wait()
            })?,
            timed_calls(calls, || {
                without_slots
                    .copy_to_device(stream, &source, &mut device)?
                    .wait()
            })?,
        ];
        if rep > 0 {
            for (n, t) in ns.iter_mut().zip(times) {
                n.push(t * 1e9);
            }
        }
    }
    let [plain, floor, staged, unslotted] = ns.map(Spread::of);
    Ok(format!(
        "{}: cudaMemcpyAsync {:.0}, least tracked {:.0}, staged {:.0} / {:.0} / {:.0} \
         ({:.3}× cudaMemcpyAsync, {:.3}× least tracked), without upload slots {:.0} \
         ({:.3}× cudaMemcpyAsync)",
        size_label(bytes as u64),
        plain.median,
        floor.median,
        staged.min,
        staged.median,
        staged.max,
        plain.median / staged.median,
        floor.median / staged.median,
        unslotted.median,
        plain.median / unslotted.median,
    ))
}

/// The note under the table that gathers [`small_upload_line`]'s parts.
fn small_uploads_note(lines: &[String], section: &mut Section) {
    section.notes.push(format!(
        "small uploads, ns per call, medians of 15 runs (staged min / median / max); least \
         tracked = one pointer lookup, the driver's call, one event; without upload slots = \
         the driver's path or the ring: {}",
        lines.join("; ")
    ));
}

/// What a small download into ordinary memory costs, in ns per call: the driver's path as the
/// table times it (`cudaMemcpyAsync`, then the stream waited for) and the stager, interleaved
/// run by run.
pub(super) fn small_downloads(
    stager: &Stager,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    progress.step("staged small downloads");
    let stream = Stream::new()?;
    let mut lines = Vec::new();
    for bytes in [4 << 10, 16 << 10] {
        let mut sink = vec![0xA5u8; bytes];
        let device = DeviceBuffer::<u8>::zeroed(bytes)?;
        let calls = calls_per_rep(bytes);
        let (mut plain, mut staged) = (Vec::new(), Vec::new());
        for rep in 0..=15 {
            let p = timed_calls(calls, || {
                // SAFETY: the buffers hold `bytes` and outlive the call, which waits.
                unsafe {
                    raw(
                        &stream,
                        sink.as_mut_ptr(),
                        device.as_raw(),
                        bytes,
                        Direction::DeviceToHost,
                    )
                }
            })?;
            let s = timed_calls(calls, || {
                stager.copy_from_device(&stream, &device, &mut sink)
            })?;
            if rep > 0 {
                plain.push(p * 1e9);
                staged.push(s * 1e9);
            }
        }
        let (plain, staged) = (Spread::of(plain), Spread::of(staged));
        lines.push(format!(
            "{}: cudaMemcpyAsync {:.0}, staged {:.0} / {:.0} / {:.0} ({:.3}× cudaMemcpyAsync)",
            size_label(bytes as u64),
            plain.median,
            staged.min,
            staged.median,
            staged.max,
            plain.median / staged.median,
        ));
    }
    section.notes.push(format!(
        "small downloads into ordinary memory, ns per call, medians of 15 runs (staged min / \
         median / max): {}",
        lines.join("; ")
    ));
    Ok(())
}

/// An event without timing, made and destroyed through the runtime.
struct UntimedEvent(cudaEvent_t);

impl UntimedEvent {
    fn new() -> Result<Self> {
        let mut event = std::ptr::null_mut();
        // SAFETY: `event` is valid for the write.
        let status =
            unsafe { cudart()?.cudaEventCreateWithFlags()?(&mut event, cudaEventDisableTiming) };
        if status == cudaError::cudaSuccess {
            Ok(Self(event))
        } else {
            Err(Error::Unsupported("cudaEventCreateWithFlags failed"))
        }
    }
}

impl Drop for UntimedEvent {
    fn drop(&mut self) {
        if let Ok(Ok(destroy)) = cudart().map(|runtime| runtime.cudaEventDestroy()) {
            // SAFETY: the event is ours and used no more; destroying one whose work is
            // pending is allowed.
            unsafe { destroy(self.0) };
        }
    }
}
