//! The one place that calls CUDA: thin `Result` functions over the sys crate.
//!
//! Every function turns a missing library or symbol into [`Error::Unavailable`] and a
//! non-success code into [`Error::Cuda`] (runtime) or [`Error::Driver`] (driver), clearing
//! the runtime's per-thread last error so a failure here does not resurface in a user's
//! next, unrelated CUDA call.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::{self, NonNull};
use std::sync::OnceLock;

use cuda_pinned_sys::{self as sys, cudaError, cudart};

use cuda_pinned_sys::driver::{self as cu, CUresult};

use crate::chunked;
use crate::error::{CudaError, DriverError, Error, Result};

/// Calls one runtime function and checks its status.
///
/// Every use site is inside an `unsafe fn` of this module whose `# Safety` section (or a safe
/// fn whose body) establishes the C function's preconditions for the given arguments.
macro_rules! cuda {
    ($name:ident($($arg:expr),* $(,)?)) => {{
        let function = cudart()?.$name()?;
        // SAFETY: see the macro's documentation: the enclosing function guarantees the
        // arguments satisfy the C function's contract.
        let status = unsafe { function($($arg),*) };
        check(stringify!($name), status)
    }};
}

/// Calls one driver function (reached through the runtime) and checks its status; the same
/// contract as [`cuda!`].
macro_rules! driver {
    ($name:ident($($arg:expr),* $(,)?)) => {{
        let function = cu::driver()?.$name()?;
        // SAFETY: as for `cuda!`: the enclosing function guarantees the arguments satisfy
        // the C function's contract.
        driver_status(stringify!($name), unsafe { function($($arg),*) })
    }};
}

/// A driver function resolved once per process: `None` where the runtime or the driver does
/// not provide it (runtimes before 12.5), so that callers fall back to the runtime's call
/// without asking again.
macro_rules! driver_fn {
    ($name:ident: $type:ty) => {{
        static RESOLVED: OnceLock<Option<$type>> = OnceLock::new();
        *RESOLVED.get_or_init(|| {
            runtime_calls_not_asked()
                .then(|| cu::driver().and_then(cu::Driver::$name).ok())
                .flatten()
        })
    }};
}

/// The environment variable that makes copies, events and pointer lookups go through the
/// runtime's calls even where the driver's can be reached: what runtimes before 12.5 do, to
/// compare or test that path. Read once.
pub const RUNTIME_CALLS_VAR: &str = "CUDA_PINNED_RUNTIME_CALLS";

/// Whether [`RUNTIME_CALLS_VAR`] is unset (or empty).
fn runtime_calls_not_asked() -> bool {
    static NOT_ASKED: OnceLock<bool> = OnceLock::new();
    *NOT_ASKED.get_or_init(|| std::env::var_os(RUNTIME_CALLS_VAR).is_none_or(|v| v.is_empty()))
}

type LookupFn = unsafe extern "C" fn(
    std::ffi::c_uint,
    *mut cu::CUpointer_attribute,
    *mut *mut c_void,
    cu::CUdeviceptr,
) -> CUresult;
type UploadFn =
    unsafe extern "C" fn(cu::CUdeviceptr, *const c_void, usize, cu::CUstream) -> CUresult;
type DownloadFn =
    unsafe extern "C" fn(*mut c_void, cu::CUdeviceptr, usize, cu::CUstream) -> CUresult;
type RecordFn = unsafe extern "C" fn(cu::CUevent, cu::CUstream) -> CUresult;
type EventFn = unsafe extern "C" fn(cu::CUevent) -> CUresult;

/// A driver call's status as a `Result`.
fn driver_status(call: &'static str, status: CUresult) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(DriverError::new(call, status)))
    }
}

fn check(call: &'static str, status: cudaError) -> Result<()> {
    if status == cudaError::cudaSuccess {
        return Ok(());
    }
    // Reset the per-thread "last error" so it does not poison later, unrelated calls.
    if let Ok(Ok(clear)) = cudart().map(|rt| rt.cudaGetLastError()) {
        // SAFETY: cudaGetLastError takes no arguments and only resets thread-local state.
        unsafe { clear() };
    }
    Err(Error::Cuda(CudaError::new(call, status)))
}

/// Like [`check`] for a call whose `NotReady` answer is a normal outcome.
fn query(call: &'static str, status: cudaError) -> Result<bool> {
    if status == cudaError::cudaErrorNotReady {
        return Ok(false);
    }
    check(call, status).map(|()| true)
}

// ---- versions and devices ------------------------------------------------------------------

pub(crate) fn runtime_version() -> Result<i32> {
    let mut version = 0;
    cuda!(cudaRuntimeGetVersion(&mut version))?;
    Ok(version)
}

pub(crate) fn driver_version() -> Result<i32> {
    let mut version = 0;
    cuda!(cudaDriverGetVersion(&mut version))?;
    Ok(version)
}

pub(crate) fn device_count() -> Result<i32> {
    let mut count = 0;
    match cuda!(cudaGetDeviceCount(&mut count)) {
        Err(Error::Cuda(e)) if e.raw() == cudaError::cudaErrorNoDevice => Ok(0),
        other => other.map(|()| count),
    }
}

pub(crate) fn current_device() -> Result<i32> {
    let mut device = 0;
    cuda!(cudaGetDevice(&mut device))?;
    Ok(device)
}

pub(crate) fn set_device(device: i32) -> Result<()> {
    cuda!(cudaSetDevice(device))
}

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
/// refuses nothing, as PyTorch's allocators do; an exchange pair costs about 30 ns through
/// the driver on an H100 host, and calls nested in one (a record inside a copy's
/// `on_device`) make none. If the mode cannot be exchanged, `work` runs in the thread's own.
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

/// Sets the calling thread's capture mode (`cudaStreamCaptureMode`, whose values the
/// driver's enum shares) and returns the one it had; `None` if CUDA refused.
fn exchange_capture_mode(mode: c_uint) -> Option<c_uint> {
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
fn has_context_calls() -> bool {
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
fn current_context() -> Result<cu::CUcontext> {
    let mut context = ptr::null_mut();
    driver!(cuCtxGetCurrent(&mut context))?;
    Ok(context)
}

/// # Safety
///
/// - `context` is null or a live context.
unsafe fn set_context(context: cu::CUcontext) -> Result<()> {
    driver!(cuCtxSetCurrent(context))
}

/// The primary context of `device` (the runtime's, and cudarc's), retained once per process
/// and kept: its handle is asked for on every switch. (The driver hands back the same handle
/// after a `cudaDeviceReset`.)
fn primary_context(device: i32) -> Result<cu::CUcontext> {
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

/// The device a stream belongs to (the runtime has the call from CUDA 12.8).
///
/// # Safety
///
/// - `stream` is a live stream.
pub(crate) unsafe fn stream_device(stream: sys::cudaStream_t) -> Result<i32> {
    let mut device = -1;
    cuda!(cudaStreamGetDevice(stream, &mut device))?;
    Ok(device)
}

pub(crate) fn device_attribute(attribute: sys::cudaDeviceAttr, device: i32) -> Result<i32> {
    let mut value = 0;
    cuda!(cudaDeviceGetAttribute(&mut value, attribute, device))?;
    Ok(value)
}

pub(crate) fn pci_bus_id(device: i32) -> Result<String> {
    let mut buffer = [0 as std::ffi::c_char; 64];
    cuda!(cudaDeviceGetPCIBusId(
        buffer.as_mut_ptr(),
        buffer.len() as c_int,
        device
    ))?;
    Ok(c_chars_to_string(&buffer))
}

pub(crate) fn device_name(device: i32) -> Result<String> {
    // `cudaDeviceProp` grows between CUDA versions, and the runtime writes its own version's
    // layout; `name` is the first field in all of them. An 8 KiB zeroed buffer holds every
    // layout to date with room to spare, and only the name is read back.
    let mut buffer = vec![0u64; 1024];
    let prop = buffer.as_mut_ptr().cast::<sys::cudaDeviceProp>();
    const _: () = assert!(std::mem::size_of::<sys::cudaDeviceProp>() < 8192);
    cuda!(cudaGetDeviceProperties(prop, device))?;
    // SAFETY: the buffer is 8-byte aligned, initialised, and 8 KiB long; the first 256 bytes
    // are `char name[256]` in every layout.
    let name =
        unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<std::ffi::c_char>(), 256) };
    Ok(c_chars_to_string(name))
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

// ---- host memory ---------------------------------------------------------------------------

// These calls work in the current device's context, which the runtime would make current
// (and leave so) on a thread that had none: `on_current_device` leaves such a thread as it
// was.

/// Runs `work` in the calling thread's current device's context (device 0's on a thread that
/// never chose one) and leaves the thread's context as it was.
fn on_current_device<R>(work: impl FnOnce() -> Result<R>) -> Result<R> {
    on_device(current_device()?, work)
}

pub(crate) fn host_alloc(bytes: usize, flags: u32) -> Result<NonNull<u8>> {
    let mut ptr = ptr::null_mut();
    on_current_device(|| cuda!(cudaHostAlloc(&mut ptr, bytes, flags)))?;
    NonNull::new(ptr.cast()).ok_or(Error::OutOfMemory { requested: bytes })
}

/// # Safety
///
/// - `ptr` came from [`host_alloc`] and is not used afterwards.
pub(crate) unsafe fn free_host(ptr: NonNull<u8>) -> Result<()> {
    on_current_device(|| cuda!(cudaFreeHost(ptr.as_ptr().cast())))
}

/// # Safety
///
/// - `ptr..ptr + bytes` is memory this process has mapped and keeps mapped until
///   [`host_unregister`] is called on `ptr`.
pub(crate) unsafe fn host_register(ptr: NonNull<u8>, bytes: usize, flags: u32) -> Result<()> {
    on_current_device(|| cuda!(cudaHostRegister(ptr.as_ptr().cast(), bytes, flags)))
}

/// # Safety
///
/// - `ptr` is the start of a range registered with [`host_register`] and no copy on any
///   stream still uses it.
pub(crate) unsafe fn host_unregister(ptr: NonNull<u8>) -> Result<()> {
    on_current_device(|| cuda!(cudaHostUnregister(ptr.as_ptr().cast())))
}

pub(crate) fn host_device_pointer(ptr: NonNull<u8>) -> Result<u64> {
    let mut device = ptr::null_mut();
    // cudaHostGetDevicePointer only looks the address up; it never dereferences it.
    on_current_device(|| {
        cuda!(cudaHostGetDevicePointer(
            &mut device,
            ptr.as_ptr().cast(),
            0
        ))
    })?;
    Ok(device as u64)
}

/// Whether CUDA sees `ptr` as ordinary host memory: not page-locked, device or managed
/// memory. `false` when CUDA cannot say. Asks the driver for the one attribute needed where
/// its entry points are reachable (about 100 ns against 140 for the runtime's whole set).
pub(crate) fn is_pageable(ptr: *const c_void) -> bool {
    if let Ok(known) = driver_memory_type(ptr) {
        return !known;
    }
    let mut attributes = sys::cudaPointerAttributes {
        type_: sys::cudaMemoryType::cudaMemoryTypeDevice,
        device: 0,
        devicePointer: ptr::null_mut(),
        hostPointer: ptr::null_mut(),
        reserved: [0; 8],
    };
    // cudaPointerGetAttributes only looks the address up; it never dereferences it.
    let looked_up = (|| cuda!(cudaPointerGetAttributes(&mut attributes, ptr)))();
    looked_up.is_ok()
        && attributes.type_ == sys::cudaMemoryType::cudaMemoryTypeUnregistered
        && attributes.devicePointer.is_null()
}

/// Whether the driver knows `ptr` as memory of some type (host, device, managed); an address
/// it does not know reads as type 0 (`cuPointerGetAttributes` fills unknown addresses with
/// zeros instead of failing). An answer it did not write counts as an error.
fn driver_memory_type(ptr: *const c_void) -> Result<bool> {
    const UNWRITTEN: std::ffi::c_uint = std::ffi::c_uint::MAX;
    let mut memory_type = UNWRITTEN;
    let mut attribute = cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    let mut data = [(&raw mut memory_type).cast::<c_void>()];
    let lookup = driver_fn!(cuPointerGetAttributes: LookupFn).ok_or(Error::Unsupported(
        "cuPointerGetAttributes is not reachable",
    ))?;
    // SAFETY: the lookup never dereferences `ptr`; `data` holds one pointer to a `c_uint`,
    // the memory type attribute's value.
    let status = unsafe { lookup(1, &mut attribute, data.as_mut_ptr(), ptr as cu::CUdeviceptr) };
    driver_status("cuPointerGetAttributes", status)?;
    if memory_type == UNWRITTEN {
        return Err(Error::Unsupported(
            "cuPointerGetAttributes left the memory type unwritten",
        ));
    }
    Ok(memory_type != 0)
}

// ---- host memory through the virtual-memory API -------------------------------------------

/// What `cuMemCreate` is asked for: page-locked host memory on NUMA node `node`.
fn host_numa_prop(node: u32) -> cu::CUmemAllocationProp {
    let mut prop = cu::CUmemAllocationProp {
        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        ..Default::default()
    };
    prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = node as c_int;
    prop
}

/// The size every chunk of host memory on `node` is a multiple of.
pub(crate) fn host_granularity(node: u32) -> Result<usize> {
    let prop = host_numa_prop(node);
    let mut granularity = 0;
    driver!(cuMemGetAllocationGranularity(
        &mut granularity,
        &prop,
        cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    ))?;
    if granularity == 0 || !granularity.is_power_of_two() {
        return Err(Error::Unsupported(
            "the driver reported no allocation granularity",
        ));
    }
    Ok(granularity)
}

/// Reserves `bytes` of address space (no memory behind it), aligned to `align`.
pub(crate) fn address_reserve(bytes: usize, align: usize) -> Result<NonNull<u8>> {
    let mut address = 0;
    relaxed(|| driver!(cuMemAddressReserve(&mut address, bytes, align, 0, 0))).map_err(
        |e| match e {
            Error::Driver(d) if d.is_out_of_memory() => Error::OutOfMemory { requested: bytes },
            other => other,
        },
    )?;
    NonNull::new(ptr::with_exposed_provenance_mut(address as usize))
        .ok_or(Error::Unsupported("the driver reserved address 0"))
}

/// # Safety
///
/// - `ptr..ptr + bytes` is exactly a range from [`address_reserve`], with nothing mapped in it
///   and nothing using it afterwards.
pub(crate) unsafe fn address_free(ptr: NonNull<u8>, bytes: usize) -> Result<()> {
    relaxed(|| driver!(cuMemAddressFree(ptr.as_ptr() as u64, bytes)))
}

/// Creates `bytes` of page-locked memory on `node` and maps it at `at`; on failure nothing is
/// mapped. The memory handle is released at once: the mapping keeps the memory until
/// [`unmap`] (the driver's rule), so nothing else needs to be remembered. The memory is not
/// accessible until [`open_host_memory`].
///
/// # Safety
///
/// - `at..at + bytes` lies inside a range from [`address_reserve`] with nothing mapped there,
///   and `at` and `bytes` are multiples of [`host_granularity`].
pub(crate) unsafe fn map_host_memory(at: NonNull<u8>, bytes: usize, node: u32) -> Result<()> {
    let prop = host_numa_prop(node);
    let mut handle = 0;
    relaxed(|| {
        driver!(cuMemCreate(&mut handle, bytes, &prop, 0))?;
        let mapped = driver!(cuMemMap(at.as_ptr() as u64, bytes, 0, handle, 0));
        // The mapping holds the memory now (or the map failed): the handle is not needed
        // either way. A failed release only leaks the handle's bookkeeping.
        let _ = driver!(cuMemRelease(handle));
        mapped
    })
}

/// Opens memory mapped by [`map_host_memory`] on `node` to the host and to `devices`.
///
/// # Safety
///
/// - `at..at + bytes` is mapped by [`map_host_memory`] (one call or several adjacent ones).
pub(crate) unsafe fn open_host_memory(
    at: NonNull<u8>,
    bytes: usize,
    node: u32,
    devices: &[i32],
) -> Result<()> {
    let access = |type_, id| cu::CUmemAccessDesc {
        location: cu::CUmemLocation { type_, id },
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let mut descriptors = vec![access(
        cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
        node as c_int,
    )];
    descriptors.extend(
        devices
            .iter()
            .map(|&device| access(cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, device)),
    );
    relaxed(|| {
        driver!(cuMemSetAccess(
            at.as_ptr() as u64,
            bytes,
            descriptors.as_ptr(),
            descriptors.len()
        ))
    })
}

/// # Safety
///
/// - `ptr..ptr + bytes` is memory mapped by [`map_host_memory`] (one call or several
///   adjacent ones), used by no device work and nothing on the host afterwards.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) -> Result<()> {
    relaxed(|| driver!(cuMemUnmap(ptr.as_ptr() as u64, bytes)))
}

// ---- device memory -------------------------------------------------------------------------

pub(crate) fn device_malloc(bytes: usize) -> Result<u64> {
    let mut ptr = ptr::null_mut();
    cuda!(cudaMalloc(&mut ptr, bytes))?;
    Ok(ptr as u64)
}

/// # Safety
///
/// - `ptr` came from [`device_malloc`], is not used afterwards, and no pending work uses it.
pub(crate) unsafe fn device_free(ptr: u64) -> Result<()> {
    cuda!(cudaFree(ptr as *mut c_void))
}

/// Direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    HostToDevice,
    DeviceToHost,
}

impl Direction {
    fn kind(self) -> sys::cudaMemcpyKind {
        match self {
            Self::HostToDevice => sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
            Self::DeviceToHost => sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
        }
    }
}

/// Queues a copy between host and device memory on `stream`, cut where buffers registered in
/// chunks end (a copy may not span two registrations).
///
/// # Safety
///
/// - `src` is readable and `dst` writable for `bytes` bytes, in the memory the direction
///   names, until the copy finishes on `stream` (which stays alive until then);
/// - nothing else writes `dst` or `src` (or reads `dst`) while the copy is pending;
/// - the calling thread's current context is the primary context of `stream`'s device (as
///   [`on_device`] leaves it): the driver checks device addresses against it, and it decides
///   which stream a default-stream handle names.
pub(crate) unsafe fn memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    direction: Direction,
    stream: sys::cudaStream_t,
) -> Result<()> {
    let host = match direction {
        Direction::HostToDevice => src as usize,
        Direction::DeviceToHost => dst as usize,
    };
    for (offset, piece) in chunked::pieces(host, bytes) {
        // Plain address arithmetic: one side is a device address, no Rust allocation.
        let (dst, src) = (dst.wrapping_byte_add(offset), src.wrapping_byte_add(offset));
        // SAFETY: forwarded from the caller, for a part of the copy.
        unsafe { copy_once(dst, src, piece, direction, stream)? };
    }
    Ok(())
}

/// One copy call, the copy whole: the driver's own call where its entry points are reachable,
/// else the runtime's `cudaMemcpyAsync`, which costs 0.1–0.3 µs more per call on an H100 host
/// (a few percent of a small copy). The handles and addresses are the same for both. Unlike
/// [`memcpy_async`] it is not cut where buffers registered in chunks end: a page-locked side
/// that spans two registrations is refused with an error, and a host side that starts in
/// ordinary memory is staged whole by the driver.
///
/// # Safety
///
/// As [`memcpy_async`].
pub(crate) unsafe fn copy_once(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    direction: Direction,
    stream: sys::cudaStream_t,
) -> Result<()> {
    match direction {
        Direction::HostToDevice => {
            if let Some(copy) = driver_fn!(cuMemcpyHtoDAsync: UploadFn) {
                // SAFETY: forwarded from the caller.
                let status = unsafe { copy(dst as u64, src, bytes, stream.cast()) };
                return driver_status("cuMemcpyHtoDAsync", status);
            }
        }
        Direction::DeviceToHost => {
            if let Some(copy) = driver_fn!(cuMemcpyDtoHAsync: DownloadFn) {
                // SAFETY: forwarded from the caller.
                let status = unsafe { copy(dst, src as u64, bytes, stream.cast()) };
                return driver_status("cuMemcpyDtoHAsync", status);
            }
        }
    }
    cuda!(cudaMemcpyAsync(dst, src, bytes, direction.kind(), stream))
}

/// `(offset, len)` pieces of a copy of `bytes` from `src` to `dst` such that neither side of a
/// piece spans two registrations of buffers registered in chunks. Pieces of a copy queued
/// one after another on one stream run in order, as the whole copy would.
fn copy_pieces(dst: usize, src: usize, bytes: usize) -> impl Iterator<Item = (usize, usize)> {
    chunked::pieces(src, bytes).flat_map(move |(offset, len)| {
        chunked::pieces(dst + offset, len).map(move |(inner, len)| (offset + inner, len))
    })
}

/// As [`memcpy_async`], the direction told by unified addressing (`cudaMemcpyDefault`).
///
/// # Safety
///
/// As [`memcpy_async`].
pub(crate) unsafe fn memcpy_async_any(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: sys::cudaStream_t,
) -> Result<()> {
    for (offset, piece) in copy_pieces(dst as usize, src as usize, bytes) {
        // Plain address arithmetic: either side may be a device address.
        let (dst, src) = (dst.wrapping_byte_add(offset), src.wrapping_byte_add(offset));
        cuda!(cudaMemcpyAsync(
            dst,
            src,
            piece,
            sys::cudaMemcpyKind::cudaMemcpyDefault,
            stream
        ))?;
    }
    Ok(())
}

/// Whether `cudaMemcpyBatchAsync` can be called with the signature of the bindings: the
/// runtime is CUDA 13 or newer (12.8 and 12.9 take one argument more).
pub(crate) fn has_memcpy_batch() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        runtime_version().is_ok_and(|v| v >= 13000)
            && cudart().is_ok_and(|rt| rt.cudaMemcpyBatchAsync().is_ok())
    })
}

/// Queues `dsts.len()` copies at once (unified addressing tells each one's direction); the
/// sources are read in stream order.
///
/// # Safety
///
/// - the three slices have one length, and [`has_memcpy_batch`] said yes;
/// - as [`memcpy_async`] for each `(dsts[i], srcs[i], sizes[i])`.
pub(crate) unsafe fn memcpy_batch_async(
    dsts: &[*mut c_void],
    srcs: &[*const c_void],
    sizes: &[usize],
    stream: sys::cudaStream_t,
) -> Result<()> {
    let mut attributes = sys::cudaMemcpyAttributes {
        srcAccessOrder: sys::cudaMemcpySrcAccessOrder::cudaMemcpySrcAccessOrderStream,
        ..Default::default()
    };
    let mut first = 0usize;
    // Copies that cross from one chunk of a buffer registered in chunks into the next are
    // cut into one entry per chunk.
    let split: (Vec<_>, Vec<_>, Vec<_>);
    let (dsts, srcs, sizes) = if chunked::any() {
        let mut pieces = (Vec::new(), Vec::new(), Vec::new());
        for ((&dst, &src), &bytes) in dsts.iter().zip(srcs).zip(sizes) {
            for (offset, len) in copy_pieces(dst as usize, src as usize, bytes) {
                pieces.0.push(dst.wrapping_byte_add(offset));
                pieces.1.push(src.wrapping_byte_add(offset));
                pieces.2.push(len);
            }
        }
        split = pieces;
        (&split.0[..], &split.1[..], &split.2[..])
    } else {
        (dsts, srcs, sizes)
    };
    cuda!(cudaMemcpyBatchAsync(
        dsts.as_ptr(),
        srcs.as_ptr(),
        sizes.as_ptr(),
        dsts.len(),
        &mut attributes,
        &mut first,
        1,
        stream
    ))
}

/// # Safety
///
/// - `ptr` is device memory writable for `bytes` bytes until the work on `stream` finishes.
pub(crate) unsafe fn memset_async(
    ptr: u64,
    value: u8,
    bytes: usize,
    stream: sys::cudaStream_t,
) -> Result<()> {
    cuda!(cudaMemsetAsync(
        ptr as *mut c_void,
        c_int::from(value),
        bytes,
        stream
    ))
}

// ---- streams and events --------------------------------------------------------------------

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

/// # Safety
///
/// - `stream` and `event` are live.
pub(crate) unsafe fn stream_wait_event(
    stream: sys::cudaStream_t,
    event: sys::cudaEvent_t,
) -> Result<()> {
    cuda!(cudaStreamWaitEvent(stream, event, 0))
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
    relaxed(|| {
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
    })
}

/// # Safety
///
/// - `event` is live.
pub(crate) unsafe fn event_synchronize(event: sys::cudaEvent_t) -> Result<()> {
    relaxed(|| {
        if let Some(function) = driver_fn!(cuEventSynchronize: EventFn) {
            // SAFETY: the caller guarantees the event is live.
            return driver_status("cuEventSynchronize", unsafe { function(event.cast()) });
        }
        cuda!(cudaEventSynchronize(event))
    })
}

/// # Safety
///
/// - both events are live. (Events created without timing make CUDA return an error.)
pub(crate) unsafe fn event_elapsed_ms(
    start: sys::cudaEvent_t,
    end: sys::cudaEvent_t,
) -> Result<f32> {
    let mut ms = 0.0f32;
    relaxed(|| cuda!(cudaEventElapsedTime(&mut ms, start, end)))?;
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CudaHost, Device, DeviceBuffer, HostLocked, PinnedVec, Registered, VirtualHost};

    /// Ordinary memory (and memory locked with `mlock`, which CUDA does not know) reads as
    /// pageable; every kind of page-locked memory, at both ends, and device memory do not: on
    /// a thread that has used CUDA and on one with no current context, which the driver's
    /// lookup leaves without one.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn only_ordinary_memory_reads_as_pageable() {
        const LEN: usize = 1 << 20;
        let ordinary = vec![0u8; LEN];
        let locked = PinnedVec::<u8, _>::zeroed_in(LEN, HostLocked::new()).unwrap();
        let host = PinnedVec::<u8, _>::zeroed_in(LEN, CudaHost::new()).unwrap();
        let registered = PinnedVec::<u8, _>::zeroed_in(LEN, Registered::new()).unwrap();
        let mapped = Device::current()
            .unwrap()
            .supports_virtual_host_memory()
            .unwrap()
            .then(|| PinnedVec::<u8, _>::zeroed_in(LEN, VirtualHost::new()).unwrap());
        let device = DeviceBuffer::<u8>::zeroed(LEN).unwrap();
        let check = || {
            for (what, memory) in [("ordinary", &ordinary[..]), ("mlock", &locked[..])] {
                assert!(is_pageable(memory.as_ptr().cast()), "{what}");
                assert!(is_pageable(memory[LEN - 1..].as_ptr().cast()), "{what}");
            }
            let mut pinned = vec![
                ("cudaHostAlloc", &host[..]),
                ("registered", &registered[..]),
            ];
            pinned.extend(mapped.as_deref().map(|m| ("virtual host", m)));
            for (what, memory) in pinned {
                assert!(!is_pageable(memory.as_ptr().cast()), "{what}");
                assert!(
                    !is_pageable(memory[LEN - 1..].as_ptr().cast()),
                    "{what}, last byte"
                );
            }
            assert!(!is_pageable(device.as_raw() as *const c_void));
        };
        check();
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    assert!(current_context().unwrap().is_null());
                    if runtime_calls_not_asked() {
                        assert!(driver_memory_type(ordinary.as_ptr().cast()).is_ok());
                    }
                    check();
                    if runtime_calls_not_asked() {
                        assert!(current_context().unwrap().is_null());
                    }
                })
                .join()
                .unwrap();
        });
    }
}
