//! Task kinds: the one table of which task types exist and what each means to the control plane
//! and the agent — its payload type, whether it changes the target, the capability it needs, and
//! where a read-back finds the sticker it writes. The server's create, transport and read-back and
//! the agent's executor dispatch all ask this table; nothing else decides these things.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::payload::{
    CheckPayload, CommandPayload, DeployTaskPayload, HealthCheckPayload, InspectPayload,
    ReadStickerPayload, ReadinessProbePayload, RollbackTaskPayload, SshDeployPayload,
    UploadFilesPayload, VolumeSticker, WriteStickerPayload,
};

/// Seed 000's capability strings, as agents report them and `requiredCapability` names them.
pub mod capability {
    /// Every agent has it: the built-in task types need nothing but the agent itself.
    pub const AGENT: &str = "agent";
    pub const DOCKER: &str = "docker";
    pub const COMPOSE: &str = "compose";
    pub const SSH: &str = "ssh";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum TaskKind {
    #[serde(rename = "health-check")]
    HealthCheck,
    #[serde(rename = "inspect")]
    Inspect,
    #[serde(rename = "read-sticker")]
    ReadSticker,
    #[serde(rename = "write-sticker")]
    WriteSticker,
    #[serde(rename = "execute-command")]
    ExecuteCommand,
    #[serde(rename = "docker.run")]
    DockerRun,
    #[serde(rename = "compose.up")]
    ComposeUp,
    #[serde(rename = "rollback")]
    Rollback,
    #[serde(rename = "ssh.deploy")]
    SshDeploy,
    #[serde(rename = "upload-files")]
    UploadFiles,
    /// An environment's readiness checks on one host (issue 14): no side effects.
    #[serde(rename = "readiness-probe")]
    ReadinessProbe,
}

/// What one task kind means. See [`TaskKind::spec`].
#[derive(Debug, Clone, Copy)]
pub struct KindSpec {
    pub name: &'static str,
    /// Changes the target: a lost lease makes the task `unknown`, never re-run automatically.
    pub side_effects: bool,
    /// One of [`capability`].
    pub required_capability: &'static str,
    /// JSON pointers into the payload naming the sticker the task writes, first match wins;
    /// empty when a lost task of this kind cannot be read back.
    pub read_back: &'static [&'static str],
    /// Parses a payload into the kind's payload type and runs its [`CheckPayload`], to refuse a
    /// bad one before it is queued.
    check_payload: fn(&serde_json::Value) -> Result<(), String>,
}

/// Decodes a payload into its kind's type; an absent payload (`null`) reads as `{}`. The server
/// checks with this at create and the agent's executors decode with it, so both agree.
pub fn decode_payload<T: DeserializeOwned>(
    payload: &serde_json::Value,
) -> Result<T, serde_json::Error> {
    match payload {
        serde_json::Value::Null => T::deserialize(serde_json::json!({})),
        payload => T::deserialize(payload),
    }
}

fn parses<T: DeserializeOwned + CheckPayload>(payload: &serde_json::Value) -> Result<(), String> {
    decode_payload::<T>(payload)
        .map_err(|e| e.to_string())?
        .check()
}

impl TaskKind {
    pub const ALL: [TaskKind; 11] = [
        TaskKind::HealthCheck,
        TaskKind::Inspect,
        TaskKind::ReadSticker,
        TaskKind::WriteSticker,
        TaskKind::ExecuteCommand,
        TaskKind::DockerRun,
        TaskKind::ComposeUp,
        TaskKind::Rollback,
        TaskKind::SshDeploy,
        TaskKind::UploadFiles,
        TaskKind::ReadinessProbe,
    ];

    /// The table.
    pub const fn spec(self) -> KindSpec {
        use capability::{AGENT, COMPOSE, DOCKER, SSH};
        const fn kind(
            name: &'static str,
            side_effects: bool,
            required_capability: &'static str,
            read_back: &'static [&'static str],
            check_payload: fn(&serde_json::Value) -> Result<(), String>,
        ) -> KindSpec {
            KindSpec {
                name,
                side_effects,
                required_capability,
                read_back,
                check_payload,
            }
        }
        match self {
            TaskKind::HealthCheck => kind(
                "health-check",
                false,
                AGENT,
                &[],
                parses::<HealthCheckPayload>,
            ),
            TaskKind::Inspect => kind("inspect", false, AGENT, &[], parses::<InspectPayload>),
            TaskKind::ReadSticker => kind(
                "read-sticker",
                false,
                AGENT,
                &[],
                parses::<ReadStickerPayload>,
            ),
            TaskKind::WriteSticker => kind(
                "write-sticker",
                true,
                AGENT,
                &["/name"],
                parses::<WriteStickerPayload>,
            ),
            TaskKind::ExecuteCommand => kind(
                "execute-command",
                true,
                AGENT,
                &[],
                parses::<CommandPayload>,
            ),
            TaskKind::DockerRun => kind(
                "docker.run",
                true,
                DOCKER,
                &["/config/containerName"],
                parses::<DeployTaskPayload>,
            ),
            TaskKind::ComposeUp => kind(
                "compose.up",
                true,
                COMPOSE,
                &["/config/projectName"],
                parses::<DeployTaskPayload>,
            ),
            TaskKind::Rollback => kind(
                "rollback",
                true,
                DOCKER,
                &["/containerName", "/config/containerName"],
                parses::<RollbackTaskPayload>,
            ),
            // The sticker is written into the remote deploy directory: its read-back is a
            // `read-sticker` over SSH (the payload's `target` and `deployDirectory` go with it).
            TaskKind::SshDeploy => kind(
                "ssh.deploy",
                true,
                SSH,
                &["/sticker/name"],
                parses::<SshDeployPayload>,
            ),
            TaskKind::UploadFiles => kind(
                "upload-files",
                true,
                AGENT,
                &[],
                parses::<UploadFilesPayload>,
            ),
            TaskKind::ReadinessProbe => kind(
                "readiness-probe",
                false,
                AGENT,
                &[],
                parses::<ReadinessProbePayload>,
            ),
        }
    }

    pub fn parse(name: &str) -> Option<TaskKind> {
        TaskKind::ALL.into_iter().find(|k| k.spec().name == name)
    }

    pub const fn name(self) -> &'static str {
        self.spec().name
    }

    pub const fn side_effects(self) -> bool {
        self.spec().side_effects
    }

    pub const fn required_capability(self) -> &'static str {
        self.spec().required_capability
    }

    /// The name of the sticker this task writes, read from its payload.
    pub fn read_back_sticker(self, payload: &serde_json::Value) -> Option<String> {
        self.spec()
            .read_back
            .iter()
            .find_map(|pointer| payload.pointer(pointer).and_then(|v| v.as_str()))
            .map(str::to_string)
    }

    /// The volume this task writes its sticker into (`stickerLocation: "volume"`), so that its
    /// read-back reads it there; `None` for a sticker in the agent's sticker directory.
    pub fn read_back_volume(self, payload: &serde_json::Value) -> Option<VolumeSticker> {
        fn parse<T: DeserializeOwned>(payload: &serde_json::Value) -> Option<T> {
            T::deserialize(payload).ok()
        }
        match self {
            TaskKind::WriteSticker => parse::<WriteStickerPayload>(payload)?.volume().ok()?,
            TaskKind::DockerRun => {
                let p = parse::<DeployTaskPayload>(payload)?;
                p.volume_sticker(p.digest.as_deref()).ok()?
            }
            TaskKind::Rollback => parse::<RollbackTaskPayload>(payload)?
                .volume_sticker()
                .ok()?,
            _ => None,
        }
    }

    /// Whether the payload parses as this kind's payload type; the error says why not.
    pub fn check_payload(self, payload: &serde_json::Value) -> Result<(), String> {
        (self.spec().check_payload)(payload)
    }

    /// Whether an agent reporting `capabilities` (seed strings) can run this kind.
    pub fn runs_on<S: AsRef<str>>(self, capabilities: &[S]) -> bool {
        let needed = self.required_capability();
        needed == capability::AGENT || capabilities.iter().any(|c| c.as_ref() == needed)
    }
}

impl std::fmt::Display for TaskKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_round_trip_through_parse_and_serde() {
        for kind in TaskKind::ALL {
            assert_eq!(TaskKind::parse(kind.name()), Some(kind));
            assert_eq!(serde_json::to_value(kind).unwrap(), json!(kind.name()));
        }
        assert_eq!(TaskKind::parse("deploy"), None);
        assert_eq!(TaskKind::parse(""), None);
    }

    #[test]
    fn the_table() {
        // (kind, side effects, capability, payload with a sticker, the sticker read back)
        let rows: [(TaskKind, bool, &str, serde_json::Value, Option<&str>); 11] = [
            (
                TaskKind::HealthCheck,
                false,
                "agent",
                json!({"type": "tcp", "host": "h", "port": 1}),
                None,
            ),
            (TaskKind::Inspect, false, "agent", json!({}), None),
            (
                TaskKind::ReadSticker,
                false,
                "agent",
                json!({"name": "a"}),
                None,
            ),
            (
                TaskKind::WriteSticker,
                true,
                "agent",
                json!({"name": "site"}),
                Some("site"),
            ),
            (
                TaskKind::ExecuteCommand,
                true,
                "agent",
                json!({"command": ["/bin/true"]}),
                None,
            ),
            (
                TaskKind::DockerRun,
                true,
                "docker",
                json!({"config": {"containerName": "web"}}),
                Some("web"),
            ),
            (
                TaskKind::ComposeUp,
                true,
                "compose",
                json!({"config": {"projectName": "app"}}),
                Some("app"),
            ),
            (
                TaskKind::Rollback,
                true,
                "docker",
                json!({"config": {"containerName": "web"}}),
                Some("web"),
            ),
            (
                TaskKind::SshDeploy,
                true,
                "ssh",
                json!({"target": {"host": "h", "user": "u", "hostKey": "ssh-ed25519 AAAA"},
                       "deployDirectory": "/srv/app", "sticker": {"name": "app"}}),
                Some("app"),
            ),
            (
                TaskKind::UploadFiles,
                true,
                "agent",
                json!({"directory": "/srv/app", "files": [{"name": "a", "content": "x"}]}),
                None,
            ),
            (
                TaskKind::ReadinessProbe,
                false,
                "agent",
                json!({"docker": true, "registries": ["127.0.0.1:5000"]}),
                None,
            ),
        ];
        for (kind, side_effects, capability, payload, sticker) in rows {
            assert_eq!(kind.side_effects(), side_effects, "{kind}");
            assert_eq!(kind.required_capability(), capability, "{kind}");
            assert_eq!(kind.check_payload(&payload), Ok(()), "{kind}");
            assert_eq!(
                kind.read_back_sticker(&payload).as_deref(),
                sticker,
                "{kind}"
            );
        }
        // A rollback names its container at the top level first.
        assert_eq!(
            TaskKind::Rollback
                .read_back_sticker(&json!({"containerName": "a", "config": {"containerName": "b"}}))
                .as_deref(),
            Some("a")
        );
    }

    #[test]
    fn payloads_are_checked_by_type() {
        assert!(TaskKind::WriteSticker.check_payload(&json!({})).is_err());
        assert!(TaskKind::ReadSticker
            .check_payload(&json!({"name": "a", "bogus": 1}))
            .is_err());
        assert!(TaskKind::ExecuteCommand
            .check_payload(&json!({"command": "sh -c x"}))
            .is_err());
        assert!(TaskKind::DockerRun.check_payload(&json!([1])).is_err());
    }

    #[test]
    fn path_like_fields_are_checked_at_decode() {
        let bad = [
            (
                TaskKind::WriteSticker,
                json!({"name": "../../tmp/pwn"}),
                "name",
            ),
            (TaskKind::ReadSticker, json!({"name": ".hidden"}), "name"),
            (
                TaskKind::DockerRun,
                json!({"config": {"containerName": "../x"}}),
                "config.containerName",
            ),
            (
                TaskKind::ComposeUp,
                json!({"config": {"projectName": "../x"}}),
                "config.projectName",
            ),
            (
                TaskKind::ComposeUp,
                json!({"config": {"projectName": "app", "deploymentDirectory": "../../tmp/pwn"}}),
                "config.deploymentDirectory",
            ),
            (
                TaskKind::Rollback,
                json!({"containerName": "a/b"}),
                "containerName",
            ),
            (
                TaskKind::Rollback,
                json!({"config": {"containerName": "a b"}}),
                "config.containerName",
            ),
        ];
        for (kind, payload, field) in bad {
            let err = kind.check_payload(&payload).unwrap_err();
            assert!(err.starts_with(&format!("{field} ")), "{kind}: {err}");
        }
        assert_eq!(
            TaskKind::ComposeUp.check_payload(
                &json!({"config": {"projectName": "app", "deploymentDirectory": "/srv/app"}})
            ),
            Ok(())
        );
    }

    #[test]
    fn capability_matching() {
        assert!(TaskKind::Inspect.runs_on::<&str>(&[]));
        assert!(!TaskKind::DockerRun.runs_on(&["compose"]));
        assert!(TaskKind::DockerRun.runs_on(&["compose", "docker"]));
        assert!(TaskKind::ComposeUp.runs_on(&["compose"]));
        assert!(!TaskKind::SshDeploy.runs_on(&["docker"]));
        assert!(TaskKind::SshDeploy.runs_on(&["ssh"]));
    }
}
