-- Releases (issue 10): immutable, a name per tenant plus components pinned by digest, or a
-- compose lock. Keep it column-for-column symmetric with migrations/postgres/0009_releases.sql.
CREATE TABLE releases (
    id           TEXT    NOT NULL PRIMARY KEY,
    tenant_id    TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name         TEXT    NOT NULL,
    -- [{name, image, digest, resolvedFrom?, config?}], every digest resolved by the server.
    components   TEXT    NOT NULL CHECK (json_type(components) = 'array'),
    compose_lock TEXT,
    created_at   INTEGER NOT NULL,
    -- A duplicate name is refused here (RELEASE_EXISTS), never by a read before the write.
    UNIQUE (tenant_id, name)
);

-- Immutable: nothing may change a release once written (deleting its tenant still removes it).
CREATE TRIGGER releases_immutable BEFORE UPDATE ON releases
BEGIN
    SELECT RAISE(ABORT, 'releases are immutable');
END;
