//! What a loader reports: what a profiler is asked when the GPU idles between batches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A loader's counters, updated as it goes.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) batches: AtomicU64,
    pub(crate) samples: AtomicU64,
    pub(crate) wait_ns: AtomicU64,
    pub(crate) fill_ns: AtomicU64,
    pub(crate) filled_bytes: AtomicU64,
    pub(crate) reserved_bytes: AtomicU64,
    pub(crate) reserved_slots: AtomicU64,
    pub(crate) late_slots: AtomicU64,
    pub(crate) construction_ns: AtomicU64,
    pub(crate) uploads: AtomicU64,
    pub(crate) uploaded_bytes: AtomicU64,
    pub(crate) upload_ns: AtomicU64,
    /// Bytes of the uploads `upload_ns` timed.
    pub(crate) timed_bytes: AtomicU64,
}

impl Counters {
    pub(crate) fn read(&self) -> LoaderStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LoaderStats {
            batches: get(&self.batches),
            samples: get(&self.samples),
            consumer_wait: nanos(&self.wait_ns),
            fill_time: nanos(&self.fill_ns),
            filled_bytes: get(&self.filled_bytes),
            reserved_bytes: get(&self.reserved_bytes),
            reserved_slots: get(&self.reserved_slots),
            late_slots: get(&self.late_slots),
            construction_time: nanos(&self.construction_ns),
            uploads: get(&self.uploads),
            uploaded_bytes: get(&self.uploaded_bytes),
            upload_time: nanos(&self.upload_ns),
            timed_bytes: get(&self.timed_bytes),
        }
    }
}

/// A snapshot of a loader's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: u64,
    /// Samples in them.
    pub samples: u64,
    /// Time the consumer spent waiting for a batch (the GPU's idle time, if it had nothing
    /// else queued).
    pub consumer_wait: Duration,
    /// Time the workers spent filling batches, all workers added up (batches begun for a
    /// next epoch that was not asked for included).
    pub fill_time: Duration,
    /// Bytes written into batches (likewise).
    pub filled_bytes: u64,
    /// Pinned bytes reserved before the first batch.
    pub reserved_bytes: u64,
    /// Slots (a full batch each) reserved before the first batch.
    pub reserved_slots: u64,
    /// Slots pinned later, because the consumer kept batches and none was free.
    pub late_slots: u64,
    /// Time `new` took, the reservation included.
    pub construction_time: Duration,
    /// Batches uploaded to the device (device loaders).
    pub uploads: u64,
    /// Bytes uploaded.
    pub uploaded_bytes: u64,
    /// Device time of the uploads whose timing has been read so far (measured with events,
    /// read when their device memory is reused).
    pub upload_time: Duration,
    /// Bytes of those uploads.
    pub timed_bytes: u64,
}

impl LoaderStats {
    /// Bytes per second the uploads moved on the device while they ran.
    pub fn upload_bandwidth(&self) -> f64 {
        let seconds = self.upload_time.as_secs_f64();
        if seconds == 0.0 {
            0.0
        } else {
            self.timed_bytes as f64 / seconds
        }
    }
}

/// Nanoseconds as a `Duration`.
pub(crate) fn nanos(counter: &AtomicU64) -> Duration {
    Duration::from_nanos(counter.load(Ordering::Relaxed))
}
