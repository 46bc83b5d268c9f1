//! Copies through every kind of memory, and their tracking: buffers come back, or go to their
//! allocator, only after the device is done with them (ignored without a device).

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use cuda_pinned::{
    Allocation, CudaHost, DefaultPinned, Device, DeviceBuffer, HostAllocFlags, HostLocked,
    MemoryKind, PinnedAllocator, PinnedBox, PinnedVec, RegisterFlags, Registered, RegisteredVec,
    Registration, Result, Stream,
};

pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Host → device → host through `allocator`, checking the bytes at each end.
pub(crate) fn round_trip<A: PinnedAllocator + Clone>(allocator: A, len: usize) {
    let stream = Stream::new().unwrap();
    let data = pattern(len, 3);
    let src = PinnedVec::from_slice_in(&data, allocator.clone()).unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(len).unwrap();
    let src = stream
        .copy_to_device(src, &mut device)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        device.to_vec().unwrap(),
        data,
        "device copy differs ({len} bytes)"
    );
    let dst = PinnedVec::zeroed_in(len, allocator).unwrap();
    let dst = stream
        .copy_from_device(&device, dst)
        .unwrap()
        .wait()
        .unwrap();
    assert!(dst == src, "host copy differs ({len} bytes)");
}

const SIZES: [usize; 4] = [0, 1, 4097, 64 << 20];

#[test]
#[ignore = "needs a CUDA device"]
fn round_trips_through_cuda_host_alloc_with_each_flag() {
    let flags = [
        HostAllocFlags::PORTABLE,
        HostAllocFlags::NONE,
        HostAllocFlags::MAPPED,
        HostAllocFlags::WRITE_COMBINED,
        HostAllocFlags::PORTABLE | HostAllocFlags::MAPPED,
    ];
    for flags in flags {
        for len in SIZES {
            round_trip(CudaHost::with_flags(flags), len);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn round_trips_through_registered_memory() {
    let kinds = [
        Registered::new(),
        Registered::new().huge_pages(false).prefault_threads(1),
        Registered::new().flags(RegisterFlags::PORTABLE | RegisterFlags::MAPPED),
    ];
    for allocator in kinds {
        for len in SIZES {
            round_trip(allocator, len);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn round_trips_through_locked_and_default_memory() {
    for len in SIZES {
        round_trip(HostLocked, len);
        round_trip(DefaultPinned, len);
    }
    assert_eq!(DefaultPinned::kind(), MemoryKind::Registered);
}

#[test]
#[ignore = "needs a CUDA device"]
fn registers_an_existing_vec_and_a_borrowed_slice() {
    let stream = Stream::new().unwrap();
    for len in [1usize, 4097, 64 << 20] {
        let data = pattern(len, 9);
        let registered = RegisteredVec::new(data.clone()).unwrap();
        assert_eq!(registered.memory_kind(), MemoryKind::Registration);
        let mut device = DeviceBuffer::<u8>::zeroed(len).unwrap();
        let registered = stream
            .copy_to_device(registered, &mut device)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(device.to_vec().unwrap(), data);
        assert_eq!(registered.into_inner().unwrap(), data);

        let mut out = vec![0u8; len];
        let mut borrowed = Registration::new(&mut out).unwrap();
        device.copy_to_host(&mut borrowed).unwrap();
        drop(borrowed);
        assert_eq!(out, data);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn mapped_memory_device_pointer_feeds_a_copy() {
    let stream = Stream::new().unwrap();
    let data = pattern(1 << 20, 5);
    let mapped =
        PinnedVec::from_slice_in(&data, CudaHost::with_flags(HostAllocFlags::MAPPED)).unwrap();
    let address = mapped.device_ptr().unwrap();
    assert_ne!(address, 0);
    let dst = PinnedVec::<u8>::zeroed(data.len()).unwrap();
    // SAFETY: `address` maps `mapped`, which outlives the copy (waited for below) and is not
    // written meanwhile.
    let dst = unsafe { stream.copy_from_device_ptr(address, dst) }
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(dst, data);
    drop(mapped);
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_box_round_trip() {
    let stream = Stream::new().unwrap();
    let value = PinnedBox::new([1.5f32, -2.0, 3.25, 4.0]).unwrap();
    let mut device = DeviceBuffer::<[f32; 4]>::zeroed(1).unwrap();
    let value = stream
        .copy_to_device(value, &mut device)
        .unwrap()
        .wait()
        .unwrap();
    let back = PinnedBox::new([0f32; 4]).unwrap();
    let back = stream
        .copy_from_device(&device, back)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(*back, *value);
}

/// Blocks `stream` for `ms` milliseconds on a driver thread; the flag is set when it unblocks.
pub(crate) fn block(stream: &Stream, ms: u64) -> Arc<AtomicBool> {
    let unblocked = Arc::new(AtomicBool::new(false));
    let flag = unblocked.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    unblocked
}

/// An event behind work that has not run reads as not finished (the driver's "not ready" is
/// no error), and as finished once the work has run.
#[test]
#[ignore = "needs a CUDA device"]
fn an_event_behind_held_work_is_not_ready_until_it_runs() {
    let stream = Stream::new().unwrap();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let holding = Arc::new(AtomicBool::new(true));
    let still = holding.clone();
    stream
        .launch_host_fn(move || {
            // Bounded: the driver runs host functions one at a time, so one that waited for
            // ever on a test thread held up would stall every test of the process.
            let _ = held.recv_timeout(Duration::from_secs(20));
            still.store(false, Ordering::SeqCst);
        })
        .unwrap();
    let event = stream.record_event().unwrap();
    for _ in 0..2 {
        let ready = event.query().unwrap();
        assert!(
            !ready || !holding.load(Ordering::SeqCst),
            "the event reads as finished while the work before it still runs"
        );
    }
    // The host function may have given up waiting already: the calls above can wait behind
    // another thread's device-wide synchronisation, which waits for this stream's host
    // function. The checks above hold either way.
    let _ = release.send(());
    event.synchronize().unwrap();
    assert!(event.query().unwrap());
}

#[test]
#[ignore = "needs a CUDA device"]
fn reading_after_a_delayed_copy_sees_the_finished_data() {
    let stream = Stream::new().unwrap();
    let len = 32 << 20;
    let data = pattern(len, 11);
    let device = DeviceBuffer::from_slice(&data).unwrap();
    let host = PinnedVec::<u8>::zeroed(len).unwrap();
    let unblocked = block(&stream, 300);
    let transfer = stream.copy_from_device(&device, host).unwrap();
    // Usually the stream is still blocked here; another thread's device-wide synchronisation
    // can delay this thread past the block. Either way a finished copy implies an unblocked
    // stream.
    if transfer.is_done().unwrap() {
        assert!(
            unblocked.load(Ordering::SeqCst),
            "the copy finished before the stream unblocked"
        );
    }
    let host = transfer.wait().unwrap();
    assert!(host == data, "the host read before the copy finished");
}

/// Wraps `CudaHost`; on deallocation checks that the block holds `expected`, i.e. that the
/// copy into it finished before the memory was freed.
#[derive(Clone)]
struct CheckOnFree {
    expected: Arc<Vec<u8>>,
    freed: Arc<AtomicUsize>,
    intact: Arc<AtomicBool>,
}

// SAFETY: forwards to `CudaHost`; the check only reads the block before freeing it.
unsafe impl PinnedAllocator for CheckOnFree {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        CudaHost::new().allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: the block is live and holds at least `expected.len()` bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(allocation.ptr().as_ptr(), self.expected.len()) };
        self.intact
            .store(bytes == self.expected.as_slice(), Ordering::SeqCst);
        self.freed.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded from the caller.
        unsafe { CudaHost::new().deallocate(allocation) }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropping_during_a_delayed_copy_frees_only_after_it() {
    let stream = Stream::new().unwrap();
    let len = 32 << 20;
    let data = Arc::new(pattern(len, 13));
    let device = DeviceBuffer::from_slice(&data).unwrap();
    let allocator = CheckOnFree {
        expected: data.clone(),
        freed: Arc::default(),
        intact: Arc::default(),
    };
    let host = PinnedVec::zeroed_in(len, allocator.clone()).unwrap();
    block(&stream, 300);
    let transfer = stream.copy_from_device(&device, host).unwrap();
    drop(transfer);
    assert_eq!(allocator.freed.load(Ordering::SeqCst), 1);
    assert!(
        allocator.intact.load(Ordering::SeqCst),
        "memory was freed before the copy ended"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropping_a_source_during_a_delayed_upload_keeps_the_data_intact() {
    let stream = Stream::new().unwrap();
    let len = 32 << 20;
    let data = pattern(len, 17);
    let mut device = DeviceBuffer::<u8>::zeroed(len).unwrap();
    let src = PinnedVec::from_slice_in(&data, CudaHost::new()).unwrap();
    block(&stream, 300);
    drop(stream.copy_to_device(src, &mut device).unwrap());
    // Allocate and scribble over fresh pinned memory: if the source had been freed early,
    // this is where its pages would go.
    let _scribble = PinnedVec::from_slice_in(&vec![0xEEu8; len], CudaHost::new()).unwrap();
    assert_eq!(device.to_vec().unwrap(), data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn recorded_streams_are_waited_for_before_freeing() {
    let stream = Stream::new().unwrap();
    let finished = Arc::new(AtomicBool::new(false));
    let flag = finished.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(200));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    let checker = Arc::new(AtomicBool::new(false));
    #[derive(Clone)]
    struct Observe(Arc<AtomicBool>, Arc<AtomicBool>);
    // SAFETY: forwards to `CudaHost`.
    unsafe impl PinnedAllocator for Observe {
        fn allocate(&self, layout: Layout) -> Result<Allocation> {
            CudaHost::new().allocate(layout)
        }
        unsafe fn deallocate(&self, allocation: Allocation) {
            self.1
                .store(self.0.load(Ordering::SeqCst), Ordering::SeqCst);
            // SAFETY: forwarded.
            unsafe { CudaHost::new().deallocate(allocation) }
        }
    }
    let mut v = PinnedVec::from_slice_in(&[1u8; 4096], Observe(finished, checker.clone())).unwrap();
    v.record_stream(&stream);
    drop(v);
    assert!(
        checker.load(Ordering::SeqCst),
        "freed while the recorded stream was still busy"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn devices_report_names_bus_ids_and_versions() {
    assert!(cuda_pinned::is_available());
    let runtime = cuda_pinned::runtime_version().unwrap();
    let driver = cuda_pinned::driver_version().unwrap();
    assert!(
        runtime.major >= 11 && driver >= runtime,
        "runtime {runtime}, driver {driver}"
    );
    let devices = Device::all().unwrap();
    assert!(!devices.is_empty());
    for device in devices {
        assert!(!device.name().unwrap().is_empty());
        assert!(device.pci_bus_id().unwrap().contains(':'));
        assert!(device.supports_host_registration().unwrap());
    }
    assert!(Device::new(1000).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn length_mismatch_is_a_clear_error_and_frees_the_buffer() {
    let stream = Stream::new().unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(10).unwrap();
    let allocator = crate::support::Counting::default();
    let src = PinnedVec::from_slice_in(&[1u8; 11], allocator.clone()).unwrap();
    let error = stream.copy_to_device(src, &mut device).unwrap_err();
    assert!(matches!(
        error,
        cuda_pinned::Error::LengthMismatch {
            host: 11,
            device: 10
        }
    ));
    assert!(error.to_string().contains("lengths differ"), "{error}");
    assert_eq!(allocator.live(), 0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn memory_registered_in_chunks_copies_as_one_buffer() {
    let mib = 1 << 20;
    let chunks = Registered::new().register_in_chunks(2 * mib);
    for len in [1, 2 * mib + 1, 3 * 2 * mib + 17, 64 * mib] {
        round_trip(chunks, len);
    }
    // A copy of a part that crosses chunk boundaries, from a view, blocking.
    let data = pattern(10 * mib, 21);
    let host = PinnedVec::from_slice_in(&data, chunks).unwrap();
    assert_eq!(host.memory_kind(), Some(MemoryKind::Registered));
    let mut device = DeviceBuffer::<u8>::zeroed(5 * mib).unwrap();
    let part = &host[mib + 3..6 * mib + 3];
    device.copy_from_host(part).unwrap();
    assert!(device.to_vec().unwrap() == part);
    // Raw batched copies across boundaries, both directions.
    let stream = Stream::new().unwrap();
    let mut back = PinnedVec::<u8, _>::zeroed_in(10 * mib, chunks).unwrap();
    let copies = [cuda_pinned::RawCopy {
        dst: device.as_raw(),
        src: host.as_ptr() as u64 + 3 * mib as u64 - 5,
        bytes: 5 * mib,
    }];
    // SAFETY: both ranges are live for the copy, which is waited for below; nothing else
    // touches them meanwhile.
    unsafe { stream.copy_batch_raw(&copies).unwrap() };
    let copies = [cuda_pinned::RawCopy {
        dst: back.as_mut_ptr() as u64 + mib as u64 + 1,
        src: device.as_raw(),
        bytes: 5 * mib,
    }];
    // SAFETY: as above.
    unsafe { stream.copy_batch_raw(&copies).unwrap() };
    stream.synchronize().unwrap();
    assert!(back[mib + 1..6 * mib + 1] == data[3 * mib - 5..8 * mib - 5]);
    drop((host, back));
    // A node the machine lacks, asked for by name, is an error.
    assert!(
        Registered::new()
            .node(4000)
            .allocate(Layout::new::<[u8; 4096]>())
            .is_err()
    );
}

/// A slice registered read-only uploads at pinned speed and arrives intact.
#[test]
#[ignore = "needs a CUDA device"]
fn a_read_only_registration_uploads_intact() {
    let device = cuda_pinned::Device::current().unwrap();
    if !device.supports_read_only_registration().unwrap() {
        return; // nothing to check on this device
    }
    let data = pattern(8 << 20, 5);
    let pinned = cuda_pinned::ReadOnlyRegistration::new(&data).unwrap();
    assert_eq!(pinned.memory_kind(), MemoryKind::Registration);
    let mut on_device = DeviceBuffer::<u8>::zeroed(data.len()).unwrap();
    on_device.copy_from_host(&pinned).unwrap();
    drop(pinned);
    assert!(on_device.to_vec().unwrap() == data);
}
