//! Checkpoints shaped like what users load, beside the large and the small one: 20,000 tiny
//! tensors, a decoder's layers, and a sharded checkpoint. Each warm against page-locked H2D
//! and the peers, and cold against the disk's ceiling and the peers as they come.

use super::peers::{Peer, peer};
use super::write::{Written, write_checkpoint, write_model, write_shards};
use super::*;

/// The reference row of the shapes: as many bytes as the checkpoint (at most 1 GiB) copied
/// from page-locked memory.
const H2D_ROW: &str = "page-locked H2D, the checkpoint's bytes up to 1 GiB (reference)";

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
    let written = |what: std::io::Result<Written>| {
        what.map_err(|e| format!("writing a checkpoint: {}", cuda_pinned::ErrorChain(&e)))
    };
    let cases = [
        (
            "tiny: 20000 × 4 KiB".to_owned(),
            written(write_checkpoint(
                dir,
                "pinned-bench-tiny.safetensors",
                20_000,
                4 << 10,
            ))?,
        ),
        (
            if quick {
                "model-shaped: an 8-layer decoder, 0.3 B parameters".to_owned()
            } else {
                "model-shaped: a 22-layer decoder, 1.1 B parameters".to_owned()
            },
            written(write_model(dir, "pinned-bench-model.safetensors", quick))?,
        ),
        (
            format!(
                "sharded: {shard_count} × {} in 16 files",
                crate::report::size_label(shard_each as u64)
            ),
            written(write_shards(
                dir,
                "pinned-bench-sharded",
                16,
                shard_count,
                shard_each,
            ))?,
        ),
    ];
    for (case, written) in &cases {
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
        peer_rows(
            section,
            &Peer::WARM,
            "warm",
            case,
            written,
            reps,
            h2d_rate,
            None,
        );
        if may_drop {
            let file_len: usize = (written.files.iter())
                .map(|file| std::fs::metadata(file).map_or(0, |m| m.len() as usize))
                .sum();
            let cold_reps = if quick { 1 } else { 3 };
            let mut ceiling_run = as_run(|| {
                (written.files.iter()).try_for_each(|file| {
                    let len = std::fs::metadata(file).map_or(0, |m| m.len() as usize);
                    direct_ceiling(file, len)
                })
            });
            let mut cold_run = as_run(|| ours(path, reader));
            let [ceiling, cold]: [Vec<f64>; 2] = taking_turns(
                cold_reps,
                || {
                    drop_caches();
                },
                &mut [&mut ceiling_run, &mut cold_run],
            )?
            .try_into()
            .expect("a series for each run");
            let ceiling_rate =
                Spread::of(ceiling.iter().map(|&s| gbps(file_len, s)).collect()).median;
            let ceiling_name = "disk ceiling: 16 threads of 8 MiB O_DIRECT reads, cold (reference)";
            row(section, ceiling_name, case, file_len, ceiling, 0.0);
            row(
                section,
                "pinned-io, cold",
                case,
                written.bytes,
                cold,
                ceiling_rate,
            );
            peer_rows(
                section,
                &Peer::COLD,
                "cold",
                case,
                written,
                1,
                ceiling_rate,
                Some(()),
            );
        }
    }
    Ok(())
}

/// A row for each of `peers` loading `written` (`reps` timed loads after one untimed one
/// where warm; one load after the page cache is dropped where `cold`), or a note of why not.
#[allow(clippy::too_many_arguments)]
pub(super) fn peer_rows(
    section: &mut Section,
    peers: &[Peer],
    state: &str,
    case: &str,
    written: &Written,
    reps: usize,
    reference: f64,
    cold: Option<()>,
) {
    for &which in peers {
        if cold.is_some() {
            drop_caches();
        }
        let untimed = usize::from(cold.is_none());
        let name = which.row(state);
        match peer(which, &written.files, untimed, reps) {
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
