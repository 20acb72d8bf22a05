//! Environment readiness on SQLite. The single writer runs each method whole, so the version
//! compare and the write cannot interleave with another write.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;

use super::{id_text, json_text, SqliteStore};
use crate::domain::readiness::verify_event;
use crate::rows::{self, environment_rows, readiness_columns, unix_millis};
use crate::{Environment, Readiness, ReadinessStore, Result};

#[async_trait::async_trait]
impl ReadinessStore for SqliteStore {
    async fn get_readiness(
        &self,
        tenant: TenantId,
        environment: EnvironmentId,
    ) -> Result<Option<Readiness>> {
        self.readers
            .read("get readiness", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        readiness_columns!(),
                        " FROM environment_readiness WHERE tenant_id = ?1 AND environment_id = ?2"
                    ),
                    params![id_text(tenant.0), id_text(environment.0)],
                    |row| rows::read_readiness(row),
                )
            })
            .await
    }

    async fn put_readiness(&self, r: Readiness, expected: Option<i64>) -> Result<bool> {
        let conditions = json_text("environment_readiness.conditions", &r.conditions)?;
        let pass = json_text("environment_readiness.pass", &r.pass)?;
        self.writer
            .write("put readiness", move |tx| {
                let written = match expected {
                    None => tx.execute(
                        "INSERT INTO environment_readiness (environment_id, tenant_id, \
                         generation, spec, conditions, operational_ready, pass, \
                         verify_observed, version, updated_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 1, ?9) \
                         ON CONFLICT (environment_id) DO NOTHING",
                        params![
                            id_text(r.environment_id.0),
                            id_text(r.tenant_id.0),
                            r.generation,
                            r.spec,
                            conditions,
                            r.operational_ready,
                            pass,
                            r.verify_observed,
                            unix_millis(r.updated_at),
                        ],
                    )?,
                    Some(version) => tx.execute(
                        "UPDATE environment_readiness SET generation = ?3, spec = ?4, \
                         conditions = ?5, operational_ready = ?6, pass = ?7, \
                         verify_observed = ?8, version = version + 1, updated_at = ?9 \
                         WHERE environment_id = ?1 AND tenant_id = ?2 AND version = ?10",
                        params![
                            id_text(r.environment_id.0),
                            id_text(r.tenant_id.0),
                            r.generation,
                            r.spec,
                            conditions,
                            r.operational_ready,
                            pass,
                            r.verify_observed,
                            unix_millis(r.updated_at),
                            version,
                        ],
                    )?,
                };
                Ok(written == 1)
            })
            .await
    }

    async fn request_verify(
        &self,
        env: &Environment,
        nonce: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<()> {
        let env = env.clone();
        let nonce = nonce.to_owned();
        self.writer
            .write("request verify", move |tx| {
                tx.execute(
                    "INSERT INTO environment_readiness (environment_id, tenant_id, \
                     verify_request, updated_at) VALUES (?1, ?2, ?3, ?4) \
                     ON CONFLICT (environment_id) DO UPDATE SET \
                     verify_request = excluded.verify_request",
                    params![
                        id_text(env.id.0),
                        id_text(env.tenant_id.0),
                        nonce,
                        unix_millis(now)
                    ],
                )?;
                super::audit::append(tx, verify_event(&env, &nonce, actor, now))?;
                Ok(())
            })
            .await
    }

    async fn readiness_environments(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>> {
        self.readers
            .read("list environments for readiness", move |db| {
                db.all(
                    concat!(
                        environment_rows!(),
                        "(?1 IS NULL OR id > ?1) ORDER BY id LIMIT ?2"
                    ),
                    params![after.map(|a| id_text(a.0)), i64::from(limit.max(1))],
                    |row| rows::read_environment(row),
                )
            })
            .await
    }
}
