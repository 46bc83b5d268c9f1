//! The crew against random cases: 1–8 threads, rings of 1–4 small chunks, parts down to a
//! byte, 1–3 jobs at once on one crew (run by their caller or submitted, with their
//! destination named at once, a little later, or never), every read mode, and one injected
//! fault: a sink, copy, record or event wait that fails, or a sink, copy or part read that
//! panics. Whatever happens, every job completes once (no hang), no target
//! completes twice, no chunk is missing or reused under a copy, no byte lands twice or
//! wrong, and a failed job reports the injected fault (or the chunks it lost, to the other
//! jobs).

use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

/// A small, seeded generator: each case is a seed, so a failing one is reproduced from it.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A call number from 1 to `n`.
    fn call(&mut self, n: usize) -> Option<usize> {
        Some(1 + self.below(n))
    }
}

#[derive(Debug, Default)]
struct Faults {
    sink_fails: Option<usize>,
    sink_panics: Option<usize>,
    part_panics: Option<usize>,
    copy_fails: Option<usize>,
    copy_panics: Option<usize>,
    record_fails: Option<usize>,
    wait_fails: Option<usize>,
    /// With `wait_fails`: no stream wait succeeds either (chunks are lost).
    stream_never_drains: bool,
}

impl Faults {
    fn any(&self) -> bool {
        self.sink_fails.is_some()
            || self.sink_panics.is_some()
            || self.part_panics.is_some()
            || self.copy_fails.is_some()
            || self.copy_panics.is_some()
            || self.record_fails.is_some()
            || self.wait_fails.is_some()
    }
}

#[derive(Debug)]
struct Case {
    seed: u64,
    threads: usize,
    chunk: usize,
    chunks: usize,
    part: usize,
    /// Bytes each job reads.
    len: usize,
    jobs: usize,
    submitted: bool,
    mode: ReadMode,
    faults: Faults,
    /// For submitted jobs: when their destination is named.
    named: Named,
}

/// When a submitted job's destination is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Named {
    AtOnce,
    /// After the job is submitted, this many microseconds later.
    Later(u64),
    /// Never: the job is abandoned (an injected fault), this many microseconds later.
    Never(u64),
}

impl Case {
    fn from_seed(seed: u64, with_faults: bool) -> Self {
        let mut r = Rng::new(seed);
        let chunk = (1 + r.below(3)) * DIRECT_ALIGN;
        let part = match r.below(4) {
            0 => 1 + r.below(64),
            1 => 1 + r.below(chunk),
            2 => chunk / 2,
            _ => chunk.div_ceil(1 + r.below(6)),
        };
        let mut faults = Faults::default();
        if with_faults {
            match r.below(7) {
                0 => faults.sink_fails = r.call(10),
                1 => faults.sink_panics = r.call(10),
                2 => faults.part_panics = r.call(20),
                3 => faults.copy_fails = r.call(10),
                4 => faults.copy_panics = r.call(10),
                5 => faults.record_fails = r.call(10),
                _ => {
                    faults.wait_fails = r.call(10);
                    faults.stream_never_drains = r.below(3) == 0;
                }
            }
        }
        Case {
            seed,
            threads: 1 + r.below(8),
            chunk,
            chunks: 1 + r.below(4),
            part,
            len: 1 + r.below(60_000),
            jobs: 1 + r.below(3),
            submitted: r.below(2) == 0,
            mode: [ReadMode::Buffered, ReadMode::Auto, ReadMode::Direct][r.below(3)],
            faults,
            named: match r.below(4) {
                0 | 1 => Named::AtOnce,
                2 => Named::Later(r.below(300) as u64),
                _ if with_faults => Named::Never(r.below(300) as u64),
                _ => Named::Later(r.below(300) as u64),
            },
        }
    }

    /// Whether a fault is injected: one of `faults`, or a destination never named.
    fn faulty(&self) -> bool {
        self.faults.any() || matches!(self.named, Named::Never(_))
    }
}

/// What one job ended with.
struct JobOutcome {
    /// The job's result, or `Err` when its caller panicked out of `run`.
    result: std::result::Result<Result<()>, ()>,
    done_calls: usize,
    /// Whether the job had an error when `done` was called.
    done_saw_error: bool,
    completed: Vec<usize>,
    targets: usize,
}

/// Runs `case`; `Err` describes the properties it broke (or the hang).
fn run_case(case: &Case) -> std::result::Result<(), String> {
    let faults = &case.faults;
    let total = case.len * case.jobs;
    let (file, bytes) = file_of(total);
    let fake = Fake::new(FakeState {
        fail_copy: faults.copy_fails,
        panic_copy: faults.copy_panics,
        fail_record: faults.record_fails,
        fail_wait: faults.wait_fails,
        fail_wait_stream: faults.stream_never_drains,
        ..FakeState::default()
    });
    let mut dst = vec![0u8; total];
    let dst_base = dst.as_mut_ptr() as usize;
    fake.dst_base.store(dst_base, Ordering::Relaxed);
    *fake.writes.lock().unwrap() = vec![0; total];
    let ring = ring_in_parts(&fake, case.chunk, case.chunks, case.part);
    let crew = Arc::new(Engine::new(ring, case.threads).unwrap());
    let sink_calls = Arc::new(AtomicUsize::new(0));
    let part_reads = Arc::new(AtomicUsize::new(0));
    let data_file = DataFile::open(file.path()).unwrap();
    let (outcome, outcomes) = mpsc::channel();
    let mut threads = Vec::new();
    for j in 0..case.jobs {
        let named = if case.submitted {
            case.named
        } else {
            Named::AtOnce
        };
        // Copies go to addresses, or to offsets from a destination named later.
        let base = if named == Named::AtOnce { dst_base } else { 0 };
        // Targets of random widths covering this job's bytes.
        let mut r = Rng::new(case.seed ^ (j as u64 + 1));
        let mut spans = Vec::new();
        let mut at = 0;
        while at < case.len {
            // Now and then a target without bytes, completed without a piece.
            let width = match r.below(16) {
                0 => 0,
                _ => (1 + r.below(9000)).min(case.len - at),
            };
            spans.push(Span {
                file: 0,
                offset: (j * case.len + at) as u64,
                width: width as u64,
                rows: 1,
                pitch: width as u64,
                dst: (base + j * case.len + at) as u64,
                target: spans.len(),
            });
            at += width;
        }
        let targets = spans.len();
        let pieces = cut(&spans, case.chunk).unwrap();
        let completed = Arc::new(Mutex::new(Vec::new()));
        let (sink_completed, calls) = (completed.clone(), sink_calls.clone());
        let (fails, panics) = (faults.sink_fails, faults.sink_panics);
        let sink: Box<Sink<Fake>> = Box::new(move |targets: &[usize], _: &()| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            assert_ne!(panics, Some(n), "injected sink panic");
            if fails == Some(n) {
                return Err(Error::Invalid("injected sink failure".into()));
            }
            sink_completed.lock().unwrap().extend_from_slice(targets);
            Ok(())
        });
        let files = vec![data_file.clone()];
        let (mut job, mut sink) = if named == Named::AtOnce {
            (Job::new(pieces, files, case.mode, (), targets, sink), None)
        } else {
            let job = Job::to_come(pieces, files, case.mode, (), targets);
            (job, Some(sink))
        };
        let (reads, panics) = (part_reads.clone(), faults.part_panics);
        job.part_hook = Some(Box::new(move |_, _| {
            let n = reads.fetch_add(1, Ordering::SeqCst) + 1;
            assert_ne!(panics, Some(n), "injected part panic");
        }));
        let done_calls = Arc::new(AtomicUsize::new(0));
        let done_saw_error = Arc::new(AtomicBool::new(false));
        let (counted, saw) = (done_calls.clone(), done_saw_error.clone());
        let job = Arc::new(job.when_done(Box::new(move |job: &Job<Fake>| {
            saw.store(
                job.error()
                    .map(|error| cuda_pinned::ErrorChain(&*error).to_string())
                    .is_some(),
                Ordering::SeqCst,
            );
            counted.fetch_add(1, Ordering::SeqCst);
        })));
        let (crew, outcome, submitted) = (crew.clone(), outcome.clone(), case.submitted);
        threads.push(std::thread::spawn(move || {
            let result = if submitted {
                crew.submit(&job);
                // Naming the destination queues what waited for it, on this thread: a copy or
                // a sink may panic here.
                let naming =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match named {
                        Named::AtOnce => {}
                        Named::Later(micros) => {
                            std::thread::sleep(Duration::from_micros(micros));
                            let sink = sink.take().expect("named once");
                            let base = dst_base as u64;
                            crew.arrive(
                                &job,
                                Destination {
                                    bases: Bases::One(base),
                                    sink,
                                },
                            );
                        }
                        Named::Never(micros) => {
                            std::thread::sleep(Duration::from_micros(micros));
                            let error = Error::Invalid("injected: no destination".into());
                            crew.abandon(&job, error);
                        }
                    }));
                job.wait_finished();
                match naming {
                    Ok(()) => Ok(job.take_error().map_or(Ok(()), Err)),
                    Err(panic) => {
                        // A panic's payload may panic when dropped: leaked.
                        std::mem::forget(panic);
                        Err(())
                    }
                }
            } else {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| crew.run(&job)));
                run.map_err(|panic| {
                    // A panic's payload may panic when dropped: leaked.
                    std::mem::forget(panic);
                    // The caller panicked out of `run`: the job still completes.
                    job.wait_finished();
                })
            };
            let _ = outcome.send(JobOutcome {
                result,
                done_calls: done_calls.load(Ordering::SeqCst),
                done_saw_error: done_saw_error.load(Ordering::SeqCst),
                completed: completed.lock().unwrap().clone(),
                targets,
            });
        }));
    }
    drop(outcome);
    let mut ended = Vec::new();
    for _ in 0..case.jobs {
        let Ok(job) = outcomes.recv_timeout(Duration::from_secs(20)) else {
            let chunks = crew.ring().census();
            let hang = format!(
                "a job never completed; ring: {} free, {} live, lost: {}; {} sink calls, {} parts \
                 read",
                chunks.free,
                chunks.live,
                chunks.lost,
                sink_calls.load(Ordering::SeqCst),
                part_reads.load(Ordering::SeqCst)
            );
            // Threads may still use all of it: leaked.
            std::mem::forget((dst, crew, file));
            return Err(hang);
        };
        ended.push(job);
    }
    for thread in threads {
        thread
            .join()
            .map_err(|_| "a job's thread panicked".to_string())?;
    }
    let (free, live, lost) = {
        let chunks = crew.ring().census();
        (chunks.free, chunks.live, chunks.lost)
    };
    drop(crew);
    if !faults.stream_never_drains {
        fake.drain();
    }
    let mut broken = Vec::new();
    if free != live {
        broken.push(format!("{free} chunks free of {live} live"));
    }
    for job in &ended {
        if job.done_calls != 1 {
            broken.push(format!("done called {} times", job.done_calls));
        }
        // `done` runs once every piece is counted, and a failure is the job's before its
        // pieces are: `done` sees the job's outcome.
        if let Ok(result) = &job.result
            && result.is_err() != job.done_saw_error
        {
            broken.push(format!("done saw an error: {}", job.done_saw_error));
        }
        let mut completed = job.completed.clone();
        completed.sort_unstable();
        let count = completed.len();
        completed.dedup();
        if completed.len() != count {
            broken.push("a target completed twice".into());
        }
        match &job.result {
            Ok(Ok(())) if count != job.targets => {
                broken.push(format!("{count} of {} targets completed", job.targets));
            }
            Ok(Err(error)) if !case.faulty() => broken.push(format!("failed: {error}")),
            Err(()) if !case.faulty() => broken.push("the caller panicked".into()),
            Ok(Err(error)) => {
                let error = error.to_string();
                // Another job's fault may lose the chunks this one waits for.
                let others = case.jobs > 1 && lost && error.contains("every chunk");
                if !(error.contains("injected") || error.contains("panicked") || others) {
                    broken.push(format!("not the injected error: {error}"));
                }
            }
            _ => {}
        }
    }
    if fake.clobbered.load(Ordering::Relaxed) != 0 {
        broken.push("a chunk was reused under a copy".into());
    }
    let writes = fake.writes.lock().unwrap();
    if writes.iter().any(|&w| w > 1) {
        broken.push("a byte written twice".into());
    }
    if !case.faulty() && writes.iter().any(|&w| w != 1) {
        broken.push("a byte not written".into());
    }
    if !faults.stream_never_drains
        && let Some(at) = (0..total).find(|&i| writes[i] == 1 && dst[i] != bytes[i])
    {
        broken.push(format!("wrong byte at {at}"));
    }
    if broken.is_empty() {
        Ok(())
    } else {
        Err(broken.join("; "))
    }
}

/// Keeps the expected panics of this module quiet (others still print).
fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = (info.payload().downcast_ref::<String>().map(String::as_str))
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            // A failed case's report may quote the injected fault: it is shown.
            if !message.contains("injected") || message.starts_with("Test failed") {
                previous(info);
            }
        }));
    });
}

/// Cases per test: `PROPTEST_CASES` where set (for longer runs), else 200.
fn cases() -> u32 {
    (std::env::var("PROPTEST_CASES").ok())
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(200)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn random_cases_land_every_byte_once(seed in any::<u64>()) {
        let case = Case::from_seed(seed, false);
        let outcome = run_case(&case);
        prop_assert!(outcome.is_ok(), "{:?}: {}", case, outcome.unwrap_err());
    }

    #[test]
    fn random_faults_fail_their_job_and_leave_the_crew_whole(seed in any::<u64>()) {
        quiet_injected_panics();
        let case = Case::from_seed(seed, true);
        let outcome = run_case(&case);
        prop_assert!(outcome.is_ok(), "{:?}: {}", case, outcome.unwrap_err());
    }
}
