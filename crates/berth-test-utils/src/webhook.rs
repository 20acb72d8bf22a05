//! A webhook receiver on loopback for the notification tests: plain HTTP/1.1, one request per
//! connection, each path playing one behaviour. It records every delivery it read (path,
//! idempotency key, whether the signature verified, body), so a test counts deliveries per key.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a path answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// `200` every time.
    Ok,
    /// `500` to the first `n` requests, then `200`.
    FailThenOk(usize),
    /// Reads the first request of each idempotency key and never answers it (holds the
    /// connection open); answers `200` to any later request with that key.
    HangOnce,
    /// `404` every time.
    NotFound,
}

#[derive(Debug, Clone)]
pub struct Delivery {
    pub path: String,
    pub idempotency_key: String,
    /// `X-Berth-Signature` is HMAC-SHA256(secret, timestamp "." body) under the path's secret.
    pub signature_ok: bool,
    pub body: serde_json::Value,
}

#[derive(Default)]
struct Shared {
    deliveries: Vec<Delivery>,
    /// Connections held open by `HangOnce`, dropped with the receiver.
    held: Vec<TcpStream>,
}

pub struct Receiver {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Serves `routes` (path → behaviour, and the secret its signatures must verify with).
    pub async fn start(routes: &[(&str, Behaviour, &str)]) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind receiver");
        let addr = listener.local_addr().expect("receiver addr");
        let routes: Arc<HashMap<String, (Behaviour, String)>> = Arc::new(
            routes
                .iter()
                .map(|(p, b, s)| (p.to_string(), (*b, s.to_string())))
                .collect(),
        );
        let shared = Arc::new(Mutex::new(Shared::default()));
        let task = {
            let shared = shared.clone();
            tokio::spawn(async move {
                while let Ok((socket, _)) = listener.accept().await {
                    let (shared, routes) = (shared.clone(), routes.clone());
                    tokio::spawn(async move {
                        let _ = serve(socket, &shared, &routes).await;
                    });
                }
            })
        };
        Receiver { addr, shared, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.shared.lock().unwrap().deliveries.clone()
    }

    /// Deliveries to `path`, counted by idempotency key.
    pub fn counts(&self, path: &str) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for d in self.deliveries().into_iter().filter(|d| d.path == path) {
            *counts.entry(d.idempotency_key).or_default() += 1;
        }
        counts
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    mut socket: TcpStream,
    shared: &Mutex<Shared>,
    routes: &HashMap<String, (Behaviour, String)>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let path = head.split(' ').nth(1).unwrap_or_default().to_string();
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let length: usize = header("content-length").parse().unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let Some((behaviour, secret)) = routes.get(&path) else {
        return respond(&mut socket, 404).await;
    };
    let key = header("idempotency-key");
    let mut signed = format!("{}.", header("x-berth-timestamp")).into_bytes();
    signed.extend_from_slice(&body);
    let expected = format!(
        "sha256={}",
        hex_encode(&berth_crypto::hmac_sha256(secret.as_bytes(), &signed))
    );
    let status = {
        let mut shared = shared.lock().unwrap();
        let earlier = shared.deliveries.iter().filter(|d| d.path == path).count();
        let earlier_of_key = shared
            .deliveries
            .iter()
            .filter(|d| d.path == path && d.idempotency_key == key)
            .count();
        shared.deliveries.push(Delivery {
            path: path.clone(),
            idempotency_key: key,
            signature_ok: header("x-berth-signature") == expected,
            body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        });
        match behaviour {
            Behaviour::Ok => Some(200),
            Behaviour::FailThenOk(n) if earlier < *n => Some(500),
            Behaviour::FailThenOk(_) => Some(200),
            Behaviour::HangOnce if earlier_of_key == 0 => None,
            Behaviour::HangOnce => Some(200),
            Behaviour::NotFound => Some(404),
        }
    };
    match status {
        Some(status) => respond(&mut socket, status).await,
        None => {
            shared.lock().unwrap().held.push(socket);
            Ok(())
        }
    }
}

async fn respond(socket: &mut TcpStream, status: u16) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Internal Server Error",
    };
    socket
        .write_all(
            format!("HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    socket.shutdown().await
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
