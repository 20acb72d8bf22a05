//! `upload-files`: writes files into a directory, each atomically, with mode 0644 or 0755. On the
//! agent's own host the directory must lie inside the agent's upload root (`PATH_FORBIDDEN`
//! otherwise; symlinks are resolved before the check, so none leads out); with `sshTarget`, on
//! that host over SFTP ([`crate::ssh`]). Every file is resolved (fetched, digest checked) before
//! the first is written. Outputs: `directory` and `files: [{name, size, sha256}]`.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use berth_proto::kind::TaskKind;
use berth_proto::payload::{CheckPayload, UploadFilesPayload};
use berth_proto::result::error_types;

use crate::artifact::{self, ArtifactSource, Resolved};
use crate::run::Run;
use crate::{parse_payload, ssh, ExecError, Executor, Outcome, Task};

/// Runs `upload-files`.
#[derive(Clone)]
pub struct UploadFiles {
    root: PathBuf,
    artifacts: Option<Arc<dyn ArtifactSource>>,
}

impl UploadFiles {
    /// Local uploads go below `root` (created when missing).
    pub fn new(root: impl Into<PathBuf>) -> UploadFiles {
        UploadFiles {
            root: root.into(),
            artifacts: None,
        }
    }

    /// Fetches files given by reference from `source`.
    pub fn with_artifacts(mut self, source: Arc<dyn ArtifactSource>) -> UploadFiles {
        self.artifacts = Some(source);
        self
    }
}

#[async_trait::async_trait]
impl Executor for UploadFiles {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::UploadFiles]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        if TaskKind::parse(&task.task_type) != Some(TaskKind::UploadFiles) {
            return Outcome::failed(
                error_types::UNSUPPORTED_TASK_TYPE,
                format!("the upload executor does not run {}", task.task_type),
                false,
            );
        }
        let p: UploadFilesPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let mut run = Run::new(task);
        let result = self.upload(&mut run, &p).await;
        run.finish(result)
    }
}

impl UploadFiles {
    async fn upload(&self, run: &mut Run<'_>, p: &UploadFilesPayload) -> Result<String, ExecError> {
        p.check().map_err(ExecError::InvalidPayload)?;
        let stop = run.stop.clone();
        let files = artifact::resolve(&p.files, self.artifacts.as_ref(), &stop).await?;
        let dir = p.directory.trim_end_matches('/');
        let message = match &p.ssh_target {
            Some(target) => {
                run.output("host", target.host.clone());
                run.output("directory", dir);
                ssh::upload_files(run, target, dir, &files).await?
            }
            None => {
                run.confirm_lease("writing the files").await?;
                let inside = self.prepare(Path::new(dir))?;
                run.output("directory", inside.display().to_string());
                write_local(run, &inside, &files)?;
                format!("wrote {} file(s) to {}", files.len(), inside.display())
            }
        };
        run.output(
            "files",
            serde_json::Value::Array(files.iter().map(Resolved::output).collect()),
        );
        Ok(message)
    }

    /// `dir` as a real path inside the upload root, created when missing; `PATH_FORBIDDEN` when
    /// it (or the symlinks on its way) leads outside.
    fn prepare(&self, dir: &Path) -> Result<PathBuf, ExecError> {
        let io = |what: &'static str, path: &Path| {
            let path = path.display().to_string();
            move |source| ExecError::Io { what, path, source }
        };
        std::fs::create_dir_all(&self.root).map_err(io("cannot create", &self.root))?;
        let root = self
            .root
            .canonicalize()
            .map_err(io("cannot resolve", &self.root))?;
        let forbidden = || {
            ExecError::PathForbidden(format!(
                "{} is outside this agent's upload root {} (berth-agent --upload-root)",
                dir.display(),
                root.display()
            ))
        };
        // The deepest existing ancestor, with its symlinks resolved, decides; what is missing
        // below it is created one plain directory at a time.
        let mut existing = dir.to_path_buf();
        let mut missing = Vec::new();
        let real = loop {
            match existing.canonicalize() {
                Ok(real) => break real,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    let Some(name) = existing.file_name() else {
                        return Err(forbidden());
                    };
                    missing.push(name.to_os_string());
                    if !existing.pop() {
                        return Err(forbidden());
                    }
                }
                Err(e) => return Err(io("cannot resolve", &existing)(e)),
            }
        };
        if !real.starts_with(&root) {
            return Err(forbidden());
        }
        let mut path = real;
        for name in missing.into_iter().rev() {
            path.push(&name);
            if let Err(e) = std::fs::create_dir(&path) {
                if e.kind() != std::io::ErrorKind::AlreadyExists {
                    return Err(io("cannot create", &path)(e));
                }
            }
            // Created by someone else in between: it must be a plain directory, not a symlink.
            let meta = std::fs::symlink_metadata(&path).map_err(io("cannot stat", &path))?;
            if !meta.is_dir() {
                return Err(forbidden());
            }
        }
        Ok(path)
    }
}

/// Each file atomically beside its final name ([`berth_fs::write_atomic`]): a symlink at the
/// name is replaced, never followed.
fn write_local(run: &mut Run<'_>, dir: &Path, files: &[Resolved]) -> Result<(), ExecError> {
    for f in files {
        let path = dir.join(&f.name);
        let failed = |source| ExecError::Io {
            what: "cannot write",
            path: path.display().to_string(),
            source,
        };
        berth_fs::write_atomic(&path, &f.bytes, f.mode).map_err(failed)?;
        // The file was created under the agent's umask; its mode is set exactly, on the file
        // itself (never through a symlink put there since).
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|file| file.set_permissions(std::fs::Permissions::from_mode(f.mode)))
            .map_err(failed)?;
        run.log.line(format!(
            "wrote {} ({} bytes, sha256 {}, mode {:o})",
            path.display(),
            f.bytes.len(),
            f.sha256,
            f.mode
        ));
    }
    Ok(())
}
