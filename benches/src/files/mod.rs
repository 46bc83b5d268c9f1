//! `files`: safetensors checkpoints from a file to the GPU — one of 205 large bf16 tensors
//! and one of 2,000 small ones, then the shapes of `shapes.rs` — warm (in the page cache)
//! and cold (cache dropped, where the process may), against in the same run: page-locked
//! H2D, the disk's `O_DIRECT` ceiling, an mmap with one pageable copy per tensor, the file
//! read into a `Vec` and one copy, and the peers of `peers.rs` where `python3` has them.

use std::mem::MaybeUninit;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
use pinned_io::{Checkpoint, FileReader, LoadOptions, ReaderConfig};

use pinned_bench::goals::{
    FILES_ALLOCATION_BACK_TO_BACK_ROW as ALLOCATION_BACK_TO_BACK_ROW,
    FILES_ALLOCATION_SETTLED_ROW as ALLOCATION_SETTLED_ROW,
    FILES_FIRST_BACK_TO_BACK_ROW as FIRST_BACK_TO_BACK_ROW,
    FILES_FIRST_SETTLED_ROW as FIRST_SETTLED_ROW,
};

mod peers;
mod shapes;
mod write;

use peers::{Peer, torch};
use shapes::{peer_rows, shapes};
use write::{Written, write_checkpoint};

use crate::progress::Progress;
use crate::report::{Section, Value};
use crate::stats::{Spread, gbps};

/// Work items, for the progress bar.
pub fn steps() -> usize {
    3
}

use pinned_bench::goals::FILES_CEILING_ROW as CEILING_ROW;

/// Drops the page cache: `true` where the process may (root on Linux).
fn drop_caches() -> bool {
    // SAFETY: `sync` takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// How long the device is left alone after device memory is freed: the driver goes on
/// releasing it after `cudaFree` returns, and a copy started in that time runs markedly
/// slower (docs/tuning.md).
const SETTLE: Duration = Duration::from_millis(250);

/// Drops what a run made (device memory, mostly) and leaves the device to settle, so that
/// the driver's release of it does not slow the next run.
fn free_and_settle<T>(made: T) {
    drop(made);
    std::thread::sleep(SETTLE);
}

/// What a timed run made, dropped after the clock stops.
type Made = Box<dyn std::any::Any>;

/// A run to time, boxing what it makes.
type Run<'a> = &'a mut dyn FnMut() -> Result<Made, String>;

/// Seconds of each of `runs`, which take turns `reps` times, each preceded by `before`, so
/// that the machine's drift from second to second touches them alike. What a run makes is
/// freed after the clock stops, and the device left to settle: freeing is not part of the
/// run.
fn taking_turns(
    reps: usize,
    mut before: impl FnMut(),
    runs: &mut [Run<'_>],
) -> Result<Vec<Vec<f64>>, String> {
    let mut seconds: Vec<Vec<f64>> = (0..runs.len()).map(|_| Vec::with_capacity(reps)).collect();
    for _ in 0..reps {
        for (run, seconds) in runs.iter_mut().zip(&mut seconds) {
            before();
            let start = Instant::now();
            let made = run()?;
            seconds.push(start.elapsed().as_secs_f64());
            free_and_settle(made);
        }
    }
    Ok(seconds)
}

/// Seconds of `run`, `reps` times, each preceded by `before`, as [`taking_turns`] times it.
fn timed<T: 'static>(
    reps: usize,
    before: impl FnMut(),
    run: impl FnMut() -> Result<T, String>,
) -> Result<Vec<f64>, String> {
    let mut run = as_run(run);
    Ok(taking_turns(reps, before, &mut [&mut run])?.remove(0))
}

/// `run` as a [`Run`]: what it makes, boxed.
fn as_run<T: 'static>(
    mut run: impl FnMut() -> Result<T, String>,
) -> impl FnMut() -> Result<Made, String> {
    move || run().map(|made| Box::new(made) as Made)
}

/// Crews other than the default, each with its row's name, each through one discarded load
/// as the default reader is: what the defaults were chosen by.
fn other_crews(path: &Path, reader: &FileReader) -> Result<Vec<(String, FileReader)>, String> {
    let configs = [
        (16, 32, 2, 2),
        (16, 16, 4, 1),
        (16, 8, 8, 2),
        (16, 16, 8, 2),
        (12, 12, 4, 2),
    ]
    .map(|(threads, chunks, chunk_mib, read_mib)| {
        ReaderConfig::new()
            .threads(threads)
            .chunks(chunks)
            .chunk_bytes(chunk_mib << 20)
            .read_bytes(read_mib << 20)
    });
    let mut crews = Vec::with_capacity(configs.len());
    for config in configs {
        let name = format!(
            "pinned-io, warm, {} threads, {} chunks of {} read in {}",
            config.threads,
            config.chunks,
            crate::report::size_label(config.chunk_bytes as u64),
            crate::report::size_label(config.read_bytes as u64)
        );
        let crew = FileReader::with_config_in(reader.device(), config, cuda_pinned::DefaultPinned)
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        free_and_settle(ours(path, &crew)?);
        crews.push((name, crew));
    }
    Ok(crews)
}

fn ours(path: &Path, reader: &FileReader) -> Result<pinned_io::Loaded, String> {
    let checkpoint = Checkpoint::open(path).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let loading = checkpoint
        .load(reader, &LoadOptions::new())
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    loading
        .wait()
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
}

/// The devices other than the reader's, where there are any.
fn other_devices(reader: &FileReader) -> Option<Vec<cuda_pinned::Device>> {
    let all = cuda_pinned::Device::all().ok()?;
    let others: Vec<_> = all.into_iter().filter(|&d| d != reader.device()).collect();
    (!others.is_empty()).then_some(others)
}

/// The checkpoint onto the reader's device and copied on to `others` as it lands.
fn ours_onto(
    path: &Path,
    reader: &FileReader,
    others: &[cuda_pinned::Device],
) -> Result<pinned_io::Loaded, String> {
    let checkpoint = Checkpoint::open(path).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let options = LoadOptions::new().replicate_to(others.iter().copied());
    let loading = checkpoint
        .load(reader, &options)
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    loading
        .wait()
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
}

/// The first tensor usable on the device: seconds from the call to its event having passed,
/// and the whole load, for the caller to free.
fn first_tensor(path: &Path, reader: &FileReader) -> Result<(f64, pinned_io::Loaded), String> {
    let start = Instant::now();
    let checkpoint = Checkpoint::open(path).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let loading = checkpoint
        .load(reader, &LoadOptions::new())
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    loading.tensors()[0]
        .wait()
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let first = start.elapsed().as_secs_f64();
    Ok((
        first,
        loading
            .wait()
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?,
    ))
}

/// candle's shape: the file mapped, one pageable copy per tensor.
fn mmap_per_tensor(
    path: &Path,
    written: &Written,
    stream: &Stream,
) -> Result<DeviceBuffer<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let len = file
        .metadata()
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?
        .len() as usize;
    // SAFETY: a private read-only mapping of a file nobody writes during the benchmark,
    // unmapped below; only read through the slice.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // SAFETY: the mapping above, `len` readable bytes, alive until the munmap below.
    let bytes = unsafe { std::slice::from_raw_parts(map.cast::<u8>(), len) };
    let each = written.bytes / written.tensors;
    let data = len - written.bytes;
    let result = (|| {
        let mut device = DeviceBuffer::<u8>::zeroed(written.bytes)
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        for i in 0..written.tensors {
            let src = &bytes[data + i * each..data + (i + 1) * each];
            device
                .slice_mut(i * each..(i + 1) * each)
                .copy_from_host(src)
                .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        }
        stream
            .synchronize()
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        Ok(device)
    })();
    // SAFETY: the mapping made above, no longer borrowed.
    unsafe { libc::munmap(map, len) };
    result
}

/// The whole file read into a `Vec`, then one copy.
fn read_then_copy(path: &Path) -> Result<DeviceBuffer<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    DeviceBuffer::from_slice(&bytes).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
}

/// The disk's ceiling: 16 threads of 8 MiB `O_DIRECT` reads, nothing copied.
fn direct_ceiling(path: &Path, len: usize) -> Result<(), String> {
    const PIECE: usize = 8 << 20;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..16)
            .map(|_| {
                scope.spawn(|| -> Result<(), String> {
                    let mut buffer = PinnedVec::<u8>::with_capacity(PIECE)
                        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
                    buffer.resize(PIECE, 0);
                    loop {
                        let at = next.fetch_add(PIECE, std::sync::atomic::Ordering::Relaxed);
                        if at >= len {
                            return Ok(());
                        }
                        file.read_at(&mut buffer, at as u64)
                            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
                    }
                })
            })
            .collect();
        threads
            .into_iter()
            .try_for_each(|t| t.join().unwrap_or(Err("a reading thread panicked".into())))
    })
}

fn row(
    section: &mut Section,
    what: &str,
    case: &str,
    bytes: usize,
    seconds: Vec<f64>,
    anchor: f64,
) {
    let rates: Vec<f64> = seconds.iter().map(|&s| gbps(bytes, s)).collect();
    let spread = Spread::of(rates);
    let mut cells = vec![Value::Text(what.into()), Value::Text(case.into())];
    cells.extend(spread.cells(2));
    cells.push(if anchor > 0.0 {
        Value::Num(100.0 * spread.median / anchor, 1)
    } else {
        Value::Text("—".into())
    });
    section.row(cells);
}

/// Cold loads of `written` taking turns with the disk's ceiling over the same files, `reps`
/// times, each after the page cache is dropped (the disk's rate drifts within a run); writes
/// both rows and returns pinned-io's seconds and the ceiling's median rate.
fn cold_against_ceiling(
    section: &mut Section,
    case: &str,
    written: &Written,
    reader: &FileReader,
    reps: usize,
) -> Result<(Vec<f64>, f64), String> {
    let lens = (written.files.iter())
        .map(|file| {
            let len = std::fs::metadata(file).map_err(|e| cuda_pinned::ErrorChain(&e).to_string());
            Ok((file, len?.len() as usize))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let file_len = lens.iter().map(|&(_, len)| len).sum();
    let mut ceiling_run =
        as_run(|| (lens.iter()).try_for_each(|&(file, len)| direct_ceiling(file, len)));
    let mut cold_run = as_run(|| ours(&written.path, reader));
    let [ceiling, cold]: [Vec<f64>; 2] = taking_turns(
        reps,
        || {
            drop_caches();
        },
        &mut [&mut ceiling_run, &mut cold_run],
    )?
    .try_into()
    .expect("a series for each run");
    let ceiling_rate = Spread::of(ceiling.iter().map(|&s| gbps(file_len, s)).collect()).median;
    row(section, CEILING_ROW, case, file_len, ceiling, 0.0);
    row(
        section,
        "pinned-io, cold",
        case,
        written.bytes,
        cold.clone(),
        ceiling_rate,
    );
    Ok((cold, ceiling_rate))
}

/// Reads `path` through the page cache, so that it is there for the next reader.
fn warm_page_cache(path: &Path) -> Result<(), String> {
    let mut file =
        std::fs::File::open(path).map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    std::io::copy(&mut file, &mut std::io::sink())
        .map(drop)
        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
}

/// A checkpoint measured onto one GPU: the times of its warm and cold loads (no cold ones
/// where the page cache may not be dropped).
struct OneGpu {
    written: Written,
    case: String,
    warm: Vec<f64>,
    cold: Option<Vec<f64>>,
}

/// The checkpoints onto `others` as well, read from storage once, warm and (where measured)
/// cold, against the same run's loads onto one GPU: a section of its own, so that a record
/// from a machine of several GPUs can stand beside one from another machine.
fn onto_others(
    reader: &FileReader,
    others: &[cuda_pinned::Device],
    reps: usize,
    cases: &[OneGpu],
) -> Result<Section, String> {
    let gpus = others.len() + 1;
    let mut section = Section::new(
        "files, several GPUs",
        &format!(
            "safetensors checkpoints onto {gpus} GPUs, read from the file once (GB/s; % of one \
             GPU's rate in this run)"
        ),
        &["path", "checkpoint", "min", "median", "max", "% of ref"],
    );
    let median_rate = |seconds: &[f64], bytes| {
        Spread::of(seconds.iter().map(|&s| gbps(bytes, s)).collect()).median
    };
    for OneGpu {
        written,
        case,
        warm,
        cold,
    } in cases
    {
        let (path, bytes) = (&written.path, written.bytes);
        row(
            &mut section,
            "pinned-io, warm, one GPU (reference)",
            case,
            bytes,
            warm.clone(),
            0.0,
        );
        // The cold runs read past the page cache, which they leave without the file: read it
        // through the cache again before the warm runs.
        warm_page_cache(path)?;
        let onto = timed(reps, || {}, || ours_onto(path, reader, others))?;
        let name = format!("pinned-io, warm, onto {gpus} GPUs (read once; % of one GPU)");
        row(
            &mut section,
            &name,
            case,
            bytes,
            onto,
            median_rate(warm, bytes),
        );
        if let Some(cold) = cold {
            row(
                &mut section,
                "pinned-io, cold, one GPU (reference)",
                case,
                bytes,
                cold.clone(),
                0.0,
            );
            let reps = if reps < 5 { 1 } else { 3 };
            let onto = timed(
                reps,
                || {
                    drop_caches();
                },
                || ours_onto(path, reader, others),
            )?;
            let name = format!("pinned-io, cold, onto {gpus} GPUs (read once; % of one GPU)");
            row(
                &mut section,
                &name,
                case,
                bytes,
                onto,
                median_rate(cold, bytes),
            );
        }
    }
    Ok(section)
}

/// Runs the section in `dir` (a directory on the disk to measure).
pub fn run(quick: bool, dir: &Path, progress: &mut Progress) -> Result<Vec<Section>, String> {
    std::fs::create_dir_all(dir).map_err(|e| {
        format!(
            "cannot create the directory {} for the checkpoints: {e}",
            dir.display()
        )
    })?;
    let mut section = Section::new(
        "files",
        "safetensors checkpoints from a file to the GPU (GB/s; % of the reference row above it)",
        &["path", "checkpoint", "min", "median", "max", "% of ref"],
    );
    let reps = if quick { 3 } else { 5 };
    let warm_reps = if quick { 3 } else { 11 };
    let (large_each, large_count) = if quick {
        (10 << 20, 100)
    } else {
        (40 << 20, 205)
    };
    let cases = [
        ("large", large_count, large_each),
        ("small", 2000, 64 << 10),
    ];
    let reader = FileReader::new().map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let stream = Stream::new().map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
    let may_drop = drop_caches();
    // Copies onto the other GPUs come last: peer access, once enabled, makes every later
    // device allocation of the process dearer.
    let mut later = Vec::new();
    for (label, count, each) in cases {
        let written = write_checkpoint(
            dir,
            &format!("pinned-bench-{label}.safetensors"),
            count,
            each,
        )
        .map_err(|e| {
            format!(
                "writing the checkpoint: {e}",
                e = cuda_pinned::ErrorChain(&e)
            )
        })?;
        let case = format!(
            "{label}: {count} × {}",
            crate::report::size_label(each as u64)
        );
        let path = written.path.clone();
        let bytes = written.bytes;
        // Warm: the file in the page cache (read once first).
        free_and_settle(ours(&path, &reader)?);
        let mut pinned = PinnedVec::<u8>::with_capacity(1 << 30)
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        pinned.resize(1 << 30, 1);
        let mut device = DeviceBuffer::<u8>::zeroed(1 << 30)
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        let others = if label == "large" {
            other_crews(&path, &reader)?
        } else {
            Vec::new()
        };
        // The reference copy, the default crew and the others take turns; a load is short
        // enough to take many.
        let seconds = {
            let mut h2d = as_run(|| {
                device
                    .copy_from_host(&pinned)
                    .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
            });
            let mut default = as_run(|| ours(&path, &reader));
            let mut other_runs: Vec<_> = others
                .iter()
                .map(|(_, other)| as_run(|| ours(&path, other)))
                .collect();
            let mut runs: Vec<Run<'_>> = vec![&mut h2d, &mut default];
            runs.extend(other_runs.iter_mut().map(|run| run as Run<'_>));
            taking_turns(warm_reps, || {}, &mut runs)?
        };
        free_and_settle((pinned, device));
        let mut seconds = seconds.into_iter();
        let (Some(h2d), Some(warm)) = (seconds.next(), seconds.next()) else {
            unreachable!("a series for each run");
        };
        let h2d_rate = Spread::of(h2d.iter().map(|&s| gbps(1 << 30, s)).collect()).median;
        row(
            &mut section,
            "page-locked H2D, 1 GiB (reference)",
            &case,
            1 << 30,
            h2d,
            0.0,
        );
        row(
            &mut section,
            "pinned-io, warm",
            &case,
            bytes,
            warm.clone(),
            h2d_rate,
        );
        // The other crews go with their rows, so that their threads and rings are not kept
        // through the runs below.
        for ((name, _crew), other) in others.into_iter().zip(seconds) {
            row(&mut section, &name, &case, bytes, other, h2d_rate);
        }
        if label == "large" {
            // The reads alone, into page-locked memory: what the crew's reading costs.
            let file = pinned_io::DataFile::open(&path)
                .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
            let len = file.len() as usize;
            let mut host = PinnedVec::<u8>::with_capacity(len)
                .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
            host.resize(len, 0);
            let reads = timed(
                reps,
                || {},
                || {
                    reader
                        .read_to_host(&file, 0, &mut host)
                        .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
                },
            )?;
            row(
                &mut section,
                "pinned-io, into page-locked memory only, warm",
                &case,
                len,
                reads,
                h2d_rate,
            );
        }
        // Back to back, each load starts while the driver still releases 8 GiB of written
        // memory freed just before; settled, the driver has released it, and the allocation
        // costs more. Neither stands for a process's first load, which docs/tuning.md
        // measures apart. Each state's allocation of the checkpoint's bytes, taking turns with
        // its loads, shows what the driver alone takes of the first tensor's time; it is
        // written before it is freed, as a load's memory is, so that the load after it starts
        // in the same state as after a load.
        let states = [
            (false, FIRST_BACK_TO_BACK_ROW, ALLOCATION_BACK_TO_BACK_ROW),
            (true, FIRST_SETTLED_ROW, ALLOCATION_SETTLED_ROW),
        ];
        for (settled, name, allocation_name) in states {
            let free = |made: Made| {
                if settled {
                    free_and_settle(made)
                } else {
                    drop(made)
                }
            };
            // One run discarded, so that the first timed run follows a run as the others do.
            free(Box::new(first_tensor(&path, &reader)?.1));
            let (mut first_ms, mut allocation_ms) = (Vec::new(), Vec::new());
            // A latency varies more from load to load than a load's rate: as many turns as
            // the warm loads take.
            for _ in 0..warm_reps {
                let start = Instant::now();
                let mut memory = DeviceBuffer::<MaybeUninit<u8>>::uninit_on(reader.device(), bytes)
                    .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
                allocation_ms.push(start.elapsed().as_secs_f64() * 1e3);
                (memory.slice_mut(..).set_bytes_async(1, &stream))
                    .and_then(|()| stream.synchronize())
                    .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
                free(Box::new(memory));
                let (seconds, loaded) = first_tensor(&path, &reader)?;
                first_ms.push(seconds * 1e3);
                free(Box::new(loaded));
            }
            for (name, ms) in [(name, first_ms), (allocation_name, allocation_ms)] {
                let mut cells = vec![Value::Text(name.into()), Value::Text(case.clone())];
                cells.extend(Spread::of(ms).cells(2));
                cells.push(Value::Text("—".into()));
                section.row(cells);
            }
        }
        let mmap = timed(reps, || {}, || mmap_per_tensor(&path, &written, &stream))?;
        row(
            &mut section,
            "mmap, a pageable copy per tensor, warm",
            &case,
            bytes,
            mmap,
            h2d_rate,
        );
        let vec = timed(reps.min(3), || {}, || read_then_copy(&path))?;
        row(
            &mut section,
            "read into a Vec, one copy, warm",
            &case,
            bytes,
            vec,
            h2d_rate,
        );
        for (name, pinned) in [
            ("torch load_file(device=cuda), warm", false),
            ("torch load_file, pin_memory, .to(cuda), warm", true),
        ] {
            match torch(&path, pinned) {
                Ok(seconds) => row(&mut section, name, &case, bytes, vec![seconds], h2d_rate),
                Err(why) => section.row(vec![
                    Value::Text(name.into()),
                    Value::Text(case.clone()),
                    Value::Text(why),
                    Value::Text(String::new()),
                    Value::Text(String::new()),
                    Value::Text(String::new()),
                ]),
            }
        }
        peer_rows(&mut section, &Peer::WARM, &case, &written, reps, h2d_rate);
        let mut cold_seconds = None;
        if may_drop {
            let cold_reps = if quick { 1 } else { 5 };
            let (cold, ceiling_rate) =
                cold_against_ceiling(&mut section, &case, &written, &reader, cold_reps)?;
            cold_seconds = Some(cold);
            let vec = timed(
                cold_reps,
                || {
                    drop_caches();
                },
                || read_then_copy(&path),
            )?;
            row(
                &mut section,
                "read into a Vec, one copy, cold",
                &case,
                bytes,
                vec,
                ceiling_rate,
            );
            drop_caches();
            match torch(&path, false) {
                Ok(seconds) => row(
                    &mut section,
                    "torch load_file(device=cuda), cold",
                    &case,
                    bytes,
                    vec![seconds],
                    ceiling_rate,
                ),
                Err(why) => section.row(vec![
                    Value::Text("torch load_file(device=cuda), cold".into()),
                    Value::Text(case.clone()),
                    Value::Text(why),
                    Value::Text(String::new()),
                    Value::Text(String::new()),
                    Value::Text(String::new()),
                ]),
            }
            peer_rows(&mut section, &Peer::COLD, &case, &written, 1, ceiling_rate);
        }
        later.push(OneGpu {
            written,
            case,
            warm,
            cold: cold_seconds,
        });
        progress.step(&format!("files: {label}"));
    }
    shapes(quick, dir, &reader, may_drop, &mut section)?;
    progress.step("files: shapes");
    let several = match other_devices(&reader) {
        Some(others) => Some(onto_others(&reader, &others, reps, &later)?),
        None => None,
    };
    if !may_drop {
        section.row(vec![
            Value::Text("cold rows".into()),
            Value::Text("skipped: this process may not drop the page cache (needs root)".into()),
            Value::Text(String::new()),
            Value::Text(String::new()),
            Value::Text(String::new()),
            Value::Text(String::new()),
        ]);
    }
    let ring = reader.config().chunk_bytes * reader.config().chunks;
    section.row(vec![
        Value::Text("pinned memory held by the reader (MiB)".into()),
        Value::Text(format!(
            "{} chunks × {} read in {}, {} threads",
            reader.config().chunks,
            crate::report::size_label(reader.config().chunk_bytes as u64),
            crate::report::size_label(reader.config().read_bytes as u64),
            reader.config().threads
        )),
        Value::Num((ring >> 20) as f64, 0),
        Value::Text(String::new()),
        Value::Text(String::new()),
        Value::Text(String::new()),
    ]);
    Ok(std::iter::once(section).chain(several).collect())
}
