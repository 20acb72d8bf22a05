-- PostgreSQL's migration 0025 moves event numbering and audit linking out of the writers'
-- commits into batched sequencer passes. SQLite has one writer, which numbers events and links
-- audit entries in its own batches already: nothing changes here. (Kept so that both backends
-- carry the same schema history.)
SELECT 1;
