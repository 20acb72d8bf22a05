-- Schema 0012: an environment on release v1 (its policy as 0012 wrote it, before requireReady),
-- a deployment that succeeded with its target, an approval and the drift observation.
INSERT INTO environments (id, tenant_id, name, tier, selector, policy, promote_from, approvals,
                          auto_heal, drift_interval_secs, current_release_id,
                          previous_release_id, pinned_release_id, created_by, created_at,
                          updated_at)
VALUES ('01900000-0000-7000-8000-000000000051', '01900000-0000-7000-8000-000000000001', 'prod',
        'prod', '{"role":"web"}',
        '{"maxParallel":1,"stopOnFailure":true,"autoRollback":true,"healthTimeoutSecs":60,"taskTimeoutSecs":300}',
        NULL, 1, @b(1), 120, '01900000-0000-7000-8000-000000000041', NULL, NULL,
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        @ts(2026-11-20T12:00:00Z), @ts(2026-11-20T12:10:00Z));

INSERT INTO deployments (id, tenant_id, environment_id, release_id, kind, state, rolling_back,
                         requested_by, rollback_release_id, approvals_required,
                         cancel_requested, current_wave, error_code, detail, version,
                         created_at, updated_at, finished_at)
VALUES ('01900000-0000-7000-8000-000000000061', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000051', '01900000-0000-7000-8000-000000000041',
        'deploy', 'succeeded', @b(0),
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        NULL, 1, @b(0), 1, NULL, NULL, 4, @ts(2026-11-20T12:01:00Z), @ts(2026-11-20T12:10:00Z),
        @ts(2026-11-20T12:10:00Z));

INSERT INTO deployment_targets (deployment_id, agent_id, tenant_id, environment_id, agent_name,
                                wave, phase, tasks, rollback_tasks, error_code, detail,
                                started_at, finished_at)
VALUES ('01900000-0000-7000-8000-000000000061', '01900000-0000-7000-8000-000000000011',
        '01900000-0000-7000-8000-000000000001', '01900000-0000-7000-8000-000000000051', 'web-1',
        1, 'succeeded', '["01900000-0000-7000-8000-000000000022"]', '[]', NULL, NULL,
        @ts(2026-11-20T12:05:00Z), @ts(2026-11-20T12:10:00Z));

INSERT INTO deployment_approvals (deployment_id, token_id, actor, approved_at)
VALUES ('01900000-0000-7000-8000-000000000061', '01900000-0000-7000-8000-000000000002',
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        @ts(2026-11-20T12:04:00Z));

INSERT INTO target_observations (environment_id, agent_id, tenant_id, check_task_id,
                                 next_check_at, drift, running_release, components, verified_at)
VALUES ('01900000-0000-7000-8000-000000000051', '01900000-0000-7000-8000-000000000011',
        '01900000-0000-7000-8000-000000000001', '01900000-0000-7000-8000-000000000024',
        @ts(2026-11-20T12:12:00Z), 'in_sync', 'v1',
        '[{"name":"web","digest":"sha256:abababababababababababababababababababababababababababababababab","release":"v1","state":"running"}]',
        @ts(2026-11-20T12:10:00Z));

UPDATE task_attempts SET phase = 'health' WHERE assignment_id = '01900000-0000-7000-8000-000000000035';
