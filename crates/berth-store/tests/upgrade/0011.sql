-- Schema 0011: a task created once events existed (its trigger writes a task.state event), and
-- an agent's status change (agent.status).
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, variables, timeout_seconds,
                   priority, side_effects, state, attempts, created_at, updated_at)
VALUES ('01900000-0000-7000-8000-000000000026', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000012', 'inspect', '{}', '{}', 60, 0, @b(0), 'pending',
        0, @ts(2026-11-20T11:00:00Z), @ts(2026-11-20T11:00:00Z));
UPDATE agents SET status = 'degraded', updated_at = @ts(2026-11-20T11:00:01Z)
WHERE id = '01900000-0000-7000-8000-000000000012';
