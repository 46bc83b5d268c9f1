//! A read cut into pieces: each piece one read of a file into one chunk of the ring, then the
//! copies out of the chunk to where its bytes belong.
//!
//! Small neighbours in a file share a piece (one read, and one copy where they follow each other
//! in one allocation: see the worker's `coalesced`) and large spans
//! are cut where the file's offsets cross multiples of the piece size, so that every piece
//! past a span's first starts on a block boundary that a read past the page cache can use.

use crate::error::{Error, Result};

/// Bytes of the file a piece may read through between two spans that share it, rather than
/// start a piece of its own.
const GAP: u64 = 64 << 10;

/// Where one target's bytes come from and go: `rows` rows of `width` bytes at `offset` of
/// file `file`, `pitch` apart, copied densely (row after row) to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) width: u64,
    pub(crate) rows: u64,
    pub(crate) pitch: u64,
    pub(crate) dst: u64,
    /// The target (a tensor, or a whole read) the bytes complete.
    pub(crate) target: usize,
}

/// A copy out of a filled chunk: `rows` rows of `width` bytes from `from` (bytes into the
/// piece), `pitch` apart, to `dst` densely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChunkCopy {
    pub(crate) from: usize,
    pub(crate) pitch: usize,
    pub(crate) width: usize,
    pub(crate) rows: usize,
    pub(crate) dst: u64,
    pub(crate) target: usize,
}

/// One read of `len` bytes at `offset` of file `file`, and the copies out of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) copies: Vec<ChunkCopy>,
}

impl Piece {
    pub(crate) fn end(&self) -> u64 {
        self.offset + self.len as u64
    }
}

/// Cuts `spans` into pieces of at most `capacity` bytes (a multiple of the read alignment).
///
/// # Errors
///
/// [`Error::Invalid`] for a span whose bytes overflow the address space.
pub(crate) fn cut(spans: &[Span], capacity: usize) -> Result<Vec<Piece>> {
    cut_by(spans, capacity, |_| 0)
}

/// Cuts `spans` as [`cut`] does, the spans of a lower `rank` first (in the files' order
/// among those of one rank).
///
/// # Errors
///
/// As [`cut`].
pub(crate) fn cut_by(
    spans: &[Span],
    capacity: usize,
    rank: impl Fn(&Span) -> u64,
) -> Result<Vec<Piece>> {
    let cap = capacity as u64;
    let mut order: Vec<&Span> = spans.iter().filter(|s| s.width > 0 && s.rows > 0).collect();
    order.sort_by_key(|s| (rank(s), s.file, s.offset));
    let mut pieces = Vec::new();
    let mut open: Option<Piece> = None;
    for span in order {
        let overflow = || Error::Invalid("a read's byte counts overflow".into());
        let last_row = (span.rows - 1)
            .checked_mul(span.pitch)
            .ok_or_else(overflow)?;
        let extent = last_row.checked_add(span.width).ok_or_else(overflow)?;
        span.offset.checked_add(extent).ok_or_else(overflow)?;
        span.dst
            .checked_add(span.rows.checked_mul(span.width).ok_or_else(overflow)?)
            .ok_or_else(overflow)?;
        // A small span joins the open piece when it follows it closely and fits.
        if let Some(piece) = open.as_mut()
            && piece.file == span.file
            && span.offset >= piece.end()
            && span.offset - piece.end() <= GAP
            && span.offset + extent - piece.offset <= cap
        {
            piece.copies.push(ChunkCopy {
                from: (span.offset - piece.offset) as usize,
                pitch: span.pitch as usize,
                width: span.width as usize,
                rows: span.rows as usize,
                dst: span.dst,
                target: span.target,
            });
            piece.len = (span.offset + extent - piece.offset) as usize;
            continue;
        }
        pieces.extend(open.take());
        if span.width <= cap {
            // Whole rows per piece, as many as fit.
            let per_piece = (cap - span.width) / span.pitch.max(1) + 1;
            let mut row = 0;
            while row < span.rows {
                let rows = per_piece.min(span.rows - row);
                let offset = span.offset + row * span.pitch;
                let piece = Piece {
                    file: span.file,
                    offset,
                    len: ((rows - 1) * span.pitch + span.width) as usize,
                    copies: vec![ChunkCopy {
                        from: 0,
                        pitch: span.pitch as usize,
                        width: span.width as usize,
                        rows: rows as usize,
                        dst: span.dst + row * span.width,
                        target: span.target,
                    }],
                };
                pieces.extend(open.replace(piece));
                row += rows;
            }
        } else {
            // Rows longer than a piece: each cut where the file's offsets cross multiples
            // of the capacity.
            for row in 0..span.rows {
                let start = span.offset + row * span.pitch;
                let end = start + span.width;
                let mut at = start;
                while at < end {
                    let stop = ((at / cap + 1) * cap).min(end);
                    let piece = Piece {
                        file: span.file,
                        offset: at,
                        len: (stop - at) as usize,
                        copies: vec![ChunkCopy {
                            from: 0,
                            pitch: (stop - at) as usize,
                            width: (stop - at) as usize,
                            rows: 1,
                            dst: span.dst + row * span.width + (at - start),
                            target: span.target,
                        }],
                    };
                    pieces.extend(open.replace(piece));
                    at = stop;
                }
            }
        }
    }
    pieces.extend(open);
    Ok(pieces)
}

/// How many pieces each of `targets` targets waits for.
pub(crate) fn pieces_per_target(pieces: &[Piece], targets: usize) -> Vec<usize> {
    let mut counts = vec![0; targets];
    for piece in pieces {
        let mut seen: Vec<usize> = piece.copies.iter().map(|c| c.target).collect();
        seen.sort_unstable();
        seen.dedup();
        for target in seen {
            counts[target] += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Applies the pieces to a file's bytes, as the engine would: every destination byte
    /// written exactly once, with the byte the span says.
    fn apply(pieces: &[Piece], file: &[u8], dst: &mut [Option<u8>], cap: usize) {
        for piece in pieces {
            assert!(piece.len <= cap, "piece of {} bytes past {cap}", piece.len);
            let read = &file[piece.offset as usize..piece.end() as usize];
            for copy in &piece.copies {
                for row in 0..copy.rows {
                    let from = copy.from + row * copy.pitch;
                    for (i, &byte) in read[from..from + copy.width].iter().enumerate() {
                        let at = copy.dst as usize + row * copy.width + i;
                        assert!(dst[at].is_none(), "byte {at} written twice");
                        dst[at] = Some(byte);
                    }
                }
            }
        }
    }

    fn spans() -> impl Strategy<Value = (Vec<Span>, usize)> {
        (1usize..5).prop_flat_map(|blocks| {
            let cap = blocks * 4096;
            let span = (0u64..40_000, 1u64..9_000, 1u64..5, 0u64..3000).prop_map(
                |(offset, width, rows, extra)| Span {
                    file: 0,
                    offset,
                    width,
                    rows,
                    pitch: width + extra,
                    dst: 0,
                    target: 0,
                },
            );
            (prop::collection::vec(span, 0..12), Just(cap))
        })
    }

    proptest! {
        #[test]
        fn every_byte_lands_once_where_its_span_says((mut spans, cap) in spans()) {
            let mut dst = 0;
            for (i, span) in spans.iter_mut().enumerate() {
                span.dst = dst;
                span.target = i;
                dst += span.width * span.rows;
            }
            let file: Vec<u8> = (0..120_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let pieces = cut(&spans, cap).unwrap();
            let mut out = vec![None; dst as usize];
            apply(&pieces, &file, &mut out, cap);
            for span in &spans {
                for row in 0..span.rows {
                    for i in 0..span.width {
                        let at = (span.dst + row * span.width + i) as usize;
                        let from = (span.offset + row * span.pitch + i) as usize;
                        prop_assert_eq!(out[at], Some(file[from]));
                    }
                }
            }
            let counts = pieces_per_target(&pieces, spans.len());
            for (span, count) in spans.iter().zip(counts) {
                prop_assert!(count >= 1, "span {:?} has no piece", span);
            }
        }
    }

    #[test]
    fn small_neighbours_share_a_piece_and_large_spans_cut_on_multiples() {
        let span = |offset, width, target| Span {
            file: 0,
            offset,
            width,
            rows: 1,
            pitch: width,
            dst: offset,
            target,
        };
        let pieces = cut(
            &[span(10, 100, 0), span(110, 50, 1), span(300, 10_000, 2)],
            8192,
        )
        .unwrap();
        assert_eq!(pieces[0].copies.len(), 2, "{pieces:?}");
        let starts: Vec<u64> = pieces.iter().map(|p| p.offset).collect();
        assert_eq!(starts, [10, 300, 8192]);
        assert_eq!(pieces_per_target(&pieces, 3), [1, 1, 2]);
    }
}
