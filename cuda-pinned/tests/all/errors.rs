//! Errors the world can cause come back as values with clear messages.

use std::alloc::Layout;

use cuda_pinned::{
    CudaHost, DefaultPinned, Error, HostLocked, MemoryKind, PinnedAllocator, PinnedVec, Registered,
};

#[test]
fn cuda_kinds_without_cuda_say_so() {
    if cuda_pinned::is_available() {
        return; // covered by the GPU tests
    }
    let layout = Layout::from_size_align(4096, 8).unwrap();
    for result in [
        CudaHost::new().allocate(layout),
        Registered::new().allocate(layout),
    ] {
        match result {
            Err(Error::Unavailable(load)) => assert!(load.to_string().contains("libcudart")),
            Err(Error::Cuda(_)) => {} // a runtime without a device
            other => panic!("expected an error without CUDA, got {other:?}"),
        }
    }
    // The default falls back to mlock-ed memory and says so.
    assert_eq!(DefaultPinned::kind(), MemoryKind::HostLocked);
    let v = PinnedVec::from_slice(&[1u8, 2, 3]).unwrap();
    assert_eq!(v.memory_kind(), Some(MemoryKind::HostLocked));
    assert!(matches!(v.device_ptr(), Err(Error::Unsupported(_))));
}

const REGISTER_CHILD: &str = "CUDA_PINNED_REGISTER_CHILD";

/// Runs in a child process (see below): asks for a 2 GiB registration, then reports the
/// process's peak resident memory.
#[test]
fn register_child_side() {
    if std::env::var_os(REGISTER_CHILD).is_none() {
        return;
    }
    let layout = Layout::from_size_align(2 << 30, 4096).unwrap();
    let result = Registered::new().allocate(layout);
    assert!(
        matches!(result, Err(Error::Unavailable(_) | Error::Cuda(_))),
        "{result:?}"
    );
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let peak = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    println!("peak {peak}");
}

/// Without CUDA a registration fails before the memory is mapped and faulted in.
#[test]
#[cfg_attr(miri, ignore = "starts a child process, which Miri cannot")]
fn registering_without_cuda_touches_no_memory_first() {
    if cuda_pinned::is_available() {
        return; // covered by the GPU tests
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "errors::register_child_side", "--nocapture"])
        .env(REGISTER_CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{stdout}"
    );
    let kib: usize = stdout
        .split("VmHWM:")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no peak in {stdout}"));
    assert!(kib < 256 << 10, "{kib} KiB resident at the peak");
}

#[test]
fn alignment_above_a_page_is_refused() {
    let layout = Layout::from_size_align(64, 1 << 16).unwrap();
    assert!(matches!(
        HostLocked.allocate(layout),
        Err(Error::Unsupported(_))
    ));
}

const CHILD: &str = "CUDA_PINNED_MEMLOCK_CHILD";

/// Runs in a child process (see below): lowers RLIMIT_MEMLOCK, drops the privilege that
/// ignores it, and asks for more than the limit.
#[test]
fn memlock_child_side() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let limit = 64 * 1024;
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: plain system calls on this (child) process; the parent checks the outcome.
    unsafe {
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlimit), 0);
        if libc::geteuid() == 0 {
            // Root's CAP_IPC_LOCK ignores the limit; an unprivileged user does not.
            assert_eq!(libc::setuid(65534), 0);
        }
    }
    let error = PinnedVec::<u8, _>::with_capacity_in(1 << 20, HostLocked).unwrap_err();
    let text = error.to_string();
    assert!(
        matches!(
            error,
            Error::MemlockLimit {
                requested: 1048576,
                limit: Some(65536)
            }
        ),
        "{error:?}"
    );
    assert!(
        text.contains("RLIMIT_MEMLOCK is 65536 bytes") && text.contains("ulimit -l"),
        "{text}"
    );
    // Within the limit it still works.
    assert!(PinnedVec::<u8, _>::with_capacity_in(4096, HostLocked).is_ok());
}

#[test]
#[cfg_attr(miri, ignore = "starts a child process, which Miri cannot")]
fn memlock_limit_gives_the_clear_error() {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "errors::memlock_child_side",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("1 passed"), "child ran no test:\n{stdout}");
}

#[test]
fn the_per_thread_stream_cannot_be_adopted() {
    // `cudaStreamPerThread`: a different stream on every thread.
    let per_thread = 2 as cuda_pinned::sys::cudaStream_t;
    // SAFETY: adoption is refused before the handle is used.
    let adopted = unsafe { cuda_pinned::Stream::from_raw(per_thread) };
    match adopted {
        Err(error @ Error::Unsupported(_)) => {
            assert!(error.to_string().contains("per-thread"), "{error}")
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn the_legacy_default_stream_cannot_be_adopted() {
    for raw in [0usize, 1] {
        // SAFETY: adoption is refused before the handle is used.
        let adopted =
            unsafe { cuda_pinned::Stream::from_raw(raw as cuda_pinned::sys::cudaStream_t) };
        assert!(
            matches!(adopted, Err(Error::Unsupported(_))),
            "handle {raw}"
        );
    }
}

#[test]
fn a_device_mismatch_names_both_devices() {
    let error = Error::DeviceMismatch {
        what: "the stream",
        expected: 1,
        found: 0,
    };
    assert_eq!(
        error.to_string(),
        "the stream belongs to device 0, but this needs one of device 1"
    );
}

#[test]
fn streams_events_and_device_memory_without_cuda_say_so() {
    // With a runtime but no driver or device, CUDA's own error comes back instead.
    if cuda_pinned::runtime_path().is_ok() {
        return;
    }
    let unavailable = |result: cuda_pinned::Result<()>| {
        assert!(matches!(result, Err(Error::Unavailable(_))), "{result:?}");
    };
    unavailable(cuda_pinned::Stream::new().map(drop));
    unavailable(cuda_pinned::Event::new().map(drop));
    unavailable(cuda_pinned::DeviceBuffer::<u8>::zeroed(16).map(drop));
    unavailable(cuda_pinned::Stager::new().map(drop));
}

/// A private (copy-on-write) mapping of a file of `bytes` bytes; unmapped on drop.
struct FileMapping {
    ptr: *mut u8,
    bytes: usize,
    path: std::path::PathBuf,
}

impl FileMapping {
    fn new(bytes: usize, writable: bool) -> Self {
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!(
            "cuda-pinned-cow-{}-{bytes}-{writable}.bin",
            std::process::id()
        ));
        std::fs::write(&path, vec![3u8; bytes]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh private mapping of the whole file, unmapped in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                prot,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Self {
            ptr: ptr.cast(),
            bytes,
            path,
        }
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new`; nothing borrows it any more.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Memory of a private file mapping, which CUDA cannot pin (a registration of 94 MB of one
/// never returned), is refused with a clear error before the driver is asked: with CUDA or
/// without, read-only or not.
#[test]
#[cfg_attr(miri, ignore = "maps a file, which Miri cannot")]
fn a_copy_on_write_file_mapping_is_refused_before_the_driver_is_asked() {
    let bytes = 96 << 20;
    let mapping = FileMapping::new(bytes, true);
    // SAFETY: the mapping is readable and writable for `bytes` and outlives the slice.
    let slice = unsafe { std::slice::from_raw_parts_mut(mapping.ptr, bytes) };
    let refused = cuda_pinned::Registration::new(slice).map(drop);
    assert!(
        matches!(refused, Err(Error::Unsupported(why)) if why.contains("copy-on-write")),
        "{refused:?}"
    );
    let mapping = FileMapping::new(1 << 20, false);
    // SAFETY: the mapping is readable for its length and outlives the slice.
    let slice = unsafe { std::slice::from_raw_parts(mapping.ptr, 1 << 20) };
    let refused = cuda_pinned::ReadOnlyRegistration::new(slice).map(drop);
    assert!(matches!(refused, Err(Error::Unsupported(_))), "{refused:?}");
}
