-- Releases (issue 10): immutable, a name per tenant plus components pinned by digest, or a
-- compose lock. Keep it column-for-column symmetric with migrations/sqlite/0009_releases.sql.
CREATE TABLE releases (
    id           UUID           NOT NULL PRIMARY KEY,
    tenant_id    UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name         TEXT           NOT NULL,
    -- [{name, image, digest, resolvedFrom?, config?}], every digest resolved by the server.
    components   JSONB          NOT NULL CHECK (jsonb_typeof(components) = 'array'),
    compose_lock TEXT,
    created_at   TIMESTAMPTZ(3) NOT NULL,
    -- A duplicate name is refused here (RELEASE_EXISTS), never by a read before the write.
    UNIQUE (tenant_id, name)
);

-- Immutable: nothing may change a release once written (deleting its tenant still removes it).
CREATE FUNCTION releases_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'releases are immutable';
END;
$$;
CREATE TRIGGER releases_immutable BEFORE UPDATE ON releases
    FOR EACH ROW EXECUTE FUNCTION releases_immutable();
