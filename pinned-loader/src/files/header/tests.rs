//! The header parser against headers as numpy writes them, written in other valid ways, and
//! corrupted at random.

use proptest::prelude::*;

use super::*;

/// A whole `.npy` head: preamble and `dict`, padded with spaces to a multiple of 64 bytes
/// and ended with a newline, as numpy writes it.
fn head(version: u8, dict: &str) -> Vec<u8> {
    let start = if version == 1 { 10 } else { 12 };
    let total = (start + dict.len() + 1).next_multiple_of(64);
    let mut text = dict.as_bytes().to_vec();
    text.resize(total - start - 1, b' ');
    text.push(b'\n');
    let mut out = MAGIC.to_vec();
    out.extend([version, 0]);
    if version == 1 {
        out.extend((text.len() as u16).to_le_bytes());
    } else {
        out.extend((text.len() as u32).to_le_bytes());
    }
    out.extend(text);
    out
}

fn numpy_dict(descr: &str, shape: &[usize]) -> String {
    let axes: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let shape = match axes.len() {
        1 => format!("({},)", axes[0]),
        _ => format!("({})", axes.join(", ")),
    };
    format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")
}

#[test]
fn reads_what_numpy_writes() {
    // `np.save(f, np.arange(6, dtype='<i4').reshape(2, 3))` with numpy 1.x: these 128 bytes,
    // then 24 of data.
    let mut bytes = b"\x93NUMPY\x01\x00\x76\x00{'descr': '<i4', 'fortran_order': False, \
                      'shape': (2, 3), }"
        .to_vec();
    bytes.resize(127, b' ');
    bytes.push(b'\n');
    assert_eq!(bytes, head(1, &numpy_dict("<i4", &[2, 3])));
    let layout = parse(&bytes, 128 + 24).unwrap();
    assert_eq!(
        layout,
        Layout {
            descr: "<i4",
            item_bytes: 4,
            shape: vec![2, 3],
            data_offset: 128,
            sample_bytes: 12,
        }
    );
    assert_eq!(layout.data_bytes(), 24);
}

#[test]
fn refuses_what_it_does_not_read_and_says_why() {
    let cases = [
        (numpy_dict(">f4", &[2]), "big-endian"),
        (numpy_dict("<c8", &[2]), "element type"),
        (numpy_dict("|O", &[2]), "element type"),
        (numpy_dict("<f4", &[]), "0-d"),
        (
            "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }".into(),
            "C-ordered",
        ),
        (
            "{'descr': '<f4', 'shape': (2,), }".into(),
            "no 'fortran_order'",
        ),
        (
            "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}".into(),
            "twice",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}".into(),
            "key 'x'",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}".into(),
            "integers",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk".into(),
            "more after",
        ),
        (numpy_dict("<f8", &[usize::MAX / 4, 3]), "overflows"),
        (numpy_dict("<f8", &[1000]), "takes 8000 bytes"),
    ];
    for (dict, why) in cases {
        let bytes = head(1, &dict);
        let error = parse(&bytes, bytes.len() as u64 + 16).unwrap_err();
        assert!(error.contains(why), "{dict}: {error}");
    }
    let mut bytes = head(1, &numpy_dict("<f4", &[1]));
    bytes[6] = 4;
    assert!(parse(&bytes, 1000).unwrap_err().contains("version 4.0"));
    assert!(
        parse(b"PK\x03\x04", 1000)
            .unwrap_err()
            .contains("not a .npy")
    );
    let bytes = head(2, &numpy_dict("<f4", &[1]));
    assert!(
        parse(&bytes, 20)
            .unwrap_err()
            .contains("past the file's end")
    );
}

#[test]
fn single_bytes_take_any_byte_order() {
    for descr in ["|u1", "<u1", ">u1", "=u1"] {
        let bytes = head(1, &numpy_dict(descr, &[4, 2]));
        let layout = parse(&bytes, bytes.len() as u64 + 8).unwrap();
        assert_eq!(layout.descr, "|u1");
    }
}

/// A shape numpy could write, small enough that its data fits a test's file length.
/// Shapes of any number of samples (none included), each of at least one element.
fn shapes() -> impl Strategy<Value = Vec<usize>> {
    (0usize..6, prop::collection::vec(1usize..6, 0..4))
        .prop_map(|(len, sample)| std::iter::once(len).chain(sample).collect())
}

/// Spacing numpy does not write but Python reads the same.
fn space() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["", " ", "  ", "\t", "\n "]).prop_map(str::to_owned)
}

/// A valid dict for `descr` and `shape`, its keys in any order, with any spacing, quotes
/// and trailing commas.
fn dict(descr: &'static str, shape: Vec<usize>) -> impl Strategy<Value = String> {
    let spaces = prop::collection::vec(space(), 12);
    (
        spaces,
        Just(shape),
        any::<[bool; 3]>(),
        Just(descr),
        0usize..6,
    )
        .prop_map(|(s, shape, [double, comma, tail], descr, order)| {
            let q = if double { '"' } else { '\'' };
            let mut axes: Vec<String> = shape.iter().map(ToString::to_string).collect();
            if axes.len() == 1 || comma {
                axes.last_mut().unwrap().push(',');
            }
            let entries = [
                format!("{q}descr{q}{}:{}{q}{descr}{q}", s[0], s[1]),
                format!("{q}fortran_order{q}{}:{}False", s[2], s[3]),
                format!(
                    "{q}shape{q}{}:{}({}{}{})",
                    s[4],
                    s[5],
                    s[6],
                    axes.join(&format!(",{}", s[7])),
                    s[8]
                ),
            ];
            let order = [
                [0, 1, 2],
                [0, 2, 1],
                [1, 0, 2],
                [1, 2, 0],
                [2, 0, 1],
                [2, 1, 0],
            ][order];
            let body: Vec<&str> = order.iter().map(|&k| entries[k].as_str()).collect();
            let end = if tail { "," } else { "" };
            format!(
                "{{{}{}{end}{}}}",
                s[9],
                body.join(&format!(",{}", s[10])),
                s[11]
            )
        })
}

fn valid() -> impl Strategy<Value = (u8, &'static str, usize, Vec<usize>, String)> {
    (1u8..4, prop::sample::select(DTYPES.to_vec()), shapes()).prop_flat_map(
        |(version, (descr, bytes), shape)| {
            (
                Just(version),
                Just(descr),
                Just(bytes),
                Just(shape.clone()),
                dict(descr, shape),
            )
        },
    )
}

proptest! {
    #[test]
    fn valid_headers_round_trip((version, descr, bytes, shape, dict) in valid(), spare in 0u64..64) {
        let head = head(version, &dict);
        let data: u64 = shape.iter().map(|&a| a as u64).product::<u64>() * bytes as u64;
        let layout = parse(&head, head.len() as u64 + data + spare).unwrap();
        prop_assert_eq!(layout.descr, descr);
        prop_assert_eq!(&layout.shape, &shape);
        prop_assert_eq!(layout.data_offset, head.len() as u64);
        prop_assert_eq!(layout.data_bytes(), data);
        prop_assert_eq!(layout.len(), shape[0]);
        if data > 0 {
            prop_assert!(parse(&head, head.len() as u64 + data - 1).is_err());
        }
    }

    #[test]
    fn corrupted_headers_never_panic_and_stay_inside_the_file(
        (version, _descr, _bytes, _shape, dict) in valid(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
        file_len in 0u64..4096,
    ) {
        let mut head = head(version, &dict);
        for (at, byte, kind) in edits {
            let at = at.index(head.len() + 1);
            match kind {
                0 if at < head.len() => head[at] = byte,
                1 => head.insert(at, byte),
                _ => head.truncate(at),
            }
        }
        if let Ok(layout) = parse(&head, file_len) {
            prop_assert!(layout.data_offset <= head.len() as u64);
            prop_assert!(layout.data_offset + layout.data_bytes() <= file_len);
            let elements: usize = layout.shape[1..].iter().product();
            prop_assert_eq!(layout.sample_bytes, elements * layout.item_bytes);
        }
    }
}

#[test]
fn samples_of_zero_bytes_are_refused_however_many_the_header_claims() {
    let h = head(1, &numpy_dict("|u1", &[1usize << 40, 0]));
    let error = parse(&h, h.len() as u64).unwrap_err();
    assert!(error.contains("zero elements"), "{error}");
}
