//! A safetensors checkpoint onto the GPU, a kernel on its first tensor before the rest lands.
//! `cargo run --release -p cuda-pinned-examples --features cudarc --example load_checkpoint
//! [CHECKPOINT]` (a `.safetensors` file, an index, or a directory; a demo file is written
//! when none is named).
//!
//! The load returns at once; each tensor is ready on its own event. A kernel (compiled at run
//! time with NVRTC) sums the first tensor's bytes on cudarc's stream, which waits for that
//! tensor alone, while the reader's threads still bring the rest.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use cuda_pinned::Stream;
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use pinned_io::{Checkpoint, FileReader, LoadOptions};

const SUM: &str = r#"
extern "C" __global__ void sum_bytes(const unsigned char* bytes, unsigned long long n,
                                     unsigned long long* total) {
    unsigned long long mine = 0;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        mine += bytes[i];
    }
    atomicAdd(total, mine);
}
"#;

/// Writes a demo checkpoint of 64 tensors of 16 MiB into the temporary directory.
fn demo_checkpoint() -> std::io::Result<PathBuf> {
    const TENSORS: usize = 64;
    const EACH: usize = 16 << 20;
    let mut header = String::from("{");
    for i in 0..TENSORS {
        let (start, end) = (i * EACH, (i + 1) * EACH);
        header.push_str(&format!(
            "\"layer.{i}.weight\":{{\"dtype\":\"BF16\",\"shape\":[{},{}],\"data_offsets\":[{start},{end}]}}{}",
            EACH / 2 / 4096,
            4096,
            if i + 1 < TENSORS { "," } else { "}" }
        ));
    }
    let path = std::env::temp_dir().join("load_checkpoint-demo.safetensors");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
    file.write_all(&(header.len() as u64).to_le_bytes())?;
    file.write_all(header.as_bytes())?;
    let tensor: Vec<u8> = (0..EACH as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    for _ in 0..TENSORS {
        file.write_all(&tensor)?;
    }
    file.flush()?;
    Ok(path)
}

fn main() -> Result<(), Box<dyn Error>> {
    if !cuda_pinned::is_available() {
        println!("no CUDA device: nothing to load onto");
        return Ok(());
    }
    let path = match std::env::args_os().nth(1) {
        Some(path) => PathBuf::from(path),
        None => demo_checkpoint()?,
    };
    let ctx = CudaContext::new(0)?;
    let cu_stream = ctx.new_stream()?;
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SUM)?)?;
    let sum = module.load_function("sum_bytes")?;
    let reader = FileReader::new()?;

    let start = Instant::now();
    let checkpoint = Checkpoint::open(&path)?;
    let loading = checkpoint.load(&reader, &LoadOptions::new())?;
    let first = &loading.tensors()[0];
    let name = first.name().to_owned();
    let mut total = cu_stream.alloc_zeros::<u64>(1)?;
    let len = {
        // cudarc's stream waits, on the device, for the first tensor only.
        let stream = Stream::from_cudarc(&cu_stream)?;
        let bytes = first.ready_on(&stream)?;
        let len = bytes.len() as u64;
        let mut launch = cu_stream.launch_builder(&sum);
        launch.arg(&bytes).arg(&len).arg(&mut total);
        // SAFETY: the kernel reads the `len` bytes of the first tensor, whose memory
        // `loading` keeps until the stream is done with it (its `wait` below comes after the
        // sum is read back) and which the stream waits for (above); it writes only `total`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1 << 16)) }?;
        len
    };
    let on_device = cu_stream.clone_dtoh(&total)?[0];
    let first_done = start.elapsed();
    let loaded = loading.wait()?;
    let all_done = start.elapsed();

    // The same sum on the host, from the file.
    let spec = checkpoint.tensors().next().expect("a tensor");
    let mut host = vec![0u8; spec.bytes() as usize];
    std::os::unix::fs::FileExt::read_exact_at(
        &std::fs::File::open(checkpoint.files().next().expect("a file"))?,
        &mut host,
        spec.offset(),
    )?;
    let expected: u64 = host.iter().map(|&b| u64::from(b)).sum();
    assert_eq!(on_device, expected, "the kernel's sum of `{name}`");
    println!(
        "`{name}` ({len} bytes) summed on the GPU {:.1} ms after the call; all {} tensors \
         ({:.2} GB) on the device after {:.1} ms ({:.1} GB/s)",
        first_done.as_secs_f64() * 1e3,
        loaded.tensors().len(),
        checkpoint.bytes() as f64 / 1e9,
        all_done.as_secs_f64() * 1e3,
        checkpoint.bytes() as f64 / all_done.as_secs_f64() / 1e9
    );
    Ok(())
}
