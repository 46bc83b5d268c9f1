//! The sweep behind the stager's defaults: other chunk sizes, thread counts and ring depths.

use super::*;

/// Where the defaults come from: 1 GiB each way with other chunk sizes, thread counts and
/// ring depths; and small copies on the calling thread alone against spread over the workers.
pub(super) fn sweep(section: &mut Section, progress: &mut Progress) -> Result<()> {
    progress.step("staged sweep");
    let stream = Stream::new()?;
    let bytes = 1 << 30;
    let source = vec![3u8; bytes];
    let mut sink = vec![4u8; bytes];
    let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
    sweep_configs(&stream, &source, &mut sink, &mut device, section)?;
    for bytes in [
        4 << 10,
        16 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
        512 << 10,
        1 << 20,
        2 << 20,
        4 << 20,
        8 << 20,
    ] {
        sweep_size(&stream, bytes, section)?;
    }
    Ok(())
}

/// The sweep's 1 GiB part: one note per ring configuration (chunk size, threads, ring depth,
/// smallest piece, store kind) that fits this machine's cores.
fn sweep_configs(
    stream: &Stream,
    source: &[u8],
    sink: &mut [u8],
    device: &mut DeviceBuffer<u8>,
    section: &mut Section,
) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(16, |n| n.get());
    // (chunk, threads, chunks in the ring, smallest piece, streaming stores)
    let configs = [
        (4 << 20, 8, 16, 1 << 20, true),
        (4 << 20, 12, 24, 1 << 20, true),
        (4 << 20, 12, 24, 1 << 20, false),
        (4 << 20, 16, 32, 1 << 20, true),
        (2 << 20, 12, 24, 1 << 20, true),
        (8 << 20, 12, 24, 1 << 20, true),
        (4 << 20, 12, 24, 512 << 10, true),
        (4 << 20, 12, 24, 512 << 10, false),
        // Smaller rings, nearer to staying in the last-level cache while the DMA reads them.
        (4 << 20, 12, 14, 1 << 20, true),
        (2 << 20, 12, 16, 1 << 20, true),
    ];
    for (chunk, threads, slots, min_piece, streaming_stores) in
        configs.into_iter().filter(|c| c.1 <= cores)
    {
        let config = StagingConfig {
            chunk_bytes: chunk,
            threads,
            chunks: slots,
            min_piece_bytes: min_piece,
            streaming_stores,
            ..StagingConfig::default()
        };
        let stager = Stager::with_config_in(config, DefaultPinned)?;
        let [up, down] = round_trips(&stager, stream, source, sink, device, 3)?;
        section.notes.push(format!(
            "sweep 1 GiB: chunk {:>7} × {slots:>2}, {threads:>2} threads, pieces from {:>7}, \
             {}: H2D {up:6.2} GB/s, D2H {down:6.2} GB/s",
            size_label(chunk as u64),
            size_label(min_piece as u64),
            if streaming_stores {
                "streaming stores"
            } else {
                "plain stores"
            }
        ));
    }
    Ok(())
}

/// One small size of the sweep, one note: the ring on one thread, spread over the workers,
/// from smaller pieces, the defaults, and the driver's own path.
fn sweep_size(stream: &Stream, bytes: usize, section: &mut Section) -> Result<()> {
    let source = vec![3u8; bytes];
    let mut sink = vec![4u8; bytes];
    let mut device = DeviceBuffer::<u8>::zeroed(bytes)?;
    let mut line = format!("sweep {:>7}:", size_label(bytes as u64));
    for (name, config) in sweep_variants() {
        let stager = Stager::with_config_in(config, DefaultPinned)?;
        let [up, down] = round_trips(&stager, stream, &source, &mut sink, &mut device, 30)?;
        line += &format!(" {name} H2D {up:6.2} D2H {down:6.2};");
    }
    let [up, down] = driver_round_trips(stream, &source, &mut sink, &device)?;
    section
        .notes
        .push(format!("{line} driver H2D {up:6.2} D2H {down:6.2} (GB/s)"));
    Ok(())
}

/// The stager configurations each small size of the sweep is measured with, by name.
fn sweep_variants() -> [(&'static str, StagingConfig); 4] {
    let ring_only = StagingConfig {
        driver_uploads: Vec::new(),
        driver_downloads: Vec::new(),
        upload_slots: 0,
        ..StagingConfig::default()
    };
    [
        (
            "ring, one thread",
            StagingConfig {
                single_thread_bytes: usize::MAX,
                ..ring_only.clone()
            },
        ),
        ("ring", ring_only.clone()),
        (
            "ring from 256 KiB pieces",
            StagingConfig {
                single_thread_bytes: 0,
                min_piece_bytes: 256 << 10,
                ..ring_only
            },
        ),
        ("defaults", StagingConfig::default()),
    ]
}
