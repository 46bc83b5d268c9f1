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
//! stream by an event and joined back by another:
//!
//! 1. an event is recorded on the adopted stream, and the companion waits for it;
//! 2. the work goes on the companion;
//! 3. the companion's capture status is read. A companion joins a capture only by waiting for
//!    an event recorded inside one (step 1 is the way), and CUDA ends that capture with a
//!    graph only once every stream that joined it is joined back (otherwise it fails with
//!    `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`): a companion seen capturing is never joined back,
//!    the call fails with [`Error::Capturing`], and the capture fails too. A companion seen
//!    not capturing ran the work, or had it taken by a capture that already failed, in which
//!    case every event recorded in it reports an error when waited for, and the memory those
//!    events release is leaked instead;
//! 4. an event is recorded on the companion, and the adopted stream waits for it.
//!
//! Streams this crate created need none of this: no safe code reaches their handles to
//! capture them.

use std::sync::{Mutex, PoisonError};

use crate::error::Error;
use crate::error::Result;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;

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
    #[cfg(test)]
    crate::test_hooks::reached(crate::test_hooks::Point::BeforeFork);
    let forked = companion
        .fork
        .record_shared(adopted)
        .and_then(|()| companion.stream.wait_event(&companion.fork));
    if let Err(error) = forked {
        // The companion may have joined a capture through the fork: it is not lent again.
        return Err(retire(companion, error));
    }
    let result = work(&companion.stream);
    #[cfg(test)]
    crate::test_hooks::reached(crate::test_hooks::Point::AfterWork);
    match companion.stream.is_capturing() {
        Ok(false) => {}
        // Joined to a capture begun on the adopted stream: the work is in it, and that
        // capture cannot end with a graph unless this companion is joined back. It is not.
        Ok(true) => return Err(retire(companion, Error::Capturing)),
        Err(error) => return Err(retire(companion, error)),
    }
    let joined = companion
        .join
        .record_shared(&companion.stream)
        .and_then(|()| adopted.wait_event(&companion.join));
    give(device, companion);
    joined?;
    result
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
    //! one point of the call every time (on the test's own thread: CUDA itself crashes when
    //! one thread queues work on a stream while another begins or ends a capture on it).

    #[cfg(feature = "cudarc")]
    mod capture {
        use std::cell::RefCell;
        use std::rc::Rc;
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};

        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        use cudarc::driver::{CudaContext, CudaGraph, CudaStream, DriverError};

        use crate::containers::vec::PinnedVec;
        use crate::error::Error;
        use crate::gpu::buffer::DeviceBuffer;
        use crate::gpu::stream::Stream;
        use crate::test_hooks::{self, Point};

        type Ended = Rc<RefCell<Option<Result<Option<CudaGraph>, DriverError>>>>;

        /// Runs `call` with a capture begun on `stream` just before its work is queued, ended
        /// right after the work when `end_inside`, else after the call; returns the call's result
        /// and what ending the capture gave.
        fn with_capture<R>(
            stream: &Arc<CudaStream>,
            end_inside: bool,
            call: impl FnOnce() -> R,
        ) -> (R, Result<Option<CudaGraph>, DriverError>) {
            let ended: Ended = Rc::default();
            let (begin, end, slot) = (stream.clone(), stream.clone(), ended.clone());
            let hook = move |point| match point {
                Point::BeforeFork => begin
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .unwrap(),
                Point::AfterWork if end_inside => {
                    *slot.borrow_mut() = Some(end.end_capture(CUgraphInstantiate_flags(0)));
                }
                Point::AfterWork => {}
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

        /// A host function that a capture took in runs at most once, however often its graph is
        /// launched, and never when the call reported the capture.
        #[test]
        #[ignore = "needs a CUDA device"]
        fn a_host_function_taken_by_a_capture_runs_at_most_once() {
            for end_inside in [false, true] {
                let cudarc = cudarc_stream();
                let stream = Stream::from_cudarc(&cudarc).unwrap();
                let runs = Arc::new(AtomicUsize::new(0));
                let counter = runs.clone();
                let function = move || {
                    counter.fetch_add(1, Ordering::SeqCst);
                };
                let (launched, ended) =
                    with_capture(&cudarc, end_inside, || stream.launch_host_fn(function));
                if let Ok(Some(graph)) = &ended {
                    graph.launch().unwrap();
                    graph.launch().unwrap();
                }
                cudarc.synchronize().unwrap();
                let runs = runs.load(Ordering::SeqCst);
                assert!(
                    runs <= 1,
                    "ran {runs} times (capture ended inside: {end_inside})"
                );
                if launched.is_err() {
                    assert!(matches!(launched, Err(Error::Capturing)), "{launched:?}");
                    assert_eq!(runs, 0, "ran after its call reported the capture");
                }
                // The companion was never joined back: no graph can hold the function.
                assert!(!matches!(ended, Ok(Some(_))), "a graph holds it");
            }
        }

        /// A copy that a capture took in never gives its buffer back before the copy runs: either
        /// the call reports the capture, or waiting for it fails; and no graph holds the copy.
        #[test]
        #[ignore = "needs a CUDA device"]
        fn a_copy_taken_by_a_capture_keeps_its_buffer() {
            for end_inside in [false, true] {
                let cudarc = cudarc_stream();
                let stream = Stream::from_cudarc(&cudarc).unwrap();
                let mut device = DeviceBuffer::<u32>::zeroed(1 << 16).unwrap();
                let host = PinnedVec::from_slice(&vec![7u32; 1 << 16]).unwrap();
                let (copied, ended) = with_capture(&cudarc, end_inside, || {
                    stream.copy_to_device(host, &mut device)
                });
                let returned = copied.and_then(|transfer| transfer.wait());
                assert!(
                    returned.is_err(),
                    "the buffer came back (capture ended inside: {end_inside})"
                );
                assert!(!matches!(ended, Ok(Some(_))), "a graph holds the copy");
                cudarc.synchronize().unwrap();
                // The stream is usable afterwards, through a new companion.
                let mut fresh = DeviceBuffer::<u32>::zeroed(1 << 16).unwrap();
                let host = PinnedVec::from_slice(&vec![9u32; 1 << 16]).unwrap();
                stream
                    .copy_to_device(host, &mut fresh)
                    .unwrap()
                    .wait()
                    .unwrap();
                assert!(fresh.to_vec().unwrap().iter().all(|&x| x == 9));
            }
        }
    }
}
