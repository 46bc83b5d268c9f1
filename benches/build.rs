//! Records the commit the tool is built from: `git rev-parse --short=7 HEAD`, with `-dirty`
//! when `git status --porcelain` lists changes, or `unknown` without git.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    let commit = match git(&["rev-parse", "--short=7", "HEAD"]) {
        Some(hash) if !hash.is_empty() => {
            let dirty = git(&["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
            format!("{hash}{}", if dirty { "-dirty" } else { "" })
        }
        _ => "unknown".to_owned(),
    };
    println!("cargo:rustc-env=PINNED_BENCH_COMMIT={commit}");
    // Run again when HEAD moves, the branch it names moves, or the index changes.
    for name in ["HEAD", "index"] {
        if let Some(path) = git(&["rev-parse", "--git-path", name]) {
            rerun_if_changed(&path);
        }
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(path) = git(&["rev-parse", "--git-path", &branch])
    {
        rerun_if_changed(&path);
    }
    println!("cargo:rerun-if-changed=build.rs");
}

fn rerun_if_changed(path: &str) {
    let path = Path::new(path);
    let path = if path.is_relative() {
        Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join(path)
    } else {
        path.to_owned()
    };
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
