//! `upload-files` on the agent's own host: files written atomically with their modes inside the
//! upload root; a directory outside it, or reached through a symlink that leads out, is
//! `PATH_FORBIDDEN` and nothing is written; a digest mismatch writes nothing; no lease, no write.

#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use berth_exec::artifact::sha256_hex;
use berth_exec::{ArtifactSource, Executor, FetchError, UploadFiles};
use berth_proto::result::error_types;
use berth_test_utils::docker::{assert_failed, assert_success, task};
use serde_json::json;

struct One(Vec<u8>);

#[async_trait::async_trait]
impl ArtifactSource for One {
    async fn fetch(&self, sha256: &str) -> Result<Vec<u8>, FetchError> {
        if sha256 == sha256_hex(&self.0) {
            Ok(self.0.clone())
        } else {
            Err(FetchError::NotFound(sha256.into()))
        }
    }
}

fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn writes_inside_the_root_with_modes_and_reports_each_file() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("uploads");
    let bytes = b"\x00\x01binary".to_vec();
    let sha = sha256_hex(&bytes);
    let up = UploadFiles::new(&root).with_artifacts(Arc::new(One(bytes.clone())));
    let dir = root.join("site/current");
    let o = up
        .execute(&task(
            "upload-files",
            json!({"directory": dir.display().to_string(),
                   "files": [{"name": "index.html", "content": "<h1>hi</h1>"},
                             {"name": "tool", "sha256": sha, "executable": true}]}),
        ))
        .await;
    assert_success(&o);
    assert_eq!(
        std::fs::read_to_string(dir.join("index.html")).unwrap(),
        "<h1>hi</h1>"
    );
    assert_eq!(std::fs::read(dir.join("tool")).unwrap(), bytes);
    let mode = |n: &str| std::fs::metadata(dir.join(n)).unwrap().permissions().mode() & 0o777;
    assert_eq!((mode("index.html"), mode("tool")), (0o644, 0o755));
    assert_eq!(listing(&dir), ["index.html", "tool"], "no temp file left");
    assert_eq!(
        o.outputs["files"],
        json!([{"name": "index.html", "size": 11, "sha256": sha256_hex(b"<h1>hi</h1>")},
               {"name": "tool", "size": bytes.len(), "sha256": sha}])
    );
    assert_eq!(
        o.outputs["directory"],
        json!(dir.canonicalize().unwrap().display().to_string())
    );
}

#[tokio::test]
async fn directories_outside_the_root_are_forbidden_symlinks_included() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("uploads");
    let outside = tmp.path().join("etc");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    // A symlink inside the root that leads out of it.
    std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
    let up = UploadFiles::new(&root);
    for dir in [
        outside.clone(),
        tmp.path().to_path_buf(),
        root.join("escape"),
        root.join("escape/deeper/still"),
        std::path::PathBuf::from("/tmp/berth-upload-test-elsewhere"),
    ] {
        let o = up
            .execute(&task(
                "upload-files",
                json!({"directory": dir.display().to_string(),
                       "files": [{"name": "passwd", "content": "x"}]}),
            ))
            .await;
        assert_failed(&o, error_types::PATH_FORBIDDEN);
        assert!(!o.retriable);
    }
    assert!(listing(&outside).is_empty(), "written outside the root");
    assert!(!std::path::Path::new("/tmp/berth-upload-test-elsewhere").exists());

    // A file name that is a symlink inside the root is replaced, not followed.
    let dir = root.join("app");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(outside.join("target"), "keep").unwrap();
    std::os::unix::fs::symlink(outside.join("target"), dir.join("conf")).unwrap();
    let o = up
        .execute(&task(
            "upload-files",
            json!({"directory": dir.display().to_string(),
                   "files": [{"name": "conf", "content": "new"}]}),
        ))
        .await;
    assert_success(&o);
    assert_eq!(
        std::fs::read_to_string(outside.join("target")).unwrap(),
        "keep"
    );
    assert_eq!(std::fs::read_to_string(dir.join("conf")).unwrap(), "new");
    assert!(!dir.join("conf").is_symlink());
}

#[tokio::test]
async fn a_digest_mismatch_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("uploads");
    let claimed = sha256_hex(b"what the server promised");
    struct Liar;
    #[async_trait::async_trait]
    impl ArtifactSource for Liar {
        async fn fetch(&self, _: &str) -> Result<Vec<u8>, FetchError> {
            Ok(b"something else".to_vec())
        }
    }
    let o = UploadFiles::new(&root)
        .with_artifacts(Arc::new(Liar))
        .execute(&task(
            "upload-files",
            json!({"directory": root.join("d").display().to_string(),
                   "files": [{"name": "a", "content": "first"},
                             {"name": "b", "sha256": claimed}]}),
        ))
        .await;
    assert_failed(&o, error_types::ARTIFACT_DIGEST_MISMATCH);
    assert!(!root.join("d").exists());
}

struct Fenced;

#[async_trait::async_trait]
impl berth_exec::LeaseCheck for Fenced {
    async fn confirm(
        &self,
        _phase: Option<berth_proto::transport::ProgressPhase>,
    ) -> Result<(), String> {
        Err("FENCED".into())
    }
}

#[tokio::test]
async fn without_its_lease_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    let mut t = task(
        "upload-files",
        json!({"directory": dir.display().to_string(), "files": [{"name": "a", "content": "x"}]}),
    );
    t.lease = berth_exec::Lease::new(Arc::new(Fenced));
    let o = UploadFiles::new(tmp.path()).execute(&t).await;
    assert_failed(&o, error_types::LEASE_LOST);
    assert!(!dir.exists());
}
