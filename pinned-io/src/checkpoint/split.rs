//! Tensor-parallel slices: the bytes of one rank's part of a tensor, as strided rows of a file.
//!
//! A part along dimension `dim` of a C-ordered tensor is, in the file, `product(shape[..dim])`
//! rows of equal width spaced a fixed pitch apart; along dimension 0 it is one contiguous run.
//! Parts are cut as `torch.tensor_split(t, world, dim)` cuts them, which is how vLLM shards a
//! column- or row-parallel weight.

use std::path::Path;

use super::header::TensorSpec;
use crate::error::{Error, Result};

#[cfg(test)]
mod tests;

/// One rank's share of a tensor split into `world` parts along dimension `dim`.
///
/// The first `size % world` ranks get one element more along `dim` than the rest, as
/// `torch.tensor_split` deals them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Split {
    dim: usize,
    rank: usize,
    world: usize,
}

impl Split {
    /// The part of rank `rank` out of `world` along dimension `dim`.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when `world` is 0 or `rank` is not below `world`. Whether `dim` fits a
    /// tensor is checked when the split is applied to one.
    pub fn new(dim: usize, rank: usize, world: usize) -> Result<Split> {
        if world == 0 {
            return Err(Error::Invalid(
                "a split needs a world of at least 1 rank".into(),
            ));
        }
        if rank >= world {
            return Err(Error::Invalid(format!(
                "rank {rank} is out of a world of {world} ranks (0..{world})"
            )));
        }
        Ok(Split { dim, rank, world })
    }

    /// The dimension split, 0 being the outermost.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The rank whose part this is.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of parts.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The first index along the split dimension and the number of indices that fall to this
    /// rank, of a dimension of `size`.
    pub(crate) fn part(&self, size: usize) -> (usize, usize) {
        let (base, extra) = (size / self.world, size % self.world);
        let len = base + usize::from(self.rank < extra);
        // rank < world, so rank × base ≤ size and the sum stays within `size`.
        let start = self.rank * base + self.rank.min(extra);
        (start, len)
    }
}

/// Where a tensor, or one rank's part of it, lies in its file: `rows` runs of `width` bytes, the
/// first at `offset` and each `pitch` bytes after the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Extent {
    /// The file offset of the first byte.
    pub(crate) offset: u64,
    /// The contiguous bytes of each row.
    pub(crate) width: u64,
    /// The number of rows.
    pub(crate) rows: u64,
    /// The file bytes between the starts of consecutive rows; equal to `width` for one row.
    pub(crate) pitch: u64,
}

impl Extent {
    /// The bytes the extent holds, all rows together.
    pub(crate) fn bytes(&self) -> u64 {
        // `extent` checked this product when it made the extent.
        self.width * self.rows
    }
}

/// Where `spec`'s bytes lie in the file at `path`, or those of `split`'s part of it, with the
/// shape of the result.
///
/// A part whose rows are contiguous in the file (a split along dimension 0, a tensor whose outer
/// dimensions are all 1, a world of one) comes back as a single row.
///
/// # Errors
///
/// [`Error::Invalid`], naming the tensor and the file, when `split.dim()` is not a dimension of
/// the tensor, when the part of a sub-byte dtype does not start or end on a byte, or when an
/// offset overflows.
pub(crate) fn extent(
    spec: &TensorSpec,
    split: Option<&Split>,
    path: &Path,
) -> Result<(Extent, Vec<usize>)> {
    let shape = spec.shape();
    let Some(split) = split else {
        let whole = Extent {
            offset: spec.offset(),
            width: spec.bytes(),
            rows: 1,
            pitch: spec.bytes(),
        };
        return Ok((whole, shape.to_vec()));
    };
    let fail = |problem: String| {
        Error::Invalid(format!(
            "{}: tensor `{}`: {problem}",
            path.display(),
            spec.name()
        ))
    };
    let dim = split.dim();
    let Some(&size) = shape.get(dim) else {
        return Err(fail(format!(
            "cannot split along dimension {dim} a tensor of shape {shape:?} ({} dimensions)",
            shape.len()
        )));
    };
    let (start, len) = split.part(size);
    let overflow = || fail("its part's offsets overflow 64 bits".to_owned());
    let product = |dims: &[usize]| dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
    let rows = product(&shape[..dim]).ok_or_else(overflow)?;
    let inner = product(&shape[dim + 1..]).ok_or_else(overflow)?;
    let bits = spec.dtype().bitsize() as u64;
    // The bytes of `count` slices of the split dimension, each `inner` elements.
    let to_bytes = |count: u64, what: &str| -> Result<u64> {
        let n_bits = count
            .checked_mul(inner)
            .and_then(|n| n.checked_mul(bits))
            .ok_or_else(overflow)?;
        if n_bits % 8 != 0 {
            return Err(fail(format!(
                "rank {} of {} along dimension {dim}: the part's {what} falls inside a byte of \
                 {:?}",
                split.rank(),
                split.world(),
                spec.dtype()
            )));
        }
        Ok(n_bits / 8)
    };
    let offset = spec
        .offset()
        .checked_add(to_bytes(start as u64, "start")?)
        .ok_or_else(overflow)?;
    let mut part_shape = shape.to_vec();
    part_shape[dim] = len;
    let extent = if rows == 1 || len == size || inner == 0 {
        // One row, rows that abut because they span the whole dimension, or nothing at all:
        // a single run.
        let count = rows.checked_mul(len as u64).ok_or_else(overflow)?;
        let total = to_bytes(count, "end")?;
        Extent {
            offset,
            width: total,
            rows: 1,
            pitch: total,
        }
    } else {
        let width = to_bytes(len as u64, "width")?;
        let pitch = to_bytes(size as u64, "row pitch")?;
        // Rows × pitch bounds rows × width and is the tensor's own length, which fits.
        rows.checked_mul(pitch).ok_or_else(overflow)?;
        Extent {
            offset,
            width,
            rows,
            pitch,
        }
    };
    Ok((extent, part_shape))
}
