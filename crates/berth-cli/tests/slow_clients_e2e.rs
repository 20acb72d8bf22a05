//! Slow clients against the real `berth server` under a 1,024 open-files limit (soft and hard,
//! so the server cannot raise its way out): 1,000 TLS connections at a time that never finish a
//! request, while the admin CLI, an agent's task and a new agent's registration must still be
//! served, with no 5xx, and every slow connection must be closed by the server.
//!
//! Two attacks, one after the other, so both defences are exercised:
//! - from one source address (127.0.0.2): the per-source cap refuses all but its first few;
//! - from 1,000 distinct source addresses (127.0.1.1 …): more connections than the server has
//!   file descriptors for; only the read timeouts free them, and until then the server admits
//!   no more connections than its descriptor budget, so the store never runs out of files.
//!
//! Each slow connection completes the TLS handshake, then does one of: send nothing; send the
//! HTTP/2 preface and nothing more; send a request head one header line every 500 ms, never
//! ending it; send a complete head announcing a body, then stall partway through the body.

#![cfg(target_os = "linux")]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

const SLOW_CONNECTIONS: usize = 1000;
/// The server's open-files limit, soft and hard.
const NOFILE: libc::rlim_t = 1024;
/// Per-source cap and read timeouts for this server. The timeouts are long enough that the
/// slow connections are still held while the legitimate clients are checked.
const SERVER_ARGS: &[&str] = &[
    "--max-connections-per-source",
    "100",
    "--header-read-timeout-secs",
    "10",
    "--body-read-timeout-secs",
    "10",
];
/// Generous bound for one attack: every slow connection must have been closed by then.
const ATTACK: Duration = Duration::from_secs(180);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Silent,
    /// The HTTP/2 preface and an empty SETTINGS frame, then nothing.
    SilentH2,
    SlowHead,
    StalledBody,
}

#[derive(Debug)]
enum Outcome {
    /// The connection was closed before or during the TLS handshake.
    Refused,
    /// The server closed the connection after the handshake; what it sent before closing.
    Closed(Vec<u8>),
    /// Still open when the attack's bound ran out.
    StillOpen,
}

/// Raises this process's soft open-files limit to its hard limit: two attacks' worth of
/// connections plus the test's own files.
fn raise_own_nofile() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_cur >= 2 * SLOW_CONNECTIONS as libc::rlim_t + 256,
        "this test needs an open-files hard limit of at least {}; it is {}",
        2 * SLOW_CONNECTIONS + 256,
        lim.rlim_cur
    );
}

fn start_server(data_dir: &std::path::Path) -> Server {
    let mut cmd = command(BERTH);
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: NOFILE,
                rlim_max: NOFILE,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Server::start_command(cmd, data_dir, "127.0.0.1:0", SERVER_ARGS, None)
}

fn tls_connector(server: &Server) -> tokio_rustls::TlsConnector {
    let pem = std::fs::read(server.data_dir.join("ca.crt")).expect("reading ca.crt");
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
        roots.add(cert.expect("CA PEM")).expect("adding the CA");
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One slow connection from `source`; `resolved` counts connections whose handshake finished
/// or failed, so the test knows when the attack is in place.
async fn slow_client(
    kind: Kind,
    source: Ipv4Addr,
    server: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    resolved: Arc<AtomicUsize>,
    until: Instant,
) -> Outcome {
    let handshake = async {
        let socket = tokio::net::TcpSocket::new_v4().ok()?;
        socket.bind(SocketAddr::from((source, 0))).ok()?;
        let tcp = socket.connect(server).await.ok()?;
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        // A connection over the per-source cap is dropped before the server's handshake.
        tls.connect(name, tcp).await.ok()
    };
    let stream = tokio::time::timeout_at(until, handshake).await;
    resolved.fetch_add(1, Ordering::Relaxed);
    let mut stream = match stream {
        Ok(Some(stream)) => stream,
        Ok(None) => return Outcome::Refused,
        Err(_) => return Outcome::StillOpen,
    };
    let start: &[u8] = match kind {
        Kind::Silent => b"",
        Kind::SilentH2 => b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0",
        Kind::SlowHead => b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n",
        Kind::StalledBody => {
            b"POST /api/v1/agents/register HTTP/1.1\r\nHost: localhost\r\n\
              Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"name\": \"sl"
        }
    };
    let mut answer = Vec::new();
    if stream.write_all(start).await.is_err() || stream.flush().await.is_err() {
        return Outcome::Closed(answer);
    }
    let mut trickle = tokio::time::interval(Duration::from_millis(500));
    let mut buf = [0u8; 4096];
    loop {
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => return Outcome::Closed(answer),
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            },
            _ = trickle.tick(), if kind == Kind::SlowHead => {
                if stream.write_all(b"X-Slow: 1\r\n").await.is_err() || stream.flush().await.is_err() {
                    return Outcome::Closed(answer);
                }
            }
            _ = tokio::time::sleep_until(until) => return Outcome::StillOpen,
        }
    }
}

struct Attack {
    resolved: Arc<AtomicUsize>,
    clients: Vec<(Kind, tokio::task::JoinHandle<Outcome>)>,
}

fn launch(
    rt: &tokio::runtime::Runtime,
    server: &Server,
    sources: impl Fn(usize) -> Ipv4Addr,
) -> Attack {
    let addr: SocketAddr = server
        .url
        .strip_prefix("https://")
        .unwrap()
        .parse()
        .unwrap();
    let tls = tls_connector(server);
    let resolved = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + ATTACK;
    let kinds = [
        Kind::Silent,
        Kind::SilentH2,
        Kind::SlowHead,
        Kind::StalledBody,
    ];
    let clients = (0..SLOW_CONNECTIONS)
        .map(|i| {
            let kind = kinds[i % kinds.len()];
            let client = slow_client(kind, sources(i), addr, tls.clone(), resolved.clone(), until);
            (kind, rt.spawn(client))
        })
        .collect();
    Attack { resolved, clients }
}

impl Attack {
    /// Waits until at least `n` slow connections are held or refused.
    fn wait_resolved(&self, n: usize) {
        wait_for(SETTLE, &format!("{n} slow connections in place"), || {
            let resolved = self.resolved.load(Ordering::Relaxed);
            if resolved >= n {
                Ok(())
            } else {
                Err(format!("{resolved} resolved"))
            }
        });
    }

    /// Waits for every slow connection to end; returns (held, refused). Panics if any is still
    /// open, if the server answered any with a 5xx, or if a stalled body was not refused.
    fn finish(self, rt: &tokio::runtime::Runtime) -> (usize, usize) {
        let (mut held, mut refused, mut open) = (0, 0, 0);
        for (kind, client) in self.clients {
            match rt.block_on(client).expect("slow client task") {
                Outcome::Refused => refused += 1,
                Outcome::StillOpen => open += 1,
                Outcome::Closed(answer) => {
                    held += 1;
                    let answer = String::from_utf8_lossy(&answer);
                    assert!(
                        !answer.starts_with("HTTP/1.1 5"),
                        "a slow connection was answered with a 5xx: {answer}"
                    );
                    // The body timeout refuses the request; hyper's own head timeout and the
                    // idle close answer nothing.
                    if kind == Kind::StalledBody {
                        assert!(
                            answer.starts_with("HTTP/1.1 400")
                                && answer.contains("INVALID_REQUEST"),
                            "a stalled body got: {answer}"
                        );
                    }
                }
            }
        }
        assert_eq!(
            open, 0,
            "{open} slow connections were never closed by the server ({held} closed, {refused} refused)"
        );
        (held, refused)
    }
}

/// What a legitimate operator and fleet do while an attack is in place; every step panics on a
/// failure, a 5xx included (the CLI exits non-zero on any error answer).
fn legit_traffic(server: &Server, agent: &Agent, root: &std::path::Path, new_agent: &str) {
    let agents = server.cli(&["agents", "list"]);
    assert!(agents.as_array().is_some_and(|a| !a.is_empty()), "{agents}");
    let task = server.create_task(
        &agent.id,
        "write-sticker",
        &json!({"name": new_agent}),
        Some(30),
    );
    server.wait_task_state(&id_of(&task), SETTLE, "succeeded");
    let mut newcomer = Agent::register(server, root, new_agent, &[]);
    newcomer.proc.assert_running();
}

/// Every SQLite connection of the server has its write-ahead log open from the start, so no
/// request ever needs a new file descriptor for the store. (Waits: the connection that ran the
/// migrations may still be closing.)
fn assert_store_files_open(pid: libc::pid_t) {
    wait_for(
        SETTLE,
        "a WAL file open for every database connection",
        || {
            let links: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map_err(|e| e.to_string())?
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|p| p.display().to_string())
                .collect();
            let count = |suffix: &str| links.iter().filter(|l| l.ends_with(suffix)).count();
            let (db, wal) = (count("/berth.db"), count("/berth.db-wal"));
            if db > 0 && wal == db {
                Ok(())
            } else {
                Err(format!(
                    "{db} open berth.db, {wal} open berth.db-wal: {links:?}"
                ))
            }
        },
    );
}

#[test]
fn slow_clients_cannot_starve_new_clients_or_cause_5xx() {
    raise_own_nofile();
    let dir = tempdir();
    let data_dir = dir.path().join("server");
    let mut server = start_server(&data_dir);
    assert_store_files_open(server.proc.pid());
    let agent = Agent::register(&server, dir.path(), "steady", &[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // One noisy source: the per-source cap (100) refuses the rest at once.
    let attack = launch(&rt, &server, |_| Ipv4Addr::new(127, 0, 0, 2));
    attack.wait_resolved(SLOW_CONNECTIONS * 3 / 4);
    legit_traffic(&server, &agent, dir.path(), "newcomer-1");
    let (held, refused) = attack.finish(&rt);
    eprintln!("one source: {held} held and closed by the server, {refused} refused");
    assert!(
        held <= 100 && refused >= SLOW_CONNECTIONS - 100,
        "one source held {held} connections ({refused} refused); the cap is 100"
    );

    // A thousand sources: more connections than the server has file descriptors for.
    let attack = launch(&rt, &server, |i| {
        Ipv4Addr::new(127, 0, 1 + (i / 250) as u8, 1 + (i % 250) as u8)
    });
    attack.wait_resolved(SLOW_CONNECTIONS * 3 / 4);
    legit_traffic(&server, &agent, dir.path(), "newcomer-2");
    let (held, refused) = attack.finish(&rt);
    eprintln!("distinct sources: {held} held and closed by the server, {refused} refused");
    assert!(held > 0, "no slow connection was ever held");

    server.proc.assert_running();
    let log = server.proc.stderr();
    for bad in ["request failed", "unable to open", "Too many open files"] {
        assert!(!log.contains(bad), "server log shows {bad:?}:\n{log}");
    }
    assert!(
        log.contains("open files limit"),
        "the server logs its open-files limit:\n{log}"
    );
}
