use sqlx::{Postgres, QueryBuilder};
use tokio::sync::watch;

use super::PostgresStore;
use crate::rows::{self, db_error, millis, ColumnReader};
use crate::{Event, EventFilter, EventStore, Result};
use time::OffsetDateTime;

#[async_trait::async_trait]
impl EventStore for PostgresStore {
    async fn read_events(
        &self,
        tenant: berth_proto::TenantId,
        filter: &EventFilter,
        after: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        // Every event committed before this call gets its id first. `id IS NULL` rows are
        // staged and not numbered yet: `id > $after` leaves them for a later read.
        self.sequencer.flush().await?;
        let mut query = QueryBuilder::<Postgres>::new(
            "SELECT id, tenant_id, kind, task_id, agent_id, deployment_id, environment_id, data, \
             created_at FROM events WHERE tenant_id = ",
        );
        query.push_bind(tenant.0);
        query.push(" AND id > ").push_bind(after);
        if let Some(task) = filter.task {
            query.push(" AND task_id = ").push_bind(task.0);
        }
        if let Some(agent) = filter.agent {
            query.push(" AND agent_id = ").push_bind(agent.0);
        }
        if let Some(deployment) = filter.deployment {
            query.push(" AND deployment_id = ").push_bind(deployment.0);
        }
        if let Some(environment) = filter.environment {
            query
                .push(" AND environment_id = ")
                .push_bind(environment.0);
        }
        query
            .push(" ORDER BY id LIMIT ")
            .push_bind(i64::from(limit.max(1)));
        query
            .build()
            .fetch_all(&mut *self.conn().await?)
            .await
            .map_err(db_error("read events"))?
            .iter()
            .map(rows::read_event)
            .collect()
    }

    async fn latest_event_id(&self, tenant: berth_proto::TenantId) -> Result<i64> {
        // Ids are numbered in the order of the passes that commit them, so the highest visible
        // one has every lower one visible too: a reader after it misses nothing.
        self.sequencer.flush().await?;
        let row = sqlx::query(
            "SELECT COALESCE(MAX(id), 0)::BIGINT AS latest FROM events \
             WHERE tenant_id = $1 AND id IS NOT NULL",
        )
        .bind(tenant.0)
        .fetch_one(&mut *self.conn().await?)
        .await
        .map_err(db_error("latest event id"))?;
        row.int("latest")
    }

    async fn prune_events(&self, before: OffsetDateTime, limit: u32) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM events WHERE id IN (\
               SELECT id FROM events WHERE id IS NOT NULL AND created_at < $1 \
               ORDER BY id LIMIT $2)",
        )
        .bind(millis(before))
        .bind(i64::from(limit))
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("prune events"))?;
        Ok(done.rows_affected())
    }

    fn events_written(&self) -> watch::Receiver<u64> {
        self.written.subscribe()
    }
}
