-- The event stream (issue 10 item 7), PostgreSQL flavour. Keep it symmetric with
-- migrations/sqlite/0011_events.sql.
-- Events are written by triggers on the rows they describe, so every state change, whichever
-- store method makes it, writes its event in its own transaction.
--
-- Ids in commit order: a sequence value is taken when a statement runs, not when its
-- transaction commits, so a reader could see id 11 committed while id 10 is still in flight,
-- move its cursor past 10 and never see it. So a row trigger only stages the event (`id` NULL),
-- and a DEFERRED constraint trigger numbers it at COMMIT under a transaction-scoped advisory
-- lock: the lock is released only after the commit is visible, so the transaction numbering the
-- next event waits until every lower id is visible. The lock covers the end of the commit only
-- (the deferred triggers and the commit record), not the transaction's work.
CREATE SEQUENCE events_id_seq;

CREATE TABLE events (
    -- Internal row key; `id` is the public, commit-ordered sequence number.
    row_id     BIGINT         GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id         BIGINT         UNIQUE,
    tenant_id  UUID           NOT NULL,
    kind       TEXT           NOT NULL,
    task_id    UUID,
    agent_id   UUID,
    data       JSONB          NOT NULL,
    created_at TIMESTAMPTZ(3) NOT NULL
);
CREATE INDEX idx_events_tenant ON events (tenant_id, id) WHERE id IS NOT NULL;

CREATE FUNCTION events_number() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Any constant key shared by every writer; 'berth_events' hashed by hand.
    PERFORM pg_advisory_xact_lock(7301542390455211101);
    UPDATE events SET id = nextval('events_id_seq') WHERE row_id = NEW.row_id;
    -- Delivered at commit, to every replica's listener: wakes streaming readers.
    PERFORM pg_notify('berth_events', '');
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER events_number AFTER INSERT ON events
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION events_number();

CREATE FUNCTION events_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, task_id, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'task.state', NEW.id, NEW.agent_id,
            jsonb_build_object('taskId', NEW.id, 'agentId', NEW.agent_id, 'type', NEW.task_type,
                               'state', NEW.state, 'attempts', NEW.attempts,
                               'cancelRequested', NEW.cancel_requested,
                               'readBack', NEW.read_back, 'errorCode', NEW.error_code),
            NEW.updated_at);
    RETURN NULL;
END $$;

CREATE TRIGGER events_task_created AFTER INSERT ON tasks
    FOR EACH ROW EXECUTE FUNCTION events_task();
CREATE TRIGGER events_task_state AFTER UPDATE ON tasks FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          OR OLD.cancel_requested IS DISTINCT FROM NEW.cancel_requested
          OR OLD.agent_id IS DISTINCT FROM NEW.agent_id
          OR OLD.attempts IS DISTINCT FROM NEW.attempts)
    EXECUTE FUNCTION events_task();

CREATE FUNCTION events_agent() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
        VALUES (OLD.tenant_id, 'agent.deleted', OLD.id,
                jsonb_build_object('agentId', OLD.id, 'name', OLD.name), now());
        RETURN NULL;
    END IF;
    INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
    VALUES (NEW.tenant_id,
            CASE TG_OP WHEN 'INSERT' THEN 'agent.registered' ELSE 'agent.status' END, NEW.id,
            jsonb_build_object('agentId', NEW.id, 'name', NEW.name, 'status', NEW.status),
            NEW.updated_at);
    RETURN NULL;
END $$;

CREATE TRIGGER events_agent AFTER INSERT OR DELETE ON agents
    FOR EACH ROW EXECUTE FUNCTION events_agent();
-- Heartbeats update agents all the time; only a status change is an event.
CREATE TRIGGER events_agent_status AFTER UPDATE ON agents FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION events_agent();
