//! Adding a host in one command (`crate::infra::install`): the CA the install line checks, the script
//! it runs, and the agent binaries the script downloads. None needs a credential: the CA and
//! the binaries are public, and the script holds no secret (the token stays in the line).

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;

use crate::infra::error::{ApiError, ApiResult};
use crate::infra::install;
use crate::SharedState;
use berth_proto::error::codes;
use berth_proto::ErrorBody;

/// The CA certificate (PEM). Fetched without trust by the install line, which uses it only if
/// its SHA-256 is the fingerprint written in the line.
#[utoipa::path(get, path = "/ca.crt", tag = "install", responses(
    (status = 200, description = "the CA certificate", content_type = "application/x-pem-file", body = String),
))]
pub async fn ca_certificate(State(state): State<SharedState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/x-pem-file")],
        state.ca.cert_pem().to_string(),
    )
}

/// The agent install script for this server: its URL and CA fingerprint and the sha256 of
/// every agent binary on offer are written into it.
#[utoipa::path(get, path = "/install.sh", tag = "install", responses(
    (status = 200, description = "a POSIX shell script", content_type = "text/x-shellscript", body = String),
))]
pub async fn script(State(state): State<SharedState>) -> ApiResult<impl IntoResponse> {
    let mut binaries = Vec::new();
    for (platform, file) in state.downloads.files() {
        let sha = state
            .downloads
            .sha256(&file)
            .await
            .map_err(|e| ApiError::internal(&e))?;
        binaries.push((platform, sha));
    }
    Ok((
        [(header::CONTENT_TYPE, "text/x-shellscript; charset=utf-8")],
        install::install_script(
            &state.config.public_url(),
            &state.ca.fingerprint(),
            &binaries,
        ),
    ))
}

/// The `berth-agent` binary for `platform` (`<os>-<arch>` as `uname` names them, e.g.
/// `linux-x86_64`), streamed.
#[utoipa::path(get, path = "/downloads/berth-agent/{platform}", tag = "install",
    params(("platform" = String, Path, description = "`linux-x86_64`, `linux-aarch64`, …")),
    responses(
        (status = 200, description = "the binary", content_type = "application/octet-stream"),
        (status = 404, description = "`NO_AGENT_DOWNLOAD`: none for that platform", body = ErrorBody),
    ))]
pub async fn agent_binary(
    State(state): State<SharedState>,
    Path(platform): Path<String>,
) -> ApiResult<impl IntoResponse> {
    let offered = || {
        let all: Vec<String> = state
            .downloads
            .files()
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        if all.is_empty() {
            "none (see --agent-downloads)".to_string()
        } else {
            all.join(", ")
        }
    };
    let file = install::is_platform(&platform)
        .then(|| state.downloads.file(&platform))
        .flatten()
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                codes::NO_AGENT_DOWNLOAD,
                format!(
                    "no berth-agent for {platform:?}; this server has: {}",
                    offered()
                ),
            )
        })?;
    let opened = tokio::fs::File::open(&file)
        .await
        .map_err(|e| ApiError::internal(&e))?;
    let len = opened
        .metadata()
        .await
        .map_err(|e| ApiError::internal(&e))?
        .len();
    let chunks = futures_util::stream::unfold(opened, |mut f| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 256 * 1024];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(buf), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(chunks),
    ))
}
