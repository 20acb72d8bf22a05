//! Health probes run from the agent's host: an HTTP GET that must answer 2xx, or a TCP connect.
//! Used by the `health-check` task and by the docker/compose executors while they wait for a
//! deployment to become healthy. Plain HTTP only: a deployment's own health endpoint on loopback
//! needs no TLS, and a TLS stack here would drag a second crypto provider into the agent.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A parsed `http://host[:port]/path` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTarget {
    /// Host as written, without brackets for IPv6.
    pub host: String,
    pub port: u16,
    /// `Host` header value.
    pub authority: String,
    /// Path and query, starting with `/`.
    pub path: String,
}

/// Parses an `http://` URL; anything else (https, userinfo, fragments) is refused.
pub fn parse_http_url(url: &str) -> Result<HttpTarget, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("health check URL {url:?} must start with http://"))?;
    if url.chars().any(|c| c.is_ascii_control() || c == ' ') {
        return Err(format!(
            "health check URL {url:?} contains spaces or control characters"
        ));
    }
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest[i..].starts_with('/') => (&rest[..i], rest[i..].to_string()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_string()),
    };
    if authority.contains('@') || path.contains('#') {
        return Err(format!(
            "health check URL {url:?} must not carry credentials or a fragment"
        ));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("health check URL {url:?} has an unclosed IPv6 address"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(format!("health check URL {url:?} has a malformed host")),
        };
        (host.to_string(), port)
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(format!("health check URL {url:?} has no host"));
    }
    let port = match port {
        None => 80,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("health check URL {url:?} has an invalid port"))?,
    };
    Ok(HttpTarget {
        host,
        port,
        authority: authority.to_string(),
        path,
    })
}

/// One HTTP GET of `url` (`http://` only); `Ok(status)` when the server answered 2xx.
pub async fn http(url: &str, timeout: Duration) -> Result<u16, String> {
    let target = parse_http_url(url)?;
    http_get(&target, timeout).await
}

/// One HTTP GET of a parsed URL; `Ok(status)` when the server answered 2xx.
pub async fn http_get(target: &HttpTarget, timeout: Duration) -> Result<u16, String> {
    let attempt = async {
        let mut stream = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|e| format!("connect {}: {e}", target.authority))?;
        let request = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: berth-agent\r\nAccept: */*\r\nConnection: close\r\n\r\n",
            target.path, target.authority
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        // The status line is all we need; read until its end (or a little more).
        let mut head = Vec::with_capacity(256);
        let mut buf = [0u8; 256];
        while !head.windows(2).any(|w| w == b"\r\n") && head.len() < 4096 {
            let n = stream
                .read(&mut buf)
                .await
                .map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        let line = String::from_utf8_lossy(&head);
        let line = line.lines().next().unwrap_or_default().to_string();
        let status = line
            .strip_prefix("HTTP/1.")
            .and_then(|r| r.get(2..5))
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("not an HTTP answer: {line:?}"))?;
        if (200..300).contains(&status) {
            Ok(status)
        } else {
            Err(format!("HTTP {status}"))
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {}s", timeout.as_secs_f32())))
}

/// One TCP connect.
pub async fn tcp_connect(host: &str, port: u16, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, TcpStream::connect((host, port))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("connect {host}:{port}: {e}")),
        Err(_) => Err(format!(
            "connect {host}:{port}: no answer within {}s",
            timeout.as_secs_f32()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_http_urls_and_refuses_others() {
        let t = parse_http_url("http://127.0.0.1:18080/health?x=1").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("127.0.0.1", 18080, "/health?x=1")
        );
        let t = parse_http_url("http://[::1]:81").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.path.as_str()), ("::1", 81, "/"));
        let t = parse_http_url("http://localhost?q").unwrap();
        assert_eq!((t.port, t.path.as_str()), (80, "/?q"));
        for bad in [
            "https://x/",
            "ftp://x",
            "http://",
            "http://u:p@x/",
            "http://x:0/",
            "http://x:99999/",
            "http://x/a b",
            "http://x/\r\nHost: y",
        ] {
            assert!(parse_http_url(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn http_get_wants_2xx() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            for status in ["200 OK", "503 Service Unavailable"] {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes())
                    .await;
            }
        });
        let target = parse_http_url(&format!("http://127.0.0.1:{port}/")).unwrap();
        assert_eq!(http_get(&target, Duration::from_secs(5)).await, Ok(200));
        let url = format!("http://127.0.0.1:{port}/");
        assert_eq!(
            http(&url, Duration::from_secs(5)).await,
            Err("HTTP 503".to_string())
        );
    }

    #[tokio::test]
    async fn tcp_connect_fails_when_nothing_listens() {
        // Bound but never listening: connecting is refused, and no other test can take the port
        // while this socket holds it.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = socket.local_addr().unwrap().port();
        assert!(tcp_connect("127.0.0.1", port, Duration::from_secs(5))
            .await
            .is_err());
    }
}
