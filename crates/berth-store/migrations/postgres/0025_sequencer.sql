-- Commit-ordered numbering leaves the writers' commits (issue 15, `postgres/sequencer.rs`).
-- 0011 numbered each event at its writer's COMMIT under one cluster-wide lock, and every audit
-- append linked its entry under its tenant's lock; both locks were held through the commit's
-- WAL flush, so every task creation and result in the cluster took turns on them. Now writers
-- only stage (events with `id` NULL, as 0011's row triggers already did; audit entries in
-- `audit_pending`), and sequencer passes number and link what committed, many at a time.
-- PostgreSQL only: SQLite has one writer, which numbers and links in its own batches.
DROP TRIGGER events_number ON events;
DROP FUNCTION events_number();

-- The pass finds the staged events in staging order without scanning the numbered ones.
CREATE INDEX idx_events_staged ON events (row_id) WHERE id IS NULL;

CREATE TABLE audit_pending (
    -- Staging order, which a pass links in.
    id        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id UUID NOT NULL,
    -- The entry as `domain::audit::draft` makes it: no seq and no hashes yet.
    draft     TEXT NOT NULL
);
