//! The crew: threads that live as long as the reader, each taking pieces of the jobs queued,
//! so that a read starts without starting threads.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::{Dma, Job, Ring, finish, lock};
use crate::error::Result;

struct Queue<D: Dma> {
    jobs: VecDeque<Arc<Job<D>>>,
    shutdown: bool,
}

struct Shared<D: Dma> {
    ring: Ring<D>,
    queue: Mutex<Queue<D>>,
    posted: Condvar,
}

/// The ring and the threads that move pieces through it.
pub(crate) struct Crew<D: Dma> {
    shared: Arc<Shared<D>>,
    workers: Vec<JoinHandle<()>>,
}

impl<D: Dma> Crew<D> {
    /// A crew of `threads` threads over `ring`; threads the system refuses to start leave
    /// their share to the others (and a reading caller).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`](crate::Error::Invalid) when not one thread starts.
    pub(crate) fn new(ring: Ring<D>, threads: usize) -> Result<Self> {
        let shared = Arc::new(Shared {
            ring,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                shutdown: false,
            }),
            posted: Condvar::new(),
        });
        let workers: Vec<_> = (0..threads)
            .filter_map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("pinned-io-{i}"))
                    .spawn(move || {
                        if shared.ring.dma.use_device().is_ok() {
                            shared.work();
                        }
                    })
                    .ok()
            })
            .collect();
        if workers.is_empty() {
            return Err(crate::Error::Invalid(
                "the system refused every reading thread".into(),
            ));
        }
        Ok(Self { shared, workers })
    }

    pub(crate) fn ring(&self) -> &Ring<D> {
        &self.shared.ring
    }

    /// Queues `job` for the crew and returns at once.
    pub(crate) fn submit(&self, job: &Arc<Job<D>>) {
        job.start();
        if job.exhausted() {
            return;
        }
        lock(&self.shared.queue).jobs.push_back(job.clone());
        self.shared.posted.notify_all();
    }

    /// Runs `job` with the crew and the calling thread, and returns once every piece's
    /// copies are queued; after a failure, once the stream is done with them.
    pub(crate) fn run(&self, job: &Arc<Job<D>>) -> Result<()> {
        self.submit(job);
        job.work(&self.shared.ring);
        job.wait_finished();
        finish(job, &self.shared.ring)
    }
}

impl<D: Dma> Shared<D> {
    /// A worker: takes pieces of the oldest queued job until shutdown.
    fn work(&self) {
        loop {
            let job = {
                let mut queue = lock(&self.queue);
                loop {
                    if queue.shutdown {
                        return;
                    }
                    queue.jobs.retain(|job| !job.exhausted());
                    if let Some(job) = queue.jobs.front() {
                        break job.clone();
                    }
                    queue = self
                        .posted
                        .wait(queue)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            // A panic in a piece is counted and fails its job (see `Counted`); the thread
            // goes on with the next.
            let worked =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.work(&self.ring)));
            if let Err(payload) = worked {
                // A panic's payload may panic when dropped: leaked.
                std::mem::forget(payload);
            }
        }
    }
}

impl<D: Dma> Drop for Crew<D> {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.posted.notify_all();
        for worker in self.workers.drain(..) {
            if let Err(payload) = worker.join() {
                std::mem::forget(payload);
            }
        }
    }
}
