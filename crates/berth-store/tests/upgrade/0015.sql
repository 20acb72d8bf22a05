-- Schema 0015: a builtin secret (only its metadata is read here; its envelope opens with the
-- server's key) and a deploy grant for the desired-state environment.
INSERT INTO secrets (tenant_id, key, version, wrapped_key, ciphertext, created_at, created_by,
                     deleted_at)
VALUES ('01900000-0000-7000-8000-000000000001', 'prod/db/password', 1, @hex(0a0b0c0d),
        @hex(01020304), @ts(2026-11-20T14:00:00Z),
        '{"kind":"token","id":"01900000-0000-7000-8000-000000000002","name":"operator","role":"admin"}',
        NULL);

INSERT INTO grants (jti, tenant_id, environment_id, kind, public_jwk, issued_at, expires_at,
                    superseded_at, used_at, token_accessor)
VALUES ('g-upgrade-kit', '01900000-0000-7000-8000-000000000001',
        '01900000-0000-7000-8000-000000000052', 'kit',
        '{"kid":"g-upgrade-kit","kty":"EC","crv":"P-256","x":"AA","y":"AA"}',
        @ts(2026-11-20T14:00:00Z), @ts(2027-11-20T14:00:00Z), NULL, NULL, NULL);
