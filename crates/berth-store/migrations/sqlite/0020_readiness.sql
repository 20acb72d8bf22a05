-- An environment's readiness (issue 14 items 1-2), SQLite flavour. Keep it symmetric with
-- migrations/postgres/0020_readiness.sql.
CREATE TABLE environment_readiness (
    environment_id    TEXT    NOT NULL PRIMARY KEY REFERENCES environments (id) ON DELETE CASCADE,
    tenant_id         TEXT    NOT NULL,
    -- The environment's spec revision as the readiness reconciler counts it, and the summary
    -- of the spec it was counted for.
    generation        INTEGER NOT NULL DEFAULT 0,
    spec              TEXT    NOT NULL DEFAULT '',
    -- [berth_proto::readiness::Condition]
    conditions        TEXT    NOT NULL DEFAULT '[]' CHECK (json_type(conditions) = 'array'),
    operational_ready INTEGER NOT NULL DEFAULT 0 CHECK (operational_ready IN (0, 1)),
    -- berth_store::ReadinessPass, or null.
    pass              TEXT    NOT NULL DEFAULT 'null' CHECK (json_valid(pass)),
    -- Written only by a verify request; a reconciler's write leaves it alone.
    verify_request    TEXT,
    verify_observed   TEXT,
    version           INTEGER NOT NULL DEFAULT 0,
    updated_at        INTEGER NOT NULL
);

-- A change of what the table says (the conditions, readiness or the answered nonce) is an
-- event, so the UI and followers go live.
CREATE TRIGGER events_readiness AFTER UPDATE ON environment_readiness
WHEN OLD.conditions IS NOT NEW.conditions
  OR OLD.operational_ready IS NOT NEW.operational_ready
  OR OLD.verify_observed IS NOT NEW.verify_observed
BEGIN
    INSERT INTO events (tenant_id, kind, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'environment.readiness', NEW.environment_id,
            json_object('environmentId', NEW.environment_id, 'generation', NEW.generation,
                        'operationalReady',
                        json(CASE NEW.operational_ready WHEN 1 THEN 'true' ELSE 'false' END),
                        'verifyObserved', NEW.verify_observed),
            NEW.updated_at);
END;
