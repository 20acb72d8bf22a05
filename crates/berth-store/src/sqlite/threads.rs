//! The SQLite backend's connections, each owned by a thread of its own: one writer, which owns
//! the only read-write connection, and a few readers. An operation is one closure that runs
//! whole on one of them, on that connection's prepared statements.
//!
//! Why threads and not pooled async connections: sqlx's SQLite driver runs each statement on a
//! per-connection worker thread and hands every command and row across channels, so a write
//! transaction of seven statements cost fourteen thread wake-ups while it held the only write
//! lock. Here an operation is one hand-off in and one reply out, and its statements run back
//! to back.
//!
//! The writer batches: whatever queued while a batch ran becomes the next batch, in one
//! transaction with one commit (group commit). Each operation runs inside its own SAVEPOINT,
//! so one that fails is rolled back alone; none is answered before the COMMIT that made it
//! durable, and if that COMMIT fails every operation in the batch gets the error. A commit
//! fsyncs the WAL (`synchronous=FULL`) unless every operation in its batch was written with
//! [`Writer::write_unflushed`]. A reader runs each operation in a read transaction of its own,
//! so its statements see one snapshot.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};

use rusqlite::{Connection, Params, Row};
use tokio::sync::{oneshot, watch};

use crate::rows;
use crate::{Result, StoreError};

/// At most this many operations share one transaction, so one commit never waits on an
/// unbounded amount of work.
const MAX_BATCH: usize = 256;

pub(super) struct Writer {
    jobs: mpsc::Sender<Box<dyn Job>>,
}

impl Writer {
    /// Starts the writer thread. It ends when the last `Writer` handle is dropped and the
    /// queued operations have run.
    /// `written` gets the highest event id after every commit that wrote events.
    pub(super) fn spawn(conn: Connection, written: watch::Sender<u64>) -> std::io::Result<Writer> {
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new()
            .name("berth-sqlite-writer".to_string())
            .spawn(move || write_loop(conn, queue, written))?;
        Ok(Writer { jobs })
    }

    /// Runs `work` in the writer's transaction and returns its result once it is committed
    /// and flushed to disk. An `Err` from `work` rolls back only what `work` wrote.
    pub(super) async fn write<T, F>(&self, operation: &'static str, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Db<'_>) -> Result<T> + Send + 'static,
    {
        call(&self.jobs, operation, true, work).await
    }

    /// Like [`Writer::write`], but the commit need not wait for an fsync of its own: a power
    /// cut may lose it until the next flushed commit or checkpoint (a process crash cannot).
    /// Only for state that its writer sends again anyway, like heartbeats, so that liveness
    /// never costs a disk flush each.
    pub(super) async fn write_unflushed<T, F>(&self, operation: &'static str, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Db<'_>) -> Result<T> + Send + 'static,
    {
        call(&self.jobs, operation, false, work).await
    }
}

/// The read-only connections, each on a thread of its own, taking operations from one queue.
pub(super) struct Readers {
    jobs: mpsc::Sender<Box<dyn Job>>,
}

impl Readers {
    /// Starts one thread per connection. They end when the last `Readers` handle is dropped.
    pub(super) fn spawn(connections: Vec<Connection>) -> std::io::Result<Readers> {
        let (jobs, queue) = mpsc::channel();
        let queue = Arc::new(Mutex::new(queue));
        for (i, conn) in connections.into_iter().enumerate() {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(format!("berth-sqlite-reader-{i}"))
                .spawn(move || read_loop(conn, &queue))?;
        }
        Ok(Readers { jobs })
    }

    /// Runs `work` on the next free reader, in a read transaction (one snapshot).
    pub(super) async fn read<T, F>(&self, operation: &'static str, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Db<'_>) -> Result<T> + Send + 'static,
    {
        // A reader commits nothing, so there is nothing to flush.
        call(&self.jobs, operation, false, work).await
    }
}

/// Queues `work` for the thread(s) behind `jobs` and waits for its answer.
async fn call<T, F>(
    jobs: &mpsc::Sender<Box<dyn Job>>,
    operation: &'static str,
    flush: bool,
    work: F,
) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&Db<'_>) -> Result<T> + Send + 'static,
{
    let (reply, answer) = oneshot::channel();
    let job = Box::new(Pending {
        operation,
        flush,
        work: Some(work),
        outcome: None,
        reply,
    });
    jobs.send(job)
        .map_err(|_| StoreError::ThreadStopped { operation })?;
    answer
        .await
        .map_err(|_| StoreError::ThreadStopped { operation })?
}

fn read_loop(conn: Connection, queue: &Mutex<mpsc::Receiver<Box<dyn Job>>>) {
    loop {
        // One reader waits on the queue at a time; the others wait for the lock.
        let next = match queue.lock() {
            Ok(queue) => queue.recv(),
            Err(_) => return,
        };
        let Ok(mut job) = next else {
            return;
        };
        let snapshot = conn
            .prepare_cached("BEGIN")
            .and_then(|mut begin| begin.execute([]))
            .map_err(Arc::new);
        if snapshot.is_ok() {
            job.run(&conn);
            // Ends the read transaction; nothing was written, so nothing can fail to commit.
            let _ = conn
                .prepare_cached("ROLLBACK")
                .and_then(|mut end| end.execute([]));
        }
        job.finish(snapshot.as_ref().map(|_| ()));
    }
}

/// One queued operation, type-erased so operations of any result type share the queue.
trait Job: Send {
    /// Whether its commit must be flushed to disk before it is answered.
    fn flush(&self) -> bool;
    /// Runs the operation; false if what it wrote must be rolled back.
    fn run(&mut self, conn: &Connection) -> bool;
    /// Answers the caller once the batch's commit has succeeded (`Ok`) or failed.
    fn finish(self: Box<Self>, committed: std::result::Result<(), &Arc<rusqlite::Error>>);
}

struct Pending<T, F> {
    operation: &'static str,
    flush: bool,
    work: Option<F>,
    outcome: Option<Result<T>>,
    reply: oneshot::Sender<Result<T>>,
}

impl<T, F> Job for Pending<T, F>
where
    T: Send,
    F: FnOnce(&Db<'_>) -> Result<T> + Send,
{
    fn flush(&self) -> bool {
        self.flush
    }

    fn run(&mut self, conn: &Connection) -> bool {
        let Some(work) = self.work.take() else {
            return false;
        };
        let db = Db {
            conn,
            operation: self.operation,
        };
        // A panicking operation must not take its thread, and every later operation, with it.
        let outcome = catch_unwind(AssertUnwindSafe(|| work(&db))).unwrap_or_else(|_| {
            tracing::error!(operation = self.operation, "sqlite operation panicked");
            Err(StoreError::ThreadStopped {
                operation: self.operation,
            })
        });
        let ok = outcome.is_ok();
        self.outcome = Some(outcome);
        ok
    }

    fn finish(self: Box<Self>, committed: std::result::Result<(), &Arc<rusqlite::Error>>) {
        let operation = self.operation;
        let answer = match (committed, self.outcome) {
            // A failed operation was rolled back to its savepoint; its error stands.
            (Ok(()), Some(outcome)) | (Err(_), Some(outcome @ Err(_))) => outcome,
            (Err(source), _) => Err(StoreError::Sqlite {
                operation,
                source: source.clone(),
            }),
            (Ok(()), None) => Err(StoreError::ThreadStopped { operation }),
        };
        // The caller may have gone away (its request was dropped); the write stands regardless.
        let _ = self.reply.send(answer);
    }
}

fn write_loop(conn: Connection, queue: mpsc::Receiver<Box<dyn Job>>, written: watch::Sender<u64>) {
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(MAX_BATCH);
    // The connection opens with `synchronous=FULL`.
    let mut flushing = true;
    while let Ok(first) = queue.recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let flush = batch.iter().any(|job| job.flush());
        let committed = set_flushing(&conn, &mut flushing, flush)
            .and_then(|()| run_batch(&conn, &mut batch))
            .map_err(Arc::new);
        if committed.is_err() {
            // Leaves the connection usable for the next batch; it fails only if no
            // transaction is open, which is the state we want.
            let _ = conn.execute_batch("ROLLBACK");
        }
        for job in batch.drain(..) {
            job.finish(committed.as_ref().map(|_| ()));
        }
        if committed.is_ok() {
            announce_events(&conn, &written);
        }
    }
}

/// Wakes event readers after a commit that wrote events (triggers write them, so the writer
/// asks the table, not the operations). Committed already: a woken reader finds them.
fn announce_events(conn: &Connection, written: &watch::Sender<u64>) {
    let last = conn
        .prepare_cached("SELECT seq FROM sqlite_sequence WHERE name = 'events'")
        .and_then(|mut stmt| stmt.query_row([], |row| row.get::<_, i64>(0)));
    match last {
        Ok(last) => {
            let last = u64::try_from(last).unwrap_or(0);
            written.send_if_modified(|seen| std::mem::replace(seen, last) != last);
        }
        // No event written yet: `sqlite_sequence` has no row for the table.
        Err(rusqlite::Error::QueryReturnedNoRows) => {}
        Err(e) => {
            tracing::warn!(error = %berth_proto::error::ErrorChain(&e), "reading the last event id failed");
            written.send_modify(|_| {});
        }
    }
}

/// Switches commits between fsyncing the WAL (FULL) and not (NORMAL), outside a transaction.
/// In WAL mode a later FULL commit or a checkpoint flushes the NORMAL commits before it too.
fn set_flushing(conn: &Connection, flushing: &mut bool, flush: bool) -> rusqlite::Result<()> {
    if *flushing != flush {
        conn.pragma_update(None, "synchronous", if flush { "FULL" } else { "NORMAL" })?;
        *flushing = flush;
    }
    Ok(())
}

/// Runs every job of the batch in one transaction and commits it.
fn run_batch(conn: &Connection, batch: &mut [Box<dyn Job>]) -> rusqlite::Result<()> {
    // IMMEDIATE takes the write lock up front: a read lock upgraded later can fail with a
    // SQLITE_BUSY that no timeout resolves.
    conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
    for job in batch.iter_mut() {
        conn.prepare_cached("SAVEPOINT operation")?.execute([])?;
        if !job.run(conn) {
            conn.prepare_cached("ROLLBACK TO operation")?.execute([])?;
        }
        conn.prepare_cached("RELEASE operation")?.execute([])?;
    }
    conn.prepare_cached("COMMIT")?.execute([])?;
    Ok(())
}

/// One operation's view of the writer's open transaction: statements go through the
/// connection's prepared-statement cache, and failures are named after the operation.
pub(super) struct Db<'c> {
    conn: &'c Connection,
    operation: &'static str,
}

impl Db<'_> {
    /// Runs a statement that returns no rows; the number of rows it changed.
    pub(super) fn execute(&self, sql: &str, params: impl Params) -> Result<usize> {
        self.conn
            .prepare_cached(sql)
            .and_then(|mut stmt| stmt.execute(params))
            .map_err(self.error())
    }

    /// The first row, read by `read`, if there is one.
    pub(super) fn optional<T>(
        &self,
        sql: &str,
        params: impl Params,
        read: impl FnOnce(&Row<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let mut stmt = self.conn.prepare_cached(sql).map_err(self.error())?;
        let mut rows = stmt.query(params).map_err(self.error())?;
        match rows.next().map_err(self.error())? {
            Some(row) => read(row).map(Some),
            None => Ok(None),
        }
    }

    /// Exactly the first row; none is an error (the statement was expected to match).
    pub(super) fn one<T>(
        &self,
        sql: &str,
        params: impl Params,
        read: impl FnOnce(&Row<'_>) -> Result<T>,
    ) -> Result<T> {
        self.optional(sql, params, read)?
            .ok_or_else(|| self.error()(rusqlite::Error::QueryReturnedNoRows))
    }

    /// Every row, each read by `read`.
    pub(super) fn all<T>(
        &self,
        sql: &str,
        params: impl Params,
        read: impl Fn(&Row<'_>) -> Result<T>,
    ) -> Result<Vec<T>> {
        let mut stmt = self.conn.prepare_cached(sql).map_err(self.error())?;
        let mut rows = stmt.query(params).map_err(self.error())?;
        let mut all = Vec::new();
        while let Some(row) = rows.next().map_err(self.error())? {
            all.push(read(row)?);
        }
        Ok(all)
    }

    /// Maps a failed statement as `rows::db_error` does for sqlx: a known unique violation
    /// becomes `Conflict`, anything else keeps its source under the operation's name.
    fn error(&self) -> impl FnOnce(rusqlite::Error) -> StoreError {
        let operation = self.operation;
        move |source| {
            if let rusqlite::Error::SqliteFailure(e, Some(message)) = &source {
                if e.code == rusqlite::ErrorCode::ConstraintViolation {
                    if let Some(constraint) = rows::sqlite_unique_violation(message) {
                        return StoreError::Conflict { constraint };
                    }
                }
            }
            StoreError::Sqlite {
                operation,
                source: Arc::new(source),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn writer() -> Writer {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch("CREATE TABLE t (k TEXT PRIMARY KEY)")
            .expect("schema");
        Writer::spawn(conn, watch::channel(0).0).expect("spawn")
    }

    fn insert(key: &'static str) -> impl FnOnce(&Db<'_>) -> Result<usize> + Send {
        move |tx| tx.execute("INSERT INTO t (k) VALUES (?1)", [key])
    }

    async fn keys(writer: &Writer) -> Vec<String> {
        writer
            .write("read", |tx| {
                tx.all("SELECT k FROM t ORDER BY k", [], |row| {
                    row.get(0).map_err(|e| StoreError::Corrupt(e.to_string()))
                })
            })
            .await
            .expect("read")
    }

    /// Of operations sharing one batch, the one that fails is rolled back alone and reports its own error, the others commit.
    #[tokio::test]
    async fn a_failed_operation_does_not_take_its_batch_with_it() {
        let writer = writer();
        writer.write("seed", insert("taken")).await.expect("seed");
        // Queued at once behind a slow first operation, `a`, `dup` and `b` run in one batch.
        let (first, a, dup, b) = tokio::join!(
            writer.write("first", |_| {
                std::thread::sleep(Duration::from_millis(100));
                Ok(0)
            }),
            writer.write("a", insert("a")),
            writer.write("dup", |tx| {
                // Writes, then fails: what it wrote must not survive.
                tx.execute("INSERT INTO t (k) VALUES ('partial')", [])?;
                insert("taken")(tx)
            }),
            writer.write("b", insert("b")),
        );
        first.expect("first");
        assert_eq!(a.expect("a"), 1);
        assert_eq!(b.expect("b"), 1);
        assert!(
            matches!(
                dup,
                Err(StoreError::Sqlite {
                    operation: "dup",
                    ..
                })
            ),
            "{dup:?}"
        );
        assert_eq!(keys(&writer).await, ["a", "b", "taken"]);
    }

    fn synchronous(db: &Db<'_>) -> Result<i64> {
        db.one("PRAGMA synchronous", [], |row| {
            row.get(0).map_err(|e| StoreError::Corrupt(e.to_string()))
        })
    }

    /// A batch of only unflushed operations commits with NORMAL (1); one flushed operation
    /// makes its whole batch FULL (2), whatever ran before.
    #[tokio::test]
    async fn a_batch_is_flushed_when_any_of_its_operations_must_be() {
        let conn = Connection::open_in_memory().expect("open");
        conn.pragma_update(None, "synchronous", "FULL")
            .expect("full");
        let writer = Writer::spawn(conn, watch::channel(0).0).expect("spawn");
        assert_eq!(writer.write_unflushed("hb", synchronous).await.unwrap(), 1);
        assert_eq!(writer.write("task", synchronous).await.unwrap(), 2);
        assert_eq!(writer.write_unflushed("hb", synchronous).await.unwrap(), 1);
        // Queued at once behind a slow first operation, the two probes share a batch.
        let (_, unflushed, flushed) = tokio::join!(
            writer.write_unflushed("first", |_| {
                std::thread::sleep(Duration::from_millis(100));
                Ok(0)
            }),
            writer.write_unflushed("hb", synchronous),
            writer.write("task", synchronous),
        );
        assert_eq!((unflushed.unwrap(), flushed.unwrap()), (2, 2));
    }

    /// A panicking operation is answered with an error, rolled back, and the writer goes on.
    #[tokio::test]
    async fn a_panicking_operation_does_not_stop_the_writer() {
        let writer = writer();
        let panicked = writer
            .write("boom", |tx| -> Result<()> {
                tx.execute("INSERT INTO t (k) VALUES ('before-panic')", [])?;
                panic!("boom")
            })
            .await;
        assert!(
            matches!(
                panicked,
                Err(StoreError::ThreadStopped { operation: "boom" })
            ),
            "{panicked:?}"
        );
        writer.write("after", insert("after")).await.expect("after");
        assert_eq!(keys(&writer).await, ["after"]);
    }

    /// A batch whose commit fails answers every operation in it with that error: none of
    /// them is acknowledged.
    #[tokio::test]
    async fn a_failed_commit_fails_every_operation_of_the_batch() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch(
            "CREATE TABLE parent (id INTEGER PRIMARY KEY); \
             CREATE TABLE child (p INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED); \
             PRAGMA foreign_keys = ON;",
        )
        .expect("schema");
        let writer = Writer::spawn(conn, watch::channel(0).0).expect("spawn");
        // Queued at once behind a slow first operation, `good` and `orphan` run in one batch
        // (with `first` too, unless the writer took it before they were queued).
        let (_, good, orphan) = tokio::join!(
            writer.write("first", |_| {
                std::thread::sleep(Duration::from_millis(100));
                Ok(0)
            }),
            writer.write("good", |tx| tx
                .execute("INSERT INTO parent (id) VALUES (1)", [])),
            // A deferred foreign key is checked only at COMMIT, which then fails.
            writer.write("orphan", |tx| tx
                .execute("INSERT INTO child (p) VALUES (42)", [])),
        );
        for (name, answer) in [("good", good), ("orphan", orphan)] {
            assert!(
                matches!(&answer, Err(StoreError::Sqlite { operation, .. }) if *operation == name),
                "{name}: {answer:?}"
            );
        }
        let parents = writer
            .write("count", |tx| {
                tx.one("SELECT count(*) FROM parent", [], |row| {
                    row.get::<_, i64>(0)
                        .map_err(|e| StoreError::Corrupt(e.to_string()))
                })
            })
            .await
            .expect("count");
        assert_eq!(parents, 0, "the failed batch was rolled back");
    }
}
