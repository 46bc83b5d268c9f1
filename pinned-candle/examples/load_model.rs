//! A candle model's weights loaded by pinned-io: the one line that changes from candle's own
//! `VarBuilder::from_mmaped_safetensors`.
//!
//! ```sh
//! cargo run --release --example load_model -- [CHECKPOINT]
//! ```
//!
//! Without a checkpoint it writes a small two-layer MLP's and loads that.

use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder, linear};

/// A two-layer MLP, as candle-nn models are written: built from a `VarBuilder`.
struct Mlp {
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            up: linear(1024, 4096, vb.pp("mlp.up_proj"))?,
            down: linear(4096, 1024, vb.pp("mlp.down_proj"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down.forward(&self.up.forward(x)?.gelu()?)
    }
}

/// Writes an MLP's checkpoint with candle's own writer.
fn write_demo(path: &std::path::Path) -> candle_core::Result<()> {
    let cpu = Device::Cpu;
    let weights = [
        (
            "mlp.up_proj.weight",
            Tensor::randn(0f32, 0.02, (4096, 1024), &cpu)?,
        ),
        ("mlp.up_proj.bias", Tensor::zeros(4096, DType::F32, &cpu)?),
        (
            "mlp.down_proj.weight",
            Tensor::randn(0f32, 0.02, (1024, 4096), &cpu)?,
        ),
        ("mlp.down_proj.bias", Tensor::zeros(1024, DType::F32, &cpu)?),
    ];
    let weights: Vec<(&str, Tensor)> = weights
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(DType::BF16)?)))
        .collect::<candle_core::Result<_>>()?;
    candle_core::safetensors::save(&weights.into_iter().collect(), path)
}

fn main() -> candle_core::Result<()> {
    let device = Device::new_cuda_with_stream(0)?;
    let demo = std::env::temp_dir().join("pinned-candle-mlp.safetensors");
    let path = match std::env::args().nth(1) {
        Some(path) => path.into(),
        None => {
            write_demo(&demo)?;
            demo
        }
    };
    let start = Instant::now();
    // Was: let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::BF16, &device)? };
    let vb = pinned_candle::var_builder(&[&path], DType::BF16, &device)?;
    let model = Mlp::new(vb)?;
    device.synchronize()?;
    println!(
        "loaded {} in {:.1} ms",
        path.display(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let x = Tensor::ones((8, 1024), DType::BF16, &device)?;
    let y = model.forward(&x)?;
    println!(
        "forward: {:?}, mean {:.5}",
        y.dims(),
        y.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?
    );
    Ok(())
}
