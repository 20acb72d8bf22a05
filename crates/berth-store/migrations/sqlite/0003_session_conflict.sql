-- A refused second process (SESSION_HELD) keeps its agent degraded until this time, whatever
-- the holder's heartbeats report; a new session acquisition clears it.
ALTER TABLE agents ADD COLUMN session_conflict_until INTEGER;
