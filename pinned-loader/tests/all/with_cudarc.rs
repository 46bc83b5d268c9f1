//! Device batches as cudarc kernel arguments (the `cudarc` feature; ignored without a device):
//! a kernel reads a batch passed as typed arguments, and a batch dropped while such a kernel
//! is still queued is not refilled under it.

use std::sync::Arc;

use cuda_pinned::{CudarcCopies, Stream};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use pinned_loader::{Assembly, DeviceLoader, Loader, LoaderConfig, PinnedSamples};

use crate::device::{IMAGE, Images, image};

/// Per sample: its label times 2^32 plus the sum of its pixels.
const CHECKSUM: &str = r#"
extern "C" __global__ void checksum(const unsigned char *pixels, const long long *labels,
                                    unsigned long long *out, int samples, int image) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= samples) return;
    unsigned long long sum = 0;
    for (int k = 0; k < image; ++k) sum += pixels[(long long)i * image + k];
    out[i] = ((unsigned long long)labels[i] << 32) + sum;
}
"#;

fn checksum_kernel(ctx: &Arc<CudaContext>) -> CudaFunction {
    let ptx = cudarc::nvrtc::compile_ptx(CHECKSUM).unwrap();
    ctx.load_module(ptx)
        .unwrap()
        .load_function("checksum")
        .unwrap()
}

/// What the kernel computes for dataset sample `i`.
fn expected(i: u64) -> u64 {
    (i << 32) + image(i as usize).iter().map(|&b| u64::from(b)).sum::<u64>()
}

/// Launches the checksum kernel on `stream` over one ready batch, writing `out`.
fn launch(
    stream: &Arc<CudaStream>,
    kernel: &CudaFunction,
    batch: &mut pinned_loader::DeviceBatch<(pinned_loader::Field<u8>, pinned_loader::Field<i64>)>,
    out: &mut cudarc::driver::CudaSlice<u64>,
) {
    let samples = batch.len() as i32;
    let (pixels, labels) = batch
        .ready_on(&Stream::from_cudarc(stream).unwrap())
        .unwrap();
    let image = IMAGE as i32;
    let mut builder = stream.launch_builder(kernel);
    builder
        .arg(&pixels)
        .arg(&labels)
        .arg(out)
        .arg(&samples)
        .arg(&image);
    // SAFETY: the kernel's parameters match the arguments (two device arrays of `samples`
    // samples, an output of as many, two ints) and it stays in bounds; `stream` waited for
    // the batch, and the batch is reused only after `stream` has passed the launch.
    unsafe { builder.launch(LaunchConfig::for_num_elems(samples as u32)) }.unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cudarc_kernel_reads_a_batch_passed_as_arguments() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernel = checksum_kernel(&ctx);
    for assembly in [Assembly::HostCollate, Assembly::DeviceGather] {
        let dataset = PinnedSamples::from_dataset(&Images { len: 16 * 10 }).unwrap();
        let loader = Loader::new(dataset, LoaderConfig::new(16).workers(2).shuffle(3)).unwrap();
        let mut device = DeviceLoader::new(loader, assembly).unwrap();
        let mut seen = Vec::new();
        for batch in device.epoch(0) {
            let mut batch = batch.unwrap();
            let mut out = stream.alloc_zeros::<u64>(batch.len()).unwrap();
            launch(&stream, &kernel, &mut batch, &mut out);
            let sums = stream.clone_dtoh(&out).unwrap();
            for (&index, &sum) in batch.indices().iter().zip(&sums) {
                assert_eq!(sum, expected(index as u64), "{assembly:?}: sample {index}");
            }
            seen.extend_from_slice(batch.indices());
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..160).collect::<Vec<usize>>());
    }
}

/// A batch a cudarc kernel still reads (its stream held back) is dropped, and the loader
/// hands out the next batches meanwhile, which would take its slot first: the kernel still
/// sees its own batch.
#[test]
#[ignore = "needs a CUDA device"]
fn a_batch_under_a_queued_cudarc_kernel_is_not_recycled() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernel = checksum_kernel(&ctx);
    for assembly in [Assembly::HostCollate, Assembly::DeviceGather] {
        let dataset = PinnedSamples::from_dataset(&Images { len: 16 * 40 }).unwrap();
        let loader = Loader::new(dataset, LoaderConfig::new(16).workers(2)).unwrap();
        let mut device = DeviceLoader::new(loader, assembly).unwrap();
        let mut epoch = device.epoch(0);
        let mut first = epoch.next().unwrap().unwrap();
        let indices = first.indices().to_vec();
        let mut out = stream.alloc_zeros::<u64>(first.len()).unwrap();
        Stream::from_cudarc(&stream)
            .unwrap()
            .launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(300)))
            .unwrap();
        launch(&stream, &kernel, &mut first, &mut out);
        drop(first);
        let rest: Vec<_> = epoch.by_ref().take(6).map(Result::unwrap).collect();
        let sums = stream.clone_dtoh(&out).unwrap();
        for (&index, &sum) in indices.iter().zip(&sums) {
            assert_eq!(
                sum,
                expected(index as u64),
                "{assembly:?}: the kernel read another batch"
            );
        }
        drop(rest);
    }
}

/// A batch's field copies into cudarc's memory on cudarc's stream, tracked: no raw address.
#[test]
#[ignore = "needs a CUDA device"]
fn a_batch_copies_into_cudarc_memory() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let dataset = PinnedSamples::from_dataset(&Images { len: 64 }).unwrap();
    let loader = Loader::new(dataset, LoaderConfig::new(16).workers(2)).unwrap();
    let mut device = DeviceLoader::new(loader, Assembly::HostCollate).unwrap();
    for batch in device.epoch(0) {
        let mut batch = batch.unwrap();
        let (pixels, _) = batch
            .ready_on(&Stream::from_cudarc(&stream).unwrap())
            .unwrap();
        let mut theirs = stream.alloc_zeros::<u8>(pixels.len()).unwrap();
        stream.copy_device_to_cudarc(pixels, &mut theirs).unwrap();
        let back = stream.clone_dtoh(&theirs).unwrap();
        for (&index, sample) in batch.indices().iter().zip(back.chunks(IMAGE)) {
            assert!(sample == image(index), "sample {index}");
        }
    }
}
