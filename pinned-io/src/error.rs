//! What can go wrong between a file and the device.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything reading a file into pinned or device memory can report. A checkpoint's errors
/// name the file, and the tensor where one is at fault.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The operating system refused to open, inspect or read a file.
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        doing: &'static str,
        /// The operating system's error.
        source: io::Error,
    },
    /// A file's contents break its format (a checkpoint's header, an index, an array's header).
    Format {
        /// The file.
        path: PathBuf,
        /// The tensor at fault, where one is.
        tensor: Option<String>,
        /// What is wrong.
        problem: String,
    },
    /// A file ended before a byte its header or the caller asked for: it is shorter than its
    /// header says, or it shrank while being read.
    Truncated {
        /// The file.
        path: PathBuf,
        /// Where the read that came up short began.
        offset: u64,
        /// The bytes that read wanted.
        wanted: u64,
        /// The file's length when the read came up short.
        length: u64,
    },
    /// A request that cannot be met as asked: a range past a file's end, a destination of
    /// another length, a split of a tensor that does not divide, a setting out of range.
    Invalid(String),
    /// A load failed before this tensor landed (or before its end, for the load's iterator):
    /// a copy of the load's own error, shared by everything that waited, is the
    /// [`source`](std::error::Error::source); the load's [`wait`](crate::Loading::wait)
    /// returns the error itself.
    Failed(Arc<Error>),
    /// A load stopped before its end without an error of its own: dropped, or its device
    /// memory never came; says which.
    Stopped(&'static str),
    /// cuda-pinned's error: pinned memory, the device or a CUDA call failed, or the ring and
    /// threads beneath the reader did (a lost ring, a panicked or refused thread).
    Cuda(cuda_pinned::Error),
}

impl Error {
    pub(crate) fn io(path: &Path, doing: &'static str, source: io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            doing,
            source,
        }
    }

    pub(crate) fn format(path: &Path, tensor: Option<&str>, problem: impl Into<String>) -> Self {
        Self::Format {
            path: path.to_owned(),
            tensor: tensor.map(str::to_owned),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, doing, .. } => write!(f, "{}: {doing}", path.display()),
            Self::Format {
                path,
                tensor: Some(tensor),
                problem,
            } => write!(f, "{}: tensor `{tensor}`: {problem}", path.display()),
            Self::Format {
                path,
                tensor: None,
                problem,
            } => write!(f, "{}: {problem}", path.display()),
            Self::Truncated {
                path,
                offset,
                wanted,
                length,
            } => write!(
                f,
                "{}: the file ends at byte {length}, before the {wanted} bytes from byte {offset} \
                 were read (truncated, or shrinking while read)",
                path.display()
            ),
            Self::Invalid(message) => f.write_str(message),
            Self::Failed(_) => f.write_str("the checkpoint's load failed"),
            Self::Stopped(why) => write!(f, "the checkpoint's load stopped: {why}"),
            Self::Cuda(error) => write!(f, "{error}"),
        }
    }
}

/// The cause of an error is its [`source`](std::error::Error::source), never in its text
/// too, so that a report of the chain names each cause once; [`Error::Cuda`] only wraps
/// cuda-pinned's error, and is that error: its text and its source.
impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Failed(cause) => Some(&**cause),
            Self::Cuda(error) => error.source(),
            _ => None,
        }
    }
}

/// A copy, for errors handed to several waiters (the tensors of a failed load); an operating
/// system's error is copied by its code, or else by its kind and text.
impl Clone for Error {
    fn clone(&self) -> Self {
        match self {
            Self::Io {
                path,
                doing,
                source,
            } => Self::Io {
                path: path.clone(),
                doing,
                source: cuda_pinned::copy_io_error(source),
            },
            Self::Format {
                path,
                tensor,
                problem,
            } => Self::Format {
                path: path.clone(),
                tensor: tensor.clone(),
                problem: problem.clone(),
            },
            Self::Truncated {
                path,
                offset,
                wanted,
                length,
            } => Self::Truncated {
                path: path.clone(),
                offset: *offset,
                wanted: *wanted,
                length: *length,
            },
            Self::Invalid(message) => Self::Invalid(message.clone()),
            Self::Failed(cause) => Self::Failed(cause.clone()),
            Self::Stopped(why) => Self::Stopped(why),
            Self::Cuda(error) => Self::Cuda(error.clone()),
        }
    }
}

impl From<cuda_pinned::Error> for Error {
    fn from(error: cuda_pinned::Error) -> Self {
        Self::Cuda(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each cause appears once in a report of the chain: as a source, not in the text of
    /// the error it caused too.
    #[test]
    fn a_chain_names_each_cause_once() {
        let cause = io::Error::from_raw_os_error(libc::EISDIR);
        let error = Error::io(Path::new("w.safetensors"), "reading", cause);
        assert_eq!(error.to_string(), "w.safetensors: reading");
        let chain = cuda_pinned::ErrorChain(&error).to_string();
        let cause = io::Error::from_raw_os_error(libc::EISDIR).to_string();
        assert_eq!(chain, format!("w.safetensors: reading: {cause}"));
        let wrapped = Error::Cuda(cuda_pinned::Error::Os {
            call: "mmap",
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        });
        let chain = cuda_pinned::ErrorChain(&wrapped).to_string();
        assert_eq!(chain.matches("mmap failed").count(), 1, "{chain}");
        assert!(chain.ends_with(&io::Error::from_raw_os_error(libc::ENOMEM).to_string()));
    }

    /// A failed load's waiters get a copy of its error as their cause; the copy keeps the
    /// system's error code.
    #[test]
    fn a_failed_load_hands_each_waiter_its_error_as_the_cause() {
        let error = Error::io(
            Path::new("w.safetensors"),
            "reading",
            io::Error::from_raw_os_error(libc::EIO),
        );
        let waiter = Error::Failed(Arc::new(error.clone()));
        assert_eq!(waiter.to_string(), "the checkpoint's load failed");
        let chain = cuda_pinned::ErrorChain(&waiter).to_string();
        assert!(chain.starts_with("the checkpoint's load failed: w.safetensors: reading: "));
        let Error::Io { source, .. } = &error.clone() else {
            panic!("a copy of another kind");
        };
        assert_eq!(source.raw_os_error(), Some(libc::EIO));
        let stopped = Error::Stopped("it was dropped");
        assert_eq!(
            stopped.to_string(),
            "the checkpoint's load stopped: it was dropped"
        );
    }
}
