//! `devices`: every GPU's H2D bandwidth alone, then all of them at once (does one GPU's copy
//! slow another's, and what do they reach together?), and, on machines with several NUMA
//! nodes, each GPU from memory on every node.

use std::sync::Barrier;
use std::time::Instant;

use cuda_pinned::{Device, DeviceBuffer, Event, PinnedVec, Registered, Result, Stream};

use crate::host;
use crate::progress::Progress;
use crate::report::{Section, Value, size_label};
use crate::stats::{self, Spread};

fn bytes(quick: bool) -> usize {
    if quick { 64 << 20 } else { 256 << 20 }
}

fn reps(quick: bool) -> usize {
    if quick { 5 } else { 15 }
}

/// Work items, for the progress bar: each device alone, all together, each node.
pub fn steps(devices: usize, nodes: usize) -> usize {
    devices + 1 + if nodes > 1 { devices * nodes } else { 0 }
}

/// `reps` timed H2D copies of `bytes` on `device` from pinned memory of `memory`, after one
/// untimed copy; every thread given the same `start` begins its timed copies together (and
/// waits there even when its setup failed, so that none waits forever). Runs on the calling
/// thread with `device` current (the memory then lands on its node unless `memory` names
/// another). GB/s of each copy, and the seconds from `start` to the last.
fn h2d(
    device: Device,
    memory: Registered,
    bytes: usize,
    reps: usize,
    start: &Barrier,
) -> Result<(Vec<f64>, f64)> {
    let setup = (|| -> Result<_> {
        device.set_current()?;
        let stream = Stream::on(device)?;
        let mut source = PinnedVec::with_capacity_in(bytes, memory)?;
        source.resize(bytes, 7);
        let mut target = DeviceBuffer::<u8>::zeroed_on(device, bytes)?;
        source = stream.copy_to_device(source, &mut target)?.wait()?;
        let events = (Event::on(device)?, Event::on(device)?);
        Ok((stream, source, target, events))
    })();
    start.wait();
    let (stream, mut source, mut target, (mut begin, mut end)) = setup?;
    let started = Instant::now();
    let mut gbps = Vec::with_capacity(reps);
    for _ in 0..reps {
        begin.record(&stream)?;
        let upload = stream.copy_to_device(source, &mut target)?;
        end.record(&stream)?;
        source = upload.wait()?;
        // The copy's own event is done; `end`, recorded after it, may not be yet.
        end.synchronize()?;
        let ms = f64::from(end.elapsed_ms_since(&begin)?);
        gbps.push(stats::gbps(bytes, ms * 1e-3));
    }
    Ok((gbps, started.elapsed().as_secs_f64()))
}

/// One device's copies on a thread of its own (its current device is its own business).
fn alone(device: Device, memory: Registered, bytes: usize, reps: usize) -> Result<(Vec<f64>, f64)> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| h2d(device, memory, bytes, reps, &Barrier::new(1)))
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

pub fn run(quick: bool, progress: &mut Progress) -> Result<Section> {
    let (bytes, reps) = (bytes(quick), reps(quick));
    let devices = Device::all()?;
    let nodes = host::online_numa_nodes();
    let mut section = Section::new(
        "devices",
        &format!(
            "Each GPU alone and all at once: H2D copies of {} from page-locked memory (GB/s per \
             copy, {reps} copies)",
            size_label(bytes as u64)
        ),
        &[
            "device",
            "gpu node",
            "memory",
            "run",
            "min",
            "median",
            "max",
            "% of alone",
        ],
    );
    let alone = alone_rows(&devices, bytes, reps, &mut section, progress)?;
    together_rows(&devices, &alone, bytes, reps, &mut section, progress)?;
    if nodes.len() > 1 {
        node_rows(&devices, &nodes, bytes, reps, &mut section, progress);
    } else {
        section.notes.push(
            "One NUMA node here: memory on another node than the GPU's could not be measured."
                .into(),
        );
    }
    Ok(section)
}

/// The first cells of a device's row: which GPU, its node, where the memory was, which run.
fn head(device: Device, memory: String, run: &str) -> Vec<Value> {
    vec![
        Value::Int(device.ordinal() as u64),
        Value::Text(
            device
                .nearest_numa_node()
                .map_or("-".to_owned(), |n| n.to_string()),
        ),
        Value::Text(memory),
        Value::Text(run.into()),
    ]
}

/// What each device measured alone, for the "together" rows to compare against.
struct Alone {
    /// Per device, the median copy (device clock).
    medians: Vec<f64>,
    /// Per device, all its bytes over the whole run (host clock, gaps between copies
    /// included, as the aggregate is taken).
    host_rates: Vec<f64>,
}

/// Each device alone from memory on its own node, one row each; returns what the
/// "together" rows are compared with.
fn alone_rows(
    devices: &[Device],
    bytes: usize,
    reps: usize,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<Alone> {
    let mut alone_medians = Vec::new();
    let mut alone_host_rates = Vec::new();
    for &device in devices {
        progress.step(&format!("device {} alone", device.ordinal()));
        let (gbps, seconds) = alone(device, Registered::new(), bytes, reps)?;
        let spread = Spread::of(gbps);
        alone_medians.push(spread.median);
        alone_host_rates.push(stats::gbps(reps * bytes, seconds));
        let mut row = head(device, "its node".into(), "alone");
        row.extend(spread.cells(1));
        row.push(Value::Missing);
        section.row(row);
    }
    Ok(Alone {
        medians: alone_medians,
        host_rates: alone_host_rates,
    })
}

/// All devices at once, one row each and the aggregate row, with the notes on how the
/// aggregate is taken.
fn together_rows(
    devices: &[Device],
    alone: &Alone,
    bytes: usize,
    reps: usize,
    section: &mut Section,
    progress: &mut Progress,
) -> Result<()> {
    progress.step("all devices at once");
    let start = Barrier::new(devices.len());
    let together: Vec<Result<(Vec<f64>, f64)>> = std::thread::scope(|scope| {
        let threads: Vec<_> = devices
            .iter()
            .map(|&device| {
                let start = &start;
                scope.spawn(move || h2d(device, Registered::new(), bytes, reps, start))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut slowest = 0.0f64;
    for ((&device, result), alone) in devices.iter().zip(together).zip(&alone.medians) {
        let (gbps, seconds) = result?;
        slowest = slowest.max(seconds);
        let spread = Spread::of(gbps);
        let mut row = head(device, "its node".into(), "together");
        row.extend(spread.cells(1));
        row.push(Value::Num(100.0 * spread.median / alone, 1));
        section.row(row);
    }
    let aggregate = stats::gbps(devices.len() * reps * bytes, slowest);
    let sum_alone: f64 = alone.host_rates.iter().sum();
    section.row(vec![
        Value::Text("all".into()),
        Value::Missing,
        Value::Text("its node".into()),
        Value::Text("together, aggregate".into()),
        Value::Missing,
        Value::Num(aggregate, 1),
        Value::Missing,
        Value::Num(100.0 * aggregate / sum_alone, 1),
    ]);
    section.notes.push(
        "Each GPU's copies run on a thread of their own; the aggregate is all bytes over the \
         time from the common start to the last copy's end (host clock, the gaps between \
         copies included), against the sum of each GPU's rate alone taken the same way."
            .into(),
    );
    if devices.len() == 1 {
        section
            .notes
            .push("One GPU here: \"together\" is the same GPU run again.".into());
    }
    Ok(())
}

/// Each device alone from memory on every NUMA node in turn (only where there are several);
/// a node that fails gets a note and an empty row.
fn node_rows(
    devices: &[Device],
    nodes: &[u32],
    bytes: usize,
    reps: usize,
    section: &mut Section,
    progress: &mut Progress,
) {
    for &device in devices {
        for &node in nodes {
            progress.step(&format!("device {} from node {node}", device.ordinal()));
            let measured =
                alone(device, Registered::new().node(node), bytes, reps).map(|(gbps, _)| gbps);
            let mut row = head(device, format!("node {node}"), "alone");
            match measured {
                Ok(gbps) => row.extend(Spread::of(gbps).cells(1)),
                Err(e) => {
                    section.notes.push(format!(
                        "device {device:?} from node {node}: {e}",
                        e = cuda_pinned::ErrorChain(&e)
                    ));
                    row.extend([Value::Missing, Value::Missing, Value::Missing]);
                }
            }
            row.push(Value::Missing);
            section.row(row);
        }
    }
}
