use rusqlite::params_from_iter;
use tokio::sync::watch;

use super::{id_text, Query, SqliteStore};
use crate::rows::{self, unix_millis, ColumnReader};
use crate::{Event, EventFilter, EventStore, Result};
use time::OffsetDateTime;

#[async_trait::async_trait]
impl EventStore for SqliteStore {
    async fn read_events(
        &self,
        tenant: berth_proto::TenantId,
        filter: &EventFilter,
        after: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        let mut query = Query::new(
            "SELECT id, tenant_id, kind, task_id, agent_id, deployment_id, environment_id, data, \
             created_at FROM events WHERE tenant_id = ",
        );
        query.push_bind(id_text(tenant.0));
        query.push(" AND id > ").push_bind(after);
        if let Some(task) = filter.task {
            query.push(" AND task_id = ").push_bind(id_text(task.0));
        }
        if let Some(agent) = filter.agent {
            query.push(" AND agent_id = ").push_bind(id_text(agent.0));
        }
        if let Some(deployment) = filter.deployment {
            query
                .push(" AND deployment_id = ")
                .push_bind(id_text(deployment.0));
        }
        if let Some(environment) = filter.environment {
            query
                .push(" AND environment_id = ")
                .push_bind(id_text(environment.0));
        }
        query
            .push(" ORDER BY id LIMIT ")
            .push_bind(i64::from(limit.max(1)));
        self.readers
            .read("read events", move |db| {
                db.all(&query.sql, params_from_iter(query.params), |row| {
                    rows::read_event(row)
                })
            })
            .await
    }

    async fn latest_event_id(&self, tenant: berth_proto::TenantId) -> Result<i64> {
        self.readers
            .read("latest event id", move |db| {
                db.one(
                    "SELECT COALESCE(MAX(id), 0) AS latest FROM events WHERE tenant_id = ?1",
                    [id_text(tenant.0)],
                    |row| row.int("latest"),
                )
            })
            .await
    }

    async fn prune_events(&self, before: OffsetDateTime, limit: u32) -> Result<u64> {
        self.writer
            .write("prune events", move |tx| {
                tx.execute(
                    "DELETE FROM events WHERE id IN (\
                       SELECT id FROM events WHERE created_at < ?1 ORDER BY id LIMIT ?2)",
                    rusqlite::params![unix_millis(before), i64::from(limit)],
                )
                .map(|n| n as u64)
            })
            .await
    }

    fn events_written(&self) -> watch::Receiver<u64> {
        self.written.subscribe()
    }
}
