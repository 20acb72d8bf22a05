//! The agent's state directory: its identity (key + certificate in one 0600 file, so a crash
//! can never pair a new key with an old certificate), the pinned CA, and what it registered as.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use berth_proto::AgentId;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::AgentError;

#[derive(Debug, Clone)]
pub struct StateDir(pub PathBuf);

/// `identity.json`: who this agent is and whom it trusts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityFile {
    pub agent_id: AgentId,
    pub name: String,
    pub server: String,
    pub ca_fingerprint: String,
    /// When the current certificate was issued (agent clock); renewal is due at 2/3 of its life.
    #[serde(with = "time::serde::rfc3339")]
    pub certificate_issued_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub certificate_expires_at: OffsetDateTime,
}

/// Everything needed to talk to the server as this agent.
#[derive(Debug, Clone)]
pub struct Identity {
    pub file: IdentityFile,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl StateDir {
    fn identity_path(&self) -> PathBuf {
        self.0.join("identity.json")
    }
    /// Private key followed by the certificate, PEM, mode 0600.
    fn credentials_path(&self) -> PathBuf {
        self.0.join("agent.pem")
    }
    fn ca_path(&self) -> PathBuf {
        self.0.join("ca.crt")
    }

    pub fn ensure(&self) -> Result<(), AgentError> {
        std::fs::create_dir_all(&self.0)
            .and_then(|_| std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| AgentError::Config(format!("state dir {}: {e}", self.0.display())))
    }

    pub fn is_registered(&self) -> bool {
        self.identity_path().exists()
    }

    pub fn load(&self) -> Result<Identity, AgentError> {
        let read = |p: PathBuf| {
            std::fs::read_to_string(&p).map_err(|e| {
                AgentError::Config(format!(
                    "{}: {e} (register first with --register --token … --ca-fingerprint …)",
                    p.display()
                ))
            })
        };
        let file: IdentityFile = serde_json::from_str(&read(self.identity_path())?)
            .map_err(|e| AgentError::Config(format!("identity.json is unreadable: {e}")))?;
        let credentials = read(self.credentials_path())?;
        let (key_pem, cert_pem) = split_credentials(&credentials).ok_or_else(|| {
            AgentError::Config("agent.pem must hold the private key then the certificate".into())
        })?;
        Ok(Identity {
            file,
            key_pem,
            cert_pem,
            ca_pem: read(self.ca_path())?,
        })
    }

    /// Stores a (new) identity. The credentials file is replaced atomically, then the identity
    /// file; both describe the same certificate at every instant a reader can observe.
    pub fn save(&self, identity: &Identity) -> Result<(), AgentError> {
        self.ensure()?;
        let credentials = format!(
            "{}\n{}\n",
            identity.key_pem.trim(),
            identity.cert_pem.trim()
        );
        write_atomic(&self.credentials_path(), credentials.as_bytes(), 0o600)?;
        write_atomic(&self.ca_path(), identity.ca_pem.as_bytes(), 0o644)?;
        let json = serde_json::to_vec_pretty(&identity.file)
            .map_err(|e| AgentError::Fatal(format!("encoding identity.json: {e}")))?;
        write_atomic(&self.identity_path(), &json, 0o600)
    }
}

fn split_credentials(pem: &str) -> Option<(String, String)> {
    let cert_start = pem.find("-----BEGIN CERTIFICATE-----")?;
    let key = pem[..cert_start].trim();
    if !key.contains("PRIVATE KEY-----") {
        return None;
    }
    Some((key.to_string(), pem[cert_start..].trim().to_string()))
}

fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), AgentError> {
    berth_fs::write_atomic(path, contents, mode)
        .map_err(|e| AgentError::Config(format!("writing {}: {e}", path.display())))
}
