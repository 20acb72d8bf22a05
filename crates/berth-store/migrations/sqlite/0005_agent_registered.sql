-- An agent that registered but has not sent a heartbeat is `registered`, not `online`
-- (issue 9 item 8). SQLite cannot alter a CHECK, so the table is rebuilt (the documented
-- create-copy-drop-rename procedure); no table references agents, so nothing cascades.
CREATE TABLE agents_new (
    id                      TEXT    NOT NULL PRIMARY KEY,
    tenant_id               TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name                    TEXT    NOT NULL,
    version                 TEXT    NOT NULL,
    capabilities            TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(capabilities) = 'array'),
    labels                  TEXT    NOT NULL DEFAULT '{}' CHECK (json_type(labels) = 'object'),
    status                  TEXT    NOT NULL DEFAULT 'offline'
                                    CHECK (status IN ('registered', 'online', 'offline', 'degraded')),
    reported_status         TEXT    NOT NULL DEFAULT 'offline'
                                    CHECK (reported_status IN ('registered', 'online', 'offline', 'degraded')),
    environment             TEXT,
    last_heartbeat          INTEGER,
    resource_usage          TEXT CHECK (resource_usage IS NULL OR json_valid(resource_usage)),
    -- NULLs never collide, so an unbound agent does not block anyone.
    certificate_fingerprint TEXT,
    certificate_expires_at  INTEGER,
    generation              INTEGER NOT NULL DEFAULT 0,
    created_at              INTEGER NOT NULL,
    updated_at              INTEGER NOT NULL,
    session_instance_id     TEXT,
    session_expires_at      INTEGER,
    session_conflict_until  INTEGER,
    CONSTRAINT agents_tenant_id_name_key UNIQUE (tenant_id, name),
    CONSTRAINT agents_certificate_fingerprint_key UNIQUE (certificate_fingerprint)
);

INSERT INTO agents_new (id, tenant_id, name, version, capabilities, labels, status,
    reported_status, environment, last_heartbeat, resource_usage, certificate_fingerprint,
    certificate_expires_at, generation, created_at, updated_at, session_instance_id,
    session_expires_at, session_conflict_until)
SELECT id, tenant_id, name, version, capabilities, labels, status, reported_status, environment,
    last_heartbeat, resource_usage, certificate_fingerprint, certificate_expires_at, generation,
    created_at, updated_at, session_instance_id, session_expires_at, session_conflict_until
FROM agents;

DROP TABLE agents;
ALTER TABLE agents_new RENAME TO agents;

CREATE INDEX idx_agents_tenant ON agents (tenant_id, id);
CREATE INDEX idx_agents_status ON agents (status);
