//! [`FileReader`]: byte ranges of files onto a device, or into host memory, read by a crew
//! of threads.

use std::sync::{Arc, Mutex, PoisonError};

use bytemuck::AnyBitPattern;
use cuda_pinned::{DefaultPinned, Device, DeviceSliceMut, PinnedAllocator, PinnedVec, Stream};

use cuda_pinned::ring::Cuda;

use crate::engine::{Done, Engine, Job, ReadRing, Reading};
use crate::error::{Error, Result};
use crate::file::{DIRECT_ALIGN, DataFile, ReadMode};
use crate::plan::{self, Span};

/// How a [`FileReader`] cuts and reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReaderConfig {
    /// The most bytes of one piece: a piece of a read fills one chunk of the pinned ring and
    /// goes to the device in one copy (per destination). A multiple of 4096.
    pub chunk_bytes: usize,
    /// The most bytes of a chunk that one thread takes on at once through the page cache:
    /// several threads fill a chunk from the page cache together, in parts of this size.
    /// Reads past the page cache fill a whole chunk, or several, in one call.
    pub read_bytes: usize,
    /// Chunks in the ring: the pinned memory the reader holds is `chunks` times
    /// `chunk_bytes` and two pages (room for reads past the page cache, which read whole
    /// aligned blocks).
    pub chunks: usize,
    /// Threads of the reader's crew, which live as long as the reader (a caller of
    /// [`FileReader::read_to_device`] reads beside them).
    pub threads: usize,
    /// Through the page cache, past it, or as the kernel says per piece.
    pub mode: ReadMode,
}

impl ReaderConfig {
    /// The most threads a reader may have.
    pub const MAX_THREADS: usize = 256;

    /// The defaults: as many threads as the machine has cores, up to sixteen; as many 4 MiB
    /// chunks, filled from the page cache in parts of 2 MiB; the mode the kernel picks per
    /// piece.
    ///
    /// The DMA engine pays for every copy it starts, so copies are large; several threads
    /// fill a chunk from the page cache at once, so that it is soon full and on its way. The
    /// `files` section of `pinned-bench` measures the choice against others (RESULTS.md of
    /// the benches).
    pub fn new() -> Self {
        let threads = std::thread::available_parallelism()
            .map_or(4, usize::from)
            .min(16);
        Self {
            chunk_bytes: 4 << 20,
            read_bytes: 2 << 20,
            chunks: threads,
            threads,
            mode: ReadMode::Auto,
        }
    }

    /// With `bytes` per chunk.
    pub fn chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes;
        self
    }

    /// With parts of at most `bytes` read through the page cache by one thread.
    pub fn read_bytes(mut self, bytes: usize) -> Self {
        self.read_bytes = bytes;
        self
    }

    /// With `count` chunks.
    pub fn chunks(mut self, count: usize) -> Self {
        self.chunks = count;
        self
    }

    /// With `count` threads.
    pub fn threads(mut self, count: usize) -> Self {
        self.threads = count;
        self
    }

    /// With reads as `mode` says.
    pub fn mode(mut self, mode: ReadMode) -> Self {
        self.mode = mode;
        self
    }

    fn check(&self) -> Result<()> {
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(DIRECT_ALIGN) {
            return Err(Error::Invalid(format!(
                "a reader's chunks must be a positive multiple of {DIRECT_ALIGN} bytes (asked: \
                 {})",
                self.chunk_bytes
            )));
        }
        if self.read_bytes == 0 {
            return Err(Error::Invalid(
                "a reader's reads through the page cache need at least one byte".into(),
            ));
        }
        if self.chunks == 0 || self.threads == 0 || self.threads > Self::MAX_THREADS {
            return Err(Error::Invalid(format!(
                "a reader needs at least one chunk and 1 to {} threads (asked: {} chunks, {} \
                 threads)",
                Self::MAX_THREADS,
                self.chunks,
                self.threads
            )));
        }
        Ok(())
    }
}

impl Default for ReaderConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads byte ranges of files onto one device, or into host memory, with a crew of threads.
///
/// Its threads, started with it, read pieces of a file into the chunks of a pinned ring while
/// the DMA engine copies the filled chunks to the device: reads and copies overlap, and the
/// pinned memory held is the ring's, whatever the size of a read. Share one reader between
/// threads; make one per device.
///
/// # Examples
///
/// ```no_run
/// use cuda_pinned::{DeviceBuffer, Stream};
/// use pinned_io::{DataFile, FileReader};
///
/// let reader = FileReader::new()?;
/// let stream = Stream::new()?;
/// let file = DataFile::open("weights.bin")?;
/// let mut on_device = DeviceBuffer::<u8>::zeroed(file.len() as usize)?;
/// reader.read_to_device(&stream, &file, 0, &mut on_device)?;
/// // Work queued on `stream` from here on sees the file's bytes.
/// stream.synchronize()?;
/// # Ok::<(), pinned_io::Error>(())
/// ```
pub struct FileReader {
    crew: Arc<Engine<Cuda>>,
    device: Device,
    config: ReaderConfig,
}

impl FileReader {
    /// A reader for the calling thread's current device, with the default configuration and
    /// [`DefaultPinned`] memory.
    ///
    /// # Errors
    ///
    /// As [`with_config_in`](Self::with_config_in).
    pub fn new() -> Result<Self> {
        Self::with_config_in(Device::current()?, ReaderConfig::new(), DefaultPinned)
    }

    /// A reader for `device`, with the default configuration and [`DefaultPinned`] memory.
    ///
    /// # Errors
    ///
    /// As [`with_config_in`](Self::with_config_in).
    pub fn on(device: Device) -> Result<Self> {
        Self::with_config_in(device, ReaderConfig::new(), DefaultPinned)
    }

    /// A reader for `device` configured as `config` says, its ring allocated from
    /// `allocator` (a pool, for instance) now.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a configuration out of range; the allocator's error for the
    /// ring; a CUDA error making the chunks' events.
    pub fn with_config_in<A>(device: Device, config: ReaderConfig, allocator: A) -> Result<Self>
    where
        A: PinnedAllocator + Send + Sync + 'static,
    {
        config.check()?;
        let bytes = ReadRing::<Cuda>::bytes_for(config.chunk_bytes, config.chunks)
            .ok_or_else(|| Error::Invalid("a reader's ring overflows the address space".into()))?;
        let mut memory = PinnedVec::<u8, A>::with_capacity_in(bytes, allocator)?;
        let start = memory.as_mut_ptr();
        // SAFETY: `start` is the first byte of `bytes_for` bytes of page-locked memory, which
        // the ring keeps and uses alone.
        let ring = unsafe {
            ReadRing::new(
                Cuda::on(device),
                start,
                config.chunk_bytes,
                config.chunks,
                Box::new(memory),
            )
        }?
        .read_in_parts_of(config.read_bytes);
        Ok(Self {
            crew: Arc::new(Engine::new(ring, config.threads)?),
            device,
            config,
        })
    }

    /// The device it copies to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The configuration in use.
    pub fn config(&self) -> &ReaderConfig {
        &self.config
    }

    /// The most bytes of one piece of a read (a chunk of the ring).
    pub(crate) fn piece_bytes(&self) -> usize {
        self.crew.ring().capacity()
    }

    /// The pinned memory the reader's ring holds.
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.crew.ring().pinned_bytes()
    }

    /// Starts reading `pieces` of `files` toward `targets` targets on `stream`, before their
    /// destination exists: the crew reads the first target's pieces while the caller
    /// allocates, and the caller names the destination (or abandons the read) through the
    /// [`Reading`], which it waits on; `done` runs once every piece is moved or skipped.
    pub(crate) fn start(
        &self,
        pieces: Vec<plan::Piece>,
        files: Vec<DataFile>,
        stream: &Stream,
        targets: usize,
        done: Box<Done<Cuda>>,
    ) -> Reading<Cuda> {
        let job = Job::to_come(pieces, files, self.config.mode, stream.clone(), targets);
        self.crew.start(job.when_done(done))
    }

    /// Reads the bytes of `file` from `offset` into `dst` on `stream`, and returns once
    /// every byte has been read and its copy queued.
    ///
    /// Work queued on `stream` afterwards sees the bytes; the reader's pinned chunks are
    /// reused only once their copies are done.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a range past the file's end (as opened) or a stream of another
    /// device; [`Error::Truncated`] for a file that shrank; [`Error::Io`]; a CUDA error.
    /// After an error, part of `dst` may have been written, and no copy of the call still
    /// runs.
    pub fn read_to_device<'d, T: AnyBitPattern + 'd>(
        &self,
        stream: &Stream,
        file: &DataFile,
        offset: u64,
        dst: impl Into<DeviceSliceMut<'d, T>>,
    ) -> Result<()> {
        let mut dst = dst.into();
        let len = (dst.len() * size_of::<T>()) as u64;
        self.check(stream, file, offset, len)?;
        if dst.device() != self.device() {
            return Err(Error::Invalid(format!(
                "a reader for device {} was given memory of device {}",
                self.device().ordinal(),
                dst.device().ordinal()
            )));
        }
        let crew = &self.crew;
        let mode = self.config.mode;
        dst.track_writes(stream, |address| {
            let span = Span {
                file: 0,
                offset,
                width: len,
                rows: 1,
                pitch: len,
                dst: address,
                target: 0,
            };
            let pieces = plan::cut(&[span], self.piece_bytes())?;
            let sink = Box::new(|_: &[usize], _: &Stream| Ok(()));
            let job = Job::new(pieces, vec![file.clone()], mode, stream.clone(), 1, sink);
            crew.run(&Arc::new(job))
        })
    }

    /// Reads the bytes of `file` from `offset` into `dst` (pinned memory the caller owns, or
    /// any memory) through the page cache, on as many threads as the reader's crew has
    /// (started for the call; the crew's own threads are bound to its ring).
    ///
    /// # Errors
    ///
    /// As [`read_to_device`](Self::read_to_device), without the CUDA errors. After an error,
    /// part of `dst` may have been written.
    pub fn read_to_host(&self, file: &DataFile, offset: u64, dst: &mut [u8]) -> Result<()> {
        file.check_range(offset, dst.len() as u64)?;
        let dst_len = dst.len();
        let piece = self.config.read_bytes;
        let parts = Mutex::new(dst.chunks_mut(piece).enumerate());
        let work = || -> Result<()> {
            loop {
                let next = parts.lock().unwrap_or_else(PoisonError::into_inner).next();
                let Some((i, part)) = next else {
                    return Ok(());
                };
                let at = offset + (i * piece) as u64;
                // SAFETY: `part` is a part of `dst` of its own, writable and this thread's
                // alone; no scratch is claimed around it.
                unsafe {
                    file.read_at(part.as_mut_ptr(), part.len(), at, ReadMode::Buffered, false)
                }?;
            }
        };
        let helpers = self
            .config
            .threads
            .min(dst_len.div_ceil(piece))
            .saturating_sub(1);
        std::thread::scope(|scope| {
            let helpers: Vec<_> = (0..helpers)
                .filter_map(|_| std::thread::Builder::new().spawn_scoped(scope, work).ok())
                .collect();
            let mut result = work();
            for helper in helpers {
                let theirs = helper
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                result = result.and(theirs);
            }
            result
        })
    }

    fn check(&self, stream: &Stream, file: &DataFile, offset: u64, len: u64) -> Result<()> {
        file.check_range(offset, len)?;
        if stream.device() != self.device() {
            return Err(Error::Invalid(format!(
                "a reader for device {} was given a stream of device {}",
                self.device().ordinal(),
                stream.device().ordinal()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_out_of_range_is_refused_with_what_was_asked() {
        assert!(ReaderConfig::new().check().is_ok());
        let refused = |config: ReaderConfig| config.check().unwrap_err().to_string();
        assert!(refused(ReaderConfig::new().chunk_bytes(5000)).contains("5000"));
        assert!(refused(ReaderConfig::new().chunk_bytes(0)).contains("multiple of"));
        assert!(refused(ReaderConfig::new().read_bytes(0)).contains("at least one byte"));
        assert!(refused(ReaderConfig::new().chunks(0)).contains("0 chunks"));
        assert!(refused(ReaderConfig::new().threads(300)).contains("300 threads"));
        // Reads larger than a chunk read each piece whole.
        assert!(ReaderConfig::new().read_bytes(64 << 20).check().is_ok());
    }
}
