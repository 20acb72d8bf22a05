-- The read-back sweep (TaskStore::unknown_without_read_back, finished_read_backs_of_unknown)
-- starts from the `unknown` tasks, by id, and finds each one's read-back through the unique
-- (tenant_id, idempotency_key) index.
CREATE INDEX idx_tasks_unknown ON tasks (id) WHERE state = 'unknown';
