//! Pre- and post-deploy hooks: `{command: [argv…], timeout}` run on the agent's host as an
//! argument vector (never through a shell), killed on timeout, with their output in the run's log
//! (redacted with everything else when the outcome is made).

use std::path::Path;
use std::time::{Duration, Instant};

use berth_proto::payload::HookConfig;

use crate::error::ExecError;
use crate::process::{self, Ended, Spec};
use crate::run::Run;

/// Used when a hook names no timeout.
pub const DEFAULT_HOOK_TIMEOUT_SECS: u64 = 300;

/// Refuses a hook that could not run, before anything is touched.
pub(crate) fn validate(hook: &HookConfig, name: &str) -> Result<(), ExecError> {
    match hook.command.first() {
        None => Err(ExecError::InvalidPayload(format!(
            "the {name} hook has an empty command"
        ))),
        Some(p) if p.is_empty() => Err(ExecError::InvalidPayload(format!(
            "the {name} hook's program is empty"
        ))),
        _ if hook.command.iter().any(|a| a.contains('\0')) => Err(ExecError::InvalidPayload(
            format!("the {name} hook's command contains a NUL byte"),
        )),
        _ if hook.timeout == Some(0) => Err(ExecError::InvalidPayload(format!(
            "the {name} hook's timeout must be at least 1 second"
        ))),
        _ => Ok(()),
    }
}

/// Runs one hook. `env` tells it what is being deployed (`BERTH_*` variables, no secrets).
pub(crate) async fn run_hook(
    run: &mut Run<'_>,
    hook: &HookConfig,
    name: &'static str,
    cwd: Option<&Path>,
    env: Vec<(String, String)>,
) -> Result<(), ExecError> {
    validate(hook, name)?;
    run.stop.check()?;
    let seconds = hook.timeout.unwrap_or(DEFAULT_HOOK_TIMEOUT_SECS);
    run.log.line(format!(
        "{name} hook: running {:?} (timeout {seconds}s)",
        hook.command
    ));
    let mut env = env;
    env.push(("BERTH_HOOK".into(), name.into()));
    env.push(("BERTH_TASK_ID".into(), run.task.task_id.to_string()));
    let spec = Spec {
        argv: &hook.command,
        cwd,
        env,
        env_remove: &[],
    };
    let started = Instant::now();
    let finished = process::run(&spec, Duration::from_secs(seconds), &run.stop)
        .await
        .map_err(|e| ExecError::HookFailed {
            hook: name,
            detail: format!("cannot start {:?}: {e}", hook.command[0]),
        })?;
    let output = finished.output();
    if !output.is_empty() {
        run.log.line(format!("{name} hook output:\n{output}"));
    }
    let took = started.elapsed().as_millis();
    match finished.ended {
        Ended::Exited(status) if status.success() => {
            run.log.line(format!("{name} hook: exit 0 after {took} ms"));
            Ok(())
        }
        Ended::Exited(status) => Err(ExecError::HookFailed {
            hook: name,
            detail: match status.code() {
                Some(code) => format!("exit status {code}"),
                None => format!("ended by {status}"),
            },
        }),
        Ended::TimedOut => Err(ExecError::HookTimeout {
            hook: name,
            seconds,
        }),
        Ended::Stopped(e) => Err(e),
    }
}
