//! A candle CUDA device as this workspace sees it: its GPU, its stream, and how work on that
//! stream is made to wait for ours.

use std::sync::Arc;

use candle_core::cuda::cudarc::driver::CudaStream;
use candle_core::{CudaDevice, Device};

use crate::error::{Result, wrap};

/// A candle CUDA device, its GPU as cuda-pinned's, and its stream adopted where it can be.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) candle: CudaDevice,
    pub(crate) device: cuda_pinned::Device,
    pub(crate) stream: Arc<CudaStream>,
    /// candle's stream as cuda-pinned's, so that it can wait on the device for our copies:
    /// `None` where candle runs on cudarc's per-thread or default stream
    /// (`Device::new_cuda`), which names another stream on every thread. There the host
    /// waits instead, before a tensor is handed over: candle may run the tensor's kernels on
    /// any thread's stream, and only a wait the host made covers them all.
    pub(crate) adopted: Option<cuda_pinned::Stream>,
}

impl Target {
    /// The target for `device`.
    ///
    /// # Errors
    ///
    /// `candle_core::Error::Msg` for a device that is not a CUDA one; cuda-pinned's error
    /// where CUDA cannot be used through it.
    pub(crate) fn of(device: &Device) -> Result<Self> {
        let Device::Cuda(candle) = device else {
            return Err(candle_core::Error::Msg(format!(
                "pinned-candle moves data to CUDA devices; this one is {:?}",
                device.location()
            )));
        };
        let stream = candle.cuda_stream();
        let ordinal = stream.context().ordinal();
        let device = cuda_pinned::Device::new(ordinal).map_err(wrap)?;
        let adopted = cuda_pinned::Stream::from_cudarc(&stream).ok();
        Ok(Self {
            candle: candle.clone(),
            device,
            stream,
            adopted,
        })
    }

    /// Whether candle's stream waits on the device (a stream of its own), not the host.
    pub(crate) fn waits_on_device(&self) -> bool {
        self.adopted.is_some()
    }
}
