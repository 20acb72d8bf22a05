-- berth schema, SQLite flavour. Keep it column-for-column symmetric with
-- migrations/postgres/0001_init.sql (a test checks both directories hold the same migrations).
-- Ids are lowercase hyphenated UUID text (text order = byte order = creation order for v7),
-- JSON is TEXT, timestamps are INTEGER unix milliseconds.
-- Constraint names mirror the PostgreSQL ones; SQLite reports violations by column, and
-- src/rows.rs maps both spellings to the same StoreError::Conflict name.

CREATE TABLE tenants (
    id         TEXT    NOT NULL PRIMARY KEY,
    name       TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    CONSTRAINT tenants_name_key UNIQUE (name)
);

CREATE TABLE api_tokens (
    id         TEXT    NOT NULL PRIMARY KEY,
    tenant_id  TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name       TEXT    NOT NULL,
    role       TEXT    NOT NULL CHECK (role IN ('admin', 'deployer', 'viewer')),
    operator   INTEGER NOT NULL DEFAULT 0 CHECK (operator IN (0, 1)),
    token_hash TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    CONSTRAINT api_tokens_token_hash_key UNIQUE (token_hash)
);

CREATE INDEX idx_api_tokens_tenant ON api_tokens (tenant_id);

CREATE TABLE registration_tokens (
    id          TEXT    NOT NULL PRIMARY KEY,
    tenant_id   TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    token_hash  TEXT    NOT NULL,
    labels      TEXT    NOT NULL DEFAULT '{}' CHECK (json_type(labels) = 'object'),
    environment TEXT,
    expires_at  INTEGER NOT NULL,
    used_at     INTEGER,
    created_at  INTEGER NOT NULL,
    CONSTRAINT registration_tokens_token_hash_key UNIQUE (token_hash)
);

CREATE INDEX idx_registration_tokens_tenant ON registration_tokens (tenant_id);

-- Seed 000 "Database Schema", plus reported_status, environment, the certificate binding and
-- the fencing generation.
CREATE TABLE agents (
    id                      TEXT    NOT NULL PRIMARY KEY,
    tenant_id               TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name                    TEXT    NOT NULL,
    version                 TEXT    NOT NULL,
    capabilities            TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(capabilities) = 'array'),
    labels                  TEXT    NOT NULL DEFAULT '{}' CHECK (json_type(labels) = 'object'),
    status                  TEXT    NOT NULL DEFAULT 'offline'
                                    CHECK (status IN ('online', 'offline', 'degraded')),
    reported_status         TEXT    NOT NULL DEFAULT 'offline'
                                    CHECK (reported_status IN ('online', 'offline', 'degraded')),
    environment             TEXT,
    last_heartbeat          INTEGER,
    resource_usage          TEXT CHECK (resource_usage IS NULL OR json_valid(resource_usage)),
    -- NULLs never collide, so an unbound agent does not block anyone.
    certificate_fingerprint TEXT,
    certificate_expires_at  INTEGER,
    generation              INTEGER NOT NULL DEFAULT 0,
    created_at              INTEGER NOT NULL,
    updated_at              INTEGER NOT NULL,
    CONSTRAINT agents_tenant_id_name_key UNIQUE (tenant_id, name),
    CONSTRAINT agents_certificate_fingerprint_key UNIQUE (certificate_fingerprint)
);

-- The seed indexes tenant_id alone; (tenant_id, id) also serves the id-ordered listing.
CREATE INDEX idx_agents_tenant ON agents (tenant_id, id);
CREATE INDEX idx_agents_status ON agents (status);
