-- Retention (issue 16): the pruner takes the oldest finished tasks first (the tasks a read-back
-- still names are found through 0004's idx_tasks_read_back_of), so a batch never scans the table.
CREATE INDEX idx_tasks_finished ON tasks (finished_at)
    WHERE state IN ('succeeded', 'failed', 'dead_letter', 'cancelled', 'expired');
