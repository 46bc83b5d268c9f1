//! Work queued for a stream that other code may capture into a CUDA graph.
//!
//! A stream this crate did not create (adopted from cudarc or as a raw handle) may begin a
//! capture on another thread at any moment: cudarc's `CudaStream::begin_capture` is a safe
//! call. Work queued on it meanwhile goes into the graph instead of running, and runs at each
//! launch of that graph, when the host memory it reads or fills may be gone. A check before
//! the work is queued cannot close that window, and a check after it cannot see a capture
//! that began and ended inside it.
//!
//! So this crate queues such work on a companion stream of its own, forked from the adopted
//! stream by an event and joined back by another, and decides whether a capture took the
//! fork before it queues anything:
//!
//! 1. an event (the fork) is recorded on the adopted stream, and the companion waits for it;
//! 2. the companion's capture status and the fork's state are read. A fork recorded inside a
//!    capture joins the companion to it if the capture is still going (the companion then
//!    reads as capturing), and otherwise reports an error when queried (an event last
//!    recorded inside a capture does, once it ended). Either way nothing is queued: the
//!    companion is kept out of use for good and the call fails with [`Error::Capturing`].
//!    A fork recorded outside a capture keeps the companion out of every capture, so what
//!    follows runs now, ordered after the adopted stream's earlier work;
//! 3. the work goes on the companion, whose capture status is read again;
//! 4. an event (the join) is recorded on the companion, and the adopted stream waits for it
//!    as an external wait: should a capture have begun there meanwhile, its graph waits for
//!    the join at each launch instead of breaking.
//!
//! Streams this crate created need none of this: no safe code reaches their handles to
//! capture them.

use std::sync::{Mutex, PoisonError};

use crate::error::Error;
use crate::error::Result;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;
use crate::test_hooks::{Point, reached as hook};

/// Companions kept per device: more are made while all are busy, and dropped when returned.
const KEPT: usize = 16;

/// A stream of this crate's own with its fork and join events, lent to one call at a time.
struct Companion {
    stream: Stream,
    fork: Event,
    join: Event,
}

/// Idle companions, by device.
static IDLE: Mutex<Vec<(i32, Vec<Companion>)>> = Mutex::new(Vec::new());

/// Runs `work`, which queues this crate's work for `stream`, on the stream itself or, for a
/// stream adopted from other code, on a companion stream fenced as the module says. Refuses a
/// stream capturing a graph ([`Error::Capturing`]) before anything is queued. Runs with the
/// stream's device current.
pub(crate) fn enqueue<R>(stream: &Stream, work: impl FnOnce(&Stream) -> Result<R>) -> Result<R> {
    crate::context::on_device(stream.device().raw(), || {
        stream.refuse_capture()?;
        if stream.is_adopted() {
            run(stream, work)
        } else {
            work(stream)
        }
    })
}

/// Runs `work` for `adopted` on a companion stream, fenced as the module says. Runs with the
/// stream's device current (the caller's `on_device`).
fn run<R>(adopted: &Stream, work: impl FnOnce(&Stream) -> Result<R>) -> Result<R> {
    let device = adopted.device().raw();
    let companion = take(device)?;
    hook(Point::BeforeFork);
    let forked = companion
        .fork
        .record_shared(adopted)
        .and_then(|()| companion.stream.wait_event(&companion.fork));
    hook(Point::AfterFork);
    // A fork that a capture took joined the companion to it (while the capture goes on) or
    // reports an error (once it ended): nothing may be queued then.
    let outside = forked
        .and_then(|()| companion.stream.is_capturing())
        .and_then(|capturing| {
            if capturing {
                return Err(Error::Capturing);
            }
            companion.fork.query().map_err(|error| {
                if recorded_in_a_capture(&error) {
                    Error::Capturing
                } else {
                    error
                }
            })
        });
    if let Err(error) = outside {
        // It may be part of a capture: it is not lent again.
        return Err(retire(companion, error));
    }
    hook(Point::BeforeWork);
    let result = work(&companion.stream);
    hook(Point::AfterWork);
    match companion.stream.is_capturing() {
        Ok(false) => {}
        // The work cannot have joined a capture (it waits only for events recorded outside
        // one); should it have, the companion is never joined back, so no graph holds it.
        Ok(true) => return Err(retire(companion, Error::Capturing)),
        Err(error) => return Err(retire(companion, error)),
    }
    let joined = companion
        .join
        .record_shared(&companion.stream)
        .and_then(|()| join(adopted, &companion.join));
    match joined {
        // A graph captured on the adopted stream waits for the join event at each launch:
        // the companion, and the event with it, is kept for good.
        Ok(Join::External) => drop(retire(companion, Error::Capturing)),
        Ok(Join::Plain) => give(device, companion),
        Err(error) => return Err(retire(companion, error)),
    }
    result
}

/// How the adopted stream was made to wait for the join.
enum Join {
    Plain,
    /// As a node of a graph being captured there.
    External,
}

/// Whether `error` is what querying an event last recorded inside a capture answers: 907
/// while the capture goes on, an invalid value once it ended.
fn recorded_in_a_capture(error: &Error) -> bool {
    use cuda_pinned_sys::driver::CUresult;
    match error {
        Error::Driver(e) => {
            e.code() == CUresult::CUDA_ERROR_INVALID_VALUE.0
                || e.code() == CUresult::CUDA_ERROR_CAPTURED_EVENT.0
        }
        Error::Cuda(e) => {
            e.raw() == cuda_pinned_sys::cudaError::cudaErrorInvalidValue
                || e.raw() == cuda_pinned_sys::cudaError::cudaErrorCapturedEvent
        }
        _ => false,
    }
}

/// Makes `adopted` wait for `join`: as an external wait where a capture began on it meanwhile
/// (its graph then waits for the join at each launch; a plain wait for an event recorded
/// outside the capture would break it), plainly otherwise (CUDA refuses the external wait
/// outside a capture, as it does when the capture ends between the check and the wait).
fn join(adopted: &Stream, join: &Event) -> Result<Join> {
    if adopted.is_capturing()? {
        match adopted.wait_event_external(join) {
            Err(Error::Cuda(e)) if e.raw() == cuda_pinned_sys::cudaError::cudaErrorIllegalState => {
            }
            other => return other.map(|()| Join::External),
        }
    }
    adopted.wait_event(join).map(|()| Join::Plain)
}

/// An idle companion of `device` whose last work was seen finished, the first idle one
/// otherwise, or a new one.
fn take(device: i32) -> Result<Companion> {
    {
        let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, list)) = idle.iter_mut().find(|(d, _)| *d == device)
            && !list.is_empty()
        {
            let position = list
                .iter()
                .position(|c| c.join.query().unwrap_or(false))
                .unwrap_or(0);
            return Ok(list.swap_remove(position));
        }
    }
    let device = crate::Device::from_raw(device);
    Ok(Companion {
        stream: Stream::on(device)?,
        fork: Event::untimed_on(device)?,
        join: Event::untimed_on(device)?,
    })
}

fn give(device: i32, companion: Companion) {
    let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
    let list = match idle.iter().position(|(d, _)| *d == device) {
        Some(i) => &mut idle[i].1,
        None => {
            idle.push((device, Vec::new()));
            &mut idle.last_mut().expect("pushed").1
        }
    };
    if list.len() < KEPT {
        list.push(companion);
    }
}

/// Keeps a companion that may be part of a capture out of use for good (destroying a stream
/// that a capture holds could break that capture's end), and returns `error`.
fn retire(companion: Companion, error: Error) -> Error {
    std::mem::forget(companion);
    error
}

#[cfg(test)]
mod tests {
    //! A capture begun by other code on an adopted stream inside a call, made to happen at
    //! chosen points of the call every time (on the test's own thread: CUDA itself crashes
    //! when one thread queues work on a stream while another begins or ends a capture on it).

    #[cfg(feature = "cudarc")]
    mod capture {
        use std::cell::RefCell;
        use std::rc::Rc;
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};

        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        use cudarc::driver::{CudaContext, CudaGraph, CudaStream, DriverError};

        use crate::test_hooks::{self, Point};
        use crate::{DeviceBuffer, Error, PinnedVec, Stream};

        type Ended = Result<Option<CudaGraph>, DriverError>;

        /// Where the capture begins, and where it ends (`None`: after the call).
        const CASES: [(Point, Option<Point>); 4] = [
            (Point::BeforeFork, None),
            (Point::BeforeFork, Some(Point::AfterFork)),
            (Point::BeforeWork, None),
            (Point::BeforeWork, Some(Point::AfterWork)),
        ];

        /// Whether the fence lets the call's work run in `case`: only when the capture began
        /// after the fork was found outside every capture.
        fn runs(case: (Point, Option<Point>)) -> bool {
            case.0 == Point::BeforeWork
        }

        /// Runs `call` with a capture on `stream` begun and ended as `case` says; returns the
        /// call's result and what ending the capture gave.
        fn with_capture<R>(
            stream: &Arc<CudaStream>,
            (begin, end): (Point, Option<Point>),
            call: impl FnOnce() -> R,
        ) -> (R, Ended) {
            let ended: Rc<RefCell<Option<Ended>>> = Rc::default();
            let (capturing, slot) = (stream.clone(), ended.clone());
            let hook = move |point| {
                if point == begin {
                    capturing
                        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                        .unwrap();
                } else if Some(point) == end {
                    *slot.borrow_mut() = Some(capturing.end_capture(CUgraphInstantiate_flags(0)));
                }
            };
            let result = test_hooks::with(hook, call);
            let ended = ended
                .borrow_mut()
                .take()
                .unwrap_or_else(|| stream.end_capture(CUgraphInstantiate_flags(0)));
            (result, ended)
        }

        fn cudarc_stream() -> Arc<CudaStream> {
            CudaContext::new(0).unwrap().new_stream().unwrap()
        }

        /// Launches the graph a capture gave, if any, twice, and waits for the stream, which
        /// waits for the call's work (directly, or through the graph's external wait).
        fn launch_twice(stream: &Arc<CudaStream>, ended: &Ended) {
            if let Ok(Some(graph)) = ended {
                graph.launch().unwrap();
                graph.launch().unwrap();
            }
            stream.synchronize().unwrap();
        }

        /// One capture test at a time: a device-wide call of one (a context's synchronize, a
        /// free) would break the other's capture.
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

        /// A host function runs once when the fence let it be queued and never otherwise,
        /// however often a graph captured meanwhile is launched.
        #[test]
        #[ignore = "needs a CUDA device"]
        fn a_host_function_runs_once_or_never_whatever_a_capture_does() {
            let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
            for case in CASES {
                let cudarc = cudarc_stream();
                let stream = Stream::from_cudarc(&cudarc).unwrap();
                let count = Arc::new(AtomicUsize::new(0));
                let counter = count.clone();
                let function = move || {
                    counter.fetch_add(1, Ordering::SeqCst);
                };
                let (launched, ended) =
                    with_capture(&cudarc, case, || stream.launch_host_fn(function));
                launch_twice(&cudarc, &ended);
                let count = count.load(Ordering::SeqCst);
                if runs(case) {
                    launched.unwrap();
                    assert_eq!(count, 1, "{case:?}");
                    assert!(matches!(ended, Ok(Some(_))), "{case:?}: the capture broke");
                } else {
                    assert!(
                        matches!(launched, Err(Error::Capturing)),
                        "{case:?}: {launched:?}"
                    );
                    assert_eq!(count, 0, "{case:?}");
                }
            }
        }

        /// A copy runs now when the fence let it be queued, and is refused with nothing
        /// queued otherwise; no graph captured meanwhile copies anything when launched.
        #[test]
        #[ignore = "needs a CUDA device"]
        fn a_copy_runs_now_or_not_at_all_whatever_a_capture_does() {
            let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
            for case in CASES {
                let cudarc = cudarc_stream();
                let stream = Stream::from_cudarc(&cudarc).unwrap();
                let mut device = DeviceBuffer::<u32>::zeroed(1 << 16).unwrap();
                let host = PinnedVec::from_slice(&vec![7u32; 1 << 16]).unwrap();
                let (copied, ended) =
                    with_capture(&cudarc, case, || stream.copy_to_device(host, &mut device));
                let expected = if runs(case) {
                    // Back after the copy ran; overwritten, it must not reach the device.
                    let mut host = copied.unwrap().wait().unwrap();
                    host.fill(9);
                    assert!(matches!(ended, Ok(Some(_))), "{case:?}: the capture broke");
                    7
                } else {
                    assert!(
                        matches!(copied, Err(Error::Capturing)),
                        "{case:?}: {copied:?}"
                    );
                    0
                };
                launch_twice(&cudarc, &ended);
                let on_device = device.to_vec().unwrap();
                assert!(on_device.iter().all(|&x| x == expected), "{case:?}");
            }
        }
    }
}
