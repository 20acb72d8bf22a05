//! The audit log end to end: a real `berth server` (SQLite), a real agent running two tasks, the
//! admin CLI for the actions, then `berth audit export` and the offline `berth audit verify`.
//! Tampering with the database afterwards (one row altered, two rows re-ordered, a result's
//! signature swapped with a chain rewritten to match) makes `verify` fail naming the entry.

#![cfg(unix)]

mod common;

use std::path::Path;

use berth_proto::audit::{hash_input, GENESIS_HASH};
use common::*;
use serde_json::{json, Value};

/// `berth audit export` to a file; the exported entries.
fn export(server: &Server, file: &Path) -> Vec<Value> {
    let mut cmd = command(BERTH);
    cmd.args(["audit", "export"])
        .env("BERTH_SERVER", &server.url)
        .env("BERTH_TOKEN", &server.admin_token)
        .env("BERTH_CA_FILE", server.data_dir.join("ca.crt"));
    let out = Proc::spawn("berth audit export", cmd).finish(EXIT);
    assert!(out.status.success(), "export failed: {}", out.stderr);
    std::fs::write(file, &out.stdout).expect("write export");
    out.stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// `berth audit verify FILE --ca ca.crt`, with no server: Ok(stdout) or Err(stderr).
fn verify(server: &Server, file: &Path) -> Result<String, String> {
    let mut cmd = command(BERTH);
    cmd.args(["audit", "verify"])
        .arg(file)
        .arg("--ca")
        .arg(server.data_dir.join("ca.crt"))
        .env_remove("BERTH_SERVER")
        .env_remove("BERTH_TOKEN");
    let out = Proc::spawn("berth audit verify", cmd).finish(EXIT);
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(out.stderr)
    }
}

fn db(server: &Server) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(server.data_dir.join("berth.db")).expect("open db");
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .expect("busy timeout");
    conn
}

/// The stored rows of the chain, by seq.
fn rows(conn: &rusqlite::Connection) -> Vec<(i64, String)> {
    let mut stmt = conn
        .prepare("SELECT seq, entry FROM audit_log ORDER BY tenant_id, seq")
        .expect("prepare");
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect()
}

fn set_entry(conn: &rusqlite::Connection, seq: i64, entry: &str) {
    conn.execute(
        "UPDATE audit_log SET entry = ?2 WHERE seq = ?1",
        rusqlite::params![seq, entry],
    )
    .expect("update");
}

#[test]
fn audit_export_verifies_and_tampering_is_named() {
    let dir = tempdir();
    let data = dir.path().join("server");
    let server = Server::start(&data, &[]);
    let agent = Agent::register(&server, dir.path(), "audited", &[]);
    server.cli(&["api-token", "create", "--role", "viewer", "--name", "ci"]);
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let task = server.create_task(&agent.id, "inspect", &json!({}), Some(60));
        let id = id_of(&task);
        server.wait_task(&id, SETTLE, "finished", |t| t["finishedAt"].is_string());
        tasks.push(id);
    }
    server.cli(&["agents", "label", &agent.id, "tier=qa"]);

    // The export holds every action, in order, and verifies offline.
    let file = dir.path().join("audit.jsonl");
    let entries = export(&server, &file);
    let actions: Vec<&str> = entries
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "agent_token.create",
            "api_token.create",
            "task.create",
            "task.result",
            "task.create",
            "task.result",
            "agent.update"
        ],
        "{entries:#?}"
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        !text.contains("bat_") && !text.contains("reg_"),
        "no token secret in the log"
    );
    let ok = verify(&server, &file).expect("a genuine export verifies");
    assert!(ok.contains("7 entries, 2 signed results"), "{ok}");
    let result_seqs: Vec<i64> = entries
        .iter()
        .filter(|e| e["action"] == "task.result")
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    let first_result = result_seqs[0];

    let conn = db(&server);
    let genuine = rows(&conn);
    let restore = |conn: &rusqlite::Connection| {
        for (seq, entry) in &genuine {
            set_entry(conn, *seq, entry);
        }
    };

    // (1) One row altered: the result said failed instead of what the agent signed.
    let (seq, entry) = &genuine[first_result as usize - 1];
    let mut altered: Value = serde_json::from_str(entry).unwrap();
    altered["details"]["state"] = "failed".into();
    set_entry(&conn, *seq, &altered.to_string());
    export(&server, &file);
    let refused = verify(&server, &file).expect_err("an altered row fails");
    assert!(
        refused.contains(&format!("entry seq {first_result} ")) && refused.contains("altered"),
        "{refused}"
    );
    restore(&conn);
    export(&server, &file);
    verify(&server, &file).expect("restored");

    // (2) Two rows re-ordered: seq 2's and 3's entries trade places.
    set_entry(&conn, 2, &genuine[2].1);
    set_entry(&conn, 3, &genuine[1].1);
    export(&server, &file);
    let refused = verify(&server, &file).expect_err("re-ordered rows fail");
    assert!(
        refused.contains("entry seq 3 (line 2)") && refused.contains("out of sequence"),
        "{refused}"
    );
    restore(&conn);

    // (3) A result's signature swapped for the other result's, and every hash from there on
    // rewritten to match (a forger with the database): the chain checks out, the signature
    // does not.
    let mut chain: Vec<Value> = genuine
        .iter()
        .map(|(_, e)| serde_json::from_str(e).unwrap())
        .collect();
    let (a, b) = (first_result as usize - 1, result_seqs[1] as usize - 1);
    let other = chain[b]["details"]["envelope"]["signature"].clone();
    assert_ne!(chain[a]["details"]["envelope"]["signature"], other);
    chain[a]["details"]["envelope"]["signature"] = other;
    let mut prev = GENESIS_HASH.to_string();
    for entry in &mut chain {
        entry["prevHash"] = prev.clone().into();
        let hash = berth_crypto::sha256_hex(&hash_input(entry).unwrap());
        entry["hash"] = hash.clone().into();
        prev = hash;
    }
    for (seq, entry) in chain.iter().enumerate() {
        set_entry(&conn, seq as i64 + 1, &entry.to_string());
    }
    export(&server, &file);
    let refused = verify(&server, &file).expect_err("a swapped signature fails");
    assert!(
        refused.contains(&format!("entry seq {first_result} "))
            && refused.contains("signature does not verify"),
        "{refused}"
    );
    restore(&conn);
    export(&server, &file);
    verify(&server, &file).expect("restored");
    drop(agent);
}
