-- Schema 0014: a desired-state environment with its bundle and an agent that checked in.
INSERT INTO environments (id, tenant_id, name, tier, selector, policy, approvals, auto_heal,
                          drift_interval_secs, created_by, created_at, updated_at, desired_sha,
                          retired, purge_volumes, checkin_interval_secs)
VALUES ('01900000-0000-7000-8000-000000000052', '01900000-0000-7000-8000-000000000001', 'edge',
        'dev', '{}',
        '{"maxParallel":1,"stopOnFailure":true,"autoRollback":false,"healthTimeoutSecs":60,"taskTimeoutSecs":300}',
        0, @b(0), 60,
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        @ts(2026-11-20T13:00:00Z), @ts(2026-11-20T13:00:00Z),
        'dededededededededededededededededededededededededededededededede', @b(0), @b(0), 30);

INSERT INTO bundles (tenant_id, environment_id, sha, content, size, created_at, created_by)
VALUES ('01900000-0000-7000-8000-000000000001', '01900000-0000-7000-8000-000000000052',
        'dededededededededededededededededededededededededededededededede', @hex(1f8b0800),
        4, @ts(2026-11-20T13:00:00Z),
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}');

INSERT INTO desired_agents (environment_id, agent_key, applied_sha, last_result, detail, host,
                            containers, log_tail, last_checkin_at, last_report_at)
VALUES ('01900000-0000-7000-8000-000000000052', 'agent:edge-1',
        'dededededededededededededededededededededededededededededededede', 'applied', NULL,
        '{"hostname":"edge-1"}', '[{"name":"web","state":"running","health":"healthy"}]',
        'INFO applied', @ts(2026-11-20T13:05:00Z), @ts(2026-11-20T13:05:10Z));
