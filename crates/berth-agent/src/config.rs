//! How the agent runs: what `berth-agent` passes in after parsing its flags.

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Overrides the server URL recorded at registration.
    pub server: Option<String>,
    pub state_dir: PathBuf,
    pub retry_budget: Duration,
    /// Programs `execute-command` may run (absolute paths); empty turns it off.
    pub allow_commands: Vec<PathBuf>,
    /// Programs deployment hooks may run (absolute paths, matched exactly); empty: any
    /// deployment with a hook fails with `HOOK_NOT_ALLOWED`. Separate from `allow_commands`.
    pub allow_hooks: Vec<PathBuf>,
    /// Where version stickers live; default `<state_dir>/stickers`.
    pub sticker_dir: Option<PathBuf>,
    /// `upload-files` on this host writes only below it; default `<state_dir>/uploads`.
    pub upload_root: Option<PathBuf>,
    /// Tasks run at once.
    pub max_concurrent_tasks: usize,
    /// Where `/healthz` and `/readyz` are served (plain HTTP); `None`: nowhere.
    pub probe_listen: Option<std::net::SocketAddr>,
}

impl AgentConfig {
    /// Refuses an allow-list entry that is not an absolute, clean path (exit 78).
    pub fn validate(&self) -> Result<(), crate::AgentError> {
        if let Some(bad) = self
            .allow_hooks
            .iter()
            .find(|p| !berth_exec::hooks::is_clean_absolute(p))
        {
            return Err(crate::AgentError::Config(format!(
                "--allow-hook {} must be an absolute path without . or .. components",
                bad.display()
            )));
        }
        Ok(())
    }

    /// The directory local `upload-files` tasks write below (created at the first upload).
    pub fn upload_root(&self) -> PathBuf {
        self.upload_root
            .clone()
            .unwrap_or_else(|| self.state_dir.join("uploads"))
    }

    /// Where compose registry logins live while a task runs (0700; swept at start).
    pub fn credentials_dir(&self) -> PathBuf {
        self.state_dir.join("tmp")
    }

    pub fn new(state_dir: PathBuf) -> AgentConfig {
        AgentConfig {
            server: None,
            state_dir,
            retry_budget: Duration::from_secs(600),
            allow_commands: Vec::new(),
            allow_hooks: Vec::new(),
            sticker_dir: None,
            upload_root: None,
            max_concurrent_tasks: 8,
            probe_listen: None,
        }
    }
}
