//! Environment readiness on PostgreSQL. A reconciler's write is one conditional statement (the
//! version compare is its `WHERE`), so replicas never both apply a pass's step.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use sqlx::types::Json;
use time::OffsetDateTime;

use super::PostgresStore;
use crate::domain::readiness::verify_event;
use crate::rows::{self, db_error, environment_rows, millis, readiness_columns};
use crate::{Environment, Readiness, ReadinessStore, Result};

#[async_trait::async_trait]
impl ReadinessStore for PostgresStore {
    async fn get_readiness(
        &self,
        tenant: TenantId,
        environment: EnvironmentId,
    ) -> Result<Option<Readiness>> {
        sqlx::query(concat!(
            "SELECT ",
            readiness_columns!(),
            " FROM environment_readiness WHERE tenant_id = $1 AND environment_id = $2"
        ))
        .bind(tenant.0)
        .bind(environment.0)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get readiness"))?
        .map(|row| rows::read_readiness(&row))
        .transpose()
    }

    async fn put_readiness(&self, r: Readiness, expected: Option<i64>) -> Result<bool> {
        let query = match expected {
            None => sqlx::query(
                "INSERT INTO environment_readiness (environment_id, tenant_id, generation, spec, \
                 conditions, operational_ready, pass, verify_observed, version, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $10 + 1, $9) \
                 ON CONFLICT (environment_id) DO NOTHING",
            ),
            Some(_) => sqlx::query(
                "UPDATE environment_readiness SET generation = $3, spec = $4, conditions = $5, \
                 operational_ready = $6, pass = $7, verify_observed = $8, \
                 version = version + 1, updated_at = $9 \
                 WHERE environment_id = $1 AND tenant_id = $2 AND version = $10",
            ),
        };
        let done = query
            .bind(r.environment_id.0)
            .bind(r.tenant_id.0)
            .bind(r.generation)
            .bind(&r.spec)
            .bind(Json(&r.conditions))
            .bind(r.operational_ready)
            .bind(Json(&r.pass))
            .bind(&r.verify_observed)
            .bind(millis(r.updated_at))
            .bind(expected.unwrap_or(0))
            .execute(&mut *self.conn().await?)
            .await
            .map_err(db_error("put readiness"))?;
        Ok(done.rows_affected() == 1)
    }

    async fn request_verify(
        &self,
        env: &Environment,
        nonce: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<()> {
        const OP: &str = "request verify";
        let mut tx = self.begin(OP).await?;
        sqlx::query(
            "INSERT INTO environment_readiness (environment_id, tenant_id, verify_request, \
             updated_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (environment_id) DO UPDATE SET verify_request = excluded.verify_request",
        )
        .bind(env.id.0)
        .bind(env.tenant_id.0)
        .bind(nonce)
        .bind(millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        super::audit::append(&mut tx, verify_event(env, nonce, actor, now)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(())
    }

    async fn readiness_environments(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>> {
        sqlx::query(concat!(
            environment_rows!(),
            "($1::uuid IS NULL OR id > $1) ORDER BY id LIMIT $2"
        ))
        .bind(after.map(|a| a.0))
        .bind(i64::from(limit.max(1)))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list environments for readiness"))?
        .iter()
        .map(rows::read_environment)
        .collect()
    }
}
