-- Operator holds on an agent (issue 14 item 4), SQLite flavour. Keep it symmetric with
-- migrations/postgres/0018_agent_holds.sql.
-- cordoned: no new work is routed to it (task create refuses, selectors and deployments skip).
-- suspended: it claims nothing new (the claim answers empty); its session and heartbeats go on.
ALTER TABLE agents ADD COLUMN cordoned INTEGER NOT NULL DEFAULT 0;
ALTER TABLE agents ADD COLUMN suspended INTEGER NOT NULL DEFAULT 0;

-- Counting an agent's open tasks for the queue cap, in the create's transaction.
CREATE INDEX idx_tasks_agent_open ON tasks (agent_id)
    WHERE state IN ('pending', 'leased', 'retry_wait', 'unknown');

CREATE TRIGGER events_agent_hold AFTER UPDATE OF cordoned, suspended ON agents
WHEN OLD.cordoned IS NOT NEW.cordoned OR OLD.suspended IS NOT NEW.suspended
BEGIN
    INSERT INTO events (tenant_id, kind, agent_id, data, created_at)
    VALUES (NEW.tenant_id, 'agent.hold', NEW.id,
            json_object('agentId', NEW.id, 'name', NEW.name,
                        'cordoned', json(CASE NEW.cordoned WHEN 1 THEN 'true' ELSE 'false' END),
                        'suspended', json(CASE NEW.suspended WHEN 1 THEN 'true' ELSE 'false' END)),
            NEW.updated_at);
END;
