//! Datasets read from files: each sample read into its place in a pinned batch with `pread`
//! and no mapping. A read passes through a small buffer of the reading thread's, which stays
//! in its core's caches, and reaches the batch with streaming stores
//! ([`read_at_streaming`](cuda_pinned::read_at_streaming)): the sample crosses main memory
//! once, as a read straight into the batch would.

use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

mod header;
mod npy;
mod records;

pub use npy::{NpyArray, NpyDataset, NpyElement, NpyFields};
pub use records::RecordDataset;

/// What can go wrong with a dataset's file: at open, or when a sample is read.
#[derive(Debug)]
#[non_exhaustive]
pub enum FileError {
    /// The file could not be opened, sized or read.
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        doing: &'static str,
        /// What the system said.
        source: io::Error,
    },
    /// The file's contents are not what the dataset reads: a header it refuses, sizes that do
    /// not fit, an element type other than the field's.
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file ended inside a sample: it shrank after it was opened.
    Shrunk {
        /// The file.
        path: PathBuf,
        /// The sample's index in the dataset.
        sample: usize,
        /// Where in the file the read found its end.
        offset: u64,
    },
}

impl FileError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            Self::Io { path, .. } | Self::Invalid { path, .. } | Self::Shrunk { path, .. } => path,
        }
    }

    pub(crate) fn invalid(path: &Path, reason: impl Into<String>) -> Self {
        Self::Invalid {
            path: path.to_owned(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io(path: &Path, doing: &'static str, source: io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            doing,
            source,
        }
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, doing, .. } => write!(f, "{}: {doing}", path.display()),
            Self::Invalid { path, reason } => write!(f, "{}: {reason}", path.display()),
            Self::Shrunk {
                path,
                sample,
                offset,
            } => write!(
                f,
                "{}: the file ends at byte {offset}, inside sample {sample} (it shrank after it \
                 was opened)",
                path.display()
            ),
        }
    }
}

/// The system's error is the [`source`](std::error::Error::source) of [`FileError::Io`], not
/// in its text too, so that a report of the chain names it once.
impl std::error::Error for FileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// An open file and its name, for errors.
#[derive(Debug)]
pub(crate) struct Source {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    /// What the page cache holds of the file; `None` where the kernel cannot say.
    pub(crate) probe: Option<cuda_pinned::PageCacheProbe>,
}

impl Source {
    /// Opens `path` for reading; returns it with its length. Anything but a regular file (a
    /// directory, named pipe, socket or device) is refused before it is opened.
    pub(crate) fn open(path: &Path) -> Result<(Self, u64), FileError> {
        let file =
            cuda_pinned::open_regular_file(path).map_err(|e| FileError::io(path, "opening", e))?;
        let len = file
            .metadata()
            .map_err(|e| FileError::io(path, "inspecting", e))?
            .len();
        // Miri maps no files: there the page cache cannot be asked.
        let probe = (!cfg!(miri))
            .then(|| cuda_pinned::PageCacheProbe::of(&file))
            .flatten();
        let source = Self {
            path: path.to_owned(),
            file,
            probe,
        };
        Ok((source, len))
    }

    /// Fills `into` from `offset` on, for sample `sample`: short reads are continued and
    /// interrupted ones retried; an end of file before `into` is full is an error.
    pub(crate) fn read_at(
        &self,
        into: &mut [u8],
        offset: u64,
        sample: usize,
    ) -> Result<(), FileError> {
        let mut done = 0;
        while done < into.len() {
            // Cannot overflow: the sample lay inside the file when it was opened.
            let at = offset + done as u64;
            match cuda_pinned::read_at_streaming(&self.file, &mut into[done..], at) {
                Ok(0) => {
                    return Err(FileError::Shrunk {
                        path: self.path.clone(),
                        sample,
                        offset: at,
                    });
                }
                Ok(read) => done += read,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FileError::io(&self.path, "reading", e)),
            }
        }
        Ok(())
    }

    /// Tells the kernel reads will come at random (a shuffled epoch): it then reads no more
    /// than asked for, instead of reading ahead what the next sample will not need.
    pub(crate) fn advise_random(&self) -> Result<(), FileError> {
        cuda_pinned::advise_random(&self.file)
            .map_err(|e| FileError::io(&self.path, "advising random reads", e))
    }

    /// Whether the page cache holds the byte at `offset`; `None` where the kernel cannot say
    /// (or the byte lies past the file's end when it was opened).
    pub(crate) fn cached_at(&self, offset: u64) -> Option<bool> {
        let probe = self.probe.as_ref().filter(|probe| offset < probe.len())?;
        Some(probe.holds(offset, 1))
    }

    /// Asks the kernel to start reading `len` bytes from `offset` into the page cache, and
    /// returns without waiting for them.
    pub(crate) fn will_need(&self, offset: u64, len: u64) {
        cuda_pinned::advise_will_need(&self.file, offset, len);
    }

    /// Starts reading the byte ranges `ranges` yields (a batch's samples, in order) side by
    /// side, where the first is not in the page cache: a cold batch's reads then reach the
    /// disk together, not one at a time, and a warm one pays a single question. Where the
    /// kernel cannot tell, nothing is asked: advice on every warm batch would cost more than
    /// it saves.
    pub(crate) fn read_ahead(&self, mut ranges: impl Iterator<Item = (u64, u64)>) {
        let Some((offset, len)) = ranges.next() else {
            return;
        };
        if self.cached_at(offset) != Some(false) {
            return;
        }
        self.will_need(offset, len);
        for (offset, len) in ranges {
            self.will_need(offset, len);
        }
    }
}
