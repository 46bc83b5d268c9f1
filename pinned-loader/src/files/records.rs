//! Fixed-size records in one or more files: sharded binary datasets.

use std::path::Path;

use super::{FileError, Source};
use crate::dataset::Dataset;
use crate::error::BoxError;
use crate::fields::Fields;

/// A [`Dataset`] of fixed-size records in one or more files (shards such as `train-000.bin`,
/// `train-001.bin`), each record its fields' bytes one after another.
///
/// The layout is the dataset's [`Fields`]: `(Field::<u8>::new(3072), Field::<i64>::new(1))` reads
/// records of a 3,072-byte image then an 8-byte label. Elements are read in the machine's own
/// byte order. Sample `i` is the `i`-th record counting through the files in order; each
/// field of it is read into its place in the batch.
///
/// ```no_run
/// use pinned_loader::{Field, RecordDataset};
///
/// let layout = (Field::<u8>::new(3 * 32 * 32), Field::<i64>::new(1));
/// let shards = ["train-000.bin", "train-001.bin"];
/// let data = RecordDataset::open(&shards, 0, layout)?;
/// # Ok::<(), pinned_loader::FileError>(())
/// ```
#[derive(Debug)]
pub struct RecordDataset<F: Fields> {
    files: Vec<Source>,
    /// The first sample of each file: samples before it lie in earlier files.
    starts: Vec<usize>,
    len: usize,
    header_bytes: u64,
    fields: F,
    /// Where each field starts in a record.
    field_offsets: Vec<u64>,
    record_bytes: u64,
}

impl<F: Fields> RecordDataset<F> {
    /// Opens `paths` in order, each with a header of `header_bytes` skipped, then records of
    /// `layout`'s fields.
    ///
    /// # Errors
    ///
    /// [`FileError::Io`] for a file that cannot be opened; [`FileError::Invalid`] for records
    /// of no bytes, a file shorter than its header, or one whose data is not a whole number
    /// of records.
    pub fn open<P: AsRef<Path>>(
        paths: &[P],
        header_bytes: u64,
        layout: F,
    ) -> Result<Self, FileError> {
        let mut field_offsets = Vec::new();
        let mut record_bytes = 0u64;
        for bytes in layout.sample_bytes() {
            field_offsets.push(record_bytes);
            record_bytes = record_bytes.saturating_add(bytes as u64);
        }
        let mut files = Vec::with_capacity(paths.len());
        let mut starts = Vec::with_capacity(paths.len());
        let mut len = 0usize;
        for path in paths {
            let path = path.as_ref();
            let (source, file_len) = Source::open(path)?;
            let records = records_in(path, file_len, header_bytes, record_bytes)?;
            starts.push(len);
            len = usize::try_from(records)
                .ok()
                .and_then(|records| len.checked_add(records))
                .ok_or_else(|| FileError::invalid(path, "more records than an index can count"))?;
            files.push(source);
        }
        Ok(Self {
            files,
            starts,
            len,
            header_bytes,
            fields: layout,
            field_offsets,
            record_bytes,
        })
    }

    /// Records in each file, in order.
    pub fn records_per_file(&self) -> Vec<usize> {
        let ends = self.starts.iter().skip(1).copied().chain([self.len]);
        ends.zip(&self.starts)
            .map(|(end, start)| end - start)
            .collect()
    }

    /// Bytes of one record.
    pub fn record_bytes(&self) -> u64 {
        self.record_bytes
    }

    /// The file sample `index` lies in and the record's offset there, or `None` past the end.
    pub fn locate(&self, index: usize) -> Option<(&Path, u64)> {
        let (file, offset) = self.place(index)?;
        Some((&self.files[file].path, offset))
    }

    fn place(&self, index: usize) -> Option<(usize, u64)> {
        if index >= self.len {
            return None;
        }
        // The last file starting at or before the index: an empty file shares its start with
        // the next one, which comes after it and so is the one found.
        let file = self.starts.partition_point(|&start| start <= index) - 1;
        // Inside the file, whose size was checked to hold its records.
        let offset = self.header_bytes + (index - self.starts[file]) as u64 * self.record_bytes;
        Some((file, offset))
    }

    /// Tells the system every file will be read at random (a shuffled loader).
    ///
    /// # Errors
    ///
    /// [`FileError::Io`] with the system's error.
    pub fn advise_random(&self) -> Result<(), FileError> {
        self.files.iter().try_for_each(Source::advise_random)
    }
}

/// Records in a file of `file_len` bytes.
fn records_in(
    path: &Path,
    file_len: u64,
    header_bytes: u64,
    record_bytes: u64,
) -> Result<u64, FileError> {
    if record_bytes == 0 {
        return Err(FileError::invalid(path, "records of 0 bytes"));
    }
    let Some(data) = file_len.checked_sub(header_bytes) else {
        return Err(FileError::invalid(
            path,
            format!("{file_len} bytes, fewer than its header's {header_bytes}"),
        ));
    };
    let over = data % record_bytes;
    if over != 0 {
        return Err(FileError::invalid(
            path,
            format!(
                "{data} bytes after its header: {} records of {record_bytes} bytes and {over} \
                 bytes over",
                data / record_bytes
            ),
        ));
    }
    Ok(data / record_bytes)
}

impl<F: Fields> Dataset for RecordDataset<F> {
    type Fields = F;

    fn len(&self) -> usize {
        self.len
    }

    fn fields(&self) -> F {
        self.fields.clone()
    }

    /// Starts reading the batch's records side by side in each file whose first record of
    /// the batch is not in the page cache.
    fn read_ahead(&self, indices: &[usize]) {
        // Each file the batch reaches, and whether its first record there was cold.
        let mut cold: Vec<(usize, bool)> = Vec::new();
        for (file, record) in indices.iter().filter_map(|&index| self.place(index)) {
            let source = &self.files[file];
            let is_cold = match cold.iter().find(|(seen, _)| *seen == file) {
                Some(&(_, is_cold)) => is_cold,
                None => {
                    let is_cold = source.cached_at(record) == Some(false);
                    cold.push((file, is_cold));
                    is_cold
                }
            };
            if is_cold {
                source.will_need(record, self.record_bytes);
            }
        }
    }

    fn write(&self, index: usize, sample: F::Sample<'_>) -> Result<(), BoxError> {
        let Some((file, record)) = self.place(index) else {
            return Err(format!("sample {index} of {}", self.len).into());
        };
        let source = &self.files[file];
        let mut places = Vec::with_capacity(self.field_offsets.len());
        self.fields.sample_as_bytes(sample, &mut places);
        for (place, &at) in places.into_iter().zip(&self.field_offsets) {
            source.read_at(place, record + at, index)?;
        }
        Ok(())
    }
}
