//! The crew against a fake device whose copies run late: only when an event behind them is
//! waited for, so a chunk reused too early shows as wrong bytes.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cuda_pinned::ring::{Dma, RingCopy, Way};
use proptest::prelude::*;

use super::*;
use crate::error::{Error, Result};
use crate::file::{DIRECT_ALIGN, DataFile, ReadMode};
use crate::plan::{ChunkCopy, Span, cut};

mod random_faults;

enum Op {
    Copy {
        src: usize,
        copy: ChunkCopy,
        snap: Vec<u8>,
    },
    Record(Arc<AtomicBool>),
}

/// A device whose stream is a list of operations, run when something waits.
#[derive(Clone, Default)]
struct Fake(Arc<FakeState>);

impl Fake {
    fn new(state: FakeState) -> Self {
        Self(Arc::new(state))
    }
}

impl std::ops::Deref for Fake {
    type Target = FakeState;

    fn deref(&self) -> &FakeState {
        &self.0
    }
}

#[derive(Default)]
struct FakeState {
    stream: Mutex<Vec<Op>>,
    /// Times each destination byte was written (indexed from `dst_base`).
    writes: Mutex<Vec<u8>>,
    dst_base: AtomicUsize,
    /// Fail the copy call with this number (counted from 1).
    fail_copy: Option<usize>,
    /// Panic in the copy call with this number (counted from 1).
    panic_copy: Option<usize>,
    copy_calls: AtomicUsize,
    /// Fail the record call with this number (counted from 1), after the copies are queued.
    fail_record: Option<usize>,
    record_calls: AtomicUsize,
    /// Fail the event wait with this number (counted from 1); the work stays queued.
    fail_wait: Option<usize>,
    wait_calls: AtomicUsize,
    /// Every stream wait fails (nothing drains).
    fail_wait_stream: bool,
    /// Copies that ran after their source bytes changed (a chunk reused too early).
    clobbered: AtomicUsize,
    /// Every copy queued (to its address), in the order queued, drained or not.
    queued: Mutex<Vec<ChunkCopy>>,
    /// Where each target's destination starts, in order (none: every copy is target 0's).
    target_starts: Mutex<Vec<u64>>,
}

impl FakeState {
    /// The target whose destination holds `device`.
    fn target_of(&self, device: u64) -> usize {
        let starts = self.target_starts.lock().unwrap();
        starts
            .iter()
            .filter(|&&start| start <= device)
            .count()
            .saturating_sub(1)
    }

    fn drain(&self) {
        // Run under the stream's lock: an event is done only once its work has run.
        let mut stream = self.stream.lock().unwrap();
        let ops = std::mem::take(&mut *stream);
        let base = self.dst_base.load(Ordering::Relaxed);
        let mut writes = self.writes.lock().unwrap();
        for op in ops {
            match op {
                Op::Copy { src, copy, snap } => {
                    let mut now = Vec::new();
                    for row in 0..copy.rows {
                        let from = src + row * copy.pitch;
                        // SAFETY: as below.
                        now.extend_from_slice(unsafe {
                            std::slice::from_raw_parts(from as *const u8, copy.width)
                        });
                    }
                    if now != snap {
                        self.clobbered.fetch_add(1, Ordering::Relaxed);
                    }
                    for row in 0..copy.rows {
                        let from = src + row * copy.pitch;
                        let to = copy.dst as usize + row * copy.width;
                        for i in 0..copy.width {
                            writes[to + i - base] += 1;
                        }
                        // SAFETY: the test lends these ranges: the chunk (left alone until
                        // this runs, which is what is tested) and its destination buffer.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                from as *const u8,
                                to as *mut u8,
                                copy.width,
                            )
                        };
                    }
                }
                Op::Record(done) => done.store(true, Ordering::Release),
            }
        }
    }
}

fn injected(what: &'static str) -> cuda_pinned::Error {
    cuda_pinned::Error::Unsupported(what)
}

impl Dma for Fake {
    type Stream = ();
    type Event = Arc<AtomicBool>;

    fn event(&self) -> cuda_pinned::Result<Self::Event> {
        Ok(Arc::default())
    }

    unsafe fn queue(&self, _: &(), copies: &[RingCopy], way: Way) -> cuda_pinned::Result<()> {
        assert_eq!(way, Way::Upload, "a reader only uploads");
        let call = self.copy_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_copy == Some(call) {
            return Err(injected("injected copy failure"));
        }
        assert_ne!(self.panic_copy, Some(call), "injected copy panic");
        let mut stream = self.stream.lock().unwrap();
        for copy in copies {
            let src = copy.host as usize;
            let copy = ChunkCopy {
                from: 0,
                pitch: copy.host_pitch,
                width: copy.width,
                rows: copy.rows,
                dst: copy.device,
                target: self.target_of(copy.device),
            };
            self.queued.lock().unwrap().push(copy);
            let mut snap = Vec::new();
            for row in 0..copy.rows {
                // SAFETY: the filled bytes of the chunk (the contract).
                snap.extend_from_slice(unsafe {
                    std::slice::from_raw_parts((src + row * copy.pitch) as *const u8, copy.width)
                });
            }
            stream.push(Op::Copy { src, copy, snap });
        }
        Ok(())
    }

    fn record(&self, event: &Self::Event, _: &()) -> cuda_pinned::Result<()> {
        let call = self.record_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_record == Some(call) {
            return Err(injected("injected record failure"));
        }
        event.store(false, Ordering::Relaxed);
        self.stream.lock().unwrap().push(Op::Record(event.clone()));
        Ok(())
    }

    fn wait(&self, event: &Self::Event) -> cuda_pinned::Result<()> {
        let call = self.wait_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_wait == Some(call) {
            return Err(injected("injected wait failure"));
        }
        if !event.load(Ordering::Acquire) {
            self.drain();
        }
        Ok(())
    }

    fn seen_finished(&self, event: &Self::Event) -> bool {
        event.load(Ordering::Acquire)
    }

    fn finished(&self, event: &Self::Event) -> cuda_pinned::Result<bool> {
        Ok(event.load(Ordering::Acquire))
    }

    fn wait_stream(&self, _: &()) -> cuda_pinned::Result<()> {
        if self.fail_wait_stream {
            return Err(injected("injected stream wait failure"));
        }
        self.drain();
        Ok(())
    }

    fn device(&self) -> i32 {
        0
    }

    fn use_device(&self) -> cuda_pinned::Result<()> {
        Ok(())
    }
}

fn ring(fake: &Fake, capacity: usize, count: usize) -> ReadRing<Fake> {
    ring_in_parts(fake, capacity, count, capacity)
}

/// [`ring`], reading pieces through the page cache in parts of `part` bytes.
fn ring_in_parts(fake: &Fake, capacity: usize, count: usize, part: usize) -> ReadRing<Fake> {
    let mut memory = vec![0u8; ReadRing::<Fake>::bytes_for(capacity, count).unwrap()];
    let start = memory.as_mut_ptr();
    // SAFETY: `start` is the first of `bytes_for` bytes of `memory`, which the ring keeps
    // (the fake device needs no page-locked memory).
    unsafe { ReadRing::new(fake.clone(), start, capacity, count, Box::new(memory)) }
        .unwrap()
        .read_in_parts_of(part)
}

fn file_of(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
    let bytes: Vec<u8> = (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut file = tempfile::NamedTempFile::new_in(std::env::temp_dir()).unwrap();
    file.write_all(&bytes).unwrap();
    file.flush().unwrap();
    (file, bytes)
}

/// Reads `spans` of a fresh file into a buffer through the crew, with a ring of `count`
/// chunks.
fn read_through(
    spans: &mut [Span],
    file_len: usize,
    mode: ReadMode,
    threads: usize,
    chunk: usize,
    count: usize,
) -> Outcome {
    read_in_parts(spans, file_len, mode, threads, chunk, count, chunk)
}

/// [`read_through`], reading pieces through the page cache in parts of `part` bytes.
fn read_in_parts(
    spans: &mut [Span],
    file_len: usize,
    mode: ReadMode,
    threads: usize,
    chunk: usize,
    count: usize,
    part: usize,
) -> Outcome {
    let (file, bytes) = file_of(file_len);
    let mut total = 0;
    for (i, span) in spans.iter_mut().enumerate() {
        span.target = i;
        total += span.width * span.rows;
    }
    let mut dst = vec![0u8; total as usize];
    let base = dst.as_mut_ptr() as u64;
    let mut at = base;
    for span in spans.iter_mut() {
        span.dst = at;
        at += span.width * span.rows;
    }
    let fake = Fake::default();
    fake.dst_base.store(base as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; total as usize];
    let crew = Crew::new(ring_in_parts(&fake, chunk, count, part), threads).unwrap();
    let pieces = cut(spans, crew.ring().capacity()).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink_seen = seen.clone();
    let data_file = DataFile::open(file.path()).unwrap();
    let direct_at_open = data_file.can_read_direct();
    let files = vec![data_file.clone()];
    let job = Job::new(
        pieces,
        files,
        mode,
        (),
        spans.len(),
        Box::new(move |targets: &[usize], _: &()| {
            sink_seen.lock().unwrap().extend_from_slice(targets);
            Ok(())
        }),
    );
    let result = crew.run(&Arc::new(job));
    fake.drain();
    let seen = seen.lock().unwrap().clone();
    Outcome {
        result,
        dst,
        bytes,
        fake,
        seen,
        direct_throughout: direct_at_open && data_file.can_read_direct(),
        cached_bytes: data_file.bytes_read().0,
    }
}

/// What [`read_in_parts`] saw: the run's result, the destination and the file's bytes, the fake, and
/// the targets the sink saw, in order.
struct Outcome {
    result: Result<()>,
    dst: Vec<u8>,
    bytes: Vec<u8>,
    fake: Fake,
    seen: Vec<usize>,
    /// Whether the file system took direct reads from the opening to the end.
    direct_throughout: bool,
    /// Bytes read through the page cache.
    cached_bytes: u64,
}

fn spans() -> impl Strategy<Value = Vec<Span>> {
    let span = (0u64..70_000, 1u64..20_000, 1u64..4, 0u64..5000).prop_map(
        |(offset, width, rows, extra)| Span {
            file: 0,
            offset,
            width,
            rows,
            pitch: width + extra,
            dst: 0,
            target: 0,
        },
    );
    prop::collection::vec(span, 1..8)
}

fn modes() -> impl Strategy<Value = ReadMode> {
    prop_oneof![
        Just(ReadMode::Auto),
        Just(ReadMode::Buffered),
        Just(ReadMode::Direct)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_byte_lands_once_in_place(
        mut spans in spans(),
        mode in modes(),
        threads in 1usize..5,
        blocks in 1usize..4,
        count in 1usize..5,
        parts in 1usize..5,
    ) {
        // Parts of any size, down to a few bytes that split no block evenly.
        let chunk = blocks * DIRECT_ALIGN;
        let part = chunk.div_ceil(parts) - parts + 1;
        let Outcome { result, dst, bytes, fake, mut seen, .. } =
            read_in_parts(&mut spans, 150_000, mode, threads, chunk, count, part);
        prop_assert!(result.is_ok(), "{:?}", result);
        for span in &spans {
            for row in 0..span.rows {
                let from = (span.offset + row * span.pitch) as usize;
                let to = (span.dst - dst.as_ptr() as u64 + row * span.width) as usize;
                let width = span.width as usize;
                prop_assert!(dst[to..to + width] == bytes[from..from + width]);
            }
        }
        prop_assert!(fake.writes.lock().unwrap().iter().all(|&w| w == 1));
        prop_assert_eq!(fake.clobbered.load(Ordering::Relaxed), 0);
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..spans.len()).collect::<Vec<_>>());
    }
}

/// A span of `rows` rows of `width` bytes, `pitch` apart, from `offset`.
fn rows(offset: u64, width: u64, rows: u64, pitch: u64) -> Span {
    Span {
        file: 0,
        offset,
        width,
        rows,
        pitch,
        dst: 0,
        target: 0,
    }
}

#[test]
fn runs_read_past_the_page_cache_land_every_byte_and_go_past_it() {
    const LEN: usize = 150_001;
    let cases = [
        // An unaligned start, to the file's unaligned end.
        vec![rows(1000, (LEN - 1000) as u64, 1, 1)],
        // The whole file.
        vec![rows(0, LEN as u64, 1, 1)],
        // Two targets meeting on a block boundary, the first unaligned.
        vec![rows(5, 8187, 1, 1), rows(8192, 10_000, 1, 1)],
        // Rows starting on blocks, with gaps between them: pieces that must not be read as
        // one run.
        vec![rows(8192, 4000, 6, 8192)],
        // Wide rows with gaps, and a last piece in the file's last partial block.
        vec![rows(3000, 20_000, 3, 24_576), rows(147_000, 3001, 1, 1)],
    ];
    // Whether this file system takes direct reads: one piece at a time, no runs.
    let takes_direct = read_through(
        &mut [rows(0, 8192, 1, 1)],
        LEN,
        ReadMode::Direct,
        1,
        4096,
        1,
    )
    .direct_throughout;
    for spans in cases {
        for mode in [ReadMode::Direct, ReadMode::Auto] {
            for threads in [1, 3] {
                for (chunk, count) in [(4096, 8), (8192, 8), (12_288, 5), (8192, 2)] {
                    let mut spans = spans.clone();
                    let outcome = read_through(&mut spans, LEN, mode, threads, chunk, count);
                    let case = format!("{spans:?} {mode:?} {threads} threads, {count} × {chunk}");
                    assert!(outcome.result.is_ok(), "{case}: {:?}", outcome.result);
                    for span in &spans {
                        for row in 0..span.rows {
                            let from = (span.offset + row * span.pitch) as usize;
                            let to = (span.dst - outcome.dst.as_ptr() as u64 + row * span.width)
                                as usize;
                            let width = span.width as usize;
                            assert!(
                                outcome.dst[to..to + width] == outcome.bytes[from..from + width],
                                "{case}: wrong bytes"
                            );
                        }
                    }
                    assert!(outcome.fake.writes.lock().unwrap().iter().all(|&w| w == 1));
                    assert_eq!(outcome.fake.clobbered.load(Ordering::Relaxed), 0, "{case}");
                    if mode == ReadMode::Direct && takes_direct {
                        // Nothing fell back to the page cache: every run was a valid read.
                        assert!(outcome.direct_throughout, "{case}: a read was refused");
                        assert_eq!(outcome.cached_bytes, 0, "{case}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_file_shorter_than_the_read_is_truncated_and_the_ring_stays_whole() {
    let mut spans = [Span {
        file: 0,
        offset: 1000,
        width: 50_000,
        rows: 1,
        pitch: 50_000,
        dst: 0,
        target: 0,
    }];
    for mode in [ReadMode::Auto, ReadMode::Buffered, ReadMode::Direct] {
        for (threads, part) in [(2, 3 * DIRECT_ALIGN), (3, 5000)] {
            let Outcome {
                result, seen, fake, ..
            } = read_in_parts(&mut spans, 30_000, mode, threads, 3 * DIRECT_ALIGN, 3, part);
            match result {
                Err(Error::Truncated { length, .. }) => assert_eq!(length, 30_000),
                other => panic!("{mode:?}: {other:?}"),
            }
            assert!(seen.is_empty(), "a target completed: {seen:?}");
            assert_eq!(fake.clobbered.load(Ordering::Relaxed), 0);
        }
    }
}

#[test]
fn a_piece_read_in_parts_goes_to_the_device_in_one_copy() {
    let chunk = 4 * DIRECT_ALIGN;
    for threads in [1, 2, 4] {
        for part in [DIRECT_ALIGN, 3000, 1] {
            let mut spans = [rows(100, 100_000, 1, 1)];
            let outcome = read_in_parts(
                &mut spans,
                120_000,
                ReadMode::Buffered,
                threads,
                chunk,
                3,
                part,
            );
            assert!(outcome.result.is_ok(), "{:?}", outcome.result);
            assert!(outcome.dst[..] == outcome.bytes[100..100_100]);
            assert!(outcome.fake.writes.lock().unwrap().iter().all(|&w| w == 1));
            assert_eq!(outcome.fake.clobbered.load(Ordering::Relaxed), 0);
            let pieces = cut(&spans, chunk).unwrap().len();
            assert_eq!(
                outcome.fake.copy_calls.load(Ordering::Relaxed),
                pieces,
                "{threads} threads, parts of {part}"
            );
        }
    }
}

#[test]
fn a_failed_copy_is_the_jobs_error_and_its_chunk_is_reused_after_the_stream() {
    let (file, _) = file_of(64 << 10);
    let fake = Fake::new(FakeState {
        fail_copy: Some(2),
        ..FakeState::default()
    });
    let mut dst = vec![0u8; 64 << 10];
    fake.dst_base
        .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; 64 << 10];
    let crew = Crew::new(ring(&fake, 3 * DIRECT_ALIGN, 2), 1).unwrap();
    let spans = [Span {
        file: 0,
        offset: 0,
        width: 64 << 10,
        rows: 1,
        pitch: 64 << 10,
        dst: dst.as_mut_ptr() as u64,
        target: 0,
    }];
    let files = vec![DataFile::open(file.path()).unwrap()];
    let pieces = cut(&spans, crew.ring().capacity()).unwrap();
    let job = Job::new(
        pieces,
        files,
        ReadMode::Buffered,
        (),
        1,
        Box::new(|_: &[usize], _: &()| Ok(())),
    );
    let error = crew.run(&Arc::new(job)).unwrap_err();
    assert!(error.to_string().contains("injected"), "{error}");
    assert_eq!(crew.ring().census().live, 2, "a chunk was lost");
}

/// A job of `spans` pieces of a fresh file, for the crew tests.
fn job_for(
    crew: &Crew<Fake>,
    dst: &mut [u8],
    sink: Box<Sink<Fake>>,
) -> (tempfile::NamedTempFile, Job<Fake>) {
    let (file, _) = file_of(dst.len());
    let span = Span {
        file: 0,
        offset: 0,
        width: dst.len() as u64,
        rows: 1,
        pitch: dst.len() as u64,
        dst: dst.as_mut_ptr() as u64,
        target: 0,
    };
    let pieces = cut(&[span], crew.ring().capacity()).unwrap();
    let files = vec![DataFile::open(file.path()).unwrap()];
    (
        file,
        Job::new(pieces, files, ReadMode::Buffered, (), 1, sink),
    )
}

#[test]
fn a_submitted_job_completes_on_the_crew_alone_and_calls_done_once() {
    let fake = Fake::default();
    let mut dst = vec![0u8; 40_000];
    fake.dst_base
        .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; dst.len()];
    let crew = Crew::new(ring(&fake, DIRECT_ALIGN, 2), 3).unwrap();
    let sinks = Arc::new(AtomicUsize::new(0));
    let dones = Arc::new(AtomicUsize::new(0));
    let (seen, finished) = (sinks.clone(), dones.clone());
    let sink = Box::new(move |_: &[usize], _: &()| {
        seen.fetch_add(1, Ordering::Relaxed);
        Ok(())
    });
    let (_file, job) = job_for(&crew, &mut dst, sink);
    let job = Arc::new(job.when_done(Box::new(move |_| {
        finished.fetch_add(1, Ordering::Relaxed);
    })));
    crew.submit(&job);
    job.wait_finished();
    assert!(job.take_error().is_none());
    assert_eq!(
        (sinks.load(Ordering::Relaxed), dones.load(Ordering::Relaxed)),
        (1, 1)
    );
    fake.drain();
    assert!(fake.writes.lock().unwrap().iter().all(|&w| w == 1));
}

#[test]
fn a_panicking_sink_fails_the_job_and_nobody_hangs() {
    let fake = Fake::default();
    let mut dst = vec![0u8; 40_000];
    fake.dst_base
        .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; dst.len()];
    let crew = Crew::new(ring(&fake, DIRECT_ALIGN, 2), 2).unwrap();
    let sink = Box::new(|_: &[usize], _: &()| -> Result<()> { panic!("a sink that panics") });
    let (_file, job) = job_for(&crew, &mut dst, sink);
    let job = Arc::new(job);
    crew.submit(&job);
    job.wait_finished();
    let error = job.take_error().expect("the job failed");
    assert!(error.to_string().contains("panicked"), "{error}");
    // The crew goes on: its threads survived the panic.
    let (_file, job) = job_for(&crew, &mut dst, Box::new(|_: &[usize], _: &()| Ok(())));
    let job = Arc::new(job);
    crew.submit(&job);
    job.wait_finished();
    assert!(job.take_error().is_none());
}

// Fault injection: every way the device can fail, against the ring's promises.

/// Memory that says when it is freed.
struct Watched(#[allow(dead_code)] Vec<u8>, Arc<AtomicBool>);
impl Drop for Watched {
    fn drop(&mut self) {
        self.1.store(true, Ordering::Relaxed);
    }
}

struct Faulty {
    result: Result<()>,
    fake: Fake,
    live: usize,
    lost: bool,
    freed: bool,
    dst: Vec<u8>,
    bytes: Vec<u8>,
    sink_calls: usize,
    /// Pieces, and calls that read past the page cache.
    pieces: usize,
    direct_reads: u64,
}

/// `len` bytes read through `count` chunks of `chunk` bytes by `threads` threads against
/// `fake`, as `mode` says, each piece read through the page cache in `parts` parts;
/// `sink_fails` makes the sink fail on its n-th call.
#[allow(clippy::too_many_arguments)]
fn faulty(
    fake: FakeState,
    len: usize,
    chunk: usize,
    count: usize,
    threads: usize,
    sink_fails: Option<usize>,
    mode: ReadMode,
    parts: usize,
) -> Faulty {
    let (file, bytes) = file_of(len);
    let fake = Fake::new(fake);
    let mut dst = vec![0u8; len];
    fake.dst_base
        .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; len];
    let freed = Arc::new(AtomicBool::new(false));
    let mut memory = vec![0u8; ReadRing::<Fake>::bytes_for(chunk, count).unwrap()];
    let start = memory.as_mut_ptr();
    // SAFETY: as in `ring_in_parts`.
    let ring = unsafe {
        ReadRing::new(
            fake.clone(),
            start,
            chunk,
            count,
            Box::new(Watched(memory, freed.clone())),
        )
    }
    .unwrap()
    .read_in_parts_of(chunk.div_ceil(parts));
    // Many small targets: one per KiB, so the sink is called often, and pieces of whole
    // blocks, so that reads past the page cache take several at a time.
    let spans: Vec<Span> = (0..len.div_ceil(1024))
        .map(|i| {
            let w = (len - i * 1024).min(1024) as u64;
            Span {
                file: 0,
                offset: (i * 1024) as u64,
                width: w,
                rows: 1,
                pitch: w,
                dst: dst.as_mut_ptr() as u64 + (i * 1024) as u64,
                target: i,
            }
        })
        .collect();
    let pieces = cut(&spans, chunk).unwrap();
    let piece_count = pieces.len();
    let calls = Arc::new(AtomicUsize::new(0));
    let sink_calls = calls.clone();
    let data_file = DataFile::open(file.path()).unwrap();
    let job = Job::new(
        pieces,
        vec![data_file.clone()],
        mode,
        (),
        spans.len(),
        Box::new(move |_: &[usize], _: &()| {
            let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
            if sink_fails == Some(n) {
                return Err(Error::Invalid("injected sink failure".into()));
            }
            Ok(())
        }),
    );
    let crew = Crew::new(ring, threads).unwrap();
    let result = crew.run(&Arc::new(job));
    let (live, lost) = {
        let c = crew.ring().census();
        (c.live, c.lost)
    };
    drop(crew);
    // Whatever is still queued runs now (the fake's "device" finishing late).
    let fake2 = fake.clone();
    if !fake2.fail_wait_stream {
        fake2.drain();
    }
    Faulty {
        result,
        fake,
        live,
        lost,
        freed: freed.load(Ordering::Relaxed),
        dst,
        bytes,
        sink_calls: sink_calls.load(Ordering::Relaxed),
        pieces: piece_count,
        direct_reads: data_file.direct_reads(),
    }
}

#[test]
fn a_sink_panicking_mid_run_loses_no_chunk() {
    for (mode, threads, parts) in modes_and(&[1, 3]) {
        let len = 200_000;
        let (file, _) = file_of(len);
        let fake = Fake::default();
        let mut dst = vec![0u8; len];
        fake.dst_base
            .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
        *fake.writes.lock().unwrap() = vec![0; len];
        let crew = Crew::new(ring_in_parts(&fake, 8192, 8, 8192 / parts), threads).unwrap();
        // A target per KiB, so that a run of pieces completes several.
        let spans: Vec<Span> = (0..len.div_ceil(1024))
            .map(|i| Span {
                file: 0,
                offset: (i * 1024) as u64,
                width: (len - i * 1024).min(1024) as u64,
                rows: 1,
                pitch: 1024,
                dst: dst.as_mut_ptr() as u64 + (i * 1024) as u64,
                target: i,
            })
            .collect();
        let pieces = cut(&spans, crew.ring().capacity()).unwrap();
        let calls = AtomicUsize::new(0);
        let sink = Box::new(move |_: &[usize], _: &()| -> Result<()> {
            let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
            assert_ne!(n, 3, "injected sink panic");
            Ok(())
        });
        let files = vec![DataFile::open(file.path()).unwrap()];
        let job = Arc::new(Job::new(pieces, files, mode, (), spans.len(), sink));
        // Submitted, not run: the crew's threads catch the panic, the caller's would not.
        crew.submit(&job);
        job.wait_finished();
        let error = job.take_error().expect("the job failed");
        assert!(error.to_string().contains("panicked"), "{error}");
        let chunks = crew.ring().census();
        assert_eq!(
            (chunks.live, chunks.lost),
            (8, false),
            "{mode:?}, {threads} threads, {parts} parts"
        );
    }
}

#[test]
fn pieces_past_the_page_cache_are_read_several_at_a_time() {
    for threads in [1, 3] {
        let f = faulty(
            FakeState::default(),
            300_000,
            8192,
            8,
            threads,
            None,
            ReadMode::Direct,
            1,
        );
        assert!(f.result.is_ok(), "{:?}", f.result);
        check_written_bytes_are_right(&f);
        assert!(f.fake.writes.lock().unwrap().iter().all(|&w| w == 1));
        // Where the file system takes direct reads at all: fewer calls than pieces, runs of
        // pieces going in one call each.
        if f.direct_reads > 0 {
            assert!(
                (f.direct_reads as usize) < f.pieces,
                "{} reads for {} pieces",
                f.direct_reads,
                f.pieces
            );
        }
        assert_eq!((f.live, f.lost), (8, false));
    }
}

/// Each of `threads` with reads through the page cache, a piece in one part or in three
/// (read by several threads), and past it (where several pieces are read in one call); the
/// third of each is the parts.
fn modes_and(threads: &[usize]) -> Vec<(ReadMode, usize, usize)> {
    [
        (ReadMode::Buffered, 1),
        (ReadMode::Buffered, 3),
        (ReadMode::Direct, 1),
    ]
    .into_iter()
    .flat_map(|(mode, parts)| threads.iter().map(move |&t| (mode, t, parts)))
    .collect()
}

fn check_written_bytes_are_right(f: &Faulty) {
    let writes = f.fake.writes.lock().unwrap();
    for (i, &w) in writes.iter().enumerate() {
        assert!(w <= 1, "byte {i} written {w} times");
        if w == 1 {
            assert_eq!(f.dst[i], f.bytes[i], "byte {i} wrong");
        }
    }
    assert_eq!(
        f.fake.clobbered.load(Ordering::Relaxed),
        0,
        "a chunk was reused under a copy"
    );
}

#[test]
fn record_fails_stream_drains_chunk_kept() {
    for (mode, threads, parts) in modes_and(&[1, 3]) {
        let f = faulty(
            FakeState {
                fail_record: Some(3),
                ..FakeState::default()
            },
            200_000,
            8192,
            3,
            threads,
            None,
            mode,
            parts,
        );
        let e = f.result.as_ref().unwrap_err().to_string();
        assert!(e.contains("injected record"), "{e}");
        assert_eq!(f.live, 3);
        assert!(!f.lost);
        assert!(f.freed, "ring memory not freed although settled");
        check_written_bytes_are_right(&f);
    }
}

#[test]
fn record_fails_stream_wait_fails_chunk_lost_memory_kept() {
    for (mode, threads, parts) in modes_and(&[1, 3]) {
        let f = faulty(
            FakeState {
                fail_record: Some(2),
                fail_wait_stream: true,
                ..FakeState::default()
            },
            200_000,
            8192,
            3,
            threads,
            None,
            mode,
            parts,
        );
        let e = f.result.as_ref().unwrap_err().to_string();
        assert!(e.contains("injected record"), "{e}");
        assert_eq!(f.live, 2, "threads {threads}");
        assert!(f.lost);
        assert!(!f.freed, "ring memory freed while a copy out of it may run");
        // (no drain: the fake's stream never finishes; nothing to check in dst)
        assert_eq!(f.fake.clobbered.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn event_wait_fails_chunk_lost_memory_kept() {
    for (mode, threads, parts) in modes_and(&[1, 3]) {
        let f = faulty(
            FakeState {
                fail_wait: Some(2),
                ..FakeState::default()
            },
            200_000,
            8192,
            2,
            threads,
            None,
            mode,
            parts,
        );
        let e = f.result.as_ref().unwrap_err().to_string();
        assert!(e.contains("injected wait"), "{e}");
        assert_eq!(f.live, 1);
        assert!(!f.freed);
        check_written_bytes_are_right(&f);
    }
}

#[test]
fn sink_fails_first_error_reported_ring_whole() {
    for (mode, threads, parts) in modes_and(&[1, 3]) {
        let f = faulty(
            FakeState::default(),
            200_000,
            8192,
            3,
            threads,
            Some(4),
            mode,
            parts,
        );
        let e = f.result.as_ref().unwrap_err().to_string();
        assert!(e.contains("injected sink"), "{e}");
        assert_eq!(f.live, 3);
        assert!(f.freed);
        assert!(f.sink_calls >= 4);
        check_written_bytes_are_right(&f);
    }
}

#[test]
fn every_chunk_lost_no_hang() {
    // One chunk; the first record fails and the stream never drains: the chunk is lost, and
    // threads waiting for a chunk must wake and fail, not hang.
    for (mode, threads, parts) in modes_and(&[1, 2, 4]) {
        let f = faulty(
            FakeState {
                fail_record: Some(1),
                fail_wait_stream: true,
                ..FakeState::default()
            },
            200_000,
            4096,
            1,
            threads,
            None,
            mode,
            parts,
        );
        let e = f.result.as_ref().unwrap_err().to_string();
        assert!(e.contains("injected record"), "first error should win: {e}");
        assert_eq!(f.live, 0);
        assert!(!f.freed);
    }
}

#[test]
fn copy_fails_with_threads_bytes_right() {
    for (mode, threads, parts) in modes_and(&[2, 4]) {
        let f = faulty(
            FakeState {
                fail_copy: Some(5),
                ..FakeState::default()
            },
            300_000,
            4096,
            2,
            threads,
            None,
            mode,
            parts,
        );
        assert!(f.result.is_err());
        assert_eq!(f.live, 2);
        assert!(f.freed);
        check_written_bytes_are_right(&f);
    }
}

#[test]
fn a_panic_reading_a_part_fails_the_job_and_leaves_nothing_behind() {
    let chunk = 4 * DIRECT_ALIGN;
    for (threads, pieces, submitted) in [
        (1, 1, true),
        (1, 1, false),
        (3, 1, true),
        (3, 6, true),
        (3, 6, false),
    ] {
        {
            let fake = Fake::default();
            let mut dst = vec![0u8; pieces * chunk];
            fake.dst_base
                .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
            *fake.writes.lock().unwrap() = vec![0; dst.len()];
            let crew = Crew::new(ring_in_parts(&fake, chunk, 2, DIRECT_ALIGN), threads).unwrap();
            let done = Arc::new(AtomicUsize::new(0));
            let counted = done.clone();
            let (_file, mut job) = job_for(&crew, &mut dst, Box::new(|_: &[usize], _: &()| Ok(())));
            // A part that is neither the first nor the last of its piece: the thread that
            // opened the piece may be the one that panics and leaves the job, after the last
            // piece was taken (one piece) or before.
            job.part_hook = Some(Box::new(|piece, part| {
                assert!(!(piece == 0 && part == 1), "injected part panic");
            }));
            let job = Arc::new(job.when_done(Box::new(move |_| {
                counted.fetch_add(1, Ordering::Relaxed);
            })));
            // The job's error: a panic on the caller's thread leaves it with the job.
            let mut returned = None;
            if submitted {
                // The crew's threads catch the panic and go on with other jobs.
                crew.submit(&job);
            } else {
                // The caller's thread reads beside them, and a panic there is its own.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| crew.run(&job)));
                if let Ok(result) = run {
                    returned = Some(result.expect_err("the job failed").to_string());
                }
            }
            let case = format!("{threads} threads, {pieces} pieces, submitted: {submitted}");
            assert!(finishes(&job), "{case}: the job never finished");
            let error = returned
                .or_else(|| {
                    job.error()
                        .map(|error| cuda_pinned::ErrorChain(&*error).to_string())
                })
                .expect("the job failed");
            assert!(error.contains("panicked"), "{case}: {error}");
            assert_eq!(done.load(Ordering::Relaxed), 1, "{case}");
            let chunks = crew.ring().census();
            assert_eq!(
                (chunks.free, chunks.live, chunks.lost),
                (2, 2, false),
                "{case}"
            );
        }
    }
}

#[test]
fn a_job_completes_once_however_its_last_counts_interleave() {
    let fake = Fake::default();
    let mut dst = vec![0u8; 100];
    let crew = Crew::new(ring(&fake, DIRECT_ALIGN, 1), 1).unwrap();
    let (_file, job) = job_for(&crew, &mut dst, Box::new(|_: &[usize], _: &()| Ok(())));
    let done = Arc::new(AtomicUsize::new(0));
    let counted = done.clone();
    let job = job.when_done(Box::new(move |_| {
        counted.fetch_add(1, Ordering::Relaxed);
    }));
    job.count_finished(job.pieces.len());
    // A count of nothing after the job completed (an opened piece's taker, late).
    job.count_finished(0);
    assert_eq!(done.load(Ordering::Relaxed), 1);
}

#[test]
fn reads_through_the_page_cache_write_nothing_outside_their_piece() {
    const CANARY: u8 = 0xA5;
    let chunk = 4 * DIRECT_ALIGN;
    for threads in [1, 3] {
        for part in [1000, 3000, DIRECT_ALIGN] {
            let (file, _) = file_of(50_000);
            let fake = Fake::default();
            // One piece of a length no part size divides, into a ring of one chunk.
            let (offset, len) = (1234usize, 9_500usize);
            let mut dst = vec![0u8; len];
            fake.dst_base
                .store(dst.as_mut_ptr() as usize, Ordering::Relaxed);
            *fake.writes.lock().unwrap() = vec![0; len];
            let mut memory = vec![CANARY; ReadRing::<Fake>::bytes_for(chunk, 1).unwrap()];
            let (start, bytes) = (memory.as_mut_ptr(), memory.len());
            // SAFETY: as in `ring_in_parts`.
            let ring = unsafe { ReadRing::new(fake.clone(), start, chunk, 1, Box::new(memory)) }
                .unwrap()
                .read_in_parts_of(part);
            let crew = Crew::new(ring, threads).unwrap();
            let span = rows(offset as u64, len as u64, 1, 1);
            let span = Span {
                dst: dst.as_mut_ptr() as u64,
                ..span
            };
            let pieces = cut(&[span], chunk).unwrap();
            assert_eq!(pieces.len(), 1);
            let files = vec![DataFile::open(file.path()).unwrap()];
            let job = Job::new(
                pieces,
                files,
                ReadMode::Buffered,
                (),
                1,
                Box::new(|_: &[usize], _: &()| Ok(())),
            );
            crew.run(&Arc::new(job)).unwrap();
            fake.drain();
            // SAFETY: the ring's memory, alive while the crew is; its job is over and its
            // copies have run, so nobody writes it now.
            let memory = unsafe { std::slice::from_raw_parts(start, bytes) };
            let piece = start.align_offset(DIRECT_ALIGN) + offset % DIRECT_ALIGN;
            let outside = (memory.iter().enumerate())
                .filter(|&(i, &byte)| !(piece..piece + len).contains(&i) && byte != CANARY)
                .count();
            assert_eq!(outside, 0, "{threads} threads, parts of {part}");
        }
    }
}

#[test]
fn the_first_target_is_queued_before_the_pieces_after_it() {
    // Six pieces read by four threads through a ring of eight chunks, the first two of them
    // the first target's, the first piece read late: the other four wait for the lead (half
    // the ring), and the first target is queued first.
    let (chunks, lead) = (8, 2);
    let chunk = 4 * DIRECT_ALIGN;
    let (file, bytes) = file_of(6 * chunk);
    let fake = Fake::default();
    let mut dst = vec![0u8; 6 * chunk];
    let base = dst.as_mut_ptr() as u64;
    fake.dst_base.store(base as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; dst.len()];
    let crew = Crew::new(ring_in_parts(&fake, chunk, chunks, DIRECT_ALIGN), 4).unwrap();
    let split = (lead * chunk) as u64;
    let rest = (6 * chunk) as u64 - split;
    let spans = [rows(0, split, 1, split), rows(split, rest, 1, rest)];
    let mut spans = spans.map(|span| Span {
        dst: base + span.offset,
        ..span
    });
    spans[1].target = 1;
    *fake.target_starts.lock().unwrap() = spans.iter().map(|span| span.dst).collect();
    let pieces = cut(&spans, chunk).unwrap();
    assert_eq!(pieces.len(), 6);
    // For each sink call: its targets, and the copies queued by then.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (sink_seen, sink_fake) = (seen.clone(), fake.clone());
    let copies_queued = |fake: &Fake| -> Vec<usize> {
        (fake.queued.lock().unwrap().iter())
            .map(|copy| copy.target)
            .collect()
    };
    let mut job = Job::new(
        pieces,
        vec![DataFile::open(file.path()).unwrap()],
        ReadMode::Buffered,
        (),
        2,
        Box::new(move |targets: &[usize], _: &()| {
            let queued = copies_queued(&sink_fake);
            sink_seen.lock().unwrap().push((targets.to_vec(), queued));
            Ok(())
        }),
    );
    // The first piece is read late: the pieces after the first target are filled before it.
    job.part_hook = Some(Box::new(|piece, _| {
        if piece == 0 {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }));
    crew.run(&Arc::new(job)).unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let (first_targets, queued_by_then) = &seen[0];
    assert_eq!(first_targets, &[0], "{seen:?}");
    assert_eq!(
        queued_by_then,
        &vec![0; lead],
        "the first target waited behind: {seen:?}"
    );
    let order: Vec<usize> = (0..6).map(|piece| usize::from(piece >= lead)).collect();
    assert_eq!(copies_queued(&fake), order, "{chunks} chunks");
    fake.drain();
    assert!(dst == bytes);
    assert!(fake.writes.lock().unwrap().iter().all(|&w| w == 1));
    assert_eq!(fake.clobbered.load(Ordering::Relaxed), 0);
    let ring = crew.ring().census();
    assert_eq!((ring.free, ring.parked), (chunks, 0));
}

/// A job of three targets of two chunks each, at offsets from a destination named later, on
/// a crew of three threads over a ring of `chunks` chunks; the file's bytes, and how many
/// times `done` was called.
struct ToCome {
    _file: tempfile::NamedTempFile,
    bytes: Vec<u8>,
    fake: Fake,
    crew: Crew<Fake>,
    job: Arc<Job<Fake>>,
    done: Arc<AtomicUsize>,
}

fn job_to_come(chunks: usize) -> ToCome {
    let chunk = 4 * DIRECT_ALIGN;
    let (file, bytes) = file_of(6 * chunk);
    let fake = Fake::default();
    let crew = Crew::new(ring_in_parts(&fake, chunk, chunks, DIRECT_ALIGN), 3).unwrap();
    let width = 2 * chunk as u64;
    let spans: Vec<Span> = (0..3)
        .map(|target| Span {
            dst: target as u64 * width,
            target,
            ..rows(target as u64 * width, width, 1, width)
        })
        .collect();
    let pieces = cut(&spans, chunk).unwrap();
    let files = vec![DataFile::open(file.path()).unwrap()];
    let done = Arc::new(AtomicUsize::new(0));
    let counted = done.clone();
    let job =
        Job::to_come(pieces, files, ReadMode::Buffered, (), 3).when_done(Box::new(move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
        }));
    ToCome {
        _file: file,
        bytes,
        fake,
        crew,
        job: Arc::new(job),
        done,
    }
}

/// Waits until `count` pieces of `job` are parked.
fn until_parked(job: &Job<Fake>, count: usize) {
    let start = std::time::Instant::now();
    while job.lead.waiting().parked.len() < count {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "never parked"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn a_job_reads_its_lead_before_its_destination_is_named_then_queues_in_order() {
    let ToCome {
        _file,
        bytes,
        fake,
        crew,
        job,
        done,
    } = job_to_come(8);
    crew.submit(&job);
    // The first target's two pieces are read, each into a chunk of its own, and wait; the
    // threads read no further.
    until_parked(&job, 2);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(job.lead.waiting().parked.len(), 2);
    assert_eq!(job.next.load(Ordering::Relaxed), 2);
    assert_eq!(fake.copy_calls.load(Ordering::Relaxed), 0);
    let mut dst = vec![0u8; bytes.len()];
    let base = dst.as_mut_ptr() as u64;
    fake.dst_base.store(base as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; dst.len()];
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink_seen = seen.clone();
    let sink = Box::new(move |targets: &[usize], _: &()| {
        sink_seen.lock().unwrap().extend_from_slice(targets);
        Ok(())
    });
    crew.arrive(
        &job,
        Destination {
            bases: Bases::One(base),
            sink,
        },
    );
    job.wait_finished();
    // Every copy runs before anything can fail: none may run once `dst` is gone.
    fake.drain();
    assert!(job.take_error().is_none());
    assert_eq!(done.load(Ordering::Relaxed), 1);
    // The first target first; the others as their pieces were read.
    let mut seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0], 0, "{seen:?}");
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2]);
    let mut queued: Vec<u64> = (fake.queued.lock().unwrap().iter())
        .map(|copy| copy.dst - base)
        .collect();
    // The waiting pieces first, in order.
    let chunk = 4 * DIRECT_ALIGN as u64;
    assert_eq!(queued[..2], [0, chunk]);
    queued.sort_unstable();
    assert_eq!(queued, (0..6).map(|i| i * chunk).collect::<Vec<_>>());
    assert!(dst == bytes);
    assert!(fake.writes.lock().unwrap().iter().all(|&w| w == 1));
    let chunks = crew.ring().census();
    assert_eq!((chunks.free, chunks.parked), (8, 0));
}

#[test]
fn a_job_whose_destination_never_comes_gives_its_chunks_back_and_completes() {
    // Two chunks for six pieces: the crew's threads wait for chunks that pieces hold.
    let ToCome {
        _file,
        fake,
        crew,
        job,
        done,
        ..
    } = job_to_come(2);
    crew.submit(&job);
    until_parked(&job, 2);
    crew.abandon(&job, Error::Invalid("the destination never came".into()));
    assert!(finishes(&job), "the job never finished");
    let error = job.take_error().expect("the job failed").to_string();
    assert!(error.contains("never came"), "{error}");
    assert_eq!(done.load(Ordering::Relaxed), 1);
    assert_eq!(fake.copy_calls.load(Ordering::Relaxed), 0);
    let chunks = crew.ring().census();
    assert_eq!((chunks.free, chunks.live, chunks.parked), (2, 2, 0));
}

#[test]
fn a_job_without_pieces_completes_once_named_or_abandoned() {
    for named in [true, false] {
        let fake = Fake::default();
        let crew = Crew::new(ring(&fake, DIRECT_ALIGN, 2), 2).unwrap();
        // One target without bytes.
        let job = Arc::new(Job::to_come(
            Vec::new(),
            Vec::new(),
            ReadMode::Buffered,
            (),
            1,
        ));
        crew.submit(&job);
        let seen = Arc::new(Mutex::new(Vec::new()));
        if named {
            let sink_seen = seen.clone();
            let sink = Box::new(move |targets: &[usize], _: &()| {
                sink_seen.lock().unwrap().extend_from_slice(targets);
                Ok(())
            });
            crew.arrive(
                &job,
                Destination {
                    bases: Bases::One(0),
                    sink,
                },
            );
        } else {
            let error = Error::Invalid("the destination never came".into());
            crew.abandon(&job, error);
        }
        assert!(finishes(&job), "named: {named}: the job never finished");
        assert_eq!(job.take_error().is_none(), named);
        assert_eq!(*seen.lock().unwrap(), if named { vec![0] } else { vec![] });
    }
}

/// Whether `job` finishes within 20 seconds (a thread of its own waits for it, left behind if
/// it does not).
fn finishes(job: &Arc<Job<Fake>>) -> bool {
    let (sender, receiver) = std::sync::mpsc::channel();
    let waiting = job.clone();
    std::thread::spawn(move || {
        waiting.wait_finished();
        let _ = sender.send(());
    });
    receiver
        .recv_timeout(std::time::Duration::from_secs(20))
        .is_ok()
}

#[test]
fn a_job_named_late_completes_after_what_naming_it_does() {
    // Two pieces, the first read in two parts, and a target without bytes whose sink fails.
    let chunk = 4 * DIRECT_ALIGN;
    let (file, _) = file_of(2 * chunk);
    let fake = Fake::default();
    let mut dst = vec![0u8; 2 * chunk];
    let base = dst.as_mut_ptr() as u64;
    fake.dst_base.store(base as usize, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; dst.len()];
    let crew = Crew::new(ring_in_parts(&fake, chunk, 4, 2 * DIRECT_ALIGN), 1).unwrap();
    let width = chunk as u64;
    let spans: Vec<Span> = [(0, width), (width, width), (2 * width, 0)]
        .into_iter()
        .enumerate()
        .map(|(target, (at, width))| Span {
            dst: at,
            target,
            ..rows(at, width, 1, width)
        })
        .collect();
    let pieces = cut(&spans, chunk).unwrap();
    let files = vec![DataFile::open(file.path()).unwrap()];
    let mut job = Job::to_come(pieces, files, ReadMode::Buffered, (), 3);
    // The first part is read once the destination is set.
    let (reading, read) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (hook_reading, hook_read) = (reading.clone(), read.clone());
    job.part_hook = Some(Box::new(move |piece, part| {
        if (piece, part) == (0, 0) {
            hook_reading.store(true, Ordering::SeqCst);
            while !hook_read.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
        }
    }));
    let completed = Arc::new(Mutex::new(Vec::new()));
    let at_done = Arc::new(Mutex::new(None));
    let (seen, saw) = (completed.clone(), at_done.clone());
    let job = Arc::new(job.when_done(Box::new(move |job: &Job<Fake>| {
        *saw.lock().unwrap() = Some((
            job.error()
                .map(|error| cuda_pinned::ErrorChain(&*error).to_string()),
            seen.lock().unwrap().clone(),
        ));
    })));
    crew.submit(&job);
    let wait = |what: &str, until: &dyn Fn() -> bool| {
        let start = std::time::Instant::now();
        while !until() {
            assert!(start.elapsed().as_secs() < 20, "never {what}");
            std::thread::yield_now();
        }
    };
    wait("reading", &|| reading.load(Ordering::SeqCst));
    // The naming thread stops where it wakes the crew, its destination set: the crew's
    // thread counts every piece meanwhile.
    let gate = job.arrival.hold_gate();
    std::thread::scope(|scope| {
        let sink_seen = completed.clone();
        let sink = Box::new(move |targets: &[usize], _: &()| {
            sink_seen.lock().unwrap().extend_from_slice(targets);
            match targets.contains(&2) {
                true => Err(Error::Invalid("no room for the empty target".into())),
                false => Ok(()),
            }
        });
        let naming = scope.spawn(|| {
            crew.arrive(
                &job,
                Destination {
                    bases: Bases::One(base),
                    sink,
                },
            )
        });
        wait("named", &|| job.named());
        read.store(true, Ordering::SeqCst);
        wait("counted", &|| job.outcome.pieces() == 2);
        drop(gate);
        naming.join().unwrap();
    });
    assert!(finishes(&job), "the job never finished");
    fake.drain();
    let (error, completed) = at_done.lock().unwrap().clone().expect("done ran");
    assert!(error.is_some_and(|error| error.contains("no room")));
    assert!(completed.contains(&2), "{completed:?}");
}
