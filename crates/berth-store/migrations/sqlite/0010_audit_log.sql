-- The audit log: one hash-chained chain per tenant (berth_proto::audit). `entry` is the entry's
-- JSON exactly as hashed; `seq` and `hash` repeat what it says, for ordering and the chain head.
-- No foreign key to tenants: the log outlives what it describes.
CREATE TABLE audit_log (
    tenant_id TEXT    NOT NULL,
    seq       INTEGER NOT NULL,
    hash      TEXT    NOT NULL,
    entry     TEXT    NOT NULL,
    CONSTRAINT audit_log_pkey PRIMARY KEY (tenant_id, seq)
);
