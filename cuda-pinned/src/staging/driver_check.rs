//! What the stager's driver paths rely on, checked on the device before they are taken.
//!
//! An upload from ordinary memory returns once the driver has copied the source into its own
//! pinned memory, and a download into ordinary memory returns once the destination is
//! filled: CUDA documented both up to version 11, and version 13 still behaves so on the
//! devices measured, but its documentation now says only that such calls "might be
//! synchronous". So the first stager of each device in a process copies 4 KiB and 4 MiB each
//! way, each copy behind work that holds the stream back, and a path whose calls return early
//! is not taken. A call that returns early is caught unless the checking thread stalls for
//! the whole hold between the call's return and its look.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::Result;
use crate::gpu::buffer::DeviceBuffer;
use crate::gpu::device::Device;
use crate::raw::copy::Direction;

use crate::gpu::stream::Stream;

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

/// The sizes copied each way: the smallest copies and the largest a driver path may take.
const SIZES: [usize; 2] = [4 << 10, MAX_DRIVER_BYTES];

/// The largest copy the stager's driver paths take: the largest size checked.
pub(crate) const MAX_DRIVER_BYTES: usize = 4 << 20;

/// The driver paths of `device`, checked once per process (four holds and the copies: tens of
/// milliseconds). Runs with the device current.
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

/// Uploads a pattern of each size behind held-back work and overwrites each source as soon
/// as its call returns; then downloads them, each behind held-back work, and looks at each
/// destination as soon as its call returns. A path that fails at either size is not taken
/// at any size.
fn check(device: Device) -> Result<DriverPaths> {
    let stream = Stream::on(device)?;
    let total: usize = SIZES.iter().sum();
    let memory = DeviceBuffer::<u8>::zeroed_on(device, total)?;
    let offsets = SIZES.iter().scan(0, |at, &bytes| {
        let offset = *at;
        *at += bytes;
        Some((offset, bytes))
    });
    let offsets: Vec<(usize, usize)> = offsets.collect();
    let original: Vec<u8> = (0..total).map(|i| (i % 251) as u8 + 1).collect();
    let mut source = original.clone();
    let mut back = vec![0u8; total];
    // SAFETY: `source` and `memory` outlive the work on the stream: it is waited for below,
    // or both are leaked; nothing else uses `memory`.
    let uploaded = unsafe { upload_each(&stream, &memory, &mut source, &offsets) };
    let filled_on_return = uploaded.and_then(|()| {
        // SAFETY: as above, for `back`.
        unsafe { download_each(&stream, &memory, &mut back, &original, &offsets) }
    });
    if let Err(error) = stream.synchronize() {
        // The copies may still run: their memory must stay.
        std::mem::forget((source, back, memory));
        return Err(error);
    }
    let filled_on_return = filled_on_return?;
    // `back` holds what the uploads delivered.
    let uploads = back == original;
    Ok(DriverPaths {
        uploads,
        downloads: uploads && filled_on_return,
    })
}

/// Holds `stream` back for a while (a host function that sleeps); the flag is raised when
/// the hold is over.
fn hold(stream: &Stream) -> Result<Arc<AtomicBool>> {
    let over = Arc::new(AtomicBool::new(false));
    let flag = over.clone();
    stream.launch_host_fn(move || {
        std::thread::sleep(HOLD);
        flag.store(true, Ordering::Release);
    })?;
    Ok(over)
}

/// Uploads each `(offset, bytes)` piece of `source` behind a hold, through the driver's own
/// call, and zeroes the piece as soon as the call returns: a call that had not read it yet
/// delivers zeros.
///
/// # Safety
///
/// - `source` and `memory` outlive the work queued on `stream`; the pieces lie in both.
unsafe fn upload_each(
    stream: &Stream,
    memory: &DeviceBuffer<u8>,
    source: &mut [u8],
    offsets: &[(usize, usize)],
) -> Result<()> {
    let mut uploaded = Ok(());
    for &(offset, bytes) in offsets {
        uploaded = uploaded.and_then(|()| {
            hold(stream)?;
            // SAFETY: the piece lies in `source` and `memory`, which outlive the copy (the
            // caller's promise); nothing else uses `memory`.
            unsafe {
                crate::raw::copy::copy_once(
                    (memory.as_raw() + offset as u64) as *mut std::ffi::c_void,
                    source.as_ptr().add(offset).cast(),
                    bytes,
                    Direction::HostToDevice,
                    stream.as_raw(),
                )
            }
        });
        // Through a raw pointer, as the driver may still read it: if it does, zeros arrive.
        // SAFETY: the range lies in `source`, which is live.
        unsafe { std::ptr::write_bytes(source.as_mut_ptr().add(offset), 0, bytes) };
    }
    uploaded
}

/// Downloads each piece into `back` behind a hold, through the driver's own call, and says
/// whether every call returned after its hold with its piece filled (as `original`).
///
/// # Safety
///
/// - `back` and `memory` outlive the work queued on `stream`; the pieces lie in both.
unsafe fn download_each(
    stream: &Stream,
    memory: &DeviceBuffer<u8>,
    back: &mut [u8],
    original: &[u8],
    offsets: &[(usize, usize)],
) -> Result<bool> {
    let mut filled = true;
    for &(offset, bytes) in offsets {
        let held = hold(stream)?;
        // SAFETY: the piece lies in `back` and `memory`, which outlive the copy (the caller's
        // promise).
        unsafe {
            crate::raw::copy::copy_once(
                back.as_mut_ptr().add(offset).cast(),
                (memory.as_raw() + offset as u64) as *const std::ffi::c_void,
                bytes,
                Direction::DeviceToHost,
                stream.as_raw(),
            )
        }?;
        let waited = held.load(Ordering::Acquire);
        // Read as the DMA may still write it (if the call did not wait for it).
        // SAFETY: the piece lies in `back`, which is live; bytes are read one at a time.
        let seen = (offset..offset + bytes)
            .all(|i| unsafe { back.as_ptr().add(i).read_volatile() } == original[i]);
        filled &= waited && seen;
    }
    Ok(filled)
}
