-- Builtin secrets and deploy grants (issue 11 items 5 and 6), SQLite flavour. Keep it
-- column-for-column symmetric with migrations/postgres/0015_secrets.sql.

-- One row per secret version, sealed: `ciphertext` is the value under a fresh data key,
-- `wrapped_key` that data key under the server's master key, both with the associated data
-- `<tenant>/<key>#<version>`. Nothing here is the value in clear.
CREATE TABLE secrets (
    tenant_id   TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    -- `<env>/<rest>` (berth_proto::desired::SecretPath::store_key).
    key         TEXT    NOT NULL,
    version     INTEGER NOT NULL CHECK (version >= 1),
    wrapped_key BLOB    NOT NULL,
    ciphertext  BLOB    NOT NULL,
    created_at  INTEGER NOT NULL,
    -- berth_proto::audit::AuditActor as JSON.
    created_by  TEXT    NOT NULL CHECK (json_valid(created_by)),
    deleted_at  INTEGER,
    -- Two concurrent puts of one key cannot get the same version: this key refuses the second.
    PRIMARY KEY (tenant_id, key, version)
);

-- Deploy grants: ES256 JWTs each signed by a key of its own (kid = jti). Only the public key
-- is kept; the JWKS serves the live ones (not superseded, not used, not expired).
CREATE TABLE grants (
    jti            TEXT    NOT NULL PRIMARY KEY,
    tenant_id      TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    environment_id TEXT    NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    kind           TEXT    NOT NULL CHECK (kind IN ('kit', 'lease')),
    public_jwk     TEXT    NOT NULL CHECK (json_valid(public_jwk)),
    issued_at      INTEGER NOT NULL,
    expires_at     INTEGER NOT NULL,
    superseded_at  INTEGER,
    used_at        INTEGER,
    -- The OpenBao token accessor the grant was exchanged for (the first use wins).
    token_accessor TEXT
);

CREATE INDEX grants_environment ON grants (environment_id);
