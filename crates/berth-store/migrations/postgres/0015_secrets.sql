-- Builtin secrets and deploy grants (issue 11 items 5 and 6), PostgreSQL flavour. Keep it
-- column-for-column symmetric with migrations/sqlite/0015_secrets.sql.

-- One row per secret version, sealed: `ciphertext` is the value under a fresh data key,
-- `wrapped_key` that data key under the server's master key, both with the associated data
-- `<tenant>/<key>#<version>`. Nothing here is the value in clear.
CREATE TABLE secrets (
    tenant_id   UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    -- `<env>/<rest>` (berth_proto::desired::SecretPath::store_key).
    key         TEXT           NOT NULL,
    version     BIGINT         NOT NULL CHECK (version >= 1),
    wrapped_key BYTEA          NOT NULL,
    ciphertext  BYTEA          NOT NULL,
    created_at  TIMESTAMPTZ(3) NOT NULL,
    -- berth_proto::audit::AuditActor as JSON.
    created_by  JSONB          NOT NULL,
    deleted_at  TIMESTAMPTZ(3),
    -- Two concurrent puts of one key cannot get the same version: this key refuses the second.
    PRIMARY KEY (tenant_id, key, version)
);

-- Deploy grants: ES256 JWTs each signed by a key of its own (kid = jti). Only the public key
-- is kept; the JWKS serves the live ones (not superseded, not used, not expired).
CREATE TABLE grants (
    jti            TEXT           NOT NULL PRIMARY KEY,
    tenant_id      UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    environment_id UUID           NOT NULL REFERENCES environments (id) ON DELETE CASCADE,
    kind           TEXT           NOT NULL CHECK (kind IN ('kit', 'lease')),
    public_jwk     JSONB          NOT NULL,
    issued_at      TIMESTAMPTZ(3) NOT NULL,
    expires_at     TIMESTAMPTZ(3) NOT NULL,
    superseded_at  TIMESTAMPTZ(3),
    used_at        TIMESTAMPTZ(3),
    -- The OpenBao token accessor the grant was exchanged for (the first use wins).
    token_accessor TEXT
);

CREATE INDEX grants_environment ON grants (environment_id);
