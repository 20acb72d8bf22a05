-- Notifications through an outbox (issue 14 item 3), PostgreSQL flavour. Keep it symmetric with
-- migrations/sqlite/0019_notifications.sql.

-- An approval is an event of its own: webhooks (and the event stream) see each one, not only
-- the state change the last one causes.
CREATE FUNCTION events_deployment_approval() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (tenant_id, kind, deployment_id, environment_id, data, created_at)
    SELECT d.tenant_id, 'deployment.approval', d.id, d.environment_id,
           jsonb_build_object('deploymentId', d.id, 'environmentId', d.environment_id,
                              'approvedBy', NEW.actor),
           NEW.approved_at
    FROM deployments d WHERE d.id = NEW.deployment_id;
    RETURN NULL;
END $$;

CREATE TRIGGER events_deployment_approval AFTER INSERT ON deployment_approvals
    FOR EACH ROW EXECUTE FUNCTION events_deployment_approval();

CREATE TABLE webhooks (
    id                 BIGINT         GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id          UUID           NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name               TEXT           NOT NULL,
    url                TEXT           NOT NULL,
    format             TEXT           NOT NULL CHECK (format IN ('generic', 'slack')),
    -- ["deployment.state", …]: the event kinds it receives.
    events             JSONB          NOT NULL CHECK (jsonb_typeof(events) = 'array'),
    -- The HMAC key, sealed by the server (secrets.rs, AAD `<tenant>/webhook/<name>#1`).
    secret_wrapped_key BYTEA          NOT NULL,
    secret_ciphertext  BYTEA          NOT NULL,
    created_at         TIMESTAMPTZ(3) NOT NULL,
    UNIQUE (tenant_id, name)
);

-- The outbox and the operation ledger in one: a row per (webhook, event), written by the
-- trigger below in the event's own transaction; the sender moves it through its states.
CREATE TABLE notifications (
    id              BIGINT         GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       UUID           NOT NULL,
    webhook_id      BIGINT         NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_id        BIGINT         NOT NULL,
    event_kind      TEXT           NOT NULL,
    event_data      JSONB          NOT NULL,
    event_at        TIMESTAMPTZ(3) NOT NULL,
    -- `<webhook>:<event>`: the same on every send, so a receiver can dedupe.
    idempotency_key TEXT           NOT NULL UNIQUE,
    state           TEXT           NOT NULL CHECK (state IN ('pending', 'sending', 'succeeded',
                                                             'failed', 'dead', 'unknown')),
    attempts        BIGINT         NOT NULL DEFAULT 0,
    -- Retryable failures since it was last queued: the place in the retry schedule.
    retries         BIGINT         NOT NULL DEFAULT 0,
    -- pending: when it is due; sending: when the send is taken as interrupted.
    next_attempt_at TIMESTAMPTZ(3) NOT NULL,
    error_code      TEXT,
    error_message   TEXT,
    created_at      TIMESTAMPTZ(3) NOT NULL,
    updated_at      TIMESTAMPTZ(3) NOT NULL
);
CREATE INDEX idx_notifications_due ON notifications (state, next_attempt_at);
CREATE INDEX idx_notifications_tenant ON notifications (tenant_id, id);

-- An event's public id is given at COMMIT (0011's deferred `events_number()`), so the outbox
-- rows are written when it is: by this trigger on that UPDATE, still inside the committing
-- transaction. No webhook of the tenant: one index probe.
CREATE FUNCTION notifications_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO notifications (tenant_id, webhook_id, event_id, event_kind, event_data, event_at,
                               idempotency_key, state, next_attempt_at, created_at, updated_at)
    SELECT NEW.tenant_id, w.id, NEW.id, NEW.kind, NEW.data, NEW.created_at,
           w.id || ':' || NEW.id, 'pending', NEW.created_at, NEW.created_at, NEW.created_at
    FROM webhooks w
    WHERE w.tenant_id = NEW.tenant_id AND w.events ? NEW.kind;
    RETURN NULL;
END $$;

CREATE TRIGGER notifications_outbox AFTER UPDATE OF id ON events FOR EACH ROW
    WHEN (OLD.id IS NULL AND NEW.id IS NOT NULL)
    EXECUTE FUNCTION notifications_outbox();
