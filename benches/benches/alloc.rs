//! A pool hit against a direct allocation of each kind of pinned memory (1 MiB and 64 MiB).

#![allow(
    missing_docs,
    reason = "criterion's macros generate undocumented items"
)]

use std::alloc::Layout;
use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use cuda_pinned::{CudaHost, HostLocked, PinnedAllocator, Registered};
use pinned_pool::Pool;

fn direct<A: PinnedAllocator>(c: &mut Criterion, name: &str, allocator: &A) {
    let mut group = c.benchmark_group(format!("alloc/{name}"));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2));
    for bytes in [1usize << 20, 64 << 20] {
        let layout = Layout::from_size_align(bytes, 4096).expect("layout");
        if let Err(e) = allocator.allocate(layout).map(|a| {
            // SAFETY: just allocated, unused.
            unsafe { allocator.deallocate(a) }
        }) {
            eprintln!("alloc/{name}: skipped: {}", cuda_pinned::ErrorChain(&e));
            return;
        }
        group.bench_with_input(BenchmarkId::from_parameter(bytes), &layout, |b, &layout| {
            b.iter(|| {
                let allocation = allocator.allocate(black_box(layout)).expect("allocate");
                // SAFETY: just allocated, unused.
                unsafe { allocator.deallocate(allocation) };
            })
        });
    }
    group.finish();
}

fn kinds(c: &mut Criterion) {
    let pool = Pool::new();
    let mut group = c.benchmark_group("alloc/pool_hit");
    for bytes in [1usize << 20, 64 << 20] {
        drop(pool.with_capacity(bytes).expect("pin"));
        group.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
            b.iter(|| {
                let block = pool.allocate_raw(black_box(bytes)).expect("hit");
                // SAFETY: from this pool, unused.
                unsafe { pool.free_raw(block) };
            })
        });
    }
    group.finish();
    direct(c, "mlock", &HostLocked);
    if cuda_pinned::is_available() {
        direct(c, "cudaHostAlloc", &CudaHost::new());
        direct(c, "registered", &Registered::new());
    } else {
        eprintln!("alloc: CUDA not available; cudaHostAlloc and registered skipped");
    }
}

criterion_group!(benches, kinds);
criterion_main!(benches);
