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

mod faults;
mod random_faults;
mod to_come;

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

    fn enqueue<R>(
        &self,
        stream: &(),
        work: impl FnOnce(&()) -> cuda_pinned::Result<R>,
    ) -> cuda_pinned::Result<R> {
        work(stream)
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
    let crew = Engine::new(ring_in_parts(&fake, chunk, count, part), threads).unwrap();
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
    let crew = Engine::new(ring(&fake, 3 * DIRECT_ALIGN, 2), 1).unwrap();
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
    crew: &Engine<Fake>,
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
    let crew = Engine::new(ring(&fake, DIRECT_ALIGN, 2), 3).unwrap();
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
    let crew = Engine::new(ring(&fake, DIRECT_ALIGN, 2), 2).unwrap();
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

#[test]
fn a_job_completes_once_however_its_last_counts_interleave() {
    let fake = Fake::default();
    let mut dst = vec![0u8; 100];
    let crew = Engine::new(ring(&fake, DIRECT_ALIGN, 1), 1).unwrap();
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
            let crew = Engine::new(ring, threads).unwrap();
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
    let crew = Engine::new(ring_in_parts(&fake, chunk, chunks, DIRECT_ALIGN), 4).unwrap();
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
