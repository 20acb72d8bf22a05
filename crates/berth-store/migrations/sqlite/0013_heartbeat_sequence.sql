-- The (generation, sequence) of the last signed heartbeat applied. A heartbeat applies only when
-- its generation is current and, within that generation, its sequence is above this one: the
-- check is in the heartbeat's UPDATE itself, so a replay (or the loser of two concurrent
-- heartbeats with one sequence) changes nothing. A new session generation starts afresh, which
-- is why the agent persists no sequence. -1 is below every generation a session is granted.
ALTER TABLE agents ADD COLUMN heartbeat_generation INTEGER NOT NULL DEFAULT -1;
ALTER TABLE agents ADD COLUMN heartbeat_sequence INTEGER NOT NULL DEFAULT 0;
