//! Maintainer tasks. `bindgen` regenerates `cuda-pinned-sys/src/bindings.rs` (the runtime API)
//! and `cuda-pinned-sys/src/driver_bindings.rs` (the few driver calls reached through the
//! runtime's entry-point query) from the CUDA headers; `scripts/regen-bindings` is the
//! documented way to run it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runtime API functions bound. Keep sorted; add here, then regenerate.
const FUNCTIONS: &[&str] = &[
    "cudaDeviceCanAccessPeer",
    "cudaDeviceEnablePeerAccess",
    "cudaDeviceGetAttribute",
    "cudaDeviceGetPCIBusId",
    "cudaDeviceSynchronize",
    "cudaDriverGetVersion",
    "cudaEventCreateWithFlags",
    "cudaEventDestroy",
    "cudaEventElapsedTime",
    "cudaEventQuery",
    "cudaEventRecord",
    "cudaEventSynchronize",
    "cudaFree",
    "cudaFreeHost",
    "cudaGetDevice",
    "cudaGetDriverEntryPointByVersion",
    "cudaGetDeviceCount",
    "cudaGetDeviceProperties",
    "cudaGetErrorName",
    "cudaGetErrorString",
    "cudaGetLastError",
    "cudaHostAlloc",
    "cudaHostGetDevicePointer",
    "cudaHostGetFlags",
    "cudaHostRegister",
    "cudaHostUnregister",
    "cudaLaunchHostFunc",
    "cudaMalloc",
    "cudaMallocHost",
    "cudaMemcpy",
    "cudaMemcpy2DAsync",
    "cudaMemcpyAsync",
    "cudaMemcpyBatchAsync",
    "cudaMemcpyPeerAsync",
    "cudaMemset",
    "cudaMemsetAsync",
    "cudaPeekAtLastError",
    "cudaPointerGetAttributes",
    "cudaRuntimeGetVersion",
    "cudaSetDevice",
    "cudaStreamCreateWithFlags",
    "cudaStreamDestroy",
    "cudaStreamGetDevice",
    "cudaStreamIsCapturing",
    "cudaStreamQuery",
    "cudaStreamSynchronize",
    "cudaStreamWaitEvent",
    "cudaThreadExchangeStreamCaptureMode",
];

/// `#define`d constants bound: the flag words and the header's version.
const CONSTANTS: &str = "CUDART_VERSION|cudaHostAlloc[A-Za-z]+|cudaHostRegister[A-Za-z]+|\
cudaStream(Default|NonBlocking)|cudaEvent(Default|BlockingSync|DisableTiming|Interprocess)";

/// Driver API functions bound (the current context, and the virtual-memory calls for host
/// memory). Keep sorted.
const DRIVER_FUNCTIONS: &[&str] = &[
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuEventQuery",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemAddressFree",
    "cuMemAddressReserve",
    "cuMemCreate",
    "cuMemGetAllocationGranularity",
    "cuMemMap",
    "cuMemRelease",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuPointerGetAttributes",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
];

/// Driver enums bound besides those the functions use (a device attribute is asked through
/// the runtime, whose enum lacks the newest values).
const DRIVER_TYPES: &str = "CUdevice_attribute(_enum)?";

const OUTPUT: &str = "cuda-pinned-sys/src/bindings.rs";
const DRIVER_OUTPUT: &str = "cuda-pinned-sys/src/driver_bindings.rs";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let usage = "usage: xtask bindgen --include DIR [--check]";
    let mut include = None;
    let mut check = false;
    let mut rest = args.iter();
    match rest.next().map(String::as_str) {
        Some("bindgen") => {}
        _ => return Err(usage.into()),
    }
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--include" => include = rest.next().map(PathBuf::from),
            "--check" => check = true,
            _ => return Err(format!("unknown argument {arg:?}\n{usage}")),
        }
    }
    let include = include.ok_or(usage)?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (file, generated) in [
        (OUTPUT, generate_runtime(&include)?),
        (DRIVER_OUTPUT, generate_driver(&include)?),
    ] {
        let output = root.join(file);
        if check {
            let committed = std::fs::read_to_string(&output)
                .map_err(|e| format!("cannot read {}: {e}", output.display()))?;
            if committed != generated {
                return Err(format!(
                    "{file} differs from what the headers in {} generate; run scripts/regen-bindings",
                    include.display()
                ));
            }
            println!("{file} is up to date");
        } else {
            std::fs::write(&output, generated)
                .map_err(|e| format!("cannot write {}: {e}", output.display()))?;
            println!("wrote {file}");
        }
    }
    Ok(())
}

/// bindgen as both files use it: open newtype enums, `Default`, layout tests, formatted.
fn builder(include: &Path, header: &str) -> Result<bindgen::Builder, String> {
    Ok(bindgen::Builder::default()
        .header_contents("wrapper.h", &format!("#include <{header}>\n"))
        .clang_arg(format!("-I{}", include.display()))
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_default(true)
        .layout_tests(true)
        .generate_comments(false)
        .merge_extern_blocks(true)
        .use_core()
        .rust_target(bindgen::RustTarget::stable(85, 0).map_err(|e| e.to_string())?)
        .rust_edition(bindgen::RustEdition::Edition2024)
        .formatter(bindgen::Formatter::Prettyplease))
}

fn generate_runtime(include: &Path) -> Result<String, String> {
    let api_header = include.join("cuda_runtime_api.h");
    let header_text = std::fs::read_to_string(&api_header)
        .map_err(|e| format!("cannot read {}: {e}", api_header.display()))?;
    let aliases = versioned_aliases(&header_text);

    let mut builder = builder(include, "cuda_runtime_api.h")?.allowlist_var(CONSTANTS);
    for function in FUNCTIONS {
        // A header may `#define` a name to a versioned symbol (`cudaX` -> `cudaX_v2`); the
        // preprocessor then hands bindgen the versioned declaration.
        builder = builder.allowlist_function(format!("{function}(_v[0-9]+)?"));
    }
    let bindings = builder
        .generate()
        .map_err(|e| format!("bindgen failed: {e}"))?
        .to_string();
    post_process(&bindings, &aliases)
}

fn generate_driver(include: &Path) -> Result<String, String> {
    let mut builder = builder(include, "cuda.h")?.allowlist_type(DRIVER_TYPES);
    for function in DRIVER_FUNCTIONS {
        builder = builder.allowlist_function(function);
    }
    let bindings = builder
        .generate()
        .map_err(|e| format!("bindgen failed: {e}"))?
        .to_string();
    const EXTERN: &str = "unsafe extern \"C\" {";
    if bindings.matches(EXTERN).count() != 1 {
        return Err("expected bindgen to emit exactly one extern block for the driver".into());
    }
    // The entry-point query takes a function's base name (`cuMemcpyHtoDAsync`, which the
    // header defines as `cuMemcpyHtoDAsync_v2`); the ABI version picks the variant.
    let mut bindings = bindings;
    for function in DRIVER_FUNCTIONS {
        let base = match function.rsplit_once("_v") {
            Some((base, version)) if version.parse::<u32>().is_ok() => base,
            _ => function,
        };
        bindings = bindings.replace(&format!("pub fn {function}("), &format!("pub fn {base}("));
        if !bindings.contains(&format!("pub fn {base}(")) {
            return Err(format!("bindgen emitted no declaration for {function}"));
        }
    }
    Ok(format!(
        "// Generated by scripts/regen-bindings from the CUDA driver header; do not edit.\n\
         // Functions are resolved at run time through the runtime's driver entry-point query\n\
         // by the `driver_api!` macro (src/driver.rs).\n\n{}",
        bindings.replacen(EXTERN, "driver_api! {", 1)
    ))
}

/// `(name, versioned symbol)` for every `#define cudaX cudaX_vN` in the header.
fn versioned_aliases(header: &str) -> Vec<(String, String)> {
    header
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "#define").then_some(())?;
            let (name, target) = (words.next()?, words.next()?);
            let suffix = target.strip_prefix(name)?.strip_prefix("_v")?;
            (!suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()))
                .then(|| (name.to_owned(), target.to_owned()))
        })
        .collect()
}

/// Turns bindgen's one `extern "C"` block into an invocation of the sys crate's
/// `cudart_api!` macro, which resolves each function lazily from the loaded library, and
/// gives versioned symbols back their plain names with a `link_name`.
fn post_process(bindings: &str, aliases: &[(String, String)]) -> Result<String, String> {
    const EXTERN: &str = "unsafe extern \"C\" {";
    if bindings.matches(EXTERN).count() != 1 {
        return Err("expected bindgen to emit exactly one extern block".into());
    }
    let mut text = bindings.replacen(EXTERN, "cudart_api! {", 1);
    for (name, target) in aliases {
        text = text.replace(
            &format!("pub fn {target}("),
            &format!("#[link_name = \"{target}\"]\n    pub fn {name}("),
        );
    }
    Ok(format!(
        "// Generated by scripts/regen-bindings from the CUDA runtime headers; do not edit.\n\
         // Functions are resolved at run time by the `cudart_api!` macro (src/api.rs).\n\n{text}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_versioned_aliases_and_renames_them() {
        let header = "#define cudaGetDeviceProperties cudaGetDeviceProperties_v2\n\
                      #define cudaMemcpy __CUDART_API_PTDS(cudaMemcpy)\n#define cudaFoo cudaFoo_vx\n";
        let aliases = versioned_aliases(header);
        assert_eq!(
            aliases,
            [(
                "cudaGetDeviceProperties".to_owned(),
                "cudaGetDeviceProperties_v2".to_owned()
            )]
        );
        let out = post_process(
            "unsafe extern \"C\" {\n    pub fn cudaGetDeviceProperties_v2(p: *mut u8) -> i32;\n}\n",
            &aliases,
        )
        .unwrap();
        assert!(out.contains("cudart_api! {"));
        assert!(out.contains(
            "#[link_name = \"cudaGetDeviceProperties_v2\"]\n    pub fn cudaGetDeviceProperties("
        ));
    }
}
