//! Reads of pieces into their chunks: one piece through the page cache or past it, or a run
//! of neighbours past it in one call.

use crate::error::Result;
use crate::file::{DIRECT_ALIGN, DataFile, ReadMode};
use crate::plan::Piece;

/// Pieces read past the page cache in one call, at most (each into a chunk of its own), and
/// the most bytes such a call asks for when it takes more than one piece.
pub(super) const DIRECT_RUN: usize = 4;
pub(super) const DIRECT_RUN_BYTES: usize = 8 << 20;

/// Whether `next` can be read in the same call as `piece`, past the page cache: it starts
/// where `piece` ends, in the same file, on a block boundary.
pub(super) fn follows(piece: &Piece, next: &Piece) -> bool {
    next.file == piece.file
        && next.offset == piece.end()
        && next.offset.is_multiple_of(DIRECT_ALIGN as u64)
}

/// Reads `pieces` into the chunk memory at `starts`: one piece past the page cache if
/// `direct`, else through it; several past it in one call (what that leaves unread, through
/// the cache).
///
/// # Safety
///
/// As [`DataFile::read_at`] with scratch, for each piece at its start; the pieces follow
/// one another in the file on block boundaries.
pub(super) unsafe fn read_pieces(
    file: &DataFile,
    starts: &[*mut u8],
    pieces: &[Piece],
    direct: bool,
) -> Result<()> {
    if let [piece] = pieces {
        let mode = if direct {
            ReadMode::Direct
        } else {
            ReadMode::Buffered
        };
        // SAFETY: forwarded from the caller.
        return unsafe { file.read_at(starts[0], piece.len, piece.offset, mode, true) };
    }
    let parts: Vec<(*mut u8, usize)> = starts
        .iter()
        .zip(pieces)
        .map(|(&start, piece)| (start, piece.len))
        .collect();
    // SAFETY: forwarded from the caller.
    let filled = unsafe { file.read_direct_parts(&parts, pieces[0].offset) }?;
    for ((&start, piece), filled) in starts.iter().zip(pieces).zip(filled) {
        if filled < piece.len {
            // SAFETY: the rest of the piece's memory, writable and ours (the contract).
            unsafe {
                file.read_through_cache(
                    start.wrapping_add(filled),
                    piece.len - filled,
                    piece.offset + filled as u64,
                )
            }?;
        }
    }
    Ok(())
}
