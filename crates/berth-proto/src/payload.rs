//! Task payloads: the JSON inside `assignment.payload` of every task kind (see
//! [`crate::kind::TaskKind`], which names each kind's type here). The deployment payloads use seed
//! 000's `DeployTaskPayload` names (camelCase); also what the agent's `inspect` task reports about
//! containers.
//!
//! Names and paths that become file or container names (sticker names, `containerName`,
//! `projectName`, `deploymentDirectory`) are checked here, by [`CheckPayload`], so the server's
//! create and the agent's executors refuse the same payloads; the rest of the validation (digest
//! pinning, port syntax, volume specs) belongs to the executors. Unknown fields are ignored in the deployment payloads so the control plane can add fields
//! before every agent knows them; the built-in kinds' payloads refuse them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A sticker name: 1-128 of `A-Z a-z 0-9 . _ -`, not starting with a dot (it names a file in
/// the agent's sticker directory).
pub fn valid_sticker_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A container name as the docker engine accepts it: `[A-Za-z0-9][A-Za-z0-9_.-]`, 1-100 long.
pub fn valid_container_name(name: &str) -> bool {
    (1..=100).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Compose project names as both compose v1 and v2 accept them unchanged:
/// `[a-z0-9][a-z0-9_-]`, 1-64 long.
pub fn valid_project_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

/// An absolute, normalized directory other than `/`: no `.` or `..` components, no empty
/// components (`//`), no NUL.
pub fn valid_directory(dir: &str) -> bool {
    dir.len() > 1
        && dir.starts_with('/')
        && !dir.contains('\0')
        && dir
            .trim_end_matches('/')
            .split('/')
            .skip(1)
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// A plain file name inside a directory: 1-255 bytes, no `/` or NUL, not `.` or `..`, and not
/// one of berth's own `.berth-*` names there (the `ssh.deploy` backup and sticker). Anything else
/// (spaces, quotes, `;`, newlines) is allowed: such names travel over SFTP or as single-quoted
/// arguments, never through a shell line.
pub fn valid_file_name(name: &str) -> bool {
    (1..=255).contains(&name.len())
        && name != "."
        && name != ".."
        && !name.starts_with(".berth-")
        && !name.contains(['/', '\0'])
}

/// An OpenSSH public key line as a host key pin: `<algorithm> <base64>` (a trailing comment is
/// allowed), for the algorithms an sshd offers as host keys. The executor decodes the key itself.
pub fn valid_host_key_line(line: &str) -> bool {
    let mut parts = line.split_ascii_whitespace();
    let (Some(algorithm), Some(key)) = (parts.next(), parts.next()) else {
        return false;
    };
    matches!(
        algorithm,
        "ssh-ed25519"
            | "ecdsa-sha2-nistp256"
            | "ecdsa-sha2-nistp384"
            | "ecdsa-sha2-nistp521"
            | "ssh-rsa"
    ) && key.len() >= 4
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
}

/// The checks a payload type makes after it decodes: names and paths. Absent optional fields
/// pass; the executor says when it needs them.
pub trait CheckPayload {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

fn check_field(
    field: &str,
    value: Option<&str>,
    ok: fn(&str) -> bool,
    rule: &str,
) -> Result<(), String> {
    match value {
        Some(v) if !ok(v) => Err(format!(
            "{field} {:?} is invalid: {rule}",
            v.chars().take(64).collect::<String>()
        )),
        _ => Ok(()),
    }
}

const STICKER_RULE: &str = "1-128 of A-Z a-z 0-9 . _ -, not starting with a dot";
const CONTAINER_RULE: &str = "1-100 of A-Z a-z 0-9 _ . -, starting with a letter or digit";
const VOLUME_PATH_RULE: &str =
    "a relative path of components of A-Z a-z 0-9 . _ -, no . or .., at most 255 bytes";
const PROJECT_RULE: &str = "1-64 of a-z 0-9 _ -, starting with a letter or digit";
const DIRECTORY_RULE: &str = "an absolute path other than /, without . or .. components";
const FILE_NAME_RULE: &str =
    "a plain file name: 1-255 bytes, no / or NUL, not . or .., not berth's own .berth-*";

impl CheckPayload for CommandPayload {}

impl CheckPayload for HealthCheckPayload {
    fn check(&self) -> Result<(), String> {
        match (self.kind.as_str(), &self.ssh_target) {
            ("http" | "tcp", _) => Ok(()),
            ("command", Some(t)) => {
                t.check("sshTarget")?;
                check_command("health-check", &self.command, self.timeout)
            }
            ("command", None) => Err("a health-check of type command needs an sshTarget".into()),
            (other, _) => Err(format!(
                "type {:?} is not one of http, tcp, command",
                short(other)
            )),
        }
    }
}

impl CheckPayload for InspectPayload {
    fn check(&self) -> Result<(), String> {
        check_remote(&self.ssh_target, &self.deploy_directory)
    }
}

impl CheckPayload for ReadStickerPayload {
    fn check(&self) -> Result<(), String> {
        check_field("name", Some(&self.name), valid_sticker_name, STICKER_RULE)?;
        if self.volume()?.is_some() && self.ssh_target.is_some() {
            return Err("a volume sticker is read on the agent's host, not with sshTarget".into());
        }
        check_remote(&self.ssh_target, &self.deploy_directory)
    }
}

impl CheckPayload for UploadFilesPayload {
    fn check(&self) -> Result<(), String> {
        check_field(
            "directory",
            Some(&self.directory),
            valid_directory,
            DIRECTORY_RULE,
        )?;
        if self.files.is_empty() {
            return Err("files is empty".into());
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, f) in self.files.iter().enumerate() {
            check_field(
                &format!("files[{i}].name"),
                Some(&f.name),
                valid_file_name,
                FILE_NAME_RULE,
            )?;
            if !names.insert(f.name.as_str()) {
                return Err(format!(
                    "files[{i}].name {:?} is not unique",
                    short(&f.name)
                ));
            }
            f.check(&format!("files[{i}]"))?;
        }
        match &self.ssh_target {
            Some(t) => t.check("sshTarget"),
            None => Ok(()),
        }
    }
}

impl CheckPayload for WriteStickerPayload {
    fn check(&self) -> Result<(), String> {
        check_field("name", Some(&self.name), valid_sticker_name, STICKER_RULE)?;
        self.volume().map(|_| ())
    }
}

impl CheckPayload for DeployTaskPayload {
    fn check(&self) -> Result<(), String> {
        self.check_names()?;
        self.volume_sticker(self.digest.as_deref()).map(|_| ())
    }
}

impl DeployTaskPayload {
    fn check_names(&self) -> Result<(), String> {
        let c = &self.config;
        check_field(
            "config.containerName",
            c.container_name.as_deref(),
            valid_container_name,
            CONTAINER_RULE,
        )?;
        check_field(
            "config.projectName",
            c.project_name.as_deref(),
            valid_project_name,
            PROJECT_RULE,
        )?;
        check_field(
            "config.deploymentDirectory",
            c.deployment_directory.as_deref(),
            valid_directory,
            DIRECTORY_RULE,
        )
    }
}

impl CheckPayload for RollbackTaskPayload {
    fn check(&self) -> Result<(), String> {
        check_field(
            "containerName",
            self.container_name.as_deref(),
            valid_container_name,
            CONTAINER_RULE,
        )?;
        self.deploy.check_names()?;
        self.volume_sticker().map(|_| ())
    }
}

impl DeployTaskPayload {
    /// The volume the container's sticker goes into, if `config.stickerLocation` is `volume`:
    /// named `config.containerName`, the helper image by default `image@digest` (`digest` is
    /// the one deployed). Only `docker.run` and `rollback` write one.
    pub fn volume_sticker(&self, digest: Option<&str>) -> Result<Option<VolumeSticker>, String> {
        let c = &self.config;
        if c.sticker_location.unwrap_or_default() == StickerLocation::Volume
            && c.container_name.is_none()
        {
            return Err(
                "stickerLocation volume is for docker.run: it needs config.containerName".into(),
            );
        }
        let deployed = match (&self.image, digest) {
            (Some(image), _) if image.contains('@') => Some(image.clone()),
            (Some(image), Some(digest)) => Some(format!("{image}@{digest}")),
            _ => None,
        };
        VolumeSticker::from_fields(
            c.container_name.as_deref().unwrap_or_default(),
            c.sticker_location,
            c.sticker_volume.as_deref(),
            c.sticker_path.as_deref(),
            c.sticker_image.as_deref(),
            deployed,
        )
    }
}

impl RollbackTaskPayload {
    /// The rolled-back container's volume sticker: as [`DeployTaskPayload::volume_sticker`],
    /// named by the top-level `containerName` when given, the image by `targetDigest`.
    pub fn volume_sticker(&self) -> Result<Option<VolumeSticker>, String> {
        let mut deploy = self.deploy.clone();
        if let Some(name) = &self.container_name {
            deploy.config.container_name = Some(name.clone());
        }
        deploy.volume_sticker(self.target_digest.as_deref())
    }
}

impl ReadStickerPayload {
    /// The read-back of a sticker in a volume: what `read-sticker` needs to find it.
    pub fn in_volume(name: &str, volume: VolumeSticker) -> ReadStickerPayload {
        ReadStickerPayload {
            name: name.to_string(),
            sticker_location: Some(StickerLocation::Volume),
            sticker_volume: Some(volume.volume),
            sticker_path: Some(volume.path),
            sticker_image: Some(volume.image),
            ..Default::default()
        }
    }
}

impl SshTarget {
    /// The target's own rules; `field` names it in the error (`target`, `sshTarget`).
    pub fn check(&self, field: &str) -> Result<(), String> {
        let t = self;
        if t.host.is_empty() || t.host.len() > 253 || !t.host.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(format!(
                "{field}.host {:?} is invalid: 1-253 printable ASCII characters, no spaces",
                short(&t.host)
            ));
        }
        if t.port == Some(0) {
            return Err(format!("{field}.port must be 1-65535"));
        }
        if t.user.is_empty() || t.user.len() > 64 || !t.user.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{field}.user {:?} is invalid: 1-64 printable ASCII characters, no spaces",
                short(&t.user)
            ));
        }
        if !valid_host_key_line(&t.host_key) {
            return Err(format!(
                "{field}.hostKey {:?} is invalid: an OpenSSH public key line, `ssh-ed25519 AAAA…`",
                short(&t.host_key)
            ));
        }
        if t.connect_timeout == Some(0) {
            return Err(format!("{field}.connectTimeout must be at least 1 second"));
        }
        Ok(())
    }
}

impl CheckPayload for SshDeployPayload {
    fn check(&self) -> Result<(), String> {
        self.target.check("target")?;
        check_deploy_spec(
            &self.deploy_directory,
            &self.artifacts,
            &self.script,
            &self.hooks,
            &self.health_check,
        )?;
        check_field(
            "sticker.name",
            Some(&self.sticker.name),
            valid_sticker_name,
            STICKER_RULE,
        )?;
        // Its sticker is a file in the deploy directory on the SSH target.
        if self.sticker.volume()?.is_some() {
            return Err("an ssh.deploy sticker cannot be in a volume".into());
        }
        Ok(())
    }
}

/// What `ssh.deploy` does on its target, checked: by the payload's check, and by a release's
/// `ssh` part when it is created ([`crate::release::SshRelease::check`]).
pub(crate) fn check_deploy_spec(
    deploy_directory: &str,
    artifacts: &[SshArtifact],
    script: &Option<HookConfig>,
    hooks: &DeployHooks,
    health_check: &Option<SshHealthCheck>,
) -> Result<(), String> {
    check_field(
        "deployDirectory",
        Some(deploy_directory),
        valid_directory,
        DIRECTORY_RULE,
    )?;
    let mut names = std::collections::BTreeSet::new();
    for (i, a) in artifacts.iter().enumerate() {
        check_field(
            &format!("artifacts[{i}].name"),
            Some(&a.name),
            valid_file_name,
            FILE_NAME_RULE,
        )?;
        if !names.insert(a.name.as_str()) {
            return Err(format!(
                "artifacts[{i}].name {:?} is not unique",
                short(&a.name)
            ));
        }
        a.check(&format!("artifacts[{i}]"))?;
    }
    for (field, command) in [
        ("script", script),
        ("hooks.preDeploy", &hooks.pre_deploy),
        ("hooks.postDeploy", &hooks.post_deploy),
    ] {
        if let Some(c) = command {
            check_command(field, &c.command, c.timeout)?;
        }
    }
    if let Some(h) = health_check {
        match h.kind {
            SshHealthCheckKind::Http if h.url.is_none() => {
                return Err("healthCheck of type http needs a url".into())
            }
            SshHealthCheckKind::Tcp if h.host.is_none() || h.port.is_none() => {
                return Err("healthCheck of type tcp needs a host and a port".into())
            }
            SshHealthCheckKind::Command => check_command("healthCheck", &h.command, Some(1))?,
            _ => {}
        }
    }
    Ok(())
}

fn short(v: &str) -> String {
    v.chars().take(64).collect()
}

fn check_command(field: &str, argv: &[String], timeout: Option<u64>) -> Result<(), String> {
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err(format!("{field}.command needs a program"));
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(format!("{field}.command contains a NUL byte"));
    }
    if timeout == Some(0) {
        return Err(format!("{field}.timeout must be at least 1 second"));
    }
    Ok(())
}

/// `health-check`: one probe from the agent's host (`http`, `tcp`), or a command run on an SSH
/// target (`command`, with `sshTarget`; it passes when it exits 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheckPayload {
    /// `http`, `tcp` or `command`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `command`: the argument vector run on `sshTarget`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_target: Option<SshTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Seconds for one probe; default 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
}

/// `inspect`: on the agent's own host it takes no arguments (any other object, or none, is
/// accepted). With `sshTarget` and `deployDirectory` it reads that SSH target instead: outputs
/// `{"sticker": <the deploy directory's sticker or null>, "files": [{"name", "size",
/// "sha256"}]}` (the deploy directory's regular files, berth's own `.berth-*` excluded).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InspectPayload {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_target: Option<SshTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deploy_directory: Option<String>,
}

/// `read-sticker`: the agent's sticker `name`; or, with `sshTarget` and `deployDirectory`, the
/// sticker `ssh.deploy` wrote there (`<deployDirectory>/.berth-sticker.json`), read over SFTP and
/// reported only if its `name` is `name` (else `outputs.sticker` is null, as for a missing one).
/// Either way the result's `outputs.sticker` is the sticker as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReadStickerPayload {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_target: Option<SshTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deploy_directory: Option<String>,
    /// `volume`: read the sticker from a named Docker volume (see [`VolumeSticker`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_location: Option<StickerLocation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_volume: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_path: Option<String>,
    /// The image the read's helper container is created from (never started); read-sticker
    /// has no default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_image: Option<String>,
}

/// `upload-files` (seed 000's task list): writes `files` into `directory`, each atomically
/// (a temporary name, then a rename), creating the directory when missing. With `sshTarget`, on
/// that host over SFTP (the key in the sealed credentials' `sshPrivateKey`); without, on the
/// agent's own host, where `directory` must lie inside the agent's upload root
/// (`berth-agent --upload-root`, default `<state-dir>/uploads`), else `PATH_FORBIDDEN`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UploadFilesPayload {
    /// Absolute ([`valid_directory`]).
    pub directory: String,
    pub files: Vec<SshArtifact>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_target: Option<SshTarget>,
}

/// Checks an optional SSH target and the deploy directory that must come with it.
fn check_remote(target: &Option<SshTarget>, directory: &Option<String>) -> Result<(), String> {
    match (target, directory) {
        (None, None) => Ok(()),
        (Some(t), Some(d)) => {
            t.check("sshTarget")?;
            check_field("deployDirectory", Some(d), valid_directory, DIRECTORY_RULE)
        }
        _ => Err("sshTarget and deployDirectory come together".into()),
    }
}

/// Where a sticker lives (seed 000's `stickerLocation`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StickerLocation {
    /// `<sticker-dir>/<name>.json` on the agent's host.
    #[default]
    File,
    /// A file in a named Docker volume.
    Volume,
}

/// A sticker in a named Docker volume (`stickerLocation: "volume"`): the file `path` (relative,
/// default `<name>.json`) in the volume `volume`. The agent writes and reads it only through
/// the Engine API's archive upload and download on a helper container that mounts the volume
/// at [`VolumeSticker::MOUNT`], created from `image` and never started: no shell, no command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSticker {
    pub volume: String,
    pub path: String,
    pub image: String,
}

impl VolumeSticker {
    /// Where the helper container mounts the volume.
    pub const MOUNT: &'static str = "/berth-sticker";

    /// The volume sticker the fields describe; `Ok(None)` for a file sticker. `default_image`
    /// stands in for a missing `stickerImage`.
    pub fn from_fields(
        name: &str,
        location: Option<StickerLocation>,
        volume: Option<&str>,
        path: Option<&str>,
        image: Option<&str>,
        default_image: Option<String>,
    ) -> Result<Option<VolumeSticker>, String> {
        if location.unwrap_or_default() == StickerLocation::File {
            if volume.is_some() || path.is_some() || image.is_some() {
                return Err(
                    "stickerVolume, stickerPath and stickerImage need stickerLocation volume"
                        .into(),
                );
            }
            return Ok(None);
        }
        let volume = volume.ok_or("stickerLocation volume needs stickerVolume")?;
        check_field(
            "stickerVolume",
            Some(volume),
            valid_container_name,
            CONTAINER_RULE,
        )?;
        let path = path.map_or_else(|| format!("{name}.json"), str::to_string);
        check_field(
            "stickerPath",
            Some(&path),
            valid_volume_path,
            VOLUME_PATH_RULE,
        )?;
        let image = image
            .map(str::to_string)
            .or(default_image)
            .ok_or("stickerLocation volume needs stickerImage (or image and digest)")?;
        crate::reference::parse_image(&image).map_err(|e| format!("stickerImage: {e}"))?;
        Ok(Some(VolumeSticker {
            volume: volume.to_string(),
            path,
            image,
        }))
    }
}

/// A file's path inside a sticker volume: relative, 1-255 bytes, components of
/// `A-Z a-z 0-9 . _ -` that are not `.` or `..`.
pub fn valid_volume_path(path: &str) -> bool {
    (1..=255).contains(&path.len())
        && path.split('/').all(|c| {
            !c.is_empty()
                && c != "."
                && c != ".."
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        })
}

impl WriteStickerPayload {
    /// Its volume sticker, if `stickerLocation` is `volume`.
    pub fn volume(&self) -> Result<Option<VolumeSticker>, String> {
        let deployed = match (&self.image, &self.digest) {
            (Some(image), Some(digest)) => Some(format!("{image}@{digest}")),
            _ => None,
        };
        VolumeSticker::from_fields(
            &self.name,
            self.sticker_location,
            self.sticker_volume.as_deref(),
            self.sticker_path.as_deref(),
            self.sticker_image.as_deref(),
            deployed,
        )
    }
}

impl ReadStickerPayload {
    /// Its volume sticker, if `stickerLocation` is `volume`.
    pub fn volume(&self) -> Result<Option<VolumeSticker>, String> {
        VolumeSticker::from_fields(
            &self.name,
            self.sticker_location,
            self.sticker_volume.as_deref(),
            self.sticker_path.as_deref(),
            self.sticker_image.as_deref(),
            None,
        )
    }
}

/// `write-sticker`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WriteStickerPayload {
    pub name: String,
    /// `volume`: write the sticker into a named Docker volume (see [`VolumeSticker`]); absent
    /// or `file`: into the agent's sticker directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_location: Option<StickerLocation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_volume: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_path: Option<String>,
    /// The image the write's helper container is created from (never started); default
    /// `image@digest`, the deployed image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// `execute-command`: an argument vector, never a shell line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandPayload {
    /// Program (absolute path, on the agent's allow-list) and its arguments.
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_directory: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub environment: BTreeMap<String, String>,
}

/// `docker.run` and `compose.up`: seed 000's `DeployTaskPayload`.
///
/// `image` and `digest` are required by `docker.run` and unused by `compose.up`, whose images are
/// in the compose lock artifact.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeployTaskPayload {
    /// Repository, without tag or digest: `127.0.0.1:5000/web`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// `sha256:<64 hex>`; the only reference a deployment runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default)]
    pub config: DeployConfig,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<ArtifactReference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_digest: Option<String>,
    #[serde(default)]
    pub hooks: DeployHooks,
}

/// `rollback`: back to `targetDigest` (a redeploy of that digest with the rest of the payload),
/// or, without it, back to the newest `<containerName>-previous-<ts>` container.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RollbackTaskPayload {
    /// The container to roll back; `config.containerName` is used when this is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_digest: Option<String>,
    #[serde(flatten)]
    pub deploy: DeployTaskPayload,
}

/// Seed 000's `DeployConfig`; the docker fields and the compose fields share one object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeployConfig {
    // --- docker.run ---
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_name: Option<String>,
    /// Container environment variables.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub environment: BTreeMap<String, String>,
    /// Docker CLI syntax: `127.0.0.1:18080:8080/tcp`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
    /// Docker CLI syntax: `data:/data:ro` (named volume) or `/srv/x:/x` (bind mount).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
    /// `no`, `always`, `unless-stopped` (default), `on-failure` or `on-failure:N`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
    /// Bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<i64>,
    /// CPU quota in microseconds per 100 ms period (50000 = half a core).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_limit: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheckConfig>,
    /// Remove the previous container after a successful deployment (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleanup_previous: Option<bool>,
    /// `volume`: the sticker goes into a named Docker volume (see [`VolumeSticker`]; its image
    /// defaults to the deployed `image@digest`); absent or `file`: the agent's sticker directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_location: Option<StickerLocation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_volume: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticker_image: Option<String>,

    // --- compose.up ---
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_directory: Option<String>,
    /// `{service: "sha256:…"}`: every service of the lock, and nothing else.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expected_digests: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_name: Option<String>,
}

/// How a deployment proves it is healthy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheckConfig {
    #[serde(rename = "type")]
    pub kind: HealthCheckKind,
    /// `http`: the URL to GET; a 2xx answer is healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// `tcp`: where to connect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Seconds to wait for health in total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Seconds between checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthCheckKind {
    Http,
    Tcp,
    /// The image's own HEALTHCHECK, as the engine reports it.
    Docker,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeployHooks {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_deploy: Option<HookConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub post_deploy: Option<HookConfig>,
}

/// A command run on the agent's host around a deployment: an argument vector, never a shell line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HookConfig {
    pub command: Vec<String>,
    /// Seconds; the hook is killed when it runs longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
}

/// An artifact shipped inside the payload: `{"type": "compose_lock", "name": "compose.yml",
/// "content": "…"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactReference {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// The artifact type of a compose lock file.
pub const ARTIFACT_COMPOSE_LOCK: &str = "compose_lock";

/// The sealed credential that carries an SSH target's private key (OpenSSH or PKCS#8 PEM; Ed25519,
/// ECDSA or RSA) to the agent, for every task that reaches an SSH target.
pub const SSH_PRIVATE_KEY_CREDENTIAL: &str = "sshPrivateKey";

/// The credential that holds a registry bearer token for the image's registry (with
/// `registryServer`, the registry host): berth's short-lived pull token of a deployment task,
/// which the Docker engine gets as `X-Registry-Auth`'s `registrytoken`.
pub const REGISTRY_TOKEN_CREDENTIAL: &str = "registryToken";

/// `ssh.deploy` (seed 000's `SSHRemoteExecutor.deploy`): an agent deploys to a host that runs no
/// agent, over one SSH connection. The target's private key is not here: it arrives in the task's
/// sealed credentials (`sshPrivateKey`). Unknown fields are ignored, as in the other deployment
/// payloads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshDeployPayload {
    pub target: SshTarget,
    /// Absolute; created when missing. Its contents are backed up before anything changes and
    /// restored when the script or the health check fails.
    pub deploy_directory: String,
    /// Written into the deploy directory over SFTP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<SshArtifact>,
    /// The deploy script: an argument vector run on the target, in the deploy directory, under
    /// its timeout (e.g. `["./deploy.sh"]` for an executable artifact).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<HookConfig>,
    /// Run on the target, in the deploy directory, before and after the script.
    #[serde(default)]
    pub hooks: DeployHooks,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<SshHealthCheck>,
    /// Written as `.berth-sticker.json` into the deploy directory once the deployment is healthy.
    pub sticker: WriteStickerPayload,
}

/// Where `ssh.deploy` connects, and the host key it must find there. Unknown fields are refused:
/// a `privateKey` or `password` put here would be stored in the task row in plain text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SshTarget {
    pub host: String,
    /// Default 22.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    pub user: String,
    /// The pinned host key, an OpenSSH public key line (`ssh-ed25519 AAAA…`). Any other key is
    /// refused before authentication: unknown hosts are never trusted.
    pub host_key: String,
    /// Seconds for the TCP connect, key exchange and authentication together; default 15.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<u64>,
}

/// A file to write: shipped inside the payload (`content`), or by reference (`sha256`), fetched
/// by the agent from the server (`GET /api/v1/agents/{id}/artifacts/{sha256}`,
/// [`crate::agent::agent_artifact_path`]) and written only if its SHA-256 is that one. Exactly one
/// of the two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshArtifact {
    /// A plain file name ([`valid_file_name`]), written inside the deploy directory.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// 64 lowercase hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Mode 0755 instead of 0644.
    #[serde(default)]
    pub executable: bool,
}

impl SshArtifact {
    fn check(&self, field: &str) -> Result<(), String> {
        match (&self.content, &self.sha256) {
            (Some(_), None) => Ok(()),
            (None, Some(sha)) if crate::desired::valid_sha(sha) => Ok(()),
            (None, Some(sha)) => Err(format!(
                "{field}.sha256 {:?} is invalid: 64 lowercase hex digits",
                short(sha)
            )),
            _ => Err(format!("{field} needs exactly one of content and sha256")),
        }
    }
}

/// How `ssh.deploy` proves the deployment healthy: a probe from the agent, or a command on the
/// target that exits 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshHealthCheck {
    #[serde(rename = "type")]
    pub kind: SshHealthCheckKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// `command`: the argument vector run on the target, in the deploy directory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Seconds to wait for health in total; default 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Seconds between checks; default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SshHealthCheckKind {
    Http,
    Tcp,
    Command,
}

/// `readiness-probe`: what one host checks for an environment's readiness
/// (`crate::readiness`). Read-only: nothing on the host changes, and no secret value leaves it.
/// The result's `outputs` is a [`crate::readiness::ProbeReport`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReadinessProbePayload {
    /// Ask the Docker engine (a fresh connection, `GET /_ping`): the release runs containers.
    #[serde(default)]
    pub docker: bool,
    /// Registry hosts (`host[:port]`) whose `/v2/` must answer from this host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registries: Vec<String>,
    /// berth's containers of the current release on this host, by name: the `Healthy` check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<String>,
    /// The readiness pass this probe belongs to (makes each pass's probe a new task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass: Option<String>,
    /// The environment's OpenBao-backed secrets to resolve from this host (one host per pass).
    /// The deploy grant to log in with is the task's credential [`OPENBAO_LOGIN_JWT_CREDENTIAL`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<SecretsProbe>,
}

/// The task credential holding a deploy grant (a `lease` grant of seed 001, minted for this one
/// probe and expiring with it) that a `readiness-probe` logs in to OpenBao with.
pub const OPENBAO_LOGIN_JWT_CREDENTIAL: &str = "openbaoLoginJwt";

/// Where and how a probe resolves an environment's secrets at OpenBao: the login a desired-state
/// agent's apply makes (`POST /v1/auth/{authMount}/login` with the grant), then each manifest
/// entry read as its apply reads it (`{kvMount}/data/{env}/…`, the version when pinned). The
/// agent keeps only whether each one resolved; the values are dropped where they are read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretsProbe {
    /// OpenBao's address as the server's lease names it (the agent's `--openbao-addr` wins).
    pub addr: String,
    pub auth_mount: String,
    pub role: String,
    pub kv_mount: String,
    pub entries: Vec<SecretsProbeEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretsProbeEntry {
    /// The manifest's path (`crate::desired::SecretPath`).
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
}

/// At most this many secrets are resolved by one probe (a manifest's own limit is lower).
pub const MAX_PROBED_SECRETS: usize = 512;

/// A registry host as an image reference names it: letters, digits, `.`, `-`, `_`, `[`, `]`,
/// `:` (a port or an IPv6 address), 1-255 bytes.
pub fn valid_registry_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 255
        && host.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'[' | b']' | b':')
        })
}

impl CheckPayload for ReadinessProbePayload {
    fn check(&self) -> Result<(), String> {
        if self.registries.len() > 64 || self.containers.len() > 256 {
            return Err("at most 64 registries and 256 containers".into());
        }
        for host in &self.registries {
            check_field(
                "registries[]",
                Some(host),
                valid_registry_host,
                "a registry host[:port]",
            )?;
        }
        for name in &self.containers {
            check_field(
                "containers[]",
                Some(name),
                valid_container_name,
                CONTAINER_RULE,
            )?;
        }
        if let Some(secrets) = &self.secrets {
            if secrets.entries.len() > MAX_PROBED_SECRETS {
                return Err(format!("at most {MAX_PROBED_SECRETS} secrets"));
            }
            for entry in &secrets.entries {
                if crate::desired::SecretPath::parse(&entry.path).is_none() {
                    return Err(format!(
                        "secrets.entries[].path {:?} is not a secret path",
                        entry.path
                    ));
                }
            }
        }
        Ok(())
    }
}

/// One container carrying berth labels, as the agent's `inspect` task reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InspectedContainer {
    pub id: String,
    pub name: String,
    /// The image reference the container was created from (`repo@sha256:…`).
    pub image: String,
    /// `running`, `exited`, `restarting`, …
    pub state: String,
    /// `healthy`, `unhealthy`, `starting`, or absent when the image has no HEALTHCHECK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<String>,
    #[serde(default)]
    pub restart_count: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployed_at: Option<String>,
    /// Every `berth.*` label, and nothing else.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_directories() {
        for ok in ["a", "web-1.2_x", &"a".repeat(100)] {
            assert!(valid_container_name(ok), "{ok}");
            assert!(valid_sticker_name(ok), "{ok}");
        }
        for bad in ["", ".x", "-x", "../x", "a/b", "a b", &"a".repeat(101)] {
            assert!(!valid_container_name(bad), "{bad}");
        }
        for bad in ["", ".x", "../../tmp/pwn", "a/b", &"a".repeat(129)] {
            assert!(!valid_sticker_name(bad), "{bad}");
        }
        assert!(valid_project_name("app_1-x"));
        assert!(!valid_project_name("App") && !valid_project_name("../x"));
        for ok in ["/srv/app", "/srv/app/"] {
            assert!(valid_directory(ok), "{ok}");
        }
        for bad in [
            "",
            "/",
            "srv/app",
            "../../tmp/pwn",
            "/srv/../etc",
            "/srv/./x",
            "/srv//x",
            "/a\0",
        ] {
            assert!(!valid_directory(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_docker_run_sticker_may_go_into_a_volume() {
        use crate::kind::TaskKind;
        let digest = format!("sha256:{}", "b".repeat(64));
        let run = serde_json::json!({"image": "127.0.0.1:5000/web", "digest": digest,
            "config": {"containerName": "web", "stickerLocation": "volume", "stickerVolume": "stickers"}});
        assert_eq!(TaskKind::DockerRun.check_payload(&run), Ok(()));
        let p: DeployTaskPayload = serde_json::from_value(run.clone()).unwrap();
        let v = p.volume_sticker(p.digest.as_deref()).unwrap().unwrap();
        assert_eq!(
            (v.volume.as_str(), v.path.as_str()),
            ("stickers", "web.json")
        );
        assert_eq!(v.image, format!("127.0.0.1:5000/web@{digest}"));
        assert_eq!(
            TaskKind::DockerRun.read_back_volume(&run),
            Some(v.clone()),
            "the read-back reads where the deploy wrote"
        );
        let rollback = serde_json::json!({"containerName": "web", "targetDigest": digest,
            "image": "127.0.0.1:5000/web",
            "config": {"stickerLocation": "volume", "stickerVolume": "stickers"}});
        assert_eq!(TaskKind::Rollback.check_payload(&rollback), Ok(()));
        assert_eq!(TaskKind::Rollback.read_back_volume(&rollback), Some(v));
        for bad in [
            // No image to create the helper from.
            serde_json::json!({"config": {"containerName": "web", "stickerLocation": "volume", "stickerVolume": "s"}}),
            // compose.up has no container to name the sticker by.
            serde_json::json!({"config": {"projectName": "app", "stickerLocation": "volume", "stickerVolume": "s"}}),
            serde_json::json!({"image": "x/web", "digest": digest,
                "config": {"containerName": "web", "stickerVolume": "s"}}),
        ] {
            assert!(TaskKind::DockerRun.check_payload(&bad).is_err(), "{bad}");
        }
        assert_eq!(
            TaskKind::DockerRun
                .read_back_volume(&serde_json::json!({"config": {"containerName": "web"}})),
            None
        );
    }

    #[test]
    fn volume_stickers_name_a_volume_a_path_inside_it_and_an_image() {
        for ok in ["version.json", "berth/web.json", "a.b_c-d"] {
            assert!(valid_volume_path(ok), "{ok}");
        }
        for bad in [
            "", "/abs", "../x", "a/../b", "a//b", "a/", "./a", "a b", "a\0",
        ] {
            assert!(!valid_volume_path(bad), "{bad:?}");
        }
        let write = |v: serde_json::Value| -> Result<(), String> {
            serde_json::from_value::<WriteStickerPayload>(v)
                .map_err(|e| e.to_string())?
                .check()
        };
        let image = "127.0.0.1:5000/web";
        let digest = format!("sha256:{}", "a".repeat(64));
        write(
            serde_json::json!({"name": "web", "stickerLocation": "volume",
            "stickerVolume": "data", "image": image, "digest": digest}),
        )
        .unwrap();
        let p: WriteStickerPayload = serde_json::from_value(serde_json::json!({"name": "web",
            "stickerLocation": "volume", "stickerVolume": "data", "image": image, "digest": digest}))
        .unwrap();
        let v = p.volume().unwrap().unwrap();
        assert_eq!(v.path, "web.json");
        assert_eq!(v.image, format!("{image}@{digest}"));
        for bad in [
            serde_json::json!({"name": "web", "stickerLocation": "volume", "image": image, "digest": digest}),
            serde_json::json!({"name": "web", "stickerLocation": "volume", "stickerVolume": "data"}),
            serde_json::json!({"name": "web", "stickerLocation": "volume", "stickerVolume": "/etc",
                "image": image, "digest": digest}),
            serde_json::json!({"name": "web", "stickerLocation": "volume", "stickerVolume": "data",
                "stickerPath": "../../etc/passwd", "image": image, "digest": digest}),
            serde_json::json!({"name": "web", "stickerPath": "x.json"}),
            serde_json::json!({"name": "web", "stickerLocation": "disk"}),
        ] {
            assert!(write(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_the_design_example() {
        let json = r#"{"image": "127.0.0.1:5000/web", "digest": "sha256:abc", "previousDigest": null,
 "config": {"containerName": "web", "releaseId": "r", "releaseName": "web-1.4",
            "environment": {"K": "V"}, "ports": ["127.0.0.1:18080:8080/tcp"], "volumes": ["data:/data:ro"],
            "restartPolicy": "unless-stopped", "memoryLimit": 268435456, "cpuLimit": 50000,
            "healthCheck": {"type": "http", "url": "http://127.0.0.1:18080/", "timeout": 30, "interval": 1},
            "cleanupPrevious": true},
 "hooks": {"preDeploy": {"command": ["/usr/bin/true"], "timeout": 30}}}"#;
        let p: DeployTaskPayload = serde_json::from_str(json).unwrap();
        assert_eq!(p.config.container_name.as_deref(), Some("web"));
        assert_eq!(
            p.config.health_check.as_ref().unwrap().kind,
            HealthCheckKind::Http
        );
        assert_eq!(p.hooks.pre_deploy.unwrap().command, vec!["/usr/bin/true"]);
        assert_eq!(p.config.memory_limit, Some(268435456));
    }

    #[test]
    fn parses_compose_and_rollback_payloads() {
        let json = r#"{"artifacts": [{"type": "compose_lock", "name": "compose.yml", "content": "services: {}"}],
            "config": {"deploymentDirectory": "/srv/app", "expectedDigests": {"web": "sha256:1"},
                       "projectName": "app", "healthCheck": {"type": "docker", "timeout": 5}}}"#;
        let p: DeployTaskPayload = serde_json::from_str(json).unwrap();
        assert_eq!(p.artifacts[0].kind, ARTIFACT_COMPOSE_LOCK);
        assert_eq!(p.config.expected_digests["web"], "sha256:1");

        let r: RollbackTaskPayload = serde_json::from_str(
            r#"{"containerName": "web", "targetDigest": "sha256:2", "image": "x/web"}"#,
        )
        .unwrap();
        assert_eq!(r.container_name.as_deref(), Some("web"));
        assert_eq!(r.deploy.image.as_deref(), Some("x/web"));
    }

    #[test]
    fn ssh_deploy_payloads() {
        use crate::kind::TaskKind;
        let ok = serde_json::json!({
            "target": {"host": "10.0.0.5", "port": 2222, "user": "deploy",
                       "hostKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEurclYv comment"},
            "deployDirectory": "/srv/it's; $(x) `y`\nz",
            "artifacts": [{"name": "app v1; $(rm -rf ~) 'q'", "content": "x", "executable": true}],
            "script": {"command": ["./deploy.sh"], "timeout": 60},
            "hooks": {"preDeploy": {"command": ["true"]}},
            "healthCheck": {"type": "command", "command": ["test", "-f", "app"]},
            "sticker": {"name": "app", "releaseId": "r1"}});
        assert_eq!(TaskKind::SshDeploy.check_payload(&ok), Ok(()));
        let with = |pointer: &str, value: serde_json::Value| {
            let mut p = ok.clone();
            *p.pointer_mut(pointer).unwrap() = value;
            TaskKind::SshDeploy.check_payload(&p)
        };
        for (pointer, bad, field) in [
            (
                "/deployDirectory",
                serde_json::json!("srv/app"),
                "deployDirectory",
            ),
            (
                "/deployDirectory",
                serde_json::json!("/srv/../etc"),
                "deployDirectory",
            ),
            (
                "/artifacts/0/name",
                serde_json::json!("../x"),
                "artifacts[0].name",
            ),
            (
                "/artifacts/0/name",
                serde_json::json!(".."),
                "artifacts[0].name",
            ),
            (
                "/artifacts/0/name",
                serde_json::json!(".berth-backup"),
                "artifacts[0].name",
            ),
            (
                "/artifacts/0/name",
                serde_json::json!("a\u{0}b"),
                "artifacts[0].name",
            ),
            (
                "/target/hostKey",
                serde_json::json!("AAAA"),
                "target.hostKey",
            ),
            (
                "/target/hostKey",
                serde_json::json!("ssh-ed25519 AA;AA"),
                "target.hostKey",
            ),
            ("/target/host", serde_json::json!("a b"), "target.host"),
            ("/target/user", serde_json::json!(""), "target.user"),
            ("/sticker/name", serde_json::json!("../s"), "sticker.name"),
            ("/script/command", serde_json::json!([]), "script.command"),
            (
                "/healthCheck/command",
                serde_json::json!([]),
                "healthCheck.command",
            ),
        ] {
            let err = with(pointer, bad).unwrap_err();
            assert!(err.starts_with(field), "{pointer}: {err}");
        }
        assert!(with("/target/port", serde_json::json!(0)).is_err());
        // The private key is a credential, never a payload field.
        let mut leaky = ok.clone();
        leaky["target"]["privateKey"] = serde_json::json!("-----BEGIN OPENSSH PRIVATE KEY-----");
        assert!(TaskKind::SshDeploy.check_payload(&leaky).is_err());
        assert!(TaskKind::SshDeploy
            .check_payload(&serde_json::json!({"deployDirectory": "/srv/app"}))
            .is_err());
    }
}
