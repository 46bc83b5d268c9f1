//! A load's figures, measured as it runs, and a verdict of what limited it.

use std::fmt;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use cuda_pinned::ring::Cuda;
use cuda_pinned::{Device, Event, Stream};

use crate::engine::Job;
use crate::error::Result;
use crate::file::DataFile;

/// What a load took and moved ([`Loaded::report`](super::Loaded::report)); its `Display` is
/// one line for a log, ending with the verdict.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LoadReport {
    /// Tensors loaded onto the reader's device.
    pub tensors: usize,
    /// Their bytes.
    pub bytes: u64,
    /// From the call to `load` until the first tensor had landed on the device.
    pub first_tensor: Duration,
    /// From the call to `load` until every tensor had landed on the reader's device.
    pub last_tensor: Duration,
    /// Bytes of the checkpoint's files read through the page cache during the load.
    pub cached_bytes: u64,
    /// Bytes read past the page cache (`O_DIRECT`), from storage.
    pub direct_bytes: u64,
    /// The pinned memory the reader holds (its ring), whatever the checkpoint's size.
    pub pinned_bytes: usize,
    /// Allocating the device memory (while the reader's threads read the first tensor).
    pub allocation: Duration,
    /// The reader's threads' time reading files, all threads together.
    pub reading: Duration,
    /// The threads' time waiting for a chunk's copies to the device to finish before
    /// filling it again, all threads together.
    pub waiting_for_copies: Duration,
    /// The reader's threads.
    pub threads: usize,
}

/// What limited a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadLimit {
    /// Reads past the page cache: the storage's speed.
    Storage,
    /// The threads' copies out of the page cache into the ring.
    PageCacheCopy,
    /// The copies to the device: the threads waited for the ring more than they read.
    Link,
    /// Allocating the device memory took a large share of the load.
    DeviceAllocation,
}

impl LoadReport {
    /// Gigabytes (10⁹ bytes) per second over the whole load.
    pub fn gb_per_s(&self) -> f64 {
        let seconds = self.last_tensor.as_secs_f64();
        if seconds > 0.0 {
            self.bytes as f64 / seconds / 1e9
        } else {
            0.0
        }
    }

    /// What limited the load, judged from the shares of its time: the allocation's, the
    /// threads' reading and their waiting for the device's copies.
    pub fn limit(&self) -> LoadLimit {
        let wall = self.last_tensor.as_secs_f64();
        let threads_wall = wall * self.threads.max(1) as f64;
        let share = |d: Duration, of: f64| {
            if of > 0.0 { d.as_secs_f64() / of } else { 0.0 }
        };
        if share(self.allocation, wall) >= 0.25 {
            LoadLimit::DeviceAllocation
        } else if share(self.waiting_for_copies, threads_wall) > share(self.reading, threads_wall) {
            LoadLimit::Link
        } else if self.direct_bytes > self.cached_bytes {
            LoadLimit::Storage
        } else {
            LoadLimit::PageCacheCopy
        }
    }

    /// The limit, what would help, and the figures behind the call, in one line.
    pub fn verdict(&self) -> String {
        let (limit, advice) = match self.limit() {
            LoadLimit::Storage => (
                "storage",
                "the data came from storage past the page cache: faster or more drives, or a \
                 checkpoint already in the page cache",
            ),
            LoadLimit::PageCacheCopy => (
                "the page-cache copy",
                "the threads copying out of the page cache: more reader threads, if cores are \
                 free (`ReaderConfig::threads`)",
            ),
            LoadLimit::Link => (
                "the link",
                "the copies to the device: the threads waited for them more than they read",
            ),
            LoadLimit::DeviceAllocation => (
                "device allocation",
                "allocating the device memory: a warm allocator, or memory allocated ahead \
                 (`Checkpoint::load_into`)",
            ),
        };
        format!("{limit} limited it ({advice})")
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "{} tensors, {:.2} GB in {:.1} ms ({:.1} GB/s); first tensor after {:.2} ms; {:.2} GB \
             through the page cache, {:.2} GB past it; {} MiB pinned; allocation {:.2} ms; {}",
            self.tensors,
            self.bytes as f64 / 1e9,
            ms(self.last_tensor),
            self.gb_per_s(),
            ms(self.first_tensor),
            self.cached_bytes as f64 / 1e9,
            self.direct_bytes as f64 / 1e9,
            self.pinned_bytes >> 20,
            ms(self.allocation),
            self.verdict(),
        )
    }
}

/// What a load measures as it runs: device timestamps at its start, its first landing and
/// its last copy, the allocation's time, and the files' byte counts before it.
pub(super) struct Meter {
    device: Device,
    start: Event,
    first: OnceLock<Event>,
    end: OnceLock<Event>,
    allocation: Mutex<Duration>,
    files: Vec<DataFile>,
    read_before: Vec<(u64, u64)>,
    tensors: usize,
    bytes: u64,
    pinned_bytes: usize,
    threads: usize,
}

impl Meter {
    /// Starts measuring a load of `tensors` tensors of `bytes` bytes on `stream`.
    pub(super) fn start(
        stream: &Stream,
        files: &[DataFile],
        (tensors, bytes): (usize, u64),
        (pinned_bytes, threads): (usize, usize),
    ) -> Result<Self> {
        let device = stream.device();
        let mut start = Event::on(device)?;
        start.record(stream)?;
        Ok(Self {
            device,
            start,
            first: OnceLock::new(),
            end: OnceLock::new(),
            allocation: Mutex::new(Duration::ZERO),
            files: files.to_vec(),
            read_before: files.iter().map(DataFile::bytes_read).collect(),
            tensors,
            bytes,
            pinned_bytes,
            threads,
        })
    }

    pub(super) fn allocated_in(&self, took: Duration) {
        *self
            .allocation
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = took;
    }

    /// Marks the first landing on `stream` (the first call counts): a timed event behind the
    /// first tensors' copies.
    pub(super) fn landed(&self, stream: &Stream) -> Result<()> {
        if self.first.get().is_none() {
            let mut first = Event::on(self.device)?;
            first.record(stream)?;
            if self.first.set(first).is_ok() {
                tracing::debug!(
                    tensors = self.tensors,
                    "first tensor ready (its copies queued)"
                );
            }
        }
        Ok(())
    }

    /// Marks the end of the load's copies on `stream` (every copy queued).
    pub(super) fn ended(&self, stream: &Stream) -> Result<()> {
        let mut end = Event::on(self.device)?;
        end.record(stream)?;
        let _ = self.end.set(end);
        Ok(())
    }

    /// The figures of a load that has completed: waits for its copies.
    pub(super) fn report(&self, job: &Job<Cuda>, stream: &Stream) -> Result<LoadReport> {
        stream.synchronize()?;
        // Figures, not the load's outcome: a timing that cannot be read counts none.
        let since_start = |event: Option<&Event>| {
            event
                .and_then(|event| event.elapsed_ms_since(&self.start).ok())
                .map_or(Duration::ZERO, |ms| {
                    Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)
                })
        };
        let last_tensor = since_start(self.end.get());
        let (cached_bytes, direct_bytes) = self.files.iter().zip(&self.read_before).fold(
            (0, 0),
            |(cached, direct), (file, &(cached_before, direct_before))| {
                let (c, d) = file.bytes_read();
                (
                    cached + c.saturating_sub(cached_before),
                    direct + d.saturating_sub(direct_before),
                )
            },
        );
        let timing = job.timing();
        Ok(LoadReport {
            tensors: self.tensors,
            bytes: self.bytes,
            first_tensor: since_start(self.first.get()).min(last_tensor),
            last_tensor,
            cached_bytes,
            direct_bytes,
            pinned_bytes: self.pinned_bytes,
            allocation: *self
                .allocation
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
            reading: timing.reading(),
            waiting_for_copies: timing.waiting_for_copies(),
            threads: self.threads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(allocation_ms: u64, reading_ms: u64, waiting_ms: u64, direct: u64) -> LoadReport {
        LoadReport {
            tensors: 10,
            bytes: 4_000_000_000,
            first_tensor: Duration::from_millis(3),
            last_tensor: Duration::from_millis(100),
            cached_bytes: 4_000_000_000 - direct,
            direct_bytes: direct,
            pinned_bytes: 64 << 20,
            allocation: Duration::from_millis(allocation_ms),
            reading: Duration::from_millis(reading_ms),
            waiting_for_copies: Duration::from_millis(waiting_ms),
            threads: 8,
        }
    }

    #[test]
    fn the_verdict_follows_the_shares_of_the_time() {
        assert_eq!(report(40, 200, 100, 0).limit(), LoadLimit::DeviceAllocation);
        assert_eq!(report(1, 200, 500, 0).limit(), LoadLimit::Link);
        assert_eq!(report(1, 700, 50, 0).limit(), LoadLimit::PageCacheCopy);
        assert_eq!(
            report(1, 700, 50, 3_000_000_000).limit(),
            LoadLimit::Storage
        );
        let line = report(1, 200, 500, 0).to_string();
        for part in [
            "10 tensors, 4.00 GB in 100.0 ms (40.0 GB/s)",
            "first tensor after 3.00 ms",
            "4.00 GB through the page cache, 0.00 GB past it",
            "64 MiB pinned",
            "the link limited it",
        ] {
            assert!(line.contains(part), "{part:?} missing from {line:?}");
        }
    }

    #[test]
    fn an_empty_load_has_no_rate_and_no_division_by_zero() {
        let mut empty = report(0, 0, 0, 0);
        empty.last_tensor = Duration::ZERO;
        empty.bytes = 0;
        assert_eq!(empty.gb_per_s(), 0.0);
        assert_eq!(empty.limit(), LoadLimit::PageCacheCopy);
    }
}
