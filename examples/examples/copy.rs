//! An async round trip through the GPU: `cargo run -p cuda-pinned-examples --example copy`.

use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};

fn main() -> cuda_pinned::Result<()> {
    let mut host = PinnedVec::<u32>::with_capacity(1 << 20)?;
    host.extend(0..1 << 20);
    println!(
        "{} elements in {} memory",
        host.len(),
        host.memory_kind().expect("allocated")
    );
    if !cuda_pinned::is_available() {
        println!("no CUDA device: nothing to copy to");
        return Ok(());
    }
    let stream = Stream::new()?;
    let mut device = DeviceBuffer::<u32>::zeroed(host.len())?;
    // The buffer travels with the copy and comes back once the device is done with it.
    let upload = stream.copy_to_device(host, &mut device)?;
    let host = upload.wait()?;
    let back = stream
        .copy_from_device(&device, PinnedVec::zeroed(host.len())?)?
        .wait()?;
    assert_eq!(back, host);
    println!("round trip of {} bytes verified", back.len() * 4);
    Ok(())
}
