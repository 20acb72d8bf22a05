//! Partitions between an agent and the server, with real processes: the agent runs in a network
//! namespace of its own (`common::netns`), the server listens on the host end of its veth link,
//! and the test cuts the link while a task runs and heals it after the task's lease has expired.
//!
//! What must hold (issue 9, item 11): no task runs twice, a side effect whose result was lost is
//! resolved by read-back, and the agent process rides out the partition and takes new work after
//! the heal on its own, in the same session.
//!
//! The work the agent does is counted where it happens: HTTP probes by a server the test runs
//! inside the agent's namespace (it holds each answer until told, so the cut lands while the task
//! runs), containers by the Docker engine's own events.

#![cfg(unix)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use berth_test_utils::docker::{self as fixtures, container_id, make_image, Cleanup, Variant};
use common::netns::Netns;
use common::*;
use serde_json::{json, Value};

/// How long a task may take to reach a state that needs only the agent and the sweeper, or a
/// deployment to finish, on a loaded 2-core host.
const TASK: Duration = Duration::from_secs(120);
/// How long the agent may take to get through again after the heal: its requests sent into the
/// cut link finish on TCP's retransmission back-off, or time out (30 s) and are retried.
const RECOVER: Duration = Duration::from_secs(180);

// ---------------------------------------------------------------------------------------------
// An HTTP server in the agent's namespace that holds its answers
// ---------------------------------------------------------------------------------------------

/// Answers every `GET` with 200, but only once released; counts the requests it received.
struct HeldHttp {
    port: u16,
    requests: Arc<AtomicUsize>,
    released: Arc<(Mutex<bool>, Condvar)>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl HeldHttp {
    fn start(listener: TcpListener) -> HeldHttp {
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let released = Arc::new((Mutex::new(false), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let (requests, released, stop) = (requests.clone(), released.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            let (requests, released) = (requests.clone(), released.clone());
                            std::thread::spawn(move || answer(conn, &requests, &released));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })
        };
        HeldHttp {
            port,
            requests,
            released,
            stop,
            acceptor: Some(acceptor),
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    fn wait_requests(&self, n: usize) {
        wait_for(
            TASK,
            &format!("{n} request(s) to the held server"),
            || match self.requests() {
                got if got >= n => Ok(()),
                got => Err(format!("{got} so far")),
            },
        );
    }

    /// Answers the held requests, and every later one at once.
    fn release(&self) {
        let (open, changed) = &*self.released;
        *open.lock().unwrap() = true;
        changed.notify_all();
    }
}

impl Drop for HeldHttp {
    fn drop(&mut self) {
        self.release();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn answer(mut conn: TcpStream, requests: &AtomicUsize, released: &(Mutex<bool>, Condvar)) {
    conn.set_nonblocking(false).unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    requests.fetch_add(1, Ordering::SeqCst);
    let (open, changed) = released;
    drop(
        changed
            .wait_while(open.lock().unwrap(), |open| !*open)
            .unwrap(),
    );
    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
}

// ---------------------------------------------------------------------------------------------
// A server on the host end, an agent in the namespace
// ---------------------------------------------------------------------------------------------

/// Short leases (1 s heartbeats: the session lapses after 3 s; 1 s of grace after a task's
/// timeout) so the partition outlives both quickly. The certificate names the host end.
fn start_server(data_dir: &std::path::Path, ns: &Netns) -> Server {
    let host = ns.host_ip.to_string();
    Server::start_at(
        data_dir,
        &format!("{host}:0"),
        &[
            "--heartbeat-interval-secs",
            "1",
            "--lease-grace-secs",
            "1",
            "--hostname",
            &host,
        ],
        None,
    )
}

/// Registers `name` from inside the namespace and waits for its first heartbeat. `docker`: the
/// agent talks to the host's engine (its unix socket does not care about network namespaces);
/// otherwise it is pointed at none, like the harness's agents.
fn spawn_agent(
    server: &Server,
    root: &std::path::Path,
    name: &str,
    ns: &Netns,
    docker: bool,
) -> Agent {
    let agent = Agent::spawn_registered(server, root, name, &[], |state_dir, args| {
        let mut cmd = ns.command(BERTH_AGENT);
        cmd.arg("--state-dir").arg(state_dir).args(args);
        if !docker {
            cmd.env("DOCKER_HOST", "unix:///nonexistent/berth-e2e/docker.sock");
        }
        cmd
    });
    server.wait_agent(&agent.id, "the agent up with a heartbeat", |a| {
        matches!(a["status"].as_str(), Some("online" | "degraded"))
            && a["lastHeartbeat"].is_string()
    });
    agent
}

/// The one session generation the agent process acquired (it must never take another: that
/// would mean it restarted or lost its session).
fn only_generation(agent: &Proc) -> i64 {
    let generations = acquired_generations(&agent.stderr());
    assert_eq!(
        generations.len(),
        1,
        "sessions: {generations:?}\n{}",
        agent.stderr()
    );
    generations[0]
}

/// After the heal: the same process is back online in the same session, and runs a new task.
fn assert_resumed(
    server: &Server,
    agent: &mut Agent,
    generation: i64,
    task_type: &str,
    payload: &Value,
) {
    server.wait_agent(&agent.id, "the agent back with a heartbeat", |a| {
        matches!(a["status"].as_str(), Some("online" | "degraded"))
    });
    let next = id_of(&server.create_task(&agent.id, task_type, payload, Some(60)));
    let done = server.wait_task_state(&next, RECOVER, "succeeded");
    assert_eq!(attempts(&done).len(), 1, "{done}");
    assert_eq!(attempts(&done)[0]["generation"], generation, "{done}");
    agent.proc.assert_running();
    assert_eq!(only_generation(&agent.proc), generation);
}

// ---------------------------------------------------------------------------------------------
// 1. a read-only task: requeued after the lost delivery, answered from the journal
// ---------------------------------------------------------------------------------------------

/// A `health-check` probes the held server in the agent's namespace; the link is cut while the
/// probe waits for its answer, and only then is it answered, so the result exists only on the
/// agent's side of the cut. The lease (8 s + 1 s) expires: the task is requeued (read-only), and
/// a redelivery may be lost in the cut too. The link stays cut until the agent's request for the
/// result has timed out. After the heal the late result is refused (FENCED) and a redelivery is
/// answered from the journal: the probe ran once.
#[test]
fn read_only_task_cut_mid_run_runs_once_and_the_agent_resumes() {
    const TEST: &str = "read_only_task_cut_mid_run_runs_once_and_the_agent_resumes";
    let Some(ns) = Netns::create(TEST) else {
        return;
    };
    let tmp = tempdir();
    let server = start_server(&tmp.path().join("data"), &ns);
    let mut agent = spawn_agent(&server, tmp.path(), "cut-probe", &ns, false);
    let generation = only_generation(&agent.proc);
    let target = HeldHttp::start(ns.listen_loopback());
    let probe = json!({
        "type": "http",
        "url": format!("http://127.0.0.1:{}/", target.port),
        "timeout": 6,
    });

    let id = id_of(&server.create_task(&agent.id, "health-check", &probe, Some(8)));
    target.wait_requests(1);
    ns.cut();
    target.release();

    let requeued = server.wait_task(&id, TASK, "the cut-off delivery expired", |t| {
        t["attempts"][0]["state"] == "expired"
    });
    assert_eq!(requeued["readBack"], false, "{requeued}");
    server.wait_agent(&agent.id, "the cut-off agent offline", |a| {
        a["status"] == "offline"
    });
    // The cut lasts until the result's request has timed out on the agent (30 s) and is being
    // retried: the agent rides out failed requests, not only slow ones.
    wait_for(RECOVER, "the agent to retry its result", || {
        let log = agent.proc.stderr();
        if log
            .lines()
            .any(|l| l.contains(&id) && l.contains("result failed; retrying"))
        {
            Ok(())
        } else {
            Err(log)
        }
    });
    agent.proc.assert_running();
    ns.heal();

    let done = server.wait_task_state(&id, RECOVER, "succeeded");
    assert_eq!(done["readBack"], false, "{done}");
    let tries = attempts(&done);
    assert!(tries.len() >= 2, "{done}");
    assert_eq!(tries[0]["state"], "expired", "{done}");
    assert_eq!(tries[tries.len() - 1]["state"], "succeeded", "{done}");
    assert!(
        tries.iter().all(|t| t["generation"] == generation),
        "{done}"
    );
    assert_eq!(target.requests(), 1, "the probe ran again");
    wait_fenced_in_log(&mut agent.proc, &id);
    assert!(
        agent
            .proc
            .stderr()
            .lines()
            .any(|l| l.contains(&id) && l.contains("answering from the journal")),
        "{}",
        agent.proc.stderr()
    );

    assert_resumed(&server, &mut agent, generation, "health-check", &probe);
    assert_eq!(target.requests(), 2, "the new task's probe");
}

// ---------------------------------------------------------------------------------------------
// 2. docker.run: `unknown` after the lost delivery, proven by read-back, deployed once
// ---------------------------------------------------------------------------------------------

/// Containers named `name` the engine created since `since` (unix seconds).
fn creations(name: &str, since: u64) -> usize {
    let until = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1;
    let (ok, out) = fixtures::docker(&[
        "events",
        "--since",
        &since.to_string(),
        "--until",
        &until.to_string(),
        "--filter",
        "type=container",
        "--filter",
        "event=create",
        "--filter",
        &format!("container={name}"),
        "--format",
        "{{.ID}}",
    ]);
    assert!(ok, "docker events: {out}");
    out.lines().filter(|l| !l.trim().is_empty()).count()
}

/// The deployment's health check probes the held server (in the agent's namespace): when it
/// arrives, the container has been created and started. The link is cut, then the check is
/// answered, so the deployment completes (sticker written) with its result stuck on the agent's
/// side. The lease (20 s + 1 s) expires: `unknown`, never re-run. After the heal the read-back
/// finds the sticker naming the task: `succeeded` by read-back, one container, created once.
#[test]
fn docker_run_cut_mid_deploy_is_read_back_and_deployed_once() {
    const TEST: &str = "docker_run_cut_mid_deploy_is_read_back_and_deployed_once";
    let Some(env) = fixtures::env(TEST) else {
        return;
    };
    let Some(ns) = Netns::create(TEST) else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let tmp = tempdir();
    let server = start_server(&tmp.path().join("data"), &ns);
    let mut agent = spawn_agent(&server, tmp.path(), "cut-deployer", &ns, true);
    let generation = only_generation(&agent.proc);
    let image = make_image(
        &env.registry,
        &cleanup.prefix,
        "web",
        Variant::Healthy,
        "v1",
        None,
    );
    let name = format!("{}-web", cleanup.prefix);
    let health = HeldHttp::start(ns.listen_loopback());
    // One probe every 5 s, each allowed 5 s: the held answer is released well within that.
    let check = json!({
        "type": "http",
        "url": format!("http://127.0.0.1:{}/", health.port),
        "timeout": 60,
        "interval": 5,
    });
    let payload = image.deploy(&name, free_port(), check);
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();

    let id = id_of(&server.create_task(&agent.id, "docker.run", &payload, Some(20)));
    health.wait_requests(1);
    let created = container_id(&name).expect("the container exists while its health is checked");
    ns.cut();
    health.release();

    // The deployment finishes on the agent's side of the cut.
    let sticker_path = agent.sticker_dir.join(format!("{name}.json"));
    let sticker: Value = wait_for(TASK, "the sticker", || {
        let text = std::fs::read_to_string(&sticker_path).map_err(|e| e.to_string())?;
        serde_json::from_str(&text).map_err(|e| e.to_string())
    });
    assert_eq!(sticker["taskId"], id.as_str(), "{sticker}");
    let unknown = server.wait_task_state(&id, TASK, "unknown");
    assert_eq!(attempts(&unknown).len(), 1, "{unknown}");
    assert_eq!(attempts(&unknown)[0]["state"], "expired", "{unknown}");
    server.wait_agent(&agent.id, "the cut-off agent offline", |a| {
        a["status"] == "offline"
    });
    agent.proc.assert_running();
    ns.heal();

    let done = wait_proven_by_read_back(&server, &id, RECOVER);
    assert_eq!(
        done["result"]["sticker"]["digest"],
        image.digest.as_str(),
        "{done}"
    );
    wait_fenced_in_log(&mut agent.proc, &id);
    // Deployed once: the container created before the cut is the one running, and the engine
    // created no other.
    assert_eq!(container_id(&name), Some(created));
    let (_, running) = fixtures::docker(&["inspect", "--format", "{{.State.Running}}", &name]);
    assert_eq!(running.trim(), "true");
    assert_eq!(creations(&name, since), 1, "containers created for {name}");

    assert_resumed(&server, &mut agent, generation, "inspect", &json!({}));
}
