//! `berth-bench seal`: what sealing costs one task, on this thread only. The four HPKE steps of
//! a delivery, each as its side runs it: the server seals a typical assignment's payload and
//! credentials to the agent's key (JSON, seal, base64), the agent opens it (base64, open, JSON);
//! the agent seals a typical result log to the server's key, the server opens it. Medians over
//! `iterations`, in microseconds, against `--task-ms`, a task's median end-to-end time.

use std::time::Instant;

use anyhow::bail;
use berth_crypto::hpke::{self, RecipientKey};
use berth_proto::transport::{
    AgentTaskAssignment, SealedAssignment, ASSIGNMENT_SEAL_INFO, CONTRACT_VERSION, LOGS_SEAL_INFO,
};
use berth_proto::{AgentId, AssignmentId, TaskId};
use clap::Args;
use serde_json::json;
use time::OffsetDateTime;

use crate::tasks::{open_assignment, seal_box};

#[derive(Args, Debug)]
pub struct SealArgs {
    #[arg(long, default_value_t = 5000)]
    iterations: usize,
    /// Bytes of result log sealed per task.
    #[arg(long, default_value_t = 4096)]
    log_bytes: usize,
    /// A task's median end-to-end time in ms (create response to acknowledged result), to put
    /// the cost next to; `BENCHMARKS.md`'s task figure.
    #[arg(long)]
    task_ms: Option<f64>,
}

/// A `docker.run` deployment's payload, with a registry login and a builtin secret in its
/// credentials: the kind of assignment that carries something worth sealing.
fn typical() -> SealedAssignment {
    let payload = json!({
        "image": "registry.example.com/shop/web@sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "config": {
            "containerName": "web",
            "ports": [{"host": 8080, "container": 80}],
            "env": {"RUST_LOG": "info", "DATABASE_URL": "postgres://shop@db/shop", "FEATURE_FLAGS": "checkout-v2,search"},
            "volumes": [{"source": "shop-data", "target": "/var/lib/shop"}],
            "healthCheck": {"type": "http", "url": "http://127.0.0.1:8080/healthz", "timeoutSeconds": 30},
            "restartPolicy": "unless-stopped",
            "labels": {"berth.environment": "production", "berth.release": "2026.12.03-1"}
        },
        "sticker": {"name": "web", "release": "2026.12.03-1"}
    });
    SealedAssignment {
        payload: payload.to_string(),
        credentials: [
            ("registryUsername".to_string(), "deploy-bot".to_string()),
            (
                "registryPassword".to_string(),
                "r3g-7f0b2c9d4e8a1b6c3d5e7f9a0b2c4d6e".to_string(),
            ),
            (
                "secret:DATABASE_PASSWORD".to_string(),
                "pw-0123456789abcdef0123456789abcdef".to_string(),
            ),
        ]
        .into(),
    }
}

pub fn seal(args: &SealArgs) -> anyhow::Result<()> {
    if args.iterations == 0 {
        bail!("--iterations must be positive");
    }
    let agent_key = RecipientKey::generate()?;
    let server_key = RecipientKey::generate()?;
    let clear = typical();
    let log = "x".repeat(args.log_bytes);
    let mut steps: [Vec<f64>; 4] = Default::default();
    let mut assignment = AgentTaskAssignment {
        contract_version: CONTRACT_VERSION.into(),
        assignment_id: AssignmentId(uuid::Uuid::new_v4()),
        task_id: TaskId(uuid::Uuid::new_v4()),
        agent_id: AgentId(uuid::Uuid::new_v4()),
        required_capability: "docker".into(),
        task_type: "docker.run".into(),
        payload: String::new(),
        credentials: Default::default(),
        sealed: None,
        variables: Default::default(),
        assigned_at: OffsetDateTime::now_utc(),
        timeout: "00:05:00".into(),
        idempotency_key: "bench".into(),
        expires_at: OffsetDateTime::now_utc(),
        side_effects: true,
    };
    let micros = |t: Instant| t.elapsed().as_nanos() as f64 / 1000.0;
    for _ in 0..args.iterations {
        assignment.assignment_id = AssignmentId(uuid::Uuid::new_v4());
        let id = assignment.assignment_id;

        let t = Instant::now();
        let text = serde_json::to_vec(&clear)?;
        assignment.sealed = Some(seal_box(
            agent_key.public_key(),
            ASSIGNMENT_SEAL_INFO,
            id,
            &text,
        )?);
        steps[0].push(micros(t));

        let t = Instant::now();
        let opened = open_assignment(&agent_key, &assignment)?;
        steps[1].push(micros(t));
        if opened != clear {
            bail!("the assignment opened to something else");
        }

        let t = Instant::now();
        let sealed_log = seal_box(server_key.public_key(), LOGS_SEAL_INFO, id, log.as_bytes())?;
        steps[2].push(micros(t));

        let t = Instant::now();
        let boxed = hpke::Sealed::from_base64(&sealed_log.enc, &sealed_log.ciphertext)?;
        let opened = server_key.open(
            hpke::Aead::Aes256Gcm,
            &boxed,
            LOGS_SEAL_INFO,
            id.to_string().as_bytes(),
        )?;
        steps[3].push(micros(t));
        if opened.len() != log.len() {
            bail!("the log opened to something else");
        }
    }
    let medians: Vec<f64> = steps.into_iter().map(crate::stats::median).collect();
    let total: f64 = medians.iter().sum();
    let names = [
        "seal assignment (server)",
        "open assignment (agent)",
        "seal logs (agent)",
        "open logs (server)",
    ];
    println!(
        "sealed payload+credentials: {} bytes of JSON; log: {} bytes; {} iterations",
        serde_json::to_vec(&clear)?.len(),
        args.log_bytes,
        args.iterations
    );
    for (name, m) in names.iter().zip(&medians) {
        println!("  {name}: median {m:.1} µs");
    }
    println!("  per task (sum of medians): {total:.1} µs");
    let share = args.task_ms.map(|ms| total / (ms * 1000.0) * 100.0);
    if let (Some(ms), Some(share)) = (args.task_ms, share) {
        println!("  against a task's end-to-end median of {ms} ms: {share:.2} %");
    }
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "seal",
            "iterations": args.iterations,
            "log_bytes": args.log_bytes,
            "seal_assignment_us": medians[0],
            "open_assignment_us": medians[1],
            "seal_logs_us": medians[2],
            "open_logs_us": medians[3],
            "per_task_us": total,
            "task_ms": args.task_ms,
            "share_percent": share,
        })
    );
    Ok(())
}
