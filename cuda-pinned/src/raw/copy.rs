//! Copies.

use std::ffi::c_void;

use cuda_pinned_sys::driver::{self as cu, CUresult};
use cuda_pinned_sys::{self as sys, cudart};

use super::device::runtime_version;
use super::driver_status;
use crate::error::Result;

type UploadFn =
    unsafe extern "C" fn(cu::CUdeviceptr, *const c_void, usize, cu::CUstream) -> CUresult;

type DownloadFn =
    unsafe extern "C" fn(*mut c_void, cu::CUdeviceptr, usize, cu::CUstream) -> CUresult;

/// Direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    HostToDevice,
    DeviceToHost,
}

impl Direction {
    /// How traces name it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::HostToDevice => "host to device",
            Self::DeviceToHost => "device to host",
        }
    }

    fn kind(self) -> sys::cudaMemcpyKind {
        match self {
            Self::HostToDevice => sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
            Self::DeviceToHost => sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
        }
    }
}

/// One copy call, the copy whole: the driver's own call where its entry points are reachable,
/// else the runtime's `cudaMemcpyAsync`, which costs a little more per call (a few percent of
/// a small copy). The handles and addresses are the same for both. Unlike
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

/// One `cudaMemcpyAsync` whose direction unified addressing tells (`cudaMemcpyDefault`).
///
/// # Safety
///
/// As [`copy_once`], either side host or device memory.
pub(crate) unsafe fn copy_default(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: sys::cudaStream_t,
) -> Result<()> {
    cuda!(cudaMemcpyAsync(
        dst,
        src,
        bytes,
        sys::cudaMemcpyKind::cudaMemcpyDefault,
        stream
    ))
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
/// - as [`copy_default`] for each `(dsts[i], srcs[i], sizes[i])`.
pub(crate) unsafe fn copy_batch(
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

/// Queues a strided copy: `rows` rows of `width` bytes, row starts `src_pitch` apart at the
/// source and `dst_pitch` apart at the destination (unified addressing tells the direction).
///
/// # Safety
///
/// As [`copy_default`] for every row; pitches at least `width`; neither side spans two
/// registrations of buffers registered in chunks.
pub(crate) unsafe fn copy_2d(
    dst: *mut c_void,
    dst_pitch: usize,
    src: *const c_void,
    src_pitch: usize,
    width: usize,
    rows: usize,
    stream: sys::cudaStream_t,
) -> Result<()> {
    cuda!(cudaMemcpy2DAsync(
        dst,
        dst_pitch,
        src,
        src_pitch,
        width,
        rows,
        sys::cudaMemcpyKind::cudaMemcpyDefault,
        stream
    ))
}
