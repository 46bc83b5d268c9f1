//! What can go wrong while loading.

use std::fmt;

/// A dataset's own error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything a loader can report. A failed batch is reported once and skipped; the loader
/// stays usable (the next batch follows) unless the error says otherwise.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoaderError {
    /// The dataset failed to produce or write a sample.
    Sample {
        /// The batch's number in its epoch.
        batch: usize,
        /// The sample's index in the dataset.
        sample: usize,
        /// What the dataset said.
        source: BoxError,
    },
    /// The dataset panicked while producing or writing a sample (caught in the worker).
    Panicked {
        /// The batch's number in its epoch.
        batch: usize,
        /// The sample's index in the dataset.
        sample: usize,
        /// The panic's message.
        message: String,
    },
    /// A worker thread stopped while filling this batch (a panic the loader could not catch),
    /// or no worker is left to fill it.
    WorkerStopped {
        /// The batch's number in its epoch.
        batch: usize,
    },
    /// A setting that cannot work (a batch size of 0, a shard outside the world).
    Config(String),
    /// The pinned working set would pass the budget: pinned pages cannot be swapped, so a
    /// budget near the machine's memory starves everything else.
    PinnedBudget {
        /// Bytes the loader would pin.
        requested: u64,
        /// The budget: the stated fraction of the machine's memory.
        budget: u64,
        /// The machine's memory.
        total: u64,
    },
    /// Pinned memory or a CUDA call failed (the pool's limit among the causes).
    Cuda(cuda_pinned::Error),
    /// The dataset cannot be gathered on the device: its samples are not in pinned memory.
    NotPinned,
}

impl fmt::Display for LoaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sample { batch, sample, .. } => {
                write!(f, "batch {batch}, sample {sample}: the dataset failed")
            }
            Self::Panicked {
                batch,
                sample,
                message,
            } => write!(
                f,
                "batch {batch}, sample {sample}: the dataset panicked: {message}"
            ),
            Self::WorkerStopped { batch } => {
                write!(f, "batch {batch}: the loader's worker threads stopped")
            }
            Self::Config(what) => write!(f, "loader configuration: {what}"),
            Self::PinnedBudget {
                requested,
                budget,
                total,
            } => write!(
                f,
                "the loader would pin {requested} bytes, past its budget of {budget} bytes \
                 (a fraction of the machine's {total}); lower workers, prefetch or batch size, \
                 or raise `max_pinned_fraction`"
            ),
            Self::Cuda(e) => e.fmt(f),
            Self::NotPinned => f.write_str(
                "device gather needs a dataset whose samples sit in pinned memory \
                 (`PinnedSamples`)",
            ),
        }
    }
}

/// The cause of an error is its [`source`](std::error::Error::source), never in its text
/// too, so that a report of the chain names each cause once; [`LoaderError::Cuda`] only
/// wraps cuda-pinned's error, and is that error: its text and its source.
impl std::error::Error for LoaderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Sample { source, .. } => Some(&**source),
            Self::Cuda(e) => e.source(),
            _ => None,
        }
    }
}

impl From<cuda_pinned::Error> for LoaderError {
    fn from(e: cuda_pinned::Error) -> Self {
        Self::Cuda(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each cause appears once in a report of the chain: as a source, not in the text of
    /// the error it caused too.
    #[test]
    fn a_chain_names_each_cause_once() {
        let error = LoaderError::Sample {
            batch: 3,
            sample: 17,
            source: "the image is corrupt".into(),
        };
        assert_eq!(error.to_string(), "batch 3, sample 17: the dataset failed");
        assert_eq!(
            cuda_pinned::ErrorChain(&error).to_string(),
            "batch 3, sample 17: the dataset failed: the image is corrupt"
        );
        let wrapped = LoaderError::Cuda(cuda_pinned::Error::Os {
            call: "mlock",
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        });
        let chain = cuda_pinned::ErrorChain(&wrapped).to_string();
        assert_eq!(chain.matches("mlock failed").count(), 1, "{chain}");
    }
}
