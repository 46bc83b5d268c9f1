//! `.npy` arrays, and datasets of one array per field.

use std::path::Path;

use bytemuck::Pod;

use super::header::{self, Layout};
use super::{FileError, Source};
use crate::dataset::Dataset;
use crate::error::BoxError;
use crate::fields::{Field, Fields};

/// One `.npy` file, opened and checked: its first axis counts the samples, the others shape
/// one sample.
///
/// Reads numpy's format versions 1.0, 2.0 and 3.0, C-ordered, of little-endian bool, integer
/// and float elements of 1 to 8 bytes (`|b1 |u1 |i1 <u2 <i2 <f2 <u4 <i4 <f4 <u8 <i8 <f8`).
/// Each sample is read with `pread` (and no mapping) wherever the caller wants it.
///
/// ```no_run
/// let images = pinned_loader::NpyArray::open("train_images.npy")?;
/// println!("{} samples of {:?} {}", images.len(), images.sample_shape(), images.descr());
/// # Ok::<(), pinned_loader::FileError>(())
/// ```
#[derive(Debug)]
pub struct NpyArray {
    source: Source,
    layout: Layout,
}

impl NpyArray {
    /// Opens the `.npy` file at `path` and checks its header against its length.
    ///
    /// # Errors
    ///
    /// [`FileError::Io`] when it cannot be opened or read; [`FileError::Invalid`] for a header
    /// that is not numpy's (or of a version, element type or order not read here: big-endian
    /// and Fortran-ordered arrays among them), a shape whose size overflows, or a file
    /// shorter than its header and data.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, FileError> {
        let (source, file_len) = Source::open(path.as_ref())?;
        Self::read_header(source, file_len)
    }

    /// Reads and checks the header of `source`, `file_len` bytes long.
    fn read_header(source: Source, file_len: u64) -> Result<Self, FileError> {
        let path = source.path.as_path();
        let invalid = |reason| FileError::invalid(path, reason);
        // A read that found the file's end found it shrunk since it was sized; any other
        // error is the system's, kept as it is.
        let shrunk = |error| match error {
            FileError::Shrunk { .. } => invalid("the file shrank while its header was read".into()),
            error => error,
        };
        let mut preamble = vec![0; file_len.min(12) as usize];
        source.read_at(&mut preamble, 0, 0).map_err(shrunk)?;
        let end = header::header_end(&preamble).map_err(invalid)?;
        if end > file_len {
            return Err(invalid(format!(
                "the header runs to byte {end}, past the file's end at {file_len}"
            )));
        }
        // At most `MAX_HEADER` and a preamble, both checked above.
        let mut head = vec![0; end as usize];
        source.read_at(&mut head, 0, 0).map_err(shrunk)?;
        let layout = header::parse(&head, file_len).map_err(invalid)?;
        Ok(Self { source, layout })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.source.path
    }

    /// Samples: the length of the first axis.
    pub fn len(&self) -> usize {
        self.layout.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole shape, the samples' axis first.
    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    /// One sample's shape: every axis but the first.
    pub fn sample_shape(&self) -> &[usize] {
        &self.layout.shape[1..]
    }

    /// Elements in one sample.
    pub fn sample_elements(&self) -> usize {
        self.sample_bytes() / self.layout.item_bytes
    }

    /// The element type as numpy writes it: `|u1`, `<f4`, `<i8`.
    pub fn descr(&self) -> &'static str {
        self.layout.descr
    }

    /// Bytes of one element.
    pub fn item_bytes(&self) -> usize {
        self.layout.item_bytes
    }

    /// Bytes of one sample.
    pub fn sample_bytes(&self) -> usize {
        self.layout.sample_bytes
    }

    /// Where the data starts in the file: the header's end.
    pub fn data_offset(&self) -> u64 {
        self.layout.data_offset
    }

    /// Reads sample `index` into `into`, [`sample_bytes`](Self::sample_bytes) long, with
    /// `pread`.
    ///
    /// # Errors
    ///
    /// [`FileError::Invalid`] for an index past the end or an `into` of another length;
    /// [`FileError::Shrunk`] when the file ends inside the sample (it was cut after it was
    /// opened); [`FileError::Io`] for a failed read.
    pub fn read_sample(&self, index: usize, into: &mut [u8]) -> Result<(), FileError> {
        if index >= self.len() || into.len() != self.sample_bytes() {
            return Err(FileError::invalid(
                self.path(),
                format!(
                    "sample {index} into {} bytes: the array has {} samples of {} bytes",
                    into.len(),
                    self.len(),
                    self.sample_bytes()
                ),
            ));
        }
        // Inside the file's data, which was checked to fit when it was opened.
        let offset = self.layout.data_offset + index as u64 * self.sample_bytes() as u64;
        self.source.read_at(into, offset, index)
    }

    /// Starts reading samples `indices` (those past the end are left out) into the page
    /// cache side by side, where the first of them is not there yet; returns at once. The
    /// loader calls it through [`Dataset::read_ahead`] with each batch, a little before
    /// the batch is written.
    pub fn read_ahead(&self, indices: &[usize]) {
        let bytes = self.sample_bytes() as u64;
        let start = self.layout.data_offset;
        self.source.read_ahead(
            (indices.iter())
                .filter(|&&index| index < self.len())
                .map(|&index| (start + index as u64 * bytes, bytes)),
        );
    }

    /// Tells the system this file will be read at random (a shuffled loader): it then reads
    /// ahead no more than each sample.
    ///
    /// # Errors
    ///
    /// [`FileError::Io`] with the system's error.
    pub fn advise_random(&self) -> Result<(), FileError> {
        self.source.advise_random()
    }
}

/// A Rust element type and the `.npy` element types it reads: a field of `T` refuses an array
/// of any other type when the dataset is opened.
///
/// Implemented for the integers of 1 to 8 bytes and `f32`/`f64`. `u8` also reads numpy's bools
/// (`|b1`, one byte of 0 or 1 each) and `u16` its half floats (`<f2`, as raw bits).
pub trait NpyElement: Pod + Send + Sync {
    /// The `.npy` element types read as `Self`, as numpy writes them.
    const DESCRS: &'static [&'static str];
}

macro_rules! npy_element {
    ($($ty:ty => [$($descr:literal),+]),+ $(,)?) => {
        $(impl NpyElement for $ty {
            const DESCRS: &'static [&'static str] = &[$($descr),+];
        })+
    };
}

npy_element! {
    u8 => ["|u1", "|b1"],
    i8 => ["|i1"],
    u16 => ["<u2", "<f2"],
    i16 => ["<i2"],
    u32 => ["<u4"],
    i32 => ["<i4"],
    f32 => ["<f4"],
    u64 => ["<u8"],
    i64 => ["<i8"],
    f64 => ["<f8"],
}

/// Fields that can be read from `.npy` arrays, one array per [`Field`]: a `Field<T>` of an
/// [`NpyElement`] `T`, and tuples of up to six of them.
pub trait NpyFields: Fields {
    /// Arrays taken: one per field.
    const ARRAYS: usize;

    /// The fields for `arrays`, taken in order, each checked against its field's element
    /// type and sized to a sample of its array.
    ///
    /// # Errors
    ///
    /// [`FileError::Invalid`] naming an array whose element type the field's does not read.
    fn for_arrays(arrays: &mut dyn Iterator<Item = &NpyArray>) -> Result<Self, FileError>;
}

impl<T: NpyElement> NpyFields for Field<T> {
    const ARRAYS: usize = 1;

    fn for_arrays(arrays: &mut dyn Iterator<Item = &NpyArray>) -> Result<Self, FileError> {
        let Some(array) = arrays.next() else {
            return Err(FileError::invalid(
                Path::new(""),
                "fewer arrays than fields",
            ));
        };
        if !T::DESCRS.contains(&array.descr()) {
            return Err(FileError::invalid(
                array.path(),
                format!(
                    "holds {} elements, which a field of {} does not read (it reads {})",
                    array.descr(),
                    std::any::type_name::<T>(),
                    T::DESCRS.join(", ")
                ),
            ));
        }
        Ok(Field::new(array.sample_elements()))
    }
}

macro_rules! tuple_npy_fields {
    ($($name:ident),+) => {
        impl<$($name: NpyFields),+> NpyFields for ($($name,)+) {
            const ARRAYS: usize = 0 $(+ $name::ARRAYS)+;

            fn for_arrays(
                arrays: &mut dyn Iterator<Item = &NpyArray>,
            ) -> Result<Self, FileError> {
                Ok(($($name::for_arrays(arrays)?,)+))
            }
        }
    };
}

tuple_npy_fields!(A);
tuple_npy_fields!(A, B);
tuple_npy_fields!(A, B, C);
tuple_npy_fields!(A, B, C, D);
tuple_npy_fields!(A, B, C, D, E);
tuple_npy_fields!(A, B, C, D, E, F);

/// A [`Dataset`] over `.npy` arrays of the same number of samples, one array per field:
/// sample `i` of the dataset is sample `i` of every array, read into its place in the batch.
///
/// ```no_run
/// use pinned_loader::{Field, Loader, LoaderConfig, NpyDataset};
///
/// // images: (N, 3, 32, 32) |u1; labels: (N,) <i8
/// let data = NpyDataset::<(Field<u8>, Field<i64>)>::open(&["images.npy", "labels.npy"])?;
/// let mut loader = Loader::new(data, LoaderConfig::new(256).workers(8).shuffle(1))?;
/// for batch in loader.epoch(0) {
///     let batch = batch?;
///     let (images, labels) = batch.fields();
///     assert_eq!(images.len(), 3 * 32 * 32 * labels.len());
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct NpyDataset<F: NpyFields> {
    arrays: Vec<NpyArray>,
    fields: F,
    len: usize,
}

impl<F: NpyFields> NpyDataset<F> {
    /// Opens one `.npy` file per field, in the fields' order.
    ///
    /// # Errors
    ///
    /// As [`NpyArray::open`] for each file, then as [`new`](Self::new).
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<Self, FileError> {
        let arrays = paths.iter().map(NpyArray::open).collect::<Result<_, _>>()?;
        Self::new(arrays)
    }

    /// A dataset over `arrays`, one per field, in the fields' order.
    ///
    /// # Errors
    ///
    /// [`FileError::Invalid`] for a count of arrays other than the fields', an array whose
    /// element type its field does not read, or arrays of different numbers of samples.
    pub fn new(arrays: Vec<NpyArray>) -> Result<Self, FileError> {
        let Some(first) = arrays.first() else {
            return Err(FileError::invalid(
                Path::new(""),
                format!("no arrays, for {} fields", F::ARRAYS),
            ));
        };
        if arrays.len() != F::ARRAYS {
            return Err(FileError::invalid(
                first.path(),
                format!("one of {} arrays, for {} fields", arrays.len(), F::ARRAYS),
            ));
        }
        if let Some(other) = arrays.iter().find(|a| a.len() != first.len()) {
            return Err(FileError::invalid(
                other.path(),
                format!(
                    "{} samples, where {} has {}",
                    other.len(),
                    first.path().display(),
                    first.len()
                ),
            ));
        }
        let fields = F::for_arrays(&mut arrays.iter())?;
        let len = first.len();
        Ok(Self {
            arrays,
            fields,
            len,
        })
    }

    /// The arrays, one per field.
    pub fn arrays(&self) -> &[NpyArray] {
        &self.arrays
    }

    /// Tells the system every array will be read at random (a shuffled loader).
    ///
    /// # Errors
    ///
    /// As [`NpyArray::advise_random`].
    pub fn advise_random(&self) -> Result<(), FileError> {
        self.arrays.iter().try_for_each(NpyArray::advise_random)
    }
}

impl<F: NpyFields> Dataset for NpyDataset<F> {
    type Fields = F;

    fn len(&self) -> usize {
        self.len
    }

    fn fields(&self) -> F {
        self.fields.clone()
    }

    fn read_ahead(&self, indices: &[usize]) {
        for array in &self.arrays {
            array.read_ahead(indices);
        }
    }

    fn write(&self, index: usize, sample: F::Sample<'_>) -> Result<(), BoxError> {
        let mut places = Vec::with_capacity(F::ARRAYS);
        self.fields.sample_as_bytes(sample, &mut places);
        for (array, place) in self.arrays.iter().zip(places) {
            array.read_sample(index, place)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "Miri's isolation refuses to open files")]
    fn an_error_reading_the_header_is_the_systems_own() {
        // A descriptor that cannot read: every read fails with the system's error (EBADF),
        // which must reach the caller as it is, not as a file that shrank.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("write-only.npy");
        std::fs::write(&path, [0u8; 128]).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let source = Source {
            path: path.clone(),
            file,
            probe: None,
        };
        let error = NpyArray::read_header(source, 128).unwrap_err();
        let FileError::Io {
            path: at, source, ..
        } = &error
        else {
            panic!("not the system's error: {error}");
        };
        assert_eq!(at, &path);
        assert_eq!(source.raw_os_error(), Some(libc::EBADF), "{error}");
    }
}
