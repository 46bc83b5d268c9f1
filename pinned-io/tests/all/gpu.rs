//! Files onto a real device: byte ranges at alignment and chunk edges, checkpoints, slices,
//! replicas, cold reads and a file that shrinks.

use std::collections::HashMap;
use std::io::Write;

use cuda_pinned::{Device, DeviceBuffer, Stream};
use pinned_io::{
    Checkpoint, DataFile, Dtype, Error, FileReader, LoadOptions, ReadMode, ReaderConfig, Split,
};
use safetensors::tensor::TensorView;

pub(crate) fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

pub(crate) fn temp_file(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(bytes).unwrap();
    file.flush().unwrap();
    file
}

/// A small ring so that reads cross many chunks.
pub(crate) fn small_reader(mode: ReadMode) -> FileReader {
    let config = ReaderConfig::new()
        .chunk_bytes(16 << 10)
        .chunks(4)
        .threads(3)
        .mode(mode);
    FileReader::with_config_in(
        Device::current().unwrap(),
        config,
        cuda_pinned::DefaultPinned,
    )
    .unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn ranges_land_byte_exact_at_alignment_and_chunk_edges() {
    let bytes = pattern(3 << 20, 7);
    let file = temp_file(&bytes);
    let data = DataFile::open(file.path()).unwrap();
    let stream = Stream::new().unwrap();
    for mode in [ReadMode::Auto, ReadMode::Buffered, ReadMode::Direct] {
        let reader = small_reader(mode);
        for offset in [0usize, 1, 4095, 4096, 4097, 12_345, 8 << 10] {
            for len in [
                0usize,
                1,
                4095,
                4096,
                4097,
                8 << 10,
                (8 << 10) + 1,
                65_537,
                1 << 20,
            ] {
                let mut device = DeviceBuffer::<u8>::zeroed(len).unwrap();
                reader
                    .read_to_device(&stream, &data, offset as u64, &mut device)
                    .unwrap();
                stream.synchronize().unwrap();
                assert!(
                    device.to_vec().unwrap() == bytes[offset..offset + len],
                    "{mode:?}: {len} bytes at {offset}"
                );
            }
        }
    }
    let past = DeviceBuffer::<u8>::zeroed(10).unwrap();
    let reader = small_reader(ReadMode::Auto);
    let mut past = past;
    let error = reader
        .read_to_device(&stream, &data, (3 << 20) - 5, &mut past)
        .unwrap_err();
    assert!(matches!(error, Error::Invalid(_)), "{error}");
}

/// Writes a checkpoint of `tensors` (name, dtype, shape, bytes) and returns its file.
pub(crate) fn checkpoint(
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) -> tempfile::NamedTempFile {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let file = tempfile::Builder::new()
        .suffix(".safetensors")
        .tempfile()
        .unwrap();
    safetensors::serialize_to_file(views, None, file.path()).unwrap();
    file
}

pub(crate) fn mixed_tensors() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut tensors = Vec::new();
    let shapes: [(Dtype, Vec<usize>); 7] = [
        (Dtype::BF16, vec![1024, 513]),
        (Dtype::F32, vec![7]),
        (Dtype::U8, vec![0, 5]),
        (Dtype::F32, vec![300, 1000]),
        (Dtype::I64, vec![]),
        (Dtype::F16, vec![3, 3, 3]),
        (Dtype::BF16, vec![4096, 1024]),
    ];
    for (i, (dtype, shape)) in shapes.into_iter().enumerate() {
        let bytes = shape.iter().product::<usize>() * dtype.bitsize() / 8;
        tensors.push((format!("t{i}"), dtype, shape, pattern(bytes, i as u32)));
    }
    tensors
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_checkpoint_round_trips_and_each_tensor_orders_a_consumer_stream() {
    let tensors = mixed_tensors();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Auto);
    let loading = checkpoint.load(&reader, &LoadOptions::new()).unwrap();
    let consumer = Stream::new().unwrap();
    for (name, dtype, shape, data) in &tensors {
        let tensor = loading.tensor(name).unwrap();
        assert_eq!((tensor.dtype(), tensor.shape()), (*dtype, shape.as_slice()));
        let view = tensor.ready_on(&consumer).unwrap();
        // A copy on the consumer's stream, ordered after the tensor's event only.
        let back = DeviceBuffer::<u8>::zeroed(data.len()).unwrap();
        if !data.is_empty() {
            // SAFETY: both ranges are device memory of the right length, alive until the
            // stream is synchronized below.
            unsafe {
                consumer
                    .copy_batch_raw(&[cuda_pinned::RawCopy {
                        dst: back.as_raw(),
                        src: view.as_raw(),
                        bytes: data.len(),
                    }])
                    .unwrap();
            }
        }
        consumer.synchronize().unwrap();
        assert!(back.to_vec().unwrap() == *data, "tensor {name}");
    }
    let loaded = loading.wait().unwrap();
    assert_eq!(loaded.tensors().len(), tensors.len());
}

#[test]
#[ignore = "needs a CUDA device"]
fn tensor_parallel_slices_match_the_reference() {
    let (rows, cols) = (37usize, 50usize);
    let values: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    let tensors = vec![(
        "w".to_owned(),
        Dtype::F32,
        vec![rows, cols],
        bytemuck::cast_slice(&values).to_vec(),
    )];
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Auto);
    for dim in [0usize, 1] {
        for world in [1usize, 3, 4] {
            for rank in 0..world {
                let split = Split::new(dim, rank, world).unwrap();
                let options = LoadOptions::new().split(move |_| Some(split));
                let loaded = checkpoint.load(&reader, &options).unwrap().wait().unwrap();
                let tensor = loaded.tensor("w").unwrap();
                let got: Vec<f32> =
                    bytemuck::cast_slice(&tensor.wait().unwrap().to_vec().unwrap()).to_vec();
                let size = [rows, cols][dim];
                let (base, extra) = (size / world, size % world);
                let start = rank * base + rank.min(extra);
                let len = base + usize::from(rank < extra);
                let want: Vec<f32> = (0..rows)
                    .flat_map(|r| (0..cols).map(move |c| (r, c)))
                    .filter(|&(r, c)| (start..start + len).contains(&[r, c][dim]))
                    .map(|(r, c)| values[r * cols + c])
                    .collect();
                assert_eq!(got, want, "dim {dim}, rank {rank} of {world}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_file_that_shrinks_while_loading_fails_every_waiter() {
    let tensors = mixed_tensors();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    // The checkpoint's writer replaces the file at the path: shrink what the path names.
    let shrink = std::fs::OpenOptions::new()
        .write(true)
        .open(file.path())
        .unwrap();
    let len = shrink.metadata().unwrap().len();
    shrink.set_len(len / 2).unwrap();
    let reader = small_reader(ReadMode::Buffered);
    let loading = checkpoint.load(&reader, &LoadOptions::new()).unwrap();
    let last = tensors.last().unwrap().0.as_str();
    let stream = Stream::new().unwrap();
    let error = loading.tensor(last).unwrap().ready_on(&stream).unwrap_err();
    assert!(error.to_string().contains("load failed"), "{error}");
    match loading.wait() {
        Err(Error::Truncated { path, .. }) => assert_eq!(path, file.path()),
        other => panic!("{other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_checkpoint_larger_than_the_device_is_an_error_and_the_reader_goes_on() {
    // One tensor of 4 TiB in a sparse file: its header is sound, no device holds it.
    let bytes: u64 = 4 << 40;
    let header =
        format!(r#"{{"huge":{{"dtype":"U8","shape":[{bytes}],"data_offsets":[0,{bytes}]}}}}"#);
    let mut file = tempfile::Builder::new()
        .suffix(".safetensors")
        .tempfile()
        .unwrap();
    file.write_all(&(header.len() as u64).to_le_bytes())
        .unwrap();
    file.write_all(header.as_bytes()).unwrap();
    if let Err(error) = file.as_file().set_len(8 + header.len() as u64 + bytes) {
        eprintln!("skipped: the temporary directory holds no sparse file of 4 TiB ({error})");
        return;
    }
    let huge = Checkpoint::open(file.path()).unwrap();
    let reader = FileReader::new().unwrap();
    // The device memory is allocated before the crew is given any piece: the load is refused
    // with CUDA's out-of-memory error, and the reader loads the next checkpoint.
    let error = huge.load(&reader, &LoadOptions::new()).unwrap_err();
    assert!(
        matches!(&error, Error::Cuda(cuda_pinned::Error::Cuda(cuda))
            if cuda.is_out_of_memory() && cuda.call() == "cudaMalloc"),
        "{error:?}"
    );
    let tensors = mixed_tensors();
    let small = checkpoint(&tensors);
    loads_every_tensor(&Checkpoint::open(small.path()).unwrap(), &reader, &tensors);
}

/// Loads every tensor of `checkpoint` and checks each against `tensors`.
fn loads_every_tensor(
    checkpoint: &Checkpoint,
    reader: &FileReader,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) {
    let loaded = checkpoint
        .load(reader, &LoadOptions::new())
        .unwrap()
        .wait()
        .unwrap();
    for (name, _, _, data) in tensors {
        let got = loaded
            .tensor(name)
            .unwrap()
            .wait()
            .unwrap()
            .to_vec()
            .unwrap();
        assert!(got == *data, "tensor {name}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cold_reads_go_past_the_page_cache() {
    let bytes = pattern(64 << 20, 3);
    let file = temp_file(&bytes);
    // SAFETY: `sync` takes no arguments.
    unsafe { libc::sync() };
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_err() {
        eprintln!("skipped: this process may not drop the page cache");
        return;
    }
    let data = DataFile::open(file.path()).unwrap();
    let reader = FileReader::new().unwrap();
    let stream = Stream::new().unwrap();
    let mut device = DeviceBuffer::<u8>::zeroed(bytes.len()).unwrap();
    reader
        .read_to_device(&stream, &data, 0, &mut device)
        .unwrap();
    stream.synchronize().unwrap();
    assert!(device.to_vec().unwrap() == bytes);
    let (cached, direct) = data.bytes_read();
    if data.can_read_direct() {
        assert!(direct > cached, "cached {cached}, direct {direct}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn replicas_on_other_devices_match() {
    let devices = Device::all().unwrap();
    if devices.len() < 2 {
        eprintln!("skipped: one device");
        return;
    }
    let tensors = mixed_tensors();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = FileReader::on(devices[0]).unwrap();
    let options = LoadOptions::new().replicate_to(devices[1..].iter().copied());
    let loaded = checkpoint.load(&reader, &options).unwrap().wait().unwrap();
    every_tensor_on_every_device(&loaded, &devices, &tensors);
}

/// Asserts that each of `devices` holds every one of `tensors`, byte-exact.
fn every_tensor_on_every_device(
    loaded: &pinned_io::Loaded,
    devices: &[Device],
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) {
    let want: HashMap<&str, &Vec<u8>> = tensors.iter().map(|t| (t.0.as_str(), &t.3)).collect();
    for &device in devices {
        let on_device = loaded.tensors_on(device).unwrap();
        assert_eq!(on_device.len(), tensors.len(), "on {device:?}");
        for tensor in on_device {
            assert_eq!(tensor.device(), device);
            let got = tensor.wait().unwrap().to_vec().unwrap();
            assert!(
                got == *want[tensor.name()],
                "{} on {device:?}",
                tensor.name()
            );
        }
    }
}

/// Many small tensors back to back, in the file and in device memory (their sizes multiples
/// of the device alignment), among some that are not, onto the reader's device and on to
/// the others: many tensors share each piece and each landing.
#[test]
#[ignore = "needs a CUDA device"]
fn small_tensors_packed_back_to_back_land_byte_exact_on_every_device() {
    let devices = Device::all().unwrap();
    let tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = (0..600u32)
        .map(|i| {
            let len = if i % 50 == 49 { 4096 + 3 } else { 4096 };
            (format!("t{i}"), Dtype::U8, vec![len], pattern(len, i))
        })
        .collect();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Auto);
    let others = devices.iter().copied().filter(|&d| d != reader.device());
    if devices.len() < 2 {
        eprintln!("one device: no replicas checked");
    }
    let options = LoadOptions::new().replicate_to(others);
    let loaded = checkpoint.load(&reader, &options).unwrap().wait().unwrap();
    every_tensor_on_every_device(&loaded, &devices, &tensors);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_sharded_checkpoint_loads_from_its_index() {
    let tensors = mixed_tensors();
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = tensors.split_at(3);
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let views: Vec<(String, TensorView<'_>)> = part
            .iter()
            .map(|(name, dtype, shape, data)| {
                (
                    name.clone(),
                    TensorView::new(*dtype, shape.clone(), data).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join(shard)).unwrap();
        for (name, ..) in part {
            weight_map.insert(name.clone(), shard.into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    // The directory finds its index.
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(checkpoint.files().count(), 2);
    let reader = small_reader(ReadMode::Auto);
    loads_every_tensor(&checkpoint, &reader, &tensors);
    // A filter loads only what it keeps.
    let options = LoadOptions::new().only(|t| t.name() == "t5");
    let loaded = checkpoint.load(&reader, &options).unwrap().wait().unwrap();
    assert_eq!(loaded.tensors().len(), 1);
    assert!(loaded.tensor("t0").is_none());
}

/// A view from `ready_on(&s)` used on another stream (its own `to_vec`) is still ordered
/// after the tensor's copies: the memory tracks their event.
#[test]
#[ignore = "needs a CUDA device"]
fn a_ready_view_read_on_another_stream_sees_the_whole_tensor() {
    let len = 256usize << 20;
    let data = pattern(len, 3);
    let file = checkpoint(&[("w".into(), Dtype::U8, vec![len], data.clone())]);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let config = ReaderConfig::new()
        .chunk_bytes(64 << 20)
        .chunks(3)
        .threads(3)
        .mode(ReadMode::Buffered);
    let reader = FileReader::with_config_in(
        Device::current().unwrap(),
        config,
        cuda_pinned::DefaultPinned,
    )
    .unwrap();
    for _ in 0..3 {
        let loading = checkpoint.load(&reader, &LoadOptions::new()).unwrap();
        let stream = Stream::new().unwrap();
        let view = loading.tensor("w").unwrap().ready_on(&stream).unwrap();
        assert!(
            view.to_vec().unwrap() == data,
            "read before the tensor landed"
        );
    }
}
