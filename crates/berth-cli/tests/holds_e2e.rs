//! Issue 14 end to end, with a real `berth server` and a real `berth-agent`: the agent's probe
//! listener (`--probe-listen`: `/readyz` follows the session, `/healthz` the process), cordon,
//! suspend and drain through the CLI, and the per-agent queue cap (`--max-open-tasks-per-agent`).

#![cfg(unix)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// `GET path` on the probe listener: the status and the JSON body, or why not.
fn probe(port: u16, path: &str) -> Result<(u16, Value), String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| e.to_string())?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line: {response:?}"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .ok_or_else(|| format!("no body: {response:?}"))?;
    let body = serde_json::from_str(body).map_err(|e| format!("{e}: {body:?}"))?;
    Ok((status, body))
}

fn wait_probe(port: u16, path: &str, what: &str, check: impl Fn(u16, &Value) -> bool) -> Value {
    wait_for(SETTLE, what, || {
        let (status, body) = probe(port, path)?;
        if check(status, &body) {
            Ok(body)
        } else {
            Err(format!("{status} {body}"))
        }
    })
}

#[test]
fn readyz_follows_the_session() {
    let root = tempdir();
    let data = root.path().join("server");
    let mut server = Server::start(&data, &["--heartbeat-interval-secs", "1"]);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let agent = Agent::register(&server, root.path(), "probed", &["--probe-listen", &listen]);

    wait_probe(port, "/readyz", "readyz 200 with a session", |s, b| {
        s == 200 && b["ready"] == true
    });
    let (status, body) = probe(port, "/healthz").expect("healthz");
    assert_eq!((status, &body["ready"]), (200, &json!(true)));

    // The server goes away: no heartbeat renews the session, which lapses after three
    // intervals; the process is alive all the while.
    let address = server.url.trim_start_matches("https://").to_string();
    server.proc.terminate();
    let body = wait_probe(
        port,
        "/readyz",
        "readyz 503 once the session lapsed",
        |s, _| s == 503,
    );
    assert_eq!(body["ready"], false);
    assert!(
        body["reason"]
            .as_str()
            .unwrap_or("")
            .contains("session lapsed"),
        "{body}"
    );
    let (status, _) = probe(port, "/healthz").expect("healthz while the server is away");
    assert_eq!(status, 200);

    // Back on the same address: the agent's next heartbeat renews the same session.
    let server = Server::start_at(&data, &address, &["--heartbeat-interval-secs", "1"], None);
    wait_probe(port, "/readyz", "readyz 200 again", |s, _| s == 200);

    // The agent loses its session for good (deleted): never ready again.
    server.cli(&["agents", "rm", &agent.id]);
    wait_for(SETTLE, "readyz to stop answering 200", || {
        match probe(port, "/readyz") {
            Ok((200, body)) => Err(format!("still ready: {body}")),
            Ok(_) | Err(_) => Ok(()),
        }
    });
}

/// `berth task create` for the agent; the error text when refused.
fn try_create(server: &Server, agent: &str) -> Result<Value, String> {
    server.try_cli(&[
        "task",
        "create",
        "--agent",
        agent,
        "--type",
        "inspect",
        "--payload",
        "{}",
    ])
}

#[test]
fn cordon_suspend_drain_and_the_queue_cap() {
    let root = tempdir();
    let data = root.path().join("server");
    let server = Server::start(
        &data,
        &[
            "--heartbeat-interval-secs",
            "1",
            "--max-open-tasks-per-agent",
            "3",
        ],
    );
    let agent = Agent::register(&server, root.path(), "held", &["--labels", "role=held"]);
    let id = agent.id.as_str();

    // Cordon: a task aimed at it is refused with its code, a selector finds nobody.
    let cordoned = server.cli(&["agents", "cordon", id]);
    assert_eq!(cordoned["cordoned"], true, "{cordoned}");
    let refused = try_create(&server, id).expect_err("a cordoned agent gets no new task");
    assert!(refused.contains("AGENT_CORDONED"), "{refused}");
    let by_label = server
        .try_cli(&[
            "task",
            "create",
            "--selector",
            "role=held",
            "--type",
            "inspect",
            "--payload",
            "{}",
        ])
        .expect_err("no selector picks a cordoned agent");
    assert!(by_label.contains("NO_MATCHING_AGENT"), "{by_label}");
    let listed = server.cli(&["agents", "ls"]);
    assert_eq!(listed[0]["cordoned"], true, "{listed}");
    server.cli(&["agents", "uncordon", id]);

    // Suspend: blocked, claims nothing, yet heartbeats go on (its session is kept).
    let suspended = server.cli(&["agents", "suspend", id]);
    assert_eq!(suspended["status"], "blocked", "{suspended}");
    let waiting = str_of(&try_create(&server, id).expect("create"), "id").to_string();
    let before = str_of(&suspended, "lastHeartbeat").to_string();
    server.wait_agent(id, "a heartbeat while suspended", |a| {
        a["lastHeartbeat"].as_str().is_some_and(|h| h != before) && a["status"] == "blocked"
    });
    assert_eq!(server.task(&waiting)["state"], "pending");

    // The queue cap: 3 open tasks at most (the pending one counts).
    try_create(&server, id).expect("second");
    try_create(&server, id).expect("third");
    let full = try_create(&server, id).expect_err("the fourth is over the cap");
    assert!(full.contains("QUEUE_FULL"), "{full}");

    // Drain: cordons, then waits while the suspended agent's queue stands still; resuming lets
    // the queue run out and the drain end.
    let mut cmd = command(BERTH);
    cmd.args(["agents", "drain", id, "--timeout", "120"])
        .env("BERTH_SERVER", &server.url)
        .env("BERTH_TOKEN", &server.admin_token)
        .env("BERTH_CA_FILE", data.join("ca.crt"));
    let mut drain = Proc::spawn("berth agents drain", cmd);
    server.wait_agent(id, "the drain's cordon", |a| a["cordoned"] == true);
    drain.assert_running();
    server.cli(&["agents", "resume", id]);
    let out = drain.finish(EXIT);
    assert!(out.status.success(), "drain: {}", out.stderr);
    assert!(out.stdout.contains("3 pending"), "{}", out.stdout);
    assert!(out.stdout.contains("drained"), "{}", out.stdout);
    assert_eq!(server.task(&waiting)["state"], "succeeded");
    let refused = try_create(&server, id).expect_err("a drained agent stays cordoned");
    assert!(refused.contains("AGENT_CORDONED"), "{refused}");
}

/// An executor the agent offered that stops answering makes it unready while it still holds
/// its session: here a Docker socket that accepts connections and never answers, then none.
#[test]
fn readyz_names_an_unhealthy_executor() {
    let root = tempdir();
    let server = Server::start(
        &root.path().join("server"),
        &["--heartbeat-interval-secs", "1"],
    );
    let socket = root.path().join("docker.sock");
    let silent = std::os::unix::net::UnixListener::bind(&socket).expect("bind the socket");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let docker_host = format!("unix://{}", socket.display());
    let agent = Agent::spawn_registered(
        &server,
        root.path(),
        "dockerless",
        &["--probe-listen", &listen],
        |state_dir, args| {
            let mut cmd = agent_command(state_dir, args);
            cmd.env("DOCKER_HOST", &docker_host);
            cmd
        },
    );
    server.wait_agent(&agent.id, "a heartbeat naming docker unhealthy", |a| {
        a["status"] == "degraded" && a["lastHeartbeat"].is_string()
    });
    let body = wait_probe(port, "/readyz", "readyz 503 naming docker", |s, _| s == 503);
    let reason = body["reason"].as_str().unwrap_or("");
    assert!(reason.contains("executor docker is unhealthy"), "{body}");
    let (status, _) = probe(port, "/healthz").expect("healthz");
    assert_eq!(status, 200);

    drop(silent);
    std::fs::remove_file(&socket).expect("remove the socket");
    let body = wait_probe(port, "/readyz", "readyz naming docker gone", |s, b| {
        s == 503
            && b["reason"]
                .as_str()
                .is_some_and(|r| r.contains("docker is gone"))
    });
    assert_eq!(body["ready"], false);
}
