use proptest::prelude::*;
use proptest::sample::select;
use safetensors::Dtype;
use serde_json::json;

use super::*;
use crate::checkpoint::header::{Header, byte_len};

const FILE: &str = "shard.safetensors";

/// A tensor `name` of `dtype` and `shape` that starts `pad` bytes into its file's data section,
/// behind a filler tensor, so that offsets are not all zero.
fn spec(dtype: Dtype, shape: &[usize], pad: u64) -> TensorSpec {
    let bytes = byte_len(dtype, shape).unwrap();
    let dtype = serde_json::to_value(dtype).unwrap();
    let json = json!({
        "filler": {"dtype": "U8", "shape": [pad], "data_offsets": [0, pad]},
        "w": {"dtype": dtype, "shape": shape, "data_offsets": [pad, pad + bytes]},
    })
    .to_string();
    let start = 8 + json.len() as u64;
    let header = Header::parse(Path::new(FILE), json.as_bytes(), start, start + pad + bytes);
    let header = header.unwrap();
    header
        .tensors()
        .iter()
        .find(|t| t.name() == "w")
        .unwrap()
        .clone()
}

fn assert_invalid(result: Result<(Extent, Vec<usize>)>, words: &str) {
    match result {
        Err(Error::Invalid(message)) => {
            assert!(
                message.contains(FILE) && message.contains("`w`"),
                "{message}"
            );
            assert!(message.contains(words), "`{message}` should say `{words}`");
        }
        other => panic!("expected an invalid request, got {other:?}"),
    }
}

#[test]
fn a_split_needs_a_rank_inside_a_nonempty_world() {
    assert!(matches!(Split::new(0, 0, 0), Err(Error::Invalid(_))));
    assert!(matches!(Split::new(0, 2, 2), Err(Error::Invalid(_))));
    let split = Split::new(1, 1, 2).unwrap();
    assert_eq!((split.dim(), split.rank(), split.world()), (1, 1, 2));
}

#[test]
fn parts_are_dealt_as_tensor_split_deals_them() {
    // torch.tensor_split(torch.arange(10), 3) has parts of 4, 3 and 3.
    let parts: Vec<_> = (0..3)
        .map(|r| Split::new(0, r, 3).unwrap().part(10))
        .collect();
    assert_eq!(parts, [(0, 4), (4, 3), (7, 3)]);
    let parts: Vec<_> = (0..4)
        .map(|r| Split::new(0, r, 4).unwrap().part(2))
        .collect();
    assert_eq!(parts, [(0, 1), (1, 1), (2, 0), (2, 0)]);
}

#[test]
fn a_whole_tensor_is_one_row() {
    let w = spec(Dtype::F32, &[3, 4], 8);
    let (extent, shape) = extent(&w, None, Path::new(FILE)).unwrap();
    let row = Extent {
        offset: w.offset(),
        width: 48,
        rows: 1,
        pitch: 48,
    };
    assert_eq!((extent, shape), (row, vec![3, 4]));
}

#[test]
fn a_column_split_is_strided_and_a_row_split_contiguous() {
    let w = spec(Dtype::BF16, &[3, 10], 4);
    let cols = Split::new(1, 1, 3).unwrap();
    let (columns, shape) = extent(&w, Some(&cols), Path::new(FILE)).unwrap();
    let strided = Extent {
        offset: w.offset() + 8,
        width: 6,
        rows: 3,
        pitch: 20,
    };
    assert_eq!((columns, shape), (strided, vec![3, 3]));
    let rows = Split::new(0, 1, 2).unwrap();
    let (rows, shape) = extent(&w, Some(&rows), Path::new(FILE)).unwrap();
    let run = Extent {
        offset: w.offset() + 40,
        width: 20,
        rows: 1,
        pitch: 20,
    };
    assert_eq!((rows, shape), (run, vec![1, 10]));
}

#[test]
fn a_dimension_the_tensor_lacks_is_refused() {
    let split = Split::new(1, 0, 2).unwrap();
    assert_invalid(
        extent(&spec(Dtype::F32, &[], 0), Some(&split), Path::new(FILE)),
        "dimension 1",
    );
    assert_invalid(
        extent(&spec(Dtype::F32, &[8], 0), Some(&split), Path::new(FILE)),
        "[8]",
    );
}

#[test]
fn a_sub_byte_part_must_fall_on_bytes() {
    let path = Path::new(FILE);
    let f4 = spec(Dtype::F4, &[4, 2], 0);
    assert_invalid(extent(&f4, Some(&Split::new(1, 0, 2).unwrap()), path), "F4");
    let f4 = spec(Dtype::F4, &[6], 0);
    assert_invalid(
        extent(&f4, Some(&Split::new(0, 3, 4).unwrap()), path),
        "start",
    );
    let f6 = spec(Dtype::F6_E2M3, &[2, 4], 0);
    assert_invalid(
        extent(&f6, Some(&Split::new(1, 1, 2).unwrap()), path),
        "F6_E2M3",
    );
    // Parts of whole bytes, and a world of one along an odd inner dimension, are fine.
    let f4 = spec(Dtype::F4, &[2, 4], 0);
    let (e, _) = extent(&f4, Some(&Split::new(1, 1, 2).unwrap()), path).unwrap();
    assert_eq!(
        (e.offset - f4.offset(), e.width, e.rows, e.pitch),
        (1, 1, 2, 2)
    );
    let f4 = spec(Dtype::F4, &[2, 3], 0);
    let (e, _) = extent(&f4, Some(&Split::new(1, 0, 1).unwrap()), path).unwrap();
    assert_eq!((e.width, e.rows), (3, 1));
}

#[test]
fn a_rank_past_the_dimension_gets_an_empty_part() {
    let w = spec(Dtype::F32, &[2, 3], 0);
    let (e, shape) = extent(&w, Some(&Split::new(1, 4, 5).unwrap()), Path::new(FILE)).unwrap();
    assert_eq!((e.bytes(), shape), (0, vec![2, 0]));
    let (e, shape) = extent(&w, Some(&Split::new(0, 3, 4).unwrap()), Path::new(FILE)).unwrap();
    assert_eq!((e.bytes(), shape), (0, vec![0, 3]));
}

fn bit(data: &[u8], i: u64) -> u8 {
    (data[(i / 8) as usize] >> (i % 8)) & 1
}

/// The part's bytes by index arithmetic: each element of the part, in C order, looked up in the
/// whole tensor by its multi-index, its bits packed least significant first.
fn reference(data: &[u8], spec: &TensorSpec, dim: usize, start: usize, len: usize) -> Vec<u8> {
    let shape = spec.shape();
    let bits = spec.dtype().bitsize() as u64;
    let mut part = shape.to_vec();
    part[dim] = len;
    let count: usize = part.iter().product();
    let mut out = vec![0u8; (count as u64 * bits).div_ceil(8) as usize];
    for k in 0..count {
        let (mut rest, mut src, mut stride) = (k, 0, 1);
        for d in (0..shape.len()).rev() {
            let index = rest % part[d] + if d == dim { start } else { 0 };
            rest /= part[d];
            src += index * stride;
            stride *= shape[d];
        }
        for b in 0..bits {
            let from = spec.offset() * 8 + src as u64 * bits + b;
            let to = k as u64 * bits + b;
            out[(to / 8) as usize] |= bit(data, from) << (to % 8);
        }
    }
    out
}

fn gather(data: &[u8], extent: &Extent) -> Vec<u8> {
    (0..extent.rows)
        .flat_map(|r| {
            let at = (extent.offset + r * extent.pitch) as usize;
            data[at..at + extent.width as usize].iter().copied()
        })
        .collect()
}

proptest! {
    #[test]
    fn extents_gather_what_index_arithmetic_slices(
        dtype in select(&[Dtype::U8, Dtype::BF16, Dtype::F32, Dtype::F64, Dtype::F4, Dtype::F6_E3M2][..]),
        shape in prop::collection::vec(0usize..6, 1..4),
        pad in 0u64..5,
        dim in any::<prop::sample::Index>(),
        world in 1usize..7,
        rank in any::<prop::sample::Index>(),
    ) {
        prop_assume!(byte_len(dtype, &shape).is_ok());
        let w = spec(dtype, &shape, pad);
        let data: Vec<u8> = (0..w.offset() + w.bytes()).map(|i| (i * 131 + 7) as u8).collect();
        let split = Split::new(dim.index(shape.len()), rank.index(world), world).unwrap();
        let (start, len) = split.part(shape[split.dim()]);
        match extent(&w, Some(&split), Path::new(FILE)) {
            Ok((extent, part_shape)) => {
                prop_assert!(extent.rows == 1 || extent.pitch > extent.width);
                if extent.rows == 1 {
                    prop_assert_eq!(extent.pitch, extent.width);
                }
                if extent.bytes() > 0 {
                    let last = extent.offset + (extent.rows - 1) * extent.pitch + extent.width;
                    prop_assert!(extent.offset >= w.offset() && last <= w.offset() + w.bytes());
                }
                prop_assert_eq!(part_shape[split.dim()], len);
                let expected = reference(&data, &w, split.dim(), start, len);
                prop_assert_eq!(gather(&data, &extent), expected);
            }
            // Only a dtype narrower than a byte can cut a part inside one.
            Err(e) => prop_assert!(dtype.bitsize() < 8, "{}", e),
        }
    }

    #[test]
    fn the_parts_of_a_world_tile_the_dimension(size in 0usize..100, world in 1usize..20) {
        let parts: Vec<_> = (0..world).map(|r| Split::new(0, r, world).unwrap().part(size)).collect();
        let mut next = 0;
        for &(start, len) in &parts {
            prop_assert_eq!(start, next);
            next += len;
        }
        prop_assert_eq!(next, size);
        let (longest, shortest) = (parts[0].1, parts[world - 1].1);
        prop_assert!(longest - shortest <= 1);
        prop_assert!(parts.windows(2).all(|p| p[0].1 >= p[1].1));
    }
}
