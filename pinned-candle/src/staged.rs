//! CPU tensors to a CUDA device and back through page-locked memory: cuda-pinned's `Stager`,
//! several times the driver's path from ordinary memory that candle's `to_device` takes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytemuck::NoUninit;
use candle_core::cuda::CudaDType;
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::{DType, Device, Storage, Tensor, WithDType};
use cuda_pinned::Stager;

use crate::device::Target;
use crate::error::{Result, wrap};
use crate::memory::with_type;

/// `to_device` through page-locked memory, for candle tensors.
///
/// From the CPU to a CUDA device, and back, the bytes go through a [`Stager`]'s pinned ring
/// (one per device, made at its first use and kept for the process); between two CUDA
/// devices, or where nothing moves, this is candle's own `to_device`. 8-bit and smaller floats
/// take candle's path too, and so do downloads of less than [`STAGED_DOWNLOADS_FROM`] bytes, where
/// the driver's path is as fast (RESULTS.md of the benches has the figures).
///
/// ```no_run
/// use candle_core::{Device, Tensor};
/// use pinned_candle::ToDeviceStaged;
/// # fn main() -> candle_core::Result<()> {
/// let gpu = Device::new_cuda_with_stream(0)?;
/// let batch = Tensor::ones((1024, 1024, 64), candle_core::DType::F32, &Device::Cpu)?;
/// let on_gpu = batch.to_device_staged(&gpu)?; // instead of `batch.to_device(&gpu)?`
/// let back = on_gpu.to_device_staged(&Device::Cpu)?;
/// # let _ = back; Ok(()) }
/// ```
pub trait ToDeviceStaged {
    /// The tensor on `device`: a copy of the same shape, contiguous, and element type.
    ///
    /// # Errors
    ///
    /// candle's errors; cuda-pinned's, wrapped (no CUDA, pinned memory refused).
    fn to_device_staged(&self, device: &Device) -> Result<Tensor>;
}

/// Downloads from this many bytes on go through the stager; smaller ones take the driver's
/// path, whose fixed cost is lower, into memory the allocator hands out already touched (glibc
/// maps fresh pages for blocks from 32 MiB on, and faulting them in is what a download of that
/// size spends its time on, either way).
pub const STAGED_DOWNLOADS_FROM: usize = 32 << 20;

impl ToDeviceStaged for Tensor {
    fn to_device_staged(&self, device: &Device) -> Result<Tensor> {
        let staged = matches!(
            self.dtype(),
            DType::U8
                | DType::U32
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::BF16
                | DType::F16
                | DType::F32
                | DType::F64
        );
        let bytes = self.elem_count() * self.dtype().size_in_bytes();
        match (self.device(), device) {
            (Device::Cpu, Device::Cuda(_)) if staged => upload(self, &Target::of(device)?),
            (Device::Cuda(_), Device::Cpu) if staged && bytes >= STAGED_DOWNLOADS_FROM => {
                download(self)
            }
            _ => self.to_device(device),
        }
    }
}

/// The stager of `target`'s device, made at the first use.
fn stager(target: &Target) -> Result<Arc<Stager>> {
    static STAGERS: OnceLock<Mutex<HashMap<usize, Arc<Stager>>>> = OnceLock::new();
    let mut stagers = STAGERS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let ordinal = target.device.ordinal();
    if let Some(stager) = stagers.get(&ordinal) {
        return Ok(stager.clone());
    }
    let stager = Arc::new(Stager::on(target.device).map_err(wrap)?);
    stagers.insert(ordinal, stager.clone());
    Ok(stager)
}

/// A CPU tensor on `target`'s device, through its stager, on candle's stream.
fn upload(tensor: &Tensor, target: &Target) -> Result<Tensor> {
    let tensor = tensor.contiguous()?;
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        unreachable!("a CPU tensor's storage");
    };
    let (start, end) = layout.contiguous_offsets().expect("made contiguous above");
    let stager = stager(target)?;
    let on_device = with_type!(plain tensor.dtype(), T => {
        upload_slice::<T>(&cpu.as_slice::<T>()?[start..end], target, &stager)
    })?;
    on_device.reshape(tensor.shape())
}

fn upload_slice<T>(src: &[T], target: &Target, stager: &Stager) -> Result<Tensor>
where
    T: NoUninit + CudaDType + DeviceRepr + WithDType,
{
    // SAFETY: the memory is not initialised; the staged copy below writes every element, on
    // candle's stream, before any of candle's work there reads the tensor.
    let mut slice = unsafe { target.candle.alloc::<T>(src.len()) }?;
    // On candle's stream: after the allocation, before candle's work on the tensor; cudarc's
    // tracking records the write for other streams.
    let _copy = stager
        .copy_to_cudarc(&target.stream, src, &mut slice)
        .map_err(wrap)?;
    Ok(crate::memory::wrap(target, slice).0)
}

/// A CUDA tensor on the CPU, through its device's stager, on candle's stream.
fn download(tensor: &Tensor) -> Result<Tensor> {
    let tensor = tensor.contiguous()?;
    let target = Target::of(tensor.device())?;
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        unreachable!("a CUDA tensor's storage");
    };
    let (start, end) = layout.contiguous_offsets().expect("made contiguous above");
    let stager = stager(&target)?;
    with_type!(plain tensor.dtype(), T => {
        let slice = cuda.as_cuda_slice::<T>()?.slice(start..end);
        let mut host: Vec<T> = bytemuck::zeroed_vec(end - start);
        advise_huge_pages(bytemuck::cast_slice_mut(&mut host));
        stager
            .copy_from_cudarc(&target.stream, &slice, &mut host)
            .map_err(wrap)?;
        Tensor::from_vec(host, tensor.shape(), &Device::Cpu)
    })
}

/// Asks the kernel to back `memory` with huge pages where it can (transparent huge pages in
/// `madvise` mode): a download's fresh memory is faulted in as it is written, and a fault per
/// 2 MiB page rather than per 4 KiB one is what keeps the copy near memory speed.
fn advise_huge_pages(memory: &mut [u8]) {
    const PAGE: usize = 4096;
    let start = memory.as_mut_ptr().addr().next_multiple_of(PAGE);
    let end = (memory.as_mut_ptr().addr() + memory.len()) & !(PAGE - 1);
    if end > start {
        // SAFETY: advice about pages inside `memory`, which we hold uniquely; MADV_HUGEPAGE
        // changes how they are backed, never their contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}
