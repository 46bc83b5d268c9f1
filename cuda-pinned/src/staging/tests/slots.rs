//! Small uploads through slots of their own beside the ring.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::*;

/// An upload through a slot as the stager makes it, its event recorded by `end` (which fails
/// with `end_fails` instead, after the copy was queued); `None` when no slot was taken.
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn upload_in_slot(
    engine: &Engine<Fake, Counted>,
    fake: &Fake,
    offset: usize,
    data: &[u8],
    end_fails: Option<Error>,
) -> Option<Result<Arc<Arc<FakeEvent>>>> {
    let end = || match end_fails {
        Some(error) => Err(error),
        None => recorded(fake),
    };
    // SAFETY: `data` is readable for its length during the call; the fake's device memory
    // covers the range (checked by its slicing).
    unsafe { engine.upload_in_slot(data.as_ptr(), offset as u64, data.len(), &(), end) }
}

/// A new event recorded on the fake's queue.
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn recorded(fake: &Fake) -> Result<Arc<Arc<FakeEvent>>> {
    let event = Arc::new(fake.event()?);
    fake.record(&event, &())?;
    Ok(event)
}

/// Uploads `data` at `offset` as the stager does: through a slot, ended by the event `end`
/// records, or else through the ring. The slot's event, when a slot was taken.
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn through_a_slot_or_the_ring(
    engine: &Engine<Fake, Counted>,
    offset: usize,
    data: &[u8],
    end: impl FnOnce() -> Result<Arc<Arc<FakeEvent>>>,
) -> Option<Arc<Arc<FakeEvent>>> {
    let (host, len) = (data.as_ptr(), data.len());
    // SAFETY: `data` is readable for its length during the call; the fake's device memory
    // covers the range (checked by its slicing).
    if let Some(ended) = unsafe { engine.upload_in_slot(host, offset as u64, len, &(), end) } {
        return Some(ended.unwrap());
    }
    // SAFETY: as above; an upload only reads its host side.
    unsafe {
        engine.run(
            Direction::HostToDevice,
            host.cast_mut(),
            offset as u64,
            len,
            &(),
        )
    }
    .unwrap();
    None
}

fn with_upload_slots(slot_bytes: usize, slots: usize) -> StagingConfig {
    StagingConfig {
        upload_slot_bytes: slot_bytes,
        upload_slots: slots,
        ..config(1024, 1, 1)
    }
}

/// Small uploads from a source rewritten after each call: each takes a slot whose last copy
/// has finished or falls back to the ring, no slot is written before its copy has run, and
/// everything arrives as it was when its call returned; with slots of 256 bytes and of 40 KiB
/// (filled with streaming stores from 32 KiB).
#[test]
fn upload_slots_are_reused_only_after_their_copy() {
    const UPLOADS: usize = if cfg!(miri) { 12 } else { 60 };
    for slot in [256, 40 << 10] {
        let fake = Fake::new(UPLOADS * slot);
        let allocator = Counted::default();
        let engine =
            Engine::new(fake.clone(), with_upload_slots(slot, 2), allocator.clone()).unwrap();
        let mut events = Vec::new();
        let mut in_slots = 0;
        let mut expected = vec![0u8; UPLOADS * slot];
        let mut source = vec![0u8; slot];
        for i in 0..UPLOADS {
            let len = slot - (i * 37) % slot;
            let offset = i * slot;
            source[..len].copy_from_slice(&pattern(len, i as u8));
            expected[offset..offset + len].copy_from_slice(&source[..len]);
            if let Some(ended) =
                through_a_slot_or_the_ring(&engine, offset, &source[..len], || recorded(&fake))
            {
                events.push(ended);
                in_slots += 1;
            }
            source.fill(0xEE);
            if i % 3 == 0
                && let Some(event) = events.last()
            {
                // Waited for: its slot is known free without asking the device.
                fake.wait(event).unwrap();
            }
        }
        assert!(
            in_slots >= UPLOADS / 3,
            "{in_slots} of {UPLOADS} uploads took a slot"
        );
        for event in &events {
            fake.wait(event).unwrap();
        }
        let queries = fake.0.faults.queries.load(Ordering::Relaxed);
        assert!(upload_in_slot(&engine, &fake, 0, &expected[..10], None).is_some());
        assert_eq!(fake.0.faults.queries.load(Ordering::Relaxed), queries);
        assert!(!fake.0.overwritten.load(Ordering::Relaxed));
        drop(engine);
        assert_eq!(fake.device_bytes()[10..], expected[10..]);
        assert_eq!(allocator.0.load(Ordering::Relaxed), 0);
        fake.stop();
    }
}

#[test]
fn uploads_that_fit_no_slot_are_left_to_the_other_paths() {
    let fake = Fake::new(1 << 16);
    let engine = Engine::new(fake.clone(), with_upload_slots(256, 1), Counted::default()).unwrap();
    assert!(upload_in_slot(&engine, &fake, 0, &[], None).is_none());
    assert!(upload_in_slot(&engine, &fake, 0, &[1; 257], None).is_none());
    // The one slot's copy is held back: no slot is ready.
    fake.hold();
    let ended = upload_in_slot(&engine, &fake, 0, &[1; 256], None)
        .unwrap()
        .unwrap();
    let while_held = upload_in_slot(&engine, &fake, 0, &[2; 256], None);
    // Released before asserting: a failure must not leave the engine's drop waiting.
    fake.release();
    assert!(while_held.is_none());
    fake.wait(&ended).unwrap();
    assert!(upload_in_slot(&engine, &fake, 0, &[3; 256], None).is_some());
    drop(engine);
    let none = Engine::new(fake.clone(), with_upload_slots(0, 4), Counted::default()).unwrap();
    assert!(upload_in_slot(&none, &fake, 0, &[1], None).is_none());
    drop(none);
    fake.stop();
}

/// A slot whose copy no event covers (the copy call or the event failed) is reused after the
/// stream has been waited for, and lost when that fails too, or when a capture took the copy
/// in (waiting would break the capture): its memory is then leaked, not freed.
#[test]
#[cfg_attr(miri, ignore = "leaks the ring on purpose, which Miri reports")]
fn a_slot_whose_copy_is_unknown_waits_for_the_stream_or_is_lost() {
    let cases = [
        (1, None, false, true),
        (0, Some(injected()), false, true),
        (0, Some(injected()), true, false),
        (0, Some(Error::Capturing), false, false),
    ];
    for (queue_at, end_fails, stream_wait_fails, reused) in cases {
        let fake = Fake::new(1 << 16);
        let allocator = Counted::default();
        let engine =
            Engine::new(fake.clone(), with_upload_slots(256, 1), allocator.clone()).unwrap();
        fake.0.faults.queue_at.store(queue_at, Ordering::Relaxed);
        fake.0
            .faults
            .stream_wait_fails
            .store(stream_wait_fails, Ordering::Relaxed);
        let capturing = matches!(end_fails, Some(Error::Capturing));
        let failed = upload_in_slot(&engine, &fake, 0, &[1; 100], end_fails).unwrap();
        assert!(failed.is_err());
        let waits = fake.0.faults.stream_waits.load(Ordering::Relaxed);
        assert_eq!(waits, usize::from(!capturing), "stream waits");
        fake.0
            .faults
            .stream_wait_fails
            .store(false, Ordering::Relaxed);
        let again = upload_in_slot(&engine, &fake, 0, &[2; 100], None);
        assert_eq!(again.is_some(), reused);
        if let Some(ended) = again {
            fake.wait(&ended.unwrap()).unwrap();
        }
        drop(engine);
        assert_eq!(allocator.0.load(Ordering::Relaxed) == 0, reused);
        assert!(!fake.0.overwritten.load(Ordering::Relaxed));
        fake.stop();
    }
}

/// Three threads upload through three slots with events recycled as the stager recycles them
/// (one is reused once nobody else holds it), dropping some ended events at once, keeping,
/// waiting for, or handing others to a thread that queries them (as a device buffer or a
/// pool would): no slot is written before its copy has run, and every upload arrives.
#[test]
#[allow(
    clippy::redundant_allocation,
    reason = "the engine shares `Arc<D::Event>`, and the fake's event is an `Arc` itself"
)]
fn slots_and_recycled_events_hold_under_several_threads() {
    const THREADS: usize = 3;
    const SLOT: usize = 128;
    const BLOCKS: usize = 8;
    let iterations = if cfg!(miri) { 30 } else { 400 };
    let fake = Fake::new(THREADS * BLOCKS * SLOT);
    let allocator = Counted::default();
    let config = StagingConfig {
        threads: 2,
        chunks: 2,
        ..with_upload_slots(SLOT, 3)
    };
    let engine = Engine::new(fake.clone(), config, allocator.clone()).unwrap();
    let recycled: Mutex<Vec<Arc<Arc<FakeEvent>>>> = Mutex::new(Vec::new());
    let end_event = || {
        let mut events = lock(&recycled);
        if let Some(event) = events.iter().find(|event| Arc::strong_count(event) == 1) {
            std::sync::atomic::fence(Ordering::Acquire);
            return event.clone();
        }
        let event = Arc::new(fake.event().unwrap());
        if events.len() < 16 {
            events.push(event.clone());
        }
        event
    };
    let queried: Mutex<Vec<Arc<Arc<FakeEvent>>>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let expected: Vec<Mutex<Vec<u8>>> = (0..THREADS)
        .map(|_| Mutex::new(vec![0; BLOCKS * SLOT]))
        .collect();
    let in_slots = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let events: Vec<_> = lock(&queried).drain(..).collect();
                for event in &events {
                    let _ = fake.finished(event);
                }
                std::thread::yield_now();
            }
        });
        let uploaders: Vec<_> = (0..THREADS)
            .map(|t| {
                let (engine, fake, end_event) = (&engine, &fake, &end_event);
                let (queried, expected, in_slots) = (&queried, &expected[t], &in_slots);
                scope.spawn(move || {
                    let mut kept = VecDeque::new();
                    let mut source = [0u8; SLOT];
                    for i in 0..iterations {
                        let len = 1 + (i * 53 + t * 7) % SLOT;
                        let block = i % BLOCKS;
                        let offset = (t * BLOCKS + block) * SLOT;
                        source[..len].copy_from_slice(&pattern(len, (i + t * 31) as u8));
                        lock(expected)[block * SLOT..block * SLOT + len]
                            .copy_from_slice(&source[..len]);
                        let end = || {
                            let event = end_event();
                            fake.record(&event, &())?;
                            Ok(event)
                        };
                        if let Some(ended) =
                            through_a_slot_or_the_ring(engine, offset, &source[..len], end)
                        {
                            in_slots.fetch_add(1, Ordering::Relaxed);
                            match i % 4 {
                                0 => drop(ended),
                                1 => kept.push_back(ended),
                                2 => lock(queried).push(ended),
                                _ => fake.wait(&ended).unwrap(),
                            }
                        }
                        source.fill(0xEE);
                        if kept.len() > 4 {
                            let _ = fake.finished(&kept.pop_front().unwrap());
                        }
                    }
                })
            })
            .collect();
        for uploader in uploaders {
            uploader.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    drop(engine);
    assert!(!fake.0.overwritten.load(Ordering::Relaxed));
    assert!(in_slots.load(Ordering::Relaxed) > 0);
    let device = fake.device_bytes();
    for (t, expected) in expected.iter().enumerate() {
        let blocks = &device[t * BLOCKS * SLOT..(t + 1) * BLOCKS * SLOT];
        assert!(blocks == &lock(expected)[..], "thread {t}'s uploads");
    }
    assert_eq!(allocator.0.load(Ordering::Relaxed), 0);
    fake.stop();
}

/// Claims any amount of page-locked memory without mapping any: for configurations whose
/// memory is never touched.
#[derive(Clone, Copy)]
struct Pretend;

// SAFETY: never used for reads or writes (the one test using it copies nothing); the address
// handed out is page-aligned and never dereferenced or freed.
unsafe impl PinnedAllocator for Pretend {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let page = std::ptr::NonNull::new(std::ptr::without_provenance_mut(4096)).unwrap();
        Ok(Allocation::new(
            page,
            layout.size(),
            crate::MemoryKind::HostLocked,
            0,
        ))
    }

    unsafe fn deallocate(&self, _allocation: Allocation) {}
}

/// A configuration with more upload slots than the slot list can hold (its memory granted)
/// is refused with an error, not an abort.
#[test]
fn too_many_upload_slots_are_an_error() {
    let fake = Fake::new(16);
    let config = with_upload_slots(1, 1 << 60);
    let error = Engine::new(fake.clone(), config, Pretend).err();
    assert!(
        matches!(error, Some(Error::OutOfMemory { .. })),
        "{error:?}"
    );
    fake.stop();
}
