//! Device views, partial copies, allocator-api2 vectors and batched raw copies on a device.

use cuda_pinned::{DeviceBuffer, HostLocked, PinnedVec, RawCopy, Registered, Stream};

#[test]
#[ignore = "needs a CUDA device"]
fn a_short_batch_goes_into_a_larger_buffer_and_a_few_elements_come_back() {
    let stream = Stream::new().unwrap();
    let mut device = DeviceBuffer::<u32>::zeroed(1000).unwrap();
    let short = PinnedVec::from_slice(&(0..100u32).collect::<Vec<_>>()).unwrap();
    stream
        .copy_to_device(short, device.slice_mut(..100))
        .unwrap()
        .wait()
        .unwrap();
    let tail = PinnedVec::from_slice(&[7u32; 10]).unwrap();
    stream
        .copy_to_device(tail, device.slice_mut(990..))
        .unwrap()
        .wait()
        .unwrap();
    // A few elements back, through a view, with the tracked copy and the blocking one.
    let back = stream
        .copy_from_device(device.slice(98..102), PinnedVec::<u32>::zeroed(4).unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(back, [98, 99, 0, 0][..]);
    let mut last = [0u32; 3];
    device.slice(997..).copy_to_host(&mut last).unwrap();
    assert_eq!(last, [7; 3]);
    // Lengths are checked against the view, with a clear error.
    let error = stream
        .copy_to_device(
            PinnedVec::from_slice(&[1u32; 5]).unwrap(),
            device.slice_mut(..4),
        )
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("5 host elements and 4 device elements"),
        "{error}"
    );
    assert!(device.get(10..2000).is_none());
    // Views split and cast.
    let (head, rest) = device.slice_mut(..).split_at_mut(500);
    assert_eq!((head.len(), rest.len()), (500, 500));
    let bytes = device.slice(..2).cast::<u8>().unwrap();
    assert_eq!(bytes.to_vec().unwrap(), [0, 0, 0, 0, 1, 0, 0, 0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn allocator_api2_vectors_and_arc_pools_copy_asynchronously() {
    let stream = Stream::new().unwrap();
    let data: Vec<u8> = (0..=255).cycle().take(1 << 20).collect();
    let mut device = DeviceBuffer::<u8>::zeroed(data.len()).unwrap();
    let mut source = allocator_api2::vec::Vec::new_in(Registered::new());
    source.extend_from_slice(&data);
    let upload = stream.copy_to_device(source, &mut device).unwrap();
    drop(upload); // waits for the copy before the vector's memory goes back
    assert_eq!(device.to_vec().unwrap(), data);

    // An `Arc` of an allocator is one, so its buffers move to other threads.
    let allocator = std::sync::Arc::new(HostLocked);
    let sink = PinnedVec::<u8, _>::zeroed_in(data.len(), allocator.clone()).unwrap();
    let sink = std::thread::spawn(move || {
        stream
            .copy_from_device(&device, sink)
            .unwrap()
            .wait()
            .unwrap()
    })
    .join()
    .unwrap();
    assert!(sink == data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn batched_raw_copies_gather_pieces_into_place() {
    let stream = Stream::new().unwrap();
    let pieces: Vec<PinnedVec<u8>> = (0..64u8)
        .map(|i| PinnedVec::from_slice(&[i; 4096]).unwrap())
        .collect();
    let device = DeviceBuffer::<u8>::zeroed(64 * 4096).unwrap();
    let copies: Vec<RawCopy> = pieces
        .iter()
        .enumerate()
        .rev()
        .map(|(i, piece)| RawCopy {
            dst: device.as_raw() + ((63 - i) * 4096) as u64,
            src: piece.as_ptr() as u64,
            bytes: 4096,
        })
        .collect();
    // SAFETY: pinned sources and a device destination of the stated sizes; both outlive the
    // copies, which are waited for below; nothing else touches them meanwhile.
    unsafe { stream.copy_batch_raw(&copies).unwrap() };
    stream.synchronize().unwrap();
    let back = device.to_vec().unwrap();
    for (position, chunk) in back.chunks(4096).enumerate() {
        assert!(
            chunk.iter().all(|&b| b as usize == 63 - position),
            "piece {position}"
        );
    }
}
