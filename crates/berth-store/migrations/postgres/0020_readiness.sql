-- An environment's readiness (issue 14 items 1-2), PostgreSQL flavour. Keep it symmetric with
-- migrations/sqlite/0020_readiness.sql.
CREATE TABLE environment_readiness (
    environment_id    UUID           NOT NULL PRIMARY KEY REFERENCES environments (id) ON DELETE CASCADE,
    tenant_id         UUID           NOT NULL,
    -- The environment's spec revision as the readiness reconciler counts it, and the summary
    -- of the spec it was counted for.
    generation        BIGINT         NOT NULL DEFAULT 0,
    spec              TEXT           NOT NULL DEFAULT '',
    -- [berth_proto::readiness::Condition]
    conditions        JSONB          NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(conditions) = 'array'),
    operational_ready BOOLEAN        NOT NULL DEFAULT FALSE,
    -- berth_store::ReadinessPass, or null.
    pass              JSONB          NOT NULL DEFAULT 'null',
    -- Written only by a verify request; a reconciler's write leaves it alone.
    verify_request    TEXT,
    verify_observed   TEXT,
    version           BIGINT         NOT NULL DEFAULT 0,
    updated_at        TIMESTAMPTZ(3) NOT NULL
);

-- A change of what the table says (the conditions, readiness or the answered nonce) is an
-- event, so the UI and followers go live.
CREATE FUNCTION events_readiness() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, environment_id, data, created_at)
    VALUES (NEW.tenant_id, 'environment.readiness', NEW.environment_id,
            jsonb_build_object('environmentId', NEW.environment_id, 'generation', NEW.generation,
                               'operationalReady', NEW.operational_ready,
                               'verifyObserved', NEW.verify_observed),
            NEW.updated_at);
    RETURN NULL;
END $$;

CREATE TRIGGER events_readiness AFTER UPDATE ON environment_readiness FOR EACH ROW
    WHEN (OLD.conditions IS DISTINCT FROM NEW.conditions
          OR OLD.operational_ready IS DISTINCT FROM NEW.operational_ready
          OR OLD.verify_observed IS DISTINCT FROM NEW.verify_observed)
    EXECUTE FUNCTION events_readiness();
