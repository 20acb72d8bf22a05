-- What the session's holder proved about itself: its host's boot id and the identity of the
-- installation lock it holds (`<state-dir>/agent.lock`), as the server composed them. A
-- contender that holds the same lock on the same boot shows that the holder is dead, and
-- takes the session before its lease ends. NULL: the holder proved nothing.
ALTER TABLE agents ADD COLUMN session_restart_key TEXT;
