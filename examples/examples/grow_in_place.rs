//! A pinned buffer that grows without moving:
//! `cargo run --release -p cuda-pinned-examples --example grow_in_place`.
//!
//! `VirtualHost` memory is created chunk by chunk through CUDA's virtual-memory API, on the
//! GPU's NUMA node, inside an address range reserved with room to spare: a vector of it grows
//! by mapping more chunks after its end, so its address stays and nothing is copied, and the
//! driver's lock is held one chunk at a time, so other threads' copies keep going.

use std::time::Instant;

use cuda_pinned::{DeviceBuffer, PinnedVec, Stream, VirtualHost};

fn main() -> cuda_pinned::Result<()> {
    if !cuda_pinned::is_available() {
        println!("no CUDA: VirtualHost needs a device");
        return Ok(());
    }
    let mut log = PinnedVec::<u64, _>::new_in(VirtualHost::new());
    let mut start = None;
    let timer = Instant::now();
    for i in 0..(256u64 << 20) / 8 {
        log.try_push(i)?;
        // The address is fixed from the first push on.
        let address = log.as_ptr();
        assert_eq!(*start.get_or_insert(address), address, "the vector moved");
    }
    println!(
        "{} MiB pushed in {:.0} ms into {} memory; the vector never moved",
        (log.len() * 8) >> 20,
        timer.elapsed().as_secs_f64() * 1e3,
        log.memory_kind().expect("allocated"),
    );

    // One copy spans every chunk the growth mapped.
    let stream = Stream::new()?;
    let mut device = DeviceBuffer::<u64>::zeroed(log.len())?;
    let timer = Instant::now();
    let log = stream.copy_to_device(log, &mut device)?.wait()?;
    let seconds = timer.elapsed().as_secs_f64();
    println!(
        "uploaded at {:.1} GB/s",
        (log.len() * 8) as f64 / seconds / 1e9
    );
    let tail = device.slice(log.len() - 4..).to_vec()?;
    assert_eq!(tail, log[log.len() - 4..]);
    println!("last elements on the device: {tail:?}");
    Ok(())
}
