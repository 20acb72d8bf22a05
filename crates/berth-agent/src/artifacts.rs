//! Artifacts given by reference (`ssh.deploy`, `upload-files`): fetched from the server with the
//! agent's certificate, `GET /api/v1/agents/{id}/artifacts/{sha256}`, at most [`MAX_ARTIFACT_BYTES`]
//! each. The executor checks the bytes' SHA-256 before it writes them.

use berth_client::ClientError;
use berth_exec::{ArtifactSource, FetchError};
use berth_proto::agent::agent_artifact_path;
use berth_proto::error::codes;
use berth_proto::AgentId;

use crate::link::SharedLink;

/// The largest artifact an agent fetches.
pub(crate) const MAX_ARTIFACT_BYTES: u64 = 256 * 1024 * 1024;

/// The agent's server as an [`ArtifactSource`], through the link in use (so after a certificate
/// renewal the new certificate is presented).
pub(crate) struct ServerArtifacts {
    pub agent_id: AgentId,
    pub link: SharedLink,
}

#[async_trait::async_trait]
impl ArtifactSource for ServerArtifacts {
    async fn fetch(&self, sha256: &str) -> Result<Vec<u8>, FetchError> {
        fetch_capped(self, sha256, MAX_ARTIFACT_BYTES).await
    }
}

async fn fetch_capped(
    source: &ServerArtifacts,
    sha256: &str,
    limit: u64,
) -> Result<Vec<u8>, FetchError> {
    let client = source.link.current().client;
    let path = agent_artifact_path(source.agent_id, sha256);
    match client.get_bytes_capped(&path, limit).await {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Err(FetchError::Unavailable {
            detail: format!("larger than the agent's limit of {limit} bytes"),
            retriable: false,
        }),
        Err(e) => Err(classify(sha256, e)),
    }
}

/// Not found is final; the server or the network being down, a rate limit and a superseded
/// certificate heal with time (the task is retried); any other refusal does not.
fn classify(sha256: &str, e: ClientError) -> FetchError {
    let detail = e.to_string();
    match &e {
        ClientError::Api {
            status: 404, body, ..
        } if body.code == codes::ARTIFACT_NOT_FOUND => FetchError::NotFound(sha256.to_string()),
        ClientError::Api { status, body, .. } => FetchError::Unavailable {
            detail,
            retriable: *status >= 500
                || *status == 429
                || body.code == codes::CERTIFICATE_SUPERSEDED,
        },
        ClientError::Transport { .. } | ClientError::Connect { .. } | ClientError::Decode(_) => {
            FetchError::Unavailable {
                detail,
                retriable: true,
            }
        }
        ClientError::Config(_) => FetchError::Unavailable {
            detail,
            retriable: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Link;
    use berth_proto::ErrorBody;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A plain-HTTP stand-in for the server's artifact route (the TLS around it is the client's
    /// business, tested there): the artifact `blob` at its path, 404 `ARTIFACT_NOT_FOUND` else.
    async fn server(agent: AgentId, blob: Vec<u8>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let known = agent_artifact_path(agent, &berth_exec::artifact::sha256_hex(&blob));
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (known, blob) = (known.clone(), blob.clone());
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&request);
                    let path = line.split_whitespace().nth(1).unwrap_or_default();
                    let (status, kind, body) = if path == known {
                        ("200 OK", "application/octet-stream", blob)
                    } else {
                        let body = br#"{"code":"ARTIFACT_NOT_FOUND","detail":"no such artifact"}"#;
                        ("404 Not Found", "application/json", body.to_vec())
                    };
                    let head = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = conn.write_all(head.as_bytes()).await;
                    let _ = conn.write_all(&body).await;
                });
            }
        });
        url
    }

    #[tokio::test]
    async fn fetches_by_path_caps_the_size_and_tells_not_found() {
        let agent = AgentId(uuid::Uuid::new_v4());
        let blob: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let url = server(agent, blob.clone()).await;
        let client = crate::link::client(
            &url,
            berth_client::Trust::CaFingerprint(format!("sha256:{}", "0".repeat(64))),
            None,
        )
        .unwrap();
        let source = ServerArtifacts {
            agent_id: agent,
            link: SharedLink::new(Link {
                client,
                key: Arc::new(berth_crypto::AgentKey::generate().unwrap()),
                opener: Arc::new(berth_crypto::hpke::RecipientKey::generate().unwrap()),
                at: 0,
            }),
        };
        let sha = berth_exec::artifact::sha256_hex(&blob);
        assert_eq!(source.fetch(&sha).await.unwrap(), blob);
        let other = "b".repeat(64);
        assert!(matches!(source.fetch(&other).await, Err(FetchError::NotFound(s)) if s == other));
        match fetch_capped(&source, &sha, 99_999).await {
            Err(FetchError::Unavailable { retriable, .. }) => assert!(!retriable),
            other => panic!("{other:?}"),
        }
        assert_eq!(fetch_capped(&source, &sha, 100_000).await.unwrap(), blob);
    }

    fn api(status: u16, code: &str) -> ClientError {
        ClientError::Api {
            status,
            body: ErrorBody {
                code: code.into(),
                detail: "d".into(),
            },
            retry_after: None,
        }
    }

    #[test]
    fn not_found_is_final_and_outages_are_retriable() {
        let sha = "a".repeat(64);
        assert!(matches!(
            classify(&sha, api(404, codes::ARTIFACT_NOT_FOUND)),
            FetchError::NotFound(s) if s == sha
        ));
        for (status, code, retriable) in [
            (503, "INTERNAL", true),
            (429, "RATE_LIMITED", true),
            (401, codes::CERTIFICATE_SUPERSEDED, true),
            (403, "FORBIDDEN", false),
            // A 404 without the code is a server without the route: not the artifact's absence.
            (404, "NOT_FOUND", false),
        ] {
            match classify(&sha, api(status, code)) {
                FetchError::Unavailable { retriable: r, .. } => {
                    assert_eq!(r, retriable, "{status} {code}")
                }
                other => panic!("{status} {code}: {other:?}"),
            }
        }
    }
}
