//! An environment's readiness (issue 14, seed 003's "Readiness flow"): seven conditions, each
//! with a status, a stable reason and when it was observed, evaluated in order for the
//! environment's current generation; `operationalReady` only when every one is `True` for it.
//! `POST …/verify` sets a fresh nonce; the server echoes it as `verifyObserved` only once a
//! pass that started after it reached a terminal result for every condition.
//!
//! The generation is the environment's spec revision: the server's readiness reconciler counts
//! one up whenever what the conditions depend on changes (the current, previous or pinned
//! release, or the desired bundle).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::deploy::environment_path;
use crate::payload::InspectedContainer;
use crate::{Method, Request};

/// The conditions, in the order they are evaluated (and printed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ConditionType {
    /// The release resolves and every digest exists in its registry.
    Configured,
    /// Every selected target is online with a live session.
    TargetsReachable,
    /// Every target reports the capabilities the release's task kinds need.
    CapabilitiesMatch,
    /// Every secrets-manifest entry of the desired bundle exists at its provider.
    SecretsResolvable,
    /// Every registry of the release answers `/v2/` from each target (the agent's probe).
    RegistryReachable,
    /// Each target ran this pass's signed probe task.
    RoutesExecutable,
    /// The current release's containers run on each target and pass their health checks.
    Healthy,
}

impl ConditionType {
    pub const ALL: [ConditionType; 7] = [
        ConditionType::Configured,
        ConditionType::TargetsReachable,
        ConditionType::CapabilitiesMatch,
        ConditionType::SecretsResolvable,
        ConditionType::RegistryReachable,
        ConditionType::RoutesExecutable,
        ConditionType::Healthy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Configured => "Configured",
            ConditionType::TargetsReachable => "TargetsReachable",
            ConditionType::CapabilitiesMatch => "CapabilitiesMatch",
            ConditionType::SecretsResolvable => "SecretsResolvable",
            ConditionType::RegistryReachable => "RegistryReachable",
            ConditionType::RoutesExecutable => "RoutesExecutable",
            ConditionType::Healthy => "Healthy",
        }
    }
}

impl std::fmt::Display for ConditionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `Unknown`: not yet terminal (a probe still pending, a pass not yet evaluated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }

    pub fn is_terminal(self) -> bool {
        self != ConditionStatus::Unknown
    }
}

/// The stable reasons. `True` conditions say `OK` (or `NOTHING_TO_CHECK`); `Unknown` ones say
/// why they are still open.
pub mod reasons {
    pub const OK: &str = "OK";
    /// Nothing of this condition applies (no release yet, no secrets manifest, no registry).
    pub const NOTHING_TO_CHECK: &str = "NOTHING_TO_CHECK";
    /// The pass has not reached this condition yet.
    pub const PENDING: &str = "PENDING";
    /// A target's probe task is not finished yet: a transient state that keeps a pass open.
    pub const PROBE_PENDING: &str = "PROBE_PENDING";
    pub const RELEASE_NOT_FOUND: &str = "RELEASE_NOT_FOUND";
    pub const DIGEST_NOT_FOUND: &str = "DIGEST_NOT_FOUND";
    pub const REGISTRY_UNAUTHORIZED: &str = "REGISTRY_UNAUTHORIZED";
    pub const REGISTRY_UNREACHABLE: &str = "REGISTRY_UNREACHABLE";
    pub const NO_TARGETS: &str = "NO_TARGETS";
    pub const TARGET_OFFLINE: &str = "TARGET_OFFLINE";
    pub const CAPABILITY_MISSING: &str = "CAPABILITY_MISSING";
    pub const DOCKER_UNAVAILABLE: &str = "DOCKER_UNAVAILABLE";
    pub const SECRET_NOT_FOUND: &str = "SECRET_NOT_FOUND";
    /// The environment's secrets are OpenBao-backed and this server has no OpenBao configured
    /// (`--openbao-addr`), so no agent can be sent to resolve them.
    pub const SECRETS_UNCHECKABLE: &str = "SECRETS_UNCHECKABLE";
    /// The probing agent could not log in to OpenBao or read from it (unreachable, sealed, the
    /// grant or the policy refused): the secrets' existence is not known.
    pub const SECRETS_UNAVAILABLE: &str = "SECRETS_UNAVAILABLE";
    pub const BUNDLE_UNREADABLE: &str = "BUNDLE_UNREADABLE";
    /// A target could not run the probe (offline, cordoned, its task failed or was refused).
    pub const PROBE_FAILED: &str = "PROBE_FAILED";
    /// The probe was not done within the pass's deadline.
    pub const PROBE_TIMEOUT: &str = "PROBE_TIMEOUT";
    pub const UNHEALTHY: &str = "UNHEALTHY";
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: ConditionType,
    pub status: ConditionStatus,
    /// A stable UPPER_SNAKE code ([`reasons`]).
    pub reason: String,
    /// For people: names the target, digest, registry or secret path (never a value).
    pub message: String,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub observed_at: OffsetDateTime,
    /// The environment generation it was observed for.
    pub generation: i64,
}

/// `GET /api/v1/environments/{name}/readiness`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentReadiness {
    pub environment: String,
    /// The environment's current generation (its spec revision).
    pub generation: i64,
    /// Every condition `True` for `generation`.
    pub operational_ready: bool,
    /// In [`ConditionType::ALL`] order; empty before the first pass.
    pub conditions: Vec<Condition>,
    /// The last nonce `verify` set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_request: Option<String>,
    /// The last nonce a completed fresh pass answered; equal to `verifyRequest` once the
    /// verification is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_observed: Option<String>,
}

impl EnvironmentReadiness {
    /// The conditions that are not `True`, by name: what a refusal names.
    pub fn not_true(&self) -> Vec<String> {
        self.conditions
            .iter()
            .filter(|c| c.status != ConditionStatus::True)
            .map(|c| format!("{} ({})", c.kind, c.reason))
            .collect()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct GetReadiness {
    #[serde(skip)]
    pub name: String,
}

impl Request for GetReadiness {
    type Response = EnvironmentReadiness;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        environment_path(&self.name, "/readiness")
    }
}

/// `POST /api/v1/environments/{name}/verify`: a fresh pass, answered with its nonce.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyEnvironment {
    #[serde(skip)]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct VerifyResponse {
    pub nonce: String,
}

impl Request for VerifyEnvironment {
    type Response = VerifyResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        environment_path(&self.name, "/verify")
    }
}

/// What a `readiness-probe` found on its host: the task result's `outputs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeReport {
    /// Present when the payload asked for Docker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docker: Option<ProbeCheck>,
    #[serde(default)]
    pub registries: Vec<RegistryCheck>,
    /// berth's containers on the host that the payload named (missing ones are absent).
    #[serde(default)]
    pub containers: Vec<InspectedContainer>,
    /// Present when the payload asked to resolve secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<SecretsCheck>,
}

/// What resolving the payload's secrets at OpenBao found: whether the host could ask at all
/// (`ok`, else `detail` says why), and the manifest paths that did not resolve (each with
/// why: not found, or refused). Never a value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretsCheck {
    pub ok: bool,
    #[serde(default)]
    pub detail: String,
    #[serde(default)]
    pub unresolved: Vec<String>,
    /// How many entries were asked for.
    #[serde(default)]
    pub checked: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeCheck {
    pub ok: bool,
    #[serde(default)]
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegistryCheck {
    pub host: String,
    /// Any HTTP answer from `/v2/` (a `401` too); a refused connection or a timeout is not.
    pub ok: bool,
    #[serde(default)]
    pub detail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn condition_types_serialize_as_written() {
        for kind in ConditionType::ALL {
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                serde_json::json!(kind.as_str())
            );
        }
        assert_eq!(
            serde_json::to_value(ConditionStatus::Unknown).unwrap(),
            serde_json::json!("Unknown")
        );
    }
}
