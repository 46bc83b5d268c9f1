use proptest::prelude::*;
use serde_json::json;

use super::*;

const INDEX: &str = "ckpt/model.safetensors.index.json";

fn parse(value: &serde_json::Value) -> Result<ShardIndex> {
    ShardIndex::parse(Path::new(INDEX), value.to_string().as_bytes())
}

/// Asserts a format error whose message names the index and, where given, the tensor.
fn assert_format(result: Result<ShardIndex>, tensor: Option<&str>, words: &str) {
    let error = result.expect_err("the index should be refused");
    let message = error.to_string();
    match &error {
        Error::Format { tensor: got, .. } => assert_eq!(got.as_deref(), tensor, "{message}"),
        other => panic!("expected a format error, got {other:?}"),
    }
    assert!(message.contains(INDEX), "{message}");
    assert!(message.contains(words), "`{message}` should say `{words}`");
}

/// The header of a shard at `path` holding one byte-sized tensor per name.
fn header(path: &str, names: &[&str]) -> Header {
    let map: serde_json::Map<_, _> = (names.iter().enumerate())
        .map(|(i, name)| {
            let entry = json!({"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]});
            (name.to_string(), entry)
        })
        .collect();
    let json = serde_json::Value::Object(map).to_string();
    let start = 8 + json.len() as u64;
    let len = start + names.len() as u64;
    Header::parse(Path::new(path), json.as_bytes(), start, len).unwrap()
}

fn two_shards() -> ShardIndex {
    let value = json!({
        "metadata": {"total_size": 3},
        "weight_map": {
            "b": "model-00002-of-00002.safetensors",
            "a": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    });
    parse(&value).unwrap()
}

#[test]
fn shards_are_listed_once_sorted_and_joined_to_the_index_directory() {
    let index = two_shards();
    let shards = [
        "ckpt/model-00001-of-00002.safetensors",
        "ckpt/model-00002-of-00002.safetensors",
    ];
    assert_eq!(index.shards(), shards.map(PathBuf::from));
    assert_eq!(index.shard_of("a"), Some(0));
    assert_eq!(index.shard_of("c"), Some(1));
    assert_eq!(index.shard_of("d"), None);
    assert_eq!(index.weight_map().len(), 3);
    assert_eq!(index.path(), Path::new(INDEX));
}

#[test]
fn nested_relative_names_and_unknown_fields_are_fine() {
    let value = json!({"weight_map": {"w": "sub/dir/x.safetensors"}, "format": "custom"});
    let index = parse(&value).unwrap();
    assert_eq!(
        index.shards(),
        [PathBuf::from("ckpt/sub/dir/x.safetensors")]
    );
}

#[test]
fn names_that_escape_or_are_not_plain_are_refused() {
    let cases = [
        ("/etc/passwd", "absolute"),
        ("../secret.safetensors", "`..`"),
        ("a/../../b.safetensors", "`..`"),
        ("a//b.safetensors", "empty component"),
        ("a/", "empty component"),
        ("./a.safetensors", "`.`"),
        ("a\\b.safetensors", "backslash"),
        ("", "empty"),
        ("a\0b", "NUL"),
    ];
    for (name, why) in cases {
        let value = json!({"weight_map": {"ok": "x.safetensors", "w": name}});
        assert_format(parse(&value), Some("w"), why);
    }
}

#[test]
fn an_empty_or_missing_weight_map_is_refused() {
    assert_format(parse(&json!({"weight_map": {}})), None, "no tensor");
    assert_format(parse(&json!({"metadata": {}})), None, "weight_map");
    assert_format(
        parse(&json!({"weight_map": {"w": 1}})),
        None,
        "not a checkpoint index",
    );
    assert_format(parse(&json!([])), None, "not a checkpoint index");
}

#[test]
fn invalid_json_is_refused() {
    let result = ShardIndex::parse(Path::new(INDEX), b"{\"weight_map\": {");
    assert_format(result, None, "not a checkpoint index");
}

#[test]
fn a_tensor_listed_twice_is_refused() {
    let json = br#"{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}"#;
    assert_format(
        ShardIndex::parse(Path::new(INDEX), json),
        Some("w"),
        "twice",
    );
}

#[test]
fn an_index_over_the_cap_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors.index.json");
    // A sparse file: its length is all that is inspected.
    std::fs::File::create(&path)
        .unwrap()
        .set_len(MAX_INDEX_LEN + 1)
        .unwrap();
    let error = ShardIndex::read(&path).unwrap_err();
    assert!(matches!(error, Error::Format { .. }), "{error:?}");
    assert!(error.to_string().contains("cap"), "{error}");
}

#[test]
fn read_reports_a_missing_file_and_reads_a_present_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors.index.json");
    assert!(matches!(ShardIndex::read(&path), Err(Error::Io { .. })));
    std::fs::write(
        &path,
        json!({"weight_map": {"w": "x.safetensors"}}).to_string(),
    )
    .unwrap();
    let index = ShardIndex::read(&path).unwrap();
    assert_eq!(index.shards(), [dir.path().join("x.safetensors")]);
}

#[test]
fn a_shard_that_matches_its_index_passes() {
    let index = two_shards();
    let first = header("ckpt/model-00001-of-00002.safetensors", &["a"]);
    let second = header(
        "ckpt/model-00002-of-00002.safetensors",
        &["b", "c", "extra"],
    );
    index.check_against(0, &first).unwrap();
    index.check_against(1, &second).unwrap();
}

#[test]
fn a_shard_missing_a_tensor_names_it() {
    let index = two_shards();
    let file = "ckpt/model-00002-of-00002.safetensors";
    let error = index.check_against(1, &header(file, &["b"])).unwrap_err();
    assert!(
        matches!(&error, Error::Format { tensor: Some(t), .. } if t == "c"),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(file) && message.contains("does not list it"),
        "{message}"
    );
}

#[test]
fn a_tensor_the_index_puts_in_another_shard_is_refused() {
    let index = two_shards();
    let file = "ckpt/model-00001-of-00002.safetensors";
    let error = index
        .check_against(0, &header(file, &["a", "b"]))
        .unwrap_err();
    assert!(
        matches!(&error, Error::Format { tensor: Some(t), .. } if t == "b"),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(file) && message.contains("00002"),
        "{message}"
    );
}

#[test]
fn a_shard_out_of_range_is_an_invalid_request() {
    let index = two_shards();
    let error = index.check_against(2, &header("x", &[])).unwrap_err();
    assert!(matches!(error, Error::Invalid(_)), "{error:?}");
}

proptest! {
    #[test]
    fn any_index_text_parses_or_errors_without_panicking(text in "\\PC{0,64}") {
        let _ = ShardIndex::parse(Path::new(INDEX), text.as_bytes());
    }

    #[test]
    fn every_tensor_maps_to_its_own_shard(
        map in prop::collection::btree_map("\\PC{0,8}", "[a-c]{1,2}(/[a-c]{1,2}){0,2}", 1..20),
    ) {
        let index = parse(&json!({"weight_map": map})).unwrap();
        let mut names: Vec<_> = map.values().collect();
        names.sort();
        names.dedup();
        prop_assert_eq!(index.shards().len(), names.len());
        for (tensor, shard) in &map {
            let path = &index.shards()[index.shard_of(tensor).unwrap()];
            prop_assert_eq!(path, &Path::new("ckpt").join(shard));
        }
    }
}
