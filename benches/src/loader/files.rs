//! The loader over files: `.npy` datasets warm and cold, against the disk's random-read
//! ceiling.

use super::*;

/// Measures the loader over the same images read from `.npy` files: warm (in the page cache)
/// against memory, run for run, with 8 workers and with a worker per core, and cold against
/// the disk's random-read ceiling.
pub(super) fn file_rows(
    images: &Arc<Images>,
    batches: usize,
    reps: usize,
    cuda: bool,
    progress: &mut Progress,
    section: &mut Section,
) {
    progress.step("loader, .npy file, warm");
    let (dir, dataset) = match write_npy(images) {
        Ok(written) => written,
        Err(e) => {
            section
                .notes
                .push(format!(".npy rows: {e}", e = cuda_pinned::ErrorChain(&*e)));
            progress.step("loader, .npy file, cold");
            return;
        }
    };
    // A worker's read from the page cache copies more slowly than its copy from memory, so
    // the file loader may need more workers than the loader over memory to keep pace: both
    // are measured with 8 workers and with a worker per core, the four loaders taking turns.
    let per_core = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(PER_CORE_CAP);
    let pairs = [
        (8, NPY_ROW, MEMORY_ROW),
        (per_core, NPY_PER_CORE_ROW, MEMORY_PER_CORE_ROW),
    ];
    let mut runs: [(Vec<_>, Vec<_>); 2] = Default::default();
    for rep in 0..reps {
        for ((workers, _, _), (file, memory)) in pairs.iter().zip(&mut runs) {
            let config = collate_config(*workers, rep);
            file.push(collate_run(dataset.clone(), config.clone(), batches, cuda));
            memory.push(collate_run(images.clone(), config, batches, cuda));
        }
    }
    for ((_, file_row, memory_row), (file, memory)) in pairs.into_iter().zip(runs) {
        push_row(file_row.into(), file, section);
        push_row(memory_row.into(), memory, section);
    }
    section.notes.push(format!(
        "a worker per core (at most {PER_CORE_CAP}): {per_core} workers on this machine"
    ));
    progress.step("loader, .npy file, cold");
    cold_rows(&dataset, &dir.path().join("images.npy"), reps, section);
}

/// The images and labels read from `.npy` files.
type NpyImages = NpyDataset<(Field<u8>, Field<i64>)>;

/// The images and labels as `.npy` files in a temporary folder, and a dataset over them.
fn write_npy(images: &Images) -> Result<(tempfile::TempDir, Arc<NpyImages>), BoxError> {
    let dir = tempfile::tempdir()?;
    let labels: Vec<u8> = images.labels.iter().flat_map(|l| l.to_le_bytes()).collect();
    let paths = [dir.path().join("images.npy"), dir.path().join("labels.npy")];
    std::fs::write(
        &paths[0],
        npy("|u1", &format!("({IMAGES}, 3, 224, 224)"), &images.pixels),
    )?;
    std::fs::write(&paths[1], npy("<i8", &format!("({IMAGES},)"), &labels))?;
    let dataset = NpyDataset::open(&paths)?;
    Ok((dir, Arc::new(dataset)))
}

/// A `.npy` file of format 1.0, as numpy writes it.
fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let mut text = dict.into_bytes();
    text.resize((10 + text.len() + 1).next_multiple_of(64) - 11, b' ');
    text.push(b'\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((text.len() as u16).to_le_bytes());
    out.extend(text);
    out.extend(data);
    out
}

/// One epoch from a cold page cache, rep by rep, alternating with the disk's random-read
/// ceiling; skipped, with a note saying why, where the page cache cannot be dropped.
fn cold_rows(
    dataset: &Arc<NpyImages>,
    images: &std::path::Path,
    reps: usize,
    section: &mut Section,
) {
    let (mut loader, mut ceiling) = (Vec::new(), Vec::new());
    for rep in 0..reps {
        let measured = drop_page_cache()
            .and_then(|()| cold_epoch(dataset.clone(), rep))
            .and_then(|rate| Ok((rate, drop_page_cache()?)))
            .and_then(|(rate, ())| Ok((rate, random_reads(images, rep)?)));
        match measured {
            Ok((rate, disk)) => {
                loader.push(rate);
                ceiling.push(disk);
            }
            Err(e) => {
                section.notes.push(format!(
                    "cold .npy rows skipped: {e}",
                    e = cuda_pinned::ErrorChain(&*e)
                ));
                return;
            }
        }
    }
    let loader = Spread::of(loader);
    let ceiling = Spread::of(ceiling);
    let mut cells = vec![Value::Text(COLD_ROW.into())];
    cells.extend(loader.cells(0));
    cells.extend([Value::Missing, Value::Missing]);
    cells.push(Value::Num(loader.median * BATCH_BYTES / 1e9, 2));
    cells.extend(std::iter::repeat_n(Value::Missing, 6));
    section.row(cells);
    let mut cells = vec![Value::Text(COLD_CEILING_ROW.into())];
    cells.extend(std::iter::repeat_n(Value::Missing, 5));
    cells.push(Value::Num(ceiling.median, 2));
    cells.extend(std::iter::repeat_n(Value::Missing, 6));
    section.row(cells);
    section.notes.push(format!(
        "cold: each rep drops the page cache, then times one epoch ({IMAGES} images, host \
         batches only); the disk's random-read ceiling, this run: {:.2} GB/s median ({} \
         threads of pread of one image each at random images of the file, cache dropped \
         before); the cold loader reads {:.0}% of it",
        ceiling.median,
        CEILING_THREADS,
        100.0 * loader.median * BATCH_BYTES / 1e9 / ceiling.median
    ));
}

/// Threads reading at once for the disk's random-read ceiling: enough to fill an NVMe
/// drive's queues.
const CEILING_THREADS: usize = 32;

// The ceiling row's name (as the goals read it) says how many threads read.
const _: () = assert!(CEILING_THREADS == 32);

/// Writes dirty pages out and drops the page cache.
///
/// # Errors
///
/// Where the process may not (it is not root, or `/proc/sys` is read-only), saying so.
fn drop_page_cache() -> Result<(), BoxError> {
    if !cfg!(target_os = "linux") {
        return Err("dropping the page cache is done here only on Linux".into());
    }
    // SAFETY: geteuid and sync take nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("dropping the page cache needs root".into());
    }
    // SAFETY: as above.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").map_err(|e| {
        format!(
            "writing /proc/sys/vm/drop_caches: {e}",
            e = cuda_pinned::ErrorChain(&e)
        )
        .into()
    })
}

/// Batches/s of one shuffled epoch of host batches.
fn cold_epoch(dataset: Arc<NpyImages>, rep: usize) -> Result<f64, BoxError> {
    dataset.advise_random()?;
    let mut loader = Loader::new(
        dataset,
        LoaderConfig::new(BATCH).workers(8).shuffle(rep as u64),
    )?;
    let start = Instant::now();
    let mut done = 0;
    for batch in loader.epoch(0) {
        std::hint::black_box(batch?.fields());
        done += 1;
    }
    Ok(done as f64 / start.elapsed().as_secs_f64())
}

/// GB/s of `CEILING_THREADS` threads reading every image of `path` once, in a shuffled order,
/// each with one `pread` into a buffer of its own.
fn random_reads(path: &std::path::Path, rep: usize) -> Result<f64, BoxError> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path)?;
    let data_offset = file.metadata()?.len() - (IMAGES * IMAGE) as u64;
    // The same shuffle for every rep's seed, drawn as the loader's is (SplitMix64).
    let mut order: Vec<usize> = (0..IMAGES).collect();
    let mut state = rep as u64 ^ 0x5DEE_CE66;
    for i in (1..IMAGES).rev() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        order.swap(i, ((z ^ (z >> 31)) % (i as u64 + 1)) as usize);
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|scope| {
        let readers: Vec<_> = (0..CEILING_THREADS)
            .map(|_| {
                scope.spawn(|| -> std::io::Result<()> {
                    let mut buffer = vec![0u8; IMAGE];
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&image) = order.get(k) else {
                            return Ok(());
                        };
                        let at = data_offset + (image * IMAGE) as u64;
                        file.read_exact_at(&mut buffer, at)?;
                    }
                })
            })
            .collect();
        readers.into_iter().try_for_each(|reader| {
            reader
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    })?;
    Ok(gbps(IMAGES * IMAGE, start.elapsed().as_secs_f64()))
}
