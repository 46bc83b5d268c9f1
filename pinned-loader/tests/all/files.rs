//! Datasets over `.npy` and record files: what they read matches the data written, files
//! the datasets do not read are refused at open, and files cut short later are reported.

use std::fs;
use std::path::{Path, PathBuf};

use pinned_loader::{
    BoxError, Dataset, Field, FileError, Loader, LoaderConfig, LoaderError, NpyArray, NpyDataset,
    RecordDataset,
};
use tempfile::TempDir;

const SAMPLES: usize = 203;
/// An image of 3×4×4 bytes.
const IMAGE: usize = 48;

/// A `.npy` file of format 1.0 as numpy writes it: the dict padded with spaces to a multiple
/// of 64 bytes with the preamble, ended by a newline, then the data.
fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let axes: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let shape = match axes.len() {
        1 => format!("({},)", axes[0]),
        _ => format!("({})", axes.join(", ")),
    };
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let total = (10 + dict.len() + 1).next_multiple_of(64);
    let mut text = dict.into_bytes();
    text.resize(total - 11, b' ');
    text.push(b'\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((text.len() as u16).to_le_bytes());
    out.extend(text);
    out.extend(data);
    out
}

fn pixel(sample: usize, at: usize) -> u8 {
    (sample * 7 + at * 13) as u8
}

/// Images of sample `i` made of `pixel(i, _)`, labels `i`, as two `.npy` files.
fn write_arrays(dir: &Path) -> [PathBuf; 2] {
    let pixels: Vec<u8> = (0..SAMPLES)
        .flat_map(|i| (0..IMAGE).map(move |at| pixel(i, at)))
        .collect();
    let labels: Vec<u8> = (0..SAMPLES as i64).flat_map(i64::to_le_bytes).collect();
    let images = dir.join("images.npy");
    let labels_path = dir.join("labels.npy");
    fs::write(&images, npy("|u1", &[SAMPLES, 3, 4, 4], &pixels)).unwrap();
    fs::write(&labels_path, npy("<i8", &[SAMPLES], &labels)).unwrap();
    [images, labels_path]
}

/// The same samples in memory: the reference.
struct Reference;

impl Dataset for Reference {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        SAMPLES
    }
    fn fields(&self) -> Self::Fields {
        (Field::new(IMAGE), Field::new(1))
    }
    fn write(&self, i: usize, (image, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        for (at, byte) in image.iter_mut().enumerate() {
            *byte = pixel(i, at);
        }
        label[0] = i as i64;
        Ok(())
    }
}

/// Every batch of an epoch: its indices, images and labels.
type Batches = Vec<(Vec<usize>, Vec<u8>, Vec<i64>)>;

fn epoch<D: Dataset<Fields = (Field<u8>, Field<i64>)>>(
    loader: &mut Loader<D>,
    epoch: u64,
) -> Batches {
    loader
        .epoch(epoch)
        .map(|batch| {
            let batch = batch.unwrap();
            let (images, labels) = batch.fields();
            (batch.indices().to_vec(), images.to_vec(), labels.to_vec())
        })
        .collect()
}

#[test]
fn a_loader_over_npy_files_yields_the_reference_samples() {
    let dir = TempDir::new().unwrap();
    let paths = write_arrays(dir.path());
    let data = NpyDataset::<(Field<u8>, Field<i64>)>::open(&paths).unwrap();
    assert_eq!(data.len(), SAMPLES);
    assert_eq!(data.arrays()[0].sample_shape(), [3, 4, 4]);
    assert_eq!(data.arrays()[1].descr(), "<i8");
    data.advise_random().unwrap();
    let config = LoaderConfig::new(16).workers(4).shuffle(9);
    let mut files = Loader::new(data, config.clone()).unwrap();
    let mut memory = Loader::new(Reference, config).unwrap();
    for e in 0..3 {
        let read = epoch(&mut files, e);
        assert_eq!(read, epoch(&mut memory, e));
        let mut seen = Vec::new();
        for (indices, images, labels) in read {
            let as_labels: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            assert_eq!(labels, as_labels);
            assert_eq!(images.len(), IMAGE * indices.len());
            seen.extend(indices);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..SAMPLES).collect::<Vec<_>>());
    }
}

#[test]
fn three_fields_and_versions_two_and_three() {
    let dir = TempDir::new().unwrap();
    let mut paths = Vec::new();
    for (version, descr, width) in [(2u8, "<f4", 4), (3, "<u2", 2), (1, "|i1", 1)] {
        let data: Vec<u8> = (0..10 * 2 * width).map(|b| b as u8).collect();
        let mut bytes = npy(descr, &[10, 2], &data);
        // Version 2 and 3 take a four-byte length: the dict moves two bytes on.
        if version > 1 {
            bytes[6] = version;
            bytes.splice(
                8..10,
                ((bytes.len() - 10 - data.len()) as u32).to_le_bytes(),
            );
        }
        let path = dir.path().join(format!("v{version}.npy"));
        fs::write(&path, bytes).unwrap();
        paths.push(path);
    }
    let data = NpyDataset::<(Field<f32>, Field<u16>, Field<i8>)>::open(&paths).unwrap();
    let mut loader = Loader::new(data, LoaderConfig::new(4)).unwrap();
    let batch = loader.epoch(0).next().unwrap().unwrap();
    let (floats, halves, bytes) = batch.fields();
    assert_eq!(
        bytemuck::cast_slice::<f32, u8>(floats),
        &(0..32).collect::<Vec<u8>>()[..]
    );
    assert_eq!(halves[1], u16::from_le_bytes([2, 3]));
    assert_eq!(bytes, [0, 1, 2, 3, 4, 5, 6, 7]);
}

#[test]
fn element_types_other_than_the_fields_are_refused_at_open() {
    let dir = TempDir::new().unwrap();
    let paths = write_arrays(dir.path());
    let error = NpyDataset::<(Field<u8>, Field<f64>)>::open(&paths).unwrap_err();
    assert!(matches!(&error, FileError::Invalid { path, .. } if *path == paths[1]));
    assert!(error.to_string().contains("<i8"), "{error}");
    assert!(error.to_string().contains("f64"), "{error}");
    assert!(NpyDataset::<(Field<u8>,)>::open(&paths).is_err());
    assert!(NpyDataset::<(Field<u8>, Field<i64>)>::open(&[&paths[0], &paths[0]]).is_err());
}

#[test]
fn files_the_arrays_do_not_fit_are_refused_with_their_name() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("bad.npy");
    let cases: [(Vec<u8>, &str); 5] = [
        (npy("<f4", &[4, 2], &[0; 31]), "takes 32 bytes"),
        (npy(">f4", &[1], &[0; 4]), "big-endian"),
        (
            npy("<f4", &[1], &[0; 4])[..20].to_vec(),
            "past the file's end",
        ),
        (b"\x93NUM".to_vec(), "not a .npy"),
        (Vec::new(), "not a .npy"),
    ];
    for (bytes, why) in cases {
        fs::write(&path, bytes).unwrap();
        let error = NpyArray::open(&path).unwrap_err();
        assert_eq!(error.path(), path);
        let message = error.to_string();
        assert!(
            message.contains(why) && message.contains("bad.npy"),
            "{message}"
        );
    }
    let missing = NpyArray::open(dir.path().join("none.npy")).unwrap_err();
    assert!(matches!(missing, FileError::Io { .. }));
}

/// Runs `open` on a thread and fails the test, rather than hang the suite, if it blocks.
fn in_time<T: Send + 'static>(open: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(open());
    });
    receiver
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the open blocked")
}

/// That `error` is the system's refusal of `path`, saying what it is.
fn refused_as<T>(result: Result<T, FileError>, path: &Path, what: &str) {
    let Err(error) = result else {
        panic!("{} was opened", path.display());
    };
    let FileError::Io {
        path: at, source, ..
    } = &error
    else {
        panic!("not an I/O error: {error}");
    };
    assert_eq!(at, path);
    assert_eq!(source.to_string(), format!("not a regular file: {what}"));
}

#[test]
fn named_pipes_directories_and_devices_are_refused_at_open() {
    let dir = TempDir::new().unwrap();
    let fifo = dir.path().join("samples.npy");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let layout = (Field::<u8>::new(IMAGE), Field::<i64>::new(1));
    for path in [
        fifo.clone(),
        dir.path().to_owned(),
        PathBuf::from("/dev/null"),
    ] {
        let what = match path.to_str().unwrap() {
            "/dev/null" => "a character device",
            _ if path == fifo => "a named pipe",
            _ => "a directory",
        };
        let opened = path.clone();
        refused_as(in_time(move || NpyArray::open(opened)), &path, what);
        let opened = path.clone();
        refused_as(
            in_time(move || NpyDataset::<(Field<u8>,)>::open(&[opened])),
            &path,
            what,
        );
        let opened = path.clone();
        let records = in_time(move || RecordDataset::open(&[opened], 0, layout));
        refused_as(records, &path, what);
    }
}

#[test]
fn a_file_cut_between_epochs_fails_its_samples_by_name() {
    let dir = TempDir::new().unwrap();
    let paths = write_arrays(dir.path());
    let data = NpyDataset::<(Field<u8>, Field<i64>)>::open(&paths).unwrap();
    let mut loader = Loader::new(data, LoaderConfig::new(16).workers(3)).unwrap();
    assert_eq!(epoch(&mut loader, 0).len(), SAMPLES.div_ceil(16));
    // Labels of samples 100 and on are gone, and sample 99's is cut in half.
    let cut = loader.dataset().arrays()[1].data_offset() + 99 * 8 + 4;
    fs::OpenOptions::new()
        .write(true)
        .open(&paths[1])
        .unwrap()
        .set_len(cut)
        .unwrap();
    let data_offset = loader.dataset().arrays()[1].data_offset();
    let results: Vec<_> = loader.epoch(1).collect();
    assert_eq!(results.len(), SAMPLES.div_ceil(16));
    for (batch, result) in results.into_iter().enumerate() {
        if batch < 6 {
            assert!(result.unwrap().indices().iter().all(|&i| i < 99));
            continue;
        }
        let Err(LoaderError::Sample {
            batch: number,
            sample,
            source,
        }) = result
        else {
            panic!("batch {batch} of a cut file");
        };
        // The first sample the batch could not read: 99's label is cut, later ones gone.
        let first = if batch == 6 { 99 } else { batch * 16 };
        assert_eq!((number, sample), (batch, first));
        let file = source.downcast_ref::<FileError>().unwrap();
        let FileError::Shrunk {
            path,
            sample: at,
            offset,
        } = file
        else {
            panic!("{file}");
        };
        assert_eq!((path, *at), (&paths[1], first));
        let end = if first == 99 {
            cut
        } else {
            data_offset + 8 * first as u64
        };
        assert_eq!(*offset, end);
        assert!(file.to_string().contains("labels.npy"), "{file}");
    }
}

/// Records of a 48-byte image and an 8-byte label across shards of uneven counts (one empty),
/// behind a 16-byte header each.
#[test]
fn records_across_shards_map_every_index() {
    let dir = TempDir::new().unwrap();
    let counts = [5usize, 0, 17, 1, 30];
    let mut paths = Vec::new();
    let mut next = 0usize;
    for (k, &count) in counts.iter().enumerate() {
        let mut bytes = vec![0xEE; 16];
        for i in next..next + count {
            bytes.extend((0..IMAGE).map(|at| pixel(i, at)));
            bytes.extend((i as i64).to_ne_bytes());
        }
        next += count;
        let path = dir.path().join(format!("train-{k:03}.bin"));
        fs::write(&path, bytes).unwrap();
        paths.push(path);
    }
    let layout = (Field::<u8>::new(IMAGE), Field::<i64>::new(1));
    let data = RecordDataset::open(&paths, 16, layout).unwrap();
    assert_eq!(data.len(), next);
    assert_eq!(data.records_per_file(), counts);
    assert_eq!(data.locate(5), Some((paths[2].as_path(), 16)));
    assert_eq!(data.locate(next), None);
    let mut loader = Loader::new(data, LoaderConfig::new(8).workers(2).shuffle(3)).unwrap();
    let mut seen = 0;
    for (indices, images, labels) in epoch(&mut loader, 0) {
        for (j, &i) in indices.iter().enumerate() {
            assert_eq!(labels[j], i as i64);
            let expected: Vec<u8> = (0..IMAGE).map(|at| pixel(i, at)).collect();
            assert_eq!(images[j * IMAGE..(j + 1) * IMAGE], expected[..]);
        }
        seen += indices.len();
    }
    assert_eq!(seen, next);
    fs::write(&paths[3], vec![0; 16 + 56 + 3]).unwrap();
    let error = RecordDataset::open(&paths, 16, layout).unwrap_err();
    assert!(error.to_string().contains("3 bytes over"), "{error}");
    assert_eq!(error.path(), paths[3]);
    let error = RecordDataset::open(&paths[..1], 1 << 20, layout).unwrap_err();
    assert!(
        error.to_string().contains("fewer than its header"),
        "{error}"
    );
}

/// What a worker did with the dataset, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    ReadAhead(Vec<usize>),
    Write(usize),
}

/// The reference dataset, noting every `read_ahead` (when it returns) and `write` call in
/// order; naming the batch that holds sample `marked`, if any, is slow, or panics.
struct Watched {
    marked: Option<usize>,
    panics: bool,
    calls: std::sync::Mutex<Vec<Call>>,
}

impl Watched {
    fn new(marked: Option<usize>, panics: bool) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            marked,
            panics,
            calls: std::sync::Mutex::new(Vec::new()),
        })
    }
}

impl Dataset for Watched {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        SAMPLES
    }
    fn fields(&self) -> Self::Fields {
        Reference.fields()
    }
    fn read_ahead(&self, indices: &[usize]) {
        if self.marked.is_some_and(|marked| indices.contains(&marked)) {
            assert!(!self.panics, "naming the marked batch");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        self.calls
            .lock()
            .unwrap()
            .push(Call::ReadAhead(indices.to_vec()));
    }
    fn write(&self, i: usize, sample: (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        self.calls.lock().unwrap().push(Call::Write(i));
        Reference.write(i, sample)
    }
}

#[test]
fn workers_name_each_batch_to_the_dataset_before_writing_it() {
    let watched = Watched::new(None, false);
    let config = LoaderConfig::new(16).workers(4).shuffle(5);
    let mut loader = Loader::new(watched.clone(), config).unwrap();
    let mut batches: Vec<Vec<usize>> = epoch(&mut loader, 0)
        .into_iter()
        .map(|(indices, _, _)| indices)
        .collect();
    drop(loader);
    let calls = watched.calls.lock().unwrap().clone();
    // Every sample is written after a call that named it (each sample is in one batch).
    let mut named = std::collections::HashSet::new();
    for call in &calls {
        match call {
            Call::ReadAhead(indices) => named.extend(indices.iter().copied()),
            Call::Write(i) => assert!(named.contains(i), "sample {i} written unannounced"),
        }
    }
    let mut asked: Vec<Vec<usize>> = calls
        .into_iter()
        .filter_map(|call| match call {
            Call::ReadAhead(indices) => Some(indices),
            Call::Write(_) => None,
        })
        .collect();
    batches.sort();
    asked.sort();
    assert_eq!(asked, batches);
}

#[test]
fn a_worker_names_the_batch_queued_behind_its_own_before_finishing_its_own() {
    let watched = Watched::new(None, false);
    // One worker, four batches in the making: the batch it will take next is queued while
    // it writes the current one.
    let config = LoaderConfig::new(16).workers(1).prefetch(4).shuffle(9);
    let mut loader = Loader::new(watched.clone(), config).unwrap();
    let batches: Vec<Vec<usize>> = epoch(&mut loader, 0)
        .into_iter()
        .map(|(indices, _, _)| indices)
        .collect();
    drop(loader);
    let calls = watched.calls.lock().unwrap().clone();
    let named_at = |batch: &Vec<usize>| {
        calls
            .iter()
            .position(|call| call == &Call::ReadAhead(batch.clone()))
            .unwrap_or_else(|| panic!("batch {batch:?} never named"))
    };
    let last_write = |batch: &Vec<usize>| {
        calls
            .iter()
            .rposition(|call| matches!(call, Call::Write(i) if batch.contains(i)))
            .unwrap()
    };
    let early = batches
        .windows(2)
        .filter(|pair| named_at(&pair[1]) < last_write(&pair[0]))
        .count();
    assert!(
        early > 0,
        "no batch was named before the one before it was written: {calls:?}"
    );
}

/// The reference dataset, noting which thread named each batch and which wrote each sample.
struct Threads {
    named: std::sync::Mutex<Vec<(Vec<usize>, std::thread::ThreadId)>>,
    wrote: std::sync::Mutex<std::collections::HashMap<usize, std::thread::ThreadId>>,
}

impl Dataset for Threads {
    type Fields = (Field<u8>, Field<i64>);
    fn len(&self) -> usize {
        SAMPLES
    }
    fn fields(&self) -> Self::Fields {
        Reference.fields()
    }
    fn read_ahead(&self, indices: &[usize]) {
        let me = std::thread::current().id();
        self.named.lock().unwrap().push((indices.to_vec(), me));
    }
    fn write(&self, i: usize, sample: (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
        let me = std::thread::current().id();
        self.wrote.lock().unwrap().insert(i, me);
        // Samples slow to come, as from a cold disk: the workers set the pace.
        std::thread::sleep(std::time::Duration::from_micros(300));
        Reference.write(i, sample)
    }
}

#[test]
fn when_the_workers_set_the_pace_many_batches_are_named_before_their_worker_takes_them() {
    let dataset = std::sync::Arc::new(Threads {
        named: std::sync::Mutex::new(Vec::new()),
        wrote: std::sync::Mutex::new(std::collections::HashMap::new()),
    });
    // The default prefetch: about one batch queued per worker besides those in the making.
    let config = LoaderConfig::new(2).workers(4).shuffle(4);
    let mut loader = Loader::new(dataset.clone(), config).unwrap();
    for batch in loader.epoch(0) {
        drop(batch.unwrap());
    }
    drop(loader);
    let named = dataset.named.lock().unwrap().clone();
    let wrote = dataset.wrote.lock().unwrap().clone();
    assert_eq!(named.len(), SAMPLES.div_ceil(2), "each batch named once");
    let ahead = (named.iter())
        .filter(|(batch, namer)| wrote[&batch[0]] != *namer)
        .count();
    assert!(
        ahead * 3 > named.len(),
        "{ahead} of {} batches named by another worker than their own",
        named.len()
    );
}

#[test]
fn no_sample_is_written_before_its_batch_is_named_however_slow_the_naming() {
    // Several workers and batches queued: the marked batch is likely named by a worker that
    // took an earlier one, while its own worker may already hold it.
    for marked in [40, 90, 150] {
        let dataset = Watched::new(Some(marked), false);
        let config = LoaderConfig::new(16).workers(3).prefetch(4).shuffle(3);
        let mut loader = Loader::new(dataset.clone(), config).unwrap();
        assert_eq!(epoch(&mut loader, 0).len(), SAMPLES.div_ceil(16));
        drop(loader);
        let calls = dataset.calls.lock().unwrap().clone();
        let named = (calls.iter())
            .position(|call| matches!(call, Call::ReadAhead(batch) if batch.contains(&marked)))
            .expect("the marked batch was named");
        let Call::ReadAhead(batch) = &calls[named] else {
            unreachable!()
        };
        let first_write = (calls.iter())
            .position(|call| matches!(call, Call::Write(i) if batch.contains(i)))
            .unwrap();
        assert!(
            named < first_write,
            "a sample of {batch:?} was written before its naming returned: {calls:?}"
        );
    }
}

#[test]
fn a_panic_naming_a_batch_fails_that_batch_alone() {
    for workers in [1, 3] {
        let marked = 70;
        let dataset = Watched::new(Some(marked), true);
        let config = LoaderConfig::new(16)
            .workers(workers)
            .prefetch(4)
            .shuffle(8);
        let mut loader = Loader::new(dataset, config).unwrap();
        let mut failed = Vec::new();
        let mut delivered = Vec::new();
        for batch in loader.epoch(0) {
            match batch {
                Ok(batch) => delivered.extend(batch.indices().iter().copied()),
                Err(error) => failed.push(error.to_string()),
            }
        }
        assert_eq!(failed.len(), 1, "{workers} workers: {failed:?}");
        assert!(failed[0].contains("naming the marked batch"), "{failed:?}");
        assert!(!delivered.contains(&marked), "{workers} workers");
        assert_eq!(delivered.len(), SAMPLES - 16, "{workers} workers");
    }
}

/// Which pages of `file` (of `len` bytes) the page cache holds, as `mincore` says of a
/// mapping of it (which reads nothing in).
fn resident_pages(file: &fs::File, len: usize) -> Vec<bool> {
    use std::os::fd::AsRawFd;
    let pages = len.div_ceil(4096);
    // SAFETY: a fresh read-only shared mapping of the open file, unmapped below and never
    // dereferenced.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    let mut vector = vec![0u8; pages];
    // SAFETY: the mapping spans `len` bytes; `vector` has a byte for each of its pages.
    let code = unsafe { libc::mincore(map, len, vector.as_mut_ptr()) };
    // SAFETY: the mapping made above, unused from here on.
    unsafe { libc::munmap(map, len) };
    assert_eq!(code, 0);
    vector.iter().map(|&page| page & 1 == 1).collect()
}

/// Whether the kernel tells apart cached and uncached pages of `file` here.
fn tells_cached(file: &fs::File) -> bool {
    cuda_pinned::PageCacheProbe::of(file).is_some()
}

/// Writes `bytes` to a fresh file on a disk, evicts it from the page cache and calls
/// `read_ahead` with samples 3 and 40 (and one past the end) of the `COUNT` samples of
/// `SAMPLE` bytes starting at `data`: those two must be read in, sample 20 not.
fn cold_read_ahead(
    name: &str,
    bytes: &[u8],
    data: u64,
    read_ahead: impl FnOnce(&std::path::Path, &[usize]),
) {
    // On a disk, where the build's own scratch folder is (a temporary file system would keep
    // the pages); else in the system's temporary folder.
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = if scratch.is_dir() {
        TempDir::new_in(scratch)
    } else {
        TempDir::new()
    }
    .unwrap();
    let path = dir.path().join(name);
    fs::write(&path, bytes).unwrap();
    let file = fs::File::open(&path).unwrap();
    file.sync_all().unwrap();
    let len = bytes.len();
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
    let pages_of = |sample: usize| {
        let start = data as usize + sample * COLD_SAMPLE;
        start / 4096..(start + COLD_SAMPLE).div_ceil(4096)
    };
    let resident = resident_pages(&file, len);
    if [3, 20, 40]
        .iter()
        .any(|&s| resident[pages_of(s)].contains(&true))
    {
        // tmpfs keeps its pages.
        eprintln!("not measurable here: the file stayed in the page cache after eviction");
        return;
    }
    if !tells_cached(&file) {
        eprintln!("not measurable here: the file system cannot say what the page cache holds");
        return;
    }
    read_ahead(&path, &[3, 40, COLD_COUNT + 7]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let resident = resident_pages(&file, len);
        if [3, 40]
            .iter()
            .all(|&s| resident[pages_of(s)].iter().all(|&r| r))
        {
            // Random access reads nothing but what was asked for.
            assert!(!resident[pages_of(20)].contains(&true));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "samples 3 and 40 were not read in"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

const COLD_SAMPLE: usize = 64 << 10;
const COLD_COUNT: usize = 64;

#[test]
fn a_cold_batch_is_asked_of_the_disk_at_once() {
    let bytes = npy(
        "|u1",
        &[COLD_COUNT, COLD_SAMPLE],
        &vec![5; COLD_COUNT * COLD_SAMPLE],
    );
    let data = (bytes.len() - COLD_COUNT * COLD_SAMPLE) as u64;
    cold_read_ahead("cold.npy", &bytes, data, |path, indices| {
        let array = NpyArray::open(path).unwrap();
        array.advise_random().unwrap();
        // An index past the end is left out.
        array.read_ahead(indices);
    });
}

#[test]
fn a_cold_batch_of_records_is_asked_of_the_disk_at_once() {
    let mut bytes = vec![0xEE; 16];
    bytes.extend(std::iter::repeat_n(7u8, COLD_COUNT * COLD_SAMPLE));
    cold_read_ahead("cold.bin", &bytes, 16, |path, indices| {
        let layout = (Field::<u8>::new(COLD_SAMPLE - 8), Field::<i64>::new(1));
        let data = RecordDataset::open(&[path], 16, layout).unwrap();
        data.advise_random().unwrap();
        data.read_ahead(indices);
    });
}
