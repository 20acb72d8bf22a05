//! Environments and deployments on PostgreSQL. Replicas share the database: a change that
//! depends on what it read takes the deployment's row lock first (approve, cancel), or is one
//! conditional statement (a step's compare-and-set on `version`); the constraints
//! (`deployments_one_active`, the approvals' primary key) decide the races between creates.

use berth_proto::audit::actions::{DEPLOYMENT_APPROVE, DEPLOYMENT_CANCEL, ENVIRONMENT_UNPIN};
use berth_proto::audit::AuditActor;
use berth_proto::deploy::{DeploymentState, TargetPhase};
use berth_proto::{AgentId, DeploymentId, EnvironmentId, ReleaseId, TenantId};
use sqlx::types::Json;
use sqlx::{PgConnection, Postgres, QueryBuilder};
use time::OffsetDateTime;

use super::{fetch_page, PostgresStore};
use crate::domain::audit::{admin_event, deployment_create_event, environment_create_event};
use crate::domain::tasks::deployment_target_key_prefix;
use crate::rows::{
    self, db_error, deployment_rows, environment_rows, millis, observation_columns, target_columns,
    task_columns, ColumnReader,
};
use crate::{
    ApproveOutcome, Deployment, DeploymentDetail, DeploymentGuard, DeploymentStep, DeploymentStore,
    DeploymentTarget, DeploymentTaskOutcome, Environment, NewDeployment, NewTask, Page, Result,
    StoreError, TargetObservation,
};

async fn environment_by_id(
    conn: &mut PgConnection,
    op: &'static str,
    id: EnvironmentId,
) -> Result<Option<Environment>> {
    sqlx::query(concat!(environment_rows!(), "id = $1"))
        .bind(id.0)
        .fetch_optional(conn)
        .await
        .map_err(db_error(op))?
        .map(|row| rows::read_environment(&row))
        .transpose()
}

/// The deployment with its targets and approvals; of `tenant` when given.
async fn detail(
    conn: &mut PgConnection,
    op: &'static str,
    tenant: Option<TenantId>,
    id: DeploymentId,
) -> Result<Option<DeploymentDetail>> {
    let deployment = sqlx::query(concat!(
        deployment_rows!(),
        "id = $1 AND ($2::uuid IS NULL OR tenant_id = $2)"
    ))
    .bind(id.0)
    .bind(tenant.map(|t| t.0))
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_error(op))?
    .map(|row| rows::read_deployment(&row))
    .transpose()?;
    match deployment {
        Some(deployment) => Ok(Some(with_parts(conn, op, deployment).await?)),
        None => Ok(None),
    }
}

/// `detail` for a deployment the transaction just wrote.
async fn written(
    conn: &mut PgConnection,
    op: &'static str,
    id: DeploymentId,
) -> Result<DeploymentDetail> {
    detail(conn, op, None, id)
        .await?
        .ok_or_else(|| StoreError::Corrupt(format!("deployment {id} vanished during {op}")))
}

async fn with_parts(
    conn: &mut PgConnection,
    op: &'static str,
    deployment: Deployment,
) -> Result<DeploymentDetail> {
    let targets = sqlx::query(concat!(
        "SELECT ",
        target_columns!(),
        " FROM deployment_targets WHERE deployment_id = $1 ORDER BY wave, agent_name, agent_id"
    ))
    .bind(deployment.id.0)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error(op))?
    .iter()
    .map(rows::read_deployment_target)
    .collect::<Result<Vec<_>>>()?;
    let approvals = sqlx::query(
        "SELECT deployment_id, token_id, actor, approved_at FROM deployment_approvals \
         WHERE deployment_id = $1 ORDER BY approved_at, token_id",
    )
    .bind(deployment.id.0)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error(op))?
    .iter()
    .map(rows::read_approval)
    .collect::<Result<Vec<_>>>()?;
    Ok(DeploymentDetail {
        deployment,
        targets,
        approvals,
    })
}

/// The tenant's deployment's state, its row locked `FOR UPDATE` until the transaction ends.
async fn locked_state(
    conn: &mut PgConnection,
    op: &'static str,
    tenant: TenantId,
    id: DeploymentId,
) -> Result<Option<DeploymentState>> {
    let Some(row) =
        sqlx::query("SELECT state FROM deployments WHERE tenant_id = $1 AND id = $2 FOR UPDATE")
            .bind(tenant.0)
            .bind(id.0)
            .fetch_optional(conn)
            .await
            .map_err(db_error(op))?
    else {
        return Ok(None);
    };
    let state = row.text("state")?;
    DeploymentState::parse(&state)
        .map(Some)
        .ok_or_else(|| StoreError::Corrupt(format!("deployments.state: unknown {state:?}")))
}

/// In a cancel's transaction, the deployment row locked: cancels the open tasks created for
/// its targets still `waiting` (a step that read the deployment before the cancel created
/// them, and its record fails on `version`), each with its audit entry. The agents to wake.
async fn cancel_unstarted_tasks(
    store: &PostgresStore,
    tx: &mut sqlx::Transaction<'static, Postgres>,
    id: DeploymentId,
    actor: AuditActor,
    now: OffsetDateTime,
) -> Result<Vec<AgentId>> {
    const OP: &str = "cancel deployment";
    let waiting: Vec<String> = sqlx::query(
        "SELECT agent_id FROM deployment_targets WHERE deployment_id = $1 AND phase = $2",
    )
    .bind(id.0)
    .bind(TargetPhase::Waiting.as_str())
    .fetch_all(&mut **tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        Ok(deployment_target_key_prefix(
            id,
            AgentId(row.uuid("agent_id")?),
        ))
    })
    .collect::<Result<_>>()?;
    if waiting.is_empty() {
        return Ok(Vec::new());
    }
    let open = sqlx::query(concat!(
        "SELECT ",
        task_columns!(),
        " FROM tasks WHERE deployment_id = $1 AND state IN ('pending', 'retry_wait', 'leased') \
         ORDER BY id FOR UPDATE"
    ))
    .bind(id.0)
    .fetch_all(&mut **tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| rows::read_task(row, &store.payload_key))
    .collect::<Result<Vec<_>>>()?;
    let mut woken = Vec::new();
    for task in open {
        let unstarted = task.idempotency_key.as_deref().is_some_and(|key| {
            waiting
                .iter()
                .any(|prefix| key.starts_with(prefix.as_str()))
        });
        if unstarted {
            super::tasks::cancel_locked(tx, &store.payload_key, OP, &task, actor.clone(), now)
                .await?;
            woken.push(task.agent_id);
        }
    }
    Ok(woken)
}

/// Writes `target` whole: an update of its row (so a phase change fires the event trigger),
/// or an insert when the deployment has none for its agent yet.
async fn put_target(
    conn: &mut PgConnection,
    op: &'static str,
    deployment: &Deployment,
    target: &DeploymentTarget,
    insert_only: bool,
) -> Result<()> {
    if !insert_only {
        let updated = sqlx::query(
            "UPDATE deployment_targets SET agent_name = $3, wave = $4, phase = $5, tasks = $6, \
             rollback_tasks = $7, error_code = $8, detail = $9, started_at = $10, \
             finished_at = $11 WHERE deployment_id = $1 AND agent_id = $2",
        )
        .bind(deployment.id.0)
        .bind(target.agent_id.0)
        .bind(&target.agent_name)
        .bind(i64::from(target.wave))
        .bind(target.phase.as_str())
        .bind(Json(&target.tasks))
        .bind(Json(&target.rollback_tasks))
        .bind(&target.error_code)
        .bind(&target.detail)
        .bind(target.started_at.map(millis))
        .bind(target.finished_at.map(millis))
        .execute(&mut *conn)
        .await
        .map_err(db_error(op))?;
        if updated.rows_affected() > 0 {
            return Ok(());
        }
    }
    sqlx::query(
        "INSERT INTO deployment_targets (deployment_id, agent_id, agent_name, wave, phase, \
         tasks, rollback_tasks, error_code, detail, started_at, finished_at, tenant_id, \
         environment_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
    )
    .bind(deployment.id.0)
    .bind(target.agent_id.0)
    .bind(&target.agent_name)
    .bind(i64::from(target.wave))
    .bind(target.phase.as_str())
    .bind(Json(&target.tasks))
    .bind(Json(&target.rollback_tasks))
    .bind(&target.error_code)
    .bind(&target.detail)
    .bind(target.started_at.map(millis))
    .bind(target.finished_at.map(millis))
    .bind(deployment.tenant_id.0)
    .bind(deployment.environment_id.0)
    .execute(&mut *conn)
    .await
    .map_err(db_error(op))?;
    Ok(())
}

#[async_trait::async_trait]
impl DeploymentStore for PostgresStore {
    async fn create_environment(&self, env: Environment, actor: AuditActor) -> Result<Environment> {
        const OP: &str = "create environment";
        let mut tx = self.begin(OP).await?;
        sqlx::query(
            "INSERT INTO environments (id, tenant_id, name, tier, selector, policy, \
             promote_from, approvals, auto_heal, drift_interval_secs, current_release_id, \
             previous_release_id, pinned_release_id, created_by, created_at, updated_at, \
             target_type) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
        )
        .bind(env.id.0)
        .bind(env.tenant_id.0)
        .bind(&env.name)
        .bind(env.tier.as_str())
        .bind(Json(&env.selector))
        .bind(Json(&env.policy))
        .bind(&env.promote_from)
        .bind(i64::from(env.approvals))
        .bind(env.auto_heal)
        .bind(i64::from(env.drift_interval_secs))
        .bind(env.current_release.as_ref().map(|r| r.id.0))
        .bind(env.previous_release.as_ref().map(|r| r.id.0))
        .bind(env.pinned_release.as_ref().map(|r| r.id.0))
        .bind(Json(&env.created_by))
        .bind(millis(env.created_at))
        .bind(millis(env.updated_at))
        .bind(env.target_type.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let created = environment_by_id(&mut tx, OP, env.id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("environment vanished".into()))?;
        super::audit::append(&mut tx, environment_create_event(&created, actor)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(created)
    }

    async fn get_environment(&self, tenant: TenantId, name: &str) -> Result<Option<Environment>> {
        sqlx::query(concat!(environment_rows!(), "tenant_id = $1 AND name = $2"))
            .bind(tenant.0)
            .bind(name)
            .fetch_optional(&mut *self.conn().await?)
            .await
            .map_err(db_error("get environment"))?
            .map(|row| rows::read_environment(&row))
            .transpose()
    }

    async fn list_environments(&self, tenant: TenantId) -> Result<Vec<Environment>> {
        // `COLLATE "C"`: byte order, as SQLite sorts, whatever the database's locale.
        sqlx::query(concat!(
            environment_rows!(),
            "tenant_id = $1 ORDER BY name COLLATE \"C\""
        ))
        .bind(tenant.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list environments"))?
        .iter()
        .map(rows::read_environment)
        .collect()
    }

    async fn environments_with_release(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>> {
        sqlx::query(concat!(
            environment_rows!(),
            "current_release_id IS NOT NULL AND ($1::uuid IS NULL OR id > $1) \
             ORDER BY id LIMIT $2"
        ))
        .bind(after.map(|a| a.0))
        .bind(i64::from(limit.max(1)))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list environments with a release"))?
        .iter()
        .map(rows::read_environment)
        .collect()
    }

    async fn unpin_environment(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Environment>> {
        const OP: &str = "unpin environment";
        let mut tx = self.begin(OP).await?;
        let Some(row) = sqlx::query(
            "SELECT e.id, pn.name AS unpinned FROM environments e \
             LEFT JOIN releases pn ON pn.id = e.pinned_release_id \
             WHERE e.tenant_id = $1 AND e.name = $2 FOR UPDATE OF e",
        )
        .bind(tenant.0)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        else {
            return Ok(None);
        };
        let id = EnvironmentId(row.uuid("id")?);
        let details = serde_json::json!({"name": name, "unpinned": row.text_opt("unpinned")?});
        sqlx::query(
            "UPDATE environments SET pinned_release_id = NULL, updated_at = $2 WHERE id = $1",
        )
        .bind(id.0)
        .bind(millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let after = environment_by_id(&mut tx, OP, id).await?;
        let event = admin_event(tenant, actor, ENVIRONMENT_UNPIN, id, details, now);
        super::audit::append(&mut tx, event).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(after)
    }

    async fn create_deployment(&self, new: NewDeployment) -> Result<DeploymentDetail> {
        const OP: &str = "create deployment";
        let d = &new.deployment;
        let mut tx = self.begin(OP).await?;
        // A second active deployment of the environment waits here for the first to commit,
        // then fails on `deployments_one_active`.
        sqlx::query(
            "INSERT INTO deployments (id, tenant_id, environment_id, release_id, kind, state, \
             rolling_back, requested_by, rollback_release_id, approvals_required, \
             cancel_requested, current_wave, error_code, detail, version, created_at, \
             updated_at, finished_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 0, $15, $16, \
             $17)",
        )
        .bind(d.id.0)
        .bind(d.tenant_id.0)
        .bind(d.environment_id.0)
        .bind(d.release.id.0)
        .bind(d.kind.as_str())
        .bind(d.state.as_str())
        .bind(d.rolling_back)
        .bind(Json(&d.requested_by))
        .bind(d.rollback_release.as_ref().map(|r| r.id.0))
        .bind(i64::from(d.approvals_required))
        .bind(d.cancel_requested)
        .bind(i64::from(d.current_wave))
        .bind(&d.error_code)
        .bind(&d.detail)
        .bind(millis(d.created_at))
        .bind(millis(d.updated_at))
        .bind(d.finished_at.map(millis))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        for target in &new.targets {
            put_target(&mut tx, OP, d, target, true).await?;
        }
        if new.pin {
            sqlx::query(
                "UPDATE environments SET pinned_release_id = $2, updated_at = $3 WHERE id = $1",
            )
            .bind(d.environment_id.0)
            .bind(d.release.id.0)
            .bind(millis(d.created_at))
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        }
        let created = written(&mut tx, OP, d.id).await?;
        super::audit::append(&mut tx, deployment_create_event(&created, new.pin)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(created)
    }

    async fn get_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
    ) -> Result<Option<DeploymentDetail>> {
        const OP: &str = "get deployment";
        // One snapshot for the deployment and its parts.
        let mut tx = self.begin(OP).await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        let found = detail(&mut tx, OP, Some(tenant), id).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(found)
    }

    async fn list_deployments(
        &self,
        tenant: TenantId,
        environment: Option<EnvironmentId>,
        after: Option<DeploymentId>,
        order: berth_proto::task::ListOrder,
        limit: u32,
    ) -> Result<Page<Deployment>> {
        let limit = limit.max(1);
        let mut query = QueryBuilder::<Postgres>::new(concat!(deployment_rows!(), "tenant_id = "));
        query.push_bind(tenant.0);
        if let Some(environment) = environment {
            query
                .push(" AND environment_id = ")
                .push_bind(environment.0);
        }
        fetch_page(
            &mut *self.conn().await?,
            query,
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order,
                limit,
            },
            "list deployments",
            rows::read_deployment,
            |d| d.id.0,
        )
        .await
    }

    async fn succeeded_in(
        &self,
        tenant: TenantId,
        environment: &str,
        release: ReleaseId,
    ) -> Result<bool> {
        sqlx::query(
            "SELECT EXISTS (SELECT 1 FROM deployments d \
             JOIN environments e ON e.id = d.environment_id \
             WHERE e.tenant_id = $1 AND e.name = $2 AND d.release_id = $3 \
             AND d.state = 'succeeded') AS found",
        )
        .bind(tenant.0)
        .bind(environment)
        .bind(release.0)
        .fetch_one(&mut *self.conn().await?)
        .await
        .map_err(db_error("check promotion"))?
        .flag("found")
    }

    async fn approve_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<ApproveOutcome>> {
        const OP: &str = "approve deployment";
        let token = rows::approver_token(&actor)?;
        let mut tx = self.begin(OP).await?;
        // Approvals of one deployment queue here, so the last one counts every other.
        let Some(state) = locked_state(&mut tx, OP, tenant, id).await? else {
            return Ok(None);
        };
        if state != DeploymentState::AwaitingApproval {
            let current = written(&mut tx, OP, id).await?;
            return Ok(Some(ApproveOutcome::NotAwaiting(current)));
        }
        let inserted = sqlx::query(
            "INSERT INTO deployment_approvals (deployment_id, token_id, actor, approved_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (deployment_id, token_id) DO NOTHING",
        )
        .bind(id.0)
        .bind(token.0)
        .bind(Json(&actor))
        .bind(millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        sqlx::query(
            "UPDATE deployments SET state = 'pending', version = version + 1, updated_at = $2 \
             WHERE id = $1 AND state = 'awaiting_approval' AND approvals_required <= \
             (SELECT count(*) FROM deployment_approvals WHERE deployment_id = $1)",
        )
        .bind(id.0)
        .bind(millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let after = written(&mut tx, OP, id).await?;
        if inserted > 0 {
            let details = serde_json::json!({
                "approvals": after.approvals.len(),
                "state": after.deployment.state,
            });
            let event = admin_event(tenant, actor, DEPLOYMENT_APPROVE, id, details, now);
            super::audit::append(&mut tx, event).await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Some(ApproveOutcome::Approved(after)))
    }

    async fn cancel_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DeploymentDetail>> {
        const OP: &str = "cancel deployment";
        let at = millis(now);
        let mut tx = self.begin(OP).await?;
        let Some(state) = locked_state(&mut tx, OP, tenant, id).await? else {
            return Ok(None);
        };
        let stopped = match state {
            DeploymentState::Pending
            | DeploymentState::AwaitingApproval
            | DeploymentState::Running => {
                cancel_unstarted_tasks(self, &mut tx, id, actor.clone(), now).await?
            }
            _ => Vec::new(),
        };
        let changed = match state {
            DeploymentState::Pending | DeploymentState::AwaitingApproval => {
                sqlx::query(
                    "UPDATE deployment_targets SET phase = $2, finished_at = $3 \
                     WHERE deployment_id = $1 AND phase = $4",
                )
                .bind(id.0)
                .bind(TargetPhase::Skipped.as_str())
                .bind(at)
                .bind(TargetPhase::Waiting.as_str())
                .execute(&mut *tx)
                .await
                .map_err(db_error(OP))?;
                sqlx::query(
                    "UPDATE deployments SET state = 'cancelled', finished_at = $2, \
                     updated_at = $2, version = version + 1 WHERE id = $1",
                )
                .bind(id.0)
                .bind(at)
                .execute(&mut *tx)
                .await
                .map_err(db_error(OP))?
                .rows_affected()
            }
            DeploymentState::Running => sqlx::query(
                "UPDATE deployments SET cancel_requested = TRUE, updated_at = $2, \
                 version = version + 1 WHERE id = $1 AND NOT cancel_requested",
            )
            .bind(id.0)
            .bind(at)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?
            .rows_affected(),
            _ => 0,
        };
        let after = written(&mut tx, OP, id).await?;
        if changed > 0 {
            let details = serde_json::json!({
                "state": after.deployment.state,
                "cancelRequested": after.deployment.cancel_requested,
            });
            let event = admin_event(tenant, actor, DEPLOYMENT_CANCEL, id, details, now);
            super::audit::append(&mut tx, event).await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        for agent in stopped {
            self.wake(agent);
        }
        Ok(Some(after))
    }

    async fn create_deployment_task(
        &self,
        guard: DeploymentGuard,
        task: NewTask,
    ) -> Result<DeploymentTaskOutcome> {
        const OP: &str = "create deployment task";
        let mut tx = self.begin(OP).await?;
        // Shared: one step's creates do not wait for each other, while a cancel or a step's
        // record (both write the row) waits for this create's commit, or this create for
        // theirs, and then sees the version they wrote.
        let row = sqlx::query(
            "SELECT state, version FROM deployments WHERE tenant_id = $1 AND id = $2 FOR SHARE",
        )
        .bind(task.tenant_id.0)
        .bind(guard.deployment_id.0)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let current = match row {
            Some(row) => {
                let state = row.text("state")?;
                let state = DeploymentState::parse(&state).ok_or_else(|| {
                    StoreError::Corrupt(format!("deployments.state: unknown {state:?}"))
                })?;
                Some((state, row.int("version")?))
            }
            None => None,
        };
        if !guard.holds(current) {
            return Ok(DeploymentTaskOutcome::Superseded);
        }
        super::tasks::create_in(self, tx, task, Some(guard.deployment_id))
            .await
            .map(DeploymentTaskOutcome::Decided)
    }

    async fn active_deployments(&self, limit: u32) -> Result<Vec<DeploymentDetail>> {
        const OP: &str = "list active deployments";
        let mut conn = self.acquire(OP).await?;
        let active = sqlx::query(concat!(
            deployment_rows!(),
            "state IN ('pending', 'running') ORDER BY created_at, id LIMIT $1"
        ))
        .bind(i64::from(limit.max(1)))
        .fetch_all(&mut *conn)
        .await
        .map_err(db_error(OP))?
        .iter()
        .map(rows::read_deployment)
        .collect::<Result<Vec<_>>>()?;
        let mut details = Vec::with_capacity(active.len());
        for deployment in active {
            details.push(with_parts(&mut conn, OP, deployment).await?);
        }
        Ok(details)
    }

    async fn record_deployment_step(
        &self,
        step: DeploymentStep,
    ) -> Result<Option<DeploymentDetail>> {
        const OP: &str = "record deployment step";
        let at = millis(step.now);
        let finished = (!step.state.is_active()).then_some(at);
        let mut tx = self.begin(OP).await?;
        // A concurrent step waits for this row's lock, then finds `version` moved: 0 rows.
        let applied = sqlx::query(
            "UPDATE deployments SET state = $4, rolling_back = $5, current_wave = $6, \
             error_code = $7, detail = $8, version = version + 1, updated_at = $9, \
             finished_at = COALESCE(finished_at, $10) \
             WHERE tenant_id = $1 AND id = $2 AND version = $3",
        )
        .bind(step.tenant_id.0)
        .bind(step.id.0)
        .bind(step.expected_version)
        .bind(step.state.as_str())
        .bind(step.rolling_back)
        .bind(i64::from(step.current_wave))
        .bind(&step.error_code)
        .bind(&step.detail)
        .bind(at)
        .bind(finished)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        if applied == 0 {
            return Ok(None);
        }
        let deployment = written(&mut tx, OP, step.id).await?.deployment;
        for target in &step.targets {
            put_target(&mut tx, OP, &deployment, target, false).await?;
        }
        if step.state == DeploymentState::Succeeded {
            // Right-hand sides read the row as it was: `previous` gets the old current.
            sqlx::query(
                "UPDATE environments SET \
                 previous_release_id = CASE WHEN current_release_id IS NULL \
                   OR current_release_id = $2 THEN previous_release_id \
                   ELSE current_release_id END, \
                 current_release_id = $2, updated_at = $3 WHERE id = $1",
            )
            .bind(deployment.environment_id.0)
            .bind(deployment.release.id.0)
            .bind(at)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        }
        let after = written(&mut tx, OP, step.id).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Some(after))
    }

    async fn target_observations(
        &self,
        environment: EnvironmentId,
    ) -> Result<Vec<TargetObservation>> {
        sqlx::query(concat!(
            "SELECT ",
            observation_columns!(),
            " FROM target_observations WHERE environment_id = $1 ORDER BY agent_id"
        ))
        .bind(environment.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list target observations"))?
        .iter()
        .map(rows::read_observation)
        .collect()
    }

    async fn put_target_observation(&self, o: TargetObservation) -> Result<()> {
        sqlx::query(
            "INSERT INTO target_observations (environment_id, agent_id, tenant_id, \
             check_task_id, next_check_at, drift, running_release, components, verified_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (environment_id, agent_id) DO UPDATE SET \
             check_task_id = excluded.check_task_id, next_check_at = excluded.next_check_at, \
             drift = excluded.drift, running_release = excluded.running_release, \
             components = excluded.components, verified_at = excluded.verified_at",
        )
        .bind(o.environment_id.0)
        .bind(o.agent_id.0)
        .bind(o.tenant_id.0)
        .bind(o.check_task_id.map(|t| t.0))
        .bind(millis(o.next_check_at))
        .bind(o.drift.as_str())
        .bind(&o.running_release)
        .bind(Json(&o.components))
        .bind(o.verified_at.map(millis))
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("put target observation"))?;
        Ok(())
    }
}
