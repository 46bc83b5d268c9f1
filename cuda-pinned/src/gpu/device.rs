//! What CUDA this process has: the runtime, the driver and the devices.

use std::fmt;
use std::path::Path;

use cuda_pinned_sys::{self as sys, cudaDeviceAttr};

use crate::error::{Error, Result};

/// A CUDA version such as 13.0, as the runtime reports it (`1000 * major + 10 * minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl Version {
    fn from_raw(raw: i32) -> Self {
        let raw = raw.max(0) as u32;
        Self {
            major: raw / 1000,
            minor: raw % 1000 / 10,
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Whether CUDA can be used here: the runtime loads and sees at least one device.
pub fn is_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// The file libcudart was loaded from.
///
/// # Errors
///
/// [`Error::Unavailable`](crate::Error::Unavailable), listing the paths tried.
pub fn runtime_path() -> Result<&'static Path> {
    Ok(sys::cudart()?.path())
}

/// The version of the loaded CUDA runtime library.
///
/// # Errors
///
/// [`Error::Unavailable`](crate::Error::Unavailable) without a runtime.
pub fn runtime_version() -> Result<Version> {
    crate::raw::device::runtime_version().map(Version::from_raw)
}

/// The newest CUDA version the installed driver supports; `0.0` when no driver is installed.
///
/// # Errors
///
/// [`Error::Unavailable`](crate::Error::Unavailable) without a runtime.
pub fn driver_version() -> Result<Version> {
    crate::raw::device::driver_version().map(Version::from_raw)
}

/// The number of CUDA devices; 0 when the runtime loads but finds none.
///
/// # Errors
///
/// [`Error::Unavailable`](crate::Error::Unavailable) without a runtime;
/// [`Error::Cuda`](crate::Error::Cuda) when the driver is missing or too old.
pub fn device_count() -> Result<usize> {
    crate::raw::device::device_count().map(|n| n.max(0) as usize)
}

/// One CUDA device, by ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: i32,
}

impl Device {
    /// The device with this ordinal.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`](crate::Error::Cuda) (`cudaErrorInvalidDevice`) when there is no such
    /// device, or the errors of [`device_count`].
    pub fn new(ordinal: usize) -> Result<Self> {
        let ordinal = i32::try_from(ordinal).unwrap_or(i32::MAX);
        // Asking for an attribute validates the ordinal through the runtime itself.
        crate::raw::device::device_attribute(cudaDeviceAttr::cudaDevAttrPciBusId, ordinal)?;
        Ok(Self { ordinal })
    }

    /// Every device, in ordinal order.
    ///
    /// # Errors
    ///
    /// The errors of [`device_count`].
    pub fn all() -> Result<Vec<Self>> {
        Ok((0..device_count()? as i32)
            .map(|ordinal| Self { ordinal })
            .collect())
    }

    /// The calling thread's current device.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) or a CUDA error.
    pub fn current() -> Result<Self> {
        crate::raw::device::current_device().map(|ordinal| Self { ordinal })
    }

    /// Makes this the calling thread's current device.
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaSetDevice`.
    pub fn set_current(self) -> Result<()> {
        crate::raw::device::set_device(self.ordinal)
    }

    /// The device's ordinal.
    pub fn ordinal(self) -> usize {
        self.ordinal as usize
    }

    /// A device known to exist (an ordinal CUDA gave back).
    pub(crate) fn from_raw(ordinal: i32) -> Self {
        Self { ordinal }
    }

    /// The ordinal as CUDA takes it.
    pub(crate) fn raw(self) -> i32 {
        self.ordinal
    }

    /// The marketing name the driver reports.
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaGetDeviceProperties`.
    pub fn name(self) -> Result<String> {
        crate::raw::device::device_name(self.ordinal)
    }

    /// The PCI address, `domain:bus:device.function` (`"0000:01:00.0"`).
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceGetPCIBusId`.
    pub fn pci_bus_id(self) -> Result<String> {
        crate::raw::device::pci_bus_id(self.ordinal)
    }

    /// Whether `cudaHostRegister` works with this device (the fast pinning path).
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceGetAttribute`.
    pub fn supports_host_registration(self) -> Result<bool> {
        self.flag(cudaDeviceAttr::cudaDevAttrHostRegisterSupported)
    }

    /// Whether the device can use memory registered read-only
    /// ([`ReadOnlyRegistration`](crate::ReadOnlyRegistration)).
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceGetAttribute`.
    pub fn supports_read_only_registration(self) -> Result<bool> {
        self.flag(cudaDeviceAttr::cudaDevAttrHostRegisterReadOnlySupported)
    }

    /// Whether the device can use [`VirtualHost`](crate::VirtualHost) memory.
    ///
    /// The device's attribute says so or, where the runtime does not know the attribute, the
    /// driver gives a granularity for such memory (page-locked host memory created through
    /// CUDA's virtual-memory API on a host NUMA node).
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceGetAttribute`.
    pub fn supports_virtual_host_memory(self) -> Result<bool> {
        // The runtime's enum lacks this attribute; the driver's value is the same number.
        let attribute = cuda_pinned_sys::driver::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        match crate::raw::device::device_attribute(cudaDeviceAttr(attribute.0), self.ordinal) {
            Ok(value) => Ok(value != 0),
            Err(crate::Error::Cuda(e))
                if e.raw() == cuda_pinned_sys::cudaError::cudaErrorInvalidValue =>
            {
                Ok(crate::raw::vmm::host_granularity(0).is_ok())
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the device can map page-locked host memory into its address space.
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceGetAttribute`.
    pub fn can_map_host_memory(self) -> Result<bool> {
        self.flag(cudaDeviceAttr::cudaDevAttrCanMapHostMemory)
    }

    /// Whether the device can read and write `peer`'s memory directly (over NVLink or PCIe).
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceCanAccessPeer`.
    pub fn can_access_peer(self, peer: Device) -> Result<bool> {
        crate::raw::device::can_access_peer(self.ordinal, peer.ordinal)
    }

    /// Lets the device reach `peer`'s memory directly, so that copies between the two take
    /// the direct path rather than one through host memory. Enabling it again is no error.
    ///
    /// Peer access holds for the process's life. The calling thread's current device is
    /// left as it was.
    ///
    /// # Errors
    ///
    /// A CUDA error from `cudaDeviceEnablePeerAccess` (`cudaErrorPeerAccessUnsupported` where
    /// [`can_access_peer`](Self::can_access_peer) says no).
    pub fn enable_peer_access(self, peer: Device) -> Result<()> {
        crate::context::on_device(self.ordinal, || {
            crate::raw::device::enable_peer_access(peer.ordinal)
        })
    }

    /// The host NUMA node nearest the device as CUDA reports it; `None` where the driver does
    /// not say (older drivers, or machines with one node).
    pub fn host_numa_node(self) -> Option<u32> {
        crate::raw::device::device_attribute(cudaDeviceAttr::cudaDevAttrHostNumaId, self.ordinal)
            .ok()
            .and_then(|node| u32::try_from(node).ok())
    }

    /// The host NUMA node nearest the device: CUDA's answer ([`host_numa_node`]), else the kernel's
    /// (the sysfs `numa_node` of its PCI device); `None` where neither says.
    ///
    /// The node [`Registered`](crate::Registered) and [`VirtualHost`](crate::VirtualHost) place
    /// memory on. Asked once per device (the first 64) and remembered: allocators ask on every
    /// allocation.
    ///
    /// [`host_numa_node`]: Self::host_numa_node
    pub fn nearest_numa_node(self) -> Option<u32> {
        const KNOWN: usize = 64;
        static NODES: [std::sync::OnceLock<Option<u32>>; KNOWN] =
            [const { std::sync::OnceLock::new() }; KNOWN];
        let ask = || {
            self.host_numa_node().or_else(|| {
                let bus_id = self.pci_bus_id().ok()?.to_lowercase();
                let path = format!("/sys/bus/pci/devices/{bus_id}/numa_node");
                std::fs::read_to_string(path).ok()?.trim().parse().ok()
            })
        };
        match NODES.get(self.ordinal()) {
            Some(node) => *node.get_or_init(ask),
            None => ask(),
        }
    }

    /// The host NUMA node nearest the calling thread's current device; `None` without CUDA
    /// or where neither CUDA nor the kernel says.
    pub(crate) fn current_numa_node() -> Option<u32> {
        Self::current().ok()?.nearest_numa_node()
    }

    fn flag(self, attribute: cudaDeviceAttr) -> Result<bool> {
        crate::raw::device::device_attribute(attribute, self.ordinal).map(|v| v != 0)
    }
}

/// [`Error::DeviceMismatch`] unless `found` is `expected`.
pub(crate) fn check_same_device(what: &'static str, expected: i32, found: i32) -> Result<()> {
    if expected == found {
        return Ok(());
    }
    Err(Error::DeviceMismatch {
        what,
        expected: expected as usize,
        found: found as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_like_the_runtime_encodes_them() {
        assert_eq!(
            Version::from_raw(13000),
            Version {
                major: 13,
                minor: 0
            }
        );
        assert_eq!(Version::from_raw(12080).to_string(), "12.8");
        assert_eq!(Version::from_raw(0).to_string(), "0.0");
    }
}
