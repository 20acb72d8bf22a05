//! Desired-state environments on SQLite.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;

use super::threads::Db;
use super::{id_text, json_text, SqliteStore};
use crate::domain::desired::{
    bundle_columns, desired_agent_columns, desired_environment_columns, read_bundle,
    read_desired_agent, read_desired_environment, retire_event, set_desired_event,
};
use crate::rows::{unix_millis, ColumnReader};
use crate::{
    Bundle, CheckinRecord, DesiredAgent, DesiredEnvironment, DesiredStore, NewBundle, ReportRecord,
    Result, SetDesiredOutcome,
};

fn environment(tx: &Db<'_>, tenant: TenantId, name: &str) -> Result<Option<DesiredEnvironment>> {
    tx.optional(
        concat!(
            "SELECT ",
            desired_environment_columns!(),
            " FROM environments WHERE tenant_id = ?1 AND name = ?2"
        ),
        params![id_text(tenant.0), name],
        |row| read_desired_environment(row),
    )
}

#[async_trait::async_trait]
impl DesiredStore for SqliteStore {
    async fn desired_environment(
        &self,
        tenant: TenantId,
        name: &str,
    ) -> Result<Option<DesiredEnvironment>> {
        let name = name.to_owned();
        self.readers
            .read("get desired environment", move |db| {
                environment(db, tenant, &name)
            })
            .await
    }

    async fn put_bundle(&self, bundle: NewBundle) -> Result<(Bundle, bool)> {
        let created_by = json_text("bundles.created_by", &bundle.created_by)?;
        self.writer
            .write("put bundle", move |tx| {
                let inserted = tx.execute(
                    "INSERT INTO bundles \
                     (tenant_id, environment_id, sha, content, size, created_at, created_by) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
                     ON CONFLICT (environment_id, sha) DO NOTHING",
                    params![
                        id_text(bundle.tenant_id.0),
                        id_text(bundle.environment_id.0),
                        bundle.sha,
                        bundle.content,
                        bundle.content.len() as i64,
                        unix_millis(bundle.created_at),
                        created_by,
                    ],
                )?;
                let stored = tx.one(
                    concat!(
                        "SELECT ",
                        bundle_columns!(),
                        " FROM bundles WHERE environment_id = ?1 AND sha = ?2"
                    ),
                    params![id_text(bundle.environment_id.0), bundle.sha],
                    |row| read_bundle(row),
                )?;
                Ok((stored, inserted == 1))
            })
            .await
    }

    async fn get_bundle(&self, environment: EnvironmentId, sha: &str) -> Result<Option<Vec<u8>>> {
        let sha = sha.to_owned();
        self.readers
            .read("get bundle", move |db| {
                Ok(db
                    .optional(
                        "SELECT content FROM bundles WHERE environment_id = ?1 AND sha = ?2",
                        params![id_text(environment.0), sha],
                        |row| row.bytes_opt("content"),
                    )?
                    .flatten())
            })
            .await
    }

    async fn list_bundles(&self, environment: EnvironmentId) -> Result<Vec<Bundle>> {
        self.readers
            .read("list bundles", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        bundle_columns!(),
                        " FROM bundles WHERE environment_id = ?1 ORDER BY created_at DESC, sha"
                    ),
                    params![id_text(environment.0)],
                    |row| read_bundle(row),
                )
            })
            .await
    }

    async fn set_desired(
        &self,
        tenant: TenantId,
        name: &str,
        sha: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<SetDesiredOutcome> {
        let (name, sha) = (name.to_owned(), sha.to_owned());
        self.writer
            .write("set desired sha", move |tx| {
                let Some(mut env) = environment(tx, tenant, &name)? else {
                    return Ok(SetDesiredOutcome::NoSuchEnvironment);
                };
                let pushed = tx
                    .optional(
                        "SELECT 1 AS one FROM bundles WHERE environment_id = ?1 AND sha = ?2",
                        params![id_text(env.id.0), sha],
                        |row| row.int("one"),
                    )?
                    .is_some();
                if !pushed {
                    return Ok(SetDesiredOutcome::BundleNotFound);
                }
                tx.execute(
                    "UPDATE environments SET desired_sha = ?1, updated_at = ?2 WHERE id = ?3",
                    params![sha, unix_millis(now), id_text(env.id.0)],
                )?;
                env.desired_sha = Some(sha);
                super::audit::append(tx, set_desired_event(&env, actor, now))?;
                Ok(SetDesiredOutcome::Set(env))
            })
            .await
    }

    async fn retire_environment(
        &self,
        tenant: TenantId,
        name: &str,
        purge_volumes: bool,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DesiredEnvironment>> {
        let name = name.to_owned();
        self.writer
            .write("retire environment", move |tx| {
                let Some(mut env) = environment(tx, tenant, &name)? else {
                    return Ok(None);
                };
                tx.execute(
                    "UPDATE environments SET retired = 1, purge_volumes = ?1, updated_at = ?2 \
                     WHERE id = ?3",
                    params![purge_volumes, unix_millis(now), id_text(env.id.0)],
                )?;
                env.retired = true;
                env.purge_volumes = purge_volumes;
                super::audit::append(tx, retire_event(&env, actor, now))?;
                Ok(Some(env))
            })
            .await
    }

    async fn record_checkin(&self, checkin: CheckinRecord) -> Result<()> {
        let host = json_text("desired_agents.host", &checkin.host)?;
        let containers = json_text("desired_agents.containers", &checkin.containers)?;
        self.writer
            .write("record checkin", move |tx| {
                tx.execute(
                    "INSERT INTO desired_agents \
                     (environment_id, agent_key, applied_sha, host, containers, last_checkin_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
                     ON CONFLICT (environment_id, agent_key) DO UPDATE SET \
                     applied_sha = excluded.applied_sha, host = excluded.host, \
                     containers = excluded.containers, last_checkin_at = excluded.last_checkin_at",
                    params![
                        id_text(checkin.environment_id.0),
                        checkin.agent_key,
                        checkin.applied_sha,
                        host,
                        containers,
                        unix_millis(checkin.at),
                    ],
                )?;
                Ok(())
            })
            .await
    }

    async fn record_report(&self, report: ReportRecord) -> Result<DesiredAgent> {
        let containers = json_text("desired_agents.containers", &report.containers)?;
        self.writer
            .write("record report", move |tx| {
                let env = id_text(report.environment_id.0);
                let previous = tx
                    .optional(
                        "SELECT applied_sha FROM desired_agents \
                         WHERE environment_id = ?1 AND agent_key = ?2",
                        params![env, report.agent_key],
                        |row| row.text_opt("applied_sha"),
                    )?
                    .flatten();
                let agent = tx.one(
                    concat!(
                        "INSERT INTO desired_agents \
                         (environment_id, agent_key, applied_sha, last_result, detail, \
                          containers, log_tail, last_report_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
                         ON CONFLICT (environment_id, agent_key) DO UPDATE SET \
                         applied_sha = excluded.applied_sha, last_result = excluded.last_result, \
                         detail = excluded.detail, containers = excluded.containers, \
                         log_tail = excluded.log_tail, last_report_at = excluded.last_report_at \
                         RETURNING ",
                        desired_agent_columns!()
                    ),
                    params![
                        env,
                        report.agent_key,
                        report.applied_sha(previous),
                        report.result.as_str(),
                        report.detail,
                        containers,
                        report.log_tail,
                        unix_millis(report.at),
                    ],
                    |row| read_desired_agent(row),
                )?;
                super::audit::append(tx, report.audit_event())?;
                Ok(agent)
            })
            .await
    }

    async fn desired_agents(&self, environment: EnvironmentId) -> Result<Vec<DesiredAgent>> {
        self.readers
            .read("list desired agents", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        desired_agent_columns!(),
                        " FROM desired_agents WHERE environment_id = ?1 ORDER BY agent_key"
                    ),
                    params![id_text(environment.0)],
                    |row| read_desired_agent(row),
                )
            })
            .await
    }
}
