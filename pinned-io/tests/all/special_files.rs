//! Paths that name something other than a checkpoint's regular files: named pipes (whose
//! `open` would block until a writer came), directories, devices and sockets are refused
//! before anything is read; sizes that overflow together are refused at open.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use pinned_io::{Checkpoint, DataFile, Error};

/// Runs `open` on a thread and fails the test, rather than hang the suite, if it blocks.
fn in_time<T: Send + 'static>(open: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(open());
    });
    receiver
        .recv_timeout(Duration::from_secs(10))
        .expect("the open blocked")
}

fn mkfifo(path: &Path) {
    let name = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
}

/// A valid one-tensor checkpoint at `path`.
fn write_checkpoint(path: &Path) {
    let data = vec![1u8; 16];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![16], &data).unwrap();
    safetensors::serialize_to_file([("t", view)], None, path).unwrap();
}

/// The refusal of `path`, which must be an I/O error naming the file and saying what it is.
fn refused(result: Result<Checkpoint, Error>, path: &Path, what: &str) {
    let error = result.expect_err("refused");
    let Error::Io {
        path: at, source, ..
    } = &error
    else {
        panic!("not an I/O error: {error}");
    };
    assert_eq!(at, path, "{error}");
    assert_eq!(source.to_string(), format!("not a regular file: {what}"));
}

#[test]
fn a_named_pipe_is_refused_wherever_a_checkpoint_names_it() {
    let dir = tempfile::tempdir().unwrap();
    // Opened directly, as a file.
    let fifo = dir.path().join("model.safetensors");
    mkfifo(&fifo);
    let path = fifo.clone();
    let error = in_time(move || DataFile::open(&path)).expect_err("refused");
    let chain = cuda_pinned::ErrorChain(&error).to_string();
    assert!(
        chain.ends_with("not a regular file: a named pipe"),
        "{chain}"
    );
    let path = fifo.clone();
    refused(
        in_time(move || Checkpoint::open(path)),
        &fifo,
        "a named pipe",
    );

    // Listed in a directory beside a real shard.
    write_checkpoint(&dir.path().join("a.safetensors"));
    let listed = dir.path().to_owned();
    refused(
        in_time(move || Checkpoint::open(listed)),
        &fifo,
        "a named pipe",
    );

    // Named by an index, and an index that is a pipe itself.
    let sharded = tempfile::tempdir().unwrap();
    write_checkpoint(&sharded.path().join("a.safetensors"));
    let shard = sharded.path().join("b.safetensors");
    mkfifo(&shard);
    let index = sharded.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"weight_map": {"t": "a.safetensors", "u": "b.safetensors"}}"#,
    )
    .unwrap();
    let path = index.clone();
    refused(
        in_time(move || Checkpoint::open(path)),
        &shard,
        "a named pipe",
    );
    let piped = sharded.path().join("piped.safetensors.index.json");
    mkfifo(&piped);
    let path = piped.clone();
    refused(
        in_time(move || Checkpoint::open(path)),
        &piped,
        "a named pipe",
    );
}

#[test]
fn devices_and_sockets_are_refused() {
    let null = PathBuf::from("/dev/null");
    refused(Checkpoint::open(&null), &null, "a character device");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.safetensors");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    refused(Checkpoint::open(&socket), &socket, "a socket");
}

#[test]
fn shards_whose_sizes_overflow_together_are_refused_at_open() {
    // Sparse files take no space, but only a file system that holds files of 2^60 bytes
    // can carry them (tmpfs does; ext4 stops at 16 TiB).
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("skipped: no /dev/shm to hold sparse files of 2^60 bytes");
        return;
    };
    let huge = 1u64 << 60;
    for shard in 0..16 {
        let json = format!(
            r#"{{"t{shard}":{{"dtype":"U8","shape":[{huge}],"data_offsets":[0,{huge}]}}}}"#
        );
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        let path = dir.path().join(format!("{shard:02}.safetensors"));
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        if file.set_len(bytes.len() as u64 + huge).is_err() {
            eprintln!("skipped: /dev/shm takes no file of 2^60 bytes");
            return;
        }
    }
    let error = Checkpoint::open(dir.path()).expect_err("refused");
    let text = error.to_string();
    assert!(matches!(error, Error::Format { .. }), "{text}");
    assert!(text.contains("15.safetensors: tensor `t15`"), "{text}");
}
