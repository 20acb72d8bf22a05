//! Commit-ordered numbering, batched: the event ids and the audit chain on PostgreSQL.
//!
//! Both need an order that readers can trust: an event cursor must never skip an id that
//! becomes visible later, and an audit entry links to the entry before it. Computing either
//! inside the writing transaction means holding a lock through that transaction's commit, WAL
//! flush included, so every task creation and result in the cluster would take turns on it
//! (migration 0011's trigger, and a per-tenant lock for the chain). Instead a writer only
//! stages: the event row with `id` NULL (0011's row triggers) and the unlinked audit entry in
//! `audit_pending` (migration 0025), both in its own transaction, so they are as durable as
//! the change they describe. A *pass* then, under one cluster-wide advisory lock, numbers every
//! staged event it sees, links every pending entry, wakes the agents those events name and the
//! event streams, and commits: many writers' work shares one lock hold and one WAL flush.
//!
//! Passes run on every replica, for as long as staged rows are there: after any pooled
//! connection comes back to the pool (the main pool's `after_release` pokes), and once a
//! second as the sweep that finishes what a crashed replica staged. A reader that must see its
//! own writes (events, audit) first waits for a pass that began after it asked ([`flush`]),
//! so both read exactly as they did when the writers numbered them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use berth_proto::audit::AuditEntry;
use berth_proto::error::ErrorChain;
use berth_proto::TenantId;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::{oneshot, Mutex, Notify};
use uuid::Uuid;

use crate::domain::audit::{draft, link, parse};
use crate::rows::{db_error, ColumnReader};
use crate::{NewAuditEvent, Result, StoreError};

/// The LISTEN/NOTIFY channel that carries "this agent has something to claim" across replicas:
/// a sequencer pass notifies every agent that an event it numbered names.
pub(super) const TASK_CHANNEL: &str = "berth_tasks";
/// Notified by every sequencer pass that numbered events, on every replica's listener.
pub(super) const EVENT_CHANNEL: &str = "berth_events";

/// The one lock passes take turns on, cluster-wide (0011's trigger took the same key).
const SEQUENCER_LOCK: i64 = 7_301_542_390_455_211_101;
/// At most this many rows of each kind per pass; a pass that hit it is followed by another.
const EVENT_BATCH: i64 = 5_000;
const AUDIT_BATCH: i64 = 1_000;
/// The sweep: a pass even without a poke, for rows another replica staged and never numbered.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(5);
const OP: &str = "number events and link audit entries";

/// What the store shares with its sequencing task.
pub(super) struct Sequencer {
    /// Its own pool of one: passes take turns anyway, and one poking the main pool's
    /// `after_release` would poke itself.
    pool: PgPool,
    /// Poked whenever a pooled connection comes back: a writer may have staged something.
    poke: Arc<Notify>,
    /// One pass at a time in this process.
    turn: Mutex<()>,
    /// Tickets handed to readers that asked for a pass; `served` is the highest ticket that a
    /// committed pass began after.
    requested: AtomicU64,
    served: AtomicU64,
}

impl Sequencer {
    pub(super) fn new(pool: PgPool, poke: Arc<Notify>) -> Arc<Sequencer> {
        Arc::new(Sequencer {
            pool,
            poke,
            turn: Mutex::new(()),
            requested: AtomicU64::new(0),
            served: AtomicU64::new(0),
        })
    }

    /// Returns once a pass that began after this call has committed: everything the caller
    /// committed before is numbered and linked. Concurrent callers share one pass.
    pub(super) async fn flush(&self) -> Result<()> {
        let ticket = self.requested.fetch_add(1, Ordering::SeqCst) + 1;
        let _turn = self.turn.lock().await;
        if self.served.load(Ordering::SeqCst) >= ticket {
            return Ok(());
        }
        self.passes_locked(None).await.map(|_| ())
    }

    /// Links `event` at the head of its tenant's chain, after whatever is pending there, and
    /// returns its entry.
    pub(super) async fn append(&self, event: NewAuditEvent) -> Result<AuditEntry> {
        let _turn = self.turn.lock().await;
        let entry = self.passes_locked(Some(event)).await?;
        entry.ok_or_else(|| StoreError::Corrupt("an appended audit entry was not linked".into()))
    }

    /// Passes until one finds less than a full batch. Call with `turn` held.
    async fn passes_locked(&self, mut extra: Option<NewAuditEvent>) -> Result<Option<AuditEntry>> {
        let begun = self.requested.load(Ordering::SeqCst);
        let mut conn = self.pool.acquire().await.map_err(db_error(OP))?;
        let mut appended = None;
        loop {
            let pass = pass(&mut conn, &mut extra).await?;
            appended = appended.or(pass.appended);
            if !pass.full {
                break;
            }
        }
        self.served.fetch_max(begun, Ordering::SeqCst);
        Ok(appended)
    }
}

/// Runs passes when poked and once a second until `stop` fires or is dropped.
pub(super) async fn run(sequencer: Arc<Sequencer>, mut stop: oneshot::Receiver<()>) {
    let mut retry = Duration::from_millis(100);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            () = sequencer.poke.notified() => {}
            () = tokio::time::sleep(SWEEP_INTERVAL) => {}
        }
        let done = {
            let _turn = sequencer.turn.lock().await;
            sequencer.passes_locked(None).await
        };
        match done {
            Ok(_) => retry = Duration::from_millis(100),
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "numbering events and audit entries failed; retrying");
                tokio::select! {
                    _ = &mut stop => return,
                    () = tokio::time::sleep(retry) => {}
                }
                retry = (retry * 2).min(RETRY_MAX);
                // Not lost: the rows stay staged, and this pass runs again.
                sequencer.poke.notify_one();
            }
        }
    }
}

struct Pass {
    /// A batch was full: more may be staged.
    full: bool,
    appended: Option<AuditEntry>,
}

/// Links `extra` too, once no more is pending before it (it is taken then).
async fn pass(conn: &mut PgConnection, extra: &mut Option<NewAuditEvent>) -> Result<Pass> {
    // Without the lock, and usually the whole pass: most pokes find nothing staged.
    let row = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM events WHERE id IS NULL) AS events, \
         EXISTS (SELECT 1 FROM audit_pending) AS audit",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(db_error(OP))?;
    if !row.flag("events")? && !row.flag("audit")? && extra.is_none() {
        return Ok(Pass {
            full: false,
            appended: None,
        });
    }
    let mut tx = conn.begin().await.map_err(db_error(OP))?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(SEQUENCER_LOCK)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
    // In staging order (an identity column): a task's later event was staged after its earlier
    // one committed, so the two are numbered in that order. `MATERIALIZED`: `nextval` is taken
    // once per row, in the sorted order, and every notification is sent.
    // Delivered at commit, to every replica's listener: `berth_tasks` for each agent these
    // events name that has something to claim or a cancellation to collect now (a long-poll
    // returns for nothing else; a task created later wakes its agent through its own event),
    // and `berth_events` for the event streams.
    let numbered = sqlx::query(
        "WITH staged AS MATERIALIZED (\
             SELECT row_id FROM events WHERE id IS NULL ORDER BY row_id LIMIT $1), \
         ids AS MATERIALIZED (SELECT row_id, nextval('events_id_seq') AS id FROM staged), \
         numbered AS (UPDATE events SET id = ids.id FROM ids WHERE events.row_id = ids.row_id \
                      RETURNING events.agent_id), \
         woken AS (SELECT DISTINCT agent_id FROM tasks \
                   WHERE agent_id IN (SELECT agent_id FROM numbered) \
                   AND (state IN ('pending', 'retry_wait') \
                        OR (state = 'leased' AND cancel_requested))), \
         sent AS MATERIALIZED (SELECT pg_notify($2, agent_id::text) FROM woken \
                   UNION ALL SELECT pg_notify($3, '') WHERE EXISTS (SELECT 1 FROM numbered)) \
         SELECT (SELECT count(*) FROM numbered) AS numbered, \
                (SELECT count(*) FROM sent) AS notified",
    )
    .bind(EVENT_BATCH)
    .bind(TASK_CHANNEL)
    .bind(EVENT_CHANNEL)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .int("numbered")?;
    // Taken out and linked in one transaction: a failure leaves them staged.
    let mut pending = sqlx::query(
        "DELETE FROM audit_pending WHERE id IN \
         (SELECT id FROM audit_pending ORDER BY id LIMIT $1) RETURNING id, draft",
    )
    .bind(AUDIT_BATCH)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| Ok((row.int("id")?, parse(&row.text("draft")?)?)))
    .collect::<Result<Vec<_>>>()?;
    pending.sort_unstable_by_key(|(id, _)| *id);
    let full = numbered == EVENT_BATCH || pending.len() as i64 == AUDIT_BATCH;
    // After every entry staged before it: not while a full batch may have left some behind.
    let extra = if pending.len() as i64 == AUDIT_BATCH {
        None
    } else {
        extra.take().map(draft)
    };
    let drafts = pending.into_iter().map(|(_, draft)| draft).collect();
    let appended = link_pending(&mut tx, drafts, extra).await?;
    tx.commit().await.map_err(db_error(OP))?;
    Ok(Pass { full, appended })
}

/// Links `drafts` (in their order), then `extra`, each at the head of its tenant's chain, and
/// inserts them; returns `extra`'s entry.
async fn link_pending(
    conn: &mut PgConnection,
    mut drafts: Vec<AuditEntry>,
    extra: Option<AuditEntry>,
) -> Result<Option<AuditEntry>> {
    let has_extra = extra.is_some();
    drafts.extend(extra);
    if drafts.is_empty() {
        return Ok(None);
    }
    let mut tenants: Vec<Uuid> = drafts.iter().map(|d| d.tenant_id.0).collect();
    tenants.sort_unstable();
    tenants.dedup();
    // Every chain's own lock too, which a replica of an older berth (before migration 0025)
    // takes to append directly: mid-upgrade, the two never fork a chain.
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended('berth.audit:' || t::text, 0)) \
         FROM unnest($1::uuid[]) AS t ORDER BY t",
    )
    .bind(&tenants)
    .execute(&mut *conn)
    .await
    .map_err(db_error(OP))?;
    let mut heads: std::collections::HashMap<Uuid, Option<(i64, String)>> = sqlx::query(
        "SELECT t AS tenant_id, h.seq, h.hash FROM unnest($1::uuid[]) AS t \
         LEFT JOIN LATERAL (SELECT seq, hash FROM audit_log WHERE tenant_id = t \
                            ORDER BY seq DESC LIMIT 1) AS h ON TRUE",
    )
    .bind(&tenants)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        let head = match row.text_opt("hash")? {
            Some(hash) => Some((row.int("seq")?, hash)),
            None => None,
        };
        Ok((row.uuid("tenant_id")?, head))
    })
    .collect::<Result<_>>()?;
    let (mut tenant_ids, mut seqs, mut hashes, mut texts) = (vec![], vec![], vec![], vec![]);
    let mut last = None;
    for draft in drafts {
        let tenant = draft.tenant_id;
        let head = heads.remove(&tenant.0).flatten();
        let (entry, text) = link(draft, head)?;
        heads.insert(tenant.0, Some((entry.seq as i64, entry.hash.clone())));
        tenant_ids.push(tenant.0);
        seqs.push(entry.seq as i64);
        hashes.push(entry.hash.clone());
        texts.push(text);
        last = Some(entry);
    }
    sqlx::query(
        "INSERT INTO audit_log (tenant_id, seq, hash, entry) \
         SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[])",
    )
    .bind(&tenant_ids)
    .bind(&seqs)
    .bind(&hashes)
    .bind(&texts)
    .execute(&mut *conn)
    .await
    .map_err(db_error(OP))?;
    Ok(if has_extra { last } else { None })
}

/// The `audit_pending` row of `event`: its tenant and draft text, for a statement that stages
/// it along with the change it records.
pub(super) fn staged(event: NewAuditEvent) -> Result<(TenantId, String)> {
    let tenant = event.tenant_id;
    let text = serde_json::to_string(&draft(event))
        .map_err(|e| StoreError::Corrupt(format!("audit entry: {e}")))?;
    Ok((tenant, text))
}
