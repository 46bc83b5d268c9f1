//! Copies from and into ordinary memory through the staging ring (ignored without a device).

use std::time::{Duration, Instant};

use cuda_pinned::{
    CudaHost, DefaultPinned, DeviceBuffer, PinnedVec, Registered, Stager, StagingConfig, Stream,
    VirtualHost,
};

/// A stager without upload slots: small uploads take the driver's path (or the ring).
fn without_upload_slots() -> Stager {
    let config = StagingConfig {
        upload_slots: 0,
        ..StagingConfig::default()
    };
    Stager::with_config_in(config, DefaultPinned).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(41).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn round_trips_at_chunk_edges_and_a_gibibyte() {
    let stager = Stager::new().unwrap();
    let stream = Stream::new().unwrap();
    let chunk = stager.config().chunk_bytes;
    // Both sides of each edge of the driver's path (16 KiB, 128 KiB, 4 MiB) and of the
    // ring's chunks.
    let sizes = [
        0,
        1,
        16 << 10,
        (16 << 10) + 1,
        64 << 10,
        (128 << 10) - 1,
        128 << 10,
        4 << 20,
        (4 << 20) + 1,
        chunk - 1,
        chunk + 1,
        3 * chunk + 17,
        1 << 30,
    ];
    for len in sizes {
        let data = pattern(len, len as u8);
        let mut device = DeviceBuffer::<u8>::zeroed(len).unwrap();
        stager
            .copy_to_device(&stream, &data, &mut device)
            .unwrap()
            .wait()
            .unwrap();
        let mut back = vec![0u8; len];
        stager
            .copy_from_device(&stream, &device, &mut back)
            .unwrap();
        assert!(back == data, "{len} bytes differ after the round trip");
        // The device really holds it (read back through the driver's own path).
        if len <= 1 << 20 {
            assert_eq!(device.to_vec().unwrap(), data);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn typed_elements_and_odd_configurations() {
    let stream = Stream::new().unwrap();
    let config = StagingConfig {
        chunk_bytes: 4096 + 8,
        threads: 3,
        chunks: 2,
        single_thread_bytes: 0,
        min_piece_bytes: 1000,
        driver_uploads: Vec::new(),
        driver_downloads: Vec::new(),
        upload_slot_bytes: 0,
        upload_slots: 0,
        // Chunks of 4104 bytes: downloads start their streaming stores unaligned.
        streaming_stores: true,
    };
    let stager = Stager::with_config_in(config, cuda_pinned::CudaHost::new()).unwrap();
    let data: Vec<f64> = (0..100_003).map(|i| i as f64 * 0.5).collect();
    let mut device = DeviceBuffer::<f64>::zeroed(data.len()).unwrap();
    stager
        .copy_to_device(&stream, &data, device.slice_mut(..))
        .unwrap()
        .wait()
        .unwrap();
    let mut back = vec![0.0f64; 50_000];
    stager
        .copy_from_device(&stream, device.slice(1000..51_000), &mut back)
        .unwrap();
    assert!(back == data[1000..51_000]);
    let mismatch = stager.copy_from_device(&stream, &device, &mut back);
    assert!(matches!(
        mismatch,
        Err(cuda_pinned::Error::LengthMismatch {
            host: 50_000,
            device: 100_003
        })
    ));
}

/// The upload returns once the source has been read: changing it right after does not change
/// what arrives, even though the DMA is held back behind other work.
#[test]
#[ignore = "needs a CUDA device"]
fn the_source_may_change_as_soon_as_the_upload_returns() {
    let stager = Stager::new().unwrap();
    let stream = Stream::new().unwrap();
    // Upload slots (1000 bytes, 32 KiB), the driver's path (256 KiB) and the ring (96 KiB:
    // one chunk on this thread; 64 MiB: spread over the workers).
    for len in [1000, 32 << 10, 96 << 10, 256 << 10, 64 << 20] {
        let original = pattern(len, 9);
        let mut source = original.clone();
        let mut device = DeviceBuffer::<u8>::zeroed(len).unwrap();
        let blocked = Instant::now();
        stream
            .launch_host_fn(|| std::thread::sleep(Duration::from_millis(300)))
            .unwrap();
        let upload = stager
            .copy_to_device(&stream, &source, &mut device)
            .unwrap();
        source.fill(0xFF);
        drop(source);
        if upload.is_done().unwrap() {
            assert!(blocked.elapsed() >= Duration::from_millis(300));
        }
        upload.wait().unwrap();
        assert!(device.to_vec().unwrap() == original, "{len} bytes");
    }
}

/// Uploads `source` behind 200 ms of other work on the stream, overwrites it as soon as the
/// upload returns, and checks that what it held when the upload was called arrives.
fn arrives_as_it_was_when_the_upload_returned(
    stager: &Stager,
    stream: &Stream,
    source: &mut [u8],
    what: &str,
) {
    let original = source.to_vec();
    let mut device = DeviceBuffer::<u8>::zeroed(source.len()).unwrap();
    stream
        .launch_host_fn(|| std::thread::sleep(Duration::from_millis(200)))
        .unwrap();
    let upload = stager.copy_to_device(stream, source, &mut device).unwrap();
    source.fill(0xFF);
    upload.wait().unwrap();
    assert!(
        device.to_vec().unwrap() == original,
        "{what}, {} bytes",
        source.len()
    );
}

fn takes_the_drivers_path(stager: &Stager, len: usize) -> bool {
    stager.driver_uploads_taken()
        && stager
            .config()
            .driver_uploads
            .iter()
            .any(|r| r.contains(&len))
}

fn downloads_take_the_drivers_path(stager: &Stager, len: usize) -> bool {
    stager.driver_downloads_taken()
        && stager
            .config()
            .driver_downloads
            .iter()
            .any(|r| r.contains(&len))
}

/// Downloads into `into` behind 200 ms of other work on the stream, and checks that `into`
/// holds the device's data as soon as the download returns.
fn filled_when_the_download_returns(stager: &Stager, stream: &Stream, into: &mut [u8], what: &str) {
    let original = pattern(into.len(), 5);
    let device = DeviceBuffer::from_slice(&original).unwrap();
    into.fill(0);
    stream
        .launch_host_fn(|| std::thread::sleep(Duration::from_millis(200)))
        .unwrap();
    stager.copy_from_device(stream, &device, into).unwrap();
    assert!(into == &original[..], "{what}, {} bytes", into.len());
}

/// Page-locked sources of sizes the driver's path takes, of every kind: a `cudaMemcpyAsync`
/// from them would return before reading them, so they go through the ring, and changing
/// them right after the upload returns still does not change what arrives.
#[test]
#[ignore = "needs a CUDA device"]
fn a_page_locked_source_is_read_before_the_upload_returns() {
    let stager = without_upload_slots();
    let stream = Stream::new().unwrap();
    for len in [4 << 10, 256 << 10] {
        assert!(takes_the_drivers_path(&stager, len));
        let original = pattern(len, 3);
        let mut host = PinnedVec::<u8, _>::with_capacity_in(len, CudaHost::new()).unwrap();
        host.extend_from_slice(&original);
        arrives_as_it_was_when_the_upload_returned(&stager, &stream, &mut host, "cudaHostAlloc");
        let mut registered = PinnedVec::<u8, _>::with_capacity_in(len, Registered::new()).unwrap();
        registered.extend_from_slice(&original);
        arrives_as_it_was_when_the_upload_returned(&stager, &stream, &mut registered, "registered");
        if stager.device().supports_virtual_host_memory().unwrap() {
            let mut mapped = PinnedVec::<u8, _>::with_capacity_in(len, VirtualHost::new()).unwrap();
            mapped.extend_from_slice(&original);
            arrives_as_it_was_when_the_upload_returned(
                &stager,
                &stream,
                &mut mapped,
                "virtual host",
            );
        }
    }
}

/// Registers `len` bytes at `start` with CUDA until dropped. The memory stays owned, and
/// written, through the slice it lies in: registering only pins its pages.
struct RawRegistration(*mut u8);

impl RawRegistration {
    fn new(memory: &mut [u8], start: usize, len: usize) -> Self {
        let at = memory[start..start + len].as_mut_ptr();
        let register = cuda_pinned::sys::cudart()
            .unwrap()
            .cudaHostRegister()
            .unwrap();
        // SAFETY: `at` is valid for `len` bytes, and the memory outlives the registration
        // (each test drops it first).
        let status = unsafe { register(at.cast(), len, 0) };
        assert_eq!(status, cuda_pinned::sys::cudaError::cudaSuccess);
        Self(at)
    }
}

impl Drop for RawRegistration {
    fn drop(&mut self) {
        let unregister = cuda_pinned::sys::cudart()
            .and_then(|runtime| runtime.cudaHostUnregister())
            .expect("the runtime registered it");
        // SAFETY: `self.0` was registered by `new` and not since unregistered.
        let status = unsafe { unregister(self.0.cast()) };
        if !std::thread::panicking() {
            assert_eq!(status, cuda_pinned::sys::cudaError::cudaSuccess);
        }
    }
}

/// The driver decides by the source's first byte, looked up by byte: a source that starts in
/// ordinary memory is staged before the upload returns even when registered memory shares its
/// first and last pages, lies inside it, or holds its end, wherever in the source that memory
/// begins (should the driver cut a large copy into pieces and look each up, a registration
/// starting at a piece's start would be read late). So the driver's path, which looks only at
/// the first byte, is taken for all of them and still reads the source in time.
#[test]
#[ignore = "needs a CUDA device"]
fn a_source_starting_in_ordinary_memory_is_read_before_the_upload_returns() {
    let stager = without_upload_slots();
    let stream = Stream::new().unwrap();
    if reads_pageable_memory() {
        eprintln!("this device reads ordinary memory itself: the driver's path is never taken");
        return;
    }
    for len in [12 << 10, 256 << 10, 4 << 20] {
        assert!(takes_the_drivers_path(&stager, len));
        let mut memory = vec![0u8; len + 4 * PAGE];
        let (start, cases) = registered_around(&memory, len);
        for (what, registrations) in cases {
            let _registered: Vec<_> = registrations
                .into_iter()
                .map(|(at, bytes)| RawRegistration::new(&mut memory, at, bytes))
                .collect();
            let source = &mut memory[start..start + len];
            source.copy_from_slice(&pattern(len, 7));
            arrives_as_it_was_when_the_upload_returned(&stager, &stream, source, &what);
        }
    }
}

/// As for uploads, a destination that starts in ordinary memory is filled before the
/// download returns, whatever registered memory lies around, inside or at the end of it:
/// the driver's path, which looks only at the first byte, is taken for all of them.
#[test]
#[ignore = "needs a CUDA device"]
fn a_destination_starting_in_ordinary_memory_is_filled_before_the_download_returns() {
    let stager = Stager::new().unwrap();
    let stream = Stream::new().unwrap();
    if reads_pageable_memory() {
        eprintln!("this device reads ordinary memory itself: the driver's path is never taken");
        return;
    }
    for len in [12 << 10, 16 << 10] {
        assert!(downloads_take_the_drivers_path(&stager, len));
        let mut memory = vec![0u8; len + 4 * PAGE];
        let (start, cases) = registered_around(&memory, len);
        for (what, registrations) in cases {
            let _registered: Vec<_> = registrations
                .into_iter()
                .map(|(at, bytes)| RawRegistration::new(&mut memory, at, bytes))
                .collect();
            let into = &mut memory[start..start + len];
            filled_when_the_download_returns(&stager, &stream, into, &what);
        }
    }
}

/// A destination that starts in registered memory and ends past it, which the driver's call
/// would take and leave unfilled on return (below 8 KiB) or refuse, goes through the ring and
/// is filled before the download returns.
#[test]
#[ignore = "needs a CUDA device"]
fn a_destination_starting_in_a_registration_is_filled_before_the_download_returns() {
    let stager = Stager::new().unwrap();
    let stream = Stream::new().unwrap();
    for len in [4 << 10, 6 << 10, 16 << 10] {
        let mut memory = vec![0u8; len + 4 * PAGE];
        let start = PAGE - (memory.as_ptr() as usize % PAGE) + PAGE / 2;
        let _registered = RawRegistration::new(&mut memory, start - 1024, 3 << 10);
        let into = &mut memory[start..start + len];
        filled_when_the_download_returns(&stager, &stream, into, "its first 2 KiB registered");
    }
}

/// The driver's paths are checked on the device as the first stager is made: on a device
/// that does not read ordinary memory itself, the driver's calls pass the check.
#[test]
#[ignore = "needs a CUDA device"]
fn the_drivers_paths_pass_their_check_where_the_driver_stages() {
    let stager = Stager::new().unwrap();
    let staged = !reads_pageable_memory();
    assert_eq!(stager.driver_uploads_taken(), staged);
    assert_eq!(stager.driver_downloads_taken(), staged);
    // Without sizes for the driver, nothing is checked or taken.
    let ring_only = cuda_pinned::StagingConfig {
        driver_uploads: Vec::new(),
        driver_downloads: Vec::new(),
        ..Default::default()
    };
    let stager = Stager::with_config_in(ring_only, cuda_pinned::DefaultPinned).unwrap();
    assert!(!stager.driver_uploads_taken() && !stager.driver_downloads_taken());
}

const PAGE: usize = 4096;

/// What a case is called, and the `(start, bytes)` ranges it registers.
type Case = (String, Vec<(usize, usize)>);

/// Where in `memory` (of `len` + 4 pages) host memory of `len` bytes starts (half a page into
/// its second page, ending half a page into its last), and ranges to register around it:
/// bytes in its first and last pages, a page inside it, its end, and from points inside it
/// past its end (at the starts of pieces of the sizes a driver might cut a copy into, and at
/// page starts).
fn registered_around(memory: &[u8], len: usize) -> (usize, Vec<Case>) {
    let start = PAGE - (memory.as_ptr() as usize % PAGE) + PAGE / 2;
    let end = start + len;
    let mut cases: Vec<Case> = vec![
        (
            "registered bytes in its first and last pages".into(),
            vec![(start - PAGE / 2, PAGE / 2), (end, PAGE / 2)],
        ),
        (
            "a page registered inside it".into(),
            vec![(start + PAGE / 2, PAGE)],
        ),
        (
            "its end inside a registration".into(),
            vec![(end - 1024, 2 * PAGE)],
        ),
    ];
    for from in [2 << 10, 32 << 10, 64 << 10, 128 << 10, 1 << 20, 2 << 20] {
        if from < len {
            cases.push((
                format!("a registration from byte {from} past its end"),
                vec![(start + from, len - from + PAGE)],
            ));
            let page = (start + from).next_multiple_of(PAGE) - start;
            if page == from {
                continue;
            }
            cases.push((
                format!("a registration from the page at byte {page} past its end"),
                vec![(start + page, len - page + PAGE)],
            ));
        }
    }
    (start, cases)
}

/// Whether the current device reads ordinary memory itself (HMM, ATS): then every upload goes
/// through the ring.
fn reads_pageable_memory() -> bool {
    let runtime = cuda_pinned::sys::cudart().unwrap();
    let device = cuda_pinned::Device::current().unwrap().ordinal() as i32;
    let mut access = 0;
    // SAFETY: `access` is valid for the write.
    let status = unsafe {
        runtime.cudaDeviceGetAttribute().unwrap()(
            &mut access,
            cuda_pinned::sys::cudaDeviceAttr::cudaDevAttrPageableMemoryAccess,
            device,
        )
    };
    assert_eq!(status, cuda_pinned::sys::cudaError::cudaSuccess);
    access != 0
}

/// A download returns with the destination filled, behind other work on the stream: into
/// ordinary memory (the driver's path at 4 and 16 KiB, the ring at 64 KiB) and into
/// page-locked memory of every kind (the ring, which the driver's call would leave to fill
/// later).
#[test]
#[ignore = "needs a CUDA device"]
fn a_download_returns_with_the_destination_filled() {
    let stager = Stager::new().unwrap();
    let stream = Stream::new().unwrap();
    for len in [4 << 10, 16 << 10, 64 << 10] {
        assert_eq!(
            downloads_take_the_drivers_path(&stager, len),
            len <= 16 << 10
        );
        filled_when_the_download_returns(&stager, &stream, &mut vec![0u8; len], "ordinary");
        let mut host = PinnedVec::<u8, _>::with_capacity_in(len, CudaHost::new()).unwrap();
        host.resize(len, 0);
        filled_when_the_download_returns(&stager, &stream, &mut host, "cudaHostAlloc");
        let mut registered = PinnedVec::<u8, _>::with_capacity_in(len, Registered::new()).unwrap();
        registered.resize(len, 0);
        filled_when_the_download_returns(&stager, &stream, &mut registered, "registered");
        if stager.device().supports_virtual_host_memory().unwrap() {
            let mut mapped = PinnedVec::<u8, _>::with_capacity_in(len, VirtualHost::new()).unwrap();
            mapped.resize(len, 0);
            filled_when_the_download_returns(&stager, &stream, &mut mapped, "virtual host");
        }
    }
}

/// Both directions at once, on two streams, from two threads sharing one stager.
#[test]
#[ignore = "needs a CUDA device"]
fn both_directions_at_once_share_the_stager() {
    let stager = Stager::new().unwrap();
    let len = 256 << 20;
    let up_data = pattern(len, 1);
    let down_data = pattern(len, 2);
    let mut up_device = DeviceBuffer::<u8>::zeroed(len).unwrap();
    let down_device = DeviceBuffer::from_slice(&down_data).unwrap();
    std::thread::scope(|scope| {
        let stager = &stager;
        let up = scope.spawn(|| {
            let stream = Stream::new().unwrap();
            for _ in 0..3 {
                stager
                    .copy_to_device(&stream, &up_data, &mut up_device)
                    .unwrap()
                    .wait()
                    .unwrap();
            }
        });
        let down = scope.spawn(|| {
            let stream = Stream::new().unwrap();
            let mut back = vec![0u8; len];
            for _ in 0..3 {
                back.fill(0);
                stager
                    .copy_from_device(&stream, &down_device, &mut back)
                    .unwrap();
                assert!(back == down_data);
            }
        });
        up.join().unwrap();
        down.join().unwrap();
    });
    let mut check = vec![0u8; len];
    stager
        .copy_from_device(&Stream::new().unwrap(), &up_device, &mut check)
        .unwrap();
    assert!(check == up_data);
}

/// Small uploads through the upload slots, more at once than there are slots, from ordinary
/// and page-locked memory rewritten as each call returns, all behind 200 ms of other work:
/// the slots still busy leave uploads to the other paths, and everything arrives as it was
/// when its call returned. Then again once all have been waited for (the slots known free).
#[test]
#[ignore = "needs a CUDA device"]
fn small_uploads_arrive_as_they_were_whatever_slot_or_path_they_take() {
    let stager = Stager::new().unwrap();
    let stream = Stream::new().unwrap();
    let slot = stager.config().upload_slot_bytes;
    let count = 3 * stager.config().upload_slots + 1;
    for len in [1, 4 << 10, 12 << 10, slot, slot + 1] {
        for pinned in [false, true] {
            for round in 0..2 {
                let mut source =
                    PinnedVec::<u8, _>::with_capacity_in(len, CudaHost::new()).unwrap();
                let mut ordinary = vec![0u8; len];
                source.resize(len, 0);
                let mut devices: Vec<_> = (0..count)
                    .map(|_| DeviceBuffer::<u8>::zeroed(len).unwrap())
                    .collect();
                stream
                    .launch_host_fn(|| std::thread::sleep(Duration::from_millis(200)))
                    .unwrap();
                let mut uploads = Vec::new();
                for (i, device) in devices.iter_mut().enumerate() {
                    let host: &mut [u8] = if pinned { &mut source } else { &mut ordinary };
                    host.copy_from_slice(&pattern(len, i as u8));
                    uploads.push(stager.copy_to_device(&stream, host, device).unwrap());
                    host.fill(0xFF);
                }
                for upload in uploads {
                    upload.wait().unwrap();
                }
                for (i, device) in devices.iter().enumerate() {
                    assert!(
                        device.to_vec().unwrap() == pattern(len, i as u8),
                        "{len} bytes, upload {i}, page-locked {pinned}, round {round}"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn to_device_buffer_fills_new_memory_at_every_size_path() {
    let stager = Stager::new().unwrap();
    let other = Stream::new().unwrap();
    let stream = Stream::new().unwrap();
    // The upload slots', the driver's and the ring's sizes, and an empty one.
    for (i, len) in [0usize, 3, 20_000, 300_000, 9 << 20]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u32> = (0..len as u32)
            .map(|x| x.wrapping_mul(2_654_435_761) ^ i as u32)
            .collect();
        let buffer = stager.to_device_buffer(&stream, &data).unwrap();
        assert_eq!((buffer.len(), buffer.device()), (len, stager.device()));
        // Read back through a view on another stream: ordered after the upload by the
        // buffer's tracking, with no wait on `stream`.
        let mut back = PinnedVec::<u32>::zeroed(len).unwrap();
        back = other
            .copy_from_device(buffer.slice(..), back)
            .unwrap()
            .wait()
            .unwrap();
        assert!(back.as_slice() == data.as_slice(), "{len} elements");
    }
}
