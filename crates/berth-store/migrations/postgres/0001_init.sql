-- berth schema, PostgreSQL flavour. Keep it column-for-column symmetric with
-- migrations/sqlite/0001_init.sql (a test checks both directories hold the same migrations).
-- Timestamps are TIMESTAMPTZ(3): the store truncates to milliseconds before writing, so both
-- backends return identical values.
-- Constraint names are spelled out because src/rows.rs maps them to StoreError::Conflict names.

CREATE TABLE tenants (
    id         UUID           NOT NULL PRIMARY KEY,
    name       TEXT           NOT NULL,
    created_at TIMESTAMPTZ(3) NOT NULL,
    CONSTRAINT tenants_name_key UNIQUE (name)
);

CREATE TABLE api_tokens (
    id         UUID           NOT NULL PRIMARY KEY,
    tenant_id  UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name       TEXT           NOT NULL,
    role       TEXT           NOT NULL CHECK (role IN ('admin', 'deployer', 'viewer')),
    operator   BOOLEAN        NOT NULL DEFAULT FALSE,
    token_hash TEXT           NOT NULL,
    created_at TIMESTAMPTZ(3) NOT NULL,
    CONSTRAINT api_tokens_token_hash_key UNIQUE (token_hash)
);

CREATE INDEX idx_api_tokens_tenant ON api_tokens (tenant_id);

CREATE TABLE registration_tokens (
    id          UUID           NOT NULL PRIMARY KEY,
    tenant_id   UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    token_hash  TEXT           NOT NULL,
    labels      JSONB          NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(labels) = 'object'),
    environment TEXT,
    expires_at  TIMESTAMPTZ(3) NOT NULL,
    used_at     TIMESTAMPTZ(3),
    created_at  TIMESTAMPTZ(3) NOT NULL,
    CONSTRAINT registration_tokens_token_hash_key UNIQUE (token_hash)
);

CREATE INDEX idx_registration_tokens_tenant ON registration_tokens (tenant_id);

-- Seed 000 "Database Schema", plus reported_status, environment, the certificate binding and
-- the fencing generation.
CREATE TABLE agents (
    id                      UUID           NOT NULL PRIMARY KEY,
    tenant_id               UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name                    TEXT           NOT NULL,
    version                 TEXT           NOT NULL,
    capabilities            JSONB          NOT NULL DEFAULT '[]'
                                           CHECK (jsonb_typeof(capabilities) = 'array'),
    labels                  JSONB          NOT NULL DEFAULT '{}'
                                           CHECK (jsonb_typeof(labels) = 'object'),
    status                  TEXT           NOT NULL DEFAULT 'offline'
                                           CHECK (status IN ('online', 'offline', 'degraded')),
    reported_status         TEXT           NOT NULL DEFAULT 'offline'
                                           CHECK (reported_status IN ('online', 'offline', 'degraded')),
    environment             TEXT,
    last_heartbeat          TIMESTAMPTZ(3),
    resource_usage          JSONB,
    -- NULLs never collide, so an unbound agent does not block anyone.
    certificate_fingerprint TEXT,
    certificate_expires_at  TIMESTAMPTZ(3),
    generation              BIGINT         NOT NULL DEFAULT 0,
    created_at              TIMESTAMPTZ(3) NOT NULL,
    updated_at              TIMESTAMPTZ(3) NOT NULL,
    CONSTRAINT agents_tenant_id_name_key UNIQUE (tenant_id, name),
    CONSTRAINT agents_certificate_fingerprint_key UNIQUE (certificate_fingerprint)
);

-- The seed indexes tenant_id alone; (tenant_id, id) also serves the id-ordered listing.
CREATE INDEX idx_agents_tenant ON agents (tenant_id, id);
CREATE INDEX idx_agents_status ON agents (status);
CREATE INDEX idx_agents_capabilities ON agents USING GIN (capabilities);
-- Label selectors (`labels @> {"k": "v"}`) are how environments pick their targets.
CREATE INDEX idx_agents_labels ON agents USING GIN (labels);
