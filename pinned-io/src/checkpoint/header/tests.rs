use std::collections::BTreeMap;
use std::io::Write;

use proptest::prelude::*;
use proptest::sample::{Index, select};
use safetensors::SafeTensors;
use serde_json::{Map, Value, json};

use super::*;

const FILE: &str = "model-00001-of-00002.safetensors";

const DTYPES: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

/// A whole file: the length field, the JSON header, and `data_len` bytes of data.
fn file_bytes(json: &str, data_len: u64) -> Vec<u8> {
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.resize(bytes.len() + data_len as usize, 0xA5);
    bytes
}

fn parse(json: &str, data_len: u64) -> Result<Header> {
    let data_start = 8 + json.len() as u64;
    Header::parse(
        Path::new(FILE),
        json.as_bytes(),
        data_start,
        data_start + data_len,
    )
}

fn read_bytes(bytes: &[u8]) -> (tempfile::NamedTempFile, Result<Header>) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(bytes).unwrap();
    file.flush().unwrap();
    let header = Header::read(file.as_file(), file.path());
    (file, header)
}

/// Asserts a format error that names the file and, where given, the tensor.
fn assert_format(result: Result<Header>, file: &str, tensor: Option<&str>, words: &str) {
    let error = result.expect_err("the header should be refused");
    let message = error.to_string();
    match &error {
        Error::Format { tensor: got, .. } => assert_eq!(got.as_deref(), tensor, "{message}"),
        other => panic!("expected a format error, got {other:?}"),
    }
    assert!(message.contains(file), "{message}");
    if let Some(tensor) = tensor {
        assert!(message.contains(&format!("`{tensor}`")), "{message}");
    }
    assert!(message.contains(words), "`{message}` should say `{words}`");
}

fn assert_truncated(result: Result<Header>, file: &str) {
    let error = result.expect_err("the file should be refused as truncated");
    assert!(matches!(error, Error::Truncated { .. }), "{error:?}");
    assert!(error.to_string().contains(file), "{error}");
}

fn entry(dtype: &str, shape: &[usize], begin: u64, end: u64) -> Value {
    json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, end]})
}

#[test]
fn a_good_header_lists_tensors_by_offset() {
    let json = json!({
        "__metadata__": {"format": "pt"},
        "b": entry("F32", &[2, 2], 16, 32),
        "a": entry("BF16", &[4, 2], 0, 16),
        "empty": entry("F4", &[0], 32, 32),
    })
    .to_string();
    let header = parse(&json, 40).unwrap();
    let start = 8 + json.len() as u64;
    let names: Vec<_> = header.tensors().iter().map(TensorSpec::name).collect();
    assert_eq!(names, ["a", "b", "empty"]);
    assert_eq!(header.tensors()[1].offset(), start + 16);
    assert_eq!(header.tensors()[1].bytes(), 16);
    assert_eq!(header.tensors()[1].shape(), [2, 2]);
    assert_eq!(header.data_start(), start);
    assert_eq!(header.data_end(), start + 32);
    assert_eq!(header.file_len(), start + 40);
    assert_eq!(header.metadata().unwrap()["format"], "pt");
    assert!(parse("{}", 0).unwrap().tensors().is_empty());
}

#[test]
fn a_file_shorter_than_its_length_field_is_truncated() {
    let (file, result) = read_bytes(&[1, 0, 0]);
    assert_truncated(result, &file.path().display().to_string());
}

#[test]
fn a_header_length_past_the_file_is_truncated() {
    let mut bytes = file_bytes("{}", 0);
    bytes[0] = 200;
    let (file, result) = read_bytes(&bytes);
    assert_truncated(result, &file.path().display().to_string());
}

#[test]
fn a_header_length_past_the_cap_is_refused_before_allocating() {
    for len in [MAX_HEADER_LEN + 1, u64::MAX] {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        let (file, result) = read_bytes(&bytes);
        let name = file.path().display().to_string();
        assert_format(result, &name, None, "cap");
    }
}

#[test]
fn a_header_that_is_not_utf8_is_refused() {
    let data_start = 8 + 4;
    let result = Header::parse(Path::new(FILE), b"{\"\xff\"}", data_start, data_start);
    assert_format(result, FILE, None, "UTF-8");
}

#[test]
fn invalid_json_is_refused() {
    assert_format(parse("{,}", 0), FILE, None, "not a JSON object");
    // An error inside an entry names the tensor being read.
    assert_format(parse("{\"a\": ", 0), FILE, Some("a"), "EOF");
    assert_format(parse("{} {}", 0), FILE, None, "not a JSON object");
}

#[test]
fn a_header_that_is_not_an_object_is_refused() {
    for json in ["[]", "3", "\"a\"", "null"] {
        assert_format(parse(json, 0), FILE, None, "not a JSON object");
    }
}

#[test]
fn an_unknown_dtype_names_the_tensor() {
    let json = json!({"w": entry("F12", &[1], 0, 2)}).to_string();
    assert_format(parse(&json, 2), FILE, Some("w"), "F12");
}

#[test]
fn an_unknown_or_missing_field_names_the_tensor() {
    let json = r#"{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "stride": [1]}}"#;
    assert_format(parse(json, 1), FILE, Some("w"), "stride");
    let json = r#"{"w": {"dtype": "U8", "data_offsets": [0, 1]}}"#;
    assert_format(parse(json, 1), FILE, Some("w"), "shape");
}

#[test]
fn duplicate_keys_are_refused() {
    let twice = r#"{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                    "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}"#;
    assert_format(parse(twice, 1), FILE, Some("w"), "twice");
    let field_twice =
        r#"{"w": {"dtype": "U8", "dtype": "I8", "shape": [1], "data_offsets": [0, 1]}}"#;
    assert_format(parse(field_twice, 1), FILE, Some("w"), "duplicate");
    let metadata_twice = r#"{"__metadata__": {"k": "a", "k": "b"}}"#;
    assert_format(parse(metadata_twice, 0), FILE, None, "twice");
}

#[test]
fn metadata_must_map_strings_to_strings() {
    let json = r#"{"__metadata__": {"total_size": 3}}"#;
    assert_format(parse(json, 0), FILE, None, "__metadata__");
}

#[test]
fn overflowing_shapes_and_offsets_name_the_tensor() {
    let huge = usize::MAX / 2;
    let json = json!({"w": entry("F32", &[huge, huge], 0, 4)}).to_string();
    assert_format(parse(&json, 4), FILE, Some("w"), "64-bit");
    let json = json!({"w": entry("F64", &[usize::MAX / 4], 0, 4)}).to_string();
    assert_format(parse(&json, 4), FILE, Some("w"), "64-bit");
    // Eight tensors of the most bytes a 64-bit bit count allows run the data section's end past
    // 2^64.
    let most = u64::MAX / 8;
    let map: Map<_, _> = (0..8)
        .map(|i| {
            (
                format!("t{i}"),
                entry("U8", &[most as usize], i * most, (i + 1) * most),
            )
        })
        .collect();
    let json = Value::Object(map).to_string();
    assert_format(parse(&json, 0), FILE, None, "overflow");
}

#[test]
fn offsets_that_end_before_they_begin_name_the_tensor() {
    let json = json!({"w": entry("U8", &[0], 4, 0)}).to_string();
    assert_format(parse(&json, 4), FILE, Some("w"), "before they begin");
}

#[test]
fn overlapping_tensors_are_refused() {
    let json = json!({"a": entry("U8", &[8], 0, 8), "b": entry("U8", &[8], 4, 12)}).to_string();
    assert_format(parse(&json, 12), FILE, Some("b"), "overlap");
}

#[test]
fn holes_are_refused() {
    let json = json!({"a": entry("U8", &[8], 0, 8), "b": entry("U8", &[8], 10, 18)}).to_string();
    assert_format(parse(&json, 18), FILE, Some("b"), "hole");
    let json = json!({"a": entry("U8", &[8], 2, 10)}).to_string();
    assert_format(parse(&json, 10), FILE, Some("a"), "hole");
}

#[test]
fn a_length_that_disagrees_with_dtype_and_shape_names_the_tensor() {
    let json = json!({"w": entry("F16", &[3], 0, 4)}).to_string();
    assert_format(parse(&json, 4), FILE, Some("w"), "takes 6");
    let json = json!({"w": entry("F4", &[3], 0, 2)}).to_string();
    assert_format(parse(&json, 2), FILE, Some("w"), "whole number of bytes");
}

#[test]
fn a_data_section_past_the_end_of_the_file_is_truncated() {
    let json = json!({"w": entry("U8", &[8], 0, 8)}).to_string();
    let (file, result) = read_bytes(&file_bytes(&json, 7));
    assert_truncated(result, &file.path().display().to_string());
    let (_file, result) = read_bytes(&file_bytes(&json, 9));
    assert_eq!(result.unwrap().data_end(), 8 + json.len() as u64 + 8);
}

#[test]
fn a_file_written_by_safetensors_reads_back() {
    let a: Vec<u8> = (0..24).collect();
    let b: Vec<u8> = (0..6).collect();
    let views = [
        (
            "a.weight",
            safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap(),
        ),
        (
            "b",
            safetensors::tensor::TensorView::new(Dtype::F4, vec![3, 4], &b).unwrap(),
        ),
    ];
    let info = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    safetensors::serialize_to_file(views, Some(info.clone()), &path).unwrap();
    let file = File::open(&path).unwrap();
    let header = Header::read(&file, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(header.metadata(), Some(&info));
    assert_eq!(header.data_end(), bytes.len() as u64);
    for (spec, data) in header.tensors().iter().zip([&a, &b]) {
        let range = spec.offset() as usize..(spec.offset() + spec.bytes()) as usize;
        assert_eq!(&bytes[range], &data[..], "{}", spec.name());
    }
    assert_eq!(header.tensors()[1].dtype(), Dtype::F4);
    assert_eq!(header.path(), path);
}

/// A valid header's tensors in layout order, with its metadata and trailing padding.
#[derive(Clone, Debug)]
struct Generated {
    tensors: Vec<(String, Dtype, Vec<usize>)>,
    metadata: Option<BTreeMap<String, String>>,
    padding: usize,
}

impl Generated {
    /// The JSON header (keys in sorted order, not layout order) and the data section's length.
    fn json(&self) -> (String, u64) {
        let mut map = Map::new();
        let mut end = 0;
        for (name, dtype, shape) in &self.tensors {
            let begin = end;
            end += byte_len(*dtype, shape).unwrap();
            let dtype = serde_json::to_value(dtype).unwrap();
            let value = json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, end]});
            map.insert(name.clone(), value);
        }
        if let Some(metadata) = &self.metadata {
            map.insert(METADATA_KEY.to_owned(), json!(metadata));
        }
        let json = Value::Object(map).to_string() + &" ".repeat(self.padding);
        (json, end)
    }
}

fn generated() -> impl Strategy<Value = Generated> {
    let tensor = (select(&DTYPES[..]), prop::collection::vec(0usize..6, 0..4))
        .prop_filter("whole bytes", |(dtype, shape)| {
            byte_len(*dtype, shape).is_ok()
        });
    let names = prop::collection::btree_map("\\PC{0,10}", tensor, 0..8)
        .prop_filter("a tensor name", |map| !map.contains_key(METADATA_KEY));
    let metadata = prop::option::of(prop::collection::btree_map("\\PC{0,6}", "\\PC{0,6}", 0..4));
    (names, metadata, 0usize..8).prop_flat_map(|(names, metadata, padding)| {
        let tensors: Vec<_> = names.into_iter().map(|(n, (d, s))| (n, d, s)).collect();
        (Just(tensors).prop_shuffle(), Just(metadata), Just(padding)).prop_map(
            |(tensors, metadata, padding)| Generated {
                tensors,
                metadata,
                padding,
            },
        )
    })
}

/// Everything a header that passed promises: tensors in order, inside the file, disjoint, and
/// as long as dtype × shape.
fn check_invariants(header: &Header, file_len: u64) {
    assert!(header.data_start() <= header.data_end() && header.data_end() <= file_len);
    let mut end = header.data_start();
    for spec in header.tensors() {
        assert_eq!(spec.offset(), end, "{spec:?}");
        assert_eq!(spec.bytes(), byte_len(spec.dtype(), spec.shape()).unwrap());
        end = spec.offset() + spec.bytes();
    }
    assert_eq!(end, header.data_end());
}

/// Compares a header that passed with the `safetensors` crate's reading of the same file.
fn agrees_with_safetensors(header: &Header, bytes: &[u8]) {
    let (_, theirs) = SafeTensors::read_metadata(bytes).expect("safetensors accepts it too");
    let infos = theirs.tensors();
    assert_eq!(infos.len(), header.tensors().len());
    for spec in header.tensors() {
        let info = infos[spec.name()];
        assert_eq!(
            (info.dtype, info.shape.as_slice()),
            (spec.dtype(), spec.shape())
        );
        let begin = spec.offset() - header.data_start();
        assert_eq!(
            info.data_offsets,
            (begin as usize, (begin + spec.bytes()) as usize)
        );
    }
    assert_eq!(theirs.metadata().as_ref(), header.metadata());
}

proptest! {
    #[test]
    fn valid_headers_parse_back_to_what_was_written(generated in generated()) {
        let (json, data_len) = generated.json();
        let bytes = file_bytes(&json, data_len);
        let (_file, header) = read_bytes(&bytes);
        let header = header.unwrap();
        check_invariants(&header, bytes.len() as u64);
        agrees_with_safetensors(&header, &bytes);
        let mut expected: Vec<_> = generated.tensors.iter().map(|(n, d, s)| (n.as_str(), *d, s.as_slice())).collect();
        let mut got: Vec<_> = header.tensors().iter().map(|t| (t.name(), t.dtype(), t.shape())).collect();
        expected.sort();
        got.sort();
        prop_assert_eq!(got, expected);
        let metadata = generated.metadata.map(|m| m.into_iter().collect::<HashMap<_, _>>());
        prop_assert_eq!(header.metadata(), metadata.as_ref());
    }

    #[test]
    fn corrupt_files_never_panic_and_never_pass_unsound(
        generated in generated(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let (json, data_len) = generated.json();
        let mut bytes = file_bytes(&json, data_len);
        for mutation in &mutations {
            mutation.apply(&mut bytes);
        }
        let (_file, result) = read_bytes(&bytes);
        let theirs = SafeTensors::read_metadata(&bytes);
        match result {
            Ok(header) => {
                check_invariants(&header, bytes.len() as u64);
                if header.data_end() == bytes.len() as u64 {
                    agrees_with_safetensors(&header, &bytes);
                }
            }
            // Their reader keeps the last of two equal keys; ours refuses both.
            Err(e) => prop_assert!(theirs.is_err() || e.to_string().contains("twice"), "{}", e),
        }
    }
}

/// One way to damage a file.
#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
    SetLength(u64),
    /// Rewrites one number of a shape or offsets and fixes the length field to match, so that
    /// the damage reaches the checks of shapes and offsets rather than the JSON parser.
    Number(Index, Change),
    /// Moves one tensor's offsets together, keeping its length, so that the damage reaches the
    /// checks of overlaps and holes.
    Slide(Index, i8),
}

#[derive(Clone, Copy, Debug)]
enum Change {
    Set(u64),
    Shift(i8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let change = prop_oneof![
        any::<i8>().prop_map(Change::Shift),
        prop_oneof![0u64..64, any::<u64>(), Just(u64::MAX), Just(1 << 62)].prop_map(Change::Set),
    ];
    prop_oneof![
        2 => (any::<Index>(), 0u8..8).prop_map(|(i, bit)| Mutation::FlipBit(i, bit)),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => any::<Index>().prop_map(Mutation::Delete),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => prop_oneof![0u64..256, any::<u64>()].prop_map(Mutation::SetLength),
        4 => (any::<Index>(), change).prop_map(|(i, n)| Mutation::Number(i, n)),
        2 => (any::<Index>(), any::<i8>()).prop_map(|(i, d)| Mutation::Slide(i, d)),
    ]
}

impl Mutation {
    fn apply(&self, bytes: &mut Vec<u8>) {
        let len = bytes.len();
        match *self {
            _ if len == 0 => {}
            Mutation::FlipBit(i, bit) => bytes[i.index(len)] ^= 1 << bit,
            Mutation::Insert(i, byte) => bytes.insert(i.index(bytes.len() + 1), byte),
            Mutation::Delete(i) => drop(bytes.remove(i.index(bytes.len()))),
            Mutation::Truncate(i) => bytes.truncate(i.index(bytes.len())),
            Mutation::SetLength(len) if bytes.len() >= 8 => {
                bytes[..8].copy_from_slice(&len.to_le_bytes());
            }
            Mutation::SetLength(_) => {}
            Mutation::Number(i, change) => {
                let count = array_numbers(bytes).len();
                if count > 0 {
                    rewrite_number(bytes, i.index(count), change);
                }
            }
            Mutation::Slide(i, d) => {
                // The two numbers of one tensor's offsets, written as `[begin,end]`.
                let runs = array_numbers(bytes);
                let pairs: Vec<_> = (runs.windows(2).enumerate())
                    .filter(|(_, w)| {
                        bytes.get(8 + w[0].end) == Some(&b',')
                            && bytes.get(8 + w[1].end) == Some(&b']')
                    })
                    .map(|(k, _)| k)
                    .collect();
                if let Some(&k) = pairs.get(i.index(pairs.len().max(1))) {
                    rewrite_number(bytes, k + 1, Change::Shift(d));
                    rewrite_number(bytes, k, Change::Shift(d));
                }
            }
        }
    }
}

/// The ranges, within the JSON header, of the numbers that sit in arrays: shapes and offsets,
/// not digits inside names or dtypes.
fn array_numbers(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    let Some(json_len) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    else {
        return Vec::new();
    };
    let json = &bytes[8..8 + json_len.min(bytes.len() as u64 - 8) as usize];
    let mut runs = Vec::new();
    let mut at = 0;
    while at < json.len() {
        let len = json[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        if len > 0 && at > 0 && matches!(json[at - 1], b'[' | b',') {
            runs.push(at..at + len);
        }
        at += len.max(1);
    }
    runs
}

/// Changes the `which`-th number of [`array_numbers`] and fixes the length field to match.
fn rewrite_number(bytes: &mut Vec<u8>, which: usize, change: Change) {
    let runs = array_numbers(bytes);
    let json_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let json = &bytes[8..8 + json_len.min(bytes.len() as u64 - 8) as usize];
    let run = runs[which].clone();
    let old: u64 = std::str::from_utf8(&json[run.clone()])
        .unwrap()
        .parse()
        .unwrap_or(0);
    let new = match change {
        Change::Set(n) => n,
        Change::Shift(d) => old.saturating_add_signed(d.into()),
    };
    let mut new_json = json[..run.start].to_vec();
    new_json.extend_from_slice(new.to_string().as_bytes());
    new_json.extend_from_slice(&json[run.end..]);
    let rest = bytes[8 + json.len()..].to_vec();
    *bytes = (new_json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&new_json);
    bytes.extend_from_slice(&rest);
}
