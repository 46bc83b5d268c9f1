//! A pinned batch through cudarc, without kernels: upload, a device-side copy, download.
//! `cargo run -p cuda-pinned-examples --features cudarc --example cudarc_pipeline`.
//!
//! Uploads and downloads are tracked copies on cudarc's stream: they return at once, the
//! pinned buffer travels with the copy, and a pool would not reuse it before the DMA ends.

use std::error::Error;

use cuda_pinned::{CudarcCopies, PinnedVec};
use cudarc::driver::CudaContext;
use pinned_pool::Pool;

fn main() -> Result<(), Box<dyn Error>> {
    if !cuda_pinned::is_available() {
        println!("no CUDA device: nothing to copy to");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let pool = Pool::new();
    const LEN: usize = 1 << 22;

    let mut batch = PinnedVec::with_capacity_in(LEN, &pool)?;
    batch.extend((0..LEN as u32).map(|i| i.wrapping_mul(2_654_435_761)));
    let expected = batch.to_vec();

    let mut staged = stream.alloc_zeros::<u32>(LEN)?;
    let mut shuffled = stream.alloc_zeros::<u32>(LEN)?;
    // Upload: returns before the DMA; `batch` comes back from `wait`, or goes back to the
    // pool when the transfer drops, after the copy.
    let upload = stream.copy_to_device(batch, &mut staged)?;
    // Device-side work queued through cudarc on the same stream: its events order it after
    // the upload. Swap the two halves.
    let (low, high) = staged.split_at(LEN / 2);
    stream.memcpy_dtod(&low, &mut shuffled.slice_mut(LEN / 2..))?;
    stream.memcpy_dtod(&high, &mut shuffled.slice_mut(..LEN / 2))?;
    drop(upload);
    // Download into another pooled buffer (the first may be reused once its copy is done).
    let download = stream.copy_from_device(&shuffled, PinnedVec::zeroed_in(LEN, &pool)?)?;
    let result = download.wait()?;

    let (front, back) = expected.split_at(LEN / 2);
    assert!(result[..LEN / 2] == *back && result[LEN / 2..] == *front);
    // A blocking copy is a tracked one waited for at once.
    let check = stream
        .copy_from_device(&shuffled, PinnedVec::zeroed_in(LEN, &pool)?)?
        .wait()?;
    assert!(check == result);
    let stats = pool.stats();
    println!(
        "{} MiB uploaded, swapped on the device and downloaded intact; the pool pinned {} \
         blocks for {} requests",
        (LEN * 4) >> 20,
        stats.cache_misses,
        stats.cache_hits + stats.cache_misses
    );
    Ok(())
}
