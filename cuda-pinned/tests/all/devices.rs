//! Several devices in one process (ignored without a device). Every call names its device
//! and leaves the calling thread's current device alone; on a machine with one GPU, device 0
//! is named explicitly through every path and the checks that need two say so and pass.

use cuda_pinned::{
    CudaHost, DefaultPinned, Device, DeviceBuffer, Error, Event, HostLocked, PinnedAllocator,
    PinnedVec, RawCopy, Registered, Stager, Stream, VirtualHost,
};

use crate::copies::pattern;

fn devices() -> Vec<Device> {
    Device::all().unwrap()
}

/// A device other than `device` where there is one: made current while `device` is used.
fn elsewhere(device: Device) -> Device {
    devices()
        .into_iter()
        .rev()
        .find(|&d| d != device)
        .unwrap_or(device)
}

/// Host → device → host on `device`'s stream and memory, from memory of `allocator`.
fn round_trip_on<A: PinnedAllocator + Clone>(device: Device, allocator: A, len: usize) {
    let stream = Stream::on(device).unwrap();
    let data = pattern(len, device.ordinal() as u8 + 5);
    let src = PinnedVec::from_slice_in(&data, allocator.clone()).unwrap();
    let mut memory = DeviceBuffer::<u8>::zeroed_on(device, len).unwrap();
    assert_eq!(memory.device(), device);
    drop(
        stream
            .copy_to_device(src, &mut memory)
            .unwrap()
            .wait()
            .unwrap(),
    );
    let dst = PinnedVec::zeroed_in(len, allocator).unwrap();
    let dst = stream
        .copy_from_device(&memory, dst)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        dst[..] == data[..],
        "{len} bytes through device {} came back different",
        device.ordinal()
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_kind_round_trips_to_every_device_from_a_thread_on_another() {
    let len = (3 << 20) + 123;
    for device in devices() {
        let current = elsewhere(device);
        current.set_current().unwrap();
        round_trip_on(device, DefaultPinned, len);
        round_trip_on(device, CudaHost::new(), len);
        round_trip_on(device, Registered::new(), len);
        round_trip_on(device, Registered::new().register_in_chunks(1 << 20), len);
        round_trip_on(device, HostLocked, len);
        if device.supports_virtual_host_memory().unwrap() {
            round_trip_on(device, VirtualHost::new(), len);
        }
        assert_eq!(Device::current().unwrap(), current);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn no_call_changes_the_calling_threads_current_device() {
    for device in devices() {
        let current = elsewhere(device);
        current.set_current().unwrap();
        let unchanged = |call: &str| {
            assert_eq!(
                Device::current().unwrap(),
                current,
                "{call} on device {} changed the current device",
                device.ordinal()
            );
        };
        let stream = Stream::on(device).unwrap();
        unchanged("Stream::on");
        assert_eq!(stream.device(), device);
        let mut event = Event::on(device).unwrap();
        unchanged("Event::on");
        event.record(&stream).unwrap();
        unchanged("Event::record");
        let recorded = stream.record_event().unwrap();
        unchanged("Stream::record_event");
        assert_eq!(recorded.device(), device);
        recorded.synchronize().unwrap();
        assert!(recorded.elapsed_ms_since(&event).unwrap() >= 0.0);
        stream.launch_host_fn(|| {}).unwrap();
        unchanged("Stream::launch_host_fn");

        let mut memory = DeviceBuffer::<u32>::from_slice_on(device, &[1, 2, 3, 4]).unwrap();
        unchanged("DeviceBuffer::from_slice_on");
        memory.slice_mut(..2).set_bytes_async(0, &stream).unwrap();
        unchanged("DeviceSliceMut::set_bytes_async");
        let host = PinnedVec::from_slice(&[5u32, 6]).unwrap();
        let host = stream
            .copy_to_device(host, memory.slice_mut(2..))
            .unwrap()
            .wait()
            .unwrap();
        unchanged("Stream::copy_to_device");
        let back = stream
            .copy_from_device(&memory, PinnedVec::zeroed(4).unwrap())
            .unwrap()
            .wait()
            .unwrap();
        unchanged("Stream::copy_from_device");
        assert_eq!(&back[..], &[0, 0, 5, 6]);
        // SAFETY: both ranges are live, page-locked or device memory of this test, unused by
        // anything else until the stream is synchronised below.
        unsafe {
            stream
                .copy_batch_raw(&[RawCopy {
                    dst: memory.as_raw(),
                    src: host.as_ptr() as u64,
                    bytes: 8,
                }])
                .unwrap();
        }
        unchanged("Stream::copy_batch_raw");
        stream.synchronize().unwrap();
        memory.copy_from_host(&[7, 8, 9, 10]).unwrap();
        unchanged("DeviceBuffer::copy_from_host");
        assert_eq!(memory.to_vec().unwrap(), [7, 8, 9, 10]);
        unchanged("DeviceBuffer::to_vec");

        let stager = Stager::on(device).unwrap();
        unchanged("Stager::on");
        assert_eq!(stager.device(), device);
        let data = pattern(5 << 20, 9);
        let mut staged = DeviceBuffer::<u8>::zeroed_on(device, data.len()).unwrap();
        stager
            .copy_to_device(&stream, &data, &mut staged)
            .unwrap()
            .wait()
            .unwrap();
        unchanged("Stager::copy_to_device");
        let mut out = vec![0u8; data.len()];
        stager.copy_from_device(&stream, &staged, &mut out).unwrap();
        unchanged("Stager::copy_from_device");
        assert!(out == data, "staged round trip differs");

        let mut used = PinnedVec::from_slice(&[1u8; 64]).unwrap();
        used.record_stream(&stream);
        drop(used);
        unchanged("dropping a buffer used on the device's stream");
        drop((stager, staged, memory, recorded, event, stream));
        unchanged("dropping streams, events and device memory");
    }
}

/// Whether the calling thread has a current driver context.
fn has_context() -> bool {
    let get = cuda_pinned::sys::driver::driver()
        .unwrap()
        .cuCtxGetCurrent()
        .unwrap();
    let mut context = std::ptr::null_mut();
    // SAFETY: one out-pointer, valid for the call.
    let status = unsafe { get(&mut context) };
    assert_eq!(status, cuda_pinned::sys::driver::CUresult::CUDA_SUCCESS);
    !context.is_null()
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_thread_without_a_context_is_left_without_one() {
    let last = *devices().last().unwrap();
    std::thread::spawn(move || {
        assert!(!has_context());
        // Pinned memory of every CUDA kind, got, mapped and given back.
        let registered = PinnedVec::from_slice_in(&[3u8; 16], Registered::new()).unwrap();
        assert_ne!(registered.device_ptr().unwrap(), 0);
        drop(PinnedVec::from_slice_in(&[1u8; 16], CudaHost::new()).unwrap());
        if last.supports_virtual_host_memory().unwrap() {
            drop(PinnedVec::from_slice_in(&[2u8; 16], VirtualHost::new()).unwrap());
        }
        let stream = Stream::on(last).unwrap();
        let mut memory = DeviceBuffer::<u8>::zeroed_on(last, 16).unwrap();
        let registered = stream
            .copy_to_device(registered, &mut memory)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(memory.to_vec().unwrap(), [3u8; 16]);
        stream.synchronize().unwrap();
        assert!(stream.query().unwrap());
        let event = stream.record_event().unwrap();
        stream.wait_event(&event).unwrap();
        // Events are queried and waited for by the driver's calls, with no context current.
        event.synchronize().unwrap();
        assert!(event.query().unwrap());
        assert!(!has_context());
        drop((memory, stream, registered, event));
        assert!(
            !has_context(),
            "working on device {} left a context current",
            last.ordinal()
        );
        // The runtime's own choice for the thread is untouched: still its default, device 0.
        assert_eq!(Device::current().unwrap().ordinal(), 0);
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn mixing_devices_is_a_clear_error() {
    let all = devices();
    if all.len() < 2 {
        eprintln!("one device: nothing to mix");
        return;
    }
    let (a, b) = (all[0], all[1]);
    let on_b = Stream::on(b).unwrap();
    let mismatch = |result: Result<_, Error>| match result {
        Err(Error::DeviceMismatch {
            expected, found, ..
        }) => assert_eq!((expected, found), (a.ordinal(), b.ordinal())),
        other => panic!("expected a device mismatch, got {:?}", other.err()),
    };
    let mut event = Event::on(a).unwrap();
    mismatch(event.record(&on_b));
    let mut memory = DeviceBuffer::<u8>::zeroed_on(a, 16).unwrap();
    mismatch(
        on_b.copy_to_device(PinnedVec::<u8>::zeroed(16).unwrap(), &mut memory)
            .map(drop),
    );
    mismatch(
        Stager::on(a)
            .unwrap()
            .copy_to_device(&on_b, &[0u8; 16], &mut memory)
            .map(drop),
    );
    let late = on_b.record_event().unwrap();
    late.synchronize().unwrap();
    let early = Stream::on(a).unwrap().record_event().unwrap();
    early.synchronize().unwrap();
    // Timed against an event of device `a`: the end event's device (`b`) is the one needed.
    assert!(matches!(
        late.elapsed_ms_since(&early),
        Err(Error::DeviceMismatch { expected, found, .. })
            if (expected, found) == (b.ordinal(), a.ordinal())
    ));
}
