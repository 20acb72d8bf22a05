-- Schema 0019: a webhook on agent.status, then a status change: the outbox trigger writes its
-- notification in the event's transaction.
INSERT INTO webhooks (tenant_id, name, url, format, events, secret_wrapped_key,
                      secret_ciphertext, created_at)
VALUES ('01900000-0000-7000-8000-000000000001', 'ops', 'http://127.0.0.1:9/hook', 'generic',
        '["agent.status"]', @hex(0a0b0c), @hex(0d0e0f), @ts(2026-11-20T18:00:00Z));
UPDATE agents SET status = 'offline', updated_at = @ts(2026-11-20T18:00:01Z)
WHERE id = '01900000-0000-7000-8000-000000000012';
