-- Environments and deployments (issue 10 items 2-5), SQLite flavour. Keep it column-for-column
-- symmetric with migrations/postgres/0012_deployments.sql.
CREATE TABLE environments (
    id                  TEXT    NOT NULL PRIMARY KEY,
    tenant_id           TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name                TEXT    NOT NULL,
    tier                TEXT    NOT NULL CHECK (tier IN ('dev', 'qa', 'prod')),
    -- {label: value}, every one required of a target.
    selector            TEXT    NOT NULL CHECK (json_type(selector) = 'object'),
    -- berth_proto::deploy::RolloutPolicy as JSON.
    policy              TEXT    NOT NULL CHECK (json_type(policy) = 'object'),
    promote_from        TEXT,
    approvals           INTEGER NOT NULL CHECK (approvals >= 0),
    auto_heal           INTEGER NOT NULL CHECK (auto_heal IN (0, 1)),
    drift_interval_secs INTEGER NOT NULL CHECK (drift_interval_secs >= 1),
    current_release_id  TEXT    REFERENCES releases (id),
    previous_release_id TEXT    REFERENCES releases (id),
    pinned_release_id   TEXT    REFERENCES releases (id),
    -- berth_proto::audit::AuditActor as JSON.
    created_by          TEXT    NOT NULL CHECK (json_valid(created_by)),
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    UNIQUE (tenant_id, name)
);

CREATE TABLE deployments (
    id                  TEXT    NOT NULL PRIMARY KEY,
    tenant_id           TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    environment_id      TEXT    NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    release_id          TEXT    NOT NULL REFERENCES releases (id),
    kind                TEXT    NOT NULL CHECK (kind IN ('deploy', 'rollback', 'heal')),
    state               TEXT    NOT NULL CHECK (state IN ('pending', 'awaiting_approval',
                                    'running', 'succeeded', 'failed', 'rolled_back', 'cancelled')),
    rolling_back        INTEGER NOT NULL DEFAULT 0 CHECK (rolling_back IN (0, 1)),
    requested_by        TEXT    NOT NULL CHECK (json_valid(requested_by)),
    rollback_release_id TEXT    REFERENCES releases (id),
    approvals_required  INTEGER NOT NULL CHECK (approvals_required >= 0),
    cancel_requested    INTEGER NOT NULL DEFAULT 0 CHECK (cancel_requested IN (0, 1)),
    current_wave        INTEGER NOT NULL DEFAULT 0,
    error_code          TEXT,
    detail              TEXT,
    version             INTEGER NOT NULL DEFAULT 0,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    finished_at         INTEGER
);
CREATE INDEX idx_deployments_tenant ON deployments (tenant_id, id);
CREATE INDEX idx_deployments_environment ON deployments (environment_id, id);
-- One active deployment per environment (DEPLOYMENT_IN_PROGRESS): decided here, at the write,
-- so two concurrent creates cannot both succeed.
CREATE UNIQUE INDEX deployments_one_active ON deployments (environment_id)
    WHERE state IN ('pending', 'awaiting_approval', 'running');

CREATE TABLE deployment_targets (
    deployment_id    TEXT    NOT NULL REFERENCES deployments (id) ON DELETE CASCADE,
    agent_id         TEXT    NOT NULL,
    -- Denormalised for the event triggers' filters.
    tenant_id        TEXT    NOT NULL,
    environment_id   TEXT    NOT NULL,
    agent_name       TEXT    NOT NULL,
    wave             INTEGER NOT NULL CHECK (wave >= 0),
    phase            TEXT    NOT NULL CHECK (phase IN ('waiting', 'queued', 'deploying', 'pulling', 'starting', 'health',
                         'succeeded', 'failed', 'unknown', 'rolling_back', 'rolled_back',
                         'rollback_failed', 'skipped')),
    -- [task id, …]
    tasks            TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(tasks) = 'array'),
    rollback_tasks   TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(rollback_tasks) = 'array'),
    error_code       TEXT,
    detail           TEXT,
    started_at       INTEGER,
    finished_at      INTEGER,
    PRIMARY KEY (deployment_id, agent_id)
);

CREATE TABLE deployment_approvals (
    deployment_id TEXT    NOT NULL REFERENCES deployments (id) ON DELETE CASCADE,
    token_id      TEXT    NOT NULL,
    actor         TEXT    NOT NULL CHECK (json_valid(actor)),
    approved_at   INTEGER NOT NULL,
    -- One approval per token, whatever the race.
    PRIMARY KEY (deployment_id, token_id)
);

CREATE TABLE target_observations (
    environment_id TEXT    NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    agent_id       TEXT    NOT NULL,
    tenant_id      TEXT    NOT NULL,
    check_task_id  TEXT,
    next_check_at  INTEGER NOT NULL,
    drift          TEXT    NOT NULL CHECK (drift IN ('in_sync', 'drifted', 'unverified')),
    running_release TEXT,
    -- [berth_proto::deploy::ObservedComponent]
    components     TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(components) = 'array'),
    verified_at    INTEGER,
    PRIMARY KEY (environment_id, agent_id)
);

-- The event stream's new subjects (see 0011).
ALTER TABLE events ADD COLUMN deployment_id TEXT;
ALTER TABLE events ADD COLUMN environment_id TEXT;

CREATE TRIGGER events_deployment_created AFTER INSERT ON deployments
BEGIN
    INSERT INTO events (tenant_id, kind, deployment_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'deployment.state', NEW.id, NEW.environment_id,
            json_object('deploymentId', NEW.id, 'environmentId', NEW.environment_id,
                        'state', NEW.state,
                        'rollingBack', json(CASE NEW.rolling_back WHEN 1 THEN 'true' ELSE 'false' END),
                        'cancelRequested', json(CASE NEW.cancel_requested WHEN 1 THEN 'true' ELSE 'false' END),
                        'currentWave', NEW.current_wave, 'errorCode', NEW.error_code),
            NEW.updated_at);
END;

CREATE TRIGGER events_deployment_state
AFTER UPDATE OF state, rolling_back, cancel_requested, current_wave ON deployments
WHEN OLD.state IS NOT NEW.state OR OLD.rolling_back IS NOT NEW.rolling_back
     OR OLD.cancel_requested IS NOT NEW.cancel_requested
     OR OLD.current_wave IS NOT NEW.current_wave
BEGIN
    INSERT INTO events (tenant_id, kind, deployment_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'deployment.state', NEW.id, NEW.environment_id,
            json_object('deploymentId', NEW.id, 'environmentId', NEW.environment_id,
                        'state', NEW.state,
                        'rollingBack', json(CASE NEW.rolling_back WHEN 1 THEN 'true' ELSE 'false' END),
                        'cancelRequested', json(CASE NEW.cancel_requested WHEN 1 THEN 'true' ELSE 'false' END),
                        'currentWave', NEW.current_wave, 'errorCode', NEW.error_code),
            NEW.updated_at);
END;

CREATE TRIGGER events_deployment_target AFTER UPDATE OF phase ON deployment_targets
WHEN OLD.phase IS NOT NEW.phase
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, deployment_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'deployment.target', NEW.agent_id, NEW.deployment_id,
            NEW.environment_id,
            json_object('deploymentId', NEW.deployment_id, 'agentId', NEW.agent_id,
                        'wave', NEW.wave, 'phase', NEW.phase, 'errorCode', NEW.error_code),
            CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;

-- SQLite has no INSERT OR UPDATE trigger; a first observation that is already drifted is an
-- event too.
CREATE TRIGGER events_drift_new AFTER INSERT ON target_observations
WHEN NEW.drift = 'drifted'
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'environment.drift', NEW.agent_id, NEW.environment_id,
            json_object('environmentId', NEW.environment_id, 'agentId', NEW.agent_id,
                        'drift', NEW.drift, 'runningRelease', NEW.running_release),
            COALESCE(NEW.verified_at, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)));
END;

CREATE TRIGGER events_drift AFTER UPDATE OF drift ON target_observations
WHEN OLD.drift IS NOT NEW.drift
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'environment.drift', NEW.agent_id, NEW.environment_id,
            json_object('environmentId', NEW.environment_id, 'agentId', NEW.agent_id,
                        'drift', NEW.drift, 'runningRelease', NEW.running_release),
            COALESCE(NEW.verified_at, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)));
END;

-- What a deploying delivery reports it is doing (berth_proto::transport::ProgressPhase), through
-- the start handshake; a change is an event, so a deployment's followers see it at once.
ALTER TABLE task_attempts ADD COLUMN phase TEXT
    CHECK (phase IS NULL OR phase IN ('pulling', 'starting', 'health'));

CREATE TRIGGER events_task_progress AFTER UPDATE OF phase ON task_attempts
WHEN OLD.phase IS NOT NEW.phase
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    SELECT t.tenant_id, 'task.progress', NEW.task_id, NEW.agent_id,
           json_object('taskId', NEW.task_id, 'agentId', NEW.agent_id,
                       'assignmentId', NEW.assignment_id, 'phase', NEW.phase),
           CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
    FROM tasks t WHERE t.id = NEW.task_id;
END;
