//! Host memory through CUDA's virtual-memory API (`VirtualHost`) on a device (ignored
//! without one).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cuda_pinned::{
    Device, DeviceBuffer, MemoryKind, PinnedAllocator, PinnedVec, Stream, VirtualHost,
};

use crate::copies::{block, pattern, round_trip};

const MIB: usize = 1 << 20;

fn is_virtual(kind: Option<MemoryKind>) -> bool {
    kind == Some(MemoryKind::VirtualHost)
}

#[test]
#[ignore = "needs a CUDA device"]
fn round_trips_at_chunk_boundaries() {
    assert!(
        Device::current()
            .unwrap()
            .supports_virtual_host_memory()
            .unwrap()
    );
    // 2 MiB chunks: every size below crosses chunk boundaries somewhere.
    let small_chunks = VirtualHost::new().chunk_bytes(2 * MIB);
    for len in [
        0,
        1,
        2 * MIB - 1,
        2 * MIB,
        2 * MIB + 1,
        3 * 2 * MIB + 17,
        64 * MIB,
    ] {
        round_trip(small_chunks, len);
    }
    for len in [1, 4097, 100 * MIB] {
        round_trip(VirtualHost::new(), len);
        round_trip(VirtualHost::new().prefault_threads(0), len);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_kind_shows_sizes_round_to_the_granularity_and_the_device_sees_the_host_address() {
    let v = PinnedVec::<u8, _>::with_capacity_in(1, VirtualHost::new()).unwrap();
    assert_eq!(v.memory_kind(), Some(MemoryKind::VirtualHost));
    assert!(v.capacity() >= 2 * MIB, "sizes round up to the granularity");
    let (allocation, _, allocator) = v.into_raw_parts();
    let allocation = allocation.unwrap();
    // Unified addressing: the device sees the memory at the host's address.
    assert_eq!(
        allocation.device_ptr().unwrap(),
        allocation.ptr().as_ptr() as u64
    );
    // SAFETY: from this allocator, no device work used it.
    unsafe { allocator.deallocate(allocation) };
    // An explicit node that does not exist is the driver's error, not a panic.
    let error = PinnedVec::<u8, _>::with_capacity_in(1, VirtualHost::new().node(4096)).unwrap_err();
    println!("node 4096: {error}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn growth_in_place_keeps_contents_and_address_and_copies_span_chunks() {
    let device_before = Device::current().unwrap().ordinal();
    let mut v =
        PinnedVec::<u32, _>::with_capacity_in(1024, VirtualHost::new().chunk_bytes(4 * MIB))
            .unwrap();
    let start = v.as_ptr();
    let len = 48 * MIB / 4;
    for i in 0..len as u32 {
        v.push(i.wrapping_mul(2_654_435_761));
    }
    assert_eq!(v.as_ptr(), start, "grew by moving");
    assert!(is_virtual(v.memory_kind()));
    assert!(
        v.iter()
            .enumerate()
            .all(|(i, &x)| x == (i as u32).wrapping_mul(2_654_435_761))
    );
    // One copy across every chunk mapped by growth, and back.
    let stream = Stream::new().unwrap();
    let mut device = DeviceBuffer::<u32>::zeroed(len).unwrap();
    let v = stream
        .copy_to_device(v, &mut device)
        .unwrap()
        .wait()
        .unwrap();
    let back = PinnedVec::<u32, _>::zeroed_in(len, VirtualHost::new()).unwrap();
    let back = stream
        .copy_from_device(&device, back)
        .unwrap()
        .wait()
        .unwrap();
    assert!(back == v);
    assert_eq!(Device::current().unwrap().ordinal(), device_before);
}

#[test]
#[ignore = "needs a CUDA device"]
fn past_its_address_room_a_vector_moves_with_its_contents() {
    // No room beyond 8× the first block: a vector of one 2 MiB block grows in place to 16 MiB.
    let allocator = VirtualHost::new().address_room(0);
    let mut v = PinnedVec::<u8, _>::with_capacity_in(2 * MIB, allocator).unwrap();
    let start = v.as_ptr();
    let data = pattern(40 * MIB, 9);
    for chunk in data.chunks(MIB) {
        v.extend_from_slice(chunk);
        if v.len() <= 16 * MIB {
            assert_eq!(v.as_ptr(), start, "moved within the room");
        }
    }
    assert_ne!(v.as_ptr(), start, "grew past the room without moving");
    assert!(v.as_slice() == data.as_slice());
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_delayed_upload_from_grown_memory_sends_what_was_there() {
    let stream = Stream::new().unwrap();
    let mut v = PinnedVec::<u8, _>::with_capacity_in(MIB, VirtualHost::new()).unwrap();
    let data = pattern(24 * MIB, 5);
    v.extend_from_slice(&data); // grown in place on the way
    let mut device = DeviceBuffer::<u8>::zeroed(data.len()).unwrap();
    block(&stream, 300);
    let transfer = stream.copy_to_device(v, &mut device).unwrap();
    drop(transfer); // freed only after the copy
    stream.synchronize().unwrap();
    assert!(device.to_vec().unwrap() == data);
}

/// Another thread's small copies keep completing while a large block is created (the
/// driver's lock is taken one chunk at a time). Only what timing cannot break is asserted:
/// once the copier is running, copies finish while blocks are created (tried a few times, as
/// other tests in this process may pin memory the old way and stall every thread meanwhile);
/// the longest wait is printed.
#[test]
#[ignore = "needs a CUDA device"]
fn other_threads_copy_while_a_large_block_is_created() {
    let (running, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (during, creating) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let copier = {
        let (running, done) = (running.clone(), done.clone());
        let (during, creating) = (during.clone(), creating.clone());
        std::thread::spawn(move || {
            let stream = Stream::new().unwrap();
            let mut device = DeviceBuffer::<u8>::zeroed(64 << 10).unwrap();
            let mut host = PinnedVec::<u8>::zeroed(64 << 10).unwrap();
            let mut worst = Duration::ZERO;
            while !done.load(Ordering::SeqCst) {
                let start = Instant::now();
                let was_creating = creating.load(Ordering::SeqCst);
                host = stream
                    .copy_to_device(host, &mut device)
                    .unwrap()
                    .wait()
                    .unwrap();
                running.store(true, Ordering::SeqCst);
                if was_creating && creating.load(Ordering::SeqCst) {
                    worst = worst.max(start.elapsed());
                    during.fetch_add(1, Ordering::SeqCst);
                }
            }
            worst
        })
    };
    while !running.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let allocator = VirtualHost::new().chunk_bytes(2 * MIB);
    // Other tests may run beside this one and slow the copier down: enough tries that one
    // of its copies falls inside a creation, unless creating blocks copies.
    for _ in 0..20 {
        creating.store(true, Ordering::SeqCst);
        let block = PinnedVec::<u8, _>::with_capacity_in(1 << 30, allocator).unwrap();
        creating.store(false, Ordering::SeqCst);
        drop(block);
        if during.load(Ordering::SeqCst) > 0 {
            break;
        }
    }
    done.store(true, Ordering::SeqCst);
    let worst = copier.join().unwrap();
    println!(
        "{} copies began and ended while 1 GiB was created; the longest took {worst:?}",
        during.load(Ordering::SeqCst)
    );
    assert!(during.load(Ordering::SeqCst) > 0);
}
