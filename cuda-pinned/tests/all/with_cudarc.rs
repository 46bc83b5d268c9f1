//! cudarc's streams and device memory with this crate's buffers (the `cudarc` feature).
//! GPU tests are ignored without a device.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cuda_pinned::{CudarcCopies, Error, PinnedBox, PinnedVec, RegisteredVec, Stream};
use cudarc::driver::{CudaContext, CudaStream};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn cudarc_stream() -> Arc<CudaStream> {
    CudaContext::new(0).unwrap().new_stream().unwrap()
}

/// Holds `stream` back for `ms` milliseconds (a host function that sleeps), so work queued
/// behind it is still pending when the test looks.
fn block(stream: &Arc<CudaStream>, ms: u64) {
    Stream::from_cudarc(stream)
        .unwrap()
        .launch_host_fn(move || std::thread::sleep(Duration::from_millis(ms)))
        .unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn tracked_copies_round_trip_through_cudarc_memory() {
    let stream = cudarc_stream();
    for len in [0, 1, 4097, 64 << 20] {
        let data = pattern(len, 5);
        let mut first = stream.alloc_zeros::<u8>(len).unwrap();
        let upload = stream
            .copy_to_device(PinnedVec::from_slice(&data).unwrap(), &mut first)
            .unwrap();
        // A device-side copy by cudarc, ordered after the upload by cudarc's own events.
        let mut second = stream.alloc_zeros::<u8>(len).unwrap();
        stream.memcpy_dtod(&first, &mut second).unwrap();
        let download = stream
            .copy_from_device(&second, PinnedVec::zeroed(len).unwrap())
            .unwrap();
        let back = download.wait().unwrap();
        assert!(back.as_slice() == data.as_slice(), "{len} bytes differ");
        drop(upload.wait().unwrap());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_tracked_copy_returns_before_the_dma_and_keeps_the_buffer() {
    let stream = cudarc_stream();
    let data = pattern(8 << 20, 9);
    let mut device = stream.alloc_zeros::<u8>(data.len()).unwrap();
    let blocked = Instant::now();
    block(&stream, 300);
    let upload = stream
        .copy_to_device(PinnedVec::from_slice(&data).unwrap(), &mut device)
        .unwrap();
    // The copy queues behind the host function: done only if this thread was held up as long.
    if upload.is_done().unwrap() {
        assert!(blocked.elapsed() >= Duration::from_millis(300));
    }
    let buffer = upload.wait().unwrap();
    assert_eq!(stream.clone_dtoh(&device).unwrap(), data);
    assert!(buffer.as_slice() == data.as_slice());
}

#[test]
#[ignore = "needs a CUDA device"]
fn tracked_copies_refuse_lengths_that_differ() {
    let stream = cudarc_stream();
    let mut device = stream.alloc_zeros::<u32>(10).unwrap();
    let error = stream
        .copy_to_device(PinnedVec::from_slice(&[1u32; 9]).unwrap(), &mut device)
        .unwrap_err();
    assert!(matches!(
        error,
        Error::LengthMismatch {
            host: 9,
            device: 10
        }
    ));
    let error = stream
        .copy_from_device(&device.slice(..4), PinnedVec::<u32>::zeroed(5).unwrap())
        .unwrap_err();
    assert!(matches!(
        error,
        Error::LengthMismatch { host: 5, device: 4 }
    ));
}

/// Through cudarc's `[T]` path a copy from page-locked memory returns with the DMA pending
/// (cudarc assumes pageable memory), which is why this crate's buffers are not cudarc
/// `HostSlice`s; a tracked copy waited for at once is the blocking copy, and a write after it
/// does not reach the device.
#[test]
#[ignore = "needs a CUDA device"]
fn blocking_copies_through_cudarc_are_tracked_copies_waited_for() {
    let stream = cudarc_stream();
    let data = pattern(8 << 20, 1);
    let mut device = stream.alloc_zeros::<u8>(data.len()).unwrap();

    let blocked = Instant::now();
    block(&stream, 200);
    let pinned = PinnedVec::from_slice(&data).unwrap();
    let mut pinned = stream
        .copy_to_device(pinned, &mut device)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        blocked.elapsed() >= Duration::from_millis(200),
        "returned before the copy"
    );
    pinned.fill(0xFF); // after the copy: must not reach the device
    assert_eq!(stream.clone_dtoh(&device).unwrap(), data);

    // The hazard: through `[T]` the call returns with the DMA pending, so a write finished
    // before the host function ends reaches the device.
    let mut racing = PinnedVec::from_slice(&data).unwrap();
    let blocked = Instant::now();
    block(&stream, 200);
    stream.memcpy_htod(&racing[..], &mut device).unwrap();
    racing.fill(0xFF);
    let written_before_the_copy = blocked.elapsed() < Duration::from_millis(200);
    let arrived = stream.clone_dtoh(&device).unwrap();
    eprintln!(
        "through `[T]`: written before the copy: {written_before_the_copy}, reached the \
         device: {}",
        arrived != data
    );
    if written_before_the_copy {
        assert!(
            arrived.iter().all(|&byte| byte == 0xFF),
            "through `[T]` the write after the call was expected to reach the device"
        );
    }

    // Into page-locked memory (a box, a registered vector): the data is there once waited.
    let source = stream.clone_htod(&data).unwrap();
    block(&stream, 200);
    let back = stream
        .copy_from_device(&source, PinnedVec::<u8>::zeroed(data.len()).unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert!(back.as_slice() == data.as_slice());
    let registered = RegisteredVec::new(vec![7u64; 1 << 20]).unwrap();
    let mut longs = stream.alloc_zeros::<u64>(1 << 20).unwrap();
    let registered = stream
        .copy_to_device(registered, &mut longs)
        .unwrap()
        .wait()
        .unwrap();
    let one = stream
        .copy_from_device(&longs.slice(..1), PinnedBox::new(0u64).unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((*one, registered[0]), (7, 7));
}

#[test]
#[ignore = "needs a CUDA device"]
fn adopted_streams_order_work_and_record_uses() {
    let cudarc_stream = cudarc_stream();
    // Ours, adopted from cudarc: work queued on either side runs in one order.
    let ours = Stream::from_cudarc(&cudarc_stream).unwrap();
    assert_eq!(ours.as_raw(), cudarc_stream.cu_stream().cast());
    // SAFETY: the raw handle is the cudarc stream's, alive for this test.
    let borrowed = unsafe { Stream::from_raw(cudarc_stream.cu_stream().cast()) }.unwrap();
    assert_eq!(borrowed, ours);

    let data = pattern(1 << 20, 4);
    let mut device = cuda_pinned::DeviceBuffer::<u8>::zeroed(data.len()).unwrap();
    let blocked = Instant::now();
    block(&cudarc_stream, 200);
    let upload = ours
        .copy_to_device(PinnedVec::from_slice(&data).unwrap(), &mut device)
        .unwrap();
    if upload.is_done().unwrap() {
        assert!(
            blocked.elapsed() >= Duration::from_millis(200),
            "ran before cudarc's work"
        );
    }
    upload.wait().unwrap();
    assert_eq!(device.to_vec().unwrap(), data);

    // cudarc's default and per-thread streams name a different stream on every device or
    // thread: they cannot be adopted, but tracked copies run on them.
    let ctx = CudaContext::new(0).unwrap();
    for stream in [ctx.default_stream(), ctx.per_thread_stream()] {
        assert!(matches!(
            Stream::from_cudarc(&stream),
            Err(Error::Unsupported(_))
        ));
        let mut device = stream.alloc_zeros::<u8>(data.len()).unwrap();
        let upload = stream
            .copy_to_device(PinnedVec::from_slice(&data).unwrap(), &mut device)
            .unwrap();
        upload.wait().unwrap();
        assert_eq!(stream.clone_dtoh(&device).unwrap(), data);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn tracked_copies_refuse_memory_of_another_device_and_keep_the_current_one() {
    let devices = CudaContext::device_count().unwrap();
    let last = (devices - 1) as usize;
    let here = cudarc_stream();
    let there = CudaContext::new(last).unwrap().new_stream().unwrap();
    let mut memory = there.alloc_zeros::<u8>(16).unwrap();
    // The calling thread is on device 0 whichever device the copy goes to.
    cuda_pinned::Device::new(0).unwrap().set_current().unwrap();
    let upload = there
        .copy_to_device(PinnedVec::from_slice(&[7u8; 16]).unwrap(), &mut memory)
        .unwrap();
    drop(upload.wait().unwrap());
    assert_eq!(cuda_pinned::Device::current().unwrap().ordinal(), 0);
    assert_eq!(there.clone_dtoh(&memory).unwrap(), [7u8; 16]);
    if devices < 2 {
        eprintln!("one device: nothing to mix");
        return;
    }
    let error = here
        .copy_to_device(PinnedVec::from_slice(&[1u8; 16]).unwrap(), &mut memory)
        .unwrap_err();
    assert!(
        matches!(error, Error::DeviceMismatch { expected: 0, found, .. } if found == last),
        "{error:?}"
    );
}

/// Set for the child process that runs the capture test alone.
const ALONE: &str = "CUDA_PINNED_TEST_ALONE";

/// Work queued on a stream that captures a graph runs at each launch of the graph, after the
/// host memory lent for a call may be gone and when events recorded now say nothing: the
/// crate's copies and tracked work refuse such a stream before queueing anything, and the
/// capture goes on unharmed. Run alone in a child process: while a stream captures, other
/// threads' device-wide synchronization fails, and invalidates the capture.
#[test]
#[ignore = "needs a CUDA device"]
fn copies_and_tracked_work_on_a_stream_capturing_a_graph_are_refused() {
    run_alone("with_cudarc::copies_and_tracked_work_on_a_capturing_stream_alone");
}

/// Runs `test` of this binary in a child process of its own, where no other test's CUDA
/// calls meet its capture.
fn run_alone(test: &str) {
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--include-ignored", "--exact", test])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&child.stdout);
    let err = String::from_utf8_lossy(&child.stderr);
    assert!(
        child.status.success(),
        "{test}: {}\n{out}\n{err}",
        child.status
    );
    assert!(out.contains("1 passed"), "{test} did not run:\n{out}");
}

/// The test above, when run in its own process.
#[test]
#[ignore = "needs a CUDA device"]
fn copies_and_tracked_work_on_a_capturing_stream_alone() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    if std::env::var_os(ALONE).is_none() {
        return;
    }
    let stager = cuda_pinned::Stager::new().unwrap();
    let stream = cudarc_stream();
    let ours = Stream::from_cudarc(&stream).unwrap();
    let mut device = cuda_pinned::DeviceBuffer::<u8>::zeroed(64 << 10).unwrap();
    let mut theirs = stream.alloc_zeros::<u8>(4096).unwrap();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refused = |result: Result<(), Error>, what: &str| {
        assert!(
            matches!(result, Err(Error::Capturing)),
            "{what}: {result:?}"
        );
    };
    // A refused tracked copy frees its page-locked buffer meanwhile, which a capture in
    // thread-local or global mode would forbid this thread but for the crate's relaxed mode.
    for mode in [
        CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
    ] {
        stream.begin_capture(mode).unwrap();
        assert!(ours.is_capturing().unwrap());
        // 4 KiB: the driver's path where it holds; 64 KiB: the ring.
        for len in [4 << 10, 64 << 10] {
            let data = pattern(len, 3);
            let upload = stager.copy_to_device(&ours, &data, device.slice_mut(..len));
            refused(upload.map(drop), "staged upload");
            let mut back = vec![7u8; len];
            let download = stager.copy_from_device(&ours, device.slice(..len), &mut back);
            refused(download, "staged download");
            assert!(back.iter().all(|&b| b == 7), "the destination was written");
        }
        {
            let pinned = PinnedVec::from_slice(&pattern(4096, 1)).unwrap();
            let transfer = ours.copy_to_device(pinned, device.slice_mut(..4096));
            refused(transfer.map(drop), "tracked copy");
            let pinned = PinnedVec::from_slice(&pattern(4096, 1)).unwrap();
            let transfer = stream.copy_to_device(pinned, &mut theirs);
            refused(transfer.map(drop), "tracked copy into cudarc memory");
            // A buffer marked as used on the stream and freed meanwhile is kept for good,
            // without waiting for the stream (which would break the capture).
            let mut used = PinnedVec::from_slice(&pattern(4096, 2)).unwrap();
            used.record_stream(&ours);
            drop(used);
            let mut registered = RegisteredVec::new(pattern(4096, 3)).unwrap();
            registered.record_stream(&ours);
            assert!(matches!(registered.into_inner(), Err(Error::Capturing)));
            let host = PinnedVec::from_slice(&pattern(4096, 4)).unwrap();
            let copy = cuda_pinned::RawCopy {
                dst: device.as_raw(),
                src: host.as_ptr() as u64,
                bytes: 4096,
            };
            // SAFETY: both ranges are live and 4096 bytes long; were the copy queued, it
            // would be waited for below.
            let batch = unsafe { ours.copy_batch_raw(&[copy]) };
            refused(batch, "raw batch");
        }
        let flag = ran.clone();
        let host_fn = ours.launch_host_fn(move || flag.store(true, Ordering::SeqCst));
        refused(host_fn, "host function");
        assert_eq!(
            Arc::strong_count(&ran),
            1,
            "the refused host function was kept"
        );
        refused(
            device.slice_mut(..).set_bytes_async(1, &ours),
            "tracked memset",
        );
        // Nothing was queued or waited on: the capture is intact.
        stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    }
    // Outside a capture the same calls run.
    let data = pattern(64 << 10, 9);
    stager
        .copy_to_device(&ours, &data, &mut device)
        .unwrap()
        .wait()
        .unwrap();
    let mut back = vec![0u8; 64 << 10];
    stager.copy_from_device(&ours, &device, &mut back).unwrap();
    assert!(!ran.load(Ordering::SeqCst), "the refused host function ran");
    assert!(back == data);
}

/// While a thread captures a graph in global mode (cudarc's default and CUDA's), CUDA refuses
/// every other thread's waits, queries and allocations, and each refusal invalidates the
/// capture; the capturing thread's own calls too. This crate makes those calls in relaxed
/// mode: blocking and tracked copies, staged copies, allocations and frees all run meanwhile,
/// a blocking copy into page-locked memory returns with it filled, and the capture ends
/// intact. (Before, a blocking copy's wait was refused and it returned while the DMA still
/// wrote the borrowed memory.)
#[test]
#[ignore = "needs a CUDA device"]
fn copies_wait_and_allocate_while_a_graph_is_captured_in_global_mode() {
    run_alone("with_cudarc::copies_wait_and_allocate_during_a_global_capture_alone");
}

/// The test above, when run in its own process.
#[test]
#[ignore = "needs a CUDA device"]
fn copies_wait_and_allocate_during_a_global_capture_alone() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use std::sync::mpsc;
    if std::env::var_os(ALONE).is_none() {
        return;
    }
    let stager = cuda_pinned::Stager::new().unwrap();
    let ours = Stream::new().unwrap();
    // Begins a capture in global mode; ends it, telling whether it held. (It takes in no
    // work: cudarc's own calls would wait on events recorded before it, which ends it.)
    let begin = || {
        let stream = cudarc_stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        stream
    };
    let end = |stream: Arc<CudaStream>| {
        stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map(|graph| graph.is_some())
    };
    for same_thread in [false, true] {
        let (ending, ended) = mpsc::channel::<()>();
        let (capture, capturer) = if same_thread {
            (Some(begin()), None)
        } else {
            let (began, begun) = mpsc::channel();
            let capturer = std::thread::spawn(move || {
                let capture = begin();
                began.send(()).unwrap();
                // Ended whatever happens to the test, so no capture outlives it.
                let _ = ended.recv();
                end(capture)
            });
            begun.recv().unwrap();
            (None, Some(capturer))
        };
        const LEN: usize = 256 << 20;
        let data = pattern(LEN, 9);
        // Page-locked and device memory allocated, a blocking upload from ordinary memory.
        let mut host = PinnedVec::<u8>::zeroed(LEN).unwrap();
        let device = cuda_pinned::DeviceBuffer::from_slice(&data).unwrap();
        // A blocking download into page-locked memory returns with it filled.
        device.copy_to_host(&mut host).unwrap();
        assert!(host[..] == data[..], "the blocking download returned early");
        // A tracked upload, waited for, and a download into ordinary memory.
        let mut second = cuda_pinned::DeviceBuffer::<u8>::zeroed(LEN).unwrap();
        let host = ours
            .copy_to_device(host, &mut second)
            .unwrap()
            .wait()
            .unwrap();
        assert!(second.to_vec().unwrap() == data);
        // Staged copies: an upload slot's size and the ring's.
        for len in [4 << 10, 64 << 20] {
            let seed = len as u8 ^ 0x5a;
            let part = pattern(len, seed);
            stager
                .copy_to_device(&ours, &part, second.slice_mut(..len))
                .unwrap()
                .wait()
                .unwrap();
            let mut back = vec![0u8; len];
            stager
                .copy_from_device(&ours, second.slice(..len), &mut back)
                .unwrap();
            assert!(back == part, "staged round trip of {len} bytes");
        }
        drop((host, second, device));
        let held = match (capture, capturer) {
            (Some(capture), _) => end(capture),
            (None, Some(capturer)) => {
                ending.send(()).unwrap();
                capturer.join().unwrap()
            }
            (None, None) => unreachable!(),
        };
        assert!(
            held.is_ok(),
            "the capture (same thread: {same_thread}) was invalidated: {held:?}"
        );
    }
}

/// This crate's device memory and cudarc's copy into each other on a cudarc stream, ordered
/// after the writers on both sides: an upload on a stream of ours (held back) before the copy
/// into cudarc's memory, and a copy back after cudarc's own.
#[test]
#[ignore = "needs a CUDA device"]
fn device_buffers_and_cudarc_memory_copy_into_each_other_in_order() {
    let cudarc = cudarc_stream();
    let ours = Stream::new().unwrap();
    let len = 8 << 20;
    let data = pattern(len, 13);
    let mut buffer = cuda_pinned::DeviceBuffer::<u8>::zeroed(len).unwrap();
    block_ours(&ours, 300);
    let upload = ours
        .copy_to_device(PinnedVec::from_slice(&data).unwrap(), &mut buffer)
        .unwrap();
    let mut theirs = cudarc.alloc_zeros::<u8>(len).unwrap();
    cudarc.copy_device_to_cudarc(&buffer, &mut theirs).unwrap();
    assert_eq!(
        cudarc.clone_dtoh(&theirs).unwrap(),
        data,
        "cudarc's copy ran before the upload"
    );

    // cudarc writes its memory, then it comes back into a range of ours.
    let ones = cudarc.clone_htod(&vec![1u8; 4096]).unwrap();
    cudarc
        .memcpy_dtod(&ones, &mut theirs.slice_mut(..4096))
        .unwrap();
    let mut back = cuda_pinned::DeviceBuffer::<u8>::zeroed(4096 + 7).unwrap();
    cudarc
        .copy_cudarc_to_device(&theirs.slice(..4096), back.slice_mut(7..))
        .unwrap();
    let back = back.to_vec().unwrap();
    assert!(back[..7].iter().all(|&b| b == 0) && back[7..].iter().all(|&b| b == 1));

    let refused = cudarc.copy_device_to_cudarc(&buffer, &mut ones.clone());
    assert!(matches!(refused, Err(Error::LengthsDiffer { src, dst: 4096 }) if src == len));
    upload.wait().unwrap();
}

/// A buffer of ours that a cudarc copy reads, dropped at once, is freed only after the copy.
#[test]
#[ignore = "needs a CUDA device"]
fn a_device_buffer_read_by_a_cudarc_copy_outlives_it() {
    let cudarc = cudarc_stream();
    let data = pattern(4 << 20, 19);
    let buffer = cuda_pinned::DeviceBuffer::from_slice(&data).unwrap();
    let mut theirs = cudarc.alloc_zeros::<u8>(data.len()).unwrap();
    block(&cudarc, 200);
    cudarc.copy_device_to_cudarc(&buffer, &mut theirs).unwrap();
    drop(buffer);
    // Fresh device memory scribbled over, where the freed buffer's pages would go.
    let _scribble = cuda_pinned::DeviceBuffer::from_slice(&vec![0xEEu8; 4 << 20]).unwrap();
    assert_eq!(cudarc.clone_dtoh(&theirs).unwrap(), data);
}

/// Holds a stream of ours back for `ms` milliseconds.
fn block_ours(stream: &Stream, ms: u64) {
    stream
        .launch_host_fn(move || std::thread::sleep(Duration::from_millis(ms)))
        .unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_stager_copies_to_and_from_cudarc_memory_on_its_streams_per_thread_ones_too() {
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stager = cuda_pinned::Stager::new().unwrap();
    for stream in [ctx.new_stream().unwrap(), ctx.per_thread_stream()] {
        for len in [5usize, 40_000, 3 << 20] {
            let data: Vec<u16> = (0..len).map(|i| (i * 31 + len) as u16).collect();
            // SAFETY: filled by the copy below before anything reads it.
            let mut slice = unsafe { stream.alloc::<u16>(len) }.unwrap();
            let _copy = stager.copy_to_cudarc(&stream, &data, &mut slice).unwrap();
            // cudarc's own copy on the same stream sees it.
            assert_eq!(stream.clone_dtoh(&slice).unwrap(), data, "{len}");
            let mut back = vec![0u16; len];
            stager.copy_from_cudarc(&stream, &slice, &mut back).unwrap();
            assert_eq!(back, data, "{len}");
        }
        let mut short = stream.alloc_zeros::<u16>(3).unwrap();
        let error = stager
            .copy_to_cudarc(&stream, &[1u16; 4], &mut short)
            .unwrap_err();
        assert!(
            matches!(error, cuda_pinned::Error::LengthMismatch { .. }),
            "{error}"
        );
    }
    ctx.check_err().unwrap();
}
