//! Copies through the ring: every byte arrives whatever the cut, chunks are reused only after
//! their copy, and errors, panics and captures midway.

use std::sync::atomic::Ordering;

use proptest::prelude::*;

use super::*;

const CASES: u32 = if cfg!(miri) { 3 } else { 48 };

/// `cases` cases; under Miri, which isolates the program from the file system, failures are
/// not written down.
fn cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: capped(cases),
        failure_persistence: if cfg!(miri) {
            None
        } else {
            ProptestConfig::default().failure_persistence
        },
        ..ProptestConfig::default()
    }
}
const MAX_LEN: usize = if cfg!(miri) { 3000 } else { 20_000 };

proptest! {
    #![proptest_config(cases(CASES))]

    /// Any size (zero, below, at and past a chunk, not a multiple of it), any chunk size,
    /// thread and slot count: the bytes arrive in place, no chunk is touched before its
    /// event, and the ring's memory is given back.
    #[test]
    fn copies_arrive_intact_whatever_the_cut(
        len in 0usize..MAX_LEN,
        offset in 0usize..64,
        chunk in 64usize..3000,
        threads in 1usize..5,
        slots in 1usize..5,
        single_thread in any::<bool>(),
    ) {
        let fake = Fake::new(MAX_LEN + 64);
        let allocator = Counted::default();
        let mut config = config(chunk, threads, slots);
        if !single_thread {
            config.single_thread_bytes = 0;
        }
        let engine = Engine::new(fake.clone(), config, allocator.clone()).unwrap();
        let data = pattern(len, offset as u8);
        let back = round_trip(&engine, offset, &data).unwrap();
        prop_assert_eq!(&back, &data);
        prop_assert_eq!(&fake.device_bytes()[offset..offset + len], data.as_slice());
        prop_assert!(!fake.0.overwritten.load(Ordering::Relaxed));
        drop(engine);
        prop_assert_eq!(allocator.0.load(Ordering::Relaxed), 0);
        fake.stop();
    }
}

proptest! {
    #![proptest_config(cases(if cfg!(miri) { 8 } else { 512 }))]

    /// Pieces cover the copy exactly, in order, none empty or larger than a chunk; on one
    /// thread they are whole chunks.
    #[test]
    fn pieces_cover_the_copy_in_order(
        bytes in 0usize..1 << 24,
        chunk in 1usize..1 << 20,
        threads in 1usize..20,
        min_piece in 0usize..1 << 20,
        spread in any::<bool>(),
    ) {
        let config = StagingConfig { min_piece_bytes: min_piece, ..config(chunk, threads, 1) };
        let cuts = cut(bytes, &config, spread);
        let mut end = 0;
        for &(offset, len) in &cuts {
            prop_assert_eq!(offset, end);
            prop_assert!(len > 0 && len <= chunk);
            end += len;
        }
        prop_assert_eq!(end, bytes);
        if !spread {
            prop_assert_eq!(cuts.len(), bytes.div_ceil(chunk));
        }
    }
}

#[test]
fn one_chunk_is_reused_only_after_each_copy() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), config(512, 3, 1), Counted::default()).unwrap();
    let data = pattern(40_000, 7);
    assert_eq!(round_trip(&engine, 100, &data).unwrap(), data);
    assert!(!fake.0.overwritten.load(Ordering::Relaxed));
    drop(engine);
    fake.stop();
}

#[test]
fn a_copy_on_one_thread_cycles_through_the_chunks() {
    let fake = Fake::new(1 << 16);
    let config = StagingConfig {
        single_thread_bytes: usize::MAX,
        ..config(256, 1, 4)
    };
    let engine = Engine::new(fake.clone(), config, Counted::default()).unwrap();
    let data = pattern(4096, 5);
    assert_eq!(round_trip(&engine, 0, &data).unwrap(), data);
    // 16 pieces each way: every chunk takes part, so one piece's DMA overlaps the next copy.
    assert_eq!(lock(&fake.0.chunks).len(), 4);
    drop(engine);
    fake.stop();
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_panicking_copy_thread_fails_the_copy_without_a_hang() {
    let fake = Fake::new(1 << 16);
    let allocator = Counted::default();
    let config = StagingConfig {
        single_thread_bytes: 0,
        ..config(256, 4, 4)
    };
    let engine = Engine::new(fake.clone(), config, allocator.clone()).unwrap();
    let data = pattern(40_000, 6);
    fake.0.faults.worker_panics.store(true, Ordering::Relaxed);
    let result = round_trip(&engine, 0, &data);
    // The caller may finish every piece before a worker wakes: then nothing panicked.
    if fake.0.faults.worker_panics.load(Ordering::Relaxed) {
        assert_eq!(result.unwrap(), data);
    } else {
        let error = result.unwrap_err();
        assert!(error.to_string().contains("panicked"), "{error}");
    }
    // The engine goes on with the threads and chunks it has left.
    fake.0.faults.worker_panics.store(false, Ordering::Relaxed);
    assert_eq!(round_trip(&engine, 0, &data).unwrap(), data);
    drop(engine);
    fake.stop();
}

#[test]
fn copies_from_several_threads_at_once_share_the_workers() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), config(1024, 4, 3), Counted::default()).unwrap();
    std::thread::scope(|scope| {
        for part in 0..4usize {
            let engine = &engine;
            scope.spawn(move || {
                let data = pattern(8000 + part, part as u8);
                assert_eq!(round_trip(engine, part * 16_000, &data).unwrap(), data);
            });
        }
    });
    assert!(!fake.0.overwritten.load(Ordering::Relaxed));
    drop(engine);
    fake.stop();
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn an_error_midway_is_reported_and_the_engine_stays_usable() {
    for (queue_at, wait_at) in [(3, 0), (0, 4), (1, 0)] {
        let fake = Fake::new(1 << 16);
        fake.0.faults.queue_at.store(queue_at, Ordering::Relaxed);
        fake.0.faults.wait_at.store(wait_at, Ordering::Relaxed);
        let allocator = Counted::default();
        let engine = Engine::new(fake.clone(), config(1000, 3, 4), allocator.clone()).unwrap();
        let data = pattern(10_000, 1);
        let error = round_trip(&engine, 0, &data).unwrap_err();
        assert!(error.to_string().contains("injected"), "{error}");
        // The ring is intact (or short of the chunk whose wait failed): copies go on.
        assert_eq!(round_trip(&engine, 0, &data).unwrap(), data);
        drop(engine);
        let freed = allocator.0.load(Ordering::Relaxed) == 0;
        // A chunk whose last copy could not be waited for is never reused, so the ring's
        // memory is leaked rather than freed under a DMA that may still run.
        assert_eq!(freed, wait_at == 0, "queue_at {queue_at} wait_at {wait_at}");
        fake.stop();
    }
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_ring_that_lost_every_chunk_says_so_instead_of_hanging() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), config(1000, 2, 1), Counted::default()).unwrap();
    fake.0.faults.wait_at.store(1, Ordering::Relaxed);
    assert!(round_trip(&engine, 0, &pattern(5000, 2)).is_err());
    let error = round_trip(&engine, 0, &pattern(5000, 2)).unwrap_err();
    assert!(error.to_string().contains("lost"), "{error}");
    drop(engine);
    fake.stop();
}

#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_copy_queued_whose_event_is_unknown_waits_for_the_stream_or_loses_the_chunk() {
    for stream_wait_fails in [false, true] {
        let fake = Fake::new(1 << 16);
        let allocator = Counted::default();
        let engine = Engine::new(fake.clone(), config(4096, 1, 2), allocator.clone()).unwrap();
        // A fresh ring's chunks have no DMA to wait for: the first wait is the piece's own,
        // after its copy was queued.
        fake.0.faults.wait_at.store(1, Ordering::Relaxed);
        fake.0
            .faults
            .stream_wait_fails
            .store(stream_wait_fails, Ordering::Relaxed);
        let mut back = vec![0u8; 4096];
        // SAFETY: `back` is writable for its length.
        let result =
            unsafe { engine.run(Direction::DeviceToHost, back.as_mut_ptr(), 0, 4096, &()) };
        assert!(result.is_err());
        drop(engine);
        assert_eq!(allocator.0.load(Ordering::Relaxed) == 0, !stream_wait_fails);
        fake.stop();
    }
}

/// A capture that began on the stream while a piece was queued took in its copy: the chunk is
/// lost without waiting for the stream (which would break the capture), and the copy fails
/// saying so.
#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_piece_taken_in_by_a_capture_loses_its_chunk_without_waiting() {
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        let fake = Fake::new(1 << 16);
        let allocator = Counted::default();
        let engine = Engine::new(fake.clone(), config(4096, 1, 2), allocator.clone()).unwrap();
        fake.0
            .faults
            .records_capturing
            .store(true, Ordering::Relaxed);
        let mut host = vec![0u8; 4096];
        // SAFETY: `host` is readable and writable for its length.
        let result = unsafe { engine.run(direction, host.as_mut_ptr(), 0, 4096, &()) };
        assert!(matches!(result, Err(Error::Capturing)), "{result:?}");
        assert_eq!(fake.0.faults.stream_waits.load(Ordering::Relaxed), 0);
        let lost: Vec<usize> = lock(&fake.0.chunks).drain().collect();
        assert_eq!(lost.len(), 1);
        // The other chunk still works; the lost one is never handed out again.
        fake.0
            .faults
            .records_capturing
            .store(false, Ordering::Relaxed);
        for _ in 0..3 {
            // SAFETY: as above.
            unsafe { engine.run(direction, host.as_mut_ptr(), 0, 4096, &()) }.unwrap();
        }
        let used: Vec<usize> = lock(&fake.0.chunks).iter().copied().collect();
        assert_eq!(used.len(), 1);
        assert_ne!(used, lost);
        drop(engine);
        assert_ne!(
            allocator.0.load(Ordering::Relaxed),
            0,
            "a lost chunk's ring was freed"
        );
        fake.stop();
    }
}

#[test]
fn configurations_without_room_are_refused() {
    let too_many = StagingConfig::MAX_THREADS + 1;
    for (chunk, threads, slots) in [
        (0, 1, 1),
        (1, 0, 1),
        (1, 1, 0),
        (1, too_many, 1),
        (1, usize::MAX, 1),
    ] {
        let fake = Fake::new(0);
        let result = Engine::new(
            fake.clone(),
            config(chunk, threads, slots),
            Counted::default(),
        );
        assert!(matches!(result, Err(Error::Unsupported(_))));
        fake.stop();
    }
    let fake = Fake::new(0);
    let result = Engine::new(fake.clone(), config(usize::MAX, 1, 2), Counted::default());
    assert!(matches!(result, Err(Error::CapacityOverflow)));
    fake.stop();
}

#[test]
#[allow(clippy::reversed_empty_ranges)]
fn driver_sizes_out_of_order_or_past_the_checked_size_are_refused() {
    let reversed = (16 << 10)..=0;
    let backwards = [
        StagingConfig {
            driver_uploads: vec![0..=4096, reversed.clone()],
            ..config(4096, 1, 1)
        },
        StagingConfig {
            driver_downloads: vec![reversed],
            ..config(4096, 1, 1)
        },
    ];
    for config in backwards {
        let fake = Fake::new(0);
        let result = Engine::new(fake.clone(), config, Counted::default());
        assert!(matches!(result, Err(Error::Unsupported(_))));
        fake.stop();
    }
    // Past the largest size checked.
    let fake = Fake::new(0);
    let unbounded = StagingConfig {
        driver_uploads: vec![1..=usize::MAX],
        ..config(4096, 1, 1)
    };
    let result = Engine::new(fake.clone(), unbounded, Counted::default());
    assert!(matches!(result, Err(Error::Unsupported(_))));
    fake.stop();
    // Overlapping and single-size ranges up to that size are fine.
    let fake = Fake::new(0);
    let fine = StagingConfig {
        driver_uploads: vec![0..=4096, 4096..=4096, 1..=(4 << 20)],
        driver_downloads: vec![0..=0],
        ..config(4096, 1, 1)
    };
    let engine = Engine::new(fake.clone(), fine, Counted::default()).unwrap();
    drop(engine);
    fake.stop();
}

/// Downloads through the engine in pieces large enough for non-temporal stores, from one to
/// five threads, into destinations at every alignment.
#[test]
#[cfg_attr(miri, ignore = "many rounds; the plain copy is covered above")]
fn streaming_downloads_through_the_engine_are_exact() {
    for round in 0..200usize {
        let chunk = 4096 + (round * 977) % 20_000;
        let threads = 1 + round % 5;
        let fake = Fake::new(1 << 20);
        let mut config = config(chunk, threads, 1 + round % 4);
        config.single_thread_bytes = if round % 2 == 0 { 0 } else { usize::MAX };
        config.min_piece_bytes = 4096;
        let engine = Engine::new(fake.clone(), config, Counted::default()).unwrap();
        let len = 10_000 + (round * 7919) % 200_000;
        let offset = round % 61;
        let data = pattern(len, round as u8);
        let mut host = vec![0u8; len + 64];
        round_trip_into(&engine, &data, &mut host[offset..offset + len]);
        assert_eq!(&host[offset..offset + len], &data[..], "round {round}");
        assert!(host[..offset].iter().all(|&b| b == 0));
        assert!(host[offset + len..].iter().all(|&b| b == 0));
        drop(engine);
        fake.stop();
    }
}

/// Uploads `data` at device offset 0, then downloads it into `into`.
fn round_trip_into(engine: &Engine<Fake, Counted>, data: &[u8], into: &mut [u8]) {
    // SAFETY: `data` is readable and `into` writable for their lengths, neither touched
    // meanwhile; the fake's device memory covers both copies (checked by its slicing).
    unsafe {
        engine
            .run(
                Direction::HostToDevice,
                data.as_ptr().cast_mut(),
                0,
                data.len(),
                &(),
            )
            .unwrap();
        engine
            .run(
                Direction::DeviceToHost,
                into.as_mut_ptr(),
                0,
                into.len(),
                &(),
            )
            .unwrap();
    }
}

/// `cases`, capped by `PROPTEST_MAX_CASES` where it is set: the sanitizer runs, whose every
/// case costs many times a plain run's, take fewer.
fn capped(cases: u32) -> u32 {
    std::env::var("PROPTEST_MAX_CASES")
        .ok()
        .and_then(|max| max.parse().ok())
        .map_or(cases, |max: u32| cases.min(max))
}
