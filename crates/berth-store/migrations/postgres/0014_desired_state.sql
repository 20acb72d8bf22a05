-- Desired-state environments (issue 11, seed 001), PostgreSQL flavour. Keep it column-for-column
-- symmetric with migrations/sqlite/0014_desired_state.sql.
ALTER TABLE environments ADD COLUMN desired_sha TEXT;
ALTER TABLE environments ADD COLUMN retired BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE environments ADD COLUMN purge_volumes BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE environments ADD COLUMN checkin_interval_secs BIGINT NOT NULL DEFAULT 60
    CHECK (checkin_interval_secs >= 1);

-- Content-addressed: (environment, sha) is written once and never replaced.
CREATE TABLE bundles (
    tenant_id      UUID           NOT NULL,
    environment_id UUID           NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    sha            TEXT           NOT NULL,
    content        BYTEA          NOT NULL,
    size           BIGINT         NOT NULL CHECK (size >= 0),
    created_at     TIMESTAMPTZ(3) NOT NULL,
    -- berth_proto::audit::AuditActor as JSON.
    created_by     JSONB          NOT NULL,
    PRIMARY KEY (environment_id, sha)
);

-- What each agent of a desired-state environment last said: `agent:<uuid>` (mTLS) or
-- `token:<env>` (an OpenBao bearer token).
CREATE TABLE desired_agents (
    environment_id  UUID           NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    agent_key       TEXT           NOT NULL,
    applied_sha     TEXT,
    last_result     TEXT           CHECK (last_result IS NULL OR last_result IN ('applied', 'failed', 'down')),
    detail          TEXT,
    -- berth_proto::desired::HostFacts
    host            JSONB          NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(host) = 'object'),
    -- [berth_proto::desired::ContainerState]
    containers      JSONB          NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(containers) = 'array'),
    -- At most 16 KiB, redacted before it is written.
    log_tail        TEXT,
    last_checkin_at TIMESTAMPTZ(3),
    last_report_at  TIMESTAMPTZ(3),
    PRIMARY KEY (environment_id, agent_key)
);
