//! The reader's engine: threads that read pieces of files into the chunks of a pinned ring
//! (cuda-pinned's [`ring`](cuda_pinned::ring)) while the DMA engine drains them.
//!
//! A thread takes the next piece, takes a free chunk (its previous copies finished: the
//! chunk's event), reads the piece into it, queues the piece's copies out of it and records
//! the chunk's event behind them. A target (a tensor, a whole read) is complete once every
//! piece holding its bytes has queued its copies: the thread that queues the last one calls
//! the job's sink, which records the target's own event on the stream, after all of them.
//!
//! A piece read through the page cache is read in parts by whichever threads are free
//! ([`parts`]). A job's first target goes to the device first: pieces after it wait in their
//! chunks until its pieces are queued ([`lead`]), so that a load's first tensor, which its
//! caller may be waiting for, lands as early as it can. A job may also start before its
//! destination exists (a load's device memory, whose allocation can take milliseconds): its
//! threads then read the lead's pieces only, which wait in their chunks until the thread
//! that names the destination queues them ([`arrival`]).
//!
//! | file | stage |
//! |---|---|
//! | `way_in.rs` | the way in, [`Engine`] (cuda-pinned's crew over a [`ReadRing`]): [`Engine::run`] a read, or [`Engine::start`] one and follow it ([`Reading`]) |
//! | `job.rs` | [`Job`]: the pieces, the files, what to take next, the targets' counts |
//! | `worker.rs` | a thread's turn: piece → chunk → read → copies queued (or parked) → targets |
//! | `read.rs` | reading a piece, or a run of neighbours past the page cache |
//! | `parts.rs` | pieces open for parts, and who closes them |
//! | `lead.rs` | the first target first: parked pieces, handed back when the lead is queued |
//! | `arrival.rs` | the destination ([`Destination`], [`Bases`], the sink), named late or at once |
//! | `outcome.rs` | the first error, the pieces counted, the waiters woken |
//! | `ring.rs` | [`ReadRing`]: chunks with room for aligned reads, and the memory they lie in |

mod arrival;
mod job;
mod lead;
mod outcome;
mod parts;
mod read;
mod ring;
#[cfg(test)]
mod tests;
pub(crate) mod way_in;
mod worker;

pub(crate) use arrival::{Bases, Destination, Sink};
pub(crate) use job::{Done, Job};
pub(crate) use ring::ReadRing;
pub(crate) use way_in::{Engine, Reading};
