-- The audit log: one hash-chained chain per tenant (berth_proto::audit). `entry` is the entry's
-- JSON exactly as hashed (TEXT, not JSONB, so it is returned byte for byte); `seq` and `hash`
-- repeat what it says, for ordering and the chain head. Appends take an advisory lock on the
-- tenant's chain; the primary key is the backstop against a fork.
-- No foreign key to tenants: the log outlives what it describes.
CREATE TABLE audit_log (
    tenant_id UUID   NOT NULL,
    seq       BIGINT NOT NULL,
    hash      TEXT   NOT NULL,
    entry     TEXT   NOT NULL,
    CONSTRAINT audit_log_pkey PRIMARY KEY (tenant_id, seq)
);
