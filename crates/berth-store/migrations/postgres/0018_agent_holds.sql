-- Operator holds on an agent (issue 14 item 4), PostgreSQL flavour. Keep it symmetric with
-- migrations/sqlite/0018_agent_holds.sql.
-- cordoned: no new work is routed to it (task create refuses, selectors and deployments skip).
-- suspended: it claims nothing new (the claim answers empty); its session and heartbeats go on.
ALTER TABLE agents ADD COLUMN cordoned BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE agents ADD COLUMN suspended BOOLEAN NOT NULL DEFAULT FALSE;

-- Counting an agent's open tasks for the queue cap, in the create's transaction.
CREATE INDEX idx_tasks_agent_open ON tasks (agent_id)
    WHERE state IN ('pending', 'leased', 'retry_wait', 'unknown');

CREATE FUNCTION events_agent_hold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'agent.hold', NEW.id,
            jsonb_build_object('agentId', NEW.id, 'name', NEW.name,
                               'cordoned', NEW.cordoned, 'suspended', NEW.suspended),
            NEW.updated_at);
    RETURN NULL;
END $$;

CREATE TRIGGER events_agent_hold AFTER UPDATE ON agents FOR EACH ROW
    WHEN (OLD.cordoned IS DISTINCT FROM NEW.cordoned OR OLD.suspended IS DISTINCT FROM NEW.suspended)
    EXECUTE FUNCTION events_agent_hold();
