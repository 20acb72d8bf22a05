//! Child processes (hooks, `docker compose`): an argument vector, never a shell; no stdin; output
//! captured up to a cap; killed with its whole process group on timeout or when the run stops.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::AsyncReadExt;

use crate::error::ExecError;
use crate::run::Stop;

/// Per stream; the rest is read and dropped so the child never blocks on a full pipe.
const MAX_CAPTURE_BYTES: usize = 32 * 1024;

/// How long to keep reading pipes after the child is gone (a grandchild that left the process
/// group may hold them open forever).
const PIPE_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(crate) enum Ended {
    Exited(ExitStatus),
    /// The command's own timeout passed; it was killed.
    TimedOut,
    /// The run was cancelled or ran out of time; the command was killed.
    Stopped(ExecError),
}

#[derive(Debug)]
pub(crate) struct Finished {
    pub ended: Ended,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn success(&self) -> bool {
        matches!(&self.ended, Ended::Exited(s) if s.success())
    }

    /// stdout and stderr, trimmed, for logs and error details.
    pub fn output(&self) -> String {
        let mut parts = Vec::new();
        if !self.stdout.trim().is_empty() {
            parts.push(self.stdout.trim().to_string());
        }
        if !self.stderr.trim().is_empty() {
            parts.push(self.stderr.trim().to_string());
        }
        parts.join("\n")
    }
}

/// A command to run.
#[derive(Debug, Default)]
pub(crate) struct Spec<'a> {
    pub argv: &'a [String],
    pub cwd: Option<&'a Path>,
    pub env: Vec<(String, String)>,
    pub env_remove: &'a [&'a str],
}

/// Runs `spec` to completion, or kills it after `timeout` or when `stop` fires. `Err` only when
/// it cannot be started.
pub(crate) async fn run(
    spec: &Spec<'_>,
    timeout: Duration,
    stop: &Stop,
) -> Result<Finished, std::io::Error> {
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "empty command",
        ));
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout kills what it started too.
        .process_group(0)
        .kill_on_drop(true);
    if let Some(cwd) = spec.cwd {
        cmd.current_dir(cwd);
    }
    for name in spec.env_remove {
        cmd.env_remove(name);
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn()?;
    let pid = child.id();
    let stdout = child.stdout.take().map(|s| tokio::spawn(capture(s)));
    let stderr = child.stderr.take().map(|s| tokio::spawn(capture(s)));

    let ended = tokio::select! {
        status = child.wait() => match status {
            Ok(status) => Ended::Exited(status),
            Err(e) => return Err(e),
        },
        _ = tokio::time::sleep(timeout) => Ended::TimedOut,
        e = stop.stopped() => Ended::Stopped(e),
    };
    if !matches!(ended, Ended::Exited(_)) {
        kill_group(pid);
        let _ = child.kill().await;
    }
    Ok(Finished {
        ended,
        stdout: collect(stdout).await,
        stderr: collect(stderr).await,
    })
}

fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) takes plain integers and touches no memory of ours; the negative pid
        // names the process group the child leads (process_group(0) above).
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

async fn capture(mut pipe: impl tokio::io::AsyncRead + Unpin) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = MAX_CAPTURE_BYTES.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    kept
}

async fn collect(handle: Option<tokio::task::JoinHandle<Vec<u8>>>) -> String {
    let Some(mut handle) = handle else {
        return String::new();
    };
    let bytes = match tokio::time::timeout(PIPE_GRACE, &mut handle).await {
        Ok(Ok(bytes)) => bytes,
        _ => {
            handle.abort();
            return "(output unavailable: the pipe stayed open)".to_string();
        }
    };
    let mut text = String::from_utf8_lossy(&bytes).into_owned();
    if bytes.len() >= MAX_CAPTURE_BYTES {
        text.push_str("\n… output truncated");
    }
    text
}
