//! Host-only bandwidth for machines without CUDA: `memcpy` from a pageable `Vec` into
//! page-locked (`mlock`ed) memory, the first half of every staged copy.

use std::time::Instant;

use cuda_pinned::{HostLocked, PinnedVec};

use crate::progress::Progress;
use crate::report::{Section, Value, size_label};
use crate::stats::gbps;

const SIZES: [usize; 4] = [1 << 20, 16 << 20, 64 << 20, 256 << 20];

/// Work items, for the progress bar.
pub fn steps() -> usize {
    SIZES.len()
}

/// Runs the section.
pub fn run(quick: bool, progress: &mut Progress) -> Section {
    let mut section = Section::new(
        "memcpy",
        "Host memcpy, pageable Vec -> mlock-ed PinnedVec (one thread, median)",
        &["size", "GB/s"],
    );
    for bytes in SIZES {
        progress.step(&format!("memcpy {}", size_label(bytes as u64)));
        let source = vec![0x42u8; bytes];
        let mut target = match PinnedVec::<u8, _>::zeroed_in(bytes, HostLocked) {
            Ok(target) => target,
            Err(e) => {
                section.notes.push(format!(
                    "{}: {e}",
                    size_label(bytes as u64),
                    e = cuda_pinned::ErrorChain(&e)
                ));
                continue;
            }
        };
        let reps = if quick { 3 } else { 9 };
        let mut rates: Vec<f64> = (0..reps)
            .map(|_| {
                let start = Instant::now();
                target.copy_from_slice(std::hint::black_box(&source));
                gbps(bytes, start.elapsed().as_secs_f64())
            })
            .collect();
        rates.sort_by(f64::total_cmp);
        section.row(vec![
            Value::Text(size_label(bytes as u64)),
            Value::Num(rates[rates.len() / 2], 2),
        ]);
    }
    section
}
