//! A loader's batches as candle tensors: each field of a pinned batch is uploaded straight into
//! a tensor candle allocated and owns, on a stream of its own, and candle's stream waits for
//! the upload on the device.

use std::sync::Arc;

use bytemuck::Pod;
use candle_core::cuda::CudaDType;
use candle_core::cuda::cudarc::driver::{CudaStream, DeviceRepr};
use candle_core::{Device, Tensor, WithDType};
use cuda_pinned::CudarcCopies;
use pinned_loader::{Dataset, Epoch, Field, FieldBuffer, Fields, HostBatch, Loader};

use crate::device::Target;
use crate::error::{Result, wrap};

/// The element types a batch's field may have as a candle tensor: candle's numbers that are
/// plain old data.
pub trait TensorElement: WithDType + CudaDType + DeviceRepr + Pod {}

impl<T: WithDType + CudaDType + DeviceRepr + Pod> TensorElement for T {}

/// Fields whose batches become candle tensors: [`Field`]`<T>` of a [`TensorElement`], and
/// tuples of up to six of them.
pub trait TensorFields: Fields {
    /// Elements per sample of each field, in order.
    fn elements(&self) -> Vec<usize>;

    /// Uploads a batch of `samples` samples, one buffer per field, into new tensors (one per
    /// field, in order) with `upload`.
    fn upload(
        &self,
        buffers: Self::Buffers,
        samples: usize,
        upload: &Upload<'_>,
    ) -> Result<Vec<Tensor>>;
}

impl<T: TensorElement + Send + Sync> TensorFields for Field<T> {
    fn elements(&self) -> Vec<usize> {
        vec![self.per_sample()]
    }

    fn upload(
        &self,
        buffer: FieldBuffer<T>,
        samples: usize,
        upload: &Upload<'_>,
    ) -> Result<Vec<Tensor>> {
        Ok(vec![upload.field(buffer, samples, self.per_sample())?])
    }
}

macro_rules! tuple_fields {
    ($(($name:ident, $var:ident)),+) => {
        impl<$($name: TensorFields),+> TensorFields for ($($name,)+) {
            fn elements(&self) -> Vec<usize> {
                #[allow(non_snake_case)]
                let ($($name,)+) = self;
                let mut elements = Vec::new();
                $(elements.extend($name.elements());)+
                elements
            }

            fn upload(
                &self,
                ($($var,)+): Self::Buffers,
                samples: usize,
                upload: &Upload<'_>,
            ) -> Result<Vec<Tensor>> {
                #[allow(non_snake_case)]
                let ($($name,)+) = self;
                let mut tensors = Vec::new();
                $(tensors.extend($name.upload($var, samples, upload)?);)+
                Ok(tensors)
            }
        }
    };
}

tuple_fields!((A, a));
tuple_fields!((A, a), (B, b));
tuple_fields!((A, a), (B, b), (C, c));
tuple_fields!((A, a), (B, b), (C, c), (D, d));
tuple_fields!((A, a), (B, b), (C, c), (D, d), (E, e));
tuple_fields!((A, a), (B, b), (C, c), (D, d), (E, e), (F, f));

/// Where a batch's fields go: the device, the upload stream, and each field's sample shape.
pub struct Upload<'a> {
    target: &'a Target,
    stream: &'a Arc<CudaStream>,
    shapes: &'a [Vec<usize>],
    /// The field the next [`field`](Self::field) uploads (a cell: tuples call it in order).
    next: std::cell::Cell<usize>,
}

impl Upload<'_> {
    /// Uploads one field's `samples` samples of `per_sample` elements into a new tensor of
    /// candle's memory.
    fn field<T: TensorElement>(
        &self,
        buffer: FieldBuffer<T>,
        samples: usize,
        per_sample: usize,
    ) -> Result<Tensor> {
        let index = self.next.replace(self.next.get() + 1);
        let elements = samples * per_sample;
        // On the upload stream, not candle's: an allocation there would order the upload after
        // all the work candle has queued. cudarc frees it there too, after candle's uses
        // (its tracking has them as reads on candle's stream).
        // SAFETY: the memory is not initialised; the upload below writes every element
        // before the tensor is handed out (candle's stream waits for it, and cudarc's
        // tracking records it), and any bytes are valid plain numbers.
        let mut slice = unsafe { self.stream.alloc::<T>(elements) }.map_err(wrap)?;
        // The batch's pinned memory goes back to the loader once the copy is done: the
        // transfer's drop hands it over behind the copy's event.
        drop(
            self.stream
                .copy_to_device(buffer, &mut slice)
                .map_err(wrap)?,
        );
        let (tensor, _) = crate::memory::wrap(self.target, slice);
        let mut shape = vec![samples];
        match self.shapes.get(index) {
            Some(sample) => shape.extend_from_slice(sample),
            None if per_sample == 1 => {}
            None => shape.push(per_sample),
        }
        tensor.reshape(shape)
    }
}

/// A loader's batches as candle tensors on a CUDA device: the one-line way from a
/// [`Loader`] to a candle training loop.
///
/// Each field of a batch becomes a tensor of shape `(samples, per_sample)` (`(samples,)` for
/// a field of one element per sample, or the sample shapes of
/// [`with_sample_shapes`](Self::with_sample_shapes)), in memory candle owns: the workers
/// write the samples into pinned memory, and the batch is uploaded straight into the tensors
/// on a stream of its own while candle's stream computes; candle's stream waits for the upload
/// on the device, and the host never does.
///
/// ```no_run
/// use candle_core::Device;
/// use pinned_candle::TensorLoader;
/// use pinned_loader::{Dataset, Field, Loader, LoaderConfig};
///
/// fn train<D: Dataset<Fields = (Field<f32>, Field<u32>)>>(data: D) -> candle_core::Result<()> {
///     let device = Device::new_cuda_with_stream(0)?;
///     let loader = Loader::new(data, LoaderConfig::new(256).workers(8).shuffle(7))
///         .map_err(candle_core::Error::wrap)?;
///     let mut batches = TensorLoader::new(loader, &device)?.with_sample_shapes(&[&[3, 32, 32][..], &[]])?;
///     for epoch in 0..10 {
///         for batch in batches.epoch(epoch) {
///             let [images, labels] = &batch?.into_tensors()[..] else { unreachable!() };
///             // ... forward, loss, backward on `images` (256, 3, 32, 32) and `labels` (256,) ...
/// #           let _ = (images, labels);
///         }
///     }
///     Ok(())
/// }
/// ```
pub struct TensorLoader<D: Dataset>
where
    D::Fields: TensorFields,
{
    loader: Loader<D>,
    fields: D::Fields,
    target: Target,
    /// Uploads run here, beside candle's stream.
    stream: Arc<CudaStream>,
    shapes: Vec<Vec<usize>>,
}

impl<D: Dataset> TensorLoader<D>
where
    D::Fields: TensorFields,
{
    /// Batches of `loader` as tensors on `device`.
    ///
    /// # Errors
    ///
    /// A device that is not a CUDA one; the CUDA error of making the upload stream.
    pub fn new(loader: Loader<D>, device: &Device) -> Result<Self> {
        let target = Target::of(device)?;
        let stream = target.stream.context().new_stream().map_err(wrap)?;
        Ok(Self {
            fields: loader.dataset().fields(),
            loader,
            target,
            stream,
            shapes: Vec::new(),
        })
    }

    /// Shapes each field's samples: field `k`'s tensor is `(samples, shapes[k]…)`. An empty
    /// shape is a field of one element per sample.
    ///
    /// # Errors
    ///
    /// `candle_core::Error::Msg` when the number of shapes is not the number of fields, or a
    /// shape's elements are not its field's per sample.
    pub fn with_sample_shapes(mut self, shapes: &[&[usize]]) -> Result<Self> {
        let elements = self.fields.elements();
        if shapes.len() != elements.len() {
            return Err(candle_core::Error::Msg(format!(
                "{} sample shapes for {} fields",
                shapes.len(),
                elements.len()
            )));
        }
        for (field, (shape, &elements)) in shapes.iter().zip(&elements).enumerate() {
            if shape.iter().product::<usize>() != elements {
                return Err(candle_core::Error::Msg(format!(
                    "field {field} has {elements} elements per sample, not a shape of {shape:?}"
                )));
            }
        }
        self.shapes = shapes.iter().map(|shape| shape.to_vec()).collect();
        Ok(self)
    }

    /// The loader behind it: its statistics, its epochs' verdicts.
    pub fn loader(&self) -> &Loader<D> {
        &self.loader
    }

    /// The batches of epoch `epoch`.
    pub fn epoch(&mut self, epoch: u64) -> TensorEpoch<'_, D> {
        TensorEpoch {
            batches: self.loader.epoch(epoch),
            fields: &self.fields,
            target: &self.target,
            stream: &self.stream,
            shapes: &self.shapes,
        }
    }
}

/// One epoch of a [`TensorLoader`]: an iterator of `Result<TensorBatch>`.
pub struct TensorEpoch<'a, D: Dataset>
where
    D::Fields: TensorFields,
{
    batches: Epoch<'a, D>,
    fields: &'a D::Fields,
    target: &'a Target,
    stream: &'a Arc<CudaStream>,
    shapes: &'a [Vec<usize>],
}

impl<D: Dataset> Iterator for TensorEpoch<'_, D>
where
    D::Fields: TensorFields,
{
    type Item = Result<TensorBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        let batch = match self.batches.next()? {
            Ok(batch) => batch,
            Err(error) => return Some(Err(wrap(error))),
        };
        Some(self.upload(batch))
    }
}

impl<D: Dataset> TensorEpoch<'_, D>
where
    D::Fields: TensorFields,
{
    fn upload(&self, batch: HostBatch<D::Fields>) -> Result<TensorBatch> {
        let (index, samples) = (batch.index(), batch.len());
        let indices = batch.indices().to_vec();
        let upload = Upload {
            target: self.target,
            stream: self.stream,
            shapes: self.shapes,
            next: std::cell::Cell::new(0),
        };
        let tensors = self.fields.upload(batch.into_buffers(), samples, &upload)?;
        // candle's stream waits for the uploads on the device; cudarc's tracking has the
        // tensors' write events too, for work on other streams.
        self.target.stream.join(self.stream).map_err(wrap)?;
        Ok(TensorBatch {
            index,
            indices,
            tensors,
        })
    }
}

/// A batch as candle tensors, one per field, ready on candle's stream.
#[derive(Debug, Clone)]
pub struct TensorBatch {
    index: usize,
    indices: Vec<usize>,
    tensors: Vec<Tensor>,
}

impl TensorBatch {
    /// The batch's number in its epoch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The dataset indices of its samples: row `j` of every tensor is sample `indices()[j]`.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// The fields' tensors, in the fields' order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The fields' tensors, taken.
    pub fn into_tensors(self) -> Vec<Tensor> {
        self.tensors
    }
}
