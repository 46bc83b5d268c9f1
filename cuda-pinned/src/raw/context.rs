//! Contexts and the thread's capture mode.

use std::ffi::c_uint;
use std::ptr::{self};
use std::sync::OnceLock;

use cuda_pinned_sys::driver::{self as cu, CUresult};
use cuda_pinned_sys::{self as sys};

use super::device::device_count;
use crate::error::Result;

/// Sets the calling thread's capture mode (`cudaStreamCaptureMode`, whose values the
/// driver's enum shares) and returns the one it had; `None` if CUDA refused.
pub(crate) fn exchange_capture_mode(mode: c_uint) -> Option<c_uint> {
    type ExchangeFn = unsafe extern "C" fn(*mut cu::CUstreamCaptureMode) -> CUresult;
    if let Some(exchange) = driver_fn!(cuThreadExchangeStreamCaptureMode: ExchangeFn) {
        let mut mode = cu::CUstreamCaptureMode(mode);
        // SAFETY: `mode` is a valid, writable mode; the call only swaps thread-local state.
        let status = unsafe { exchange(&mut mode) };
        return (status == CUresult::CUDA_SUCCESS).then_some(mode.0);
    }
    let mut mode = sys::cudaStreamCaptureMode(mode);
    (|| cuda!(cudaThreadExchangeStreamCaptureMode(&mut mode)))()
        .ok()
        .map(|()| mode.0)
}

/// Whether the driver's context calls can be reached (asked once: `on_device` runs on every
/// copy).
pub(crate) fn has_context_calls() -> bool {
    static REACHABLE: OnceLock<bool> = OnceLock::new();
    *REACHABLE.get_or_init(|| {
        cu::driver().is_ok_and(|driver| {
            driver.cuCtxGetCurrent().is_ok()
                && driver.cuCtxSetCurrent().is_ok()
                && driver.cuDeviceGet().is_ok()
                && driver.cuDevicePrimaryCtxRetain().is_ok()
        })
    })
}

/// The calling thread's current driver context; null when it has none.
pub(crate) fn current_context() -> Result<cu::CUcontext> {
    let mut context = ptr::null_mut();
    driver!(cuCtxGetCurrent(&mut context))?;
    Ok(context)
}

/// # Safety
///
/// - `context` is null or a live context.
pub(crate) unsafe fn set_context(context: cu::CUcontext) -> Result<()> {
    driver!(cuCtxSetCurrent(context))
}

/// The primary context of `device` (the runtime's, and cudarc's), retained once per process
/// and kept: its handle is asked for on every switch. (The driver hands back the same handle
/// after a `cudaDeviceReset`.)
pub(crate) fn primary_context(device: i32) -> Result<cu::CUcontext> {
    static RETAINED: OnceLock<Box<[OnceLock<usize>]>> = OnceLock::new();
    let retained = match RETAINED.get() {
        Some(retained) => retained,
        None => {
            let devices = device_count()?.max(0) as usize;
            RETAINED.get_or_init(|| (0..devices).map(|_| OnceLock::new()).collect())
        }
    };
    // An ordinal past the last device has no slot; `cuDeviceGet` refuses it below.
    let slot = usize::try_from(device).ok().and_then(|d| retained.get(d));
    if let Some(&context) = slot.and_then(OnceLock::get) {
        return Ok(context as cu::CUcontext);
    }
    let mut handle = 0;
    driver!(cuDeviceGet(&mut handle, device))?;
    let mut context = ptr::null_mut();
    // Retained for good: the crate's streams, events and memory live in it. (Two threads
    // racing here retain it twice; the count only keeps it alive.)
    driver!(cuDevicePrimaryCtxRetain(&mut context, handle))?;
    if let Some(slot) = slot {
        let _ = slot.set(context as usize);
    }
    Ok(context)
}
