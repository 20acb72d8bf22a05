//! `berth bundle build` as a process: the sha it prints is `berth_bundle::sha` of the directory's
//! files, the tar it writes unpacks to those files, and a symlink in the directory is refused.

#![cfg(unix)]

mod common;

use berth_bundle::{read_tar, sha, Files, Limits};
use common::*;

fn sample(dir: &std::path::Path) -> Files {
    let mut files = Files::new();
    files.insert(
        "docker-compose.yml".into(),
        b"services:\n  web:\n    image: nginx\n".to_vec(),
    );
    files.insert(".env.template".into(), b"TOKEN=\n".to_vec());
    files.insert(
        "secrets.manifest.json".into(),
        br#"{"vault_mode":"builtin","entries":[{"var":"TOKEN","path":"m/env/see/token","kind":"generated","version":null}]}"#.to_vec(),
    );
    files.insert("conf/nginx/site.conf".into(), b"server {}\n".to_vec());
    for (name, content) in &files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    files
}

#[test]
fn build_prints_the_sha_and_writes_the_tar() {
    let work = tempdir();
    let src = work.path().join("src");
    let files = sample(&src);
    let expected = sha(&files);

    // Default file name, in the current directory.
    let mut cmd = command(BERTH);
    cmd.args(["bundle", "build"])
        .arg(&src)
        .current_dir(work.path());
    let out = Proc::spawn("berth bundle build", cmd).finish(EXIT);
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(out.stdout, format!("{expected}\n"));
    let tar = std::fs::read(work.path().join(format!("bundle-{}.tar", &expected[..12])))
        .expect("the default tar");
    assert_eq!(read_tar(&tar, &Limits::default()).unwrap(), files);

    // --out FILE: the same bytes.
    let file = work.path().join("out.tar");
    let mut cmd = command(BERTH);
    cmd.args(["bundle", "build"])
        .arg(&src)
        .arg("--out")
        .arg(&file);
    let out = Proc::spawn("berth bundle build --out", cmd).finish(EXIT);
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(out.stdout.trim(), expected);
    assert_eq!(std::fs::read(&file).unwrap(), tar);
}

#[test]
fn build_refuses_a_symlink() {
    let work = tempdir();
    let src = work.path().join("src");
    sample(&src);
    std::os::unix::fs::symlink("/etc/passwd", src.join("passwd")).unwrap();
    let mut cmd = command(BERTH);
    cmd.args(["bundle", "build"])
        .arg(&src)
        .arg("--out")
        .arg(work.path().join("x.tar"));
    let out = Proc::spawn("berth bundle build (symlink)", cmd).finish(EXIT);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    assert!(out.stderr.contains("BUNDLE_UNSAFE"), "{}", out.stderr);
    assert!(!work.path().join("x.tar").exists());
}
