-- The certificate the agent's last renewal replaced. It is refused like any unbound
-- certificate; the server only names the refusal `CERTIFICATE_SUPERSEDED` instead of
-- `AGENT_REVOKED`, so the agent sends a request that was in flight on it again with the new one.
ALTER TABLE agents ADD COLUMN previous_certificate_fingerprint TEXT;
