//! Filling spare capacity: `PinnedVec<u8>::read_from` and `read_from_file_at` (the length is
//! exactly what was read, whatever ends the reading), and `extend_streaming`; windows of a
//! buffer as a copy's host side.

use std::io::{self, Read, Write};

use cuda_pinned::{HostBuffer, PinnedVec, Window};
use proptest::prelude::*;

/// A reader of `data` that yields at most `step` bytes a call, fails with `fail` once `fail_at`
/// bytes have been read, and is interrupted every third call.
struct Scripted {
    data: Vec<u8>,
    at: usize,
    step: usize,
    fail_at: Option<usize>,
    calls: usize,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.calls += 1;
        if self.calls.is_multiple_of(3) {
            return Err(io::ErrorKind::Interrupted.into());
        }
        if self.fail_at.is_some_and(|at| self.at >= at) {
            return Err(io::Error::other("the source failed"));
        }
        let end = self
            .data
            .len()
            .min(self.at + self.step)
            .min(self.fail_at.unwrap_or(usize::MAX))
            .min(self.at + buf.len());
        let got = end - self.at;
        buf[..got].copy_from_slice(&self.data[self.at..end]);
        self.at = end;
        Ok(got)
    }
}

/// Sizes reach past the 64 KiB pieces a reader is offered, except under Miri, which is slow.
const SCALE: usize = if cfg!(miri) { 1_000 } else { 100_000 };

fn config() -> ProptestConfig {
    crate::support::proptest_config(64, 4)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn the_length_is_what_was_read(
        len in 0usize..SCALE * 3,
        step in 1usize..SCALE,
        limit in 0usize..SCALE * 4,
        fail in prop::option::of(0usize..SCALE * 3),
        start in 0usize..10,
    ) {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let mut reader = Scripted { data: data.clone(), at: 0, step, fail_at: fail, calls: 0 };
        let mut bytes = PinnedVec::<u8>::from_slice(&vec![7; start]).unwrap();
        let result = bytes.read_from(&mut reader, limit);
        let readable = len.min(fail.unwrap_or(usize::MAX));
        let expected = readable.min(limit);
        match result {
            Ok(read) => {
                prop_assert_eq!(read, expected);
                prop_assert!(readable >= limit || fail.is_none_or(|f| f >= len));
            }
            Err(error) => {
                prop_assert_eq!(error.to_string(), "the source failed");
                prop_assert!(limit > readable);
            }
        }
        prop_assert_eq!(bytes.len(), start + expected);
        prop_assert!(bytes[..start].iter().all(|&b| b == 7));
        prop_assert!(bytes[start..] == data[..expected]);
    }
}

/// A reader that claims more bytes than it was given room for.
struct Liar;

impl Read for Liar {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(buf.len() + 1)
    }
}

#[test]
fn a_reader_that_claims_too_much_is_invalid_data_and_adds_nothing() {
    let mut bytes = PinnedVec::<u8>::with_capacity(0).unwrap();
    let error = bytes.read_from(&mut Liar, 10).unwrap_err();
    assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    assert!(bytes.is_empty());
}

#[test]
#[cfg_attr(miri, ignore = "Miri's isolation has no files")]
fn a_file_range_is_read_up_to_its_end() {
    let path = std::env::temp_dir().join(format!("cuda-pinned-fill-{}", std::process::id()));
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(&data))
        .unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mut bytes = PinnedVec::<u8>::from_slice(b"head").unwrap();
    assert_eq!(bytes.read_from_file_at(&file, 1_000, 5_000).unwrap(), 5_000);
    // Past the end: the rest, then nothing.
    assert_eq!(
        bytes.read_from_file_at(&file, 98_000, 5_000).unwrap(),
        2_000
    );
    assert_eq!(bytes.read_from_file_at(&file, 200_000, 10).unwrap(), 0);
    assert_eq!(bytes.len(), 4 + 5_000 + 2_000);
    assert_eq!(&bytes[..4], b"head");
    assert!(bytes[4..5_004] == data[1_000..6_000]);
    assert!(bytes[5_004..] == data[98_000..]);
    assert!(bytes.read_from_file_at(&file, u64::MAX, 10).is_err());
    std::fs::remove_file(path).unwrap();
}

proptest! {
    #![proptest_config(crate::support::proptest_config(64, 4))]

    /// `extend_streaming` appends exactly `src` after what was there, at any length (the
    /// non-temporal path starts at 4 KiB) and any alignment of the end of the vector.
    #[test]
    fn extend_streaming_appends_exactly_the_slice(
        head in 0usize..100,
        len in prop_oneof![0usize..64, 4090usize..4200, 20_000usize..20_100],
        seed: u8,
    ) {
        let src: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ u32::from(seed)).collect();
        let mut v = PinnedVec::<u32>::with_capacity(0).unwrap();
        v.extend((0..head as u32).map(|i| !i));
        v.extend_streaming(&src).unwrap();
        prop_assert_eq!(v.len(), head + len);
        prop_assert!(v[..head].iter().enumerate().all(|(i, &x)| x == !(i as u32)));
        prop_assert_eq!(&v[head..], &src[..]);
    }

    /// A window reports exactly its range of the buffer, wherever it is moved, and gives the
    /// whole buffer back.
    #[test]
    fn a_window_reports_its_range_of_the_buffer(len in 0usize..200, a in 0usize..200, b in 0usize..200) {
        let (start, end) = (a.min(b).min(len), a.max(b).min(len));
        let v = PinnedVec::from_slice(&vec![7u16; len]).unwrap();
        let base = v.as_ptr() as usize;
        let mut window = Window::new(v, start..end);
        prop_assert_eq!(window.range(), start..end);
        let (ptr, n) = window.host_parts();
        prop_assert_eq!((ptr as usize, n), (base.wrapping_add(2 * start), end - start));
        window.set_range(..);
        prop_assert_eq!(window.host_parts().1, len);
        prop_assert_eq!(window.into_inner().len(), len);
    }
}

#[test]
#[should_panic(expected = "out of bounds")]
fn a_window_past_the_buffer_panics_as_slicing_does() {
    let v = PinnedVec::from_slice(&[1u8; 10]).unwrap();
    let _ = Window::new(v, 5..11);
}
