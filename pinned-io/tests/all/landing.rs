//! On a real device: tensors in the order they land, an order of the caller's, a load's
//! figures, one block per element type, and a load into memory the caller lends.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cuda_pinned::{Device, DeviceBuffer, LentDeviceMemory};
use pinned_io::{Block, Checkpoint, Dtype, Error, LoadOptions, ReadMode};

use pinned_io::{FileReader, ReaderConfig};

use super::gpu::{checkpoint, mixed_tensors, pattern, small_reader};

/// A reader of small chunks whose ring can hold every piece of these tests back behind the
/// first tensor's (half its chunks wait at most): the first tensor then lands first whatever
/// the threads' timing.
fn holding_reader() -> FileReader {
    let config = ReaderConfig::new()
        .chunk_bytes(16 << 10)
        .chunks(512)
        .threads(3);
    FileReader::with_config_in(
        Device::current().unwrap(),
        config,
        cuda_pinned::DefaultPinned,
    )
    .unwrap()
}

/// `count` tensors of `bytes` each, named `t0`, `t1`…
fn many(count: usize, bytes: usize) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let name = format!("t{i}");
            (name, Dtype::U8, vec![bytes], pattern(bytes, i as u32))
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn landed_yields_each_tensor_once_the_first_listed_first() {
    let tensors = many(300, 5000);
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let loading = checkpoint
        .load(&holding_reader(), &LoadOptions::new())
        .unwrap();
    let first = loading.tensors()[0].name().to_owned();
    let mut names: Vec<String> = loading
        .landed()
        .map(|tensor| tensor.unwrap().name().to_owned())
        .collect();
    assert_eq!(names[0], first);
    names.sort();
    let mut all: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
    all.sort();
    assert_eq!(names, all);
    let loaded = loading.wait().unwrap();
    for (name, _, _, data) in &tensors {
        let view = loaded.tensor(name).unwrap().wait().unwrap();
        assert!(view.to_vec().unwrap() == *data, "{name}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn order_by_loads_the_chosen_tensors_first_and_byte_exact() {
    let tensors = many(40, 70_000);
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    // t37 first, then t5, then the rest in the checkpoint's order.
    let options = LoadOptions::new().order_by(|tensor| match tensor.name() {
        "t37" => 0,
        "t5" => 1,
        _ => 2,
    });
    let loading = checkpoint.load(&holding_reader(), &options).unwrap();
    let listed: Vec<&str> = loading.tensors().iter().map(|t| t.name()).collect();
    assert_eq!(&listed[..3], ["t37", "t5", "t0"]);
    assert_eq!(loading.landed().next().unwrap().unwrap().name(), "t37");
    let loaded = loading.wait().unwrap();
    for (name, _, _, data) in &tensors {
        let view = loaded.tensor(name).unwrap().wait().unwrap();
        assert!(view.to_vec().unwrap() == *data, "{name}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_load_reports_its_figures_and_a_verdict() {
    let tensors = mixed_tensors();
    let bytes: usize = tensors.iter().map(|t| t.3.len()).sum();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Buffered);
    let loaded = checkpoint
        .load(&reader, &LoadOptions::new())
        .unwrap()
        .wait()
        .unwrap();
    let report = loaded.report();
    assert_eq!(
        (report.tensors, report.bytes),
        (tensors.len(), bytes as u64)
    );
    assert!(report.first_tensor <= report.last_tensor, "{report}");
    assert!(report.last_tensor.as_nanos() > 0, "{report}");
    // Buffered: every byte through the page cache, none past it.
    assert!(report.cached_bytes >= bytes as u64, "{report}");
    assert_eq!(report.direct_bytes, 0, "{report}");
    // The small reader's ring: 4 chunks of 16 KiB and their pages.
    assert_eq!(report.pinned_bytes, 4 * ((16 << 10) + 8192) + 4096);
    assert_eq!(report.threads, 3);
    assert!(report.gb_per_s() > 0.0, "{report}");
    assert!(report.to_string().contains("limited it"), "{report}");
}

/// Device memory the test allocates, lent to a load, counting its drops.
struct Lent {
    memory: DeviceBuffer<u8>,
    dropped: Arc<AtomicUsize>,
}

// SAFETY: the buffer's whole allocation on its device, allocated synchronously (usable by
// every stream), kept while the value lives; nothing else touches it.
unsafe impl LentDeviceMemory for Lent {
    fn device(&self) -> Device {
        self.memory.device()
    }
    fn address(&self) -> u64 {
        self.memory.as_raw()
    }
    fn bytes(&self) -> usize {
        self.memory.len()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_load_into_lent_memory_asks_one_block_per_element_type_and_gives_it_back() {
    let tensors = mixed_tensors();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Auto);
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut asked: Vec<Block> = Vec::new();
    let loading = checkpoint
        .load_into(&reader, &LoadOptions::new(), |blocks| {
            asked.extend_from_slice(blocks);
            (blocks.iter())
                .map(|block| {
                    Ok(Lent {
                        memory: DeviceBuffer::zeroed_on(block.device(), block.bytes() + 100)?,
                        dropped: dropped.clone(),
                    })
                })
                .collect()
        })
        .unwrap();
    // BF16, F32, F16 and I64 hold bytes; the empty U8 tensor asks for nothing.
    let mut dtypes: Vec<String> = asked.iter().map(|b| format!("{:?}", b.dtype())).collect();
    dtypes.sort();
    assert_eq!(dtypes, ["BF16", "F16", "F32", "I64"]);
    let loaded = loading.wait().unwrap();
    for (name, dtype, _, data) in &tensors {
        let tensor = loaded.tensor(name).unwrap();
        let block = asked.iter().find(|b| b.dtype() == *dtype);
        if let Some(block) = block {
            assert!(tensor.offset() + tensor.bytes() <= block.bytes(), "{name}");
            assert_eq!(tensor.offset() % 256, 0, "{name}");
        }
        assert!(tensor.wait().unwrap().to_vec().unwrap() == *data, "{name}");
    }
    assert_eq!(
        dropped.load(Ordering::Relaxed),
        0,
        "kept while the tensors live"
    );
    drop(loaded);
    assert_eq!(dropped.load(Ordering::Relaxed), asked.len());
}

#[test]
#[ignore = "needs a CUDA device"]
fn lent_memory_too_small_is_refused_and_the_reader_goes_on() {
    let tensors = many(3, 10_000);
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Auto);
    let dropped = Arc::new(AtomicUsize::new(0));
    let error = checkpoint
        .load_into(&reader, &LoadOptions::new(), |blocks| {
            (blocks.iter())
                .map(|block| {
                    Ok(Lent {
                        memory: DeviceBuffer::zeroed_on(block.device(), block.bytes() - 1)?,
                        dropped: dropped.clone(),
                    })
                })
                .collect()
        })
        .unwrap_err();
    assert!(matches!(error, Error::Invalid(_)), "{error}");
    assert!(error.to_string().contains("they need"), "{error}");
    // The reader is still whole.
    let loaded = checkpoint
        .load(&reader, &LoadOptions::new())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(loaded.tensors().len(), 3);
}

#[test]
#[ignore = "needs a CUDA device"]
fn large_tensors_get_blocks_of_their_own_when_asked() {
    let tensors = mixed_tensors();
    let file = checkpoint(&tensors);
    let checkpoint = Checkpoint::open(file.path()).unwrap();
    let reader = small_reader(ReadMode::Auto);
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut asked: Vec<Block> = Vec::new();
    let options = LoadOptions::new().own_block_from(1 << 20);
    let loaded = checkpoint
        .load_into(&reader, &options, |blocks| {
            asked.extend_from_slice(blocks);
            (blocks.iter())
                .map(|block| {
                    Ok(Lent {
                        memory: DeviceBuffer::zeroed_on(block.device(), block.bytes())?,
                        dropped: dropped.clone(),
                    })
                })
                .collect()
        })
        .unwrap()
        .wait()
        .unwrap();
    // t0, t3 and t6 (over 1 MiB) alone; the small F32, I64 and F16 ones by type; the empty
    // U8 tensor asks for nothing.
    assert_eq!(asked.len(), 6, "{asked:?}");
    for (name, _, _, data) in &tensors {
        let tensor = loaded.tensor(name).unwrap();
        let Some(block) = asked.iter().find(|b| b.index() == tensor.block()) else {
            assert!(data.is_empty(), "{name} has no block");
            continue;
        };
        if data.len() >= 1 << 20 {
            assert_eq!(
                (tensor.offset(), block.bytes()),
                (0, data.len().next_multiple_of(256))
            );
        }
        if !data.is_empty() {
            assert_eq!(block.dtype(), tensor.dtype(), "{name}");
        }
        assert!(tensor.wait().unwrap().to_vec().unwrap() == *data, "{name}");
    }
    drop(loaded);
    assert_eq!(dropped.load(Ordering::Relaxed), 6);
}
