//! Checkpoints as candle `VarBuilder`s: pinned-io loads the tensors into memory candle
//! allocated and owns, and the builder hands each one to the model as soon as it has landed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::DevicePtrMut;
use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Shape, Tensor};
use candle_nn::var_builder::{Backend, Shard, SimpleBackend, VarBuilderArgs};
use candle_nn::{Init, VarBuilder};
use pinned_io::{
    Block, Checkpoint, FileReader, LoadOptions, LoadedTensor, Loading, Split, TensorSpec,
};

use crate::device::Target;
use crate::error::{Result, wrap};
use crate::memory::{Lent, candle_dtype, refused, uninit_tensor, with_type};

/// Opens `paths` and returns a `VarBuilder` whose tensors pinned-io loads onto `device`: the
/// drop-in for candle's `VarBuilder::from_mmaped_safetensors(paths, dtype, device)`.
///
/// `paths` are a checkpoint's `.safetensors` files (its shards, as candle takes them), or one
/// path to a sharded checkpoint's `*.safetensors.index.json`, or to a folder holding either
/// (a Hugging Face cache snapshot among them). The load starts at once and runs while the
/// model is built: each `get` waits for its own tensor only. See [`CheckpointLoader`] for a
/// reader or options of your own.
///
/// ```no_run
/// use candle_core::{DType, Device};
/// # fn main() -> candle_core::Result<()> {
/// let device = Device::new_cuda_with_stream(0)?;
/// // let vb = unsafe { VarBuilder::from_mmaped_safetensors(&paths, DType::BF16, &device)? };
/// let vb = pinned_candle::var_builder(&["model.safetensors"], DType::BF16, &device)?;
/// let linear = candle_nn::linear(4096, 4096, vb.pp("model.layers.0.mlp.up_proj"))?;
/// # let _ = linear; Ok(()) }
/// ```
///
/// # Errors
///
/// A file that cannot be opened or breaks the format (naming the file and the tensor); a
/// device that is not a CUDA one; the CUDA error of starting the load.
pub fn var_builder<P: AsRef<Path>>(
    paths: &[P],
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    CheckpointLoader::open(paths)?.var_builder(dtype, device)
}

/// A checkpoint to load into candle, with the reader and options the load takes.
///
/// ```no_run
/// use candle_core::{DType, Device};
/// use pinned_candle::CheckpointLoader;
/// use pinned_io::{FileReader, LoadOptions};
/// # fn main() -> candle_core::Result<()> {
/// let device = Device::new_cuda_with_stream(0)?;
/// // The embeddings and the first layers land first: the model's first kernels can run on
/// // them while the rest loads.
/// let first = |name: &str| if name.contains("embed") || name.contains("layers.0.") { 0 } else { 1 };
/// let vb = CheckpointLoader::open(&["/models/llama"])?
///     .options(LoadOptions::new().order_by(move |tensor| first(tensor.name())))
///     .var_builder(DType::BF16, &device)?;
/// # let _ = vb; Ok(()) }
/// ```
pub struct CheckpointLoader {
    checkpoint: Checkpoint,
    reader: Option<Arc<FileReader>>,
    options: LoadOptions,
}

impl std::fmt::Debug for CheckpointLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointLoader")
            .field("checkpoint", &self.checkpoint)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl CheckpointLoader {
    /// Opens the checkpoint at `paths` (as [`var_builder`] takes them) and checks its headers.
    ///
    /// # Errors
    ///
    /// pinned-io's error for a file that cannot be opened or breaks the format, or for no
    /// path.
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        let checkpoint = match paths {
            [one] => Checkpoint::open(one),
            many => Checkpoint::open_shards(many),
        }
        .map_err(wrap)?;
        Ok(Self {
            checkpoint,
            reader: None,
            options: LoadOptions::new(),
        })
    }

    /// The checkpoint: its tensors' names, types and shapes, its files.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Loads with `reader` (its device must be the builder's), instead of the device's default
    /// reader: one with the default configuration, made at the first load onto the device and
    /// kept for the later ones (its threads, and its small pinned ring).
    pub fn reader(mut self, reader: FileReader) -> Self {
        self.reader = Some(Arc::new(reader));
        self
    }

    /// Loads as `options` say: which tensors, in which order, which tensor-parallel part of
    /// each ([`LoadOptions::split`]: the part's shape is what the model then asks for).
    /// Replicas on other devices are not taken here: a builder serves one device.
    pub fn options(mut self, options: LoadOptions) -> Self {
        self.options = options;
        self
    }

    /// Starts the load onto `device` and returns a `VarBuilder` over it, as
    /// [`var_builder`] does.
    ///
    /// `get(shape, name)` waits for that tensor's landing (on the device, where `device` has
    /// a stream of its own, `Device::new_cuda_with_stream`; on the host for
    /// `Device::new_cuda`, whose per-thread stream is another on each thread), checks its
    /// shape, and converts it to the builder's element type on the device. The weights are
    /// candle's own memory: dropping the model frees them.
    ///
    /// # Errors
    ///
    /// As [`var_builder`].
    pub fn var_builder(self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        let weights = self.start(device)?;
        Ok(VarBuilder::from_backend(
            Box::new(PinnedSafetensors(weights)),
            dtype,
            device.clone(),
        ))
    }

    /// Starts the load onto `device` and returns a builder whose `get_with_hints` takes
    /// candle's tensor-parallel [`Shard`]s, as `candle_nn::var_builder::ShardedSafeTensors`
    /// does: a `Shard { dim, rank, world_size }` of a tensor whose `dim` (0 or 1) divides by
    /// `world_size` is the rank's part; `world_size` 1 is the whole tensor, its shape checked.
    ///
    /// Each part is cut from the whole tensor on the device. To read only the rank's part from
    /// storage, name it in the options ([`LoadOptions::split`] with the same split): the
    /// loaded part is then handed over as it is.
    ///
    /// candle's own `ShardedVarBuilder` type cannot be built over another backend: models
    /// written for it take this builder where they are generic over the backend
    /// (`VarBuilderArgs<'_, B: Backend<Hints = Shard>>`).
    ///
    /// # Errors
    ///
    /// As [`var_builder`].
    pub fn sharded_var_builder(
        self,
        dtype: DType,
        device: &Device,
    ) -> Result<VarBuilderArgs<'static, ShardedPinnedSafetensors>> {
        let weights = self.start(device)?;
        Ok(VarBuilderArgs::new_with_args(
            ShardedPinnedSafetensors(weights),
            dtype,
            device,
        ))
    }

    /// Starts the load into memory candle allocates on `device`.
    fn start(self, device: &Device) -> Result<Arc<Weights>> {
        let target = Target::of(device)?;
        let reader = match self.reader {
            Some(reader) if reader.device() == target.device => reader,
            Some(reader) => {
                return Err(candle_core::Error::Msg(format!(
                    "the reader copies to device {}, the builder's is device {}",
                    reader.device().ordinal(),
                    target.device.ordinal()
                )));
            }
            None => default_reader(target.device)?,
        };
        // Only what candle can hold: another type fails its own `get`, not the whole load. Each
        // tensor in an allocation of its own, candle's tensors' way: candle copies a tensor's
        // whole allocation when it moves it (`to_device`, `to_vec`), and the rest of a shared
        // one might still be loading. One device: replicas are another builder's.
        let options = self
            .options
            .only(|tensor: &TensorSpec| candle_dtype(tensor.dtype()).is_some())
            .own_block_from(0)
            .replicate_to(std::iter::empty());
        let specs = (self.checkpoint.tensors())
            .map(|t| (t.name().to_owned(), (t.dtype(), t.shape().to_vec())))
            .collect();
        let mut blocks: Vec<Option<Tensor>> = Vec::new();
        let loading = self
            .checkpoint
            .load_into(&reader, &options, |asked: &[Block]| {
                let lent = allocate(&target, asked)?;
                for (block, lent) in asked.iter().zip(&lent) {
                    if blocks.len() <= block.index() {
                        blocks.resize(block.index() + 1, None);
                    }
                    blocks[block.index()] = Some(lent.tensor.clone());
                }
                Ok(lent)
            })
            .map_err(wrap)?;
        Ok(Arc::new(Weights {
            loading,
            blocks,
            specs,
            target,
            device: device.clone(),
        }))
    }
}

/// The default reader of `device`, made at its first use and kept.
fn default_reader(device: cuda_pinned::Device) -> Result<Arc<FileReader>> {
    static READERS: OnceLock<Mutex<HashMap<usize, Arc<FileReader>>>> = OnceLock::new();
    let mut readers = READERS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(reader) = readers.get(&device.ordinal()) {
        return Ok(reader.clone());
    }
    let reader = Arc::new(FileReader::on(device).map_err(wrap)?);
    readers.insert(device.ordinal(), reader.clone());
    Ok(reader)
}

/// The load's blocks (a tensor each), in memory candle allocates and owns, settled for other
/// streams.
fn allocate(target: &Target, blocks: &[Block]) -> pinned_io::Result<Vec<Lent>> {
    let candle = |error: candle_core::Error| {
        pinned_io::Error::Invalid(format!(
            "candle's allocation of a checkpoint's tensors: {error}"
        ))
    };
    // candle allocates from the device's stream-ordered pool. Grown once by the whole load,
    // and that memory given back to it on the same stream, it serves every tensor at once
    // instead of growing by each: thousands of allocations cost about what one does.
    let total = blocks.iter().map(Block::bytes).sum::<usize>();
    // SAFETY: never read or written: freed again at once.
    if let Ok(grown) = unsafe { target.candle.alloc::<u8>(total) } {
        drop(grown);
    }
    let lent = (blocks.iter())
        .map(|block| {
            let dtype = candle_dtype(block.dtype()).expect("the load takes candle's types only");
            let len = block.bytes() / dtype.size_in_bytes();
            let (tensor, address) = uninit_tensor(target, dtype, len).map_err(candle)?;
            Ok(Lent {
                tensor,
                address,
                bytes: block.bytes(),
                device: target.device,
            })
        })
        .collect::<pinned_io::Result<Vec<Lent>>>()?;
    // The allocations are ordered on candle's stream; the load's copies run on another.
    target
        .stream
        .synchronize()
        .map_err(|e| candle(candle_core::Error::wrap(e)))?;
    Ok(lent)
}

/// A load into candle's memory, shared by the builders' backends (and their clones).
struct Weights {
    loading: Loading,
    /// The memory of each block, as one-dimensional tensors; `None` for blocks of no bytes.
    blocks: Vec<Option<Tensor>>,
    /// Every tensor of the checkpoint, loaded or not: its element type and whole shape.
    specs: HashMap<String, (pinned_io::Dtype, Vec<usize>)>,
    target: Target,
    device: Device,
}

impl Weights {
    /// Tensor `name` as it was loaded (its file's element type, the loaded part's shape),
    /// once it has landed.
    fn landed(&self, name: &str) -> Result<Tensor> {
        let Some(loaded) = self.loading.tensor(name) else {
            return Err(match self.specs.get(name) {
                Some(&(dtype, _)) if candle_dtype(dtype).is_none() => refused(name, dtype),
                Some(_) => candle_core::Error::Msg(format!(
                    "tensor `{name}` was left out of the load by its options"
                ))
                .bt(),
                None => candle_core::Error::CannotFindTensor {
                    path: name.to_owned(),
                }
                .bt(),
            });
        };
        self.wait_for(loaded)?;
        let dtype = candle_dtype(loaded.dtype()).expect("the load takes candle's types only");
        let shape = loaded.shape().to_vec();
        if loaded.bytes() == 0 {
            // Nothing was allocated for it.
            return Tensor::zeros(shape, dtype, &self.device);
        }
        let block = self.blocks[loaded.block()]
            .as_ref()
            .expect("a tensor with bytes has its allocation");
        if self.target.waits_on_device() {
            // candle's stream has waited for the tensor: cudarc's tracking records the write
            // there, so that its copies on other streams (to another device) wait too.
            block.inplace_op1(&RecordWrite)?;
        }
        let elements = loaded.bytes() / dtype.size_in_bytes();
        let start = loaded.offset() / dtype.size_in_bytes();
        let tensor = if start == 0 && elements == block.elem_count() {
            block.reshape(shape)?
        } else {
            block.narrow(0, start, elements)?.reshape(shape)?
        };
        Ok(tensor)
    }

    /// Makes candle's stream (or, for a per-thread stream, the host) wait for `tensor`.
    fn wait_for(&self, tensor: &LoadedTensor) -> Result<()> {
        match &self.target.adopted {
            Some(stream) => tensor.ready_on(stream).map(drop).map_err(wrap),
            None => tensor.wait().map(drop).map_err(wrap),
        }
    }

    /// Tensor `name` for the model: `shape` checked, converted to `dtype`, on `device`.
    fn get(&self, shape: &Shape, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let tensor = self.landed(name)?;
        if tensor.shape() != shape {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape.clone(),
                got: tensor.shape().clone(),
            }
            .bt());
        }
        self.finish(tensor, dtype, device)
    }

    /// `tensor` converted to `dtype` (on the device), and moved to `device` if it is another.
    fn finish(&self, tensor: Tensor, dtype: DType, device: &Device) -> Result<Tensor> {
        let tensor = tensor.to_dtype(dtype)?;
        if device.same_device(&self.device) {
            Ok(tensor)
        } else {
            tensor.to_device(device)
        }
    }
}

/// An in-place "op" that only records, in cudarc's tracking, a write of the tensor's memory on
/// candle's stream: the load's copies, which that stream has waited for.
struct RecordWrite;

impl InplaceOp1 for RecordWrite {
    fn name(&self) -> &'static str {
        "pinned-candle: a load's write"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, _: &Layout) -> Result<()> {
        let stream = storage.device.cuda_stream();
        with_type!(storage.dtype(), T => {
            let slice = storage.as_cuda_slice_mut::<T>()?;
            // Dropped at once: cudarc records the write event on `stream` now.
            let (_, _written) = slice.device_ptr_mut(&stream);
            Ok(())
        })
    }
}

/// A `SimpleBackend` over a load into candle's memory: what [`var_builder`] builds on.
pub struct PinnedSafetensors(Arc<Weights>);

impl SimpleBackend for PinnedSafetensors {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        self.0.get(&shape, name, dtype, device)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let tensor = self.0.landed(name)?;
        self.0.finish(tensor, dtype, device)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.loading.tensor(name).is_some()
    }
}

/// A `Backend` taking candle's tensor-parallel [`Shard`] hints, over a load into candle's
/// memory ([`CheckpointLoader::sharded_var_builder`]).
pub struct ShardedPinnedSafetensors(Arc<Weights>);

impl Backend for ShardedPinnedSafetensors {
    type Hints = Shard;

    fn get(
        &self,
        shape: Shape,
        name: &str,
        shard: Shard,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        if shard.world_size == 1 {
            return self.0.get(&shape, name, dtype, device);
        }
        let tensor = self.0.landed(name)?;
        let whole = &self.0.specs[name].1;
        let loaded_as = self.0.loading.tensor(name).and_then(LoadedTensor::split);
        let part = part(tensor, whole, loaded_as, name, shard)?;
        self.0.finish(part, dtype, device)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let tensor = self.0.landed(name)?;
        self.0.finish(tensor, dtype, device)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.loading.tensor(name).is_some()
    }
}

/// Rank `shard.rank`'s part of `tensor` (of the `whole` shape in its checkpoint), as
/// candle's sharded loading cuts it: along dimension 0 or 1, which must divide by the world's
/// size. A tensor the load took as that part already (its split named in the load's options)
/// is handed over as it is.
fn part(
    tensor: Tensor,
    whole: &[usize],
    loaded_as: Option<Split>,
    name: &str,
    shard: Shard,
) -> Result<Tensor> {
    let Shard {
        dim,
        rank,
        world_size,
    } = shard;
    if dim > 1 {
        return Err(candle_core::Error::Msg(format!(
            "{name}: candle shards along dimension 0 or 1, not {dim}"
        )));
    }
    if rank >= world_size {
        return Err(candle_core::Error::Msg(format!(
            "{name}: rank {rank} is outside a world of {world_size}"
        )));
    }
    let Some(&size) = whole.get(dim) else {
        return Err(candle_core::Error::Msg(format!(
            "{name}: a tensor of shape {whole:?} has no dimension {dim} to shard"
        )));
    };
    if size % world_size != 0 {
        return Err(candle_core::Error::ShapeMismatchSplit {
            shape: whole.into(),
            dim,
            n_parts: world_size,
        }
        .bt());
    }
    let block = size / world_size;
    if let Some(split) = loaded_as {
        // Evenly divided, pinned-io's split and candle's shard cut the same part.
        return if (split.dim(), split.rank(), split.world()) == (dim, rank, world_size) {
            Ok(tensor)
        } else {
            Err(candle_core::Error::Msg(format!(
                "{name}: the load took rank {} of {} along dimension {}, but the model asks for \
                 rank {rank} of {world_size} along dimension {dim}",
                split.rank(),
                split.world(),
                split.dim()
            )))
        };
    }
    // Cut on the device: along dimension 1 the part is strided, and made contiguous (a copy
    // of the part alone), as candle's own loader hands over contiguous tensors.
    tensor.narrow(dim, rank * block, block)?.contiguous()
}
