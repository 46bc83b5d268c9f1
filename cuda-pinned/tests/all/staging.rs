//! Copies from and into ordinary memory through the staging ring (ignored without a device).

use std::time::{Duration, Instant};

use cuda_pinned::{DeviceBuffer, Stager, StagingConfig, Stream};

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
    for len in [0, 1, chunk - 1, chunk + 1, 3 * chunk + 17, 1 << 30] {
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
        slots: 2,
        single_thread_bytes: 0,
        min_piece_bytes: 1000,
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
    for len in [1000, 64 << 20] {
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
