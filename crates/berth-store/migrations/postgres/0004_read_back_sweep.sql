-- The read-back sweep (TaskStore::unknown_without_read_back, finished_read_backs_of_unknown)
-- starts from the `unknown` tasks, by id, and finds each one's read-back through the unique
-- (tenant_id, idempotency_key) index.
CREATE INDEX idx_tasks_unknown ON tasks (id) WHERE state = 'unknown';
-- A task's read-backs: a retry releases their keys (TaskStore::retry_task); also the index the
-- read_back_of foreign key wants.
CREATE INDEX idx_tasks_read_back_of ON tasks (read_back_of) WHERE read_back_of IS NOT NULL;
