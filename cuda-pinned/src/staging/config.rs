//! How a stager cuts and spreads copies.

use std::ops::RangeInclusive;

/// How a [`Stager`](crate::Stager) cuts and spreads copies.
///
/// The defaults were tuned on one kind of host over PCIe 5.0; `docs/tuning.md` tells how and
/// why.
/// Override them for other machines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes of one chunk of the ring: the largest piece a thread copies at once.
    pub chunk_bytes: usize,
    /// Threads that copy, the calling thread included (`threads - 1` workers are started).
    pub threads: usize,
    /// Chunks in the ring (page-locked memory: `chunks × chunk_bytes`).
    pub chunks: usize,
    /// Copies up to this size run on the calling thread alone, in pieces of one chunk.
    pub single_thread_bytes: usize,
    /// The smallest piece a larger copy is cut into (about two pieces per thread, smaller at
    /// both ends, so that the DMA engine starts early and drains a short tail).
    pub min_piece_bytes: usize,
    /// Uploads of these sizes (in bytes, at most 4 MiB) from ordinary memory take the
    /// driver's own path: one copy call from the source, which the driver stages before the
    /// call returns on devices that cannot read pageable memory (checked on each device before
    /// the path is taken). Empty: every upload goes through the ring.
    pub driver_uploads: Vec<RangeInclusive<usize>>,
    /// Downloads of these sizes (in bytes, at most 4 MiB) into ordinary memory take the
    /// driver's own path: one copy call that returns with the destination filled (checked as
    /// for uploads). Empty: every download goes through the ring.
    pub driver_downloads: Vec<RangeInclusive<usize>>,
    /// Uploads of up to this many bytes (from any host memory) are copied into a slot of
    /// their own and go to the device from there, ended by one event. 0: no slots.
    pub upload_slot_bytes: usize,
    /// Slots for small uploads (page-locked memory: `upload_slots × upload_slot_bytes`).
    pub upload_slots: usize,
    /// Whether downloads out of the ring, uploads into the ring of several pieces and up to
    /// 256 MiB, and uploads into a slot from 32 KiB use non-temporal stores where the CPU has
    /// them (x86-64 with AVX2).
    pub streaming_stores: bool,
}

impl StagingConfig {
    /// The most threads a stager starts: more are refused (each is a thread of its own, and
    /// a copy is cut into about two pieces for each).
    pub const MAX_THREADS: usize = 1024;
}

impl Default for StagingConfig {
    fn default() -> Self {
        let threads = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .min(12);
        Self {
            chunk_bytes: 4 << 20,
            threads,
            chunks: 2 * threads,
            single_thread_bytes: 256 << 10,
            min_piece_bytes: 512 << 10,
            driver_uploads: vec![0..=(16 << 10), (128 << 10)..=(4 << 20)],
            driver_downloads: vec![0..=(16 << 10)],
            upload_slot_bytes: 64 << 10,
            upload_slots: 8,
            streaming_stores: true,
        }
    }
}
