//! Faults of the device, the sink and the threads, one read each: what the job reports and
//! what is left of the ring.

use super::*;

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
    let crew = Engine::new(ring, threads).unwrap();
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
        let crew = Engine::new(ring_in_parts(&fake, 8192, 8, 8192 / parts), threads).unwrap();
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

/// A fault, the read it hits, and what the job and the ring must look like after it.
struct FaultCase {
    name: &'static str,
    fake: fn() -> FakeState,
    /// The file's bytes, the ring's chunk bytes and chunks, and the crews' threads tried.
    len: usize,
    chunk: usize,
    chunks: usize,
    threads: &'static [usize],
    /// The sink's call that fails, if any.
    sink_fails: Option<usize>,
    /// What the job's error says (the first fault's), where that is known.
    error: Option<&'static str>,
    /// The ring after: chunks live, whether one was lost, whether its memory was freed.
    live: usize,
    lost: bool,
    freed: bool,
    /// Whether the fake's stream drains (else the bytes that landed cannot be checked).
    drains: bool,
    /// The sink's calls, at least.
    sink_calls: usize,
}

/// A read of 200,000 bytes through three chunks of 8 KiB, by one thread or three, that
/// fails and leaves the ring whole: what the cases below change.
const FAULT: FaultCase = FaultCase {
    name: "",
    fake: FakeState::default,
    len: 200_000,
    chunk: 8192,
    chunks: 3,
    threads: &[1, 3],
    sink_fails: None,
    error: None,
    live: 3,
    lost: false,
    freed: true,
    drains: true,
    sink_calls: 0,
};

/// Faults of the device and of the sink, one read each.
const FAULTS: &[FaultCase] = &[
    FaultCase {
        name: "a record fails, the stream drains: the chunk is kept",
        fake: || FakeState {
            fail_record: Some(3),
            ..FakeState::default()
        },
        error: Some("injected record"),
        ..FAULT
    },
    FaultCase {
        name: "a record fails, the stream is not waited for: the chunk lost, the memory kept",
        fake: || FakeState {
            fail_record: Some(2),
            fail_wait_stream: true,
            ..FakeState::default()
        },
        error: Some("injected record"),
        live: 2,
        lost: true,
        freed: false,
        drains: false,
        ..FAULT
    },
    FaultCase {
        name: "a chunk's event is not waited for: the chunk lost, the memory kept",
        fake: || FakeState {
            fail_wait: Some(2),
            ..FakeState::default()
        },
        chunks: 2,
        error: Some("injected wait"),
        live: 1,
        lost: true,
        freed: false,
        ..FAULT
    },
    FaultCase {
        name: "the sink fails: the first error is reported, the ring stays whole",
        sink_fails: Some(4),
        error: Some("injected sink"),
        sink_calls: 4,
        ..FAULT
    },
    FaultCase {
        // The threads waiting for a chunk must wake and fail, not hang.
        name: "the one chunk is lost (a record fails, the stream never drains)",
        fake: || FakeState {
            fail_record: Some(1),
            fail_wait_stream: true,
            ..FakeState::default()
        },
        chunk: 4096,
        chunks: 1,
        threads: &[1, 2, 4],
        error: Some("injected record"),
        live: 0,
        lost: true,
        freed: false,
        drains: false,
        ..FAULT
    },
    FaultCase {
        name: "a copy fails among several threads: the bytes that landed are right",
        fake: || FakeState {
            fail_copy: Some(5),
            ..FakeState::default()
        },
        len: 300_000,
        chunk: 4096,
        chunks: 2,
        threads: &[2, 4],
        error: Some("injected copy"),
        live: 2,
        ..FAULT
    },
];

#[test]
fn each_fault_fails_its_job_and_leaves_the_ring_as_it_must() {
    for case in FAULTS {
        for (mode, threads, parts) in modes_and(case.threads) {
            let at = format!("{}: {mode:?}, {threads} threads, {parts} parts", case.name);
            let f = faulty(
                (case.fake)(),
                case.len,
                case.chunk,
                case.chunks,
                threads,
                case.sink_fails,
                mode,
                parts,
            );
            let error = f.result.as_ref().expect_err(&at).to_string();
            if let Some(text) = case.error {
                assert!(error.contains(text), "{at}: {error}");
            }
            assert_eq!(
                (f.live, f.lost, f.freed),
                (case.live, case.lost, case.freed),
                "{at}: chunks live, lost, memory freed"
            );
            assert!(
                f.sink_calls >= case.sink_calls,
                "{at}: {} sink calls",
                f.sink_calls
            );
            if case.drains {
                check_written_bytes_are_right(&f);
            } else {
                assert_eq!(f.fake.clobbered.load(Ordering::Relaxed), 0, "{at}");
            }
        }
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
            let crew = Engine::new(ring_in_parts(&fake, chunk, 2, DIRECT_ALIGN), threads).unwrap();
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
