//! Operating-system memory calls: anonymous mappings, huge-page advice, NUMA placement,
//! parallel pre-fault, `mlock`. Shared by the registered and the host-locked kinds.

use std::ptr::NonNull;

use crate::error::Error;
use crate::error::Result;

/// The base page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// Transparent huge pages are 2 MiB on x86-64 and on 4 KiB-page arm64.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// `bytes` rounded up to a multiple of `to` (a power of two), or `None` on overflow.
pub(crate) fn round_up(bytes: usize, to: usize) -> Option<usize> {
    Some(bytes.checked_add(to - 1)? & !(to - 1))
}

/// A mapping of anonymous memory, `HUGE_PAGE`-aligned when `huge` (so that transparent huge
/// pages can back all of it). The length is what the caller asked for, already rounded.
pub(crate) fn map(bytes: usize, huge: bool) -> Result<NonNull<u8>> {
    // Miri unmaps only whole mappings, so there the slack is not trimmed (nor asked for).
    let huge = huge && !cfg!(miri);
    let extra = if huge { HUGE_PAGE } else { 0 };
    let span = bytes.checked_add(extra).ok_or(Error::CapacityOverflow)?;
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
    // existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        let error = std::io::Error::last_os_error();
        return Err(match error.raw_os_error() {
            Some(libc::ENOMEM) => Error::OutOfMemory { requested: bytes },
            _ => Error::Os {
                call: "mmap",
                source: error,
            },
        });
    }
    let start = raw as usize;
    let aligned = if huge {
        round_up(start, HUGE_PAGE).unwrap_or(start)
    } else {
        start
    };
    // Give back the slack before and after the aligned range.
    // SAFETY: both ranges lie inside the mapping just made and are not used by anyone.
    unsafe {
        if aligned > start {
            libc::munmap(raw, aligned - start);
        }
        let tail = start + span - (aligned + bytes);
        if tail > 0 {
            libc::munmap((aligned + bytes) as *mut libc::c_void, tail);
        }
    }
    if huge {
        // Advice only: without THP (or with it set to `never`) the kernel says EINVAL and the
        // mapping keeps base pages, which is still correct.
        // SAFETY: the range is our mapping.
        unsafe { libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
    }
    // SAFETY: mmap never returns null on success; `aligned` is inside the mapping, so the
    // offset stays in it (and the address keeps the mapping's provenance).
    Ok(unsafe { NonNull::new_unchecked(raw.cast::<u8>().add(aligned - start)) })
}

/// # Safety
///
/// - `ptr..ptr + bytes` is a mapping made by [`map`] that nothing uses any more.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: the caller guarantees the range is ours and unused. munmap only fails for
    // invalid arguments, which a range from `map` is not.
    unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
}

/// Asks the kernel to place the range's pages on NUMA node `node` (`mbind` with
/// `MPOL_PREFERRED`: the node when it has room, another rather than failing). Call it before
/// the pages are first touched.
///
/// # Errors
///
/// [`Error::Os`] for `mbind`: `EINVAL` for a node the machine does not have, `ENOSYS` on a
/// kernel without NUMA support, `EPERM` where a sandbox forbids the call (Docker's default
/// seccomp profile, without `CAP_SYS_NICE`).
///
/// # Safety
///
/// - `ptr..ptr + bytes` is a page-aligned mapping of ours.
pub(crate) unsafe fn prefer_node(ptr: NonNull<u8>, bytes: usize, node: u32) -> Result<()> {
    const MPOL_PREFERRED: libc::c_long = 1;
    // Linux numbers nodes below 1024 (`NODES_SHIFT` is at most 10): a larger number is
    // refused as `mbind` would refuse it, without a mask of its size first.
    const NODE_LIMIT: u32 = 1 << 10;
    if node >= NODE_LIMIT {
        return Err(Error::Os {
            call: "mbind",
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    let node = node as usize;
    // One word past the node: the kernel reads `maxnode - 1` bits.
    let mut mask = vec![0 as libc::c_ulong; node / libc::c_ulong::BITS as usize + 2];
    mask[node / libc::c_ulong::BITS as usize] |= 1 << (node % libc::c_ulong::BITS as usize);
    let max_node = mask.len() * libc::c_ulong::BITS as usize;
    // SAFETY: the range is our mapping (the caller's promise); `mask` holds `max_node` bits.
    let status = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr.as_ptr(),
            bytes,
            MPOL_PREFERRED,
            mask.as_ptr(),
            max_node,
            0 as libc::c_ulong,
        )
    };
    if status != 0 {
        return Err(Error::Os {
            call: "mbind",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The online NUMA nodes as `(how many, highest number + 1)`: `(1, 1)` where the kernel does
/// not say, and under Miri, which cannot read files. Read once per process.
fn numa_nodes() -> (usize, usize) {
    static NODES: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *NODES.get_or_init(|| {
        if cfg!(miri) {
            return (1, 1);
        }
        std::fs::read_to_string("/sys/devices/system/node/online")
            .ok()
            .map(|list| parse_list(list.trim()))
            .filter(|&(count, _)| count > 0)
            .unwrap_or((1, 1))
    })
}

/// How many NUMA nodes are online.
pub(crate) fn online_numa_nodes() -> usize {
    numa_nodes().0
}

/// One more than the highest online NUMA node's number: node numbers lie below it.
pub(crate) fn numa_node_bound() -> usize {
    numa_nodes().1
}

/// A kernel CPU or node list such as `0-3,8,10-11` as `(entries, highest + 1)`.
fn parse_list(list: &str) -> (usize, usize) {
    let mut count = 0;
    let mut bound = 0;
    for part in list.split(',').filter(|part| !part.is_empty()) {
        let range = match part.split_once('-') {
            Some((first, last)) => first.parse::<usize>().ok().zip(last.parse().ok()),
            None => part.parse::<usize>().ok().map(|n| (n, n)),
        };
        if let Some((first, last)) = range.filter(|(first, last)| last >= first) {
            count += last - first + 1;
            bound = bound.max(last + 1);
        }
    }
    (count, bound)
}

/// Faults every page of the range in, spread over up to `threads` threads, so that
/// registration finds the pages present (the kernel's page-fault path is the slow part of
/// pinning, and it scales with threads). A share whose thread cannot be started (a process
/// or memory limit) is faulted in on the calling thread instead.
///
/// # Safety
///
/// - `ptr..ptr + bytes` is a writable mapping of ours, not yet in use: the first byte of each
///   page becomes zero (which fresh anonymous memory already holds).
pub(crate) unsafe fn prefault(ptr: NonNull<u8>, bytes: usize, threads: usize) {
    let page = page_size();
    let mut shares = prefault_shares(bytes / page, page, threads);
    let base = Base(ptr);
    let touch = move |(first, last): (usize, usize)| {
        // SAFETY: pages `first..last` lie inside the range, which nobody uses yet.
        unsafe { touch_pages(base.at(first * page), (last - first) * page) };
    };
    // The calling thread takes the last share itself.
    let last = shares.pop().unwrap_or((0, 0));
    if shares.is_empty() {
        touch(last);
        return;
    }
    std::thread::scope(|scope| {
        for share in shares {
            if spawn(scope, move || touch(share)).is_err() {
                touch(share);
            }
        }
        touch(last);
    });
}

/// How [`prefault`] splits `pages` pages of `page` bytes between up to `threads` threads:
/// page ranges, in order, each whole 2 MiB units (two threads faulting one huge page wait for
/// each other) but the last, none empty unless the range is; one for a range under 4 MiB,
/// not worth a thread.
fn prefault_shares(pages: usize, page: usize, threads: usize) -> Vec<(usize, usize)> {
    let unit = (HUGE_PAGE / page).max(1);
    let units = pages.div_ceil(unit).max(1);
    let threads = if pages * page < (4 << 20) {
        1
    } else {
        threads.clamp(1, units)
    };
    let per_share = units.div_ceil(threads) * unit;
    (0..pages.div_ceil(per_share).max(1))
        .map(|t| (t * per_share, ((t + 1) * per_share).min(pages)))
        .collect()
}

/// Faults in every page of the range from the calling thread: the first byte of each page
/// becomes zero.
///
/// # Safety
///
/// - `ptr..ptr + bytes` is a writable mapping of ours that nobody uses yet.
pub(crate) unsafe fn touch_pages(ptr: *mut u8, bytes: usize) {
    let page = page_size();
    for offset in (0..bytes).step_by(page) {
        // SAFETY: inside the range (the caller's promise); the write makes the kernel (or the
        // driver) back the page.
        unsafe { std::ptr::write_volatile(ptr.add(offset), 0) };
    }
}

/// The start of a range being pre-faulted, shared by the faulting threads.
#[derive(Clone, Copy)]
pub(crate) struct Base(pub(crate) NonNull<u8>);

impl Base {
    /// The address `offset` bytes in (a method, so that closures capture the whole `Base`).
    ///
    /// # Safety
    ///
    /// - `offset` lies inside the range.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.as_ptr().add(offset) }
    }
}

// SAFETY: the threads only write to disjoint pages of a mapping that outlives them (they are
// scoped); nothing else uses the range meanwhile.
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

/// Starts a scoped thread, reporting failure instead of panicking as `Scope::spawn` does.
pub(crate) fn spawn<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    work: impl FnOnce() + Send + 'scope,
) -> std::io::Result<()> {
    #[cfg(test)]
    if tests::spawn_refused() {
        return Err(std::io::Error::other("thread creation refused by the test"));
    }
    std::thread::Builder::new()
        .name("cuda-pinned-prefault".into())
        .spawn_scoped(scope, work)
        .map(drop)
}

/// `mlock`s the range, turning the kernel's refusal into [`Error::MemlockLimit`].
///
/// # Safety
///
/// - `ptr..ptr + bytes` is a mapping of ours.
pub(crate) unsafe fn lock(ptr: NonNull<u8>, bytes: usize) -> Result<()> {
    // Miri has no paging to lock pages against; its memory stays put anyway.
    if cfg!(miri) {
        return Ok(());
    }
    let _span = tracing::debug_span!("pin", kind = %"mlock", bytes).entered();
    // SAFETY: the caller guarantees the range is mapped.
    if unsafe { libc::mlock(ptr.as_ptr().cast(), bytes) } == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    let limit = memlock_limit();
    Err(match error.raw_os_error() {
        // EPERM: limit 0 and unprivileged; ENOMEM: over the limit, or out of memory.
        Some(libc::EPERM) => Error::MemlockLimit {
            requested: bytes,
            limit,
        },
        Some(libc::ENOMEM) if limit.is_some() => Error::MemlockLimit {
            requested: bytes,
            limit,
        },
        Some(libc::ENOMEM) => Error::OutOfMemory { requested: bytes },
        _ => Error::Os {
            call: "mlock",
            source: error,
        },
    })
}

/// # Safety
///
/// - `ptr..ptr + bytes` was locked with [`lock`].
pub(crate) unsafe fn unlock(ptr: NonNull<u8>, bytes: usize) {
    if cfg!(miri) {
        return;
    }
    // SAFETY: the caller guarantees the range is ours; munlock cannot fail for it.
    unsafe { libc::munlock(ptr.as_ptr().cast(), bytes) };
}

/// The soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited or unreadable.
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid out-pointer.
    let status = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (status == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Default number of pre-fault threads: the cores available to us, at most 16 (past that the
/// kernel's page allocator, not the number of faulting threads, is the limit).
pub(crate) fn default_prefault_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16)
}

/// Whether any of `addr..addr + bytes` lies in a private mapping of a file: the kernel shares
/// its pages with the page cache until they are written (copy-on-write), and CUDA cannot pin
/// such pages (a registration of one was seen never to return). Read from
/// `/proc/self/maps`; `false` where that cannot be read.
pub(crate) fn in_private_file_mapping(addr: usize, bytes: usize) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let end = addr.saturating_add(bytes);
    maps.lines().any(|line| {
        private_file_mapping(line).is_some_and(|(start, stop)| start < end && addr < stop)
    })
}

/// The range of a line of `/proc/<pid>/maps` if it is a private mapping of a file:
/// `start-end perms offset dev inode path`, with a path that is a file (not `[heap]` and the
/// like, nor an anonymous mapping) and `p` in the permissions.
fn private_file_mapping(line: &str) -> Option<(usize, usize)> {
    let mut fields = line.split_whitespace();
    let range = fields.next()?;
    let perms = fields.next()?;
    let inode = fields.nth(2)?;
    let path = fields.next()?;
    if !perms.ends_with('p') || inode == "0" || path.starts_with('[') {
        return None;
    }
    let (start, stop) = range.split_once('-')?;
    Some((
        usize::from_str_radix(start, 16).ok()?,
        usize::from_str_radix(stop, 16).ok()?,
    ))
}

/// Whether every page of `ptr..ptr + bytes` (page-aligned, in a mapping of ours) is resident.
#[cfg(test)]
pub(crate) fn resident(ptr: NonNull<u8>, bytes: usize) -> bool {
    let mut pages = vec![0u8; bytes.div_ceil(page_size())];
    // SAFETY: the range is a mapping of ours; `pages` has a byte per page.
    let status = unsafe { libc::mincore(ptr.as_ptr().cast(), bytes, pages.as_mut_ptr()) };
    assert_eq!(status, 0, "mincore: {}", std::io::Error::last_os_error());
    pages.iter().all(|&p| p & 1 == 1)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn private_file_mappings_are_told_from_the_others() {
        let line = |perms: &str, inode: &str, path: &str| {
            format!("7f00a000-7f00c000 {perms} 00000000 fd:01 {inode} {path}")
        };
        let file = private_file_mapping(&line("r--p", "1234", "/data/model.bin"));
        assert_eq!(file, Some((0x7f00_a000, 0x7f00_c000)));
        assert_eq!(
            private_file_mapping(&line("rw-s", "1234", "/data/model.bin")),
            None
        );
        assert_eq!(private_file_mapping(&line("rw-p", "0", "")), None);
        assert_eq!(private_file_mapping(&line("rw-p", "0", "[heap]")), None);
        assert_eq!(private_file_mapping("garbage"), None);
    }

    /// A file mapped privately is found, and ordinary heap memory is not.
    #[test]
    #[cfg_attr(miri, ignore = "maps a file, which Miri cannot")]
    fn a_private_file_mapping_of_this_process_is_found() {
        let path = std::env::temp_dir().join(format!("cow-{}.bin", std::process::id()));
        std::fs::write(&path, vec![7u8; 64 << 10]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh private read-only mapping of the whole file, unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                64 << 10,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        assert!(in_private_file_mapping(map as usize + 100, 10));
        let heap = vec![0u8; 1 << 20];
        assert!(!in_private_file_mapping(heap.as_ptr() as usize, heap.len()));
        // SAFETY: mapped above, unused afterwards.
        unsafe { libc::munmap(map, 64 << 10) };
        let _ = std::fs::remove_file(path);
    }

    thread_local! {
        /// Makes `spawn` fail on this thread, as under `RLIMIT_NPROC`.
        static REFUSE_SPAWN: Cell<bool> = const { Cell::new(false) };
    }

    pub(super) fn spawn_refused() -> bool {
        REFUSE_SPAWN.get()
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not model mmap'ed pages or mincore")]
    fn prefault_without_threads_still_faults_every_page() {
        let bytes = 8 << 20;
        for refuse in [false, true] {
            REFUSE_SPAWN.set(refuse);
            let ptr = map(bytes, false).unwrap();
            // SAFETY: fresh mapping of `bytes` bytes, unmapped once below.
            unsafe {
                assert!(!resident(ptr, bytes), "fresh mapping already resident");
                prefault(ptr, bytes, 4);
                assert!(resident(ptr, bytes), "refuse={refuse}: pages missing");
                unmap(ptr, bytes);
            }
        }
        REFUSE_SPAWN.set(false);
    }

    #[test]
    fn prefault_shares_are_whole_huge_pages_and_cover_the_range() {
        let page = 4096;
        let unit = HUGE_PAGE / page;
        for pages in [1, 512, 1023, 1024, 2048, 4096, 4097, 9 * 512 + 3, 262_144] {
            for threads in [1, 2, 3, 8, 16, 100] {
                let shares = prefault_shares(pages, page, threads);
                let at = format!("{pages} pages, {threads} threads");
                assert!(!shares.is_empty() && shares.len() <= threads, "{at}");
                assert_eq!(shares[0].0, 0, "{at}");
                assert_eq!(shares.last().unwrap().1, pages, "{at}");
                assert!(shares.iter().all(|&(first, last)| first < last), "{at}");
                for pair in shares.windows(2) {
                    assert_eq!(pair[0].1, pair[1].0, "{at}");
                    assert_eq!(pair[0].1 % unit, 0, "{at}");
                }
            }
        }
        // Under 4 MiB, one share; 16 MiB, at most one thread per huge page.
        assert_eq!(prefault_shares(1023, page, 16).len(), 1);
        assert_eq!(prefault_shares(4096, page, 16).len(), 8);
    }

    #[test]
    fn node_lists_are_counted() {
        assert_eq!(parse_list("0"), (1, 1));
        assert_eq!(parse_list("0-1"), (2, 2));
        assert_eq!(parse_list("0-3,8,10-11"), (7, 12));
        assert_eq!(parse_list(""), (0, 0));
        assert_eq!(parse_list("x,3-1"), (0, 0));
        assert!(online_numa_nodes() >= 1);
        assert!(numa_node_bound() >= online_numa_nodes());
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot make system calls such as mbind")]
    fn placing_pages_on_a_node_the_machine_lacks_is_an_error() {
        let bytes = 4 * page_size();
        let ptr = map(bytes, false).unwrap();
        // SAFETY: fresh mapping of `bytes` bytes, unmapped once below.
        unsafe {
            // Node 0 exists on every Linux machine with NUMA support (ENOSYS without).
            match prefer_node(ptr, bytes, 0) {
                Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOSYS) => {
                    unmap(ptr, bytes);
                    return;
                }
                other => other.unwrap(),
            }
            let error = prefer_node(ptr, bytes, 4000).unwrap_err();
            assert!(matches!(error, Error::Os { call: "mbind", .. }), "{error}");
            // Refused before a mask of half a gigabyte is made for it.
            let error = prefer_node(ptr, bytes, u32::MAX).unwrap_err();
            let Error::Os {
                call: "mbind",
                source,
            } = &error
            else {
                panic!("{error}")
            };
            assert_eq!(source.raw_os_error(), Some(libc::EINVAL), "{error}");
            prefault(ptr, bytes, 1);
            unmap(ptr, bytes);
        }
    }

    #[test]
    fn rounds_up_and_detects_overflow() {
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(usize::MAX, 4096), None);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri's mappings are not trimmed to huge-page alignment"
    )]
    fn huge_mappings_are_aligned_and_usable() {
        let bytes = 3 * HUGE_PAGE;
        let ptr = map(bytes, true).unwrap();
        assert_eq!(ptr.as_ptr() as usize % HUGE_PAGE, 0);
        // SAFETY: fresh mapping of `bytes` bytes, unmapped once below.
        unsafe {
            prefault(ptr, bytes, 4);
            std::ptr::write_bytes(ptr.as_ptr(), 7, bytes);
            assert_eq!(*ptr.as_ptr().add(bytes - 1), 7);
            unmap(ptr, bytes);
        }
    }
}
