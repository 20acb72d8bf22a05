-- Seeds a migrated berth database for scripts/bench-reconcilers.sh: :envs environments with a
-- current release, :per agents (targets) each, one running deployment per environment whose
-- every target has a queued docker.run task, and a drift observation per target whose last
-- check succeeded. Agents are offline and never connect: nothing changes by itself, so each
-- pass of each reconciler does the steady-state work of a fleet of that size.
\set ON_ERROR_STOP 1
BEGIN;

CREATE TEMP TABLE p AS
SELECT (SELECT id FROM tenants ORDER BY created_at, id LIMIT 1) AS tenant,
       (SELECT jsonb_build_object('kind', 'token', 'id', id, 'name', name, 'role', role)
          FROM api_tokens ORDER BY created_at, id LIMIT 1) AS actor,
       gen_random_uuid() AS release,
       now() AS t0;

INSERT INTO releases (id, tenant_id, name, components, created_at)
SELECT release, tenant, 'bench-r1',
       jsonb_build_array(jsonb_build_object(
           'name', 'web', 'image', '127.0.0.1:9/bench/web',
           'digest', 'sha256:' || encode(sha256('bench-r1'), 'hex'))),
       t0 - interval '2 hours'
FROM p;

-- maxParallel = :per: one wave, so a pass never starts a new one.
INSERT INTO environments (id, tenant_id, name, tier, selector, policy, approvals, auto_heal,
                          drift_interval_secs, current_release_id, created_by, created_at,
                          updated_at)
SELECT gen_random_uuid(), tenant, 'e' || lpad(e::text, 5, '0'), 'dev',
       jsonb_build_object('env', 'e' || lpad(e::text, 5, '0')),
       jsonb_build_object('maxParallel', :per), 0, false, 3600, release, actor,
       t0 - interval '1 hour', t0 - interval '1 hour'
FROM p, generate_series(0, :envs - 1) AS e;

INSERT INTO agents (id, tenant_id, name, version, capabilities, labels, status,
                    reported_status, last_heartbeat, created_at, updated_at)
SELECT gen_random_uuid(), tenant, 'a' || lpad(i::text, 6, '0'), '0.0.0',
       '[{"name": "docker", "healthy": true}]',
       jsonb_build_object('env', 'e' || lpad((i / :per)::text, 5, '0')),
       'offline', 'offline', t0 - interval '2 hours', t0 - interval '2 hours',
       t0 - interval '2 hours'
FROM p, generate_series(0, :envs * :per - 1) AS i;

INSERT INTO deployments (id, tenant_id, environment_id, release_id, kind, state, requested_by,
                         approvals_required, current_wave, version, created_at, updated_at)
SELECT gen_random_uuid(), e.tenant_id, e.id, e.current_release_id, 'deploy', 'running',
       e.created_by, 0, 0, 1, p.t0 - interval '10 minutes' + (row_number() OVER (ORDER BY e.name)) * interval '1 ms',
       p.t0 - interval '10 minutes'
FROM environments e, p;

CREATE TEMP TABLE dt AS
SELECT d.id AS deployment_id, d.tenant_id, d.environment_id, a.id AS agent_id,
       a.name AS agent_name, gen_random_uuid() AS deploy_task, gen_random_uuid() AS check_task
FROM deployments d
JOIN environments e ON e.id = d.environment_id
JOIN agents a ON a.labels @> e.selector;

-- The deployment's task on each target: queued (the agent never comes to take it).
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, timeout_seconds, priority,
                   side_effects, state, created_at, updated_at)
SELECT deploy_task, tenant_id, agent_id, 'docker.run', '{}', 600, 0, true, 'pending',
       p.t0 - interval '10 minutes', p.t0 - interval '10 minutes'
FROM dt, p;

INSERT INTO deployment_targets (deployment_id, agent_id, tenant_id, environment_id, agent_name,
                                wave, phase, tasks)
SELECT deployment_id, agent_id, tenant_id, environment_id, agent_name, 0, 'queued',
       jsonb_build_array(deploy_task::text)
FROM dt;

-- Each target's last drift check: succeeded, already applied (verified at its finish), the
-- next one due within the hour (the script spreads next_check_at again on each copy).
INSERT INTO tasks (id, tenant_id, agent_id, task_type, payload, timeout_seconds, priority,
                   side_effects, state, attempts, result, created_at, updated_at, finished_at)
SELECT check_task, tenant_id, agent_id, 'inspect', '{}', 60, 0, false, 'succeeded', 1,
       '{"outputs": {"containers": []}}', p.t0 - interval '10 minutes',
       p.t0 - interval '5 minutes', p.t0 - interval '5 minutes'
FROM dt, p;

INSERT INTO target_observations (environment_id, agent_id, tenant_id, check_task_id,
                                 next_check_at, drift, running_release, components, verified_at)
SELECT environment_id, agent_id, tenant_id, check_task, p.t0 + interval '1 hour', 'in_sync',
       'bench-r1', '[]', p.t0 - interval '5 minutes'
FROM dt, p;

COMMIT;
ANALYZE;
