-- The event stream (issue 10 item 7), SQLite flavour. Keep it symmetric with
-- migrations/postgres/0011_events.sql.
-- Events are written by triggers on the rows they describe, so every state change, whichever
-- store method makes it, writes its event in its own transaction. The one writer connection
-- commits in order, so AUTOINCREMENT ids become visible in id order: a reader that has seen id
-- N has seen every id below it.
CREATE TABLE events (
    id         INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    tenant_id  TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    -- The subjects a client filters by; later deployment and environment ids.
    task_id    TEXT,
    agent_id   TEXT,
    data       TEXT    NOT NULL CHECK (json_valid(data)),
    created_at INTEGER NOT NULL
);
CREATE INDEX idx_events_tenant ON events (tenant_id, id);

-- SQLite has no trigger functions and no INSERT OR UPDATE trigger: the insert and update
-- triggers repeat one INSERT (PostgreSQL shares `events_task()`).
CREATE TRIGGER events_task_created AFTER INSERT ON tasks
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'task.state', NEW.id, NEW.agent_id,
            json_object('taskId', NEW.id, 'agentId', NEW.agent_id, 'type', NEW.task_type,
                        'state', NEW.state, 'attempts', NEW.attempts,
                        'cancelRequested', json(CASE NEW.cancel_requested WHEN 1 THEN 'true' ELSE 'false' END),
                        'readBack', json(CASE NEW.read_back WHEN 1 THEN 'true' ELSE 'false' END),
                        'errorCode', NEW.error_code),
            NEW.updated_at);
END;

CREATE TRIGGER events_task_state AFTER UPDATE OF state, cancel_requested, agent_id, attempts ON tasks
WHEN OLD.state IS NOT NEW.state OR OLD.cancel_requested IS NOT NEW.cancel_requested
     OR OLD.agent_id IS NOT NEW.agent_id OR OLD.attempts IS NOT NEW.attempts
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'task.state', NEW.id, NEW.agent_id,
            json_object('taskId', NEW.id, 'agentId', NEW.agent_id, 'type', NEW.task_type,
                        'state', NEW.state, 'attempts', NEW.attempts,
                        'cancelRequested', json(CASE NEW.cancel_requested WHEN 1 THEN 'true' ELSE 'false' END),
                        'readBack', json(CASE NEW.read_back WHEN 1 THEN 'true' ELSE 'false' END),
                        'errorCode', NEW.error_code),
            NEW.updated_at);
END;

CREATE TRIGGER events_agent_registered AFTER INSERT ON agents
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'agent.registered', NEW.id,
            json_object('agentId', NEW.id, 'name', NEW.name, 'status', NEW.status),
            NEW.updated_at);
END;

CREATE TRIGGER events_agent_status AFTER UPDATE OF status ON agents
WHEN OLD.status IS NOT NEW.status
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'agent.status', NEW.id,
            json_object('agentId', NEW.id, 'name', NEW.name, 'status', NEW.status),
            NEW.updated_at);
END;

CREATE TRIGGER events_agent_deleted AFTER DELETE ON agents
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
    VALUES (OLD.tenant_id, 'agent.deleted', OLD.id,
            json_object('agentId', OLD.id, 'name', OLD.name),
            CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;
