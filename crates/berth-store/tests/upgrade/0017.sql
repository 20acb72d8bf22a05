-- Schema 0017: the operator's web UI session (it expires long after the test runs).
INSERT INTO ui_sessions (id_hash, token_id, created_at, expires_at)
VALUES ('e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0',
        '01900000-0000-7000-8000-000000000002', @ts(2026-11-20T16:00:00Z),
        @ts(2036-11-20T16:00:00Z));
