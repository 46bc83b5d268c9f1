//! Copies between device memory, windows of host buffers, and streams recorded on device
//! buffers (ignored without a device): data byte-exact, work ordered after its writers, memory
//! kept until its readers are done.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cuda_pinned::{Device, DeviceBuffer, Error, PinnedVec, RawCopy, Registered, Stream, Window};

use crate::copies::pattern;

/// Holds `stream` back for `ms` milliseconds; the flag turns true when it lets go.
fn hold(stream: &Stream, ms: u64) -> Arc<AtomicBool> {
    let released = Arc::new(AtomicBool::new(false));
    let flag = released.clone();
    stream
        .launch_host_fn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
    released
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_to_device_copies_whole_buffers_and_ranges() {
    let stream = Stream::new().unwrap();
    let data = pattern(1 << 20, 5);
    let src = DeviceBuffer::from_slice(&data).unwrap();
    let mut dst = DeviceBuffer::<u8>::zeroed(1 << 20).unwrap();
    stream.copy_device_to_device(&src, &mut dst).unwrap();
    stream.synchronize().unwrap();
    assert!(dst.to_vec().unwrap() == data);

    // Ranges at odd offsets and lengths, into the middle of another buffer.
    let mut middle = DeviceBuffer::<u8>::zeroed(10_000).unwrap();
    stream
        .copy_device_to_device(src.slice(4093..4093 + 5003), middle.slice_mut(997..6000))
        .unwrap();
    let back = middle.to_vec().unwrap();
    assert!(back[..997].iter().all(|&b| b == 0));
    assert_eq!(&back[997..6000], &data[4093..9096]);
    assert!(back[6000..].iter().all(|&b| b == 0));

    // An empty copy queues nothing and succeeds.
    stream
        .copy_device_to_device(src.slice(..0), middle.slice_mut(..0))
        .unwrap();
    let mismatch = stream.copy_device_to_device(src.slice(..3), middle.slice_mut(..4));
    assert!(matches!(
        mismatch,
        Err(Error::LengthsDiffer { src: 3, dst: 4 })
    ));
}

/// A device-to-device copy on one stream is ordered after an upload into its source on another
/// (held back), and a download on a third after the copy: no host wait in between.
#[test]
#[ignore = "needs a CUDA device"]
fn device_to_device_copies_are_ordered_after_their_writers() {
    let (writer, copier, reader) = (
        Stream::new().unwrap(),
        Stream::new().unwrap(),
        Stream::new().unwrap(),
    );
    let len = 8 << 20;
    let data = pattern(len, 11);
    let mut src = DeviceBuffer::<u8>::zeroed(len).unwrap();
    let mut dst = DeviceBuffer::<u8>::zeroed(len).unwrap();
    let released = hold(&writer, 300);
    let upload = writer
        .copy_to_device(PinnedVec::from_slice(&data).unwrap(), &mut src)
        .unwrap();
    copier.copy_device_to_device(&src, &mut dst).unwrap();
    let back = reader
        .copy_from_device(&dst, PinnedVec::<u8>::zeroed(len).unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        released.load(Ordering::SeqCst),
        "the download did not wait for the hold"
    );
    assert!(
        back.as_slice() == data,
        "the copy read its source before the upload ended"
    );
    upload.wait().unwrap();
}

/// Dropping the source of a pending device-to-device copy frees it only after the copy.
#[test]
#[ignore = "needs a CUDA device"]
fn a_device_to_device_copy_keeps_its_source_alive() {
    let stream = Stream::new().unwrap();
    let data = pattern(4 << 20, 17);
    let src = DeviceBuffer::from_slice(&data).unwrap();
    let mut dst = DeviceBuffer::<u8>::zeroed(4 << 20).unwrap();
    let released = hold(&stream, 200);
    stream.copy_device_to_device(&src, &mut dst).unwrap();
    drop(src);
    assert!(
        released.load(Ordering::SeqCst),
        "the source was freed under its copy"
    );
    assert!(dst.to_vec().unwrap() == data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_to_device_copies_between_devices() {
    if cuda_pinned::device_count().unwrap() < 2 {
        eprintln!("one device: skipped");
        return;
    }
    let (zero, one) = (Device::new(0).unwrap(), Device::new(1).unwrap());
    let data = pattern(3 << 20, 23);
    let src = DeviceBuffer::from_slice_on(zero, &data).unwrap();
    let mut dst = DeviceBuffer::<u8>::zeroed_on(one, 3 << 20).unwrap();
    for device in [zero, one] {
        let stream = Stream::on(device).unwrap();
        stream.copy_device_to_device(&src, &mut dst).unwrap();
        stream.synchronize().unwrap();
        assert!(
            dst.to_vec().unwrap() == data,
            "a copy on device {}",
            device.ordinal()
        );
    }
    if cuda_pinned::device_count().unwrap() >= 3 {
        let third = Stream::on(Device::new(2).unwrap()).unwrap();
        let refused = third.copy_device_to_device(&src, &mut dst);
        assert!(matches!(refused, Err(Error::DeviceMismatch { .. })));
    }
}

/// Windows of pinned buffers copy byte-exact at alignment edges and across the chunks of a
/// buffer registered in chunks, and the whole buffer comes back.
#[test]
#[ignore = "needs a CUDA device"]
fn windows_copy_ranges_at_chunk_and_alignment_edges() {
    let stream = Stream::new().unwrap();
    let mib = 1 << 20;
    let chunks = Registered::new().register_in_chunks(2 * mib);
    let data = pattern(7 * mib + 5, 29);
    let mut host = PinnedVec::from_slice_in(&data, chunks).unwrap();
    for (start, end) in [
        (0, 1),
        (1, 4097),
        (2 * mib - 3, 2 * mib + 5),
        (mib + 7, 5 * mib + 1),
        (0, 7 * mib + 5),
        (7 * mib + 5, 7 * mib + 5),
    ] {
        let mut device = DeviceBuffer::<u8>::zeroed(end - start).unwrap();
        let window = stream
            .copy_to_device(Window::new(host, start..end), &mut device)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(window.range(), start..end);
        host = window.into_inner();
        assert!(
            device.to_vec().unwrap() == data[start..end],
            "upload of {start}..{end}"
        );
        // Back into the same range of a zeroed buffer: the rest stays zero.
        let back = PinnedVec::<u8, _>::zeroed_in(data.len(), chunks).unwrap();
        let back = stream
            .copy_from_device(&device, Window::new(back, start..end))
            .unwrap()
            .wait()
            .unwrap()
            .into_inner();
        assert!(
            back[start..end] == data[start..end],
            "download of {start}..{end}"
        );
        assert!(back[..start].iter().chain(&back[end..]).all(|&b| b == 0));
    }
    assert_eq!(host.len(), data.len());
}

/// A window's buffer is kept until its copy ends, when the transfer is dropped unwaited.
#[test]
#[ignore = "needs a CUDA device"]
fn a_dropped_window_transfer_keeps_the_buffer_until_the_copy_ends() {
    let stream = Stream::new().unwrap();
    let data = pattern(4 << 20, 31);
    let mut device = DeviceBuffer::<u8>::zeroed(1 << 20).unwrap();
    let released = hold(&stream, 200);
    let host = PinnedVec::from_slice(&data).unwrap();
    drop(
        stream
            .copy_to_device(Window::new(host, 3 << 20..), &mut device)
            .unwrap(),
    );
    // Fresh pinned memory scribbled over: where the buffer's pages would go, had it been freed.
    let _scribble = PinnedVec::from_slice(&vec![0xEEu8; 4 << 20]).unwrap();
    assert!(device.to_vec().unwrap() == data[3 << 20..]);
    assert!(released.load(Ordering::SeqCst));
}

/// Work on a recorded stream, queued before or after `record_stream`, holds a device buffer:
/// a copy on another stream waits for it, and the buffer is freed only after it.
#[test]
#[ignore = "needs a CUDA device"]
fn recorded_streams_hold_a_device_buffer() {
    let (kernel, other) = (Stream::new().unwrap(), Stream::new().unwrap());
    let len = 2 << 20;
    let data = pattern(len, 37);
    let buffer = DeviceBuffer::from_slice(&data).unwrap();
    buffer.record_stream(&kernel).unwrap();
    // "A kernel" writing the buffer, queued after the record, behind a hold: a raw copy from
    // other device memory, standing in for work this crate cannot see.
    let released = hold(&kernel, 300);
    let zeros = DeviceBuffer::<u8>::zeroed(len).unwrap();
    zeros.record_stream(&kernel).unwrap();
    let write = RawCopy {
        dst: buffer.as_raw(),
        src: zeros.as_raw(),
        bytes: len,
    };
    // SAFETY: two device buffers of `len` bytes, kept until `kernel` has passed this copy
    // (both recorded it).
    unsafe { kernel.copy_batch_raw(&[write]).unwrap() };
    // A download on another stream is ordered after it: it sees the zeros.
    let back = other
        .copy_from_device(&buffer, PinnedVec::<u8>::zeroed(len).unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert!(released.load(Ordering::SeqCst));
    assert!(
        back.iter().all(|&b| b == 0),
        "the download ran before the recorded stream's work"
    );

    // Dropped while the recorded stream is held, the buffer waits for it.
    let released = hold(&kernel, 200);
    drop(buffer);
    assert!(
        released.load(Ordering::SeqCst),
        "freed while the recorded stream was busy"
    );
}
