//! Group execution on PostgreSQL: concurrent calls of one operation run together, as one
//! statement or one short transaction over arrays, instead of a transaction and a handful of
//! round trips each. This is what SQLite's writer thread does by committing whatever queued
//! while it was busy (`sqlite/threads.rs`); on PostgreSQL every round trip also costs the
//! database process a wake-up, a parse-bind-execute and, for a commit, a WAL flush, so the task
//! path's throughput is set by how many statements a task takes, not by the rows it touches.
//!
//! A batcher has a few worker tasks. Each takes whatever calls are queued (at most
//! [`MAX_BATCH`]), runs them as one batch and answers each. While every worker is busy, calls
//! queue up and go together in the next batch; when one is idle, a call runs at once, alone,
//! so a quiet server adds no latency. A batch may *decline* a call: it hands the input back
//! and the caller runs the operation's own single-call transaction, which decides every case
//! the batch does not (an idempotency key already taken, a cordoned agent, a queue cap, an
//! unrunnable head) and any call of a batch that failed as a whole. Both paths read and write
//! the same rows under the same locks, so a call decided either way is decided the same.
//!
//! A call whose caller has gone (its future dropped while it queued) is withdrawn: the next
//! batch leaves it out, as a request that never arrived. One that goes while its batch runs is
//! decided all the same, as a request whose client went away mid-transaction would be; its
//! answer, undeliverable, goes to the operation's `undelivered` hook, which undoes what must
//! not outlive the caller (a claim's lease: `task_batches.rs`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use crate::{BatchStats, Result, StoreError};

/// Most calls one batch takes: enough to share a round trip widely, few enough that a batch's
/// arrays and locks stay small.
const MAX_BATCH: usize = 64;

/// A call's answer: decided by the batch, or its input handed back to run alone.
pub(super) type Decided<I, O> = std::result::Result<O, I>;

type Job<I, O> = (I, oneshot::Sender<Decided<I, O>>);

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    decided: AtomicU64,
    declined: AtomicU64,
}

pub(super) struct Batcher<I, O> {
    queue: mpsc::UnboundedSender<Job<I, O>>,
    counters: Arc<Counters>,
    /// The operation's name, for the error when a worker is gone.
    operation: &'static str,
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts `workers` tasks running `run_batch` over whatever is queued. `run_batch` answers
    /// every input, in order; a decided answer whose caller has gone meanwhile is handed to
    /// `undelivered`. The workers stop once the batcher is dropped and the queue is drained.
    pub(super) fn start<F, Fut, U>(
        operation: &'static str,
        workers: usize,
        run_batch: F,
        undelivered: U,
    ) -> Batcher<I, O>
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Decided<I, O>>> + Send,
        U: Fn(O) + Send + Sync + 'static,
    {
        let (queue, received) = mpsc::unbounded_channel::<Job<I, O>>();
        let received = Arc::new(Mutex::new(received));
        let run_batch = Arc::new(run_batch);
        let undelivered = Arc::new(undelivered);
        let counters = Arc::new(Counters::default());
        for _ in 0..workers {
            let received = received.clone();
            let run_batch = run_batch.clone();
            let undelivered = undelivered.clone();
            let counters = counters.clone();
            tokio::spawn(async move {
                loop {
                    // The queue's lock is held only while taking: the next worker takes the
                    // calls that arrive while this one runs its batch.
                    let jobs = {
                        let mut received = received.lock().await;
                        let Some(first) = received.recv().await else {
                            return;
                        };
                        let mut jobs = vec![first];
                        while jobs.len() < MAX_BATCH {
                            match received.try_recv() {
                                Ok(job) => jobs.push(job),
                                Err(_) => break,
                            }
                        }
                        jobs
                    };
                    // Withdrawn: nobody waits for these answers, and nothing was done yet.
                    let jobs: Vec<Job<I, O>> = jobs
                        .into_iter()
                        .filter(|(_, reply)| !reply.is_closed())
                        .collect();
                    if jobs.is_empty() {
                        continue;
                    }
                    let (inputs, replies): (Vec<I>, Vec<_>) = jobs.into_iter().unzip();
                    let answers = run_batch(inputs).await;
                    debug_assert_eq!(answers.len(), replies.len());
                    let decided = answers.iter().filter(|a| a.is_ok()).count() as u64;
                    counters.batches.fetch_add(1, Ordering::Relaxed);
                    counters.decided.fetch_add(decided, Ordering::Relaxed);
                    let declined = answers.len() as u64 - decided;
                    counters.declined.fetch_add(declined, Ordering::Relaxed);
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        // A caller that went away does not want its answer; a decided one may
                        // need undoing. (A declined input just drops: nothing was done for it.)
                        if let Err(Ok(decided)) = reply.send(answer) {
                            undelivered(decided);
                        }
                    }
                }
            });
        }
        Batcher {
            queue,
            counters,
            operation,
        }
    }

    pub(super) fn stats(&self) -> BatchStats {
        BatchStats {
            operation: self.operation,
            batches: self.counters.batches.load(Ordering::Relaxed),
            decided: self.counters.decided.load(Ordering::Relaxed),
            declined: self.counters.declined.load(Ordering::Relaxed),
        }
    }

    /// Runs `input` in the next batch.
    pub(super) async fn run(&self, input: I) -> Result<Decided<I, O>> {
        let (reply, answer) = oneshot::channel();
        if let Err(mpsc::error::SendError((input, _))) = self.queue.send((input, reply)) {
            return Ok(Err(input));
        }
        answer.await.map_err(|_| StoreError::ThreadStopped {
            operation: self.operation,
        })
    }
}

/// Answers every input of a batch that could not run: each is handed back to run alone.
pub(super) fn decline_all<I, O>(inputs: Vec<I>) -> Vec<Decided<I, O>> {
    inputs.into_iter().map(Err).collect()
}
