//! pinned-candle against candle's own paths. GPU tests are ignored without a device (CI has
//! none: its run starts the binary on stand-in CUDA libraries, and the host-only tests run).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_nn::var_builder::Shard;
use half::{bf16, f16};
use pinned_candle::{CheckpointLoader, TensorLoader, ToDeviceStaged, var_builder};
use pinned_io::{LoadOptions, Split};
use pinned_loader::{BoxError, Dataset, Field, Loader, LoaderConfig};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// Finite values from a seed, as bytes of `dtype` (no NaN, so that equal tensors compare
/// equal element by element too).
fn values(dtype: Dtype, elements: usize, seed: u32) -> Vec<u8> {
    let x = |i: usize| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001;
    let float = |i| x(i) as f32 / 1000.0 - 1.0;
    let mut out = Vec::new();
    for i in 0..elements {
        match dtype {
            Dtype::BF16 => out.extend(bf16::from_f32(float(i)).to_le_bytes()),
            Dtype::F16 => out.extend(f16::from_f32(float(i)).to_le_bytes()),
            Dtype::F32 => out.extend(float(i).to_le_bytes()),
            Dtype::I64 => out.extend((x(i) as i64 - 1000).to_le_bytes()),
            Dtype::U32 => out.extend(x(i).to_le_bytes()),
            Dtype::U8 | Dtype::BOOL => out.push((x(i) % 2) as u8),
            _ => unreachable!(),
        }
    }
    out
}

/// A checkpoint of `tensors` (name, type, shape) at `path`; returns it with each tensor's bytes.
fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>)]) -> HashMap<String, Vec<u8>> {
    let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, dtype, shape))| {
            let bytes = values(*dtype, shape.iter().product(), i as u32);
            ((*name).to_owned(), *dtype, shape.clone(), bytes)
        })
        .collect();
    let views = data.iter().map(|(name, dtype, shape, bytes)| {
        (
            name.clone(),
            TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
    data.into_iter()
        .map(|(name, _, _, bytes)| (name, bytes))
        .collect()
}

/// A small decoder's worth of tensors: a large embedding, projections, norms and biases, a
/// tensor candle cannot hold.
fn model_tensors() -> Vec<(&'static str, Dtype, Vec<usize>)> {
    vec![
        ("model.embed_tokens.weight", Dtype::BF16, vec![3000, 256]),
        (
            "model.layers.0.input_layernorm.weight",
            Dtype::F32,
            vec![256],
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            Dtype::BF16,
            vec![1024, 256],
        ),
        ("model.layers.0.mlp.up_proj.bias", Dtype::F16, vec![1024]),
        (
            "model.layers.0.mlp.down_proj.weight",
            Dtype::BF16,
            vec![256, 1024],
        ),
        ("model.layers.0.positions", Dtype::I64, vec![7]),
        ("model.layers.0.counts", Dtype::U32, vec![3, 5]),
        ("model.mask", Dtype::BOOL, vec![16]),
        ("lm_head.weight", Dtype::BF16, vec![3000, 256]),
    ]
}

/// The raw bytes of a tensor, copied back to the host in its element type.
fn bytes_of(tensor: &Tensor) -> Vec<u8> {
    let flat = tensor
        .flatten_all()
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    match flat.dtype() {
        DType::BF16 => bytemuck::cast_slice(&flat.to_vec1::<bf16>().unwrap()).to_vec(),
        DType::F16 => bytemuck::cast_slice(&flat.to_vec1::<f16>().unwrap()).to_vec(),
        DType::F32 => bytemuck::cast_slice(&flat.to_vec1::<f32>().unwrap()).to_vec(),
        DType::I64 => bytemuck::cast_slice(&flat.to_vec1::<i64>().unwrap()).to_vec(),
        DType::U32 => bytemuck::cast_slice(&flat.to_vec1::<u32>().unwrap()).to_vec(),
        DType::F64 => bytemuck::cast_slice(&flat.to_vec1::<f64>().unwrap()).to_vec(),
        DType::U8 => flat.to_vec1::<u8>().unwrap(),
        other => panic!("{other:?}"),
    }
}

fn dir_with_model() -> (tempfile::TempDir, PathBuf, HashMap<String, Vec<u8>>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let bytes = write(&path, &model_tensors());
    (dir, path, bytes)
}

/// candle's own loader, tensor by tensor (its `load` of the whole file refuses the BOOL one).
fn reference(path: &Path, device: &Device) -> HashMap<String, Tensor> {
    // SAFETY: nothing changes the file while it is mapped.
    let file = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.unwrap();
    model_tensors()
        .into_iter()
        .filter(|(_, dtype, _)| *dtype != Dtype::BOOL)
        .map(|(name, _, _)| (name.to_owned(), file.load(name, device).unwrap()))
        .collect()
}

/// One GPU test at a time: they measure the device's memory, and share it.
fn gpu() -> std::sync::MutexGuard<'static, ()> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPU.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The devices a candle program makes: with a stream of its own, and on the per-thread
/// stream.
fn devices() -> [Device; 2] {
    [
        Device::new_cuda_with_stream(0).unwrap(),
        Device::new_cuda(0).unwrap(),
    ]
}

#[test]
fn a_device_other_than_cuda_is_refused_before_anything_loads() {
    let (_dir, path, _) = dir_with_model();
    let Err(error) = var_builder(&[&path], DType::F32, &Device::Cpu) else {
        panic!("a CPU device was taken");
    };
    assert!(error.to_string().contains("CUDA devices"), "{error}");
}

#[test]
fn a_missing_or_bad_file_names_itself() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.safetensors");
    let error = CheckpointLoader::open(&[&missing]).unwrap_err().to_string();
    assert!(
        error.contains("none.safetensors") && error.contains("opening"),
        "{error}"
    );
    std::fs::write(&missing, b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}").unwrap();
    let error = CheckpointLoader::open(&[&missing]).unwrap_err().to_string();
    assert!(error.contains("none.safetensors"), "{error}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_tensor_matches_candles_own_loader_on_both_kinds_of_device() {
    let _gpu = gpu();
    let (_dir, path, bytes) = dir_with_model();
    for device in devices() {
        let reference = reference(&path, &device);
        let vb = var_builder(&[&path], DType::BF16, &device).unwrap();
        for (name, dtype, shape) in model_tensors() {
            if dtype == Dtype::BOOL {
                continue;
            }
            // In the file's own type: the same bytes, the same shape as candle's.
            let tensor = vb
                .get_unchecked_dtype(name, reference[name].dtype())
                .unwrap();
            assert_eq!(tensor.dims(), shape.as_slice(), "{name}");
            assert_eq!(bytes_of(&tensor), bytes[name], "{name}");
            assert_eq!(bytes_of(&tensor), bytes_of(&reference[name]), "{name}");
        }
        // Asked in another type: converted on the device, as candle's own builder does.
        let norm = "model.layers.0.input_layernorm.weight";
        let ours = vb.get(256, norm).unwrap();
        let theirs = reference[norm].to_dtype(DType::BF16).unwrap();
        assert_eq!(
            (ours.dtype(), bytes_of(&ours)),
            (DType::BF16, bytes_of(&theirs))
        );
        device.synchronize().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_model_built_on_loaded_weights_computes_what_candles_own_does() {
    let _gpu = gpu();
    let (_dir, path, _) = dir_with_model();
    let device = Device::new_cuda_with_stream(0).unwrap();
    let ours = var_builder(&[&path], DType::BF16, &device).unwrap();
    // SAFETY: the file is not changed while mapped.
    let theirs =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::BF16, &device) }.unwrap();
    let input = Tensor::ones((4, 256), DType::BF16, &device).unwrap();
    let forward = |vb: VarBuilder| {
        let up = candle_nn::linear(256, 1024, vb.pp("model.layers.0.mlp.up_proj")).unwrap();
        let down =
            candle_nn::linear_no_bias(1024, 256, vb.pp("model.layers.0.mlp.down_proj")).unwrap();
        down.forward(&up.forward(&input).unwrap().relu().unwrap())
            .unwrap()
    };
    assert_eq!(bytes_of(&forward(ours)), bytes_of(&forward(theirs)));
}

#[test]
#[ignore = "needs a CUDA device"]
fn what_the_model_asks_wrongly_is_candles_error() {
    let _gpu = gpu();
    let (_dir, path, _) = dir_with_model();
    let device = Device::new_cuda_with_stream(0).unwrap();
    let vb = var_builder(&[&path], DType::F32, &device).unwrap();
    let shape = vb
        .get((256, 1000), "model.layers.0.mlp.up_proj.weight")
        .unwrap_err();
    assert!(shape.to_string().contains("shape mismatch"), "{shape}");
    let missing = vb.get(3, "model.nothing").unwrap_err();
    assert!(missing.to_string().contains("model.nothing"), "{missing}");
    assert!(!vb.contains_tensor("model.nothing") && vb.contains_tensor("lm_head.weight"));
    // Left out by the caller's options: said so, not blamed on the type.
    let options = LoadOptions::new().only(|t| !t.name().starts_with("lm_head"));
    let only = CheckpointLoader::open(&[&path])
        .unwrap()
        .options(options)
        .var_builder(DType::BF16, &device)
        .unwrap();
    let left_out = only
        .get((3000, 256), "lm_head.weight")
        .unwrap_err()
        .to_string();
    assert!(left_out.contains("left out of the load"), "{left_out}");
    let mask = vb.get(16, "model.mask").unwrap_err().to_string();
    assert!(
        mask.contains("model.mask") && mask.contains("BOOL") && mask.contains("candle"),
        "{mask}"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropping_the_model_gives_candle_its_memory_back_and_leaves_no_cuda_error() {
    let _gpu = gpu();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let tensors: Vec<(String, Dtype, Vec<usize>)> = (0..8)
        .map(|i| (format!("w{i}"), Dtype::BF16, vec![4096, 4096]))
        .collect();
    let named: Vec<(&str, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, d, s)| (n.as_str(), *d, s.clone()))
        .collect();
    write(&path, &named);
    let device = Device::new_cuda_with_stream(0).unwrap();
    let Device::Cuda(cuda) = &device else {
        unreachable!()
    };
    let context = cuda.cuda_stream().context().clone();
    let free = || {
        device.synchronize().unwrap();
        context.mem_get_info().unwrap().0 as i64
    };
    let before = free();
    for _ in 0..3 {
        let vb = var_builder(&[&path], DType::BF16, &device).unwrap();
        let weights: Vec<Tensor> = (0..8)
            .map(|i| vb.get((4096, 4096), &format!("w{i}")).unwrap())
            .collect();
        assert!(
            free() < before - (200 << 20),
            "the weights take device memory"
        );
        drop((vb, weights));
    }
    // Back within what candle's pool and the reader keep around.
    let after = free();
    assert!(
        after > before - (300 << 20),
        "{} MiB not given back",
        (before - after) >> 20
    );
    context.check_err().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_weight_copied_to_another_device_right_away_is_whole() {
    let _gpu = gpu();
    // cudarc's tracking must see the load's write: the copy runs on the other device's
    // stream, which waits for the weight's write event only.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let bytes = write(&path, &[("w", Dtype::F32, vec![8192, 4096])]);
    let device = Device::new_cuda_with_stream(0).unwrap();
    let other = Device::new_cuda_with_stream(0).unwrap();
    for _ in 0..3 {
        let vb = var_builder(&[&path], DType::F32, &device).unwrap();
        let copied = vb
            .get((8192, 4096), "w")
            .unwrap()
            .to_device(&other)
            .unwrap();
        assert_eq!(bytes_of(&copied), bytes["w"]);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn sharded_gets_cut_as_candles_sharded_loading_does() {
    let _gpu = gpu();
    let (_dir, path, _) = dir_with_model();
    let device = Device::new_cuda_with_stream(0).unwrap();
    let reference = reference(&path, &device);
    let name = "model.layers.0.mlp.up_proj.weight";
    let full = &reference[name];
    // Cut from the whole tensor on the device.
    let vb = CheckpointLoader::open(&[&path])
        .unwrap()
        .sharded_var_builder(DType::BF16, &device)
        .unwrap();
    for (dim, rank) in [(0, 0), (0, 3), (1, 1)] {
        let shard = Shard {
            dim,
            rank,
            world_size: 4,
        };
        let part = vb.get_with_hints((), name, shard).unwrap();
        let size = full.dims()[dim] / 4;
        let expected = full
            .narrow(dim, rank * size, size)
            .unwrap()
            .contiguous()
            .unwrap();
        assert_eq!(
            bytes_of(&part),
            bytes_of(&expected),
            "dim {dim} rank {rank}"
        );
    }
    let whole = vb
        .get_with_hints((1024, 256), name, Shard::default())
        .unwrap();
    assert_eq!(bytes_of(&whole), bytes_of(full));
    let uneven = vb
        .get_with_hints(
            (),
            name,
            Shard {
                dim: 0,
                rank: 0,
                world_size: 3,
            },
        )
        .unwrap_err();
    assert!(
        uneven.to_string().contains("equally along dim 0 into 3"),
        "{uneven}"
    );
    // Read as the part already: handed over as loaded.
    let options =
        LoadOptions::new().split(move |t| (t.name() == name).then(|| Split::new(1, 1, 4).unwrap()));
    let vb = CheckpointLoader::open(&[&path])
        .unwrap()
        .options(options)
        .sharded_var_builder(DType::BF16, &device)
        .unwrap();
    let part = vb
        .get_with_hints(
            (),
            name,
            Shard {
                dim: 1,
                rank: 1,
                world_size: 4,
            },
        )
        .unwrap();
    let expected = full.narrow(1, 64, 64).unwrap().contiguous().unwrap();
    assert_eq!(bytes_of(&part), bytes_of(&expected));
    // Another rank than the one loaded: refused, not another rank's weights.
    let other = Shard {
        dim: 1,
        rank: 2,
        world_size: 4,
    };
    let error = vb.get_with_hints((), name, other).unwrap_err().to_string();
    assert!(error.contains("took rank 1 of 4"), "{error}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_sharded_checkpoint_and_a_snapshot_folder_load_like_one_file() {
    let _gpu = gpu();
    let dir = tempfile::tempdir().unwrap();
    let tensors = model_tensors();
    let (first, second) = tensors.split_at(4);
    let mut bytes = write(&dir.path().join("blobs-a"), first);
    bytes.extend(write(&dir.path().join("blobs-b"), second));
    // A Hugging Face snapshot: the shards and the index are links to blobs.
    let snapshot = dir.path().join("snapshots/abc");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::os::unix::fs::symlink(
        dir.path().join("blobs-a"),
        snapshot.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        dir.path().join("blobs-b"),
        snapshot.join("model-00002-of-00002.safetensors"),
    )
    .unwrap();
    let map: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, _, _))| {
            let shard = if i < 4 {
                "model-00001-of-00002.safetensors"
            } else {
                "model-00002-of-00002.safetensors"
            };
            ((*name).to_owned(), shard.into())
        })
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        snapshot.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let device = Device::new_cuda_with_stream(0).unwrap();
    let shards = [
        snapshot.join("model-00001-of-00002.safetensors"),
        snapshot.join("model-00002-of-00002.safetensors"),
    ];
    for vb in [
        var_builder(&[&snapshot], DType::F32, &device).unwrap(),
        var_builder(
            &[snapshot.join("model.safetensors.index.json")],
            DType::F32,
            &device,
        )
        .unwrap(),
        var_builder(&shards, DType::F32, &device).unwrap(),
    ] {
        let name = "lm_head.weight";
        let tensor = vb.get_unchecked_dtype(name, DType::BF16).unwrap();
        assert_eq!(bytes_of(&tensor), bytes[name]);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn staged_copies_round_trip_every_type_and_strided_tensors() {
    let _gpu = gpu();
    for device in devices() {
        for dtype in [
            DType::U8,
            DType::U32,
            DType::I64,
            DType::BF16,
            DType::F16,
            DType::F32,
            DType::F64,
        ] {
            for elements in [1usize, 1000, 3 << 20] {
                let cpu = Tensor::arange(0u32, elements as u32, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let theirs = cpu.to_device(&device).unwrap();
                let ours = cpu.to_device_staged(&device).unwrap();
                assert_eq!(bytes_of(&ours), bytes_of(&theirs), "{dtype:?} {elements}");
                let back = ours.to_device_staged(&Device::Cpu).unwrap();
                assert_eq!(bytes_of(&back), bytes_of(&cpu), "{dtype:?} {elements}");
            }
        }
        // A transposed view: made contiguous on its way.
        let cpu = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap()
            .t()
            .unwrap();
        let ours = cpu.to_device_staged(&device).unwrap();
        assert_eq!(ours.dims(), [4, 3]);
        assert_eq!(
            ours.to_vec2::<f32>().unwrap(),
            cpu.to_vec2::<f32>().unwrap()
        );
        let narrowed = ours
            .narrow(0, 1, 2)
            .unwrap()
            .to_device_staged(&Device::Cpu)
            .unwrap();
        assert_eq!(
            narrowed.to_vec2::<f32>().unwrap(),
            cpu.narrow(0, 1, 2).unwrap().to_vec2::<f32>().unwrap()
        );
    }
}

/// Sample `i`: an image of 3×8×8 floats `i + k / 1000`, and the label `i`.
struct Images(usize);

impl Dataset for Images {
    type Fields = (Field<f32>, Field<u32>);
    fn len(&self) -> usize {
        self.0
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(192), Field::new(1))
    }
    fn write(&self, i: usize, (image, label): (&mut [f32], &mut [u32])) -> Result<(), BoxError> {
        for (k, pixel) in image.iter_mut().enumerate() {
            *pixel = i as f32 + k as f32 / 1000.0;
        }
        label[0] = i as u32;
        Ok(())
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn loader_batches_arrive_as_tensors_of_their_samples_on_both_kinds_of_device() {
    let _gpu = gpu();
    for device in devices() {
        let loader = Loader::new(Images(333), LoaderConfig::new(32).workers(3).shuffle(5)).unwrap();
        let mut batches = TensorLoader::new(loader, &device)
            .unwrap()
            .with_sample_shapes(&[&[3, 8, 8][..], &[]])
            .unwrap();
        for epoch in 0..2 {
            let mut seen = Vec::new();
            for batch in batches.epoch(epoch) {
                let batch = batch.unwrap();
                let [images, labels] = batch.tensors() else {
                    panic!("two fields")
                };
                assert_eq!(images.dims(), [batch.indices().len(), 3, 8, 8]);
                assert_eq!(labels.dims(), [batch.indices().len()]);
                // Work on candle's stream sees the upload: a kernel reads both.
                let firsts = images
                    .flatten_from(1)
                    .unwrap()
                    .narrow(1, 0, 1)
                    .unwrap()
                    .squeeze(1)
                    .unwrap();
                let labels_f = labels.to_dtype(DType::F32).unwrap();
                assert_eq!(
                    firsts.to_vec1::<f32>().unwrap(),
                    labels_f.to_vec1::<f32>().unwrap()
                );
                let labels = labels.to_vec1::<u32>().unwrap();
                let indices: Vec<u32> = batch.indices().iter().map(|&i| i as u32).collect();
                assert_eq!(labels, indices);
                seen.extend(labels);
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..333).collect::<Vec<u32>>());
        }
    }
    let wrong = Loader::new(Images(8), LoaderConfig::new(4)).unwrap();
    let device = Device::new_cuda_with_stream(0).unwrap();
    let error = TensorLoader::new(wrong, &device)
        .unwrap()
        .with_sample_shapes(&[&[192][..]]);
    assert!(error.is_err());
}
