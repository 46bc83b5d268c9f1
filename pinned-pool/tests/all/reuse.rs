//! PyTorch's caching-pinned-memory semantics on a real device (ignored without one).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cuda_pinned::{
    Device, DeviceBuffer, MemoryKind, PinnedAllocator, PinnedVec, Registered, Stream, VirtualHost,
};
use pinned_pool::{Pool, PoolConfig};

fn block_stream(stream: &Stream, ms: u64) {
    stream
        .launch_host_fn(move || std::thread::sleep(Duration::from_millis(ms)))
        .unwrap();
}

/// Holds `stream` until the returned flag is raised (or 10 s pass, so that a failing test
/// cannot hang): until then nothing queued on it after this runs, whatever the timing.
fn hold(stream: &Stream) -> Arc<AtomicBool> {
    let open = Arc::new(AtomicBool::new(false));
    let flag = open.clone();
    stream
        .launch_host_fn(move || {
            let start = Instant::now();
            while !flag.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_micros(100));
            }
        })
        .unwrap();
    open
}

/// Taken by every test here: a test that holds a stream must not run beside one whose CUDA
/// calls wait for the whole device (`cudaFree` does) while holding the driver's lock, or
/// each waits for the other until the hold gives up.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPU.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 % 251) as u8).collect()
}

const LEN: usize = 8 << 20;

/// A pool over host memory from CUDA's virtual-memory API.
fn virtual_pool() -> Pool<VirtualHost> {
    Pool::with_backend(VirtualHost::new().fixed_size(), PoolConfig::default())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_block_in_flight_is_not_reused_until_its_copy_ends() {
    let _gpu = exclusive();
    let device = Device::current().unwrap();
    in_flight_block_waits(Pool::new(), device, |kind| kind == MemoryKind::Registered);
    in_flight_block_waits(virtual_pool(), device, |kind| {
        kind == MemoryKind::VirtualHost
    });
    // Blocks registered in 2 MiB chunks: the copy is split, the block still waits for all of it.
    let chunks = Registered::new().register_in_chunks(2 << 20);
    in_flight_block_waits(
        Pool::with_backend(chunks, PoolConfig::default()),
        device,
        |kind| kind == MemoryKind::Registered,
    );
}

/// The last device, and the first made current meanwhile: on a machine with two GPUs, a
/// block used on device 1 from a thread on device 0.
fn last_device_from_the_first() -> Device {
    let all = Device::all().unwrap();
    all[0].set_current().unwrap();
    *all.last().unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_block_used_on_another_device_is_not_reused_until_its_copy_ends() {
    let _gpu = exclusive();
    let device = last_device_from_the_first();
    in_flight_block_waits(Pool::new(), device, |kind| kind == MemoryKind::Registered);
    in_flight_block_waits(virtual_pool(), device, |kind| {
        kind == MemoryKind::VirtualHost
    });
    assert_eq!(Device::current().unwrap().ordinal(), 0);
}

fn in_flight_block_waits<B: PinnedAllocator>(
    pool: Pool<B>,
    on: Device,
    kind: fn(MemoryKind) -> bool,
) {
    let stream = Stream::on(on).unwrap();
    let data = pattern(LEN);
    let mut block = pool.with_capacity(LEN).unwrap();
    block.extend_from_slice(&data);
    assert!(
        kind(block.memory_kind().unwrap()),
        "{:?}",
        block.memory_kind()
    );
    let address = block.as_ptr();
    let mut device = DeviceBuffer::<u8>::zeroed_on(on, LEN).unwrap();

    let open = hold(&stream);
    block.record_stream(&stream); // as PyTorch's record_stream; the copy records itself too
    drop(stream.copy_to_device(block, &mut device).unwrap());

    // The copy waits behind the held stream: the pool must hand out other memory and keep
    // the block pending. (Had the drop waited for the stream instead of recording an event on
    // it, it would have returned only when the hold gave up, with the stream idle.)
    assert!(!stream.query().unwrap(), "the drop waited for the stream");
    let mut other = pool.with_capacity(LEN).unwrap();
    assert_ne!(
        other.as_ptr(),
        address,
        "reused a block whose copy is pending"
    );
    other.resize(LEN, 0xEE); // scribbling here must not reach the device
    assert_eq!(pool.stats().pending_requests, 1);

    open.store(true, Ordering::Release);
    stream.synchronize().unwrap();
    assert_eq!(
        device.to_vec().unwrap(),
        data,
        "the device did not get the original data"
    );
    drop(other);

    // Both blocks are reusable now: the next allocations are hits, one of them the original.
    let before = pool.stats();
    let held: Vec<_> = (0..2).map(|_| pool.with_capacity(LEN).unwrap()).collect();
    let after = pool.stats();
    assert_eq!(after.cache_hits - before.cache_hits, 2);
    assert_eq!(after.cache_misses, before.cache_misses);
    assert!(held.iter().any(|b| b.as_ptr() == address));
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_block_used_on_two_streams_waits_for_both() {
    let _gpu = exclusive();
    let device = Device::current().unwrap();
    used_on_two_streams(Pool::new(), [device; 2]);
    used_on_two_streams(virtual_pool(), [device; 2]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_block_used_on_two_devices_waits_for_both() {
    let _gpu = exclusive();
    let last = last_device_from_the_first();
    let first = Device::new(0).unwrap();
    used_on_two_streams(Pool::new(), [first, last]);
    used_on_two_streams(Pool::new(), [last, first]);
    used_on_two_streams(virtual_pool(), [last, first]);
}

/// A block copied on a stream of `devices[0]` and used on one of `devices[1]`.
fn used_on_two_streams<B: PinnedAllocator>(pool: Pool<B>, devices: [Device; 2]) {
    let copy_stream = Stream::on(devices[0]).unwrap();
    let other_stream = Stream::on(devices[1]).unwrap();
    let data = pattern(LEN);
    let mut block = pool.with_capacity(LEN).unwrap();
    block.extend_from_slice(&data);
    let address = block.as_ptr();
    let mut device = DeviceBuffer::<u8>::zeroed_on(devices[0], LEN).unwrap();

    let open_copy = hold(&copy_stream);
    block.record_stream(&other_stream); // e.g. a kernel reading it through its device pointer
    let transfer = copy_stream.copy_to_device(block, &mut device).unwrap();
    // Held after the copy was queued: streams can share a hardware queue, and a copy queued
    // behind this hold would wait for it too.
    let open_other = hold(&other_stream);
    drop(transfer);
    assert_eq!(pool.stats().pending_requests, 1);

    open_copy.store(true, Ordering::Release);
    copy_stream.synchronize().unwrap();
    // The copy is done but the other stream is held: still not reusable.
    let early = pool.with_capacity(LEN).unwrap();
    assert_ne!(
        early.as_ptr(),
        address,
        "reused while the second stream was busy"
    );
    assert!(!other_stream.query().unwrap());

    open_other.store(true, Ordering::Release);
    other_stream.synchronize().unwrap();
    assert_eq!(device.to_vec().unwrap(), data);
    // Both streams are done: the original is the block the next allocation gets.
    let late = pool.with_capacity(LEN).unwrap();
    assert_eq!(
        late.as_ptr(),
        address,
        "not reused after both streams finished"
    );
    assert_eq!(pool.stats().pending_requests, 0);
    drop((early, late));
    pool.empty_cache();
    assert_eq!(pool.stats().allocated_bytes.current, 0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn pool_buffers_round_trip_and_hit_the_cache() {
    let _gpu = exclusive();
    let pool = Pool::new();
    let stream = Stream::new().unwrap();
    let mut device = DeviceBuffer::<f32>::zeroed(1 << 20).unwrap();
    for step in 0..10 {
        let mut host = PinnedVec::<f32, _>::with_capacity_in(1 << 20, &pool).unwrap();
        host.resize(1 << 20, step as f32);
        let host = stream
            .copy_to_device(host, &mut device)
            .unwrap()
            .wait()
            .unwrap();
        let back = PinnedVec::<f32, _>::zeroed_in(1 << 20, &pool).unwrap();
        let back = stream
            .copy_from_device(&device, back)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(back, host);
    }
    let stats = pool.stats();
    assert_eq!(stats.cache_misses, 2);
    assert_eq!(stats.cache_hits, 18);
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_arc_pool_feeds_copies_from_worker_threads_and_gets_every_block_back() {
    let _gpu = exclusive();
    let pool = std::sync::Arc::new(Pool::new());
    let stream = Stream::new().unwrap();
    let data = pattern(1 << 20);
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (pool, stream, data) = (pool.clone(), stream.clone(), data.clone());
            std::thread::spawn(move || {
                let mut device = DeviceBuffer::<u8>::zeroed(data.len()).unwrap();
                for _ in 0..20 {
                    let batch = PinnedVec::from_slice_in(&data, pool.clone()).unwrap();
                    // The transfer drops at once: the pool defers the block on its event.
                    drop(stream.copy_to_device(batch, &mut device).unwrap());
                }
                stream.synchronize().unwrap();
                device.to_vec().unwrap()
            })
        })
        .collect();
    for worker in workers {
        assert!(worker.join().unwrap() == data);
    }
    pool.process_events();
    let stats = pool.stats();
    assert_eq!(stats.active_requests.current, 0);
    assert_eq!(stats.pending_requests, 0);
}

/// A block that work queued through cudarc still reads (declared with `record_stream` on the
/// adopted stream, or a tracked copy on cudarc's stream) is not handed out again until that
/// work has finished.
#[test]
#[ignore = "needs a CUDA device"]
fn a_block_recorded_on_a_cudarc_stream_waits_for_it() {
    let _gpu = exclusive();
    use cuda_pinned::CudarcCopies;
    let pool = Pool::new();
    let cudarc_stream = cudarc::driver::CudaContext::new(0)
        .unwrap()
        .new_stream()
        .unwrap();
    let adopted = Stream::from_cudarc(&cudarc_stream).unwrap();
    let data = pattern(LEN);
    let mut device = cudarc_stream.alloc_zeros::<u8>(LEN).unwrap();

    for tracked_copy in [false, true] {
        let mut block = pool.with_capacity(LEN).unwrap();
        block.extend_from_slice(&data);
        let address = block.as_ptr();
        block_stream(&adopted, 300);
        if tracked_copy {
            drop(cudarc_stream.copy_to_device(block, &mut device).unwrap());
        } else {
            // As if a cudarc kernel read the block through its mapped address.
            block.record_stream(&adopted);
            drop(block);
        }
        let mut other = pool.with_capacity(LEN).unwrap();
        if other.as_ptr() == address {
            assert!(
                adopted.query().unwrap(),
                "reused a block whose cudarc work is pending (tracked copy: {tracked_copy})"
            );
        }
        other.resize(LEN, 0xEE);
        cudarc_stream.synchronize().unwrap();
        drop(other);
    }
    assert_eq!(cudarc_stream.clone_dtoh(&device).unwrap(), data);
    assert_eq!(pool.stats().active_bytes.current, 0);
}

/// Blocks pinned ahead by the reserve thread are ordinary pool blocks: they copy, and they
/// wait for their copy before reuse like any other.
#[test]
#[ignore = "needs a CUDA device"]
fn blocks_pinned_ahead_copy_and_wait_like_any_other() {
    let _gpu = exclusive();
    let pool = Pool::new();
    pool.reserve(LEN, 2).unwrap();
    while pool.approximate_stats().reserve_ready_bytes < 2 * LEN as u64 {
        assert!(pool.take_reserve_error().is_none());
        std::thread::sleep(Duration::from_millis(1));
    }
    let stream = Stream::new().unwrap();
    let data = pattern(LEN);
    let mut block = pool.with_capacity(LEN).unwrap();
    assert_eq!(pool.stats().cache_misses, 1);
    block.extend_from_slice(&data);
    let address = block.as_ptr();
    let mut device = DeviceBuffer::<u8>::zeroed(LEN).unwrap();
    block_stream(&stream, 300);
    drop(stream.copy_to_device(block, &mut device).unwrap());
    let mut other = pool.with_capacity(LEN).unwrap();
    if other.as_ptr() == address {
        assert!(
            stream.query().unwrap(),
            "reused a block whose copy is pending"
        );
    }
    other.resize(LEN, 0xEE);
    stream.synchronize().unwrap();
    assert_eq!(device.to_vec().unwrap(), data);
}
