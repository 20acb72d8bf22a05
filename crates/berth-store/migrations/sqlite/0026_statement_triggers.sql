-- PostgreSQL's migration 0026 turns its task-event and outbox row triggers into statement
-- triggers, for the batched task path. SQLite has no statement triggers and no batched
-- statements: nothing changes here. (Kept so that both backends carry the same schema history.)
SELECT 1;
