-- Schema 0009: an immutable release of two components pinned by digest.
INSERT INTO releases (id, tenant_id, name, components, compose_lock, created_at)
VALUES ('01900000-0000-7000-8000-000000000041', '01900000-0000-7000-8000-000000000001', 'v1',
        '[{"name":"web","image":"registry.example:5000/team/web","digest":"sha256:abababababababababababababababababababababababababababababababab","resolvedFrom":"1.0","config":{"containerName":"web","ports":["8080:80"]}},{"name":"worker","image":"registry.example:5000/team/worker","digest":"sha256:efefefefefefefefefefefefefefefefefefefefefefefefefefefefefefefef","resolvedFrom":"1.0","config":{"containerName":"worker"}}]',
        NULL, @ts(2026-11-20T10:00:00Z));
