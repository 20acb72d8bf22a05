-- Task transport (seed 003 delivery semantics), SQLite flavour. Keep it column-for-column
-- symmetric with migrations/postgres/0002_tasks.sql.
-- Tasks and attempts name their agent WITHOUT a foreign key: deleting an agent must not delete,
-- nor be refused by, the history of what it ran (delete_agent moves its open tasks on instead).

-- The session lease (fencing): which process instance holds the agent's identity, until when.
ALTER TABLE agents ADD COLUMN session_instance_id TEXT;
ALTER TABLE agents ADD COLUMN session_expires_at  INTEGER;

CREATE TABLE tasks (
    id                 TEXT    NOT NULL,
    -- Strict creation order for the claim queue (v7 ids only order to the millisecond).
    -- SQLite hands out AUTOINCREMENT only on the rowid, hence the primary key here.
    seq                INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    tenant_id          TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    agent_id           TEXT    NOT NULL,
    task_type          TEXT    NOT NULL,
    payload            TEXT    NOT NULL CHECK (json_valid(payload)),
    -- AEAD-sealed with the master key (aad = task id); never stored in clear.
    credentials_sealed BLOB,
    variables          TEXT    NOT NULL DEFAULT '{}' CHECK (json_type(variables) = 'object'),
    timeout_seconds    INTEGER NOT NULL CHECK (timeout_seconds >= 0),
    priority           INTEGER NOT NULL DEFAULT 0,
    side_effects       INTEGER NOT NULL CHECK (side_effects IN (0, 1)),
    idempotency_key    TEXT,
    request_hash       TEXT,
    read_back_of       TEXT    REFERENCES tasks (id),
    state              TEXT    NOT NULL
                               CHECK (state IN ('pending', 'leased', 'succeeded', 'failed',
                                                'retry_wait', 'dead_letter', 'unknown',
                                                'cancelled', 'expired')),
    attempts           INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at    INTEGER,
    current_assignment TEXT,
    lease_expires_at   INTEGER,
    cancel_requested   INTEGER NOT NULL DEFAULT 0 CHECK (cancel_requested IN (0, 1)),
    read_back          INTEGER NOT NULL DEFAULT 0 CHECK (read_back IN (0, 1)),
    error_code         TEXT,
    result             TEXT    CHECK (result IS NULL OR json_valid(result)),
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    finished_at        INTEGER,
    CONSTRAINT tasks_pkey UNIQUE (id),
    -- A leased task always names its delivery and its deadline.
    CONSTRAINT tasks_leased_has_assignment CHECK (
        state <> 'leased' OR (current_assignment IS NOT NULL AND lease_expires_at IS NOT NULL))
);

-- Idempotency-Key, unique per tenant; tasks without one never collide.
CREATE UNIQUE INDEX tasks_tenant_id_idempotency_key_key ON tasks (tenant_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- The claim query: an agent's open tasks by priority, then creation.
CREATE INDEX idx_tasks_claim ON tasks (agent_id, priority DESC, seq)
    WHERE state IN ('pending', 'retry_wait');
-- "Another side-effecting task of the agent is leased", pending cancellations, delete_agent.
CREATE INDEX idx_tasks_agent_leased ON tasks (agent_id) WHERE state = 'leased';
-- The lease sweep.
CREATE INDEX idx_tasks_lease_expiry ON tasks (lease_expires_at) WHERE state = 'leased';
-- Tenant listing by id.
CREATE INDEX idx_tasks_tenant ON tasks (tenant_id, id);

CREATE TABLE task_attempts (
    assignment_id    TEXT    NOT NULL PRIMARY KEY,
    task_id          TEXT    NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    agent_id         TEXT    NOT NULL,
    generation       INTEGER NOT NULL,
    state            TEXT    NOT NULL
                             CHECK (state IN ('leased', 'succeeded', 'failed', 'cancelled',
                                              'expired')),
    assigned_at      INTEGER NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    finished_at      INTEGER,
    -- The verified, signed result envelope as received (audit).
    envelope         TEXT    CHECK (envelope IS NULL OR json_valid(envelope)),
    error_code       TEXT
);

CREATE INDEX idx_task_attempts_task ON task_attempts (task_id, assigned_at);
