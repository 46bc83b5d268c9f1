//! What getting pinned memory costs, per kind: `cargo run --release -p cuda-pinned-examples
//! --example pin_cost [MiB]` (default 1024).

use std::alloc::Layout;
use std::time::Instant;

use cuda_pinned::{CudaHost, HostLocked, PinnedAllocator, Registered};

fn time<A: PinnedAllocator>(name: &str, allocator: &A, bytes: usize) {
    let layout = Layout::from_size_align(bytes, 4096).expect("valid layout");
    let start = Instant::now();
    match allocator.allocate(layout) {
        Ok(allocation) => {
            let pinned = start.elapsed();
            let start = Instant::now();
            // SAFETY: just allocated here, never used by a device.
            unsafe { allocator.deallocate(allocation) };
            let freed = start.elapsed();
            let gib = bytes as f64 / f64::from(1 << 30);
            println!(
                "{name:<34} pin {:>9.1} ms ({:>7.1} ms/GiB)   free {:>8.1} ms",
                pinned.as_secs_f64() * 1e3,
                pinned.as_secs_f64() * 1e3 / gib,
                freed.as_secs_f64() * 1e3
            );
        }
        Err(e) => println!("{name:<34} failed: {e}", e = cuda_pinned::ErrorChain(&e)),
    }
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let bytes = mib << 20;
    println!("pinning {mib} MiB");
    if cuda_pinned::is_available() {
        time("cudaHostAlloc (portable)", &CudaHost::new(), bytes);
        time(
            "registered (huge pages, parallel pre-fault)",
            &Registered::new(),
            bytes,
        );
        time(
            "registered (4 KiB pages, 1 thread)",
            &Registered::new().huge_pages(false).prefault_threads(1),
            bytes,
        );
    } else {
        println!("CUDA not available: only the mlock kind");
    }
    time("mlock (no CUDA)", &HostLocked, bytes);
}
