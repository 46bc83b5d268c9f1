//! pinned-candle against candle's own paths, in one run: a checkpoint into a `VarBuilder`
//! (every tensor taken, as building a model does) beside candle's `from_mmaped_safetensors`
//! and pinned-io's own load; CPU tensors to the GPU and back beside candle's `to_device`; a
//! loader's batches as tensors beside the same loader's device batches.
//!
//! ```sh
//! cargo run --release --example bench -- [--quick] [--dir DIR] [--record DIR]
//! ```
//!
//! Each figure is the spread of several timed rounds after an untimed one, the paths taking
//! turns round by round; candle's kernels are compiled before anything is timed. `--record`
//! writes the rows as a record of `pinned-bench` (`pinned-bench results` puts them in
//! RESULTS.md beside the workspace's).

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pinned_bench::report::{Report, Section, Value, size_label};
use pinned_bench::stats::{Spread, gbps};
use pinned_candle::{TensorLoader, ToDeviceStaged};
use pinned_io::{Checkpoint, FileReader, LoadOptions};
use pinned_loader::{Assembly, BoxError, Dataset, DeviceLoader, Field, Loader, LoaderConfig};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

type Error = Box<dyn std::error::Error>;

/// One timed path: its direction, its name, and the work.
type Timed<'a> = (
    &'static str,
    &'static str,
    Box<dyn Fn() -> Result<(), Error> + 'a>,
);

struct Options {
    quick: bool,
    dir: PathBuf,
    record: Option<PathBuf>,
}

fn options() -> Result<Options, Error> {
    let mut options = Options {
        quick: false,
        dir: std::env::temp_dir(),
        record: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--dir" => options.dir = args.next().ok_or("--dir needs a folder")?.into(),
            "--record" => {
                options.record = Some(args.next().ok_or("--record needs a folder")?.into())
            }
            other => return Err(format!("unknown argument {other}; see the file's doc").into()),
        }
    }
    std::fs::create_dir_all(&options.dir)?;
    Ok(options)
}

/// A tensor of a checkpoint to write: name, type, shape.
type Spec = (String, Dtype, Vec<usize>);

/// `count` bf16 tensors of `each` bytes, like the files section's large checkpoint.
fn large(count: usize, each: usize) -> Vec<Spec> {
    (0..count)
        .map(|i| (format!("w{i}"), Dtype::BF16, vec![each / 2048, 1024]))
        .collect()
}

/// A decoder shaped like a 1.1-billion-parameter model (TinyLlama's): one large embedding
/// and head, and per layer the attention and MLP projections, two norms in f32 and biases.
fn decoder(layers: usize) -> Vec<Spec> {
    let (hidden, inter, kv, vocab) = (2048, 5632, 256, 32000);
    let mut specs = vec![(
        "model.embed_tokens.weight".to_owned(),
        Dtype::BF16,
        vec![vocab, hidden],
    )];
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        specs.extend([
            (
                p("self_attn.q_proj.weight"),
                Dtype::BF16,
                vec![hidden, hidden],
            ),
            (p("self_attn.k_proj.weight"), Dtype::BF16, vec![kv, hidden]),
            (p("self_attn.v_proj.weight"), Dtype::BF16, vec![kv, hidden]),
            (
                p("self_attn.o_proj.weight"),
                Dtype::BF16,
                vec![hidden, hidden],
            ),
            (p("self_attn.q_proj.bias"), Dtype::BF16, vec![hidden]),
            (p("mlp.gate_proj.weight"), Dtype::BF16, vec![inter, hidden]),
            (p("mlp.up_proj.weight"), Dtype::BF16, vec![inter, hidden]),
            (p("mlp.down_proj.weight"), Dtype::BF16, vec![hidden, inter]),
            (p("input_layernorm.weight"), Dtype::F32, vec![hidden]),
            (
                p("post_attention_layernorm.weight"),
                Dtype::F32,
                vec![hidden],
            ),
        ]);
    }
    specs.push(("model.norm.weight".to_owned(), Dtype::F32, vec![hidden]));
    specs.push((
        "lm_head.weight".to_owned(),
        Dtype::BF16,
        vec![vocab, hidden],
    ));
    specs
}

/// Writes `specs` as a checkpoint at `path` (bytes of a pattern) and returns its bytes.
fn write(path: &Path, specs: &[Spec]) -> Result<usize, Error> {
    let datas: Vec<Vec<u8>> = specs
        .iter()
        .map(|(_, dtype, shape)| {
            let bytes = shape.iter().product::<usize>() * dtype.bitsize() / 8;
            // bf16 and f32 patterns of finite numbers: 0x3c.. and 0x3f.. high bytes.
            (0..bytes)
                .map(|i| if i % 2 == 1 { 0x3c } else { (i / 2) as u8 })
                .collect()
        })
        .collect();
    let views = specs
        .iter()
        .zip(&datas)
        .map(|((name, dtype, shape), data)| {
            Ok((name.clone(), TensorView::new(*dtype, shape.clone(), data)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, path)?;
    // Into the page cache: the rounds measure warm loads.
    let _ = std::fs::read(path)?;
    Ok(datas.iter().map(Vec::len).sum())
}

/// Seconds `run` takes, ended by a device synchronisation.
fn timed(device: &Device, run: impl FnOnce() -> Result<(), Error>) -> Result<f64, Error> {
    device.synchronize()?;
    let start = Instant::now();
    run()?;
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Every tensor of `specs` from `vb`, in its file's type, as building a model takes them.
fn take_all(vb: &VarBuilder, specs: &[Spec]) -> Result<Vec<Tensor>, Error> {
    specs
        .iter()
        .map(|(name, dtype, _)| {
            let dtype = if *dtype == Dtype::F32 {
                DType::F32
            } else {
                DType::BF16
            };
            Ok(vb.get_unchecked_dtype(name, dtype)?)
        })
        .collect()
}

fn checkpoints(options: &Options, device: &Device, section: &mut Section) -> Result<(), Error> {
    let (rounds, count, each) = if options.quick {
        (3, 100, 10 << 20)
    } else {
        (5, 205, 40 << 20)
    };
    let cases = [
        (
            format!("large: {count} × {}", size_label(each as u64)),
            large(count, each),
        ),
        (
            "model-shaped: a 22-layer decoder, 1.1 B parameters".to_owned(),
            decoder(22),
        ),
    ];
    let reader = FileReader::on(cuda_pinned::Device::new(0)?)?;
    for (label, specs) in cases {
        let path = options.dir.join("pinned-candle-bench.safetensors");
        let bytes = write(&path, &specs)?;
        let paths = [&path];
        let pinned_io = || -> Result<(), Error> {
            let checkpoint = Checkpoint::open(&path)?;
            checkpoint.load(&reader, &LoadOptions::new())?.wait()?;
            Ok(())
        };
        let pinned_io_own = || -> Result<(), Error> {
            let checkpoint = Checkpoint::open(&path)?;
            let options = LoadOptions::new().own_block_from(1 << 20);
            checkpoint.load(&reader, &options)?.wait()?;
            Ok(())
        };
        let ours = || -> Result<(), Error> {
            let vb = pinned_candle::var_builder(&paths, DType::BF16, device)?;
            drop(take_all(&vb, &specs)?);
            Ok(())
        };

        let candle = || -> Result<(), Error> {
            // SAFETY: nothing changes the file while it is mapped.
            let vb = unsafe { VarBuilder::from_mmaped_safetensors(&paths, DType::BF16, device) }?;
            drop(take_all(&vb, &specs)?);
            Ok(())
        };
        let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for round in 0..=rounds {
            let runs = [&pinned_io as &dyn Fn() -> _, &pinned_io_own, &ours, &candle];
            for (i, run) in runs.into_iter().enumerate() {
                let seconds = timed(device, run)?;
                if round > 0 {
                    times[i].push(gbps(bytes, seconds));
                }
            }
        }
        let names = [
            "pinned-io load (reference)",
            "pinned-io load, an allocation per tensor of 1 MiB or more",
            "pinned-candle var_builder, every tensor taken",
            "candle from_mmaped_safetensors, every tensor taken",
        ];
        for (name, times) in names.into_iter().zip(times) {
            let mut row = vec![Value::Text(name.into()), Value::Text(label.clone())];
            row.extend(Spread::of(times).cells(2));
            section.row(row);
        }
        std::fs::remove_file(&path)?;
    }
    Ok(())
}

fn transfers(options: &Options, device: &Device, section: &mut Section) -> Result<(), Error> {
    let rounds = if options.quick { 3 } else { 7 };
    let sizes: &[usize] = &[256 << 10, 4 << 20, 16 << 20, 64 << 20, 1 << 30];
    for &bytes in sizes {
        let cpu = Tensor::ones(bytes / 4, DType::F32, &Device::Cpu)?;
        let gpu = cpu.to_device(device)?;
        let paths: [Timed<'_>; 4] = [
            (
                "H2D",
                "candle to_device",
                Box::new(|| {
                    cpu.to_device(device)?;
                    Ok(())
                }),
            ),
            (
                "H2D",
                "pinned-candle to_device_staged",
                Box::new(|| {
                    cpu.to_device_staged(device)?;
                    Ok(())
                }),
            ),
            (
                "D2H",
                "candle to_device",
                Box::new(|| {
                    gpu.to_device(&Device::Cpu)?;
                    Ok(())
                }),
            ),
            (
                "D2H",
                "pinned-candle to_device_staged",
                Box::new(|| {
                    gpu.to_device_staged(&Device::Cpu)?;
                    Ok(())
                }),
            ),
        ];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
        for round in 0..=rounds {
            for (i, (_, _, run)) in paths.iter().enumerate() {
                let seconds = timed(device, run)?;
                if round > 0 {
                    times[i].push(gbps(bytes, seconds));
                }
            }
        }
        for ((direction, path, _), times) in paths.iter().zip(times) {
            let mut row = vec![
                Value::Text((*direction).into()),
                Value::Text(size_label(bytes as u64)),
                Value::Text((*path).into()),
            ];
            row.extend(Spread::of(times).cells(2));
            section.row(row);
        }
    }
    Ok(())
}

/// Images of 3×224×224 bytes and a label: what a vision training step takes.
struct Images;

impl Dataset for Images {
    type Fields = (Field<u8>, Field<u32>);
    fn len(&self) -> usize {
        4096
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(3 * 224 * 224), Field::new(1))
    }
    fn write(&self, i: usize, (image, label): (&mut [u8], &mut [u32])) -> Result<(), BoxError> {
        image.fill(i as u8);
        label[0] = i as u32;
        Ok(())
    }
}

fn loaders(options: &Options, device: &Device, section: &mut Section) -> Result<(), Error> {
    let rounds = if options.quick { 2 } else { 5 };
    let config = || LoaderConfig::new(64).workers(8).shuffle(1);
    let consumer = match device {
        Device::Cuda(cuda) => cuda_pinned::Stream::from_cudarc(&cuda.cuda_stream())?,
        _ => return Err("a CUDA device".into()),
    };
    let mut device_loader =
        DeviceLoader::new(Loader::new(Images, config())?, Assembly::HostCollate)?;
    let mut tensor_loader = TensorLoader::new(Loader::new(Images, config())?, device)?;
    let batches = 4096 / 64;
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..=rounds {
        let epoch = round as u64;
        let seconds = timed(device, || {
            for batch in device_loader.epoch(epoch) {
                let mut batch = batch?;
                let (images, _) = batch.ready_on(&consumer)?;
                let _ = images;
            }
            Ok(())
        })?;
        let tensors = timed(device, || {
            for batch in tensor_loader.epoch(epoch) {
                drop(batch?);
            }
            Ok(())
        })?;
        if round > 0 {
            times[0].push(batches as f64 / seconds);
            times[1].push(batches as f64 / tensors);
        }
    }
    let names = [
        "pinned-loader DeviceLoader, host collate (reference: the loader's own device memory)",
        "pinned-candle TensorLoader: uploads into candle's tensors",
    ];
    for (name, times) in names.into_iter().zip(times) {
        let mut row = vec![Value::Text(name.into())];
        row.extend(Spread::of(times).cells(0));
        section.row(row);
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let options = options()?;
    let device = Device::new_cuda_with_stream(0)?;
    // candle compiles a kernel module at its first use: before anything is timed.
    let warm = Tensor::ones(1024, DType::BF16, &device)?
        .to_dtype(DType::F32)?
        .sum_all()?;
    let _ = warm.to_vec0::<f32>()?;
    let mut report = Report {
        date: pinned_bench::context::today(),
        commit: pinned_bench::context::COMMIT.to_owned(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        ..Report::default()
    };
    let gpu = cuda_pinned::Device::new(0)?;
    report.machine.push(("device 0".into(), gpu.name()?));
    let mut loads = Section::new(
        "candle",
        "candle: a checkpoint into a VarBuilder, every tensor taken, warm (GB/s)",
        &["path", "checkpoint", "min", "median", "max"],
    );
    checkpoints(&options, &device, &mut loads)?;
    let mut moves = Section::new(
        "candle_to_device",
        "candle: f32 tensors between the CPU and the GPU (GB/s)",
        &["direction", "size", "path", "min", "median", "max"],
    );
    transfers(&options, &device, &mut moves)?;
    let mut batches = Section::new(
        "candle_loader",
        "candle: 64 images of 3×224×224 bytes and labels a batch, 8 workers (batches/s)",
        &["path", "min", "median", "max"],
    );
    loaders(&options, &device, &mut batches)?;
    for section in [loads, moves, batches] {
        print!("{}", section.render());
        report.sections.push(section);
    }
    if let Some(dir) = &options.record {
        let path = pinned_bench::context::record_path(
            dir,
            &pinned_bench::context::record_name(&report, "candle"),
        );
        std::fs::create_dir_all(dir)?;
        std::fs::write(&path, report.to_json())?;
        println!("\nrecord: {}", path.display());
    }
    Ok(())
}
