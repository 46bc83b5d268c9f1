//! One safetensors file's header, read with two `pread`s and checked as untrusted input.
//!
//! The file is an 8-byte little-endian length `n`, `n` bytes of JSON, then the data section. The
//! JSON maps each tensor's name to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative
//! to the data section) and may hold a `__metadata__` map of strings. The checks follow the
//! `safetensors` crate's `Metadata::validate`, and go further where its reader is lenient: a
//! duplicate key or an unknown field is refused rather than silently dropped.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};

use crate::error::{Error, Result};

#[cfg(test)]
mod tests;

/// The format's cap on the JSON header, the one number read before anything is allocated.
pub(crate) const MAX_HEADER_LEN: u64 = 100_000_000;

/// The bytes of the little-endian header length that opens every file.
const LEN_BYTES: u64 = 8;

/// The reserved key under which a file keeps its free-form string metadata.
const METADATA_KEY: &str = "__metadata__";

/// One tensor of a checkpoint: its name, element type, shape and where its bytes lie in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: u64,
    bytes: u64,
}

impl TensorSpec {
    /// The tensor's name, as the header spells it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The type of each element.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The extent of each dimension, outermost first (C order); empty for a scalar.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The absolute byte offset of the tensor's first byte in its file.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The tensor's length in bytes, which the header has been checked to agree with
    /// dtype × shape.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A checked safetensors header: tensors ordered by offset, lying disjoint and without holes in a
/// data section that fits in the file.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    path: PathBuf,
    tensors: Vec<TensorSpec>,
    metadata: Option<HashMap<String, String>>,
    #[cfg_attr(not(test), allow(dead_code, reason = "the tests check the layout"))]
    data_start: u64,
    #[cfg_attr(not(test), allow(dead_code, reason = "the tests check the layout"))]
    data_end: u64,
    #[cfg_attr(not(test), allow(dead_code, reason = "the tests check the layout"))]
    file_len: u64,
}

impl Header {
    /// Reads and checks the header of `file`, which was opened from `path`.
    ///
    /// Only the 8-byte length and the JSON it announces are read; the length is checked against
    /// [`MAX_HEADER_LEN`] and the file's size before anything is allocated for it.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`] when the file is shorter than its length field, its header, or the
    /// data section the header describes; [`Error::Format`] for a header over the cap or one that
    /// breaks the format; [`Error::Io`] when the file cannot be inspected or read.
    pub(crate) fn read(file: &File, path: &Path) -> Result<Header> {
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(path, "inspecting the checkpoint", e))?
            .len();
        let mut len_field = [0u8; LEN_BYTES as usize];
        read_at(file, path, &mut len_field, 0, file_len)?;
        let header_len = u64::from_le_bytes(len_field);
        if header_len > MAX_HEADER_LEN {
            let problem = format!(
                "the header claims {header_len} bytes, more than the format's cap of \
                 {MAX_HEADER_LEN}"
            );
            return Err(Error::format(path, None, problem));
        }
        // Capped above, so neither the sum nor the conversion can fail on a 64-bit host; the
        // checks stay for the hosts where `usize` is narrower.
        let data_start = LEN_BYTES + header_len;
        let header_usize = usize::try_from(header_len)
            .map_err(|_| Error::format(path, None, "the header does not fit in memory"))?;
        if data_start > file_len {
            return Err(truncated(path, LEN_BYTES, header_len, file_len));
        }
        let mut json = vec![0u8; header_usize];
        read_at(file, path, &mut json, LEN_BYTES, file_len)?;
        Header::parse(path, &json, data_start, file_len)
    }

    /// Checks the JSON header `json` of the file at `path`, whose data section starts at
    /// `data_start` and which is `file_len` bytes long.
    ///
    /// # Errors
    ///
    /// [`Error::Format`] when the header breaks the format, naming the tensor at fault where one
    /// is; [`Error::Truncated`] when the data section it describes runs past `file_len`.
    pub(crate) fn parse(
        path: &Path,
        json: &[u8],
        data_start: u64,
        file_len: u64,
    ) -> Result<Header> {
        let text = std::str::from_utf8(json).map_err(|e| {
            let at = e.valid_up_to();
            Error::format(
                path,
                None,
                format!("the header is not UTF-8 (at its byte {at})"),
            )
        })?;
        let entries = deserialize_entries(path, text)?;
        if let Some(key) = first_duplicate(&entries) {
            let culprit = (key != METADATA_KEY).then_some(key);
            return Err(Error::format(
                path,
                culprit,
                format!("the key `{key}` appears twice"),
            ));
        }
        let mut metadata = None;
        let mut raw = Vec::with_capacity(entries.len());
        for (name, entry) in entries {
            match entry {
                Entry::Metadata(map) => {
                    metadata = map.map(|m| metadata_map(path, m)).transpose()?
                }
                Entry::Tensor(tensor) => raw.push(checked_tensor(path, name, tensor)?),
            }
        }
        raw.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
        let data_len = check_contiguous(path, &raw)?;
        let data_end = data_start.checked_add(data_len).ok_or_else(|| {
            Error::format(
                path,
                None,
                "the data section's end overflows a 64-bit offset",
            )
        })?;
        if data_end > file_len {
            return Err(truncated(path, data_start, data_len, file_len));
        }
        let tensors = raw.into_iter().map(|t| t.into_spec(data_start)).collect();
        Ok(Header {
            path: path.to_owned(),
            tensors,
            metadata,
            data_start,
            data_end,
            file_len,
        })
    }

    /// The file this header was read from.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors, ordered by offset.
    pub(crate) fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The free-form `__metadata__` map, where the file has one.
    pub(crate) fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.metadata.as_ref()
    }

    /// The absolute offset of the data section, just past the JSON header.
    #[cfg(test)]
    pub(crate) fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The absolute offset just past the last tensor's last byte.
    #[cfg(test)]
    pub(crate) fn data_end(&self) -> u64 {
        self.data_end
    }

    /// The file's length when its header was read; bytes past [`Header::data_end`] are ignored.
    #[cfg(test)]
    pub(crate) fn file_len(&self) -> u64 {
        self.file_len
    }
}

fn truncated(path: &Path, offset: u64, wanted: u64, length: u64) -> Error {
    Error::Truncated {
        path: path.to_owned(),
        offset,
        wanted,
        length,
    }
}

/// Fills `buf` from `offset`, reporting a file that ends early (or shrank since it was measured)
/// as truncated rather than as an I/O failure.
fn read_at(file: &File, path: &Path, buf: &mut [u8], offset: u64, file_len: u64) -> Result<()> {
    let wanted = buf.len() as u64;
    if offset.saturating_add(wanted) > file_len {
        return Err(truncated(path, offset, wanted, file_len));
    }
    file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => truncated(path, offset, wanted, file_len),
        _ => Error::io(path, "reading the checkpoint's header", e),
    })
}

/// A JSON object's entries in file order, duplicates kept so that they can be refused: serde's
/// maps keep the last of two equal keys without a word.
#[derive(Debug)]
pub(crate) struct Pairs<V>(pub(crate) Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Pairs<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PairsVisitor<V>(PhantomData<V>);

        impl<'de, V: Deserialize<'de>> Visitor<'de> for PairsVisitor<V> {
            type Value = Pairs<V>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Pairs<V>, A::Error> {
                let mut pairs = Vec::new();
                while let Some(pair) = map.next_entry()? {
                    pairs.push(pair);
                }
                Ok(Pairs(pairs))
            }
        }

        deserializer.deserialize_map(PairsVisitor(PhantomData))
    }
}

/// The first key that appears more than once, if any.
pub(crate) fn first_duplicate<V>(pairs: &[(String, V)]) -> Option<&str> {
    let mut seen = foldhash::HashSet::with_capacity_and_hasher(pairs.len(), Default::default());
    pairs
        .iter()
        .map(|(key, _)| key.as_str())
        .find(|key| !seen.insert(*key))
}

/// One tensor's entry as the JSON spells it; unknown fields are refused, as a misspelt field
/// would otherwise vanish.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

enum Entry {
    Metadata(Option<Pairs<String>>),
    Tensor(RawEntry),
}

/// Deserializes the top-level object entry by entry, remembering which key was being read when
/// an error struck so that the error can name the tensor.
struct TopVisitor<'a> {
    culprit: &'a mut Option<String>,
}

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = Vec<(String, Entry)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object mapping tensor names to their entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let entry = if key == METADATA_KEY {
                map.next_value().map(Entry::Metadata)
            } else {
                map.next_value().map(Entry::Tensor)
            };
            match entry {
                Ok(entry) => entries.push((key, entry)),
                Err(e) => {
                    *self.culprit = Some(key);
                    return Err(e);
                }
            }
        }
        Ok(entries)
    }
}

impl<'de> DeserializeSeed<'de> for TopVisitor<'_> {
    type Value = Vec<(String, Entry)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

fn deserialize_entries(path: &Path, text: &str) -> Result<Vec<(String, Entry)>> {
    let mut culprit = None;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let outcome = TopVisitor {
        culprit: &mut culprit,
    }
    .deserialize(&mut deserializer)
    .and_then(|entries| deserializer.end().map(|()| entries));
    outcome.map_err(|e| match culprit.as_deref() {
        Some(METADATA_KEY) => Error::format(path, None, format!("bad `{METADATA_KEY}`: {e}")),
        Some(name) => Error::format(path, Some(name), format!("bad entry: {e}")),
        None => Error::format(path, None, format!("the header is not a JSON object: {e}")),
    })
}

fn metadata_map(path: &Path, pairs: Pairs<String>) -> Result<HashMap<String, String>> {
    if let Some(key) = first_duplicate(&pairs.0) {
        let problem = format!("the key `{key}` appears twice in `{METADATA_KEY}`");
        return Err(Error::format(path, None, problem));
    }
    Ok(pairs.0.into_iter().collect())
}

/// A tensor whose byte length has been checked against its dtype and shape, with offsets still
/// relative to the data section.
struct Checked {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    begin: u64,
    end: u64,
}

impl Checked {
    fn into_spec(self, data_start: u64) -> TensorSpec {
        TensorSpec {
            // `Header::parse` checked that `data_start` plus the data section's length fits.
            offset: data_start + self.begin,
            bytes: self.end - self.begin,
            name: self.name,
            dtype: self.dtype,
            shape: self.shape,
        }
    }
}

/// The bytes that `shape` elements of `dtype` take, or why they cannot be stored.
pub(crate) fn byte_len(dtype: Dtype, shape: &[usize]) -> Result<u64, String> {
    let elements = shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
        .ok_or_else(|| format!("the shape {shape:?} has more elements than a 64-bit count"))?;
    let bits = elements
        .checked_mul(dtype.bitsize() as u64)
        .ok_or_else(|| format!("{elements} elements of {dtype:?} overflow a 64-bit bit count"))?;
    if bits % 8 != 0 {
        return Err(format!(
            "{elements} elements of {dtype:?} take {bits} bits, not a whole number of bytes"
        ));
    }
    Ok(bits / 8)
}

fn checked_tensor(path: &Path, name: String, raw: RawEntry) -> Result<Checked> {
    let [begin, end] = raw.data_offsets;
    let fail = |problem: String| Error::format(path, Some(&name), problem);
    if end < begin {
        return Err(fail(format!(
            "its data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    let bytes = byte_len(raw.dtype, &raw.shape).map_err(fail)?;
    if end - begin != bytes {
        let (dtype, shape) = (raw.dtype, &raw.shape);
        return Err(fail(format!(
            "its data_offsets [{begin}, {end}] span {} bytes, but {dtype:?} of shape {shape:?} \
             takes {bytes}",
            end - begin
        )));
    }
    Ok(Checked {
        name,
        dtype: raw.dtype,
        shape: raw.shape,
        begin,
        end,
    })
}

/// Checks that tensors sorted by offset tile the data section from 0 without holes or overlaps,
/// and returns its length.
fn check_contiguous(path: &Path, tensors: &[Checked]) -> Result<u64> {
    let mut end = 0;
    let mut previous: Option<&str> = None;
    for tensor in tensors {
        let name = Some(tensor.name.as_str());
        let begin = tensor.begin;
        let problem = match (begin.cmp(&end), previous) {
            (std::cmp::Ordering::Equal, _) => None,
            (std::cmp::Ordering::Less, Some(prev)) => Some(format!(
                "its bytes from {begin} overlap those of `{prev}`, which end at {end}"
            )),
            (std::cmp::Ordering::Greater, Some(prev)) => Some(format!(
                "its bytes begin at {begin}, leaving a hole after `{prev}`, which ends at {end}"
            )),
            (_, None) => Some(format!(
                "the first tensor's bytes begin at {begin}, leaving a hole at the start of the \
                 data section"
            )),
        };
        if let Some(problem) = problem {
            return Err(Error::format(path, name, problem));
        }
        end = tensor.end;
        previous = name;
    }
    Ok(end)
}
