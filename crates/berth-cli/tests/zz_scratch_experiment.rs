#![cfg(unix)]
mod common;
use common::*;
use std::os::unix::fs::PermissionsExt;
#[test]
fn scratch() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let mut original = Agent::register(&server, tmp.path(), "twin", &[]);
    let copy = tmp.path().join("twin-copy");
    std::fs::create_dir(&copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o700)).unwrap();
    for file in ["identity.json", "agent.pem", "ca.crt"] {
        std::fs::copy(original.state_dir.join(file), copy.join(file)).unwrap();
    }
    original.proc.signal(libc::SIGSTOP);
    server.wait_agent(&original.id, "offline", |a| a["status"] == "offline");
    let mut clone = Agent::restart(&server.url, &copy, &tmp.path().join("s"), "clone", &[]);
    let _ = wait_for(SETTLE, "gen", || {
        acquired_generations(&clone.stderr())
            .last()
            .copied()
            .ok_or_else(|| clone.stderr())
    });
    original.proc.signal(libc::SIGCONT);
    let t = std::time::Instant::now();
    let code = original.proc.wait_code(EXIT);
    println!(
        "ORIGINAL EXIT {code} after {:?}\n{}",
        t.elapsed(),
        original.proc.stderr()
    );
    clone.assert_running();
}
