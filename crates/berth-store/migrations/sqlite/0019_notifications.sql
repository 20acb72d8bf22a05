-- Notifications through an outbox (issue 14 item 3), SQLite flavour. Keep it symmetric with
-- migrations/postgres/0019_notifications.sql.

-- An approval is an event of its own: webhooks (and the event stream) see each one, not only
-- the state change the last one causes.
CREATE TRIGGER events_deployment_approval AFTER INSERT ON deployment_approvals
BEGIN
    INSERT INTO events (tenant_id, kind, deployment_id, environment_id, data, created_at)
    SELECT d.tenant_id, 'deployment.approval', d.id, d.environment_id,
           json_object('deploymentId', d.id, 'environmentId', d.environment_id,
                       'approvedBy', json(NEW.actor)),
           NEW.approved_at
    FROM deployments d WHERE d.id = NEW.deployment_id;
END;

CREATE TABLE webhooks (
    id                 INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    tenant_id          TEXT    NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name               TEXT    NOT NULL,
    url                TEXT    NOT NULL,
    format             TEXT    NOT NULL CHECK (format IN ('generic', 'slack')),
    -- ["deployment.state", …]: the event kinds it receives.
    events             TEXT    NOT NULL CHECK (json_type(events) = 'array'),
    -- The HMAC key, sealed by the server (secrets.rs, AAD `<tenant>/webhook/<name>#1`).
    secret_wrapped_key BLOB    NOT NULL,
    secret_ciphertext  BLOB    NOT NULL,
    created_at         INTEGER NOT NULL,
    UNIQUE (tenant_id, name)
);

-- The outbox and the operation ledger in one: a row per (webhook, event), written by the
-- trigger below in the event's own transaction; the sender moves it through its states.
CREATE TABLE notifications (
    id              INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    tenant_id       TEXT    NOT NULL,
    webhook_id      INTEGER NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_id        INTEGER NOT NULL,
    event_kind      TEXT    NOT NULL,
    event_data      TEXT    NOT NULL CHECK (json_valid(event_data)),
    event_at        INTEGER NOT NULL,
    -- `<webhook>:<event>`: the same on every send, so a receiver can dedupe.
    idempotency_key TEXT    NOT NULL UNIQUE,
    state           TEXT    NOT NULL CHECK (state IN ('pending', 'sending', 'succeeded', 'failed',
                                                      'dead', 'unknown')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    -- Retryable failures since it was last queued: the place in the retry schedule.
    retries         INTEGER NOT NULL DEFAULT 0,
    -- pending: when it is due; sending: when the send is taken as interrupted.
    next_attempt_at INTEGER NOT NULL,
    error_code      TEXT,
    error_message   TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX idx_notifications_due ON notifications (state, next_attempt_at);
CREATE INDEX idx_notifications_tenant ON notifications (tenant_id, id);

CREATE TRIGGER notifications_outbox AFTER INSERT ON events
BEGIN
    INSERT INTO notifications (tenant_id, webhook_id, event_id, event_kind, event_data, event_at,
                               idempotency_key, state, next_attempt_at, created_at, updated_at)
    SELECT NEW.tenant_id, w.id, NEW.id, NEW.kind, NEW.data, NEW.created_at,
           w.id || ':' || NEW.id, 'pending', NEW.created_at, NEW.created_at, NEW.created_at
    FROM webhooks w
    WHERE w.tenant_id = NEW.tenant_id
      AND EXISTS (SELECT 1 FROM json_each(w.events) WHERE json_each.value = NEW.kind);
END;
