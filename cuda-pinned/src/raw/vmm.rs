//! Host memory through the virtual-memory API.

use std::ffi::c_int;
use std::ptr::{self, NonNull};

use cuda_pinned_sys::driver::{self as cu};

use crate::error::{Error, Result};

/// What `cuMemCreate` is asked for: page-locked host memory on NUMA node `node`.
pub(crate) fn host_numa_prop(node: u32) -> cu::CUmemAllocationProp {
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
    driver!(cuMemAddressReserve(&mut address, bytes, align, 0, 0)).map_err(|e| match e {
        Error::Driver(d) if d.is_out_of_memory() => Error::OutOfMemory { requested: bytes },
        other => other,
    })?;
    NonNull::new(ptr::with_exposed_provenance_mut(address as usize))
        .ok_or(Error::Unsupported("the driver reserved address 0"))
}

/// # Safety
///
/// - `ptr..ptr + bytes` is exactly a range from [`address_reserve`], with nothing mapped in it
///   and nothing using it afterwards.
pub(crate) unsafe fn address_free(ptr: NonNull<u8>, bytes: usize) -> Result<()> {
    driver!(cuMemAddressFree(ptr.as_ptr() as u64, bytes))
}

/// Creates `bytes` of page-locked memory on `node`; the handle keeps it until
/// [`release`]d, and a mapping of it keeps it until [`unmap`]ped.
pub(crate) fn create(bytes: usize, node: u32) -> Result<cu::CUmemGenericAllocationHandle> {
    let _span = tracing::debug_span!("pin", kind = %"cuMemCreate", bytes, node).entered();
    let prop = host_numa_prop(node);
    let mut handle = 0;
    driver!(cuMemCreate(&mut handle, bytes, &prop, 0))?;
    Ok(handle)
}

/// Maps the memory of `handle` at `at`.
///
/// # Safety
///
/// - `at..at + bytes` lies inside a range from [`address_reserve`] with nothing mapped there,
///   `at` and `bytes` are multiples of [`host_granularity`], and `handle` holds `bytes`.
pub(crate) unsafe fn map(
    at: NonNull<u8>,
    bytes: usize,
    handle: cu::CUmemGenericAllocationHandle,
) -> Result<()> {
    driver!(cuMemMap(at.as_ptr() as u64, bytes, 0, handle, 0))
}

/// Gives up a handle from [`create`]: its memory stays while a mapping of it does.
pub(crate) fn release(handle: cu::CUmemGenericAllocationHandle) -> Result<()> {
    driver!(cuMemRelease(handle))
}

/// Opens memory mapped by [`map`] on `node` to the host and to `devices`.
///
/// # Safety
///
/// - `at..at + bytes` is mapped by [`map`] (one call or several adjacent ones).
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
    driver!(cuMemSetAccess(
        at.as_ptr() as u64,
        bytes,
        descriptors.as_ptr(),
        descriptors.len()
    ))
}

/// # Safety
///
/// - `ptr..ptr + bytes` is memory mapped by [`map`] (one call or several
///   adjacent ones), used by no device work and nothing on the host afterwards.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) -> Result<()> {
    driver!(cuMemUnmap(ptr.as_ptr() as u64, bytes))
}
