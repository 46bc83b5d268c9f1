//! Copies with non-temporal stores: for filling memory that the DMA engine, not the CPU,
//! reads next.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use bytemuck::NoUninit;

/// The smallest copy worth non-temporal stores: below it, a plain copy's cache lines cost
/// little, and the aligned head and tail would be most of the copy.
const STREAMING_MIN: usize = 4096;

/// Bytes of a thread's bounce buffer for [`read_at_streaming`]: small enough to stay in the
/// core's own caches between the kernel's copy into it and the copy out, large enough for
/// one read to carry a whole sample or part.
const BOUNCE_BYTES: usize = 256 << 10;

/// The bounce buffer's alignment: a page, which reads past the page cache (`O_DIRECT`) need.
const BOUNCE_ALIGN: usize = 4096;

/// Copies `src` into `dst` with non-temporal stores, for memory the DMA engine reads next.
///
/// It does what [`slice::copy_from_slice`] does (for plain-old-data `T`), with non-temporal stores
/// where the CPU has them (x86-64 with AVX2; copies of 4 KiB and more): the destination's cache
/// lines are neither read in first nor kept in the caches afterwards. Filling page-locked memory
/// that a copy to the device reads next (a batch, a staging chunk), this saves the memory bandwidth
/// of reading the destination; data the CPU reads again soon is better copied plainly.
///
/// ```
/// let src = vec![7u32; 1 << 16];
/// let mut dst = vec![0u32; 1 << 16];
/// cuda_pinned::copy_streaming(&mut dst, &src);
/// assert_eq!(dst, src);
/// ```
///
/// # Panics
///
/// When the two slices have different lengths, as `copy_from_slice`.
pub fn copy_streaming<T: NoUninit>(dst: &mut [T], src: &[T]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "source and destination slices have different lengths"
    );
    // SAFETY: both slices hold `size_of_val(src)` bytes, `dst` uniquely borrowed (so the two
    // do not overlap); every byte of `src` is initialized (`NoUninit`: the vector loads read
    // them as integers), and an exact copy of valid `T`s is valid `T`s.
    unsafe {
        copy_bytes_streaming(
            src.as_ptr().cast(),
            dst.as_mut_ptr().cast(),
            size_of_val(src),
        );
    }
}

/// Reads from `file` at `offset` into `dst` as [`FileExt::read_at`] does, with non-temporal
/// stores: for filling large buffers from a file in the page cache, such as batches of
/// samples, that no core reads back soon.
///
/// The kernel copies a file's cached pages with plain stores, which first read every
/// destination cache line in. Here it copies into a small, page-aligned buffer of the calling
/// thread's (allocated on its first read, kept until it ends), which stays in the core's
/// caches, and [`copy_streaming`] moves the bytes on into `dst`. Reads of less than 4 KiB go
/// straight into `dst`, and so does a read where the thread's buffer cannot be had (while the
/// thread ends, or from a signal handler that interrupted a read).
///
/// Streaming stores send the bytes to memory. A small buffer that a device copy reads right
/// after it is filled may be read faster from the CPU's caches, where plain `read_at` leaves
/// it: measure both.
///
/// Like `read_at`, one call may read less than `dst.len()` (at most 256 KiB): it returns the
/// bytes read, 0 at the end of the file; callers loop as over `read_at`. A descriptor opened
/// with `O_DIRECT` takes the same offsets and lengths as with `read_at`.
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// # if cfg!(miri) { return Ok(()); } // Miri's isolation refuses to open files.
/// use std::io::Write;
/// let mut file = tempfile::tempfile()?;
/// file.write_all(&[7u8; 300_000])?;
/// let mut dst = vec![0u8; 300_000];
/// let mut done = 0;
/// while done < dst.len() {
///     match cuda_pinned::read_at_streaming(&file, &mut dst[done..], done as u64)? {
///         0 => break,
///         read => done += read,
///     }
/// }
/// assert!(dst.iter().all(|&b| b == 7));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// What `read_at` returns.
pub fn read_at_streaming(file: &File, dst: &mut [u8], offset: u64) -> io::Result<usize> {
    thread_local! {
        static BOUNCE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    if dst.len() < STREAMING_MIN {
        return file.read_at(dst, offset);
    }
    let streamed = BOUNCE.try_with(|bounce| {
        let mut bounce = bounce.try_borrow_mut().ok()?;
        if bounce.is_empty() {
            *bounce = vec![0; BOUNCE_BYTES + BOUNCE_ALIGN];
        }
        // The vector is never resized again: its aligned part stays where it is.
        let skew = bounce.as_ptr().addr().wrapping_neg() % BOUNCE_ALIGN;
        let bounce = &mut bounce[skew..skew + BOUNCE_BYTES];
        let len = dst.len().min(BOUNCE_BYTES);
        let read = file.read_at(&mut bounce[..len], offset);
        if let Ok(read) = read {
            copy_streaming(&mut dst[..read], &bounce[..read]);
        }
        Some(read)
    });
    match streamed {
        Ok(Some(read)) => read,
        // The thread's buffer is gone (the thread is ending) or in use (a signal handler):
        // read straight in.
        Ok(None) | Err(_) => file.read_at(dst, offset),
    }
}

/// Copies `bytes` from `src` to `dst` with non-temporal stores where the CPU has AVX2, else
/// as `copy_nonoverlapping` does. The stores are fenced before returning: whatever the caller
/// does next (releasing a lock) is seen after them.
///
/// # Safety
///
/// As `copy_nonoverlapping`: `src` readable and `dst` writable for `bytes`, not overlapping.
pub(crate) unsafe fn copy_bytes_streaming(src: *const u8, dst: *mut u8, bytes: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if bytes >= STREAMING_MIN && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above); the ranges as the caller promised.
        return unsafe { copy_streaming_avx2(src, dst, bytes) };
    }
    // SAFETY: as the caller promised.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) }
}

/// [`copy_bytes_streaming`] on a CPU with AVX2: unaligned loads, aligned 32-byte non-temporal
/// stores, plain copies for the unaligned head and the tail.
///
/// # Safety
///
/// As [`copy_bytes_streaming`], on a CPU with AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn copy_streaming_avx2(src: *const u8, dst: *mut u8, bytes: usize) {
    use std::arch::x86_64::{__m256i, _mm_sfence, _mm256_loadu_si256, _mm256_stream_si256};
    let head = dst.align_offset(32).min(bytes);
    // SAFETY: both ranges hold `bytes` ≥ `head` bytes and do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let body = (bytes - head) / 128 * 128;
    let (src_body, dst_body) = (src.wrapping_add(head), dst.wrapping_add(head));
    let mut at = 0;
    while at < body {
        for lane in (0..128).step_by(32) {
            // SAFETY: `head + at + lane + 32 <= bytes`: in bounds of both ranges; the store
            // is 32-byte aligned (`dst + head` is, and every offset is a multiple of 32).
            unsafe {
                let value = _mm256_loadu_si256(src_body.add(at + lane).cast::<__m256i>());
                _mm256_stream_si256(dst_body.add(at + lane).cast::<__m256i>(), value);
            }
        }
        at += 128;
    }
    let done = head + body;
    // SAFETY: the tail lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), bytes - done) };
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use proptest::prelude::*;

    use super::{BOUNCE_BYTES, STREAMING_MIN, copy_streaming, read_at_streaming};

    /// A file of `len` bytes, each a function of its offset, and those bytes.
    fn file_of(len: usize) -> (std::fs::File, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut file = tempfile::tempfile().expect("a temporary file");
        file.write_all(&bytes).expect("written");
        (file, bytes)
    }

    /// Sizes around the edges of the streaming path and of the bounce buffer.
    fn edges() -> impl Strategy<Value = usize> {
        let edges = vec![STREAMING_MIN, BOUNCE_BYTES, 2 * BOUNCE_BYTES];
        (prop::sample::select(edges), -40isize..40).prop_map(|(e, d)| e.saturating_add_signed(d))
    }

    proptest! {
        /// Reading in a loop, as callers do, fills the destination with the file's bytes from
        /// the offset, as far as the file goes; no call reads past what it was given or
        /// returns more than it read, and the rest of the destination is left alone.
        #[test]
        #[cfg_attr(miri, ignore = "opens files, which Miri's isolation refuses")]
        fn streaming_reads_land_like_plain_reads(
            file_len in prop_oneof![edges(), 0usize..10_000],
            dst_len in prop_oneof![edges(), 0usize..10_000],
            offset in 0usize..6_000,
            into in 0usize..64,
        ) {
            let (file, bytes) = file_of(file_len);
            let mut target = vec![0xEEu8; into + dst_len + 64];
            let dst = &mut target[into..into + dst_len];
            let mut done = 0;
            while done < dst.len() {
                let read = read_at_streaming(&file, &mut dst[done..], (offset + done) as u64)
                    .expect("read");
                prop_assert!(read <= dst.len() - done);
                if read == 0 {
                    break;
                }
                done += read;
            }
            let expected = dst_len.min(file_len.saturating_sub(offset));
            prop_assert_eq!(done, expected);
            prop_assert_eq!(&target[into..into + done], &bytes[offset.min(file_len)..][..done]);
            prop_assert!(target[..into].iter().all(|&b| b == 0xEE));
            prop_assert!(target[into + done..].iter().all(|&b| b == 0xEE));
        }
    }

    /// Reads in a loop as callers do; returns the bytes read.
    fn read_all(file: &std::fs::File, dst: &mut [u8], offset: usize) -> std::io::Result<usize> {
        let mut done = 0;
        while done < dst.len() {
            match read_at_streaming(file, &mut dst[done..], (offset + done) as u64)? {
                0 => break,
                read => done += read,
            }
        }
        Ok(done)
    }

    /// A descriptor that reads past the page cache (`O_DIRECT`) takes aligned reads into an
    /// aligned destination, as with `read_at`: the bounce buffer is page-aligned too.
    #[test]
    #[cfg_attr(miri, ignore = "opens files, which Miri's isolation refuses")]
    fn a_descriptor_past_the_page_cache_reads_as_with_read_at() {
        use std::os::unix::fs::OpenOptionsExt;
        const LEN: usize = 3 * BOUNCE_BYTES + 4 * STREAMING_MIN;
        // Beside the sources, or where the test runs when they are not here (a bundle of
        // test binaries): a temporary folder may be in memory, which has no `O_DIRECT`.
        let sources = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = match sources.is_dir() {
            true => tempfile::tempdir_in(sources),
            false => tempfile::tempdir_in("."),
        }
        .expect("a directory");
        let path = dir.path().join("direct");
        let bytes: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::write(&path, &bytes).expect("written");
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        else {
            eprintln!("skipped: this file system refuses O_DIRECT");
            return;
        };
        let mut room = vec![0u8; LEN + 4096];
        let skew = room.as_ptr().align_offset(4096);
        let dst = &mut room[skew..skew + LEN];
        assert_eq!(read_all(&file, dst, 0).expect("read"), LEN);
        assert!(dst == &bytes[..]);
    }

    /// A read from a thread-local destructor that runs after the thread's bounce buffer is
    /// gone reads straight in, instead of panicking (which would abort the process).
    #[test]
    #[cfg_attr(miri, ignore = "opens files, which Miri's isolation refuses")]
    fn a_read_while_the_thread_ends_reads_straight_in() {
        use std::cell::RefCell;
        use std::sync::mpsc;

        type Sent = std::io::Result<Vec<u8>>;
        struct ReadsWhenDropped(Option<(std::fs::File, mpsc::Sender<Sent>)>);
        impl Drop for ReadsWhenDropped {
            fn drop(&mut self) {
                if let Some((file, sender)) = self.0.take() {
                    let mut dst = vec![0u8; 2 * STREAMING_MIN];
                    let read = read_all(&file, &mut dst, 0).map(|n| dst[..n].to_vec());
                    let _ = sender.send(read);
                }
            }
        }
        thread_local! {
            static LAST: RefCell<ReadsWhenDropped> =
                const { RefCell::new(ReadsWhenDropped(None)) };
        }
        let (file, bytes) = file_of(3 * STREAMING_MIN);
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            // Destructors run in the reverse order of first use: the bounce buffer, used
            // after this, goes first.
            let own = file.try_clone().expect("a second descriptor");
            LAST.with_borrow_mut(|last| last.0 = Some((own, sender)));
            let mut dst = vec![0u8; 2 * STREAMING_MIN];
            assert_eq!(read_all(&file, &mut dst, 0).expect("read"), dst.len());
        })
        .join()
        .expect("the thread ends without a panic");
        let read = receiver.recv().expect("the destructor ran").expect("read");
        assert_eq!(read, bytes[..2 * STREAMING_MIN]);
    }

    /// A read the file system refuses is returned as its error.
    #[test]
    #[cfg_attr(miri, ignore = "opens files, which Miri's isolation refuses")]
    fn a_failed_read_is_returned() {
        let file = std::fs::File::create(
            tempfile::tempdir()
                .expect("a directory")
                .path()
                .join("write-only"),
        )
        .expect("created");
        let error = read_at_streaming(&file, &mut [0u8; 2 * STREAMING_MIN], 0)
            .expect_err("a write-only descriptor cannot be read");
        assert_eq!(error.raw_os_error(), Some(libc::EBADF));
    }

    /// Streaming copies equal plain ones at every alignment of either side, below and above
    /// the size where the non-temporal path starts, tails of every length included.
    #[test]
    fn streaming_copies_are_exact_at_any_alignment() {
        let source: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let lens = [
            0,
            1,
            31,
            33,
            127,
            4095,
            4096,
            4097,
            4096 + 127,
            4096 + 129,
            12_345,
        ];
        let lens = if cfg!(miri) { &lens[..5] } else { &lens[..] };
        for &len in lens {
            for from in [0, 1, 17, 32] {
                for into in [0, 3, 31, 64] {
                    let mut target = vec![0xEEu8; len + 128];
                    copy_streaming(&mut target[into..into + len], &source[from..from + len]);
                    assert_eq!(&target[into..into + len], &source[from..from + len]);
                    assert!(
                        target[..into].iter().all(|&b| b == 0xEE),
                        "{len} {from} {into}"
                    );
                    assert!(
                        target[into + len..].iter().all(|&b| b == 0xEE),
                        "{len} {from} {into}"
                    );
                }
            }
        }
    }

    #[test]
    fn typed_elements_are_copied_whole() {
        let source: Vec<f64> = (0..3_001).map(|i| f64::from(i) * 0.25).collect();
        let mut target = vec![0.0f64; 3_001];
        copy_streaming(&mut target, &source);
        assert_eq!(target, source);
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn slices_of_different_lengths_are_refused() {
        copy_streaming(&mut [0u8; 3], &[1u8; 4]);
    }
}
