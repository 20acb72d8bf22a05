//! Group commit for heartbeats: handlers queue a record and wait; one writer drains whatever is
//! queued and commits it in one transaction, so N concurrent heartbeats cost one flush, not N.
//!
//! A heartbeat is acknowledged only after its transaction committed. Nothing waits on a timer:
//! under low load a batch is one record, under load batches grow by themselves.

use berth_proto::error::ErrorChain;
use berth_store::{DynStore, HeartbeatOutcome, HeartbeatRecord};
use tokio::sync::{mpsc, oneshot, Mutex};

use crate::infra::metrics::Metrics;

const MAX_BATCH: usize = 2048;
const QUEUE: usize = 16 * 1024;

type Reply = oneshot::Sender<Result<HeartbeatOutcome, ()>>;

pub struct HeartbeatWriter {
    queue: Mutex<Option<mpsc::Sender<(HeartbeatRecord, Reply)>>>,
    writer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    #[error("the heartbeat writer has stopped")]
    Stopped,
    #[error("the heartbeat could not be stored")]
    Store,
}

impl HeartbeatWriter {
    pub fn spawn(store: DynStore, metrics: Metrics) -> HeartbeatWriter {
        let (tx, rx) = mpsc::channel(QUEUE);
        let writer = tokio::spawn(write_batches(store, metrics, rx));
        HeartbeatWriter {
            queue: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
        }
    }

    /// Queues the heartbeat and waits for its commit.
    pub async fn record(
        &self,
        record: HeartbeatRecord,
    ) -> Result<HeartbeatOutcome, HeartbeatError> {
        let sender = self
            .queue
            .lock()
            .await
            .clone()
            .ok_or(HeartbeatError::Stopped)?;
        let (reply, answer) = oneshot::channel();
        sender
            .send((record, reply))
            .await
            .map_err(|_| HeartbeatError::Stopped)?;
        match answer.await {
            Ok(Ok(applied)) => Ok(applied),
            Ok(Err(())) => Err(HeartbeatError::Store),
            Err(_) => Err(HeartbeatError::Stopped),
        }
    }

    /// Stops taking heartbeats and waits until the queued ones are written.
    pub async fn close(&self) {
        self.queue.lock().await.take();
        if let Some(writer) = self.writer.lock().await.take() {
            let _ = writer.await;
        }
    }
}

async fn write_batches(
    store: DynStore,
    metrics: Metrics,
    mut rx: mpsc::Receiver<(HeartbeatRecord, Reply)>,
) {
    let mut records = Vec::with_capacity(MAX_BATCH);
    let mut replies = Vec::with_capacity(MAX_BATCH);
    while let Some((record, reply)) = rx.recv().await {
        records.push(record);
        replies.push(reply);
        while records.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok((record, reply)) => {
                    records.push(record);
                    replies.push(reply);
                }
                Err(_) => break,
            }
        }
        match store.record_heartbeats(&records).await {
            Ok(applied) => {
                metrics.heartbeat_batch(records.len());
                for (reply, applied) in replies.drain(..).zip(applied) {
                    let _ = reply.send(Ok(applied));
                }
            }
            Err(e) => {
                tracing::error!(error = %ErrorChain(&e), batch = records.len(), "writing heartbeats failed");
                metrics.error("heartbeat_store");
                for reply in replies.drain(..) {
                    let _ = reply.send(Err(()));
                }
            }
        }
        records.clear();
        replies.clear();
    }
}
