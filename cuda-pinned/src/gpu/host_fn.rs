//! Host functions queued on a stream: parked in a table under a number, which is all the
//! driver is handed. A call the driver makes more than once (each launch of a graph that
//! captured the function calls it) or never leaves nothing freed under it.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::error::Result;
use crate::gpu::stream::Stream;

impl Stream {
    /// Queues `function` to run on a driver thread once the work before it has finished;
    /// work queued after it waits for it to return.
    ///
    /// The function must not call CUDA: CUDA may refuse such calls or deadlock in them. That
    /// includes dropping values of this crate that wait for the device first (a `Transfer`,
    /// a `DeviceBuffer` with copies pending, a buffer with recorded uses): a wait that fails
    /// there leaks the memory rather than free it early, but one may never return. A panic
    /// inside the function is caught and its payload leaked, since neither may unwind into
    /// the driver.
    ///
    /// The function runs at most once, however often the driver calls it (a graph that
    /// took it in, launched again and again).
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`](crate::Error::Capturing) on a stream capturing a graph, or a
    /// CUDA error; then `function` is dropped without running, unless it was queued already
    /// and only ordering the stream after it failed (it then runs once, as queued).
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, function: F) -> Result<()> {
        let id = park(Box::new(function));
        // Set once the function is queued to run now (not into a capture): from then on it
        // runs once, whatever the call answers.
        let mut runs = false;
        let queued = crate::gpu::fence::enqueue(self, |stream| {
            // SAFETY: the stream is live; the trampoline is handed a number, not a pointer,
            // runs the function parked under it at most once, lets no panic unwind into the
            // driver, and does nothing on a later call; the function is `Send + 'static`, so
            // running it later on another thread is sound. A function that calls CUDA
            // regardless gets errors or a deadlock, which touch no memory.
            unsafe { crate::raw::stream::launch_host_func(stream.as_raw(), trampoline, id)? };
            runs = true;
            Ok(())
        });
        if queued.is_err() && !runs {
            // Not queued: it never runs.
            drop(unpark(id));
        }
        queued
    }
}

type Parked = Box<dyn FnOnce() + Send>;

static PARKED: Mutex<Option<HashMap<usize, Parked>>> = Mutex::new(None);
static NEXT: AtomicUsize = AtomicUsize::new(1);

/// Parks `function`; the number to hand the driver (as its data pointer).
fn park(function: Parked) -> *mut c_void {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    lock().get_or_insert_with(HashMap::new).insert(id, function);
    std::ptr::without_provenance_mut(id)
}

/// Takes the function parked under `id` back, if it has not run.
fn unpark(id: *mut c_void) -> Option<Parked> {
    lock().as_mut()?.remove(&id.addr())
}

fn lock() -> std::sync::MutexGuard<'static, Option<HashMap<usize, Parked>>> {
    PARKED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the driver calls: runs the function parked under `data`'s number, if still there.
unsafe extern "C" fn trampoline(data: *mut c_void) {
    if let Some(function) = unpark(data) {
        // A payload whose own drop panicked would unwind here: it is leaked instead.
        if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(function)) {
            std::mem::forget(payload);
        }
    }
}
