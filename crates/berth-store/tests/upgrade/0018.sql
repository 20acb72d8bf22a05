-- Schema 0018: db-1 cordoned (its trigger writes an agent.hold event).
UPDATE agents SET cordoned = @b(1), updated_at = @ts(2026-11-20T17:00:00Z)
WHERE id = '01900000-0000-7000-8000-000000000012';
