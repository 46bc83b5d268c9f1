//! Checkpoints shaped like what users load, beside the large and the small one: 20,000 tiny
//! tensors, a decoder's layers, and a sharded checkpoint. Each warm against page-locked H2D
//! and the peers, and cold against the disk's ceiling and the peers as they come.

use super::peers::{Peer, peer};
use super::write::{Written, model_label, write_checkpoint, write_model, write_shards};
use super::*;

use pinned_bench::goals::FILES_SHAPE_H2D_ROW as H2D_ROW;

/// Loads each shape warm and cold into `section`.
pub(super) fn shapes(
    quick: bool,
    dir: &Path,
    reader: &FileReader,
    may_drop: bool,
    section: &mut Section,
) -> Result<(), String> {
    let reps = if quick { 3 } else { 11 };
    let (shard_each, shard_count) = if quick {
        (10 << 20, 100)
    } else {
        (40 << 20, 205)
    };
    let checked = |what: std::io::Result<Written>| {
        what.map_err(|e| format!("writing a checkpoint: {}", cuda_pinned::ErrorChain(&e)))
    };
    let tiny = 4 << 10;
    // Written, loaded and removed in turn: the disk and the page cache hold one at a time.
    type Writer<'a> = Box<dyn Fn() -> std::io::Result<Written> + 'a>;
    let cases: [(String, Writer<'_>); 3] = [
        (
            format!("tiny: 20000 × {}", crate::report::size_label(tiny as u64)),
            Box::new(|| write_checkpoint(dir, "pinned-bench-tiny.safetensors", 20_000, tiny)),
        ),
        (
            model_label(quick),
            Box::new(|| write_model(dir, "pinned-bench-model.safetensors", quick)),
        ),
        (
            format!(
                "sharded: {shard_count} × {} in 16 files",
                crate::report::size_label(shard_each as u64)
            ),
            Box::new(|| write_shards(dir, "pinned-bench-sharded", 16, shard_count, shard_each)),
        ),
    ];
    for (case, write) in &cases {
        let written = &checked(write())?;
        let path = &written.path;
        for file in &written.files {
            warm_page_cache(file)?;
        }
        free_and_settle(ours(path, reader)?);
        let h2d_bytes = written.bytes.min(1 << 30);
        let mut pinned = PinnedVec::<u8>::with_capacity(h2d_bytes)
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        pinned.resize(h2d_bytes, 1);
        let mut device = DeviceBuffer::<u8>::zeroed(h2d_bytes)
            .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())?;
        let [h2d, warm]: [Vec<f64>; 2] = {
            let mut h2d = as_run(|| {
                device
                    .copy_from_host(&pinned)
                    .map_err(|e| cuda_pinned::ErrorChain(&e).to_string())
            });
            let mut warm = as_run(|| ours(path, reader));
            taking_turns(reps, || {}, &mut [&mut h2d, &mut warm])?
                .try_into()
                .expect("a series for each run")
        };
        free_and_settle((pinned, device));
        let h2d_rate = Spread::of(h2d.iter().map(|&s| gbps(h2d_bytes, s)).collect()).median;
        row(section, H2D_ROW, case, h2d_bytes, h2d, 0.0);
        row(
            section,
            "pinned-io, warm",
            case,
            written.bytes,
            warm,
            h2d_rate,
        );
        peer_rows(section, &Peer::WARM, case, written, reps, h2d_rate);
        if may_drop {
            let cold_reps = if quick { 1 } else { 3 };
            let (_, ceiling_rate) =
                cold_against_ceiling(section, case, written, reader, cold_reps)?;
            peer_rows(section, &Peer::COLD, case, written, 1, ceiling_rate);
        }
    }
    Ok(())
}

/// A row for each of `peers` loading `written`: `reps` timed loads after an untimed one for
/// the warm peers; one load after the page cache is dropped for the cold ones (a fresh
/// process, its library's start-up included). Or a note of why not.
pub(super) fn peer_rows(
    section: &mut Section,
    peers: &[Peer],
    case: &str,
    written: &Written,
    reps: usize,
    reference: f64,
) {
    for &which in peers {
        let cold = which.cold();
        if cold {
            drop_caches();
        }
        let name = which.row();
        match peer(which, &written.files, usize::from(!cold), reps) {
            Ok(seconds) => row(section, &name, case, written.bytes, seconds, reference),
            Err(why) => section.row(vec![
                Value::Text(name),
                Value::Text(case.into()),
                Value::Text(why),
                Value::Text(String::new()),
                Value::Text(String::new()),
                Value::Text(String::new()),
            ]),
        }
    }
}
