-- An agent that registered but has not sent a heartbeat is `registered`, not `online`
-- (issue 9 item 8). The inline CHECKs of 0001 carry PostgreSQL's default names.
ALTER TABLE agents DROP CONSTRAINT agents_status_check;
ALTER TABLE agents ADD CONSTRAINT agents_status_check
    CHECK (status IN ('registered', 'online', 'offline', 'degraded'));
ALTER TABLE agents DROP CONSTRAINT agents_reported_status_check;
ALTER TABLE agents ADD CONSTRAINT agents_reported_status_check
    CHECK (reported_status IN ('registered', 'online', 'offline', 'degraded'));
