//! Issue 16 item 4: `berth backup` and `berth restore` through the real binaries.
//!
//! SQLite: a server under steady task creation is backed up while it runs; the backup restores
//! into a new data dir, the restored server holds every task acknowledged before the backup
//! began, and the agent reconnects to it with its identity (no new registration). A wrong
//! passphrase or a non-empty data dir restores nothing; an age X25519 recipient works as a
//! passphrase does. PostgreSQL: the backup holds the key material, `pg_dump`/`pg_restore` the
//! database, and the two together make a server the agent reconnects to.

#![cfg(unix)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use age::secrecy::ExposeSecret;
use berth_proto::task::CreateTask;
use berth_proto::TaskId;
use berth_test_utils::postgres::{self, TestDatabase};
use common::*;
use serde_json::{json, Value};

/// `berth <args> -o json`: the exit code, stdout parsed (Null when it is not JSON), stderr.
fn berth(args: &[&str]) -> (i32, Value, String) {
    berth_with(args, &[])
}

fn berth_with(args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
    let out = command(BERTH)
        .envs(env.iter().copied())
        .args(args)
        .args(["--output", "json"])
        .output()
        .expect("running berth");
    (
        out.status.code().expect("berth exited"),
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Creates `write-sticker` tasks for `agent` back to back until `stop`; each acknowledged id
/// with when its create returned.
/// Each acknowledged task with when its create returned.
type Acked = Arc<Mutex<Vec<(TaskId, Instant)>>>;

fn steady_load(
    server: &Server,
    agent: &str,
    stop: Arc<AtomicBool>,
) -> (std::thread::JoinHandle<()>, Acked) {
    let api = server.api();
    let agent = berth_proto::AgentId::from_str(agent).unwrap();
    let acked = Arc::new(Mutex::new(Vec::new()));
    let log = acked.clone();
    let thread = std::thread::spawn(move || {
        block_on(async {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let created = api
                    .send(&CreateTask {
                        task_type: "write-sticker".into(),
                        agent_id: Some(agent),
                        payload: json!({ "name": format!("load-{n}") }),
                        timeout_seconds: Some(5),
                        ..Default::default()
                    })
                    .await
                    .expect("creating a task");
                log.lock().unwrap().push((created.id, Instant::now()));
            }
        })
    });
    (thread, acked)
}

#[test]
fn a_live_sqlite_server_backs_up_and_restores_with_nothing_acknowledged_lost() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    let mut server = Server::start(&data, &["--heartbeat-interval-secs", "1"]);
    let mut agent = Agent::register(&server, tmp.path(), "backed-up", &[]);
    let passphrase = tmp.path().join("passphrase");
    std::fs::write(&passphrase, "correct horse battery staple\n").unwrap();
    let pass = passphrase.display().to_string();
    let data_arg = data.display().to_string();

    let stop = Arc::new(AtomicBool::new(false));
    let (load, acked) = steady_load(&server, &agent.id, stop.clone());
    wait_for(Duration::from_secs(60), "50 tasks acknowledged", || {
        let n = acked.lock().unwrap().len();
        if n >= 50 {
            Ok(())
        } else {
            Err(format!("{n}"))
        }
    });
    let backup = tmp.path().join("berth.backup");
    let backup_arg = backup.display().to_string();
    let began = Instant::now();
    let (code, report, stderr) = berth(&[
        "backup",
        &backup_arg,
        "--data-dir",
        &data_arg,
        "--passphrase-file",
        &pass,
    ]);
    assert_eq!(code, 0, "{stderr}");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    load.join().unwrap();
    assert_eq!(report["database"], "sqlite", "{report}");
    assert_eq!(mode(&backup), 0o600);
    let before: Vec<TaskId> = acked
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, at)| *at < began)
        .map(|(id, _)| *id)
        .collect();
    let total = acked.lock().unwrap().len();
    assert!(
        total > before.len(),
        "no task was created while the backup ran ({total})"
    );
    let bytes = std::fs::read(&backup).unwrap();
    assert!(bytes.starts_with(b"age-encryption.org/v1"));
    let key = std::fs::read(data.join("ca.key")).unwrap();
    assert!(
        !bytes.windows(64).any(|w| w == &key[..64]),
        "the CA key is in the backup in the clear"
    );

    // What restores nothing.
    let wrong = tmp.path().join("wrong");
    std::fs::write(&wrong, "incorrect horse\n").unwrap();
    let nowhere = tmp.path().join("nowhere");
    let (code, _, stderr) = berth(&[
        "restore",
        &backup_arg,
        "--data-dir",
        nowhere.to_str().unwrap(),
        "--passphrase-file",
        wrong.to_str().unwrap(),
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("cannot open the backup"), "{stderr}");
    assert!(!nowhere.exists());
    let (code, _, stderr) = berth(&[
        "restore",
        &backup_arg,
        "--data-dir",
        &data_arg,
        "--passphrase-file",
        &pass,
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("is not empty"), "{stderr}");

    let restored = tmp.path().join("restored");
    let (code, report, stderr) = berth(&[
        "restore",
        &backup_arg,
        "--data-dir",
        restored.to_str().unwrap(),
        "--passphrase-file",
        &pass,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(report["database"], "sqlite", "{report}");
    assert_eq!(mode(&restored), 0o700);
    assert_eq!(mode(&restored.join("ca.key")), 0o600);
    assert_eq!(mode(&restored.join("master.key")), 0o600);
    assert_eq!(mode(&restored.join("ca.crt")), 0o644);

    // The restored server, elsewhere: the old one and its agent process gone.
    agent.proc.terminate();
    server.proc.terminate();
    let server = Server::start(
        &restored,
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"],
    );
    let missing: Vec<String> = before
        .iter()
        .map(|id| id.to_string())
        .filter(|id| server.try_task(id).is_err())
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged tasks are not in the restored server: {missing:?}",
        missing.len(),
        before.len()
    );
    let mut moved = Agent::restart(
        &server.url,
        &agent.state_dir,
        &agent.sticker_dir,
        "backed-up",
        &[],
    );
    server.wait_agent(&agent.id, "the agent back, on the restored server", |a| {
        a["status"] == "online"
    });
    let task = server.create_task(&agent.id, "write-sticker", &json!({"name": "after"}), None);
    server.wait_task_state(&id_of(&task), Duration::from_secs(60), "succeeded");
    assert!(
        !moved.stderr().contains("registered as"),
        "{}",
        moved.stderr()
    );
    assert_eq!(moved.terminate(), 0);
    println!(
        "backup: {} of {total} acknowledged tasks were acknowledged before it began; all restored",
        before.len()
    );
}

#[test]
fn a_backup_to_an_age_recipient_restores_with_its_identity_only() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    let server = Server::start(&data, &[]);
    drop(server);
    let identity = age::x25519::Identity::generate();
    let recipient = identity.to_public().to_string();
    let identity_file = tmp.path().join("key.txt");
    std::fs::write(
        &identity_file,
        format!("# a comment\n{}\n", identity.to_string().expose_secret()),
    )
    .unwrap();
    let backup = tmp.path().join("b.age");
    // The database named as the server also takes it, with the `sqlite://` prefix.
    let database = format!("sqlite://{}", data.join("berth.db").display());
    let (code, _, stderr) = berth(&[
        "backup",
        backup.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
        "--database",
        &database,
        "--recipient",
        &recipient,
    ]);
    assert_eq!(code, 0, "{stderr}");

    let other = tmp.path().join("other.txt");
    std::fs::write(
        &other,
        age::x25519::Identity::generate()
            .to_string()
            .expose_secret()
            .as_bytes(),
    )
    .unwrap();
    let restored = tmp.path().join("restored");
    let restore = |identity: &Path| {
        berth(&[
            "restore",
            backup.to_str().unwrap(),
            "--data-dir",
            restored.to_str().unwrap(),
            "--identity",
            identity.to_str().unwrap(),
        ])
    };
    let (code, _, stderr) = restore(&other);
    assert_ne!(code, 0, "another identity opened it");
    assert!(stderr.contains("cannot open the backup"), "{stderr}");
    let (code, _, stderr) = restore(&identity_file);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        std::fs::read(restored.join("ca.key")).unwrap(),
        std::fs::read(data.join("ca.key")).unwrap()
    );
    Server::start(&restored, &[]).cli(&["agents", "list"]);
}

#[test]
fn on_postgres_the_key_material_and_pg_dump_restore_a_server_agents_reconnect_to() {
    let Some(admin_url) = postgres::admin_url(
        "on_postgres_the_key_material_and_pg_dump_restore_a_server_agents_reconnect_to",
    ) else {
        return;
    };
    let original = TestDatabase::create(&admin_url);
    let copy = TestDatabase::create(&admin_url);
    let tmp = tempdir();
    let data = tmp.path().join("data");
    let mut server = Server::start(
        &data,
        &[
            "--heartbeat-interval-secs",
            "1",
            "--database",
            &original.url,
        ],
    );
    let mut agent = Agent::register(&server, tmp.path(), "on-pg", &[]);
    let task = server.create_task(&agent.id, "write-sticker", &json!({"name": "pg"}), None);
    let task = id_of(&task);
    server.wait_task_state(&task, Duration::from_secs(60), "succeeded");

    let passphrase = [("BERTH_BACKUP_PASSPHRASE", "pg passphrase")];
    let keys = tmp.path().join("keys.backup");
    let (code, report, stderr) = berth_with(
        &[
            "backup",
            keys.to_str().unwrap(),
            "--data-dir",
            data.to_str().unwrap(),
            "--database",
            &original.url,
        ],
        &passphrase,
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(report["database"], "none", "{report}");
    let dump = tmp.path().join("berth.pgdump");
    let ran = std::process::Command::new("pg_dump")
        .args(["--format=custom", "--file"])
        .arg(&dump)
        .arg(&original.url)
        .output()
        .expect("pg_dump");
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    agent.proc.terminate();
    server.proc.terminate();

    let ran = std::process::Command::new("pg_restore")
        .args(["--no-owner", "--dbname", &copy.url])
        .arg(&dump)
        .output()
        .expect("pg_restore");
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let restored = tmp.path().join("restored");
    let (code, report, stderr) = berth_with(
        &[
            "restore",
            keys.to_str().unwrap(),
            "--data-dir",
            restored.to_str().unwrap(),
        ],
        &passphrase,
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(report["database"], "none", "{report}");
    assert!(!restored.join("berth.db").exists());

    let server = Server::start(
        &restored,
        &["--heartbeat-interval-secs", "1", "--database", &copy.url],
    );
    assert_eq!(server.task(&task)["state"], "succeeded");
    let mut moved = Agent::restart(
        &server.url,
        &agent.state_dir,
        &agent.sticker_dir,
        "on-pg",
        &[],
    );
    server.wait_agent(&agent.id, "the agent back, on the restored server", |a| {
        a["status"] == "online"
    });
    let again = server.create_task(&agent.id, "write-sticker", &json!({"name": "pg2"}), None);
    server.wait_task_state(&id_of(&again), Duration::from_secs(60), "succeeded");
    assert_eq!(moved.terminate(), 0);
}
