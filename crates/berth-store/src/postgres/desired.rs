//! Desired-state environments on PostgreSQL.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use sqlx::types::Json;
use sqlx::PgConnection;
use time::OffsetDateTime;

use super::PostgresStore;
use crate::domain::desired::{
    bundle_columns, desired_agent_columns, desired_environment_columns, read_bundle,
    read_desired_agent, read_desired_environment, retire_event, set_desired_event,
};
use crate::rows::{db_error, millis, ColumnReader};
use crate::{
    Bundle, CheckinRecord, DesiredAgent, DesiredEnvironment, DesiredStore, NewBundle, ReportRecord,
    Result, SetDesiredOutcome,
};

/// The environment, its row locked when `lock` (a write follows in the same transaction).
async fn environment(
    conn: &mut PgConnection,
    tenant: TenantId,
    name: &str,
    lock: bool,
    op: &'static str,
) -> Result<Option<DesiredEnvironment>> {
    let sql = if lock {
        concat!(
            "SELECT ",
            desired_environment_columns!(),
            " FROM environments WHERE tenant_id = $1 AND name = $2 FOR UPDATE"
        )
    } else {
        concat!(
            "SELECT ",
            desired_environment_columns!(),
            " FROM environments WHERE tenant_id = $1 AND name = $2"
        )
    };
    sqlx::query(sql)
        .bind(tenant.0)
        .bind(name)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db_error(op))?
        .map(|row| read_desired_environment(&row))
        .transpose()
}

#[async_trait::async_trait]
impl DesiredStore for PostgresStore {
    async fn desired_environment(
        &self,
        tenant: TenantId,
        name: &str,
    ) -> Result<Option<DesiredEnvironment>> {
        const OP: &str = "get desired environment";
        let mut conn = self.acquire(OP).await?;
        environment(&mut conn, tenant, name, false, OP).await
    }

    async fn put_bundle(&self, bundle: NewBundle) -> Result<(Bundle, bool)> {
        const OP: &str = "put bundle";
        let mut tx = self.begin(OP).await?;
        let inserted = sqlx::query(
            "INSERT INTO bundles \
             (tenant_id, environment_id, sha, content, size, created_at, created_by) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (environment_id, sha) DO NOTHING",
        )
        .bind(bundle.tenant_id.0)
        .bind(bundle.environment_id.0)
        .bind(&bundle.sha)
        .bind(&bundle.content)
        .bind(bundle.content.len() as i64)
        .bind(millis(bundle.created_at))
        .bind(Json(&bundle.created_by))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        let row = sqlx::query(concat!(
            "SELECT ",
            bundle_columns!(),
            " FROM bundles WHERE environment_id = $1 AND sha = $2"
        ))
        .bind(bundle.environment_id.0)
        .bind(&bundle.sha)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let stored = read_bundle(&row)?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok((stored, inserted == 1))
    }

    async fn get_bundle(&self, environment: EnvironmentId, sha: &str) -> Result<Option<Vec<u8>>> {
        Ok(
            sqlx::query("SELECT content FROM bundles WHERE environment_id = $1 AND sha = $2")
                .bind(environment.0)
                .bind(sha)
                .fetch_optional(&mut *self.conn().await?)
                .await
                .map_err(db_error("get bundle"))?
                .map(|row| row.bytes_opt("content"))
                .transpose()?
                .flatten(),
        )
    }

    async fn list_bundles(&self, environment: EnvironmentId) -> Result<Vec<Bundle>> {
        sqlx::query(concat!(
            "SELECT ",
            bundle_columns!(),
            " FROM bundles WHERE environment_id = $1 ORDER BY created_at DESC, sha"
        ))
        .bind(environment.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list bundles"))?
        .iter()
        .map(read_bundle)
        .collect()
    }

    async fn set_desired(
        &self,
        tenant: TenantId,
        name: &str,
        sha: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<SetDesiredOutcome> {
        const OP: &str = "set desired sha";
        let mut tx = self.begin(OP).await?;
        let Some(mut env) = environment(&mut tx, tenant, name, true, OP).await? else {
            return Ok(SetDesiredOutcome::NoSuchEnvironment);
        };
        let pushed = sqlx::query("SELECT 1 FROM bundles WHERE environment_id = $1 AND sha = $2")
            .bind(env.id.0)
            .bind(sha)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?
            .is_some();
        if !pushed {
            return Ok(SetDesiredOutcome::BundleNotFound);
        }
        sqlx::query("UPDATE environments SET desired_sha = $1, updated_at = $2 WHERE id = $3")
            .bind(sha)
            .bind(millis(now))
            .bind(env.id.0)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        env.desired_sha = Some(sha.to_owned());
        super::audit::append(&mut tx, set_desired_event(&env, actor, now)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(SetDesiredOutcome::Set(env))
    }

    async fn retire_environment(
        &self,
        tenant: TenantId,
        name: &str,
        purge_volumes: bool,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DesiredEnvironment>> {
        const OP: &str = "retire environment";
        let mut tx = self.begin(OP).await?;
        let Some(mut env) = environment(&mut tx, tenant, name, true, OP).await? else {
            return Ok(None);
        };
        sqlx::query(
            "UPDATE environments SET retired = TRUE, purge_volumes = $1, updated_at = $2 \
             WHERE id = $3",
        )
        .bind(purge_volumes)
        .bind(millis(now))
        .bind(env.id.0)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        env.retired = true;
        env.purge_volumes = purge_volumes;
        super::audit::append(&mut tx, retire_event(&env, actor, now)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Some(env))
    }

    async fn record_checkin(&self, checkin: CheckinRecord) -> Result<()> {
        sqlx::query(
            "INSERT INTO desired_agents \
             (environment_id, agent_key, applied_sha, host, containers, last_checkin_at) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (environment_id, agent_key) DO UPDATE SET \
             applied_sha = excluded.applied_sha, host = excluded.host, \
             containers = excluded.containers, last_checkin_at = excluded.last_checkin_at",
        )
        .bind(checkin.environment_id.0)
        .bind(&checkin.agent_key)
        .bind(&checkin.applied_sha)
        .bind(Json(&checkin.host))
        .bind(Json(&checkin.containers))
        .bind(millis(checkin.at))
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("record checkin"))?;
        Ok(())
    }

    async fn record_report(&self, report: ReportRecord) -> Result<DesiredAgent> {
        const OP: &str = "record report";
        let mut tx = self.begin(OP).await?;
        // The row lock orders two reports of one agent; a first report has no row to lock, and
        // the primary key makes the loser's insert an update.
        let previous = sqlx::query(
            "SELECT applied_sha FROM desired_agents \
             WHERE environment_id = $1 AND agent_key = $2 FOR UPDATE",
        )
        .bind(report.environment_id.0)
        .bind(&report.agent_key)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| row.text_opt("applied_sha"))
        .transpose()?
        .flatten();
        let row = sqlx::query(concat!(
            "INSERT INTO desired_agents \
             (environment_id, agent_key, applied_sha, last_result, detail, containers, \
              log_tail, last_report_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (environment_id, agent_key) DO UPDATE SET \
             applied_sha = excluded.applied_sha, last_result = excluded.last_result, \
             detail = excluded.detail, containers = excluded.containers, \
             log_tail = excluded.log_tail, last_report_at = excluded.last_report_at \
             RETURNING ",
            desired_agent_columns!()
        ))
        .bind(report.environment_id.0)
        .bind(&report.agent_key)
        .bind(report.applied_sha(previous))
        .bind(report.result.as_str())
        .bind(&report.detail)
        .bind(Json(&report.containers))
        .bind(&report.log_tail)
        .bind(millis(report.at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let agent = read_desired_agent(&row)?;
        super::audit::append(&mut tx, report.audit_event()).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(agent)
    }

    async fn desired_agents(&self, environment: EnvironmentId) -> Result<Vec<DesiredAgent>> {
        sqlx::query(concat!(
            "SELECT ",
            desired_agent_columns!(),
            " FROM desired_agents WHERE environment_id = $1 ORDER BY agent_key"
        ))
        .bind(environment.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list desired agents"))?
        .iter()
        .map(read_desired_agent)
        .collect()
    }
}
