-- Schema 0001: a tenant, the operator's admin token, a used registration token, two agents
-- bound to their certificates.
INSERT INTO tenants (id, name, created_at)
VALUES ('01900000-0000-7000-8000-000000000001', 'default', @ts(2026-11-20T08:00:00Z));

INSERT INTO api_tokens (id, tenant_id, name, role, operator, token_hash, created_at)
VALUES ('01900000-0000-7000-8000-000000000002', '01900000-0000-7000-8000-000000000001',
        'operator', 'admin', @b(1),
        'a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0',
        @ts(2026-11-20T08:00:00Z));

INSERT INTO registration_tokens (id, tenant_id, token_hash, labels, environment, expires_at,
                                 used_at, created_at)
VALUES ('01900000-0000-7000-8000-000000000003', '01900000-0000-7000-8000-000000000001',
        'b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0', '{"role":"web"}',
        NULL, @ts(2026-11-21T08:00:00Z), @ts(2026-11-20T08:05:00Z), @ts(2026-11-20T08:00:00Z));

INSERT INTO agents (id, tenant_id, name, version, capabilities, labels, status, reported_status,
                    environment, last_heartbeat, resource_usage, certificate_fingerprint,
                    certificate_expires_at, generation, created_at, updated_at)
VALUES ('01900000-0000-7000-8000-000000000011', '01900000-0000-7000-8000-000000000001',
        'web-1', '0.1.0',
        '[{"name":"docker","version":"20.10.24","healthy":true},{"name":"compose","version":"1.29.2","healthy":true}]',
        '{"role":"web"}', 'online', 'online', NULL, @ts(2026-11-20T09:00:00Z),
        '{"cpuPercent":2.5,"cpuCores":2,"memoryUsedBytes":1073741824,"memoryTotalBytes":4294967296,"diskFreeBytes":10737418240,"diskTotalBytes":21474836480}',
        'sha256:1111111111111111111111111111111111111111111111111111111111111111',
        @ts(2027-02-20T08:05:00Z), 3, @ts(2026-11-20T08:05:00Z), @ts(2026-11-20T09:00:00Z)),
       ('01900000-0000-7000-8000-000000000012', '01900000-0000-7000-8000-000000000001',
        'db-1', '0.1.0', '[{"name":"docker","version":"20.10.24","healthy":true}]',
        '{"role":"db"}', 'offline', 'online', NULL, @ts(2026-11-20T09:00:00Z), NULL,
        'sha256:1212121212121212121212121212121212121212121212121212121212121212',
        @ts(2027-02-20T08:06:00Z), 1, @ts(2026-11-20T08:06:00Z), @ts(2026-11-20T09:30:00Z));
