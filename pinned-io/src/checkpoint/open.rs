//! A checkpoint opened: its files, and their headers read and checked.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::header::{Header, TensorSpec};
use super::index::ShardIndex;
use crate::error::{Error, Result};
use crate::file::DataFile;

/// A safetensors checkpoint: one file, or the shards an index names; its headers read and
/// checked, its data not yet.
///
/// # Examples
///
/// ```no_run
/// use cuda_pinned::Stream;
/// use pinned_io::{Checkpoint, FileReader, LoadOptions};
///
/// let checkpoint = Checkpoint::open("model.safetensors.index.json")?;
/// let reader = FileReader::new()?;
/// let loading = checkpoint.load(&reader, &LoadOptions::new())?;
/// let stream = Stream::new()?;
/// // The first tensor is usable as soon as it has landed, while the rest still loads.
/// let embed = loading.tensor("model.embed_tokens.weight").expect("in the checkpoint");
/// let weights = embed.ready_on(&stream)?; // `stream` waits for it on the device
/// # let _ = weights;
/// let loaded = loading.wait()?; // every tensor on the device
/// # Ok::<(), pinned_io::Error>(())
/// ```
#[derive(Debug)]
pub struct Checkpoint {
    pub(super) files: Vec<DataFile>,
    pub(super) headers: Vec<Header>,
    /// (file, tensor) of every tensor, in the files' order and each file's offset order.
    pub(super) order: Vec<(usize, usize)>,
    /// The bytes of all tensors (summed with a check: the sizes come from the files).
    bytes: u64,
}

impl Checkpoint {
    /// Opens a checkpoint: a `.safetensors` file, a sharded checkpoint's
    /// `*.safetensors.index.json`, or a directory holding either.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] for files that cannot be opened or read; [`Error::Format`] or
    /// [`Error::Truncated`] for a header or index that breaks the format (naming the file
    /// and, where one is at fault, the tensor); [`Error::Invalid`] for a directory with no
    /// checkpoint in it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let span = tracing::debug_span!(
            "open",
            path = %path.display(),
            files = tracing::field::Empty,
            tensors = tracing::field::Empty,
        )
        .entered();
        let opened = if path.is_dir() {
            Self::open_dir(path)
        } else if path.extension().is_some_and(|e| e == "json") {
            Self::open_index(path)
        } else {
            Self::open_files(&[path.to_owned()], None)
        }?;
        span.record("files", opened.files.len());
        span.record("tensors", opened.order.len());
        Ok(opened)
    }

    /// Opens the shards `paths`, in this order, as one checkpoint (what a caller that lists a
    /// model's `.safetensors` files itself has: candle's `from_mmaped_safetensors` takes such
    /// a list). Each path is opened as [`open`](Self::open) opens a `.safetensors` file.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open); [`Error::Format`] for a tensor in two shards; [`Error::Invalid`]
    /// for no path.
    pub fn open_shards(paths: &[impl AsRef<Path>]) -> Result<Self> {
        if paths.is_empty() {
            return Err(Error::Invalid(
                "a checkpoint needs at least one file".into(),
            ));
        }
        let paths: Vec<PathBuf> = paths.iter().map(|p| p.as_ref().to_owned()).collect();
        let _span =
            tracing::debug_span!("open", path = %paths[0].display(), files = paths.len()).entered();
        Self::open_files(&paths, None)
    }

    fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Self::open_index(&index);
        }
        let listing = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "listing", e))?;
        let mut files = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io(dir, "listing", e))?;
            if entry.path().extension().is_some_and(|e| e == "safetensors") {
                files.push(entry.path());
            }
        }
        if files.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: no `.safetensors` file or `model.safetensors.index.json` in the directory",
                dir.display()
            )));
        }
        files.sort();
        Self::open_files(&files, None)
    }

    fn open_index(path: &Path) -> Result<Self> {
        let index = ShardIndex::read(path)?;
        let shards = index.shards().to_vec();
        Self::open_files(&shards, Some(&index))
    }

    fn open_files(paths: &[PathBuf], index: Option<&ShardIndex>) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut headers = Vec::with_capacity(paths.len());
        let mut seen: foldhash::HashMap<&str, usize> = foldhash::HashMap::default();
        for (shard, path) in paths.iter().enumerate() {
            let file = DataFile::open(path)?;
            let header = Header::read(file.std_file(), path)?;
            if let Some(index) = index {
                index.check_against(shard, &header)?;
            }
            files.push(file);
            headers.push(header);
        }
        seen.reserve(headers.iter().map(|header| header.tensors().len()).sum());
        for (shard, header) in headers.iter().enumerate() {
            for tensor in header.tensors() {
                if let Some(first) = seen.insert(tensor.name(), shard) {
                    return Err(Error::format(
                        header.path(),
                        Some(tensor.name()),
                        format!("also in {}", headers[first].path().display()),
                    ));
                }
            }
        }
        let order = headers
            .iter()
            .enumerate()
            .flat_map(|(f, h)| (0..h.tensors().len()).map(move |t| (f, t)))
            .collect();
        let bytes = total_bytes(&headers)?;
        Ok(Self {
            files,
            headers,
            order,
            bytes,
        })
    }

    /// The tensors, shard after shard, each in its file's order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorSpec> {
        self.order
            .iter()
            .map(|&(f, t)| &self.headers[f].tensors()[t])
    }

    /// The free-form `__metadata__` of the checkpoint's first file, where it has one.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.headers.first().and_then(Header::metadata)
    }

    /// The files the checkpoint reads.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(DataFile::path)
    }

    /// The bytes of all tensors.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The bytes of every tensor of `headers` together; each file's were checked to fit it, but
/// several files (sparse ones, say) can claim more together than 64 bits count.
fn total_bytes(headers: &[Header]) -> Result<u64> {
    let mut total = 0u64;
    for header in headers {
        for tensor in header.tensors() {
            total = total.checked_add(tensor.bytes()).ok_or_else(|| {
                Error::format(
                    header.path(),
                    Some(tensor.name()),
                    "the checkpoint's tensors together hold more bytes than 64 bits count",
                )
            })?;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header of one `U8` tensor of `bytes` bytes, in a file just long enough for it.
    fn header_of(name: &str, bytes: u64) -> Header {
        let json = format!(
            r#"{{"{name}":{{"dtype":"U8","shape":[{bytes}],"data_offsets":[0,{bytes}]}}}}"#
        );
        let path = PathBuf::from(format!("{name}.safetensors"));
        let start = 8 + json.len() as u64;
        Header::parse(&path, json.as_bytes(), start, start + bytes).unwrap()
    }

    #[test]
    fn sizes_that_overflow_together_are_refused_naming_the_tensor() {
        // The largest tensors a header takes count their bits in 64 bits: 2^60 bytes each,
        // sixteen of them overflow a 64-bit byte count together.
        let huge = 1u64 << 60;
        let headers: Vec<Header> = (0..16).map(|i| header_of(&format!("s{i}"), huge)).collect();
        assert_eq!(total_bytes(&headers[..15]).unwrap(), 15 * huge);
        let error = total_bytes(&headers).unwrap_err();
        let text = error.to_string();
        assert!(matches!(error, Error::Format { .. }), "{text}");
        assert!(text.contains("s15.safetensors: tensor `s15`"), "{text}");
        assert!(text.contains("more bytes than 64 bits count"), "{text}");
    }
}
