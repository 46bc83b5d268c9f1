//! Versions and devices.

use std::ffi::c_int;

use cuda_pinned_sys::{self as sys, cudaError};

use crate::error::{Error, Result};

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

pub(crate) fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Whether `device` can read and write `peer`'s memory directly (over NVLink or PCIe).
pub(crate) fn can_access_peer(device: i32, peer: i32) -> Result<bool> {
    let mut can: c_int = 0;
    cuda!(cudaDeviceCanAccessPeer(&mut can, device, peer))?;
    Ok(can != 0)
}

/// Lets the current device reach `peer`'s memory directly; already enabled is success.
pub(crate) fn enable_peer_access(peer: i32) -> Result<()> {
    match cuda!(cudaDeviceEnablePeerAccess(peer, 0)) {
        Err(Error::Cuda(e)) if e.raw() == cudaError::cudaErrorPeerAccessAlreadyEnabled => {
            // The runtime keeps this error as the thread's last one: cleared.
            let _ = cuda!(cudaGetLastError());
            Ok(())
        }
        other => other,
    }
}
