//! A small candle training loop fed by pinned-loader: workers write samples into pinned
//! batches, each batch arrives as candle tensors uploaded beside the training step.
//!
//! ```sh
//! cargo run --release --example train
//! ```
//!
//! The task: points in 16 dimensions, labelled by which side of a fixed plane they lie on; a
//! linear classifier learns it in a few epochs.

use candle_core::{DType, Device, Module};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, linear, loss};
use pinned_candle::TensorLoader;
use pinned_loader::{BoxError, Dataset, Field, Loader, LoaderConfig};

const DIM: usize = 16;

/// Point `i`: 16 coordinates from a hash of `i`, and whether they sum above zero.
struct Points(usize);

impl Dataset for Points {
    type Fields = (Field<f32>, Field<u32>);
    fn len(&self) -> usize {
        self.0
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(DIM), Field::new(1))
    }
    fn write(&self, i: usize, (point, label): (&mut [f32], &mut [u32])) -> Result<(), BoxError> {
        let mut state = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for x in point.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *x = (state % 2000) as f32 / 1000.0 - 1.0;
        }
        label[0] = u32::from(point.iter().sum::<f32>() > 0.0);
        Ok(())
    }
}

fn main() -> candle_core::Result<()> {
    let device = Device::new_cuda_with_stream(0)?;
    let config = LoaderConfig::new(256).workers(4).shuffle(42);
    let loader = Loader::new(Points(64 * 1024), config).map_err(candle_core::Error::wrap)?;
    let mut batches = TensorLoader::new(loader, &device)?;
    let vars = VarMap::new();
    let model = linear(DIM, 2, VarBuilder::from_varmap(&vars, DType::F32, &device))?;
    let mut optimizer = AdamW::new(
        vars.all_vars(),
        ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )?;
    for epoch in 0..5 {
        let (mut total, mut steps) = (0f32, 0);
        for batch in batches.epoch(epoch) {
            let [points, labels] = &batch?.into_tensors()[..] else {
                unreachable!("two fields");
            };
            let loss = loss::cross_entropy(&model.forward(points)?, labels)?;
            optimizer.backward_step(&loss)?;
            total += loss.to_scalar::<f32>()?;
            steps += 1;
        }
        println!("epoch {epoch}: mean loss {:.4}", total / steps as f32);
    }
    for verdict in batches.loader().epoch_stats().iter().map(|e| e.verdict()) {
        println!("{verdict}");
    }
    Ok(())
}
