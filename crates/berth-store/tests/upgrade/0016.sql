-- Schema 0016: an artifact, an SSH target reached through web-1, and an environment of SSH
-- targets.
INSERT INTO artifacts (tenant_id, sha256, size, content, created_by, created_at)
VALUES ('01900000-0000-7000-8000-000000000001',
        '5555555555555555555555555555555555555555555555555555555555555555', 3, @hex(616263),
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        @ts(2026-11-20T15:00:00Z));

INSERT INTO ssh_targets (id, tenant_id, name, host, port, user_name, via_agent, via_selector,
                         host_key, key_secret, labels, created_at)
VALUES ('01900000-0000-7000-8000-000000000071', '01900000-0000-7000-8000-000000000001', 'db-1',
        '10.0.0.7', 2222, 'deploy', 'web-1', '{}',
        'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEurclYv', 'ssh/db-1', '{"role":"db"}',
        @ts(2026-11-20T15:00:00Z));

INSERT INTO environments (id, tenant_id, name, tier, selector, policy, approvals, auto_heal,
                          drift_interval_secs, created_by, created_at, updated_at, target_type)
VALUES ('01900000-0000-7000-8000-000000000053', '01900000-0000-7000-8000-000000000001', 'db',
        'qa', '{"role":"db"}',
        '{"maxParallel":1,"stopOnFailure":true,"autoRollback":false,"healthTimeoutSecs":60,"taskTimeoutSecs":300}',
        0, @b(0), 300,
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        @ts(2026-11-20T15:00:00Z), @ts(2026-11-20T15:00:00Z), 'ssh');
