-- Schema 0020: the prod environment's readiness after a completed pass.
INSERT INTO environment_readiness (environment_id, tenant_id, generation, spec, conditions,
                                   operational_ready, pass, verify_request, verify_observed,
                                   version, updated_at)
VALUES ('01900000-0000-7000-8000-000000000051', '01900000-0000-7000-8000-000000000001', 2,
        'spec-v1',
        '[{"type":"Configured","status":"True","reason":"OK","message":"every digest resolves","observedAt":"2026-11-20T19:00:00.000Z","generation":2}]',
        @b(1), 'null', 'nonce-1', 'nonce-1', 3, @ts(2026-11-20T19:00:00Z));
