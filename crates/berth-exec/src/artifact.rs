//! Files a task writes (`ssh.deploy`'s artifacts, `upload-files`' files): shipped inline, or by
//! reference, fetched through an [`ArtifactSource`] (the agent's: its server) and checked against
//! their SHA-256 before anything is written. Every file of a task is resolved before the first
//! one is written, so a missing or altered artifact changes nothing.

use std::sync::Arc;

use berth_proto::payload::SshArtifact;
use sha2::{Digest, Sha256};

use crate::error::ExecError;
use crate::run::Stop;

/// Why an artifact could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The source has no artifact with that SHA-256; fetching again will not help.
    #[error("no artifact with SHA-256 {0}")]
    NotFound(String),
    /// The source could not answer (unreachable, overloaded: `retriable`), or refused
    /// (too large, forbidden: not retriable).
    #[error("{detail}")]
    Unavailable { detail: String, retriable: bool },
}

/// Where artifacts given by reference come from.
#[async_trait::async_trait]
pub trait ArtifactSource: Send + Sync {
    /// The bytes stored under `sha256` (64 lowercase hex digits). The caller checks that they
    /// hash to it.
    async fn fetch(&self, sha256: &str) -> Result<Vec<u8>, FetchError>;
}

/// One file ready to write.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub name: String,
    pub bytes: Vec<u8>,
    /// 0755 when the payload says `executable`, else 0644.
    pub mode: u32,
    /// Lowercase hex of the bytes' SHA-256.
    pub sha256: String,
}

impl Resolved {
    /// `{"name", "size", "sha256"}`, as the outputs report a written file.
    pub fn output(&self) -> serde_json::Value {
        serde_json::json!({"name": self.name, "size": self.bytes.len(), "sha256": self.sha256})
    }
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Every file's bytes: the inline content, or the referenced artifact once its SHA-256 is checked
/// (`ARTIFACT_DIGEST_MISMATCH` otherwise). Nothing is written here; the caller writes only after
/// all of them resolved.
pub(crate) async fn resolve(
    files: &[SshArtifact],
    source: Option<&Arc<dyn ArtifactSource>>,
    stop: &Stop,
) -> Result<Vec<Resolved>, ExecError> {
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let mode = if f.executable { 0o755 } else { 0o644 };
        let (bytes, sha256) = match (&f.content, &f.sha256) {
            (Some(content), _) => (content.clone().into_bytes(), sha256_hex(content.as_bytes())),
            (None, Some(wanted)) => {
                let source = source.ok_or_else(|| ExecError::ArtifactUnavailable {
                    detail: format!(
                        "{:?} is given by reference, and this executor has no artifact source",
                        f.name
                    ),
                    retriable: false,
                })?;
                let bytes = stop
                    .guard(async {
                        source.fetch(wanted).await.map_err(|e| match e {
                            FetchError::NotFound(_) => ExecError::ArtifactNotFound(format!(
                                "{:?}: the server has no artifact with SHA-256 {wanted}",
                                f.name
                            )),
                            FetchError::Unavailable { detail, retriable } => {
                                ExecError::ArtifactUnavailable {
                                    detail: format!(
                                        "{:?}: fetching artifact {wanted} failed: {detail}",
                                        f.name
                                    ),
                                    retriable,
                                }
                            }
                        })
                    })
                    .await?;
                let got = sha256_hex(&bytes);
                if &got != wanted {
                    return Err(ExecError::ArtifactDigestMismatch(format!(
                        "{:?}: the fetched bytes hash to {got}, not {wanted}; nothing was written",
                        f.name
                    )));
                }
                (bytes, got)
            }
            (None, None) => {
                return Err(ExecError::InvalidPayload(format!(
                    "{:?} needs content or sha256",
                    f.name
                )))
            }
        };
        out.push(Resolved {
            name: f.name.clone(),
            sha256,
            bytes,
            mode,
        });
    }
    Ok(out)
}
