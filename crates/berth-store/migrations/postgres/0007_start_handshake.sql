-- The start handshake (issue 9): a delivery whose poll promised to confirm its start before any
-- side effect (`start_handshake`), and when that start was confirmed (`started_at`). A promised
-- start that never came proves the delivery did nothing, so its lost lease requeues the task
-- instead of making it `unknown`.
ALTER TABLE task_attempts ADD COLUMN start_handshake BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE task_attempts ADD COLUMN started_at TIMESTAMPTZ(3);
