//! The NVTX layer against an NVTX tool of the test's own (the `nvtx` feature): a C library,
//! built here, loaded through `NVTX_INJECTION64_PATH` as Nsight Systems' is, that writes down
//! the ranges and marks it is given. A test binary of its own: the tool is looked for once per
//! process.
#![cfg(feature = "nvtx")]

use std::path::Path;
use std::process::Command;

use cuda_pinned::PinnedVec;
use cuda_pinned::nvtx::NvtxLayer;
use tracing_subscriber::layer::SubscriberExt;

/// An NVTX tool: installs `nvtxMarkA`, `nvtxRangePushA` and `nvtxRangePop` through NVTX's
/// injection protocol, and writes each call to the file `NVTX_TEST_LOG` names.
const TOOL: &str = r#"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef void (*fp)(void);
typedef const void *(*get_export_table)(uint32_t);
typedef struct { size_t size; int (*module_table)(int, fp ***, unsigned *); } callbacks;
typedef struct { size_t size; uint32_t version; uint32_t reserved; void (*set)(uint32_t); } version_info;
static FILE *out;
static int push(const char *m) { fprintf(out, "push %s\n", m); fflush(out); return 0; }
static int pop(void) { fprintf(out, "pop\n"); fflush(out); return 0; }
static void mark(const char *m) { fprintf(out, "mark %s\n", m); fflush(out); }
int InitializeInjectionNvtx2(get_export_table get) {
    const callbacks *cb = get(1);
    const version_info *vi = get(3);
    fp **table = 0;
    unsigned size = 0;
    if (!cb || cb->size < sizeof(callbacks) || !vi || get(2) != 0) return 0;
    if (!cb->module_table(1, &table, &size) || size != 16 || table[0] || table[16]) return 0;
    if (cb->module_table(7, &table, &size)) return 0;
    out = fopen(getenv("NVTX_TEST_LOG"), "w");
    if (!out) return 0;
    *table[2] = (fp)mark;
    *table[9] = (fp)push;
    *table[11] = (fp)pop;
    vi->set(3);
    fprintf(out, "attached, version %u\n", vi->version);
    return 1;
}
"#;

fn build_tool(dir: &Path) -> std::path::PathBuf {
    let source = dir.join("tool.c");
    std::fs::write(&source, TOOL).unwrap();
    let library = dir.join("libtool.so");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("a C compiler (cc) to build the test's NVTX tool");
    assert!(status.success(), "the NVTX tool did not build");
    library
}

#[test]
fn spans_become_ranges_and_events_marks_in_the_tool() {
    let dir = tempfile::tempdir().unwrap();
    let library = build_tool(dir.path());
    let log = dir.path().join("calls.log");
    // SAFETY: this binary's only test, on its only thread: nothing reads the environment
    // concurrently.
    unsafe {
        std::env::set_var("NVTX_INJECTION64_PATH", &library);
        std::env::set_var("NVTX_TEST_LOG", &log);
    }
    let subscriber = tracing_subscriber::registry().with(NvtxLayer::new());
    tracing::subscriber::with_default(subscriber, || {
        let outer = tracing::info_span!("outer", step = 3);
        let _outer = outer.enter();
        tracing::info!("hello");
        tracing::debug_span!("inner", what = %"a\0b").in_scope(|| {});
        drop(_outer);
        // The crate's own spans: pinning memory (locked memory without CUDA).
        drop(PinnedVec::<u8>::with_capacity(1 << 16).unwrap());
    });
    let calls = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(
        lines[..6],
        [
            "attached, version 3",
            "push outer step=3",
            "mark hello",
            "push inner what=ab",
            "pop",
            "pop",
        ],
        "{calls}"
    );
    assert!(
        lines[6..]
            .iter()
            .any(|line| line.starts_with("push pin kind=")),
        "no range for pinning: {calls}"
    );
    let pushes = lines.iter().filter(|l| l.starts_with("push")).count();
    let pops = lines.iter().filter(|l| **l == "pop").count();
    assert_eq!(pushes, pops, "{calls}");
}
