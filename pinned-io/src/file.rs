//! A file to read from: a buffered descriptor, and one that bypasses the page cache
//! (`O_DIRECT`) where the file system allows it.
//!
//! A piece of a read asks the kernel first whether the page cache holds it
//! ([`PageCacheProbe`](cuda_pinned::PageCacheProbe)) and reads it through the cache if so,
//! else past the cache in whole aligned blocks: data in the cache comes at memory speed, data
//! on storage at the device's speed without the copy through the cache.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cuda_pinned::PageCacheProbe;

use crate::error::{Error, Result};

/// The alignment of reads past the page cache: offsets, lengths and memory addresses. A page
/// covers the logical block size of every common block device.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// How pieces of a file are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadMode {
    /// Through the page cache where it holds the data, past it where it does not, asked of
    /// the kernel per piece. Data read past the cache does not enter it: a second read of a
    /// file that was not cached goes to storage again.
    #[default]
    Auto,
    /// Always through the page cache (the data stays cached for the next reader).
    Buffered,
    /// Past the page cache wherever the file system allows it (cached data is read again from
    /// storage).
    Direct,
}

/// A file opened for reading into pinned memory.
///
/// Opened once and shared by the threads that read it (clones share the descriptors); knows
/// its length at opening, and reports a file that shrinks while being read.
#[derive(Clone, Debug)]
pub struct DataFile(Arc<Opened>);

#[derive(Debug)]
struct Opened {
    path: PathBuf,
    buffered: File,
    /// Opened with `O_DIRECT`; `None` where the file system refuses it (tmpfs).
    direct: Option<File>,
    /// Cleared when the file system refuses a direct read after all.
    direct_works: AtomicBool,
    /// Where the page cache's residency of the file is asked; `None` where it cannot be.
    residency: Option<PageCacheProbe>,
    len: u64,
    cached_bytes: AtomicU64,
    direct_bytes: AtomicU64,
    /// Calls that read past the page cache.
    direct_reads: AtomicU64,
}

/// The file opened again past the page cache (`O_DIRECT`), where its file system allows it.
///
/// Through the descriptor's own name under `/proc/self/fd`, not the path: that is the file
/// already opened and checked, even if the path now names another.
fn reopen_direct(file: &File) -> Option<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

impl DataFile {
    /// Opens `path` for reading.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] where the file cannot be opened or inspected, or is not a regular file (a
    /// directory, named pipe, socket or device is refused before it is opened, and a named
    /// pipe never blocks the call).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let buffered =
            cuda_pinned::open_regular_file(path).map_err(|e| Error::io(path, "opening", e))?;
        let metadata = buffered
            .metadata()
            .map_err(|e| Error::io(path, "inspecting", e))?;
        // Miri runs neither reads past the page cache nor file mappings: under it, files are
        // read through the cache and taken as cached, so that the tests can check the rest.
        let direct = (!cfg!(miri)).then(|| reopen_direct(&buffered)).flatten();
        let residency = (!cfg!(miri))
            .then(|| PageCacheProbe::of(&buffered))
            .flatten();
        Ok(Self(Arc::new(Opened {
            path: path.to_owned(),
            residency,
            direct_works: AtomicBool::new(direct.is_some()),
            direct,
            buffered,
            len: metadata.len(),
            cached_bytes: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            direct_reads: AtomicU64::new(0),
        })))
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// The file's length when it was opened.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    /// Whether the file was empty when it was opened.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Whether reads past the page cache are possible (the file system takes `O_DIRECT`).
    pub fn can_read_direct(&self) -> bool {
        self.0.direct_works.load(Ordering::Relaxed)
    }

    /// Bytes read so far through the page cache and past it: `(cached, direct)`.
    pub fn bytes_read(&self) -> (u64, u64) {
        (
            self.0.cached_bytes.load(Ordering::Relaxed),
            self.0.direct_bytes.load(Ordering::Relaxed),
        )
    }

    /// The buffered descriptor, for reads of a few bytes (headers).
    pub(crate) fn std_file(&self) -> &File {
        &self.0.buffered
    }

    /// Checks that `offset..offset + len` lies in the file as opened.
    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len => Ok(()),
            _ => Err(Error::Invalid(format!(
                "{}: bytes {offset}..{} lie past the file's end at {}",
                self.0.path.display(),
                offset.saturating_add(len),
                self.0.len
            ))),
        }
    }

    /// Fills the `len` bytes at `buf` with the file's bytes at `offset`, as `mode` says.
    ///
    /// A read past the page cache needs `scratch`: the bytes just before and after the
    /// destination up to the alignment (`offset % DIRECT_ALIGN` before, up to `DIRECT_ALIGN`
    /// after), which it may overwrite; without it the read goes through the cache.
    ///
    /// # Safety
    ///
    /// - `buf` is writable for `len` bytes and nobody else's until this returns;
    /// - where `scratch` is true, so are the `offset % DIRECT_ALIGN` bytes before `buf` and
    ///   the `DIRECT_ALIGN` bytes after its end (reached from the same pointer), and `buf`'s
    ///   address is congruent to `offset` modulo `DIRECT_ALIGN`.
    pub(crate) unsafe fn read_at(
        &self,
        buf: *mut u8,
        len: usize,
        offset: u64,
        mode: ReadMode,
        scratch: bool,
    ) -> Result<()> {
        let direct = scratch && self.reads_direct(mode, offset, len);
        let mut done = 0;
        if direct {
            // SAFETY: forwarded from the caller.
            done = unsafe { self.read_direct(buf, len, offset) }?;
        }
        if done < len {
            // SAFETY: the rest of `buf`, writable and ours (the contract).
            let rest =
                unsafe { std::slice::from_raw_parts_mut(buf.wrapping_add(done), len - done) };
            self.read_cached(rest, offset + done as u64)?;
        }
        Ok(())
    }

    /// Whether the page cache holds every page of `offset..offset + len` (as far as the
    /// kernel says; `true` where it cannot be asked, so that such reads stay cached).
    fn cached(&self, offset: u64, len: usize) -> bool {
        self.0
            .residency
            .as_ref()
            .is_none_or(|residency| residency.holds(offset, len))
    }

    /// Reads all of `buf` through the page cache from `offset`.
    ///
    /// Straight in, with the kernel's own stores: checkpoints loaded faster this way than
    /// through [`read_at_streaming`](cuda_pinned::read_at_streaming)'s streaming stores
    /// (docs/tuning.md), likely because the chunk's copy, queued right after, finds it still
    /// in the CPU's caches.
    fn read_cached(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            match self.0.buffered.read_at(&mut buf[done..], at) {
                Ok(0) => return Err(self.truncated(at, buf.len() - done)),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&self.0.path, "reading", e)),
            }
        }
        self.0
            .cached_bytes
            .fetch_add(done as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Reads past the page cache the aligned blocks that cover the `len` bytes at `buf`
    /// (whose address is congruent to `offset`), overwriting the scratch around them; returns
    /// the bytes filled from `buf` on (short at the file's end, or 0 where the file system
    /// refuses).
    ///
    /// # Safety
    ///
    /// As [`read_at`](Self::read_at) with `scratch`.
    unsafe fn read_direct(&self, buf: *mut u8, len: usize, offset: u64) -> Result<usize> {
        let Some(direct) = &self.0.direct else {
            return Ok(0);
        };
        let skew = (offset % DIRECT_ALIGN as u64) as usize;
        let blocks = (skew + len).next_multiple_of(DIRECT_ALIGN);
        // SAFETY: the caller gives the `skew` bytes before `buf` and up to `DIRECT_ALIGN`
        // after its end as scratch, writable and its alone, reached from `buf`; `blocks`
        // ends within them.
        let block = unsafe { std::slice::from_raw_parts_mut(buf.wrapping_sub(skew), blocks) };
        let mut done = 0;
        while done < blocks {
            match direct.read_at(&mut block[done..], offset - skew as u64 + done as u64) {
                Ok(0) => break,
                // A read ending short of a block ends at the file's end.
                Ok(n) if n % DIRECT_ALIGN != 0 => {
                    done += n;
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && done == 0 => {
                    // The file system takes the flag but not these reads: cached from now on.
                    self.0.direct_works.store(false, Ordering::Relaxed);
                    return Ok(0);
                }
                Err(e) => return Err(Error::io(&self.0.path, "reading past the page cache", e)),
            }
        }
        let filled = done.saturating_sub(skew).min(len);
        self.0
            .direct_bytes
            .fetch_add(filled as u64, Ordering::Relaxed);
        self.0.direct_reads.fetch_add(1, Ordering::Relaxed);
        Ok(filled)
    }

    /// Whether `len` bytes at `offset` are read past the page cache, as `mode` says: the one
    /// place that decides (the `Auto` mode asks the page cache, a system call).
    pub(crate) fn reads_direct(&self, mode: ReadMode, offset: u64, len: usize) -> bool {
        self.can_read_direct()
            && match mode {
                ReadMode::Buffered => false,
                ReadMode::Direct => true,
                ReadMode::Auto => !self.cached(offset, len),
            }
    }

    /// Reads the bytes of `parts` past the page cache in one call: each part a buffer and
    /// its length, the first part's bytes at `offset`, each next part's following the last's
    /// in the file. Whole aligned blocks are read into the scratch around each part (as
    /// [`read_at`](Self::read_at)'s); returns the bytes of each part filled, short from where
    /// the file ends or the file system refused (0 everywhere where it takes no direct
    /// reads). The caller reads what is missing through the page cache.
    ///
    /// One large read keeps more of the storage busy than several small ones: a crew reading
    /// a cold file this way asks as much of the disk at once as one reading in larger chunks.
    ///
    /// # Safety
    ///
    /// Every part is as `buf` of [`read_at`](Self::read_at) with `scratch`; every part but
    /// the first starts on a block boundary of the file, and every part but the last ends on
    /// one.
    pub(crate) unsafe fn read_direct_parts(
        &self,
        parts: &[(*mut u8, usize)],
        offset: u64,
    ) -> Result<Vec<usize>> {
        let mut filled = vec![0; parts.len()];
        let Some(direct) = self.0.direct.as_ref().filter(|_| self.can_read_direct()) else {
            return Ok(filled);
        };
        let skew = (offset % DIRECT_ALIGN as u64) as usize;
        // Each part's aligned blocks, and where its bytes start in them.
        let mut vectors: Vec<libc::iovec> = Vec::with_capacity(parts.len());
        let mut starts = Vec::with_capacity(parts.len());
        let mut at = 0;
        for (i, &(buf, len)) in parts.iter().enumerate() {
            let before = if i == 0 { skew } else { 0 };
            let blocks = (before + len).next_multiple_of(DIRECT_ALIGN);
            vectors.push(libc::iovec {
                iov_base: buf.wrapping_sub(before).cast(),
                iov_len: blocks,
            });
            starts.push(at + before);
            at += blocks;
        }
        let total = at;
        let first_block = offset - skew as u64;
        let mut done = 0;
        let mut next = 0;
        while done < total {
            let Ok(at) = libc::off_t::try_from(first_block + done as u64) else {
                break;
            };
            // SAFETY: the vectors from `next` on cover the blocks not read yet, each in the
            // scratch-extended part the caller lends (writable and its alone); the descriptor
            // is open while `self` lives.
            let read = unsafe {
                libc::preadv(
                    direct.as_raw_fd(),
                    vectors[next..].as_ptr(),
                    (vectors.len() - next) as libc::c_int,
                    at,
                )
            };
            let read = match read {
                0 => break,
                n if n > 0 => n as usize,
                _ => {
                    let error = io::Error::last_os_error();
                    match error.raw_os_error() {
                        Some(libc::EINTR) => continue,
                        // The file system takes the flag but not these reads: cached from now
                        // on.
                        Some(libc::EINVAL) if done == 0 => {
                            self.0.direct_works.store(false, Ordering::Relaxed);
                            return Ok(filled);
                        }
                        _ => {
                            return Err(Error::io(
                                &self.0.path,
                                "reading past the page cache",
                                error,
                            ));
                        }
                    }
                }
            };
            done += read;
            // A read ending short of a block ends at the file's end.
            if read % DIRECT_ALIGN != 0 {
                break;
            }
            // Past the vectors read whole; into the one read in part.
            let mut left = read;
            while next < vectors.len() && left >= vectors[next].iov_len {
                left -= vectors[next].iov_len;
                next += 1;
            }
            if left > 0 {
                let vector = &mut vectors[next];
                vector.iov_base = vector.iov_base.cast::<u8>().wrapping_add(left).cast();
                vector.iov_len -= left;
            }
        }
        for (i, &(_, len)) in parts.iter().enumerate() {
            filled[i] = done.saturating_sub(starts[i]).min(len);
        }
        self.0
            .direct_bytes
            .fetch_add(filled.iter().sum::<usize>() as u64, Ordering::Relaxed);
        self.0.direct_reads.fetch_add(1, Ordering::Relaxed);
        Ok(filled)
    }

    /// Reads the `len` bytes at `buf` from `offset` through the page cache.
    ///
    /// # Safety
    ///
    /// `buf` is writable for `len` bytes and nobody else's until this returns.
    pub(crate) unsafe fn read_through_cache(
        &self,
        buf: *mut u8,
        len: usize,
        offset: u64,
    ) -> Result<()> {
        // SAFETY: writable and ours (the contract).
        let buf = unsafe { std::slice::from_raw_parts_mut(buf, len) };
        self.read_cached(buf, offset)
    }

    /// Calls that read past the page cache so far (one for several pieces read together).
    #[cfg(test)]
    pub(crate) fn direct_reads(&self) -> u64 {
        self.0.direct_reads.load(Ordering::Relaxed)
    }

    fn truncated(&self, offset: u64, wanted: usize) -> Error {
        let length = self.0.buffered.metadata().map_or(0, |m| m.len());
        Error::Truncated {
            path: self.0.path.clone(),
            offset,
            wanted: wanted as u64,
            length,
        }
    }
}
