//! Points inside calls where a unit test can act (begin or end a capture, say), to make a race
//! with another thread happen every time, on one thread.

use std::cell::RefCell;

/// Where a call has got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Point {
    /// The stream was checked for a capture; nothing is queued yet.
    BeforeFork,
    /// The work is queued; nothing has been checked after it.
    AfterWork,
}

type Hook = Box<dyn FnMut(Point)>;

thread_local! {
    static HOOK: RefCell<Option<Hook>> = const { RefCell::new(None) };
}

/// Runs `hook` at every point this thread reaches while `body` runs.
pub(crate) fn with<R>(hook: impl FnMut(Point) + 'static, body: impl FnOnce() -> R) -> R {
    HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    let result = body();
    HOOK.with(|h| *h.borrow_mut() = None);
    result
}

pub(crate) fn reached(point: Point) {
    HOOK.with(|h| {
        if let Some(hook) = h.borrow_mut().as_mut() {
            hook(point);
        }
    });
}
