//! How a stager cuts and spreads copies.

use std::ops::RangeInclusive;

/// How a [`Stager`](crate::Stager) cuts and spreads copies. The defaults come from measurements on an H100
/// over PCIe 5.0 (benches/RESULTS.md); override them for other machines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes of one chunk of the ring: the largest piece a thread copies at once.
    pub chunk_bytes: usize,
    /// Threads that copy, the calling thread included (`threads - 1` workers are started).
    pub threads: usize,
    /// Chunks in the ring (page-locked memory: `slots × chunk_bytes`).
    pub slots: usize,
    /// Copies up to this size run on the calling thread alone, in pieces of one chunk: waking
    /// workers costs more than it saves.
    pub single_thread_bytes: usize,
    /// The smallest piece a larger copy is cut into. Copies are cut into about two pieces
    /// per thread, smaller at both ends: the DMA engine starts early and drains a short tail.
    pub min_piece_bytes: usize,
    /// Uploads of these sizes (in bytes) from ordinary memory take the driver's own path:
    /// one copy call from the source (`cuMemcpyHtoDAsync`, or the runtime's
    /// `cudaMemcpyAsync` where the driver's entry points cannot be reached). On a device
    /// that cannot read pageable memory itself, the driver copies such a source into pinned
    /// staging buffers before the call returns: CUDA documents this for `cudaMemcpy`, and
    /// for the asynchronous calls up to version 11; since then its documentation says only
    /// that they "might be synchronous". So a stager checks it on its device before taking
    /// this path (once per device and process: uploads of 4 KiB and 4 MiB behind work that
    /// holds the stream back, their sources overwritten as the calls return; see
    /// [`Stager::driver_uploads_taken`](crate::Stager::driver_uploads_taken)), and the GPU tests check it for every default size.
    /// Sizes end at 4 MiB at most. Devices that read pageable memory directly (HMM, ATS) and
    /// sources that start in page-locked memory always go through the ring. The driver
    /// decides by the source's first byte, looked up by byte, not by page: registered memory
    /// sharing a page with the source, lying inside it or holding its end leaves it staged
    /// (checked by the GPU tests too). The call may wait for work queued earlier on the
    /// stream.
    ///
    /// Upload slots come first ([`upload_slot_bytes`](Self::upload_slot_bytes)): up to 16
    /// KiB this path takes the uploads for which no slot is free. The defaults are where the
    /// ring was not reliably faster on an H100 host: up to 16 KiB (a chunk's event calls
    /// cost more than they save) and from 128 KiB to 4 MiB (the driver overlaps its
    /// one-thread copy with the DMA, which one chunk cannot, and the ring's gain there hangs
    /// on how fast sleeping workers wake: 1.2–1.5× on some virtual machines, 0.65–0.9× on
    /// others). Around 64 KiB the driver's path is slow, and one chunk of the ring or an
    /// upload slot faster. Empty: every upload goes through the ring.
    pub driver_uploads: Vec<RangeInclusive<usize>>,
    /// Downloads of these sizes (in bytes) into ordinary memory take the driver's own path:
    /// one copy call into the destination (`cuMemcpyDtoHAsync`, or `cudaMemcpyAsync`). On a
    /// device that cannot read pageable memory itself, that call returns only once such a
    /// destination is filled, so the download needs no event and no wait of its own. CUDA
    /// documented this for `cudaMemcpyAsync` up to version 11 and version 13 behaves so, but
    /// its documentation now says only that the call "might be synchronous": as for uploads,
    /// a stager checks it on its device first (downloads of 4 KiB and 4 MiB behind held-back
    /// work, looked at as the calls return; see [`Stager::driver_downloads_taken`](crate::Stager::driver_downloads_taken)), and
    /// sizes end at 4 MiB at most. The driver decides by the destination's first byte
    /// (observed from 4 to 64 KiB, and checked by the GPU tests at 12 and 16 KiB with
    /// registered memory inside it, holding its end or sharing its pages); page-locked
    /// destinations and devices that read pageable memory go through the ring.
    ///
    /// The default is up to 16 KiB: there the driver's call alone ran 1.04–1.20× the
    /// driver's path as programs use it (`cudaMemcpyAsync`, then the stream waited for) on an
    /// H100 host, the ring's one chunk (a copy call, an event recorded and waited for, then a
    /// copy out) 0.97–1.19×; from 32 KiB the two ran alike. Empty: every download goes
    /// through the ring.
    pub driver_downloads: Vec<RangeInclusive<usize>>,
    /// Uploads of up to this many bytes (from any host memory) are copied by the calling
    /// thread into a slot of their own and go to the device from there, ended by one event:
    /// the one handed back, which also frees the slot. A slot is taken when its last upload
    /// was seen finished (its copy waited for or queried) or one query finds it finished;
    /// when no slot is, the upload takes the driver's path or the ring. A ring chunk needs an
    /// event of its own besides the one that ends the copy, and the driver's path a pointer
    /// lookup. On H100 hosts, timed against the driver's untracked call in three runs, uploads
    /// of 64 KiB through slots ran 1.17–1.25× where the ring ran 1.04–1.07×; at 4 and 16 KiB
    /// slots and the driver's path ran alike (0.96–1.03×). 0: no slots.
    pub upload_slot_bytes: usize,
    /// Slots for small uploads (page-locked memory: `upload_slots × upload_slot_bytes`, after
    /// the ring's): as many uploads may be in flight before the next takes another path.
    pub upload_slots: usize,
    /// Downloads copy pieces of 4 KiB and more out of the ring with non-temporal stores
    /// (past the CPU's caches) where the CPU has them (x86-64 with AVX2): the destination's
    /// cache lines are not read first, which saves memory bandwidth on large downloads, but
    /// the data is not in the caches afterwards either. Uploads of 32 KiB and more copy into
    /// their upload slot with them too: in a probe on an H100 host a 64 KiB upload through a
    /// slot so filled ran 1.29–1.32× the driver's path (`cudaMemcpyAsync`, then the stream
    /// waited for), 1.11–1.19× with plain stores (under 32 KiB streaming stores were slower:
    /// 0.64–0.88× at 4 to 16 KiB).
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
            slots: 2 * threads,
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
