//! Opening a user-named file without blocking on what is not a regular file.
//!
//! `open(2)` of a named pipe blocks until a writer comes, and opening a device can have
//! effects of its own (a tape rewinds, a terminal becomes the controlling one): a dataset or
//! a model archive can carry either. So the path is first looked at without being opened
//! (`O_PATH`), anything but a regular file is refused, and the very file looked at is then
//! opened through its descriptor's name under `/proc/self/fd`, without blocking: a path
//! swapped for something else in between is not followed. Where `/proc` is not mounted, the
//! path is opened again and checked to name the same file.

use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Opens `path` for reading if it is a regular file (after symbolic links), and refuses a
/// directory, named pipe, socket or device with an error of kind
/// [`InvalidInput`](io::ErrorKind::InvalidInput) that says which it is, before opening it.
///
/// Never blocks on a named pipe, and never opens a device.
///
/// # Examples
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// # if cfg!(miri) { return Ok(()); } // Miri's isolation refuses to open files.
/// let dir = tempfile::tempdir()?;
/// let error = cuda_pinned::open_regular_file(dir.path()).unwrap_err();
/// assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
/// assert_eq!(error.to_string(), "not a regular file: a directory");
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// What `open(2)` and `fstat(2)` return (a missing file, no permission), or the refusal.
pub fn open_regular_file(path: impl AsRef<Path>) -> io::Result<File> {
    let path = path.as_ref();
    if cfg!(miri) {
        // Miri knows no `O_PATH` or `O_NONBLOCK`; its file system has no pipes or devices.
        let file = File::open(path)?;
        refuse_unless_regular(&file.metadata()?)?;
        return Ok(file);
    }
    // A look at the path that opens nothing: no pipe waits, no device's open runs.
    let looked = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(path)?;
    refuse_unless_regular(&looked.metadata()?)?;
    let reading = || {
        let mut options = OpenOptions::new();
        options
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC);
        options
    };
    use std::os::fd::AsRawFd;
    let file = match reading().open(format!("/proc/self/fd/{}", looked.as_raw_fd())) {
        Ok(file) => file,
        // No /proc: by the path again, checked below to be the file looked at.
        Err(_) => reading().open(path)?,
    };
    let looked = looked.metadata()?;
    let opened = file.metadata()?;
    refuse_unless_regular(&opened)?;
    if (opened.dev(), opened.ino()) != (looked.dev(), looked.ino()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the file was replaced while it was opened",
        ));
    }
    // Reads of a regular file ignore the flag; cleared so that the descriptor is the plain
    // one its users expect.
    clear_nonblocking(&file)?;
    Ok(file)
}

fn refuse_unless_regular(metadata: &Metadata) -> io::Result<()> {
    let kind = metadata.file_type();
    let what = if kind.is_file() {
        return Ok(());
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a named pipe"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "neither a file nor a directory"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file: {what}"),
    ))
}

fn clear_nonblocking(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open (borrowed from `file`); F_GETFL reads its status flags only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above; F_SETFL changes the status flags of this open file description only.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;
    use std::sync::mpsc;
    use std::time::Duration;

    /// Runs `open_regular_file(path)` on a thread and gives up after a while: a blocking open
    /// fails the test instead of hanging the suite.
    fn open_in_time(path: &Path) -> io::Result<File> {
        let (sender, receiver) = mpsc::channel();
        let path = path.to_owned();
        std::thread::spawn(move || {
            let _ = sender.send(open_regular_file(&path));
        });
        receiver
            .recv_timeout(Duration::from_secs(10))
            .expect("the open blocked")
    }

    fn refusal(path: &Path) -> String {
        let error = open_in_time(path).expect_err("refused");
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{error}");
        error.to_string()
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri's file system has no pipes")]
    fn a_named_pipe_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("weights.safetensors");
        let name = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        assert_eq!(refusal(&fifo), "not a regular file: a named pipe");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri's isolation refuses to open files")]
    fn directories_devices_and_sockets_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(refusal(dir.path()), "not a regular file: a directory");
        assert_eq!(
            refusal(Path::new("/dev/null")),
            "not a regular file: a character device"
        );
        let socket = dir.path().join("socket");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert_eq!(refusal(&socket), "not a regular file: a socket");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri's isolation refuses to open files")]
    fn a_regular_file_opens_blocking_and_readable_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, b"bytes").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let mut file = open_in_time(&link).unwrap();
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "bytes");
        use std::os::fd::AsRawFd;
        // SAFETY: an open descriptor; F_GETFL only reads.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri's isolation refuses to open files")]
    fn a_missing_file_keeps_the_systems_error() {
        let error = open_in_time(Path::new("/nonexistent/weights")).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotFound);
    }
}
