//! A WebSocket to the server (the agent's task stream), on its own TLS connection: the client's
//! requests may share one HTTP/2 connection, which cannot carry an HTTP/1.1 `Upgrade`, so the
//! socket is a separate HTTP/1.1 connection with the same trust and client identity.
//!
//! A refused upgrade comes back as the server's `{code, detail}` ([`ClientError::Api`]), so the
//! caller decides about it exactly as about a refused request.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use berth_proto::ErrorBody;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::WebSocketStream;

use crate::{fallback_code, Client, ClientError};

/// An open WebSocket to the server.
pub type WebSocket = WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>;

/// The connection and the upgrade together must finish within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The server's messages are assignments: far below this.
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

impl Client {
    /// Opens a WebSocket at `path` with extra request headers (`X-Berth-Generation`), on the
    /// server that answered last and, when it cannot be reached or answers 5xx, on each next
    /// one in turn ([`Client::with_fallbacks`]; the upgrade is a GET, safe to repeat).
    pub async fn websocket(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<WebSocket, ClientError> {
        let first = self.current.load(Ordering::Relaxed);
        let count = self.servers.len();
        let mut tried = 0;
        loop {
            let at = (first + tried) % count;
            tried += 1;
            let server = &self.servers[at];
            let opened =
                tokio::time::timeout(CONNECT_TIMEOUT, self.open_websocket(server, path, headers))
                    .await
                    .unwrap_or_else(|_| {
                        Err(connect_error(server, std::io::ErrorKind::TimedOut.into()))
                    });
            match opened {
                Err(ClientError::Connect { .. }) if tried < count => continue,
                Err(ClientError::Api { status, .. }) if tried < count && status >= 500 => continue,
                Ok(socket) => {
                    if count > 1 {
                        self.current.store(at, Ordering::Relaxed);
                    }
                    return Ok(socket);
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn open_websocket(
        &self,
        server: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<WebSocket, ClientError> {
        let url = reqwest::Url::parse(server)
            .map_err(|e| ClientError::Config(format!("server URL: {e}")))?;
        let port = url.port_or_known_default().unwrap_or(443);
        let host = url
            .host_str()
            .ok_or_else(|| ClientError::Config("the server URL has no host".into()))?;
        // An IPv6 literal comes in brackets.
        let address = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let name = match address.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(ServerName::from(ip)),
            Err(_) => ServerName::try_from(address.clone()),
        };
        let name = name.map_err(|e| ClientError::Config(format!("server name: {e}")))?;
        let tcp = TcpStream::connect((address.as_str(), port))
            .await
            .map_err(|e| connect_error(server, e))?;
        let _ = tcp.set_nodelay(true);
        let tls = tokio_rustls::TlsConnector::from(self.stream_tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| connect_error(server, e))?;
        let mut request = format!("wss://{}{path}", url.authority())
            .into_client_request()
            .map_err(|e| ClientError::Config(format!("websocket request: {e}")))?;
        for (header, value) in headers {
            let value = HeaderValue::from_str(value)
                .map_err(|e| ClientError::Config(format!("header {header}: {e}")))?;
            let header =
                tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(header.as_bytes())
                    .map_err(|e| ClientError::Config(format!("header name: {e}")))?;
            request.headers_mut().insert(header, value);
        }
        let config = WebSocketConfig::default().max_message_size(Some(MAX_MESSAGE_BYTES));
        match tokio_tungstenite::client_async_with_config(request, tls, Some(config)).await {
            Ok((socket, _)) => Ok(socket),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                let text = response.body().as_deref().unwrap_or_default();
                let body =
                    serde_json::from_slice::<ErrorBody>(text).unwrap_or_else(|_| ErrorBody {
                        code: fallback_code(response.status()).to_string(),
                        detail: String::from_utf8_lossy(text).chars().take(512).collect(),
                    });
                Err(ClientError::Api {
                    status,
                    body,
                    retry_after,
                })
            }
            Err(e) => Err(connect_error(server, std::io::Error::other(e))),
        }
    }
}

fn connect_error(server: &str, source: std::io::Error) -> ClientError {
    ClientError::Connect {
        server: server.to_string(),
        source,
    }
}

/// The rustls configuration of a WebSocket connection: the client's, offering only HTTP/1.1.
pub(crate) fn stream_tls(mut config: rustls::ClientConfig) -> Arc<rustls::ClientConfig> {
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}
