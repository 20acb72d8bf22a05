-- Schema 0002: tasks with payloads in clear (written before payloads were sealed at rest) in
-- each kind of state, with their attempts, and the agents' session leases.
UPDATE agents SET session_instance_id = 'instance-before-upgrade',
                  session_expires_at = @ts(2026-11-20T09:00:30Z)
WHERE id = '01900000-0000-7000-8000-000000000011';

-- K1: a health-check that succeeded, its signed result kept on the attempt.
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, variables, timeout_seconds,
                   priority, side_effects, state, attempts, result, created_at, updated_at,
                   finished_at)
VALUES ('01900000-0000-7000-8000-000000000021', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000011', 'health-check',
        '{"url":"http://127.0.0.1:8080/health","expectStatus":200}', '{"K":"V"}', 60, 0, @b(0),
        'succeeded', 1, '{"ok":true}', @ts(2026-11-20T08:10:00Z), @ts(2026-11-20T08:10:02Z),
        @ts(2026-11-20T08:10:02Z));
INSERT INTO task_attempts (assignment_id, task_id, agent_id, generation, state, assigned_at,
                           lease_expires_at, finished_at, envelope, error_code)
VALUES ('01900000-0000-7000-8000-000000000031', '01900000-0000-7000-8000-000000000021',
        '01900000-0000-7000-8000-000000000011', 3, 'succeeded', @ts(2026-11-20T08:10:01Z),
        @ts(2026-11-20T08:11:31Z), @ts(2026-11-20T08:10:02Z),
        '{"assignmentId":"01900000-0000-7000-8000-000000000031","contractVersion":"agent-task-transport/v1","result":"Succeeded","signature":"00","taskId":"01900000-0000-7000-8000-000000000021"}',
        NULL);

-- K2: a docker.run still pending, with an Idempotency-Key and sealed credentials.
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, credentials_sealed, variables,
                   timeout_seconds, priority, side_effects, idempotency_key, request_hash, state,
                   attempts, created_at, updated_at)
VALUES ('01900000-0000-7000-8000-000000000022', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000011', 'docker.run',
        '{"image":"registry.example:5000/team/web@sha256:abababababababababababababababababababababababababababababababab","containerName":"web","ports":["8080:80"]}',
        NULL, '{}', 300, 5, @b(1), 'deploy-web-v1',
        'c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0', 'pending', 0,
        @ts(2026-11-20T08:20:00Z), @ts(2026-11-20T08:20:00Z));

-- K3: a docker.run whose lease was lost after its start (unknown), and K4, its read-back.
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, variables, timeout_seconds,
                   priority, side_effects, state, attempts, error_code, created_at, updated_at)
VALUES ('01900000-0000-7000-8000-000000000023', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000011', 'docker.run',
        '{"image":"registry.example:5000/team/web@sha256:cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd","containerName":"web"}',
        '{}', 300, 0, @b(1), 'unknown', 1, 'LEASE_EXPIRED', @ts(2026-11-20T08:30:00Z),
        @ts(2026-11-20T08:36:00Z));
INSERT INTO task_attempts (assignment_id, task_id, agent_id, generation, state, assigned_at,
                           lease_expires_at, finished_at, envelope, error_code)
VALUES ('01900000-0000-7000-8000-000000000033', '01900000-0000-7000-8000-000000000023',
        '01900000-0000-7000-8000-000000000011', 3, 'expired', @ts(2026-11-20T08:30:01Z),
        @ts(2026-11-20T08:35:31Z), @ts(2026-11-20T08:36:00Z), NULL, 'LEASE_EXPIRED');
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, variables, timeout_seconds,
                   priority, side_effects, read_back_of, state, attempts, read_back, result,
                   created_at, updated_at, finished_at)
VALUES ('01900000-0000-7000-8000-000000000024', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000011', 'inspect', '{"containerName":"web"}', '{}', 60,
        0, @b(0), '01900000-0000-7000-8000-000000000023', 'succeeded', 1, @b(1),
        '{"found":false}', @ts(2026-11-20T08:36:00Z), @ts(2026-11-20T08:36:05Z),
        @ts(2026-11-20T08:36:05Z));

-- K5: a health-check leased to db-1 whose lease ran out long ago.
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, variables, timeout_seconds,
                   priority, side_effects, state, attempts, current_assignment,
                   lease_expires_at, created_at, updated_at)
VALUES ('01900000-0000-7000-8000-000000000025', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000012', 'health-check',
        '{"url":"http://127.0.0.1:5432/","expectStatus":200}', '{}', 60, 0, @b(0), 'leased', 1,
        '01900000-0000-7000-8000-000000000035', @ts(2026-11-20T09:11:30Z),
        @ts(2026-11-20T09:10:00Z), @ts(2026-11-20T09:10:00Z));
INSERT INTO task_attempts (assignment_id, task_id, agent_id, generation, state, assigned_at,
                           lease_expires_at)
VALUES ('01900000-0000-7000-8000-000000000035', '01900000-0000-7000-8000-000000000025',
        '01900000-0000-7000-8000-000000000012', 1, 'leased', @ts(2026-11-20T09:10:00Z),
        @ts(2026-11-20T09:11:30Z));
