//! `ssh.deploy` of a 10 MB artifact plus a trivial deploy script, against the same by hand
//! (`scp` of both files, then `ssh … ./deploy.sh`), side by side in one run, alternating, against
//! the sshd of `scripts/sshd.sh`. Run by `scripts/bench/ssh-deploy.sh`, which builds it in release
//! mode and passes the `BERTH_TEST_SSH_*` variables.
//!
//! berth runs the executor as the agent does once it holds the assignment (one connection: pin
//! check, auth, backup, SFTP upload, script, sticker, backup removal); the server's hand-over is
//! the task transport's business and is measured by `berth-bench tasks`. The deploy directories
//! already hold the previous run's files from the second run on, so berth's backup copies 10 MB
//! every time, as it would in production.
//!
//! Usage: ssh_bench [N]   (default 7)

use std::process::Command;
use std::time::Instant;

use berth_exec::{Executor, SshExecutor};
use berth_proto::payload::SSH_PRIVATE_KEY_CREDENTIAL;
use berth_test_utils::docker::task;
use serde_json::json;

const SIZE: usize = 10 * 1024 * 1024;
const SCRIPT: &str = "#!/bin/sh\nset -e\ntest -s app.bin\n";

fn median(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[v.len() / 2]
}

fn row(label: &str, v: &[u64]) {
    println!(
        "{label:44} {:8} {:7} {:7}",
        median(v),
        v.iter().min().unwrap(),
        v.iter().max().unwrap()
    );
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("N"))
        .unwrap_or(7);
    let env = berth_test_utils::ssh::env("ssh_bench").expect("run scripts/sshd.sh first");
    let key_file = std::env::var("BERTH_TEST_SSH_KEY").unwrap();
    let root = env.tempdir();
    let local = tempfile::tempdir().unwrap();
    let (berth_dir, manual_dir) = (root.path().join("berth"), root.path().join("manual"));
    // A directory the user owns, for scp to copy into.
    std::fs::create_dir(&manual_dir).unwrap();
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(root.path()).unwrap());
    berth_test_utils::ssh::chown(&manual_dir, owner, owner);

    // 10 MB of text (inline artifacts are strings): a xorshift stream over 64 characters.
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let content: String = (0..SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            alphabet[(x % 64) as usize] as char
        })
        .collect();
    std::fs::write(local.path().join("app.bin"), &content).unwrap();
    std::fs::write(local.path().join("deploy.sh"), SCRIPT).unwrap();
    std::fs::set_permissions(
        local.path().join("deploy.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let known_hosts = local.path().join("known_hosts");
    std::fs::write(
        &known_hosts,
        format!("[{}]:{} {}\n", env.host, env.port, env.host_key),
    )
    .unwrap();
    let ssh_opts = [
        "-o".to_string(),
        "BatchMode=yes".to_string(),
        "-o".to_string(),
        "StrictHostKeyChecking=yes".to_string(),
        "-o".to_string(),
        format!("UserKnownHostsFile={}", known_hosts.display()),
        "-i".to_string(),
        key_file.clone(),
    ];

    let payload = json!({
        "target": env.target(),
        "deployDirectory": berth_dir.display().to_string(),
        "artifacts": [{"name": "app.bin", "content": content},
                      {"name": "deploy.sh", "content": SCRIPT, "executable": true}],
        "script": {"command": ["./deploy.sh"], "timeout": 60},
        "sticker": {"name": "bench"}
    });
    let (mut berth, mut upload, mut deploy, mut manual) = (vec![], vec![], vec![], vec![]);
    let mut t = task("ssh.deploy", payload);
    t.credentials.insert(
        SSH_PRIVATE_KEY_CREDENTIAL.into(),
        env.private_key.trim().to_string(),
    );
    for i in 0..n {
        for side in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            let started = Instant::now();
            if side == 0 {
                let o = SshExecutor::default().execute(&t).await;
                assert!(o.success, "{}: {}", o.message, o.logs);
                berth.push(started.elapsed().as_millis() as u64);
                upload.push(o.metrics.upload_duration_ms.unwrap());
                deploy.push(o.metrics.deploy_duration_ms.unwrap());
            } else {
                let dest = format!("{}@{}:{}/", env.user, env.host, manual_dir.display());
                let scp = Command::new("scp")
                    .arg("-q")
                    .args(&ssh_opts)
                    .args(["-P", &env.port.to_string()])
                    .arg(local.path().join("app.bin"))
                    .arg(local.path().join("deploy.sh"))
                    .arg(&dest)
                    .status()
                    .unwrap();
                assert!(scp.success(), "scp failed");
                let run = Command::new("ssh")
                    .args(&ssh_opts)
                    .args(["-p", &env.port.to_string()])
                    .arg(format!("{}@{}", env.user, env.host))
                    .arg(format!("cd {} && ./deploy.sh", manual_dir.display()))
                    .status()
                    .unwrap();
                assert!(run.success(), "ssh ./deploy.sh failed");
                manual.push(started.elapsed().as_millis() as u64);
            }
        }
    }
    let rest: Vec<u64> = (0..n).map(|i| berth[i] - upload[i] - deploy[i]).collect();
    println!("runs: {n} each, alternating; artifact {SIZE} bytes + a 3-line script");
    println!("{:44} {:>8} {:>7} {:>7}  (ms)", "", "median", "min", "max");
    row("by hand: scp (2 files) + ssh ./deploy.sh", &manual);
    row("berth ssh.deploy (executor, wall)", &berth);
    row("  of which uploadDurationMs (SFTP)", &upload);
    row("  of which deployDurationMs (script)", &deploy);
    row("  of which the rest (connect, backup, sticker)", &rest);
}
