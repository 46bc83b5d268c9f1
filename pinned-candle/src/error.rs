//! This crate's errors are candle's, so that `?` works in a candle program: the workspace's
//! own errors travel wrapped, with their causes.

use std::fmt;

/// candle's result.
pub use candle_core::Result;

/// A workspace error as candle's. candle keeps a wrapped error as something to display only,
/// which would lose the causes the workspace's errors keep as sources: the whole chain is
/// its text.
pub(crate) fn wrap(error: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
    candle_core::Error::wrap(Chained(Box::new(error)))
}

struct Chained(Box<dyn std::error::Error + Send + Sync>);

impl fmt::Display for Chained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        cuda_pinned::ErrorChain(&*self.0).fmt(f)
    }
}
