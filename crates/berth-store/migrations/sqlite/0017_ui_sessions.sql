-- Web UI sessions (issue 13), SQLite flavour. Keep it column-for-column symmetric with
-- migrations/postgres/0017_ui_sessions.sql.

-- A browser session made by signing in with an API token. Only the SHA-256 of the random
-- session id is kept (the id itself lives in the browser's HttpOnly cookie). The session acts as
-- its token: the lookup joins `api_tokens`, so it has the token's current tenant and role, and
-- deleting the token deletes its sessions (the cascade).
CREATE TABLE ui_sessions (
    id_hash    TEXT    NOT NULL PRIMARY KEY,
    token_id   TEXT    NOT NULL REFERENCES api_tokens (id) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL CHECK (expires_at > created_at)
);

CREATE INDEX idx_ui_sessions_token ON ui_sessions (token_id);
CREATE INDEX idx_ui_sessions_expires ON ui_sessions (expires_at);
