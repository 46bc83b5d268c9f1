//! What tells the pool that the device work on a freed block has finished.

use cuda_pinned::PendingUses;

/// A source of completion for the device work that used a freed block: CUDA events
/// ([`PendingUses`]) in real use, a flag the test controls in the pool's own tests.
pub trait Completion: Send {
    /// Whether the work has finished. When the answer cannot be known (a CUDA error), the
    /// answer must be `false`: the block then stays out of reuse.
    fn is_complete(&mut self) -> bool;

    /// Blocks until the work has finished; `false` when that cannot be known, and the block
    /// is then leaked rather than freed.
    fn wait(&mut self) -> bool;
}

impl Completion for PendingUses {
    fn is_complete(&mut self) -> bool {
        self.poll().unwrap_or(false)
    }

    fn wait(&mut self) -> bool {
        PendingUses::wait(self).is_ok()
    }
}
