//! Points inside calls where a unit test can act (begin or end a capture, say), to make a race
//! with another thread happen every time, on one thread. Outside the crate's unit tests the
//! points cost nothing.

#[cfg(test)]
use std::cell::RefCell;

/// Where a call has got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Point {
    /// The stream was checked for a capture; nothing is queued yet.
    BeforeFork,
    /// The fork is recorded and waited for; nothing has been checked since.
    AfterFork,
    /// The fork was found outside every capture; the work is next.
    BeforeWork,
    /// The work is queued; nothing has been checked after it.
    AfterWork,
}

#[cfg(test)]
type Hook = Box<dyn FnMut(Point)>;

#[cfg(test)]
thread_local! {
    static HOOK: RefCell<Option<Hook>> = const { RefCell::new(None) };
}

/// Runs `hook` at every point this thread reaches while `body` runs (the capture tests, which
/// need cudarc, use it).
#[cfg(all(test, feature = "cudarc"))]
pub(crate) fn with<R>(hook: impl FnMut(Point) + 'static, body: impl FnOnce() -> R) -> R {
    HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    let result = body();
    HOOK.with(|h| *h.borrow_mut() = None);
    result
}

#[cfg(not(test))]
#[inline(always)]
pub(crate) fn reached(_: Point) {}

#[cfg(test)]
pub(crate) fn reached(point: Point) {
    HOOK.with(|h| {
        if let Some(hook) = h.borrow_mut().as_mut() {
            hook(point);
        }
    });
}
