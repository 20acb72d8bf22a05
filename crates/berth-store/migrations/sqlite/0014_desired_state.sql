-- Desired-state environments (issue 11, seed 001), SQLite flavour. Keep it column-for-column
-- symmetric with migrations/postgres/0014_desired_state.sql.
ALTER TABLE environments ADD COLUMN desired_sha TEXT;
ALTER TABLE environments ADD COLUMN retired INTEGER NOT NULL DEFAULT 0 CHECK (retired IN (0, 1));
ALTER TABLE environments ADD COLUMN purge_volumes INTEGER NOT NULL DEFAULT 0
    CHECK (purge_volumes IN (0, 1));
ALTER TABLE environments ADD COLUMN checkin_interval_secs INTEGER NOT NULL DEFAULT 60
    CHECK (checkin_interval_secs >= 1);

-- Content-addressed: (environment, sha) is written once and never replaced.
CREATE TABLE bundles (
    tenant_id      TEXT    NOT NULL,
    environment_id TEXT    NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    sha            TEXT    NOT NULL,
    content        BLOB    NOT NULL,
    size           INTEGER NOT NULL CHECK (size >= 0),
    created_at     INTEGER NOT NULL,
    -- berth_proto::audit::AuditActor as JSON.
    created_by     TEXT    NOT NULL CHECK (json_valid(created_by)),
    PRIMARY KEY (environment_id, sha)
);

-- What each agent of a desired-state environment last said: `agent:<uuid>` (mTLS) or
-- `token:<env>` (an OpenBao bearer token).
CREATE TABLE desired_agents (
    environment_id  TEXT    NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    agent_key       TEXT    NOT NULL,
    applied_sha     TEXT,
    last_result     TEXT    CHECK (last_result IS NULL OR last_result IN ('applied', 'failed', 'down')),
    detail          TEXT,
    -- berth_proto::desired::HostFacts
    host            TEXT    NOT NULL DEFAULT '{}' CHECK (json_type(host) = 'object'),
    -- [berth_proto::desired::ContainerState]
    containers      TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(containers) = 'array'),
    -- At most 16 KiB, redacted before it is written.
    log_tail        TEXT,
    last_checkin_at INTEGER,
    last_report_at  INTEGER,
    PRIMARY KEY (environment_id, agent_key)
);
