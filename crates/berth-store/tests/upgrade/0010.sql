-- Schema 0010: the tenant's audit chain, two entries (their hashes are the real chain: the
-- test verifies it, and that today's store appends after it).
INSERT INTO audit_log (tenant_id, seq, hash, entry)
VALUES ('01900000-0000-7000-8000-000000000001', 1,
        'bfd56a1ac4a18963c916be1de200733e6ccd41829f320c607c460022eba80c07',
        '{"seq":1,"tenantId":"01900000-0000-7000-8000-000000000001","at":"2026-11-20T08:00:00.123Z","actor":{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"},"action":"token.create","subject":"01900000-0000-7000-8000-000000000002","details":{"name":"operator","role":"admin"},"prevHash":"0000000000000000000000000000000000000000000000000000000000000000","hash":"bfd56a1ac4a18963c916be1de200733e6ccd41829f320c607c460022eba80c07"}'),
       ('01900000-0000-7000-8000-000000000001', 2,
        '8fcdff311e6c7e5046f170eebe388a1cd2604af000da7b859f2f9faf5800099b',
        '{"seq":2,"tenantId":"01900000-0000-7000-8000-000000000001","at":"2026-11-20T08:05:00.456Z","actor":{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"},"action":"agent.register","subject":"01900000-0000-7000-8000-000000000011","details":{"name":"web-1"},"prevHash":"bfd56a1ac4a18963c916be1de200733e6ccd41829f320c607c460022eba80c07","hash":"8fcdff311e6c7e5046f170eebe388a1cd2604af000da7b859f2f9faf5800099b"}');
