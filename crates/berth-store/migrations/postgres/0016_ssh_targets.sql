-- SSH targets and artifacts (issue 12), PostgreSQL flavour. Keep it column-for-column
-- symmetric with migrations/sqlite/0016_ssh_targets.sql.

-- Files a release ships to SSH targets, content addressed per tenant (a second push of the same
-- bytes keeps the first row).
CREATE TABLE artifacts (
    tenant_id  UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    sha256     TEXT           NOT NULL CHECK (length(sha256) = 64),
    size       BIGINT         NOT NULL CHECK (size >= 0),
    content    BYTEA          NOT NULL,
    -- berth_proto::audit::AuditActor as JSON.
    created_by JSONB          NOT NULL,
    created_at TIMESTAMPTZ(3) NOT NULL,
    PRIMARY KEY (tenant_id, sha256)
);

-- Hosts without an agent. The private key is not here: `key_secret` names a builtin secret.
-- Its id stands where an agent's would in deployment_targets.agent_id and
-- target_observations.agent_id (both hold "the target's id").
CREATE TABLE ssh_targets (
    id           UUID           NOT NULL PRIMARY KEY,
    tenant_id    UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name         TEXT           NOT NULL,
    host         TEXT           NOT NULL,
    port         BIGINT         NOT NULL CHECK (port BETWEEN 1 AND 65535),
    user_name    TEXT           NOT NULL,
    -- Exactly one of an agent name and a non-empty label selector.
    via_agent    TEXT,
    via_selector JSONB          NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(via_selector) = 'object'),
    host_key     TEXT           NOT NULL,
    key_secret   TEXT           NOT NULL,
    labels       JSONB          NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(labels) = 'object'),
    created_at   TIMESTAMPTZ(3) NOT NULL,
    CHECK ((via_agent IS NULL) <> (via_selector = '{}'::jsonb)),
    UNIQUE (tenant_id, name)
);

ALTER TABLE environments ADD COLUMN target_type TEXT NOT NULL DEFAULT 'agents'
    CHECK (target_type IN ('agents', 'ssh'));

-- berth_proto::release::SshRelease as JSON, or NULL.
ALTER TABLE releases ADD COLUMN ssh JSONB;
