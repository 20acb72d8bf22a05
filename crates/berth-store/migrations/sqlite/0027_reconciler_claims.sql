-- Reconciler claims (issue 29 item 3): before a replica works one unit of a reconciler (an
-- environment's drift check, a deployment's step, ...) it takes this row. A holder keeps it
-- until it lets go or `expires_at` passes, judged by the database's clock (never a replica's),
-- so a replica that died mid-unit loses its claim when the lease runs out.
CREATE TABLE reconciler_claims (
    reconciler TEXT    NOT NULL,
    unit       TEXT    NOT NULL,
    holder     TEXT    NOT NULL,
    -- Milliseconds since the epoch, as every other timestamp here.
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (reconciler, unit)
);
