//! The machine's memory, read from files the test writes: pinning that would leave too little
//! available is refused after the idle cache is given back, and the idle cache is given back
//! while tasks stall for memory.

use std::path::Path;

use cuda_pinned::{Error, PinnedVec};
use pinned_pool::{Pool, PoolConfig};

use crate::support::Heap;

const MIB: u64 = 1 << 20;

/// Writes `meminfo` (in MiB) and, if given, a stall share for `pressure/memory`.
fn machine(dir: &Path, total_mib: u64, available_mib: u64, stall_avg60: Option<f64>) {
    std::fs::write(
        dir.join("meminfo"),
        format!(
            "MemTotal:       {} kB\nMemFree:        1 kB\nMemAvailable:   {} kB\n",
            total_mib * 1024,
            available_mib * 1024
        ),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("pressure")).unwrap();
    let pressure = dir.join("pressure/memory");
    match stall_avg60 {
        Some(avg60) => std::fs::write(
            pressure,
            format!(
                "some avg10=1.00 avg60={avg60:.2} avg300=0.50 total=100\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            ),
        )
        .unwrap(),
        None => {
            let _ = std::fs::remove_file(pressure);
        }
    }
}

fn watching(dir: &Path, config: PoolConfig) -> Pool<Heap> {
    Pool::with_backend(Heap::new(), config.memory_files(dir))
}

#[test]
fn pinning_that_would_leave_too_little_available_is_refused_after_the_cache_goes() {
    let dir = tempfile::tempdir().unwrap();
    // 1,000 MiB, 100 available; 5% (50 MiB) is kept available by default.
    machine(dir.path(), 1000, 100, None);
    let pool = watching(dir.path(), PoolConfig::new());
    // 40 MiB leaves 60: granted, then cached.
    drop(PinnedVec::<u8, _>::with_capacity_in((40 * MIB) as usize, &pool).unwrap());
    assert_eq!(pool.stats().cached_bytes, 40 * MIB);
    // The machine now has 70 MiB available: 30 more would leave 40, under 50.
    machine(dir.path(), 1000, 70, None);
    let refused = PinnedVec::<u8, _>::with_capacity_in((30 * MIB) as usize, &pool).unwrap_err();
    let Error::MemoryPressure {
        requested,
        available,
        keep,
        pinned,
        ..
    } = &refused
    else {
        panic!("not a memory-pressure refusal: {refused}");
    };
    assert_eq!(
        (*requested as u64, *available, *keep),
        (30 * MIB, 70 * MIB, 50 * MIB)
    );
    // The idle cache went back to the system first.
    assert_eq!((*pinned, pool.stats().cached_bytes), (0, 0));
    let message = refused.to_string();
    for part in [
        "30.0 MiB more",
        "40.0 MiB of the 1000.0 MiB this process may use",
        "50.0 MiB kept available",
        "this pool holds 0 B",
    ] {
        assert!(message.contains(part), "{part:?} missing from {message:?}");
    }
    assert_eq!(pool.stats().pressure_refusals, 1);
    // More memory available again: granted.
    machine(dir.path(), 1000, 500, None);
    drop(PinnedVec::<u8, _>::with_capacity_in((30 * MIB) as usize, &pool).unwrap());
    // The guard off: granted whatever the machine says.
    machine(dir.path(), 1000, 10, None);
    let unguarded = watching(dir.path(), PoolConfig::new().keep_available(0.0));
    drop(PinnedVec::<u8, _>::with_capacity_in((30 * MIB) as usize, &unguarded).unwrap());
}

#[test]
fn idle_cache_goes_back_while_tasks_stall_for_memory() {
    let dir = tempfile::tempdir().unwrap();
    machine(dir.path(), 1000, 900, Some(2.0));
    let pool = watching(dir.path(), PoolConfig::new());
    drop(PinnedVec::<u8, _>::with_capacity_in((8 * MIB) as usize, &pool).unwrap());
    assert_eq!(pool.stats().cached_bytes, 8 * MIB);
    // 2% of the last minute stalled: under the 10% default, nothing goes back.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(pool.relieve_pressure(), 0);
    // 25%: the idle cache goes back, once; a second look within the second does nothing.
    machine(dir.path(), 1000, 900, Some(25.0));
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(pool.relieve_pressure(), (8 * MIB) as usize);
    let stats = pool.stats();
    assert_eq!(
        (
            stats.cached_bytes,
            stats.pressure_releases,
            stats.pressure_released_bytes
        ),
        (0, 1, 8 * MIB)
    );
    assert_eq!(pool.relieve_pressure(), 0);
    // No pressure information (an older kernel): nothing to do.
    machine(dir.path(), 1000, 900, None);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(pool.relieve_pressure(), 0);
}

#[test]
fn the_reserve_thread_pins_ahead_only_what_the_machine_can_spare() {
    let dir = tempfile::tempdir().unwrap();
    machine(dir.path(), 1000, 60, None);
    let pool = watching(dir.path(), PoolConfig::new());
    pool.reserve((16 * MIB) as usize, 4).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pool.stats().reserve_failures == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(matches!(
        pool.take_reserve_error(),
        Some(Error::MemoryPressure { .. })
    ));
    // 60 available, 50 kept: no 16 MiB block leaves enough.
    assert_eq!(pool.stats().reserve_ready_bytes, 0);
}
