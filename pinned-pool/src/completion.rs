//! What tells the pool that the device work on a freed block has finished.

use cuda_pinned::PendingUses;

/// A source of completion for the device work that used a freed block: CUDA events
/// ([`PendingUses`]) in real use, a flag the test controls in the pool's own tests.
///
/// # Safety
///
/// The pool reuses a block as soon as its completion says the work has finished, so the
/// answer is a promise that memory safety rests on. Implementors promise that:
/// - [`is_complete`](Self::is_complete) returns `true` only once no device work covered by
///   this completion can still read or write the block;
/// - [`wait`](Self::wait) returns `true` only once that is so, having blocked until then;
/// - where the pool makes one from a freed buffer's [`PendingUses`] (`From<PendingUses>`, for
///   `PinnedVec`s and allocator-api2 collections), the completion covers every use they
///   record: dropping them, or any of their events, breaks the first promise.
///
/// A panic in either method leaks the blocks concerned (never reuses them); the pool goes on
/// with the others, then lets the panic continue.
///
/// ```compile_fail
/// struct Always;
/// impl pinned_pool::Completion for Always { // error: the trait is `unsafe` to implement
///     fn is_complete(&mut self) -> bool { true }
///     fn wait(&mut self) -> bool { true }
/// }
/// ```
pub unsafe trait Completion: Send {
    /// Whether the work has finished. When the answer cannot be known (a CUDA error), the
    /// answer must be `false`: the block then stays out of reuse.
    fn is_complete(&mut self) -> bool;

    /// Blocks until the work has finished; `false` when that cannot be known, and the block
    /// is then leaked rather than freed.
    fn wait(&mut self) -> bool;
}

// SAFETY: the events were recorded after the block's last use on every stream that used it;
// a query or wait that fails answers `false`.
unsafe impl Completion for PendingUses {
    fn is_complete(&mut self) -> bool {
        self.poll().unwrap_or(false)
    }

    fn wait(&mut self) -> bool {
        PendingUses::wait(self).is_ok()
    }
}
