//! A sharded checkpoint's index, `model.safetensors.index.json`: which file holds each tensor.
//!
//! The index is `{"metadata": {...}, "weight_map": {"tensor.name": "model-00001-of-00002.safetensors",
//! ...}}`. Shard names are untrusted: each must be a plain relative path that stays inside the
//! index's directory.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::header::{Header, Pairs, first_duplicate};
use crate::error::{Error, Result};

#[cfg(test)]
mod tests;

/// The largest index file read: far above any real model's, small enough to hold in memory.
pub(crate) const MAX_INDEX_LEN: u64 = 64 << 20;

/// The shard files of a sharded checkpoint and the shard that holds each tensor.
#[derive(Clone, Debug)]
pub(crate) struct ShardIndex {
    #[cfg_attr(not(test), allow(dead_code, reason = "the tests check it"))]
    path: PathBuf,
    shards: Vec<PathBuf>,
    weight_map: HashMap<String, usize>,
}

/// The index as the JSON spells it; fields other than these two are ignored, as writers add
/// their own.
#[derive(Deserialize)]
struct RawIndex {
    weight_map: Pairs<String>,
}

impl ShardIndex {
    /// Reads and checks the index at `path`.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the file cannot be opened or read; [`Error::Format`] when it is larger
    /// than [`MAX_INDEX_LEN`] or breaks the format (see [`ShardIndex::parse`]).
    pub(crate) fn read(path: &Path) -> Result<ShardIndex> {
        let file = cuda_pinned::open_regular_file(path)
            .map_err(|e| Error::io(path, "opening the index", e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(path, "inspecting the index", e))?
            .len();
        if len > MAX_INDEX_LEN {
            return Err(too_large(path, len));
        }
        let mut json = Vec::with_capacity(len as usize);
        // One byte past the cap tells a file that grew past it since it was measured.
        file.take(MAX_INDEX_LEN + 1)
            .read_to_end(&mut json)
            .map_err(|e| Error::io(path, "reading the index", e))?;
        ShardIndex::parse(path, &json)
    }

    /// Checks the index `json`, read from `path`; shard names are joined to `path`'s directory.
    ///
    /// # Errors
    ///
    /// [`Error::Format`] when `json` is over [`MAX_INDEX_LEN`], is not a JSON object with a
    /// `weight_map` of strings, lists a tensor twice, has an empty `weight_map`, or names a shard
    /// by a path that is absolute, climbs out with `..`, or is otherwise not plain.
    pub(crate) fn parse(path: &Path, json: &[u8]) -> Result<ShardIndex> {
        if json.len() as u64 > MAX_INDEX_LEN {
            return Err(too_large(path, json.len() as u64));
        }
        let raw: RawIndex = serde_json::from_slice(json)
            .map_err(|e| Error::format(path, None, format!("not a checkpoint index: {e}")))?;
        let pairs = raw.weight_map.0;
        if let Some(name) = first_duplicate(&pairs) {
            let problem = "the weight_map lists the tensor twice";
            return Err(Error::format(path, Some(name), problem));
        }
        if pairs.is_empty() {
            return Err(Error::format(path, None, "the weight_map lists no tensor"));
        }
        for (tensor, shard) in &pairs {
            check_shard_name(shard).map_err(|why| {
                let problem = format!("the shard name `{shard}` {why}");
                Error::format(path, Some(tensor), problem)
            })?;
        }
        let mut names: Vec<&str> = pairs.iter().map(|(_, shard)| shard.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let number: HashMap<&str, usize> = names.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let weight_map = pairs
            .iter()
            .map(|(tensor, shard)| (tensor.clone(), number[shard.as_str()]))
            .collect();
        let dir = path.parent().unwrap_or(Path::new(""));
        Ok(ShardIndex {
            path: path.to_owned(),
            shards: names.iter().map(|name| dir.join(name)).collect(),
            weight_map,
        })
    }

    /// The index file.
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The shard files, each once, sorted by name and joined to the index's directory.
    pub(crate) fn shards(&self) -> &[PathBuf] {
        &self.shards
    }

    /// Each tensor's shard, as a position in [`ShardIndex::shards`].
    #[cfg(test)]
    pub(crate) fn weight_map(&self) -> &HashMap<String, usize> {
        &self.weight_map
    }

    /// The position in [`ShardIndex::shards`] of the shard that holds `tensor`, if the index
    /// lists it.
    pub(crate) fn shard_of(&self, tensor: &str) -> Option<usize> {
        self.weight_map.get(tensor).copied()
    }

    /// Checks that `header`, read from shard `shard`, holds every tensor the index assigns to
    /// that shard, and none the index assigns to another.
    ///
    /// A tensor the index does not list at all is allowed: the index names what a model needs,
    /// and a shard may carry more.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when `shard` is not a position in [`ShardIndex::shards`];
    /// [`Error::Format`], naming the tensor and the shard, when the header and the index disagree.
    pub(crate) fn check_against(&self, shard: usize, header: &Header) -> Result<()> {
        if shard >= self.shards.len() {
            return Err(Error::Invalid(format!(
                "{}: shard {shard} is out of the index's {} shards",
                self.path.display(),
                self.shards.len()
            )));
        }
        let file = header.path();
        for spec in header.tensors() {
            match self.shard_of(spec.name()) {
                Some(other) if other != shard => {
                    let problem = format!(
                        "{} assigns it to {}, not to this file",
                        self.path.display(),
                        self.shards[other].display()
                    );
                    return Err(Error::format(file, Some(spec.name()), problem));
                }
                _ => {}
            }
        }
        let held: HashSet<&str> = header.tensors().iter().map(|spec| spec.name()).collect();
        let mut missing: Vec<&str> = self
            .weight_map
            .iter()
            .filter(|&(name, &s)| s == shard && !held.contains(name.as_str()))
            .map(|(name, _)| name.as_str())
            .collect();
        // The smallest name, so that the same files always report the same tensor.
        missing.sort_unstable();
        match missing.first() {
            None => Ok(()),
            Some(name) => {
                let problem = format!(
                    "{} assigns it to this file, but its header does not list it",
                    self.path.display()
                );
                Err(Error::format(file, Some(name), problem))
            }
        }
    }
}

fn too_large(path: &Path, len: u64) -> Error {
    let problem = format!("the index is {len} bytes, more than the cap of {MAX_INDEX_LEN}");
    Error::format(path, None, problem)
}

/// Why a shard name is not a plain relative path inside the index's directory, if it is not.
fn check_shard_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("is empty");
    }
    if name.starts_with('/') || Path::new(name).is_absolute() {
        return Err("is absolute");
    }
    if name.contains('\0') {
        return Err("contains a NUL byte");
    }
    if name.contains('\\') {
        return Err("contains a backslash, which is a separator on Windows");
    }
    for component in name.split('/') {
        match component {
            ".." => return Err("climbs out of the index's directory with `..`"),
            "." => return Err("has a `.` component"),
            "" => return Err("has an empty component (a doubled or trailing `/`)"),
            _ => {}
        }
    }
    Ok(())
}
