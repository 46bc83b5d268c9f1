//! Streams.

use std::ffi::c_void;
use std::ptr::{self};

use cuda_pinned_sys::driver::{self as cu, CUresult};
use cuda_pinned_sys::{self as sys, cudart};

use super::{driver_status, query};
use crate::error::Result;

pub(crate) fn stream_create(flags: u32) -> Result<sys::cudaStream_t> {
    let mut stream = ptr::null_mut();
    cuda!(cudaStreamCreateWithFlags(&mut stream, flags))?;
    Ok(stream)
}

/// # Safety
///
/// - `stream` came from [`stream_create`] and is not used afterwards.
pub(crate) unsafe fn stream_destroy(stream: sys::cudaStream_t) -> Result<()> {
    cuda!(cudaStreamDestroy(stream))
}

/// # Safety
///
/// - `stream` is a live stream (or null for the legacy default stream).
pub(crate) unsafe fn stream_synchronize(stream: sys::cudaStream_t) -> Result<()> {
    cuda!(cudaStreamSynchronize(stream))
}

/// Whether all work on the stream has finished.
///
/// # Safety
///
/// - `stream` is a live stream.
pub(crate) unsafe fn stream_query(stream: sys::cudaStream_t) -> Result<bool> {
    let function = cudart()?.cudaStreamQuery()?;
    // SAFETY: the caller guarantees the stream is live.
    query("cudaStreamQuery", unsafe { function(stream) })
}

/// Whether work queued on the stream now is being captured into a CUDA graph (or was, and
/// the capture failed without ending) instead of running.
///
/// # Safety
///
/// - `stream` is a live stream (or null for the default stream).
pub(crate) unsafe fn stream_is_capturing(stream: sys::cudaStream_t) -> Result<bool> {
    type CapturingFn =
        unsafe extern "C" fn(cu::CUstream, *mut cu::CUstreamCaptureStatus) -> CUresult;
    if let Some(function) = driver_fn!(cuStreamIsCapturing: CapturingFn) {
        let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller guarantees the stream is live; `status` is writable.
        driver_status("cuStreamIsCapturing", unsafe {
            function(stream.cast(), &mut status)
        })?;
        return Ok(status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    }
    let mut status = sys::cudaStreamCaptureStatus::cudaStreamCaptureStatusNone;
    cuda!(cudaStreamIsCapturing(stream, &mut status))?;
    Ok(status != sys::cudaStreamCaptureStatus::cudaStreamCaptureStatusNone)
}

/// `cudaEventWaitExternal` of the runtime's headers: in a capture, the wait becomes a node
/// of its own that waits for an event recorded outside the capture.
pub(crate) const EVENT_WAIT_EXTERNAL: u32 = 0x01;

/// # Safety
///
/// - `stream` and `event` are live.
pub(crate) unsafe fn stream_wait_event(
    stream: sys::cudaStream_t,
    event: sys::cudaEvent_t,
    flags: u32,
) -> Result<()> {
    cuda!(cudaStreamWaitEvent(stream, event, flags))
}

/// # Safety
///
/// - `stream` is live; `function(data)` is sound to call from a CUDA driver thread any number
///   of times (a graph that captured it calls it at each launch), at any later time, and
///   does not unwind. (CUDA calls made from it fail or deadlock.)
pub(crate) unsafe fn launch_host_func(
    stream: sys::cudaStream_t,
    function: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
) -> Result<()> {
    cuda!(cudaLaunchHostFunc(stream, Some(function), data))
}
