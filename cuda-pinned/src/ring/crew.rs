//! The crew: threads that live as long as their owner, each taking pieces of the jobs
//! queued, so that a copy or a read starts without starting threads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{lock, wait};

/// A job the crew's threads take pieces of, with the context `C` they share (the ring).
pub trait CrewJob<C>: Send + Sync + 'static {
    /// Whether every piece has been taken: the job leaves the queue.
    fn exhausted(&self) -> bool;

    /// Takes pieces and moves them until none is left. `worker` numbers the thread (the
    /// crew's from 1 on). A panic fails the job, as the job's own guards see to; the thread
    /// goes on with the next job.
    fn work(&self, context: &C, worker: usize);
}

/// Which queued job an idle thread joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The oldest: jobs run one after another, each with every thread.
    Oldest,
    /// Thread `i` joins job `i % jobs`: jobs queued at once share the threads.
    Spread,
}

/// How a crew's threads are named, found and woken.
#[derive(Clone, Debug)]
pub struct CrewConfig {
    /// Threads to start.
    pub threads: usize,
    /// The threads' names: this, a dash and their number.
    pub name: &'static str,
    /// Which job an idle thread joins.
    pub pick: Pick,
    /// How long a thread that found no job watches for the next before it sleeps: waking a
    /// sleeping thread takes tens of microseconds on a virtual machine, which a program that
    /// copies in a loop pays at every copy.
    pub spin: Duration,
}

struct Queue<J> {
    jobs: VecDeque<Arc<J>>,
    shutdown: bool,
}

struct Shared<C, J> {
    context: C,
    queue: Mutex<Queue<J>>,
    posted: Condvar,
    /// Jobs posted so far: an idle thread watches it while it spins.
    posts: AtomicUsize,
    pick: Pick,
    spin: Duration,
}

/// Threads that take pieces of the jobs posted, sharing a context (the ring) and stopping
/// when the crew is dropped.
pub struct Crew<C, J> {
    shared: Arc<Shared<C, J>>,
    workers: Vec<JoinHandle<()>>,
}

impl<C, J> Crew<C, J>
where
    C: Send + Sync + 'static,
    J: CrewJob<C>,
{
    /// Starts the threads of `config`, each of which runs `prepare` first (making the device
    /// current) and leaves if it fails; threads that the system refuses to start, or that
    /// leave, leave their share to the others and to the posters, who work beside them.
    pub fn start(context: C, config: CrewConfig, prepare: fn(&C) -> bool) -> Self {
        let shared = Arc::new(Shared {
            context,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                shutdown: false,
            }),
            posted: Condvar::new(),
            posts: AtomicUsize::new(0),
            pick: config.pick,
            spin: config.spin,
        });
        let workers = (1..=config.threads)
            .filter_map(|index| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("{}-{index}", config.name))
                    .spawn(move || {
                        if prepare(&shared.context) {
                            shared.work(index);
                        }
                    })
                    .ok()
            })
            .collect();
        Self { shared, workers }
    }

    /// The context the threads share.
    pub fn context(&self) -> &C {
        &self.shared.context
    }

    /// Threads started.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Queues `job` and wakes `wake` threads for it (all, if more than there are).
    pub fn post(&self, job: &Arc<J>, wake: usize) {
        {
            // Counted under the lock: a thread checks the count under it before sleeping.
            let mut queue = lock(&self.shared.queue);
            queue.jobs.push_back(job.clone());
            self.shared.posts.fetch_add(1, Ordering::Release);
        }
        if wake >= self.workers.len() {
            self.shared.posted.notify_all();
        } else {
            for _ in 0..wake {
                self.shared.posted.notify_one();
            }
        }
    }

    /// Takes `job` out of the queue, if still there.
    pub fn withdraw(&self, job: &Arc<J>) {
        lock(&self.shared.queue)
            .jobs
            .retain(|queued| !Arc::ptr_eq(queued, job));
    }
}

impl<C, J: CrewJob<C>> Shared<C, J> {
    /// A thread: takes pieces of the queued jobs until shutdown.
    fn work(&self, index: usize) {
        loop {
            let seen = self.posts.load(Ordering::Acquire);
            let job = {
                let mut queue = lock(&self.queue);
                if queue.shutdown {
                    return;
                }
                queue.jobs.retain(|job| !job.exhausted());
                let at = match self.pick {
                    Pick::Oldest => 0,
                    Pick::Spread => index % queue.jobs.len().max(1),
                };
                queue.jobs.get(at).cloned()
            };
            let Some(job) = job else {
                self.idle(seen);
                continue;
            };
            // A panic in a piece fails its job (the job's guards see to it); the thread goes
            // on with the next.
            let worked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                job.work(&self.context, index)
            }));
            if let Err(payload) = worked {
                // A panic's payload may panic when dropped: leaked.
                std::mem::forget(payload);
            }
        }
    }

    /// Waits for a job posted after `seen` (or shutdown): watching for a moment, then asleep.
    fn idle(&self, seen: usize) {
        let watch = Instant::now();
        while watch.elapsed() < self.spin {
            if self.posts.load(Ordering::Acquire) != seen {
                return;
            }
            std::hint::spin_loop();
        }
        let queue = lock(&self.queue);
        if self.posts.load(Ordering::Acquire) == seen && !queue.shutdown {
            drop(wait(&self.posted, queue));
        }
    }
}

impl<C, J> Crew<C, J> {
    /// Stops the threads and waits until they have left (at once if stopped before): the
    /// context is then the caller's alone.
    pub fn stop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.posted.notify_all();
        for worker in self.workers.drain(..) {
            if let Err(payload) = worker.join() {
                // A panic's payload may panic when dropped: leaked.
                std::mem::forget(payload);
            }
        }
    }
}

impl<C, J> Drop for Crew<C, J> {
    fn drop(&mut self) {
        self.stop();
    }
}
