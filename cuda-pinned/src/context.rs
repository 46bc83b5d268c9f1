//! Which context is current and in which capture mode, around every call this crate makes.

use std::ffi::c_uint;

use cuda_pinned_sys::driver as cu;

use crate::error::Result;
use crate::raw::context::{
    current_context, exchange_capture_mode, has_context_calls, primary_context, set_context,
};
use crate::raw::device::{current_device, set_device};

/// Runs `work` with `device`'s primary context current on the calling thread, then makes
/// current again whatever context was current before: none, another device's, or a context
/// of the user's own. The switch goes through the driver (`cuCtxSetCurrent`), never through
/// `cudaSetDevice`, so the runtime's idea of the thread's device is untouched, and a thread
/// that had no context is left with none (working on device 1 does not create a context on
/// device 0). Where the driver's entry points cannot be reached (runtimes before 12.5), the
/// runtime's device is switched and put back instead.
///
/// Every call of this crate that touches a stream, event or buffer of a named device goes
/// through here, so none leaves the caller's current device changed, even when `work`
/// unwinds.
///
/// The work runs in relaxed capture mode (see [`relaxed`]).
pub(crate) fn on_device<R>(device: i32, work: impl FnOnce() -> Result<R>) -> Result<R> {
    relaxed(|| with_context_of(device, work))
}

/// [`on_device`] without the capture mode.
fn with_context_of<R>(device: i32, work: impl FnOnce() -> Result<R>) -> Result<R> {
    if has_context_calls() {
        let current = current_context()?;
        let target = primary_context(device)?;
        if current == target {
            return work();
        }
        // SAFETY: `target` is a primary context this crate retained and never releases.
        unsafe { set_context(target)? };
        let _restore = Restore::Context(current);
        return work();
    }
    let previous = current_device()?;
    if previous == device {
        return work();
    }
    set_device(device)?;
    let _restore = Restore::Device(previous);
    work()
}

/// What [`on_device`] puts back when its work returns or unwinds.
enum Restore {
    Context(cu::CUcontext),
    Device(i32),
}

impl Drop for Restore {
    fn drop(&mut self) {
        // Nothing better is left to do if this fails; the work's result is what counts.
        let _ = match *self {
            // SAFETY: the context was current on this thread a moment ago, and whoever owns
            // it cannot have destroyed it while it was not current here; null (no context)
            // is allowed.
            Self::Context(context) => unsafe { set_context(context) },
            Self::Device(device) => set_device(device),
        };
    }
}

/// Runs `work` with the calling thread in relaxed capture mode, then gives it back its own.
///
/// While a thread captures a CUDA graph in global mode (the default, cudarc's too), CUDA
/// refuses every other thread's "potentially unsafe" calls: waiting for or querying any
/// stream or event, allocating or freeing memory. They fail with
/// `cudaErrorStreamCaptureUnsupported`, and each refusal invalidates that capture. So a copy
/// queued before the capture began could not be waited for: a tracked buffer would be
/// leaked, a blocking copy could not return. This crate never waits on or queues work into
/// a capturing stream (copies refuse one), so its calls are made in relaxed mode, which CUDA
/// refuses nothing, as PyTorch's allocators do; an exchange pair costs tens of nanoseconds,
/// and calls nested in one (a record inside a copy's `on_device`) make none. If the mode cannot be exchanged, `work` runs in the thread's own.
pub(crate) fn relaxed<R>(work: impl FnOnce() -> R) -> R {
    const RELAXED: c_uint = 2;
    if RELAXED_HERE.get() {
        return work();
    }
    let _restore = exchange_capture_mode(RELAXED).map(|previous| {
        RELAXED_HERE.set(true);
        CaptureMode(previous)
    });
    work()
}

thread_local! {
    /// Whether [`relaxed`] holds this thread in relaxed mode now.
    static RELAXED_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The capture mode [`relaxed`] gives back to the thread, also when its work unwinds.
struct CaptureMode(c_uint);

impl Drop for CaptureMode {
    fn drop(&mut self) {
        exchange_capture_mode(self.0);
        RELAXED_HERE.set(false);
    }
}

/// Runs `work` in the calling thread's current device's context (device 0's on a thread that
/// never chose one) and leaves the thread's context as it was.
pub(crate) fn on_current_device<R>(work: impl FnOnce() -> Result<R>) -> Result<R> {
    on_device(current_device()?, work)
}
