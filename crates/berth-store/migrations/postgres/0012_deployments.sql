-- Environments and deployments (issue 10 items 2-5), PostgreSQL flavour. Keep it column-for-column
-- symmetric with migrations/sqlite/0012_deployments.sql.
CREATE TABLE environments (
    id                  UUID           NOT NULL PRIMARY KEY,
    tenant_id           UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name                TEXT           NOT NULL,
    tier                TEXT           NOT NULL CHECK (tier IN ('dev', 'qa', 'prod')),
    -- {label: value}, every one required of a target.
    selector            JSONB          NOT NULL CHECK (jsonb_typeof(selector) = 'object'),
    -- berth_proto::deploy::RolloutPolicy as JSON.
    policy              JSONB          NOT NULL CHECK (jsonb_typeof(policy) = 'object'),
    promote_from        TEXT,
    approvals           BIGINT         NOT NULL CHECK (approvals >= 0),
    auto_heal           BOOLEAN        NOT NULL,
    drift_interval_secs BIGINT         NOT NULL CHECK (drift_interval_secs >= 1),
    current_release_id  UUID           REFERENCES releases (id),
    previous_release_id UUID           REFERENCES releases (id),
    pinned_release_id   UUID           REFERENCES releases (id),
    -- berth_proto::audit::AuditActor as JSON.
    created_by          JSONB          NOT NULL,
    created_at          TIMESTAMPTZ(3) NOT NULL,
    updated_at          TIMESTAMPTZ(3) NOT NULL,
    UNIQUE (tenant_id, name)
);

CREATE TABLE deployments (
    id                  UUID           NOT NULL PRIMARY KEY,
    tenant_id           UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    environment_id      UUID           NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    release_id          UUID           NOT NULL REFERENCES releases (id),
    kind                TEXT           NOT NULL CHECK (kind IN ('deploy', 'rollback', 'heal')),
    state               TEXT           NOT NULL CHECK (state IN ('pending', 'awaiting_approval',
                                           'running', 'succeeded', 'failed', 'rolled_back',
                                           'cancelled')),
    rolling_back        BOOLEAN        NOT NULL DEFAULT FALSE,
    requested_by        JSONB          NOT NULL,
    rollback_release_id UUID           REFERENCES releases (id),
    approvals_required  BIGINT         NOT NULL CHECK (approvals_required >= 0),
    cancel_requested    BOOLEAN        NOT NULL DEFAULT FALSE,
    current_wave        BIGINT         NOT NULL DEFAULT 0,
    error_code          TEXT,
    detail              TEXT,
    version             BIGINT         NOT NULL DEFAULT 0,
    created_at          TIMESTAMPTZ(3) NOT NULL,
    updated_at          TIMESTAMPTZ(3) NOT NULL,
    finished_at         TIMESTAMPTZ(3)
);
CREATE INDEX idx_deployments_tenant ON deployments (tenant_id, id);
CREATE INDEX idx_deployments_environment ON deployments (environment_id, id);
-- One active deployment per environment (DEPLOYMENT_IN_PROGRESS): decided here, at the write,
-- so two concurrent creates cannot both succeed (the second waits for the first to commit).
CREATE UNIQUE INDEX deployments_one_active ON deployments (environment_id)
    WHERE state IN ('pending', 'awaiting_approval', 'running');

CREATE TABLE deployment_targets (
    deployment_id    UUID           NOT NULL REFERENCES deployments (id) ON DELETE CASCADE,
    agent_id         UUID           NOT NULL,
    -- Denormalised for the event triggers' filters.
    tenant_id        UUID           NOT NULL,
    environment_id   UUID           NOT NULL,
    agent_name       TEXT           NOT NULL,
    wave             BIGINT         NOT NULL CHECK (wave >= 0),
    phase            TEXT           NOT NULL CHECK (phase IN ('waiting', 'queued', 'deploying', 'pulling', 'starting', 'health',
                                        'succeeded', 'failed', 'unknown', 'rolling_back',
                                        'rolled_back', 'rollback_failed', 'skipped')),
    -- [task id, …]
    tasks            JSONB          NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(tasks) = 'array'),
    rollback_tasks   JSONB          NOT NULL DEFAULT '[]'
                                    CHECK (jsonb_typeof(rollback_tasks) = 'array'),
    error_code       TEXT,
    detail           TEXT,
    started_at       TIMESTAMPTZ(3),
    finished_at      TIMESTAMPTZ(3),
    PRIMARY KEY (deployment_id, agent_id)
);

CREATE TABLE deployment_approvals (
    deployment_id UUID           NOT NULL REFERENCES deployments (id) ON DELETE CASCADE,
    token_id      UUID           NOT NULL,
    actor         JSONB          NOT NULL,
    approved_at   TIMESTAMPTZ(3) NOT NULL,
    -- One approval per token, whatever the race.
    PRIMARY KEY (deployment_id, token_id)
);

CREATE TABLE target_observations (
    environment_id  UUID           NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    agent_id        UUID           NOT NULL,
    tenant_id       UUID           NOT NULL,
    check_task_id   UUID,
    next_check_at   TIMESTAMPTZ(3) NOT NULL,
    drift           TEXT           NOT NULL CHECK (drift IN ('in_sync', 'drifted', 'unverified')),
    running_release TEXT,
    -- [berth_proto::deploy::ObservedComponent]
    components      JSONB          NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(components) = 'array'),
    verified_at     TIMESTAMPTZ(3),
    PRIMARY KEY (environment_id, agent_id)
);

-- The event stream's new subjects (see 0011). Rows are staged here and numbered at commit by
-- 0011's deferred `events_number()`.
ALTER TABLE events ADD COLUMN deployment_id UUID;
ALTER TABLE events ADD COLUMN environment_id UUID;

CREATE FUNCTION events_deployment() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, deployment_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'deployment.state', NEW.id, NEW.environment_id,
            jsonb_build_object('deploymentId', NEW.id, 'environmentId', NEW.environment_id,
                               'state', NEW.state, 'rollingBack', NEW.rolling_back,
                               'cancelRequested', NEW.cancel_requested,
                               'currentWave', NEW.current_wave, 'errorCode', NEW.error_code),
            NEW.updated_at);
    RETURN NULL;
END $$;

CREATE TRIGGER events_deployment_created AFTER INSERT ON deployments
    FOR EACH ROW EXECUTE FUNCTION events_deployment();
CREATE TRIGGER events_deployment_state AFTER UPDATE ON deployments FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          OR OLD.rolling_back IS DISTINCT FROM NEW.rolling_back
          OR OLD.cancel_requested IS DISTINCT FROM NEW.cancel_requested
          OR OLD.current_wave IS DISTINCT FROM NEW.current_wave)
    EXECUTE FUNCTION events_deployment();

CREATE FUNCTION events_deployment_target() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, deployment_id, environment_id, data,
                        created_at)
    VALUES (NEW.tenant_id, 'deployment.target', NEW.agent_id, NEW.deployment_id,
            NEW.environment_id,
            jsonb_build_object('deploymentId', NEW.deployment_id, 'agentId', NEW.agent_id,
                               'wave', NEW.wave, 'phase', NEW.phase,
                               'errorCode', NEW.error_code),
            now());
    RETURN NULL;
END $$;

CREATE TRIGGER events_deployment_target AFTER UPDATE ON deployment_targets FOR EACH ROW
    WHEN (OLD.phase IS DISTINCT FROM NEW.phase)
    EXECUTE FUNCTION events_deployment_target();

CREATE FUNCTION events_drift() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'environment.drift', NEW.agent_id, NEW.environment_id,
            jsonb_build_object('environmentId', NEW.environment_id, 'agentId', NEW.agent_id,
                               'drift', NEW.drift, 'runningRelease', NEW.running_release),
            COALESCE(NEW.verified_at, now()));
    RETURN NULL;
END $$;

-- A first observation that is already drifted is an event too.
CREATE TRIGGER events_drift_new AFTER INSERT ON target_observations FOR EACH ROW
    WHEN (NEW.drift = 'drifted')
    EXECUTE FUNCTION events_drift();
CREATE TRIGGER events_drift AFTER UPDATE ON target_observations FOR EACH ROW
    WHEN (OLD.drift IS DISTINCT FROM NEW.drift)
    EXECUTE FUNCTION events_drift();

-- What a deploying delivery reports it is doing (berth_proto::transport::ProgressPhase), through
-- the start handshake; a change is an event, so a deployment's followers see it at once.
ALTER TABLE task_attempts ADD COLUMN phase TEXT
    CHECK (phase IS NULL OR phase IN ('pulling', 'starting', 'health'));

CREATE FUNCTION events_task_progress() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    SELECT t.tenant_id, 'task.progress', NEW.task_id, NEW.agent_id,
           jsonb_build_object('taskId', NEW.task_id, 'agentId', NEW.agent_id,
                              'assignmentId', NEW.assignment_id, 'phase', NEW.phase),
           now()
    FROM tasks t WHERE t.id = NEW.task_id;
    RETURN NULL;
END $$;

CREATE TRIGGER events_task_progress AFTER UPDATE ON task_attempts FOR EACH ROW
    WHEN (OLD.phase IS DISTINCT FROM NEW.phase)
    EXECUTE FUNCTION events_task_progress();
