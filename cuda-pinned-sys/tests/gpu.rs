//! Tests against a real CUDA device. CI has none, so they are ignored there; the GPU bundle
//! (`scripts/gpu-bundle`) runs them with `--include-ignored`.

use std::ffi::c_void;
use std::ptr;

use cuda_pinned_sys::*;

fn ok(status: cudaError, call: &str) {
    assert_eq!(status, cudaError::cudaSuccess, "{call} returned {status:?}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn libcudart_loads_and_reports_versions() {
    let rt = cudart().expect("libcudart loads");
    assert!(rt.path().exists(), "loaded from {}", rt.path().display());
    let (mut runtime, mut driver) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe {
        ok(
            rt.cudaRuntimeGetVersion().unwrap()(&mut runtime),
            "cudaRuntimeGetVersion",
        );
        ok(
            rt.cudaDriverGetVersion().unwrap()(&mut driver),
            "cudaDriverGetVersion",
        );
    }
    assert!(runtime >= 11000, "runtime {runtime}");
    assert!(
        driver >= runtime,
        "driver {driver} older than runtime {runtime}"
    );
}

/// Every bound driver function resolves through the runtime's entry-point query: callers fall
/// back to the runtime's calls where one does not, which would hide a wrong name.
#[test]
#[ignore = "needs a CUDA device"]
fn every_driver_function_resolves() {
    let driver = driver::driver().expect("the runtime loads");
    assert_eq!(driver.unresolved(), Vec::<&str>::new());
}

#[test]
#[ignore = "needs a CUDA device"]
fn at_least_one_device() {
    let rt = cudart().unwrap();
    let mut count = 0;
    // SAFETY: valid out-pointer.
    ok(
        unsafe { rt.cudaGetDeviceCount().unwrap()(&mut count) },
        "cudaGetDeviceCount",
    );
    assert!(count >= 1);
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_alloc_and_free() {
    let rt = cudart().unwrap();
    let mut host: *mut c_void = ptr::null_mut();
    let bytes = 1 << 20;
    // SAFETY: valid out-pointer; the flag is a documented cudaHostAlloc flag.
    ok(
        unsafe { rt.cudaHostAlloc().unwrap()(&mut host, bytes, cudaHostAllocPortable) },
        "cudaHostAlloc",
    );
    assert!(!host.is_null());
    // SAFETY: cudaHostAlloc returned `bytes` writable bytes.
    unsafe { ptr::write_bytes(host.cast::<u8>(), 0xAB, bytes) };
    let mut flags = 0;
    // SAFETY: `host` is a live page-locked allocation; valid out-pointer. The call fails for
    // memory the runtime did not pin.
    ok(
        unsafe { rt.cudaHostGetFlags().unwrap()(&mut flags, host) },
        "cudaHostGetFlags",
    );
    // SAFETY: `host` came from cudaHostAlloc and is not used again.
    ok(unsafe { rt.cudaFreeHost().unwrap()(host) }, "cudaFreeHost");
}

#[test]
#[ignore = "needs a CUDA device"]
fn round_trip_through_the_device() {
    let rt = cudart().unwrap();
    let bytes = 4 << 20;
    let (mut src, mut dst, mut dev): (*mut c_void, *mut c_void, *mut c_void) =
        (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    let mut stream: cudaStream_t = ptr::null_mut();
    // SAFETY: out-pointers are valid; each buffer is `bytes` long; the copies and the
    // synchronize use live objects; everything is freed once, after the stream is idle.
    unsafe {
        ok(
            rt.cudaHostAlloc().unwrap()(&mut src, bytes, cudaHostAllocDefault),
            "cudaHostAlloc",
        );
        ok(
            rt.cudaHostAlloc().unwrap()(&mut dst, bytes, cudaHostAllocDefault),
            "cudaHostAlloc",
        );
        ok(rt.cudaMalloc().unwrap()(&mut dev, bytes), "cudaMalloc");
        ok(
            rt.cudaStreamCreateWithFlags().unwrap()(&mut stream, cudaStreamNonBlocking),
            "stream",
        );
        let input = std::slice::from_raw_parts_mut(src.cast::<u8>(), bytes);
        for (i, byte) in input.iter_mut().enumerate() {
            *byte = (i * 7 % 251) as u8;
        }
        ptr::write_bytes(dst.cast::<u8>(), 0, bytes);
        let copy = rt.cudaMemcpyAsync().unwrap();
        ok(
            copy(
                dev,
                src,
                bytes,
                cudaMemcpyKind::cudaMemcpyHostToDevice,
                stream,
            ),
            "H2D",
        );
        ok(
            copy(
                dst,
                dev,
                bytes,
                cudaMemcpyKind::cudaMemcpyDeviceToHost,
                stream,
            ),
            "D2H",
        );
        ok(
            rt.cudaStreamSynchronize().unwrap()(stream),
            "cudaStreamSynchronize",
        );
        let output = std::slice::from_raw_parts(dst.cast::<u8>(), bytes);
        assert!(
            output == &*input,
            "data changed on the way through the device"
        );
        ok(rt.cudaStreamDestroy().unwrap()(stream), "cudaStreamDestroy");
        ok(rt.cudaFree().unwrap()(dev), "cudaFree");
        ok(rt.cudaFreeHost().unwrap()(src), "cudaFreeHost");
        ok(rt.cudaFreeHost().unwrap()(dst), "cudaFreeHost");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn pointer_attributes_of_pinned_memory() {
    let rt = cudart().unwrap();
    let mut host: *mut c_void = ptr::null_mut();
    let mut attributes = cudaPointerAttributes::default();
    // SAFETY: valid out-pointers; `host` is freed once.
    unsafe {
        ok(
            rt.cudaHostAlloc().unwrap()(&mut host, 4096, cudaHostAllocMapped),
            "cudaHostAlloc",
        );
        ok(
            rt.cudaPointerGetAttributes().unwrap()(&mut attributes, host),
            "attributes",
        );
        ok(rt.cudaFreeHost().unwrap()(host), "cudaFreeHost");
    }
    assert_eq!(attributes.type_, cudaMemoryType::cudaMemoryTypeHost);
    assert_eq!(attributes.hostPointer, host);
    assert!(!attributes.devicePointer.is_null());
}
