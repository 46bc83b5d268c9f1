//! Host and device memory.

use std::ffi::{c_int, c_void};
use std::ptr::{self, NonNull};

use cuda_pinned_sys::driver::{self as cu, CUresult};
use cuda_pinned_sys::{self as sys};

use super::driver_status;
use crate::error::{Error, Result};

pub(crate) fn host_alloc(bytes: usize, flags: u32) -> Result<NonNull<u8>> {
    let _span = tracing::debug_span!("pin", kind = %"cudaHostAlloc", bytes).entered();
    let mut ptr = ptr::null_mut();
    cuda!(cudaHostAlloc(&mut ptr, bytes, flags))?;
    NonNull::new(ptr.cast()).ok_or(Error::OutOfMemory { requested: bytes })
}

/// # Safety
///
/// - `ptr` came from [`host_alloc`] and is not used afterwards.
pub(crate) unsafe fn free_host(ptr: NonNull<u8>) -> Result<()> {
    cuda!(cudaFreeHost(ptr.as_ptr().cast()))
}

/// # Safety
///
/// - `ptr..ptr + bytes` is memory this process has mapped and keeps mapped until
///   [`host_unregister`] is called on `ptr`.
pub(crate) unsafe fn host_register(ptr: NonNull<u8>, bytes: usize, flags: u32) -> Result<()> {
    let _span = tracing::debug_span!("pin", kind = %"cudaHostRegister", bytes).entered();
    cuda!(cudaHostRegister(ptr.as_ptr().cast(), bytes, flags))
}

/// # Safety
///
/// - `ptr` is the start of a range registered with [`host_register`] and no copy on any
///   stream still uses it.
pub(crate) unsafe fn host_unregister(ptr: NonNull<u8>) -> Result<()> {
    cuda!(cudaHostUnregister(ptr.as_ptr().cast()))
}

pub(crate) fn host_device_pointer(ptr: NonNull<u8>) -> Result<u64> {
    let mut device = ptr::null_mut();
    // cudaHostGetDevicePointer only looks the address up; it never dereferences it.
    cuda!(cudaHostGetDevicePointer(
        &mut device,
        ptr.as_ptr().cast(),
        0
    ))?;
    Ok(device as u64)
}

type LookupFn = unsafe extern "C" fn(
    std::ffi::c_uint,
    *mut cu::CUpointer_attribute,
    *mut *mut c_void,
    cu::CUdeviceptr,
) -> CUresult;

/// Whether CUDA sees `ptr` as ordinary host memory: not page-locked, device or managed
/// memory. `false` when CUDA cannot say. Asks the driver for the one attribute needed where
/// its entry points are reachable (cheaper than the runtime's whole set of attributes).
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
pub(crate) fn driver_memory_type(ptr: *const c_void) -> Result<bool> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::context::current_context;
    use crate::raw::runtime_calls_not_asked;
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
