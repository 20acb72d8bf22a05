-- Task transport (seed 003 delivery semantics), PostgreSQL flavour. Keep it column-for-column
-- symmetric with migrations/sqlite/0002_tasks.sql.
-- Tasks and attempts name their agent WITHOUT a foreign key: deleting an agent must not delete,
-- nor be refused by, the history of what it ran (delete_agent moves its open tasks on instead).

-- The session lease (fencing): which process instance holds the agent's identity, until when.
ALTER TABLE agents ADD COLUMN session_instance_id TEXT;
ALTER TABLE agents ADD COLUMN session_expires_at  TIMESTAMPTZ(3);

CREATE TABLE tasks (
    id                 UUID           NOT NULL PRIMARY KEY,
    -- Strict creation order for the claim queue (v7 ids only order to the millisecond).
    seq                BIGINT         NOT NULL GENERATED ALWAYS AS IDENTITY,
    tenant_id          UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    agent_id           UUID           NOT NULL,
    task_type          TEXT           NOT NULL,
    payload            JSONB          NOT NULL,
    -- AEAD-sealed with the master key (aad = task id); never stored in clear.
    credentials_sealed BYTEA,
    variables          JSONB          NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(variables) = 'object'),
    timeout_seconds    BIGINT         NOT NULL CHECK (timeout_seconds >= 0),
    priority           BIGINT         NOT NULL DEFAULT 0,
    side_effects       BOOLEAN        NOT NULL,
    idempotency_key    TEXT,
    request_hash       TEXT,
    read_back_of       UUID           REFERENCES tasks (id),
    state              TEXT           NOT NULL
                                      CHECK (state IN ('pending', 'leased', 'succeeded', 'failed',
                                                       'retry_wait', 'dead_letter', 'unknown',
                                                       'cancelled', 'expired')),
    attempts           BIGINT         NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at    TIMESTAMPTZ(3),
    current_assignment UUID,
    lease_expires_at   TIMESTAMPTZ(3),
    cancel_requested   BOOLEAN        NOT NULL DEFAULT FALSE,
    read_back          BOOLEAN        NOT NULL DEFAULT FALSE,
    error_code         TEXT,
    result             JSONB,
    created_at         TIMESTAMPTZ(3) NOT NULL,
    updated_at         TIMESTAMPTZ(3) NOT NULL,
    finished_at        TIMESTAMPTZ(3),
    CONSTRAINT tasks_seq_key UNIQUE (seq),
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
    assignment_id    UUID           NOT NULL PRIMARY KEY,
    task_id          UUID           NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    agent_id         UUID           NOT NULL,
    generation       BIGINT         NOT NULL,
    state            TEXT           NOT NULL
                                    CHECK (state IN ('leased', 'succeeded', 'failed', 'cancelled',
                                                     'expired')),
    assigned_at      TIMESTAMPTZ(3) NOT NULL,
    lease_expires_at TIMESTAMPTZ(3) NOT NULL,
    finished_at      TIMESTAMPTZ(3),
    -- The verified, signed result envelope as received (audit).
    envelope         JSONB,
    error_code       TEXT
);

CREATE INDEX idx_task_attempts_task ON task_attempts (task_id, assigned_at);
