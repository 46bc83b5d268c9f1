//! Datasets: where samples come from, written straight into a batch's pinned memory.

use std::sync::Arc;

use cuda_pinned::{PinnedAllocator, PinnedVec};

use crate::error::{BoxError, LoaderError};
use crate::fields::{Collate, Fields};

/// A map-style dataset (PyTorch's `Dataset` with `__len__` and `__getitem__`) that writes
/// each sample into its place in a pinned batch: no copy through pageable memory.
///
/// ```
/// use pinned_loader::{BoxError, Dataset, Field};
///
/// struct Images { pixels: Vec<u8>, labels: Vec<i64> }
/// const IMAGE: usize = 3 * 32 * 32;
///
/// impl Dataset for Images {
///     type Fields = (Field<u8>, Field<i64>);
///     fn len(&self) -> usize { self.labels.len() }
///     fn fields(&self) -> Self::Fields { (Field::new(IMAGE), Field::new(1)) }
///     fn write(&self, i: usize, (image, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
///         pinned_loader::copy_streaming(image, &self.pixels[i * IMAGE..(i + 1) * IMAGE]);
///         label[0] = self.labels[i];
///         Ok(())
///     }
/// }
/// ```
pub trait Dataset: Send + Sync + 'static {
    /// The fields of a sample, and so of a batch.
    type Fields: Fields;

    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fields, with their sizes.
    fn fields(&self) -> Self::Fields;

    /// Writes sample `index` into `sample` (its place in a pinned batch). Called from worker
    /// threads, several at once.
    ///
    /// # Errors
    ///
    /// Whatever the dataset meets (a file that cannot be read): the loader reports it with
    /// the batch and the sample, and goes on with the next batch.
    fn write(
        &self,
        index: usize,
        sample: <Self::Fields as Fields>::Sample<'_>,
    ) -> Result<(), BoxError>;

    /// Names the samples of a batch, in order, before any of them is written: a dataset
    /// reading files starts reading them all here (the file datasets of this crate do, where
    /// the batch is not in the page cache), so that a cold batch's reads reach the disk side
    /// by side rather than one after another. The default does nothing.
    ///
    /// Each batch is named once, by the thread that writes it or, earlier, by a worker that
    /// took a batch queued before it (so that the disk still has reads queued while workers
    /// move from one batch to the next); its samples are written only once the call has
    /// returned. A panic here fails the batch named, not the one its caller writes.
    fn read_ahead(&self, indices: &[usize]) {
        let _ = indices;
    }

    /// The samples in page-locked memory, when the dataset keeps them there
    /// ([`PinnedSamples`]): workers then copy bytes, and a batch can be gathered on the device
    /// with no host copy at all. `None` (the default) otherwise.
    fn pinned_storage(&self) -> Option<&PinnedStorage> {
        None
    }
}

/// Where the samples of a [`PinnedSamples`] dataset lie: each field's samples side by side
/// in page-locked memory that stays put while the dataset lives.
#[derive(Debug)]
pub struct PinnedStorage {
    len: usize,
    sample_bytes: Vec<usize>,
    /// Start of each field's samples.
    starts: Vec<u64>,
}

impl PinnedStorage {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes per sample of each field.
    pub fn sample_bytes(&self) -> &[usize] {
        &self.sample_bytes
    }

    /// The host address of field `field` of sample `index` (for copies the DMA engine makes).
    ///
    /// # Panics
    ///
    /// When either is out of range.
    pub fn address(&self, index: usize, field: usize) -> u64 {
        assert!(index < self.len, "sample {index} of {}", self.len);
        self.starts[field] + (index * self.sample_bytes[field]) as u64
    }

    /// The bytes of field `field` of sample `index`.
    ///
    /// # Panics
    ///
    /// When either is out of range.
    pub fn sample(&self, index: usize, field: usize) -> &[u8] {
        let address = self.address(index, field);
        // SAFETY: a `PinnedStorage` is only made by `PinnedSamples`, whose regions hold
        // `len * sample_bytes` initialised bytes from each start, are never written after
        // construction, and live as long as the `&self` this borrows from.
        unsafe { std::slice::from_raw_parts(address as *const u8, self.sample_bytes[field]) }
    }
}

/// A dataset that produces each sample as a value (PyTorch's `__getitem__`); the loader's
/// collate step writes it into the batch. Every `SampleDataset` is a [`Dataset`].
///
/// ```
/// use pinned_loader::{BoxError, Field, SampleDataset};
///
/// struct Squares;
/// impl SampleDataset for Squares {
///     type Sample = ([f32; 2], u32);
///     type Fields = (Field<f32>, Field<u32>);
///     fn len(&self) -> usize { 100 }
///     fn fields(&self) -> Self::Fields { (Field::new(2), Field::new(1)) }
///     fn get(&self, i: usize) -> Result<Self::Sample, BoxError> {
///         Ok(([i as f32, (i * i) as f32], i as u32))
///     }
/// }
/// ```
pub trait SampleDataset: Send + Sync + 'static {
    /// One sample as a value.
    type Sample;
    /// The fields it is written into.
    type Fields: Fields + Collate<Self::Sample>;

    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        SampleDataset::len(self) == 0
    }

    /// The fields, with their sizes.
    fn fields(&self) -> Self::Fields;

    /// Sample `index`.
    ///
    /// # Errors
    ///
    /// Whatever the dataset meets; see [`Dataset::write`].
    fn get(&self, index: usize) -> Result<Self::Sample, BoxError>;
}

impl<D: SampleDataset> Dataset for D {
    type Fields = D::Fields;

    fn len(&self) -> usize {
        SampleDataset::len(self)
    }

    fn fields(&self) -> D::Fields {
        SampleDataset::fields(self)
    }

    fn write(
        &self,
        index: usize,
        sample: <D::Fields as Fields>::Sample<'_>,
    ) -> Result<(), BoxError> {
        let value = self.get(index)?;
        SampleDataset::fields(self).collate(value, sample)
    }
}

/// A dataset held in page-locked memory, each field's samples side by side.
///
/// It is pinned once (from any other dataset), then read by the loader's workers with one `memcpy`
/// per field, or gathered on the device by the DMA engine with no host copy at all
/// ([`DeviceLoader`](crate::DeviceLoader) with [`Assembly::DeviceGather`](crate::Assembly)).
pub struct PinnedSamples<F: Fields, A: PinnedAllocator = cuda_pinned::DefaultPinned> {
    fields: F,
    storage: PinnedStorage,
    /// Owns the memory `storage` describes; never written after construction.
    _regions: Vec<PinnedVec<u8, A>>,
}

impl<F: Fields> PinnedSamples<F> {
    /// Pins every sample of `dataset` (in [`DefaultPinned`](cuda_pinned::DefaultPinned)
    /// memory).
    ///
    /// # Errors
    ///
    /// The allocation's error, or the first sample the dataset fails to write.
    pub fn from_dataset<D: Dataset<Fields = F>>(dataset: &D) -> Result<Self, LoaderError> {
        Self::from_dataset_in(dataset, cuda_pinned::DefaultPinned)
    }
}

impl<F: Fields, A: PinnedAllocator + Clone> PinnedSamples<F, A> {
    /// Pins every sample of `dataset` in memory from `allocator`.
    ///
    /// # Errors
    ///
    /// As [`from_dataset`](PinnedSamples::from_dataset).
    pub fn from_dataset_in<D: Dataset<Fields = F>>(
        dataset: &D,
        allocator: A,
    ) -> Result<Self, LoaderError> {
        let fields = dataset.fields();
        let sample_bytes = fields.sample_bytes();
        let len = dataset.len();
        let mut regions = Vec::new();
        for &bytes in &sample_bytes {
            let total = bytes
                .checked_mul(len)
                .ok_or(cuda_pinned::Error::CapacityOverflow)?;
            regions.push(PinnedVec::zeroed_in(total, allocator.clone())?);
        }
        for index in 0..len {
            let mut views = regions
                .iter_mut()
                .zip(&sample_bytes)
                .map(|(region, &bytes)| &mut region[index * bytes..(index + 1) * bytes]);
            let sample = fields.sample(&mut views);
            dataset
                .write(index, sample)
                .map_err(|source| LoaderError::Sample {
                    batch: 0,
                    sample: index,
                    source,
                })?;
        }
        let storage = PinnedStorage {
            len,
            starts: regions.iter().map(|r| r.as_ptr() as u64).collect(),
            sample_bytes,
        };
        Ok(Self {
            fields,
            storage,
            _regions: regions,
        })
    }

    /// Bytes pinned.
    pub fn pinned_bytes(&self) -> usize {
        self.storage.sample_bytes.iter().sum::<usize>() * self.storage.len
    }
}

impl<F: Fields, A: PinnedAllocator + Send + Sync + 'static> Dataset for PinnedSamples<F, A> {
    type Fields = F;

    fn len(&self) -> usize {
        self.storage.len
    }

    fn fields(&self) -> F {
        self.fields.clone()
    }

    fn write(&self, index: usize, sample: F::Sample<'_>) -> Result<(), BoxError> {
        let mut into = Vec::new();
        self.fields.sample_as_bytes(sample, &mut into);
        for (field, into) in into.into_iter().enumerate() {
            cuda_pinned::copy_streaming(into, self.storage.sample(index, field));
        }
        Ok(())
    }

    fn pinned_storage(&self) -> Option<&PinnedStorage> {
        Some(&self.storage)
    }
}

/// Shared ownership of a dataset is a dataset.
impl<D: Dataset> Dataset for Arc<D> {
    type Fields = D::Fields;
    fn len(&self) -> usize {
        (**self).len()
    }
    fn fields(&self) -> D::Fields {
        (**self).fields()
    }
    fn write(
        &self,
        index: usize,
        sample: <D::Fields as Fields>::Sample<'_>,
    ) -> Result<(), BoxError> {
        (**self).write(index, sample)
    }
    fn read_ahead(&self, indices: &[usize]) {
        (**self).read_ahead(indices);
    }
    fn pinned_storage(&self) -> Option<&PinnedStorage> {
        (**self).pinned_storage()
    }
}
