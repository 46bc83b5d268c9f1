//! Filling a [`PinnedVec`]'s spare capacity without a zeroing pass: from a reader or a file (the
//! length grows by exactly the bytes read, whatever ends the reading), or from a slice with
//! non-temporal stores.

use std::fs::File;
use std::io::{self, Read};
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;

use bytemuck::NoUninit;

use crate::containers::vec::PinnedVec;
use crate::error::Result;
use crate::memory::allocator::PinnedAllocator;

/// Bytes a [`Read`] is offered at a time: each piece is zeroed just before it is read into
/// (a reader may look at the buffer it is given), while the CPU's caches still hold it.
const READ_PIECE: usize = 64 << 10;

/// Bytes one `pread` asks for at most (Linux reads at most about 2 GiB a call).
const FILE_PIECE: usize = 1 << 30;

impl<A: PinnedAllocator> PinnedVec<u8, A> {
    /// Appends the bytes `reader` yields until its end, or until `limit` bytes were appended,
    /// and returns how many it appended.
    ///
    /// Room for `limit` more bytes is reserved first. An interrupted read is retried; any
    /// other error ends the reading, with the bytes read before it appended (the length says
    /// how many). For a file, [`read_from_file_at`](Self::read_from_file_at) reads without
    /// zeroing the room first.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_pinned::PinnedVec;
    ///
    /// let mut bytes = PinnedVec::<u8>::with_capacity(0)?;
    /// let read = bytes.read_from(&mut &b"header and body"[..], 6)?;
    /// assert_eq!((read, bytes.as_slice()), (6, &b"header"[..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// `ErrorKind::OutOfMemory` when the room cannot be reserved (nothing is read), the
    /// reader's error, or `ErrorKind::InvalidData` for a reader that claims more bytes than it
    /// was given room for.
    pub fn read_from<R: Read + ?Sized>(
        &mut self,
        reader: &mut R,
        limit: usize,
    ) -> io::Result<usize> {
        self.reserve_for_reading(limit)?;
        let mut read = 0;
        while read < limit {
            let want = (limit - read).min(READ_PIECE);
            let room = &mut self.spare_capacity_mut()[..want];
            room.fill(MaybeUninit::new(0));
            // SAFETY: the `want` bytes were just initialised (zeroed).
            let room = unsafe { &mut *(std::ptr::from_mut(room) as *mut [u8]) };
            let got = match reader.read(room) {
                Ok(0) => break,
                Ok(got) if got > want => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a reader claimed {got} bytes read into room for {want}"),
                    ));
                }
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            // SAFETY: the first `got ≤ want` bytes of the spare capacity hold what was read
            // (initialised bytes), within the capacity reserved above.
            unsafe { self.set_len(self.len() + got) };
            read += got;
        }
        Ok(read)
    }

    /// Appends up to `len` bytes of `file` from byte `offset` (fewer where the file ends
    /// first), read straight into the spare capacity with `pread`, and returns how many it
    /// appended.
    ///
    /// The file's own position is neither used nor moved. An interrupted read is retried;
    /// any other error ends the reading, with the bytes read before it appended.
    ///
    /// # Errors
    ///
    /// `ErrorKind::OutOfMemory` when the room cannot be reserved (nothing is read),
    /// `ErrorKind::InvalidInput` for a range past the largest file offset, or the operating
    /// system's error.
    pub fn read_from_file_at(&mut self, file: &File, offset: u64, len: usize) -> io::Result<usize> {
        self.reserve_for_reading(len)?;
        let mut read = 0;
        while read < len {
            let want = (len - read).min(FILE_PIECE);
            let at = offset
                .checked_add(read as u64)
                .and_then(|at| libc::off_t::try_from(at).ok())
                .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
            let room = self.spare_capacity_mut()[..want].as_mut_ptr();
            // SAFETY: `room` is `want` writable bytes of the spare capacity, which the kernel
            // only writes (uninitialised memory may be handed to it) and which nothing else
            // uses during the call.
            let got = unsafe { libc::pread(file.as_raw_fd(), room.cast(), want, at) };
            let got = match usize::try_from(got) {
                Ok(0) => break,
                Ok(got) => got.min(want),
                Err(_) => {
                    let error = io::Error::last_os_error();
                    if error.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(error);
                }
            };
            // SAFETY: the kernel wrote the first `got ≤ want` bytes of the spare capacity.
            unsafe { self.set_len(self.len() + got) };
            read += got;
        }
        Ok(read)
    }

    fn reserve_for_reading(&mut self, additional: usize) -> io::Result<()> {
        self.try_reserve(additional)
            .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e))
    }
}

impl<T: NoUninit, A: PinnedAllocator> PinnedVec<T, A> {
    /// Appends `src` with non-temporal stores ([`copy_streaming`](crate::copy_streaming)),
    /// straight into the spare capacity: for a buffer that a copy to the device reads next, and
    /// the CPU does not.
    ///
    /// ```
    /// use cuda_pinned::PinnedVec;
    /// let mut batch = PinnedVec::<f32>::with_capacity(0)?;
    /// batch.extend_streaming(&[0.5; 4096])?;
    /// assert_eq!((batch.len(), batch[4095]), (4096, 0.5));
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`](crate::Error::CapacityOverflow) or the allocator's error
    /// when room cannot be made; the vector is then unchanged.
    pub fn extend_streaming(&mut self, src: &[T]) -> Result<()> {
        self.try_reserve(src.len())?;
        let room = &mut self.spare_capacity_mut()[..src.len()];
        // SAFETY: `room` holds `size_of_val(src)` writable bytes of the spare capacity,
        // uniquely borrowed (so apart from `src`); `src` is initialised (`NoUninit`).
        unsafe {
            crate::nontemporal::copy_bytes_streaming(
                src.as_ptr().cast(),
                room.as_mut_ptr().cast(),
                size_of_val(src),
            );
        }
        // SAFETY: the first `src.len()` elements of the spare capacity now hold copies of
        // valid `T`s (`NoUninit` types are plain bytes), within the reserved capacity.
        unsafe { self.set_len(self.len() + src.len()) };
        Ok(())
    }
}
