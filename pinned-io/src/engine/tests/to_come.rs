//! Jobs whose destination comes late, or never: the lead read first and parked, then
//! queued in order once named; chunks given back when abandoned.

use super::*;

/// A job of three targets of two chunks each, at offsets from a destination named later, on
/// a crew of three threads over a ring of `chunks` chunks; the file's bytes, and how many
/// times `done` was called.
struct ToCome {
    _file: tempfile::NamedTempFile,
    bytes: Vec<u8>,
    fake: Fake,
    crew: Engine<Fake>,
    job: Arc<Job<Fake>>,
    done: Arc<AtomicUsize>,
}

fn job_to_come(chunks: usize) -> ToCome {
    let chunk = 4 * DIRECT_ALIGN;
    let (file, bytes) = file_of(6 * chunk);
    let fake = Fake::default();
    let crew = Engine::new(ring_in_parts(&fake, chunk, chunks, DIRECT_ALIGN), 3).unwrap();
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
        let crew = Engine::new(ring(&fake, DIRECT_ALIGN, 2), 2).unwrap();
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
    let crew = Engine::new(ring_in_parts(&fake, chunk, 4, 2 * DIRECT_ALIGN), 1).unwrap();
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
