//! Environments and deployments on SQLite. The single writer runs one operation at a time, so
//! each method's reads and writes form one transaction no other write interleaves with; the
//! constraints (`deployments_one_active`, the approvals' primary key) still decide what must
//! hold whatever the code above does.

use berth_proto::audit::actions::{DEPLOYMENT_APPROVE, DEPLOYMENT_CANCEL, ENVIRONMENT_UNPIN};
use berth_proto::audit::AuditActor;
use berth_proto::deploy::{DeploymentState, TargetPhase};
use berth_proto::{AgentId, DeploymentId, EnvironmentId, ReleaseId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;

use super::threads::Db;
use super::{id_text, json_text, Query, SqliteStore};
use crate::domain::audit::{admin_event, deployment_create_event, environment_create_event};
use crate::domain::tasks::deployment_target_key_prefix;
use crate::rows::{
    self, deployment_rows, environment_rows, observation_columns, target_columns, task_columns,
    unix_millis, ColumnReader,
};
use crate::{
    ApproveOutcome, CreateTaskOutcome, Deployment, DeploymentDetail, DeploymentGuard,
    DeploymentStep, DeploymentStore, DeploymentTarget, DeploymentTaskOutcome, Environment,
    NewDeployment, NewTask, Page, PayloadKey, Result, TargetObservation,
};

/// In a cancel's transaction: cancels the open tasks created for the deployment's targets
/// still `waiting` (a step that read the deployment before the cancel created them, and its
/// record fails on `version`), each with its audit entry. The agents to wake.
fn cancel_unstarted_tasks(
    tx: &Db<'_>,
    key: &PayloadKey,
    before: &DeploymentDetail,
    actor: AuditActor,
    now: OffsetDateTime,
) -> Result<Vec<AgentId>> {
    let id = before.deployment.id;
    let waiting: Vec<String> = before
        .targets
        .iter()
        .filter(|t| t.phase == TargetPhase::Waiting)
        .map(|t| deployment_target_key_prefix(id, t.agent_id))
        .collect();
    if waiting.is_empty() {
        return Ok(Vec::new());
    }
    let open = tx.all(
        concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE deployment_id = ?1 \
             AND state IN ('pending', 'retry_wait', 'leased') ORDER BY id"
        ),
        [id_text(id.0)],
        |row| rows::read_task(row, key),
    )?;
    let mut woken = Vec::new();
    for task in open {
        let unstarted = task
            .idempotency_key
            .as_deref()
            .is_some_and(|k| waiting.iter().any(|prefix| k.starts_with(prefix.as_str())));
        if unstarted {
            super::tasks::cancel_locked(tx, key, &task, actor.clone(), now)?;
            woken.push(task.agent_id);
        }
    }
    Ok(woken)
}

fn environment_by_id(db: &Db<'_>, id: EnvironmentId) -> Result<Option<Environment>> {
    db.optional(
        concat!(environment_rows!(), "id = ?1"),
        [id_text(id.0)],
        |row| rows::read_environment(row),
    )
}

fn environment_by_name(db: &Db<'_>, tenant: TenantId, name: &str) -> Result<Option<Environment>> {
    db.optional(
        concat!(environment_rows!(), "tenant_id = ?1 AND name = ?2"),
        params![id_text(tenant.0), name],
        |row| rows::read_environment(row),
    )
}

/// The deployment with its targets and approvals; of `tenant` when given.
fn detail(
    db: &Db<'_>,
    tenant: Option<TenantId>,
    id: DeploymentId,
) -> Result<Option<DeploymentDetail>> {
    let deployment = db.optional(
        concat!(
            deployment_rows!(),
            "id = ?1 AND (?2 IS NULL OR tenant_id = ?2)"
        ),
        params![id_text(id.0), tenant.map(|t| id_text(t.0))],
        |row| rows::read_deployment(row),
    )?;
    deployment.map(|d| with_parts(db, d)).transpose()
}

fn with_parts(db: &Db<'_>, deployment: Deployment) -> Result<DeploymentDetail> {
    let id = id_text(deployment.id.0);
    let targets = db.all(
        concat!(
            "SELECT ",
            target_columns!(),
            " FROM deployment_targets WHERE deployment_id = ?1 ORDER BY wave, agent_name, agent_id"
        ),
        [&id],
        |row| rows::read_deployment_target(row),
    )?;
    let approvals = db.all(
        "SELECT deployment_id, token_id, actor, approved_at FROM deployment_approvals \
         WHERE deployment_id = ?1 ORDER BY approved_at, token_id",
        [&id],
        |row| rows::read_approval(row),
    )?;
    Ok(DeploymentDetail {
        deployment,
        targets,
        approvals,
    })
}

/// Writes `target` whole: an update of its row (so a phase change fires the event trigger),
/// or an insert when the deployment has none for its agent yet.
fn put_target(
    db: &Db<'_>,
    deployment: &Deployment,
    target: &DeploymentTarget,
    insert_only: bool,
) -> Result<()> {
    let tasks = json_text("deployment_targets.tasks", &target.tasks)?;
    let rollback_tasks = json_text("deployment_targets.rollback_tasks", &target.rollback_tasks)?;
    let (deployment_id, agent_id) = (id_text(deployment.id.0), id_text(target.agent_id.0));
    let (started_at, finished_at) = (
        target.started_at.map(unix_millis),
        target.finished_at.map(unix_millis),
    );
    if !insert_only {
        let updated = db.execute(
            "UPDATE deployment_targets SET agent_name = ?3, wave = ?4, phase = ?5, tasks = ?6, \
             rollback_tasks = ?7, error_code = ?8, detail = ?9, started_at = ?10, \
             finished_at = ?11 WHERE deployment_id = ?1 AND agent_id = ?2",
            params![
                deployment_id,
                agent_id,
                target.agent_name,
                i64::from(target.wave),
                target.phase.as_str(),
                tasks,
                rollback_tasks,
                target.error_code,
                target.detail,
                started_at,
                finished_at,
            ],
        )?;
        if updated > 0 {
            return Ok(());
        }
    }
    db.execute(
        "INSERT INTO deployment_targets (deployment_id, agent_id, agent_name, wave, phase, \
         tasks, rollback_tasks, error_code, detail, started_at, finished_at, tenant_id, \
         environment_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        params![
            deployment_id,
            agent_id,
            target.agent_name,
            i64::from(target.wave),
            target.phase.as_str(),
            tasks,
            rollback_tasks,
            target.error_code,
            target.detail,
            started_at,
            finished_at,
            id_text(deployment.tenant_id.0),
            id_text(deployment.environment_id.0),
        ],
    )?;
    Ok(())
}

#[async_trait::async_trait]
impl DeploymentStore for SqliteStore {
    async fn create_environment(&self, env: Environment, actor: AuditActor) -> Result<Environment> {
        let selector = json_text("environments.selector", &env.selector)?;
        let policy = json_text("environments.policy", &env.policy)?;
        let created_by = json_text("environments.created_by", &env.created_by)?;
        self.writer
            .write("create environment", move |tx| {
                tx.execute(
                    "INSERT INTO environments (id, tenant_id, name, tier, selector, policy, \
                     promote_from, approvals, auto_heal, drift_interval_secs, \
                     current_release_id, previous_release_id, pinned_release_id, created_by, \
                     created_at, updated_at, target_type) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
                    params![
                        id_text(env.id.0),
                        id_text(env.tenant_id.0),
                        env.name,
                        env.tier.as_str(),
                        selector,
                        policy,
                        env.promote_from,
                        i64::from(env.approvals),
                        env.auto_heal,
                        i64::from(env.drift_interval_secs),
                        env.current_release.as_ref().map(|r| id_text(r.id.0)),
                        env.previous_release.as_ref().map(|r| id_text(r.id.0)),
                        env.pinned_release.as_ref().map(|r| id_text(r.id.0)),
                        created_by,
                        unix_millis(env.created_at),
                        unix_millis(env.updated_at),
                        env.target_type.as_str(),
                    ],
                )?;
                let created = environment_by_id(tx, env.id)?
                    .ok_or_else(|| crate::StoreError::Corrupt("environment vanished".into()))?;
                super::audit::append(tx, environment_create_event(&created, actor))?;
                Ok(created)
            })
            .await
    }

    async fn get_environment(&self, tenant: TenantId, name: &str) -> Result<Option<Environment>> {
        let name = name.to_owned();
        self.readers
            .read("get environment", move |db| {
                environment_by_name(db, tenant, &name)
            })
            .await
    }

    async fn list_environments(&self, tenant: TenantId) -> Result<Vec<Environment>> {
        self.readers
            .read("list environments", move |db| {
                db.all(
                    concat!(environment_rows!(), "tenant_id = ?1 ORDER BY name"),
                    [id_text(tenant.0)],
                    |row| rows::read_environment(row),
                )
            })
            .await
    }

    async fn environments_with_release(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>> {
        self.readers
            .read("list environments with a release", move |db| {
                db.all(
                    concat!(
                        environment_rows!(),
                        "current_release_id IS NOT NULL AND (?1 IS NULL OR id > ?1) \
                         ORDER BY id LIMIT ?2"
                    ),
                    params![after.map(|a| id_text(a.0)), i64::from(limit.max(1))],
                    |row| rows::read_environment(row),
                )
            })
            .await
    }

    async fn unpin_environment(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Environment>> {
        let name = name.to_owned();
        self.writer
            .write("unpin environment", move |tx| {
                let Some(before) = environment_by_name(tx, tenant, &name)? else {
                    return Ok(None);
                };
                tx.execute(
                    "UPDATE environments SET pinned_release_id = NULL, updated_at = ?2 \
                     WHERE id = ?1",
                    params![id_text(before.id.0), unix_millis(now)],
                )?;
                let details = serde_json::json!({
                    "name": before.name,
                    "unpinned": before.pinned_release.as_ref().map(|r| &r.name),
                });
                let event = admin_event(tenant, actor, ENVIRONMENT_UNPIN, before.id, details, now);
                super::audit::append(tx, event)?;
                environment_by_id(tx, before.id)
            })
            .await
    }

    async fn create_deployment(&self, new: NewDeployment) -> Result<DeploymentDetail> {
        let requested_by = json_text("deployments.requested_by", &new.deployment.requested_by)?;
        self.writer
            .write("create deployment", move |tx| {
                let d = &new.deployment;
                tx.execute(
                    "INSERT INTO deployments (id, tenant_id, environment_id, release_id, kind, \
                     state, rolling_back, requested_by, rollback_release_id, approvals_required, \
                     cancel_requested, current_wave, error_code, detail, version, created_at, \
                     updated_at, finished_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, 0, \
                     ?15, ?16, ?17)",
                    params![
                        id_text(d.id.0),
                        id_text(d.tenant_id.0),
                        id_text(d.environment_id.0),
                        id_text(d.release.id.0),
                        d.kind.as_str(),
                        d.state.as_str(),
                        d.rolling_back,
                        requested_by,
                        d.rollback_release.as_ref().map(|r| id_text(r.id.0)),
                        i64::from(d.approvals_required),
                        d.cancel_requested,
                        i64::from(d.current_wave),
                        d.error_code,
                        d.detail,
                        unix_millis(d.created_at),
                        unix_millis(d.updated_at),
                        d.finished_at.map(unix_millis),
                    ],
                )?;
                for target in &new.targets {
                    put_target(tx, d, target, true)?;
                }
                if new.pin {
                    tx.execute(
                        "UPDATE environments SET pinned_release_id = ?2, updated_at = ?3 \
                         WHERE id = ?1",
                        params![
                            id_text(d.environment_id.0),
                            id_text(d.release.id.0),
                            unix_millis(d.created_at)
                        ],
                    )?;
                }
                let created = detail(tx, None, d.id)?
                    .ok_or_else(|| crate::StoreError::Corrupt("deployment vanished".into()))?;
                super::audit::append(tx, deployment_create_event(&created, new.pin))?;
                Ok(created)
            })
            .await
    }

    async fn get_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
    ) -> Result<Option<DeploymentDetail>> {
        self.readers
            .read("get deployment", move |db| detail(db, Some(tenant), id))
            .await
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
        let mut query = Query::new(concat!(deployment_rows!(), "tenant_id = "));
        query.push_bind(id_text(tenant.0));
        if let Some(environment) = environment {
            query
                .push(" AND environment_id = ")
                .push_bind(id_text(environment.0));
        }
        self.fetch_page(
            "list deployments",
            query,
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order,
                limit,
            },
            |row| rows::read_deployment(row),
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
        let environment = environment.to_owned();
        self.readers
            .read("check promotion", move |db| {
                db.one(
                    "SELECT EXISTS (SELECT 1 FROM deployments d \
                     JOIN environments e ON e.id = d.environment_id \
                     WHERE e.tenant_id = ?1 AND e.name = ?2 AND d.release_id = ?3 \
                     AND d.state = 'succeeded') AS found",
                    params![id_text(tenant.0), environment, id_text(release.0)],
                    |row| row.flag("found"),
                )
            })
            .await
    }

    async fn approve_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<ApproveOutcome>> {
        let token = rows::approver_token(&actor)?;
        let actor_json = json_text("deployment_approvals.actor", &actor)?;
        self.writer
            .write("approve deployment", move |tx| {
                let Some(before) = detail(tx, Some(tenant), id)? else {
                    return Ok(None);
                };
                if before.deployment.state != DeploymentState::AwaitingApproval {
                    return Ok(Some(ApproveOutcome::NotAwaiting(before)));
                }
                let inserted = tx.execute(
                    "INSERT INTO deployment_approvals (deployment_id, token_id, actor, \
                     approved_at) VALUES (?1, ?2, ?3, ?4) \
                     ON CONFLICT (deployment_id, token_id) DO NOTHING",
                    params![
                        id_text(id.0),
                        id_text(token.0),
                        actor_json,
                        unix_millis(now)
                    ],
                )?;
                tx.execute(
                    "UPDATE deployments SET state = 'pending', version = version + 1, \
                     updated_at = ?2 \
                     WHERE id = ?1 AND state = 'awaiting_approval' AND approvals_required <= \
                     (SELECT count(*) FROM deployment_approvals WHERE deployment_id = ?1)",
                    params![id_text(id.0), unix_millis(now)],
                )?;
                let after = detail(tx, Some(tenant), id)?
                    .ok_or_else(|| crate::StoreError::Corrupt("deployment vanished".into()))?;
                if inserted > 0 {
                    let details = serde_json::json!({
                        "approvals": after.approvals.len(),
                        "state": after.deployment.state,
                    });
                    let event = admin_event(tenant, actor, DEPLOYMENT_APPROVE, id, details, now);
                    super::audit::append(tx, event)?;
                }
                Ok(Some(ApproveOutcome::Approved(after)))
            })
            .await
    }

    async fn cancel_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DeploymentDetail>> {
        let key = self.payload_key.clone();
        let (after, stopped) = self
            .writer
            .write("cancel deployment", move |tx| {
                let Some(before) = detail(tx, Some(tenant), id)? else {
                    return Ok((None, Vec::new()));
                };
                let stopped = match before.deployment.state {
                    DeploymentState::Pending
                    | DeploymentState::AwaitingApproval
                    | DeploymentState::Running => {
                        cancel_unstarted_tasks(tx, &key, &before, actor.clone(), now)?
                    }
                    _ => Vec::new(),
                };
                let at = unix_millis(now);
                let changed = match before.deployment.state {
                    DeploymentState::Pending | DeploymentState::AwaitingApproval => {
                        tx.execute(
                            "UPDATE deployment_targets SET phase = ?2, finished_at = ?3 \
                             WHERE deployment_id = ?1 AND phase = ?4",
                            params![
                                id_text(id.0),
                                TargetPhase::Skipped.as_str(),
                                at,
                                TargetPhase::Waiting.as_str()
                            ],
                        )?;
                        tx.execute(
                            "UPDATE deployments SET state = 'cancelled', finished_at = ?2, \
                             updated_at = ?2, version = version + 1 WHERE id = ?1",
                            params![id_text(id.0), at],
                        )?
                    }
                    DeploymentState::Running => tx.execute(
                        "UPDATE deployments SET cancel_requested = 1, updated_at = ?2, \
                         version = version + 1 WHERE id = ?1 AND cancel_requested = 0",
                        params![id_text(id.0), at],
                    )?,
                    _ => 0,
                };
                if changed == 0 {
                    return Ok((Some(before), stopped));
                }
                let after = detail(tx, Some(tenant), id)?
                    .ok_or_else(|| crate::StoreError::Corrupt("deployment vanished".into()))?;
                let details = serde_json::json!({
                    "state": after.deployment.state,
                    "cancelRequested": after.deployment.cancel_requested,
                });
                let event = admin_event(tenant, actor, DEPLOYMENT_CANCEL, id, details, now);
                super::audit::append(tx, event)?;
                Ok((Some(after), stopped))
            })
            .await?;
        for agent in stopped {
            self.wake(agent);
        }
        Ok(after)
    }

    async fn create_deployment_task(
        &self,
        guard: DeploymentGuard,
        task: NewTask,
    ) -> Result<DeploymentTaskOutcome> {
        let key = self.payload_key.clone();
        let payload = json_text("tasks.payload", &key.seal(task.id, &task.payload)?)?;
        let variables = json_text("tasks.variables", &task.variables)?;
        let outcome = self
            .writer
            .write("create deployment task", move |tx| {
                // The one writer: no cancel or step commits between this read and the insert.
                let current = tx.optional(
                    "SELECT state, version FROM deployments WHERE tenant_id = ?1 AND id = ?2",
                    params![id_text(task.tenant_id.0), id_text(guard.deployment_id.0)],
                    |row| Ok((row.text("state")?, row.int("version")?)),
                )?;
                let current = match current {
                    Some((state, version)) => Some((
                        DeploymentState::parse(&state).ok_or_else(|| {
                            crate::StoreError::Corrupt(format!(
                                "deployments.state: unknown {state:?}"
                            ))
                        })?,
                        version,
                    )),
                    None => None,
                };
                if !guard.holds(current) {
                    return Ok(DeploymentTaskOutcome::Superseded);
                }
                let deployment = Some(guard.deployment_id);
                super::tasks::create_in(tx, &key, &task, payload, variables, deployment)
                    .map(DeploymentTaskOutcome::Decided)
            })
            .await?;
        if let DeploymentTaskOutcome::Decided(CreateTaskOutcome::Created(task)) = &outcome {
            self.wake(task.agent_id);
        }
        Ok(outcome)
    }

    async fn active_deployments(&self, limit: u32) -> Result<Vec<DeploymentDetail>> {
        self.readers
            .read("list active deployments", move |db| {
                let active = db.all(
                    concat!(
                        deployment_rows!(),
                        "state IN ('pending', 'running') ORDER BY created_at, id LIMIT ?1"
                    ),
                    [i64::from(limit.max(1))],
                    |row| rows::read_deployment(row),
                )?;
                active.into_iter().map(|d| with_parts(db, d)).collect()
            })
            .await
    }

    async fn record_deployment_step(
        &self,
        step: DeploymentStep,
    ) -> Result<Option<DeploymentDetail>> {
        self.writer
            .write("record deployment step", move |tx| {
                let at = unix_millis(step.now);
                let finished = (!step.state.is_active()).then_some(at);
                let applied = tx.execute(
                    "UPDATE deployments SET state = ?4, rolling_back = ?5, current_wave = ?6, \
                     error_code = ?7, detail = ?8, version = version + 1, updated_at = ?9, \
                     finished_at = COALESCE(finished_at, ?10) \
                     WHERE tenant_id = ?1 AND id = ?2 AND version = ?3",
                    params![
                        id_text(step.tenant_id.0),
                        id_text(step.id.0),
                        step.expected_version,
                        step.state.as_str(),
                        step.rolling_back,
                        i64::from(step.current_wave),
                        step.error_code,
                        step.detail,
                        at,
                        finished,
                    ],
                )?;
                if applied == 0 {
                    return Ok(None);
                }
                let deployment = detail(tx, Some(step.tenant_id), step.id)?
                    .ok_or_else(|| crate::StoreError::Corrupt("deployment vanished".into()))?
                    .deployment;
                for target in &step.targets {
                    put_target(tx, &deployment, target, false)?;
                }
                if step.state == DeploymentState::Succeeded {
                    // Right-hand sides read the row as it was: `previous` gets the old current.
                    tx.execute(
                        "UPDATE environments SET \
                         previous_release_id = CASE WHEN current_release_id IS NULL \
                           OR current_release_id = ?2 THEN previous_release_id \
                           ELSE current_release_id END, \
                         current_release_id = ?2, updated_at = ?3 WHERE id = ?1",
                        params![
                            id_text(deployment.environment_id.0),
                            id_text(deployment.release.id.0),
                            at
                        ],
                    )?;
                }
                detail(tx, Some(step.tenant_id), step.id)
            })
            .await
    }

    async fn target_observations(
        &self,
        environment: EnvironmentId,
    ) -> Result<Vec<TargetObservation>> {
        self.readers
            .read("list target observations", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        observation_columns!(),
                        " FROM target_observations WHERE environment_id = ?1 ORDER BY agent_id"
                    ),
                    [id_text(environment.0)],
                    |row| rows::read_observation(row),
                )
            })
            .await
    }

    async fn put_target_observation(&self, observation: TargetObservation) -> Result<()> {
        let components = json_text("target_observations.components", &observation.components)?;
        self.writer
            .write("put target observation", move |tx| {
                let o = &observation;
                tx.execute(
                    "INSERT INTO target_observations (environment_id, agent_id, tenant_id, \
                     check_task_id, next_check_at, drift, running_release, components, \
                     verified_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
                     ON CONFLICT (environment_id, agent_id) DO UPDATE SET \
                     check_task_id = excluded.check_task_id, \
                     next_check_at = excluded.next_check_at, drift = excluded.drift, \
                     running_release = excluded.running_release, \
                     components = excluded.components, verified_at = excluded.verified_at",
                    params![
                        id_text(o.environment_id.0),
                        id_text(o.agent_id.0),
                        id_text(o.tenant_id.0),
                        o.check_task_id.map(|t| id_text(t.0)),
                        unix_millis(o.next_check_at),
                        o.drift.as_str(),
                        o.running_release,
                        components,
                        o.verified_at.map(unix_millis),
                    ],
                )?;
                Ok(())
            })
            .await
    }
}
