//! What a loader reports: what a profiler is asked when the GPU idles between batches, per
//! run and per epoch, and which part of the pipeline limits it.

use std::fmt;
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
    /// Batches uploaded to the device (device loaders): one per batch, however many fields it
    /// has (its indices included, where they are uploaded).
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

impl LoaderStats {
    /// What happened between `earlier` and this snapshot (the reservation's figures, which
    /// do not change, are kept).
    pub fn since(&self, earlier: &LoaderStats) -> LoaderStats {
        LoaderStats {
            batches: self.batches.saturating_sub(earlier.batches),
            samples: self.samples.saturating_sub(earlier.samples),
            consumer_wait: self.consumer_wait.saturating_sub(earlier.consumer_wait),
            fill_time: self.fill_time.saturating_sub(earlier.fill_time),
            filled_bytes: self.filled_bytes.saturating_sub(earlier.filled_bytes),
            late_slots: self.late_slots.saturating_sub(earlier.late_slots),
            uploads: self.uploads.saturating_sub(earlier.uploads),
            uploaded_bytes: self.uploaded_bytes.saturating_sub(earlier.uploaded_bytes),
            upload_time: self.upload_time.saturating_sub(earlier.upload_time),
            timed_bytes: self.timed_bytes.saturating_sub(earlier.timed_bytes),
            ..*self
        }
    }
}

/// One epoch's figures: from the call that began it to the end of its iterator.
///
/// Work that straddles two epochs counts in the one where it ends: a batch of the next epoch
/// filled ahead, an upload still running when the iterator ends. Over short epochs the shares
/// below are therefore rough; they are capped at 1.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct EpochStats {
    /// The epoch's number.
    pub epoch: u64,
    /// Wall time from the call that began it until its iterator was dropped.
    pub wall: Duration,
    /// Workers that filled its batches (0: the consumer's thread did).
    pub workers: usize,
    /// What the loader did meanwhile.
    pub totals: LoaderStats,
}

impl EpochStats {
    /// Batches delivered per second of wall time.
    pub fn batches_per_second(&self) -> f64 {
        let seconds = self.wall.as_secs_f64();
        if seconds > 0.0 {
            self.totals.batches as f64 / seconds
        } else {
            0.0
        }
    }

    /// The share of the wall time the consumer spent waiting for batches.
    pub fn consumer_wait_share(&self) -> f64 {
        ratio(
            self.totals.consumer_wait.as_secs_f64(),
            self.wall.as_secs_f64(),
        )
    }

    /// The share of the workers' time (or the consumer's, without workers) spent filling
    /// batches.
    pub fn workers_busy_share(&self) -> f64 {
        ratio(
            self.totals.fill_time.as_secs_f64(),
            self.workers.max(1) as f64 * self.wall.as_secs_f64(),
        )
    }

    /// Bytes per second the uploads moved while they ran on the device (0 without uploads,
    /// or before their timing is read).
    pub fn upload_bandwidth(&self) -> f64 {
        self.totals.upload_bandwidth()
    }

    /// The share of the wall time the copy engine spent uploading, estimated from the bytes
    /// uploaded and the bandwidth the timed uploads reached.
    pub fn upload_busy_share(&self) -> f64 {
        let bandwidth = self.upload_bandwidth();
        if bandwidth == 0.0 {
            return 0.0;
        }
        ratio(
            self.totals.uploaded_bytes as f64 / bandwidth,
            self.wall.as_secs_f64(),
        )
    }

    /// Which part of the pipeline limited the epoch, with the figures behind the call.
    pub fn verdict(&self) -> Verdict {
        let (limit, advice) = if self.consumer_wait_share() < CONSUMER_BOUND {
            (
                Limit::Consumer,
                "the batches were ready before the consumer asked: its own work sets the pace",
            )
        } else if self.upload_busy_share() >= BUSY {
            (
                Limit::Uploads,
                "the copy engine was busy uploading: smaller batches (fewer bytes per sample) \
                 or device-side decoding would help, not more workers",
            )
        } else if self.workers_busy_share() >= BUSY {
            (
                Limit::DataLoading,
                "the workers were busy filling batches: more workers or a cheaper `write` \
                 would help",
            )
        } else {
            (
                Limit::DataLoading,
                "the consumer waited while the workers were often idle: a deeper prefetch, or \
                 a dataset that answers sooner (storage latency), would help",
            )
        };
        Verdict {
            limit,
            advice,
            stats: *self,
        }
    }
}

/// Below this share of its time spent waiting, the consumer sets the pace.
const CONSUMER_BOUND: f64 = 0.1;
/// From this share of the time on, a stage counts as busy.
const BUSY: f64 = 0.75;

/// What limits a loader's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Limit {
    /// Filling batches: the workers, the dataset's `write`, or storage.
    DataLoading,
    /// Copying batches to the device.
    Uploads,
    /// The consumer's own work (the training step): the loader keeps up.
    Consumer,
}

/// Which part of the pipeline limited an epoch, and the figures behind the call
/// ([`EpochStats::verdict`]); its `Display` is one line for a log.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Verdict {
    /// What limited the epoch.
    pub limit: Limit,
    /// What would help, in words.
    pub advice: &'static str,
    /// The figures.
    pub stats: EpochStats,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        let limit = match self.limit {
            Limit::DataLoading => "data loading",
            Limit::Uploads => "uploads",
            Limit::Consumer => "the consumer",
        };
        write!(
            f,
            "epoch {}: {limit} limits it ({:.0} batches/s over {}; the consumer waited \
             {:.0}% of it; {} busy {:.0}%",
            s.epoch,
            s.batches_per_second(),
            Span(s.wall),
            100.0 * s.consumer_wait_share(),
            match s.workers {
                0 => "the consumer's filling".to_owned(),
                1 => "1 worker".to_owned(),
                n => format!("{n} workers"),
            },
            100.0 * s.workers_busy_share(),
        )?;
        if s.totals.uploaded_bytes > 0 {
            write!(
                f,
                "; uploads busy {:.0}% at {:.1} GB/s",
                100.0 * s.upload_busy_share(),
                s.upload_bandwidth() / 1e9
            )?;
        }
        write!(f, "): {}", self.advice)
    }
}

/// A duration for people: milliseconds under a second (a short epoch is not "0.00 s"),
/// seconds from there on.
struct Span(Duration);

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seconds = self.0.as_secs_f64();
        match seconds {
            s if s >= 1.0 => write!(f, "{s:.2} s"),
            s if s >= 0.01 => write!(f, "{:.0} ms", s * 1e3),
            s => write!(f, "{:.2} ms", s * 1e3),
        }
    }
}

/// `a / b` within 0 to 1; 0 when `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        (a / b).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// Nanoseconds as a `Duration`.
pub(crate) fn nanos(counter: &AtomicU64) -> Duration {
    Duration::from_nanos(counter.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(
        wall_ms: u64,
        wait_ms: u64,
        fill_ms: u64,
        workers: usize,
        uploads: Option<(u64, u64)>,
    ) -> EpochStats {
        let (uploaded_bytes, upload_ms) = uploads.unwrap_or((0, 0));
        EpochStats {
            epoch: 3,
            wall: Duration::from_millis(wall_ms),
            workers,
            totals: LoaderStats {
                batches: 100,
                consumer_wait: Duration::from_millis(wait_ms),
                fill_time: Duration::from_millis(fill_ms),
                uploads: u64::from(uploaded_bytes > 0) * 100,
                uploaded_bytes,
                timed_bytes: uploaded_bytes,
                upload_time: Duration::from_millis(upload_ms),
                ..LoaderStats::default()
            },
        }
    }

    #[test]
    fn the_verdict_names_the_stage_that_sets_the_pace() {
        // The consumer hardly waited: its own work sets the pace, busy workers or not.
        assert_eq!(
            epoch(1000, 50, 7900, 8, None).verdict().limit,
            Limit::Consumer
        );
        // It waited, and the workers were busy.
        let busy = epoch(1000, 600, 7600, 8, None);
        assert_eq!(busy.verdict().limit, Limit::DataLoading);
        assert!(busy.verdict().advice.contains("more workers"));
        // It waited, the workers were mostly idle: latency, not throughput.
        let idle = epoch(1000, 600, 2000, 8, None);
        assert_eq!(idle.verdict().limit, Limit::DataLoading);
        assert!(idle.verdict().advice.contains("prefetch"));
        // It waited, and the copy engine was busy 90% of the time.
        let link = epoch(1000, 500, 3000, 8, Some((45_000_000_000, 900)));
        assert!((link.upload_busy_share() - 0.9).abs() < 1e-9);
        assert_eq!(link.verdict().limit, Limit::Uploads);
        // No workers: the consumer's own filling counts.
        assert!((epoch(1000, 600, 900, 0, None).workers_busy_share() - 0.9).abs() < 1e-9);
        // Fills and uploads that straddle epochs cannot make a share pass 1.
        let straddling = epoch(10, 9, 500, 8, Some((1_000_000_000, 50)));
        assert_eq!(
            (
                straddling.workers_busy_share(),
                straddling.upload_busy_share()
            ),
            (1.0, 1.0)
        );
    }

    #[test]
    fn a_short_epoch_says_its_milliseconds() {
        let texts: Vec<String> = [Duration::from_micros(3_400), Duration::from_millis(640)]
            .into_iter()
            .map(|d| Span(d).to_string())
            .collect();
        assert_eq!(texts, ["3.40 ms", "640 ms"]);
        let line = epoch(4, 1, 3, 2, None).verdict().to_string();
        assert!(line.contains("over 4.00 ms"), "{line}");
    }

    #[test]
    fn shares_of_an_empty_epoch_are_zero_and_the_line_says_it_all() {
        let empty = epoch(0, 0, 0, 4, None);
        assert_eq!(empty.batches_per_second(), 0.0);
        assert_eq!(empty.consumer_wait_share(), 0.0);
        assert_eq!(empty.upload_busy_share(), 0.0);
        let line = epoch(2000, 1200, 15_000, 8, Some((10_000_000_000, 250)))
            .verdict()
            .to_string();
        for part in [
            "epoch 3",
            "over 2.00 s",
            "data loading",
            "50 batches/s",
            "waited 60%",
            "8 workers busy 94%",
            "at 40.0 GB/s",
        ] {
            assert!(line.contains(part), "{part:?} missing from {line:?}");
        }
    }

    #[test]
    fn since_subtracts_counters_and_keeps_the_reservation() {
        let earlier = LoaderStats {
            batches: 5,
            reserved_bytes: 7,
            fill_time: Duration::from_secs(1),
            ..LoaderStats::default()
        };
        let later = LoaderStats {
            batches: 9,
            reserved_bytes: 7,
            fill_time: Duration::from_secs(3),
            ..LoaderStats::default()
        };
        let delta = later.since(&earlier);
        assert_eq!(
            (delta.batches, delta.reserved_bytes, delta.fill_time),
            (4, 7, Duration::from_secs(2))
        );
        assert_eq!(earlier.since(&later).batches, 0);
    }
}
