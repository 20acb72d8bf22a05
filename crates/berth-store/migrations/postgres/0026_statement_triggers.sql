-- The task path runs in batches (issue 15, `postgres/task_batches.rs`): one statement inserts
-- or updates many tasks, and a sequencer pass numbers many events. Row triggers ran a PL/pgSQL
-- call and an INSERT for each row; these statement triggers stage the same events, and write
-- the same outbox rows, with one INSERT per statement, from its transition tables.
-- PostgreSQL only: SQLite's triggers are its own (migrations/sqlite).
DROP TRIGGER events_task_created ON tasks;
DROP TRIGGER events_task_state ON tasks;
DROP FUNCTION events_task();

-- 0011's `task.state` event, for every inserted task, in the statement's insert order.
CREATE FUNCTION events_tasks_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    SELECT n.tenant_id, 'task.state', n.id, n.agent_id,
           jsonb_build_object('taskId', n.id, 'agentId', n.agent_id, 'type', n.task_type,
                              'state', n.state, 'attempts', n.attempts,
                              'cancelRequested', n.cancel_requested,
                              'readBack', n.read_back, 'errorCode', n.error_code),
           n.updated_at
    FROM new_tasks n ORDER BY n.seq;
    RETURN NULL;
END $$;

-- The same for every updated task whose state, cancel request, agent or attempts changed
-- (0011's WHEN clause).
CREATE FUNCTION events_tasks_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    SELECT n.tenant_id, 'task.state', n.id, n.agent_id,
           jsonb_build_object('taskId', n.id, 'agentId', n.agent_id, 'type', n.task_type,
                              'state', n.state, 'attempts', n.attempts,
                              'cancelRequested', n.cancel_requested,
                              'readBack', n.read_back, 'errorCode', n.error_code),
           n.updated_at
    FROM new_tasks n JOIN old_tasks o ON o.id = n.id
    WHERE o.state IS DISTINCT FROM n.state
       OR o.cancel_requested IS DISTINCT FROM n.cancel_requested
       OR o.agent_id IS DISTINCT FROM n.agent_id
       OR o.attempts IS DISTINCT FROM n.attempts
    ORDER BY n.seq;
    RETURN NULL;
END $$;

CREATE TRIGGER events_task_created AFTER INSERT ON tasks
    REFERENCING NEW TABLE AS new_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION events_tasks_inserted();
CREATE TRIGGER events_task_state AFTER UPDATE ON tasks
    REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION events_tasks_updated();

-- 0019's outbox rows, for every event the statement numbered (a statement trigger takes no
-- column list, so the numbering is told apart by its old and new `id`).
DROP TRIGGER notifications_outbox ON events;
CREATE OR REPLACE FUNCTION notifications_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO notifications (tenant_id, webhook_id, event_id, event_kind, event_data, event_at,
                               idempotency_key, state, next_attempt_at, created_at, updated_at)
    SELECT n.tenant_id, w.id, n.id, n.kind, n.data, n.created_at,
           w.id || ':' || n.id, 'pending', n.created_at, n.created_at, n.created_at
    FROM new_events n
    JOIN old_events o ON o.row_id = n.row_id
    JOIN webhooks w ON w.tenant_id = n.tenant_id AND w.events ? n.kind
    WHERE o.id IS NULL AND n.id IS NOT NULL
    ORDER BY n.id, w.id;
    RETURN NULL;
END $$;
CREATE TRIGGER notifications_outbox AFTER UPDATE ON events
    REFERENCING OLD TABLE AS old_events NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION notifications_outbox();
