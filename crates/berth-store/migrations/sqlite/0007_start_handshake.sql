-- The start handshake (issue 9): a delivery whose poll promised to confirm its start before any
-- side effect (`start_handshake`), and when that start was confirmed (`started_at`, Unix ms). A
-- promised start that never came proves the delivery did nothing, so its lost lease requeues
-- the task instead of making it `unknown`.
ALTER TABLE task_attempts ADD COLUMN start_handshake INTEGER NOT NULL DEFAULT 0
    CHECK (start_handshake IN (0, 1));
ALTER TABLE task_attempts ADD COLUMN started_at INTEGER;
