//! The way in: the reader's [`Engine`] (cuda-pinned's crew of threads over a reader's ring),
//! and the one entry for a read — [`Engine::run`] for a read whose caller waits,
//! [`Engine::start`] for one it follows ([`Reading`]).

use std::sync::Arc;
use std::time::Duration;

use cuda_pinned::ring::{self, CrewConfig, Dma, Pick};

use super::arrival::Destination;
use super::job::{Job, finish};
use super::ring::ReadRing;
use super::worker::Worker;
use crate::error::{Error, Result};

/// The reader's engine: its ring and the crew of threads that move pieces through it.
pub(crate) struct Engine<D: Dma> {
    crew: ring::Crew<ReadRing<D>, Job<D>>,
}

impl<D: Dma> Engine<D> {
    /// A crew of `threads` threads over `ring`; threads the system refuses to start leave
    /// their share to the others (and a reading caller).
    ///
    /// # Errors
    ///
    /// [`cuda_pinned::Error::NoThreads`] when not one thread starts.
    pub(crate) fn new(ring: ReadRing<D>, threads: usize) -> Result<Self> {
        let config = CrewConfig {
            threads,
            name: "pinned-io",
            // A load's first tensor comes first: every thread on the oldest job.
            pick: Pick::Oldest,
            // Reads come one load at a time, far apart: idle threads sleep at once.
            spin: Duration::ZERO,
        };
        let crew = ring::Crew::start(ring, config, |ring| ring.dma().use_device().is_ok());
        if crew.threads() == 0 {
            return Err(Error::Cuda(cuda_pinned::Error::NoThreads {
                what: "a file reader's",
            }));
        }
        Ok(Self { crew })
    }

    pub(crate) fn ring(&self) -> &ReadRing<D> {
        self.crew.context()
    }

    /// Queues `job` for the crew and returns at once.
    pub(crate) fn submit(&self, job: &Arc<Job<D>>) {
        job.start();
        if job.exhausted() {
            return;
        }
        self.crew.post(job, usize::MAX);
    }

    /// Runs `job` with the crew and the calling thread, and returns once every piece's
    /// copies are queued; after a failure, once the stream is done with them.
    pub(crate) fn run(&self, job: &Arc<Job<D>>) -> Result<()> {
        self.submit(job);
        self.worker(job).work();
        job.wait_finished();
        finish(job, self.ring())
    }

    /// Starts `job` (made by [`Job::to_come`]) with the crew, which reads its lead while the
    /// caller prepares the destination; the caller follows it through the [`Reading`].
    pub(crate) fn start(self: &Arc<Self>, job: Job<D>) -> Reading<D> {
        let job = Arc::new(job);
        self.submit(&job);
        Reading {
            job,
            crew: self.clone(),
        }
    }

    /// Names the destination of `job` (made by [`Job::to_come`]), once, and queues the pieces
    /// read for it so far, on the calling thread, in order.
    pub(crate) fn arrive(&self, job: &Job<D>, destination: Destination<D>) {
        self.worker(job).arrive(destination);
    }

    /// Fails `job`, whose destination will never come, with `error`, and gives back what
    /// waited for it.
    pub(crate) fn abandon(&self, job: &Job<D>, error: Error) {
        self.worker(job).abandon(error);
    }

    fn worker<'a>(&'a self, job: &'a Job<D>) -> Worker<'a, D> {
        Worker {
            job,
            ring: self.ring(),
        }
    }
}

/// A read started by [`Engine::start`]: named a destination once it exists, or abandoned;
/// waited for, or stopped.
pub(crate) struct Reading<D: Dma> {
    job: Arc<Job<D>>,
    crew: Arc<Engine<D>>,
}

impl<D: Dma> Reading<D> {
    /// The job, for its stream, its timing and its outcome.
    pub(crate) fn job(&self) -> &Job<D> {
        &self.job
    }

    /// Names the destination (once), and queues the pieces read for it so far, on the
    /// calling thread, in order.
    pub(crate) fn arrive(&self, destination: Destination<D>) {
        self.crew.arrive(&self.job, destination);
    }

    /// Fails a read whose destination will never come, with `error`, and gives back what
    /// waited for it.
    pub(crate) fn abandon(&self, error: Error) {
        self.crew.abandon(&self.job, error);
    }

    /// Fails the read with `error` if pieces are left to read: its threads skip them.
    pub(crate) fn stop(&self, error: Error) {
        if !self.job.exhausted() {
            self.job.fail(error);
        }
    }

    /// Waits until every piece is moved or skipped and the job's end has run.
    pub(crate) fn wait(&self) {
        self.job.wait_finished();
    }

    /// Waits as [`wait`](Self::wait), and returns the read's outcome: after a failure, once
    /// the stream is done with its copies.
    pub(crate) fn finish(&self) -> Result<()> {
        self.wait();
        finish(&self.job, self.crew.ring())
    }
}
