//! What the stager's driver paths rely on, checked on the device before they are taken.
//!
//! An upload from ordinary memory returns once the driver has copied the source into its own
//! pinned memory, and a download into ordinary memory returns once the destination is
//! filled: CUDA documented both up to version 11, and version 13 still behaves so on the
//! devices measured, but its documentation now says only that such calls "might be
//! synchronous". So the first stager of each device in a process copies 4 KiB each way
//! behind work that holds the stream back, and a path whose call returns early is not taken.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::device::Device;
use crate::device_buffer::DeviceBuffer;
use crate::error::Result;
use crate::ffi::{self, Direction};
use crate::stream::Stream;

use super::lock;

/// Which driver paths hold on a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DriverPaths {
    /// An upload's call returned with the source read.
    pub(crate) uploads: bool,
    /// A download's call returned with the destination filled.
    pub(crate) downloads: bool,
}

/// How long the check holds its stream back before each copy: a call that does not wait
/// returns well within it.
const HOLD: Duration = Duration::from_millis(5);

/// Bytes copied each way.
const BYTES: usize = 4096;

/// The driver paths of `device`, checked once per process (at most `2 × HOLD`). Runs with
/// the device current.
pub(crate) fn driver_paths(device: Device) -> Result<DriverPaths> {
    static CHECKED: Mutex<Vec<(Device, DriverPaths)>> = Mutex::new(Vec::new());
    // Held through the check: stagers made at once wait for one check.
    let mut checked = lock(&CHECKED);
    if let Some(&(_, paths)) = checked.iter().find(|(known, _)| *known == device) {
        return Ok(paths);
    }
    let paths = check(device)?;
    checked.push((device, paths));
    Ok(paths)
}

/// Uploads a pattern behind held-back work and overwrites the source as soon as the call
/// returns; then downloads it behind held-back work and looks at the destination as soon as
/// that call returns.
fn check(device: Device) -> Result<DriverPaths> {
    let stream = Stream::on(device)?;
    let memory = DeviceBuffer::<u8>::zeroed_on(device, BYTES)?;
    let original: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8 + 1).collect();
    let mut source = original.clone();
    let mut back = vec![0u8; BYTES];
    let hold = |stream: &Stream| -> Result<Arc<AtomicBool>> {
        let over = Arc::new(AtomicBool::new(false));
        let flag = over.clone();
        stream.launch_host_fn(move || {
            std::thread::sleep(HOLD);
            flag.store(true, Ordering::Release);
        })?;
        Ok(over)
    };
    let queued = hold(&stream).and_then(|_| {
        // SAFETY: `source` and `memory` outlive the work on the stream (waited for below,
        // or both leaked); nothing else uses `memory`.
        unsafe {
            ffi::copy_once(
                memory.as_raw() as *mut std::ffi::c_void,
                source.as_ptr().cast(),
                BYTES,
                Direction::HostToDevice,
                stream.as_raw(),
            )
        }
    });
    // Through a raw pointer, as the driver may still read it: if it does, zeros arrive.
    // SAFETY: `source` is live and `BYTES` long.
    unsafe { std::ptr::write_bytes(source.as_mut_ptr(), 0, BYTES) };
    let downloaded = queued.and_then(|()| {
        let held = hold(&stream)?;
        // SAFETY: as above, for `back`.
        unsafe {
            ffi::copy_once(
                back.as_mut_ptr().cast(),
                memory.as_raw() as *const std::ffi::c_void,
                BYTES,
                Direction::DeviceToHost,
                stream.as_raw(),
            )
        }?;
        let waited = held.load(Ordering::Acquire);
        // Read as the DMA may still write it (if the call did not wait for it).
        // SAFETY: `back` is live and `BYTES` long; bytes are read one at a time.
        let seen: Vec<u8> = (0..BYTES)
            .map(|i| unsafe { back.as_ptr().add(i).read_volatile() })
            .collect();
        Ok(waited && seen == original)
    });
    if let Err(error) = stream.synchronize() {
        // The copies may still run: their memory must stay.
        std::mem::forget((source, back, memory));
        return Err(error);
    }
    let filled_on_return = downloaded?;
    // `back` holds what the upload delivered.
    let uploads = back == original;
    Ok(DriverPaths {
        uploads,
        downloads: uploads && filled_on_return,
    })
}
