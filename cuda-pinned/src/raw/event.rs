//! Events.

use std::ptr::{self};

use cuda_pinned_sys::driver::{self as cu, CUresult};
use cuda_pinned_sys::{self as sys, cudart};

use super::{driver_status, query};
use crate::error::Result;

type RecordFn = unsafe extern "C" fn(cu::CUevent, cu::CUstream) -> CUresult;

type EventFn = unsafe extern "C" fn(cu::CUevent) -> CUresult;

pub(crate) fn event_create(flags: u32) -> Result<sys::cudaEvent_t> {
    let mut event = ptr::null_mut();
    cuda!(cudaEventCreateWithFlags(&mut event, flags))?;
    Ok(event)
}

/// # Safety
///
/// - `event` came from [`event_create`] and is not used afterwards.
pub(crate) unsafe fn event_destroy(event: sys::cudaEvent_t) -> Result<()> {
    cuda!(cudaEventDestroy(event))
}

// Events are recorded, queried and waited for on every tracked copy: through the driver's own
// calls where its entry points are reachable, which skip the runtime's layer (about 0.1 µs a
// call on an H100 host), else through the runtime. The handles are the same objects.

/// # Safety
///
/// - `event` and `stream` are live;
/// - the calling thread's current context is the primary context of `stream`'s device,
///   which decides which stream a default-stream handle names.
pub(crate) unsafe fn event_record(
    event: sys::cudaEvent_t,
    stream: sys::cudaStream_t,
) -> Result<()> {
    if let Some(record) = driver_fn!(cuEventRecord: RecordFn) {
        // SAFETY: forwarded from the caller.
        return driver_status("cuEventRecord", unsafe {
            record(event.cast(), stream.cast())
        });
    }
    cuda!(cudaEventRecord(event, stream))
}

/// Whether the work captured by the event has finished.
///
/// # Safety
///
/// - `event` is live.
pub(crate) unsafe fn event_query(event: sys::cudaEvent_t) -> Result<bool> {
    if let Some(function) = driver_fn!(cuEventQuery: EventFn) {
        // SAFETY: the caller guarantees the event is live.
        return match unsafe { function(event.cast()) } {
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            status => driver_status("cuEventQuery", status).map(|()| true),
        };
    }
    let function = cudart()?.cudaEventQuery()?;
    // SAFETY: the caller guarantees the event is live.
    query("cudaEventQuery", unsafe { function(event) })
}

/// # Safety
///
/// - `event` is live.
pub(crate) unsafe fn event_synchronize(event: sys::cudaEvent_t) -> Result<()> {
    if let Some(function) = driver_fn!(cuEventSynchronize: EventFn) {
        // SAFETY: the caller guarantees the event is live.
        return driver_status("cuEventSynchronize", unsafe { function(event.cast()) });
    }
    cuda!(cudaEventSynchronize(event))
}

/// # Safety
///
/// - both events are live. (Events created without timing make CUDA return an error.)
pub(crate) unsafe fn event_elapsed_ms(
    start: sys::cudaEvent_t,
    end: sys::cudaEvent_t,
) -> Result<f32> {
    let mut ms = 0.0f32;
    cuda!(cudaEventElapsedTime(&mut ms, start, end))?;
    Ok(ms)
}
