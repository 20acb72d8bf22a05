//! The error body every refusal carries, and the stable codes.

use serde::{Deserialize, Serialize};

/// `{code, detail}`: `code` is a stable UPPER_SNAKE identifier for each distinct refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub code: String,
    pub detail: String,
}

/// An error with its whole `source()` chain, `a: b: c`: the one way berth writes an error into a
/// log line or a detail, so the cause (the SQL error under "database error during …") is never
/// lost. `tracing::error!(error = %ErrorChain(&e), …)`.
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'a));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

/// Stable error codes. Clients match on these, so they never change meaning.
pub mod codes {
    pub const MALFORMED_JSON: &str = "MALFORMED_JSON";
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST";
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "UNSUPPORTED_MEDIA_TYPE";
    pub const PAYLOAD_TOO_LARGE: &str = "PAYLOAD_TOO_LARGE";
    pub const INVALID_ID: &str = "INVALID_ID";
    pub const NOT_FOUND: &str = "NOT_FOUND";
    /// `GET /downloads/berth-agent/{platform}`: the server has no agent binary for it; the
    /// detail lists those it has.
    pub const NO_AGENT_DOWNLOAD: &str = "NO_AGENT_DOWNLOAD";
    pub const METHOD_NOT_ALLOWED: &str = "METHOD_NOT_ALLOWED";
    pub const CONFLICT: &str = "CONFLICT";
    /// A uniqueness rule of the store refused the write; the detail names which.
    pub const CONSTRAINT_CONFLICT: &str = "CONSTRAINT_CONFLICT";
    /// An `Idempotency-Key` in the server's own namespace (`read-back:…`).
    pub const IDEMPOTENCY_KEY_RESERVED: &str = "IDEMPOTENCY_KEY_RESERVED";
    pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";
    pub const FORBIDDEN: &str = "FORBIDDEN";
    pub const OPERATOR_ONLY: &str = "OPERATOR_ONLY";
    pub const REGISTRATION_TOKEN_INVALID: &str = "REGISTRATION_TOKEN_INVALID";
    pub const INVALID_CSR: &str = "INVALID_CSR";
    pub const AGENT_NAME_TAKEN: &str = "AGENT_NAME_TAKEN";
    pub const TENANT_NAME_TAKEN: &str = "TENANT_NAME_TAKEN";
    /// An agent-runtime route was called without a client certificate.
    pub const CLIENT_CERT_REQUIRED: &str = "CLIENT_CERT_REQUIRED";
    /// The client certificate is not the one bound to the agent named in the path.
    pub const CERT_BINDING_MISMATCH: &str = "CERT_BINDING_MISMATCH";
    /// The agent was deleted or its certificate rotated: re-register.
    pub const AGENT_REVOKED: &str = "AGENT_REVOKED";
    /// The client certificate is the one the agent's own last renewal replaced: a request that
    /// was in flight on it is sent again with the new certificate. Not a revocation.
    pub const CERTIFICATE_SUPERSEDED: &str = "CERTIFICATE_SUPERSEDED";
    /// The client certificate expired after the connection's handshake; TLS 1.3 does not check
    /// it again, so every request does.
    pub const CLIENT_CERT_EXPIRED: &str = "CLIENT_CERT_EXPIRED";
    pub const RATE_LIMITED: &str = "RATE_LIMITED";
    pub const INTERNAL: &str = "INTERNAL";
    // --- task transport ---
    pub const SESSION_HELD: &str = "SESSION_HELD";
    /// Stale or missing generation, or a start or result for an assignment that is no longer
    /// current (its lease ended, or the task was handed out again).
    pub const FENCED: &str = "FENCED";
    pub const TRANSPORT_DISABLED: &str = "TRANSPORT_DISABLED";
    /// A WebSocket route (the task stream) asked without `Upgrade: websocket`.
    pub const UPGRADE_REQUIRED: &str = "UPGRADE_REQUIRED";
    pub const SIGNATURE_MISSING: &str = "SIGNATURE_MISSING";
    pub const SIGNATURE_INVALID: &str = "SIGNATURE_INVALID";
    /// A poll from an agent whose certificate key cannot receive a sealed assignment (only
    /// P-256 keys can; an RSA key cannot): nothing was claimed, nothing was sent in clear.
    pub const SEALING_KEY_UNSUPPORTED: &str = "SEALING_KEY_UNSUPPORTED";
    /// A result whose `sealedLogs` does not open with the server's sealing key (tampered,
    /// sealed to another key, for another assignment, or an unknown `alg`). Nothing was recorded.
    pub const LOGS_UNSEALABLE: &str = "LOGS_UNSEALABLE";
    /// A signed heartbeat whose sequence is not above the last one applied in its generation,
    /// or whose signed generation is not the session's: a replay. Nothing was changed.
    pub const HEARTBEAT_REPLAYED: &str = "HEARTBEAT_REPLAYED";
    /// The seed's unsigned `complete` call: results are taken only signed, at the result
    /// endpoint the detail names. Nothing was recorded.
    pub const SIGNED_RESULT_REQUIRED: &str = "SIGNED_RESULT_REQUIRED";
    pub const UNSUPPORTED_SIGNATURE_ALGORITHM: &str = "UNSUPPORTED_SIGNATURE_ALGORITHM";
    pub const UNSUPPORTED_CONTRACT_VERSION: &str = "UNSUPPORTED_CONTRACT_VERSION";
    pub const TASK_ID_MISMATCH: &str = "TASK_ID_MISMATCH";
    pub const AGENT_ID_MISMATCH: &str = "AGENT_ID_MISMATCH";
    pub const NO_MATCHING_AGENT: &str = "NO_MATCHING_AGENT";
    pub const TASK_NOT_RETRIABLE: &str = "TASK_NOT_RETRIABLE";
    /// `503`: the server cannot serve the request right now, though nothing is wrong with it;
    /// send it again (after `Retry-After`, or to another replica). The database timed out: a
    /// statement ran past `--database-statement-timeout-secs`, or no pooled connection came
    /// free within `--database-acquire-timeout-secs`.
    pub const UNAVAILABLE: &str = "UNAVAILABLE";
    /// A task type no agent runs (see `kind::TaskKind`).
    pub const UNSUPPORTED_TASK_TYPE: &str = "UNSUPPORTED_TASK_TYPE";
    /// The payload does not parse as the task type's payload type.
    pub const INVALID_PAYLOAD: &str = "INVALID_PAYLOAD";
    /// The agent named does not report the capability the task type needs.
    pub const CAPABILITY_MISSING: &str = "CAPABILITY_MISSING";
    /// More credentials in one task than [`crate::task::MAX_CREDENTIALS`], or one over
    /// [`crate::task::MAX_VALUE_BYTES`].
    pub const TOO_MANY_CREDENTIALS: &str = "TOO_MANY_CREDENTIALS";
    /// A task's credentials name a key only the server sets (the registry token scope of a
    /// deployment task, `registryTokenScope`).
    pub const CREDENTIAL_RESERVED: &str = "CREDENTIAL_RESERVED";
    /// More variables in one task than [`crate::task::MAX_VARIABLES`].
    pub const TOO_MANY_VARIABLES: &str = "TOO_MANY_VARIABLES";
    /// `priority` outside [`crate::task::PRIORITY_RANGE`] (the range above is the read-backs').
    pub const PRIORITY_OUT_OF_RANGE: &str = "PRIORITY_OUT_OF_RANGE";
    /// A label (or variable) value with a control, bidi-override or zero-width character.
    pub const INVALID_LABEL: &str = "INVALID_LABEL";
    /// The request headers are larger than the server reads.
    pub const HEADERS_TOO_LARGE: &str = "HEADERS_TOO_LARGE";
    // --- releases ---
    /// A release component's image has no digest the registry would give: unknown tag or
    /// repository, unreachable registry, or an answer that is not a manifest. The detail names
    /// the component and why.
    pub const DIGEST_UNRESOLVABLE: &str = "DIGEST_UNRESOLVABLE";
    /// The registry refused the credentials given (or asked for some and none were given).
    pub const REGISTRY_UNAUTHORIZED: &str = "REGISTRY_UNAUTHORIZED";
    /// A release of that name exists in the tenant; releases are immutable.
    pub const RELEASE_EXISTS: &str = "RELEASE_EXISTS";
    pub const RELEASE_NOT_FOUND: &str = "RELEASE_NOT_FOUND";
    // --- environments and deployments ---
    pub const ENVIRONMENT_EXISTS: &str = "ENVIRONMENT_EXISTS";
    pub const ENVIRONMENT_NOT_FOUND: &str = "ENVIRONMENT_NOT_FOUND";
    /// The environment requires readiness (`policy.requireReady`) and is not `OperationalReady`
    /// for its current generation; the detail names the conditions that are not `True`.
    pub const ENV_NOT_READY: &str = "ENV_NOT_READY";
    pub const DEPLOYMENT_NOT_FOUND: &str = "DEPLOYMENT_NOT_FOUND";
    /// The environment has a deployment that has not finished (the database's unique index on
    /// an environment's active deployment decides, not a read before the write).
    pub const DEPLOYMENT_IN_PROGRESS: &str = "DEPLOYMENT_IN_PROGRESS";
    /// The environment's selector matches no agent.
    pub const NO_TARGETS: &str = "NO_TARGETS";
    /// The environment's promotion rule: the release has not succeeded in the environment it
    /// must come from.
    pub const PROMOTION_REQUIRED: &str = "PROMOTION_REQUIRED";
    /// The environment is pinned to another release (`berth rollback` pins it) until
    /// `berth env unpin`.
    pub const ENVIRONMENT_PINNED: &str = "ENVIRONMENT_PINNED";
    /// The token that requested a deployment cannot approve it.
    pub const SELF_APPROVAL: &str = "SELF_APPROVAL";
    /// Approve or cancel of a deployment in a state that does not allow it.
    pub const DEPLOYMENT_STATE: &str = "DEPLOYMENT_STATE";
    /// A rollback with no earlier successful release to return to.
    pub const NO_PREVIOUS_RELEASE: &str = "NO_PREVIOUS_RELEASE";
    // --- desired state (seed 001) ---
    /// The request names an environment the caller's credential is not for. The agent exits 78.
    pub const AGENT_ENV_MISMATCH: &str = "AGENT_ENV_MISMATCH";
    /// The credential is unknown, removed, or minted from a superseded grant. The agent deletes it.
    pub const AGENT_UNAUTHENTICATED: &str = "AGENT_UNAUTHENTICATED";
    pub const BUNDLE_NOT_FOUND: &str = "BUNDLE_NOT_FOUND";
    /// The bundle's own sha (recomputed by whoever holds it) is not the one asked for.
    pub const BUNDLE_SHA_MISMATCH: &str = "BUNDLE_SHA_MISMATCH";
    /// A member is unsafe to unpack: absolute, `..`, a link, a device, a duplicate name. The
    /// detail names the member and why.
    pub const BUNDLE_UNSAFE: &str = "BUNDLE_UNSAFE";
    /// A member, or the whole bundle, is over its size limit.
    pub const BUNDLE_TOO_LARGE: &str = "BUNDLE_TOO_LARGE";
    /// The bundle is not what the seed describes (no compose file, unreadable manifest or
    /// `bundle.json`, a manifest entry carrying a `value`).
    pub const BUNDLE_INVALID: &str = "BUNDLE_INVALID";
    /// `bundle.json` names a `renderer` other than `compose`.
    pub const RENDERER_UNSUPPORTED: &str = "RENDERER_UNSUPPORTED";
    /// Free disk is below the bundle's `disk_need_bytes`.
    pub const DISK_INSUFFICIENT: &str = "DISK_INSUFFICIENT";
    /// The compose file asks for privileged containers and the bundle does not allow them.
    pub const PRIVILEGED_FORBIDDEN: &str = "PRIVILEGED_FORBIDDEN";
    /// The desired sha was applied here before and the bundle does not `allow_rollback`.
    pub const ROLLBACK_FORBIDDEN: &str = "ROLLBACK_FORBIDDEN";
    /// Secrets the manifest names could not be resolved: `ENV_INCOMPLETE: unresolved: A, B`.
    pub const ENV_INCOMPLETE: &str = "ENV_INCOMPLETE";
    /// The lease answer has the pre-Gate-1 AppRole shape (`wrapping_token` / `role_id`).
    pub const LEASE_SHAPE: &str = "LEASE_SHAPE";
    /// No live lease for the secret read (`builtin` provider).
    pub const LEASE_REQUIRED: &str = "LEASE_REQUIRED";
    pub const LEASE_RATE_LIMITED: &str = "LEASE_RATE_LIMITED";
    pub const SECRET_NOT_FOUND: &str = "SECRET_NOT_FOUND";
    pub const ARTIFACT_NOT_FOUND: &str = "ARTIFACT_NOT_FOUND";
    pub const SSH_TARGET_EXISTS: &str = "SSH_TARGET_EXISTS";
    pub const SSH_TARGET_NOT_FOUND: &str = "SSH_TARGET_NOT_FOUND";
    /// An SSH target's `viaAgent` names no agent of the tenant.
    pub const AGENT_NOT_FOUND: &str = "AGENT_NOT_FOUND";
    /// No online agent can act for the SSH target (`--via` names none, or none is online).
    pub const SSH_VIA_UNAVAILABLE: &str = "SSH_VIA_UNAVAILABLE";
    // --- agent holds and queue caps (issue 14) ---
    /// The task names a cordoned agent: no new work is routed to it until it is uncordoned.
    pub const AGENT_CORDONED: &str = "AGENT_CORDONED";
    /// The agent already has the server's `--max-open-tasks-per-agent` open tasks; `429` with
    /// `Retry-After`.
    pub const QUEUE_FULL: &str = "QUEUE_FULL";
    /// The release cannot be deployed to this environment's kind of target (components to SSH
    /// targets, or an SSH release to agents).
    pub const RELEASE_TARGET_MISMATCH: &str = "RELEASE_TARGET_MISMATCH";
    /// `docker compose up` or its health wait failed; the previous stack keeps running.
    pub const APPLY_FAILED: &str = "APPLY_FAILED";
    /// The environment's secrets provider is not configured on this server (no OpenBao).
    pub const PROVIDER_UNAVAILABLE: &str = "PROVIDER_UNAVAILABLE";
    // --- notifications (issue 14 item 3) ---
    pub const WEBHOOK_EXISTS: &str = "WEBHOOK_EXISTS";
    pub const WEBHOOK_NOT_FOUND: &str = "WEBHOOK_NOT_FOUND";
    pub const NOTIFICATION_NOT_FOUND: &str = "NOTIFICATION_NOT_FOUND";
    /// Only an `unknown`, `failed` or `dead` notification may be resent.
    pub const NOTIFICATION_NOT_RESENDABLE: &str = "NOTIFICATION_NOT_RESENDABLE";
    /// A web UI form without the session's CSRF token (or with another one): nothing was done.
    pub const CSRF_INVALID: &str = "CSRF_INVALID";
    /// A web UI action without a live session (none, expired, signed out, or its token deleted).
    pub const SESSION_REQUIRED: &str = "SESSION_REQUIRED";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);
    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn chain_names_every_cause() {
        let e = Layer(
            "database error during claim",
            Some(Box::new(Layer(
                "disk I/O error",
                Some(Box::new(Layer("EIO", None))),
            ))),
        );
        assert_eq!(
            ErrorChain(&e).to_string(),
            "database error during claim: disk I/O error: EIO"
        );
    }
}
