//! What the page cache holds of a file, and advice on what will be read.
//!
//! Readers ask before they read whether the page cache holds the bytes: a cached read comes
//! at memory speed through the cache, an uncached one is better read past it (a checkpoint's
//! piece) or asked of the disk together with its neighbours (a batch's samples). The kernel
//! is asked with `mincore` on a mapping of the file that is never read through, which starts
//! no I/O (a read that declines to wait, `RWF_NOWAIT`, may start some, and is not taken by
//! every file system).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Says which bytes of a file the page cache holds.
///
/// A shared read-only mapping of the file, never read through: it only lets the kernel say
/// which of the file's pages are cached. A file that shrinks cannot fault an access.
///
/// # Examples
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// # if cfg!(miri) { return Ok(()); } // Miri maps no files.
/// use std::io::Write;
/// let mut file = tempfile::tempfile()?;
/// file.write_all(&[7; 8192])?;
/// let probe = cuda_pinned::PageCacheProbe::of(&file).expect("a regular file maps");
/// // Just written: in the page cache.
/// assert!(probe.holds(0, 8192));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct PageCacheProbe {
    address: usize,
    len: usize,
    page: usize,
}

impl PageCacheProbe {
    /// A probe of `file` as long as it is now; `None` where it cannot be mapped (an empty
    /// file, a file system without mappings).
    pub fn of(file: &File) -> Option<Self> {
        let len = file.metadata().ok()?.len();
        let len = usize::try_from(len).ok().filter(|&len| len > 0)?;
        // SAFETY: `sysconf` reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        // SAFETY: a new shared read-only mapping of an open file, at an address the kernel
        // picks; it is never read or written through (only `mincore` looks at it), so a file
        // that shrinks cannot fault an access, and it is unmapped when dropped.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        (address != libc::MAP_FAILED).then_some(Self {
            address: address as usize,
            len,
            page,
        })
    }

    /// The file's length when probed: the bytes it can say anything of.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the probe covers no bytes: never (an empty file has no probe).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every page of `offset..offset + len` is in the page cache; `false` where the
    /// kernel cannot say or the range passes the file's end as probed (`true` for no bytes).
    pub fn holds(&self, offset: u64, len: usize) -> bool {
        let Some(end) = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(len))
        else {
            return false;
        };
        if end > self.len || len == 0 {
            return len == 0;
        }
        let start = offset as usize / self.page * self.page;
        let mut pages = vec![0u8; (end - start).div_ceil(self.page)];
        // SAFETY: the range lies in the mapping (checked) and starts on a page; `pages` has a
        // byte for each of its pages.
        let asked = unsafe {
            libc::mincore(
                (self.address + start) as *mut libc::c_void,
                end - start,
                pages.as_mut_ptr(),
            )
        };
        asked == 0 && pages.iter().all(|&page| page & 1 == 1)
    }
}

// SAFETY: an address the probe alone unmaps, never dereferenced: only `mincore` is asked
// about it, from any thread.
unsafe impl Send for PageCacheProbe {}

// SAFETY: as above; `holds` only reads the fields.
unsafe impl Sync for PageCacheProbe {}

impl Drop for PageCacheProbe {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, unmapped once; nothing refers into it.
        unsafe { libc::munmap(self.address as *mut libc::c_void, self.len) };
    }
}

/// Tells the kernel reads of `file` will come at random (a shuffled epoch): it then reads no
/// more than asked for, instead of reading ahead what the next read will not need.
///
/// # Errors
///
/// The system's refusal (a descriptor it cannot advise).
pub fn advise_random(file: &File) -> io::Result<()> {
    // SAFETY: posix_fadvise only reads its arguments, and the descriptor is open while
    // `file` lives.
    let code = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    match code {
        0 => Ok(()),
        code => Err(io::Error::from_raw_os_error(code)),
    }
}

/// Asks the kernel to start reading `len` bytes of `file` from `offset` into the page cache,
/// and returns without waiting for them. Advice only: a failure changes nothing but speed.
pub fn advise_will_need(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: posix_fadvise only reads its arguments, and the descriptor is open while
    // `file` lives.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED) };
}
