//! candle's device memory, allocated by candle for this crate to fill: element types, typed
//! allocation, and an allocation lent to a pinned-io load.

use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Storage, Tensor};
use cuda_pinned::LentDeviceMemory;
use pinned_io::Dtype;

use crate::device::Target;
use crate::error::Result;

/// candle's element type for a checkpoint's, where candle has one.
pub(crate) fn candle_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I16 => DType::I16,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F8_E4M3 => DType::F8E4M3,
        _ => return None,
    })
}

/// Why a checkpoint's element type cannot be loaded into candle.
pub(crate) fn refused(name: &str, dtype: Dtype) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "tensor `{name}` is {dtype:?}, which candle cannot hold (it has U8, U32, I16, I32, I64, \
         BF16, F16, F32, F64 and F8E4M3)"
    ))
    .bt()
}

/// Runs `$body` with `$T` the Rust type of candle's `$dtype`; `plain` leaves out the 8-bit
/// floats, whose type is no plain old data, for bodies that need it to be.
macro_rules! with_type {
    (plain $dtype:expr, $T:ident => $body:expr) => {
        $crate::memory::with_type!(@arms $dtype, $T => $body,)
    };
    ($dtype:expr, $T:ident => $body:expr) => {
        $crate::memory::with_type!(@arms $dtype, $T => $body, DType::F8E4M3 => {
            type $T = float8::F8E4M3;
            $body
        })
    };
    (@arms $dtype:expr, $T:ident => $body:expr, $($extra:tt)*) => {
        match $dtype {
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I16 => {
                type $T = i16;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            $($extra)*
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other, "pinned-candle").bt()),
        }
    };
}
pub(crate) use with_type;

/// A one-dimensional tensor of `len` elements of `dtype` on the target's device, in memory
/// candle allocated on its stream and owns (and frees), not initialised; and its address.
///
/// The allocation is ordered on candle's stream: the caller makes it visible to other
/// streams before they write it.
pub(crate) fn uninit_tensor(target: &Target, dtype: DType, len: usize) -> Result<(Tensor, u64)> {
    with_type!(dtype, T => {
        // SAFETY: the memory is not initialised; every element of it that a tensor of this
        // crate exposes is written (by a load's copies or an upload) before that tensor is
        // handed out, and elements are plain numbers, for which device bytes of any value
        // are valid.
        let slice: CudaSlice<T> = unsafe { target.candle.alloc::<T>(len) }?;
        Ok(wrap(target, slice))
    })
}

/// `slice` as a one-dimensional candle tensor on the target's device, and its address.
pub(crate) fn wrap<T>(target: &Target, slice: CudaSlice<T>) -> (Tensor, u64)
where
    T: candle_core::cuda::CudaDType + DeviceRepr,
{
    let len = slice.len();
    let address = {
        let (address, _read) = slice.device_ptr(&target.stream);
        address
    };
    let storage = CudaStorage::wrap_cuda_slice(slice, target.candle.clone());
    let tensor = Tensor::from_storage(Storage::Cuda(storage), len, BackpropOp::none(), false);
    (tensor, address)
}

/// A tensor's memory, candle's, lent to a load that fills it: the tensor keeps it alive.
pub(crate) struct Lent {
    pub(crate) tensor: Tensor,
    pub(crate) address: u64,
    pub(crate) bytes: usize,
    pub(crate) device: cuda_pinned::Device,
}

// SAFETY: `address..address + bytes` is the whole allocation behind `tensor` (made by
// `uninit_tensor` on `device`, in the primary context candle and cuda-pinned share), which the
// tensor keeps alive while this value lives; its maker waits for the allocation on the host
// before lending it (`checkpoint::allocate`), so every stream may use it; it holds one
// tensor, handed to the model only as a view whose stream waited for the load's copies into
// it (or after the host did), and whose later copies cudarc orders after that wait.
unsafe impl LentDeviceMemory for Lent {
    fn device(&self) -> cuda_pinned::Device {
        self.device
    }
    fn address(&self) -> u64 {
        self.address
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
}
