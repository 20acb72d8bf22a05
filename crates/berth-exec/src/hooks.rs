//! Pre- and post-deploy hooks: `{command: [argv…], timeout}` run on the agent's host as an
//! argument vector (never through a shell), killed on timeout, with their output in the run's log
//! (redacted with everything else when the outcome is made).
//!
//! A hook runs only a program on the agent's hook allow-list ([`AllowedHooks`], the agent's
//! `--allow-hook`; empty by default, so hooks are off). The program must be an absolute, clean
//! path equal to a listed one: no `PATH` lookup, no relative path. The executors check both hooks
//! before they touch the host (pull, rename, lock file, `up`), and again before running each.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_proto::payload::HookConfig;

use crate::error::ExecError;
use crate::process::{self, Ended, Spec};
use crate::run::Run;

/// Used when a hook names no timeout.
pub const DEFAULT_HOOK_TIMEOUT_SECS: u64 = 300;

/// The programs hooks may run: absolute paths, compared exactly with a hook's `command[0]`.
#[derive(Debug, Clone, Default)]
pub struct AllowedHooks(Arc<[PathBuf]>);

impl AllowedHooks {
    /// Keeps only absolute, clean paths (the agent refuses anything else at start).
    pub fn new(programs: Vec<PathBuf>) -> AllowedHooks {
        AllowedHooks(
            programs
                .into_iter()
                .filter(|p| is_clean_absolute(p))
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `program` is on the list: an absolute path without `.`, `..` or empty
    /// components, equal to a listed one. A bare name is never looked up in `PATH`.
    pub fn allows(&self, program: &str) -> bool {
        let path = Path::new(program);
        is_clean_absolute(path) && self.0.iter().any(|a| a.as_os_str() == path.as_os_str())
    }
}

/// `/a/b`, not `a/b`, `/a/./b`, `/a/../b`, `/a//b` or `/a/b/`: judged on the bytes, because
/// [`Path::components`] quietly drops `.` and repeated slashes.
pub fn is_clean_absolute(path: &Path) -> bool {
    let s = path.as_os_str().as_encoded_bytes();
    s.len() > 1
        && s[0] == b'/'
        && s[1..]
            .split(|b| *b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b"..")
}

/// Refuses both hooks of a deployment unless each could run: called before anything is touched.
pub(crate) fn validate_all(
    hooks: &berth_proto::payload::DeployHooks,
    allowed: &AllowedHooks,
) -> Result<(), ExecError> {
    for (hook, name) in [
        (&hooks.pre_deploy, "pre-deploy"),
        (&hooks.post_deploy, "post-deploy"),
    ] {
        if let Some(h) = hook {
            validate(h, name, allowed)?;
        }
    }
    Ok(())
}

/// Refuses a hook that could not run, or may not, before anything is touched.
pub(crate) fn validate(
    hook: &HookConfig,
    name: &'static str,
    allowed: &AllowedHooks,
) -> Result<(), ExecError> {
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
        Some(p) if !allowed.allows(p) => Err(ExecError::HookNotAllowed {
            hook: name,
            program: p.clone(),
        }),
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
    allowed: &AllowedHooks,
) -> Result<(), ExecError> {
    validate(hook, name, allowed)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exact_absolute_paths_on_the_list_are_allowed() {
        let allowed = AllowedHooks::new(vec!["/usr/local/bin/deploy-hook".into(), "rel".into()]);
        assert!(allowed.allows("/usr/local/bin/deploy-hook"));
        for refused in [
            "deploy-hook",
            "rel",
            "./deploy-hook",
            "bin/deploy-hook",
            "/usr/local/bin/../bin/deploy-hook",
            "/usr/local/bin/./deploy-hook",
            "/usr/local//bin/deploy-hook",
            "/usr/local/bin/deploy-hook/",
            "/bin/sh",
            "",
        ] {
            assert!(!allowed.allows(refused), "{refused:?}");
        }
        assert!(
            !AllowedHooks::default().allows("/bin/sh"),
            "none by default"
        );
    }

    #[test]
    fn a_refused_hook_is_hook_not_allowed_and_not_retriable() {
        let hook = HookConfig {
            command: vec!["/bin/sh".into(), "-c".into(), "id".into()],
            timeout: None,
        };
        let e = validate(&hook, "pre-deploy", &AllowedHooks::default()).unwrap_err();
        assert_eq!(e.code(), "HOOK_NOT_ALLOWED");
        assert!(!e.retriable());
        assert!(validate(
            &hook,
            "pre-deploy",
            &AllowedHooks::new(vec!["/bin/sh".into()])
        )
        .is_ok());
    }
}
