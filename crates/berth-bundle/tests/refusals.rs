//! Every refusal of `berth-bundle`, each tried with crafted input, and the seed's sha vector.

mod common;

use std::collections::BTreeMap;

use berth_bundle::{open, read_tar, sha, to_tar, Bundle, Files, Limits};
use berth_proto::error::codes;
use common::*;
use sha2::{Digest, Sha256};

const COMPOSE: &[u8] = b"services:\n  web:\n    image: nginx\n";

fn refused(tar: &[u8], code: &str, detail_has: &str) {
    let e = read_tar(tar, &Limits::default()).expect_err("accepted");
    assert_eq!(e.code, code, "{e}");
    assert!(e.detail.contains(detail_has), "{e}");
}

fn one(name: &[u8], typeflag: u8, data: &[u8], link: &[u8]) -> Vec<u8> {
    let mut t = Vec::new();
    member(&mut t, b"ok.txt", b'0', b"fine", b"");
    member(&mut t, name, typeflag, data, link);
    end(&mut t);
    t
}

/// A bundle tar of `files` plus a compose file, and its sha.
fn bundle_of(extra: &[(&str, &[u8])]) -> (Vec<u8>, String) {
    let mut f = files(extra);
    f.entry("docker-compose.yml".into())
        .or_insert(COMPOSE.to_vec());
    (to_tar(&f), sha(&f))
}

fn open_bundle(extra: &[(&str, &[u8])]) -> Result<Bundle, berth_bundle::BundleError> {
    let (tar, sha) = bundle_of(extra);
    open(&tar, &sha, &Limits::default())
}

#[test]
fn sha_is_the_seed_formula() {
    let f = files(&[
        (
            "docker-compose.yml",
            b"services:\n  web:\n    image: nginx\n",
        ),
        ("secrets.manifest.json", b"{\"entries\":[]}"),
        ("a/b.txt", b"hello\0world"),
        (".env.template", b""),
    ]);
    // Independently: the seed's loop over sorted names, written out by hand.
    let mut names: Vec<&String> = f.keys().collect();
    names.sort();
    let mut input = Vec::new();
    for n in names {
        input.extend_from_slice(n.as_bytes());
        input.push(0);
        input.extend_from_slice(&f[n]);
        input.push(0);
    }
    assert_eq!(sha(&f), hex::encode(Sha256::digest(&input)));
    // The same files through Python's hashlib, computed once:
    // h=sha256(); for n in sorted(files): h.update(n.encode()+b"\0"+files[n]+b"\0")
    assert_eq!(
        sha(&f),
        "0a53d12ec6714a06edd2f2de3c3ade9166f419c6002b1b4ba619ec3ee5e0e3a9"
    );
    assert_eq!(
        sha(&Files::new()),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
}

#[test]
fn unsafe_members_are_refused() {
    refused(
        &one(b"/etc/passwd", b'0', b"x", b""),
        codes::BUNDLE_UNSAFE,
        "absolute",
    );
    refused(
        &one(b"a/../../x", b'0', b"x", b""),
        codes::BUNDLE_UNSAFE,
        "..",
    );
    refused(
        &one(b"link", b'2', b"", b"/etc"),
        codes::BUNDLE_UNSAFE,
        "symbolic link",
    );
    refused(
        &one(b"hard", b'1', b"", b"/etc/shadow"),
        codes::BUNDLE_UNSAFE,
        "hard link",
    );
    refused(
        &one(b"tty", b'3', b"", b""),
        codes::BUNDLE_UNSAFE,
        "character device",
    );
    refused(
        &one(b"sda", b'4', b"", b""),
        codes::BUNDLE_UNSAFE,
        "block device",
    );
    refused(&one(b"pipe", b'6', b"", b""), codes::BUNDLE_UNSAFE, "fifo");
    refused(
        &one(b"ok.txt", b'0', b"again", b""),
        codes::BUNDLE_UNSAFE,
        "duplicate",
    );
    refused(
        &one(b"./ok.txt", b'0', b"again", b""),
        codes::BUNDLE_UNSAFE,
        "duplicate",
    );
    refused(
        &one(b"a\\b", b'0', b"x", b""),
        codes::BUNDLE_UNSAFE,
        "backslash",
    );
    refused(
        &one(b"ok.txt/x", b'0', b"x", b""),
        codes::BUNDLE_UNSAFE,
        "not a directory",
    );
    refused(&one(b"x", b'S', b"", b""), codes::BUNDLE_UNSAFE, "sparse");
    refused(
        &one(b"x", b'V', b"", b""),
        codes::BUNDLE_UNSAFE,
        "not a regular",
    );
    // A link whose size field lies is refused on its header, before any data.
    let mut t = Vec::new();
    t.extend(header(b"link", b'2', 1 << 32, b"/etc"));
    refused(&t, codes::BUNDLE_UNSAFE, "symbolic link");
    // The detail names the member.
    refused(
        &one(b"tty", b'3', b"", b""),
        codes::BUNDLE_UNSAFE,
        "\"tty\"",
    );
}

#[test]
fn long_names_are_checked_like_short_ones() {
    // GNU 'L' carrying a `..` path.
    let mut t = Vec::new();
    member(&mut t, b"././@LongLink", b'L', b"../../escape\0", b"");
    member(&mut t, b"innocent", b'0', b"x", b"");
    end(&mut t);
    refused(&t, codes::BUNDLE_UNSAFE, "..");
    // pax path that is absolute.
    let mut t = Vec::new();
    member(
        &mut t,
        b"pax",
        b'x',
        &pax_record("path", b"/etc/cron.d/x"),
        b"",
    );
    member(&mut t, b"innocent", b'0', b"x", b"");
    end(&mut t);
    refused(&t, codes::BUNDLE_UNSAFE, "absolute");
    // pax linkpath / global path.
    let mut t = Vec::new();
    member(&mut t, b"pax", b'g', &pax_record("path", b"x"), b"");
    member(&mut t, b"innocent", b'0', b"x", b"");
    end(&mut t);
    refused(&t, codes::BUNDLE_UNSAFE, "pax header sets path");
    // A pax name that makes a duplicate of an earlier member.
    let mut t = Vec::new();
    member(&mut t, b"a.txt", b'0', b"x", b"");
    member(&mut t, b"pax", b'x', &pax_record("path", b"./a.txt"), b"");
    member(&mut t, b"b.txt", b'0', b"y", b"");
    end(&mut t);
    refused(&t, codes::BUNDLE_UNSAFE, "duplicate");
    // A long name followed by a symlink is still a symlink.
    let mut t = Vec::new();
    member(&mut t, b"././@LongLink", b'L', b"fine/name", b"");
    member(&mut t, b"x", b'2', b"", b"/");
    end(&mut t);
    refused(&t, codes::BUNDLE_UNSAFE, "symbolic link");
    // An extension header with nothing after it.
    let mut t = Vec::new();
    member(&mut t, b"././@LongLink", b'L', b"dangling", b"");
    end(&mut t);
    refused(&t, codes::BUNDLE_INVALID, "no member");
    // A good long name is read.
    let long = format!("{}/file.txt", "d".repeat(150));
    let mut t = Vec::new();
    member(&mut t, b"././@LongLink", b'L', long.as_bytes(), b"");
    member(&mut t, b"short", b'0', b"x", b"");
    member(&mut t, b"pax", b'x', &pax_record("path", b"p/q.txt"), b"");
    member(&mut t, b"short2", b'0', b"y", b"");
    end(&mut t);
    let got = read_tar(&t, &Limits::default()).unwrap();
    assert_eq!(got, files(&[(long.as_str(), b"x"), ("p/q.txt", b"y")]));
}

#[test]
fn sizes_are_checked_before_reading() {
    let limits = Limits {
        max_member_bytes: 10,
        max_total_bytes: 15,
        max_members: 3,
    };
    // A header claiming 4 GiB, with no data behind it: refused on the header alone.
    let mut t = Vec::new();
    t.extend(header(b"huge", b'0', 1 << 32, b""));
    let e = read_tar(&t, &limits).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_TOO_LARGE, "{e}");
    assert!(e.detail.contains("huge"), "{e}");
    // A pax size lying above the limit.
    let mut t = Vec::new();
    member(&mut t, b"pax", b'x', &pax_record("size", b"11"), b"");
    member(&mut t, b"small", b'0', b"x", b"");
    end(&mut t);
    assert_eq!(
        read_tar(&t, &limits).unwrap_err().code,
        codes::BUNDLE_TOO_LARGE
    );
    // Oversize member, oversize total, too many members.
    let big = to_tar(&files(&[("a", &[7u8; 11])]));
    assert_eq!(
        read_tar(&big, &limits).unwrap_err().code,
        codes::BUNDLE_TOO_LARGE
    );
    let total = to_tar(&files(&[("a", &[1u8; 8]), ("b", &[2u8; 8])]));
    let e = read_tar(&total, &limits).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_TOO_LARGE);
    assert!(e.detail.contains("total"), "{e}");
    let many = to_tar(&files(&[("a", b""), ("b", b""), ("c", b""), ("d", b"")]));
    let e = read_tar(&many, &limits).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_TOO_LARGE);
    assert!(e.detail.contains("members"), "{e}");
    // A size that lies about the data behind it (truncated).
    let mut t = Vec::new();
    t.extend(header(b"short", b'0', 5, b""));
    t.extend([b'x'; 2]);
    assert_eq!(
        read_tar(&t, &limits).unwrap_err().code,
        codes::BUNDLE_INVALID
    );
}

#[test]
fn garbage_is_invalid() {
    for junk in [&b""[..], b"not a tar", &[0x41u8; 1024], &[0xffu8; 2048]] {
        let e = read_tar(junk, &Limits::default()).unwrap_err();
        assert_eq!(e.code, codes::BUNDLE_INVALID, "{e}");
    }
    // A correct header with a corrupted checksum.
    let mut t = one(b"x", b'0', b"x", b"");
    t[1024 + 150] ^= 1;
    assert_eq!(
        read_tar(&t, &Limits::default()).unwrap_err().code,
        codes::BUNDLE_INVALID
    );
}

#[test]
fn directories_are_skipped_and_harmless_names_normalised() {
    let mut t = Vec::new();
    member(&mut t, b"./", b'5', b"", b"");
    member(&mut t, b"./conf/", b'5', b"", b"");
    member(&mut t, b"./conf//app.ini", b'0', b"k=v", b"");
    end(&mut t);
    assert_eq!(
        read_tar(&t, &Limits::default()).unwrap(),
        files(&[("conf/app.ini", b"k=v")])
    );
}

#[test]
fn sha_mismatch_names_both() {
    let (tar, good) = bundle_of(&[]);
    let wrong = "0".repeat(64);
    let e = open(&tar, &wrong, &Limits::default()).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_SHA_MISMATCH);
    assert!(e.detail.contains(&wrong) && e.detail.contains(&good), "{e}");
    assert_eq!(open(&tar, &good, &Limits::default()).unwrap().sha, good);
}

#[test]
fn compose_file_must_be_there_once() {
    let f = files(&[("README", b"x")]);
    let e = open(&to_tar(&f), &sha(&f), &Limits::default()).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_INVALID);
    let b = open_bundle(&[]).unwrap();
    assert_eq!(b.compose_file, "docker-compose.yml");
    let f = files(&[("compose.yaml", COMPOSE)]);
    let b = open(&to_tar(&f), &sha(&f), &Limits::default()).unwrap();
    assert_eq!(b.compose_file, "compose.yaml");
    let e = open_bundle(&[("compose.yaml", COMPOSE)]).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_INVALID);
}

const MANIFEST: &[u8] = br#"{"vault_mode": "openbao",
 "entries": [{"var": "GEMINI_API_KEY",    "path": "monky/env-qa-02/see/gemini_api_key", "kind": "supplied",  "version": 2},
             {"var": "POSTGRES_PASSWORD", "path": "monky/env-qa-02/see/pg_password",    "kind": "generated", "version": 1},
             {"var": "SEE_ADMIN_TOKEN",   "path": "monky/data/env-qa-02/see/admin_token", "kind": "generated", "version": null}]}"#;

#[test]
fn the_seed_manifest_and_meta_read() {
    let meta = br#"{"env_id": "env-qa-02", "tier": "prod", "site": "x", "renderer": "compose",
        "agent": {"allow_rollback": true, "disk_need_bytes": 100, "allow_privileged": true},
        "allow_privileged": false, "files": ["a"], "unknown": {"x": 1}}"#;
    let b = open_bundle(&[("secrets.manifest.json", MANIFEST), ("bundle.json", meta)]).unwrap();
    assert_eq!(b.manifest.vault_mode, "openbao");
    assert_eq!(b.manifest.entries.len(), 3);
    assert_eq!(b.manifest.entries[0].version, Some(2));
    assert_eq!(b.manifest.entries[2].version, None);
    assert_eq!(b.manifest.entries[1].kind, "generated");
    assert_eq!(b.meta.env_id.as_deref(), Some("env-qa-02"));
    assert!(b.meta.prod && b.meta.allow_rollback);
    assert!(!b.meta.allow_privileged, "the top level wins");
    assert_eq!(b.meta.disk_need_bytes, Some(100));
    // Absent files: defaults.
    let b = open_bundle(&[]).unwrap();
    assert_eq!(b.manifest.vault_mode, "builtin");
    assert!(b.manifest.entries.is_empty());
    assert_eq!(b.meta.renderer, "compose");
    assert!(!b.meta.prod);
}

#[test]
fn manifest_refusals() {
    for (manifest, has) in [
        (
            &br#"{"entries": [{"var": "A", "path": "m/e/x", "value": null}]}"#[..],
            "manifest entry A carries a value",
        ),
        (
            br#"{"entries": [{"var": "A", "path": "m/e/x", "value": "s3cret"}]}"#,
            "manifest entry A carries a value",
        ),
        (br#"{"entries": [{"var": "1A", "path": "m/e/x"}]}"#, "1A"),
        (br#"{"entries": [{"var": "A", "path": "m/../x"}]}"#, "path"),
        (
            br#"{"entries": [{"var": "A", "path": "m/e/x"}, {"var": "A", "path": "m/e/y"}]}"#,
            "twice",
        ),
        (br#"[]"#, "object"),
        (b"{", "JSON"),
    ] {
        let e = open_bundle(&[("secrets.manifest.json", manifest)]).unwrap_err();
        assert_eq!(e.code, codes::BUNDLE_INVALID, "{e}");
        assert!(e.detail.contains(has), "{e}");
        assert!(!e.to_string().contains("s3cret"));
    }
}

#[test]
fn renderer_must_be_compose() {
    let e = open_bundle(&[("bundle.json", br#"{"renderer": "helm"}"#)]).unwrap_err();
    assert_eq!(e.code, codes::RENDERER_UNSUPPORTED, "{e}");
    let e = open_bundle(&[("bundle.json", br#"{"allow_privileged": "yes"}"#)]).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_INVALID, "{e}");
}

#[test]
fn disk_need_is_checked() {
    let b = open_bundle(&[("bundle.json", br#"{"agent": {"disk_need_bytes": 1000}}"#)]).unwrap();
    assert_eq!(
        b.check_disk(999).unwrap_err().code,
        codes::DISK_INSUFFICIENT
    );
    b.check_disk(1000).unwrap();
    open_bundle(&[]).unwrap().check_disk(0).unwrap();
}

#[test]
fn privileged_services_are_refused_unless_allowed() {
    for (compose, why) in [
        (
            "services:\n  db:\n    image: x\n    privileged: true\n",
            "privileged",
        ),
        ("services:\n  db:\n    cap_add: [NET_ADMIN, ALL]\n", "ALL"),
        (
            "services:\n  db:\n    cap_add: [cap_sys_admin]\n",
            "SYS_ADMIN",
        ),
        ("services:\n  db:\n    pid: host\n", "pid"),
        ("services:\n  db:\n    network_mode: host\n", "network_mode"),
        ("services:\n  db:\n    privileged: ${PRIV}\n", "privileged"),
        (
            "x-p: &p\n  privileged: true\nservices:\n  db:\n    <<: *p\n    image: x\n",
            "privileged",
        ),
    ] {
        let e = open_bundle(&[("docker-compose.yml", compose.as_bytes())]).unwrap_err();
        assert_eq!(e.code, codes::PRIVILEGED_FORBIDDEN, "{compose}: {e}");
        assert!(
            e.detail.contains("service db") && e.detail.contains(why),
            "{e}"
        );
        let allowed = open_bundle(&[
            ("docker-compose.yml", compose.as_bytes()),
            ("bundle.json", br#"{"agent": {"allow_privileged": true}}"#),
        ]);
        assert!(allowed.is_ok(), "{compose}");
        // Prod never runs privileged, whatever the bundle allows.
        let prod = open_bundle(&[
            ("docker-compose.yml", compose.as_bytes()),
            (
                "bundle.json",
                br#"{"tier": "prod", "agent": {"allow_privileged": true}}"#,
            ),
        ])
        .unwrap_err();
        assert_eq!(prod.code, codes::PRIVILEGED_FORBIDDEN, "{compose}: {prod}");
    }
    // Through files the compose file pulls in, and never from outside the bundle.
    let base = b"services:\n  base:\n    privileged: true\n";
    for (compose, why) in [
        ("include:\n  - extra.yml\n", "service base"),
        ("include:\n  - path: [./extra.yml]\n", "service base"),
        (
            "services:\n  db:\n    extends: {file: extra.yml, service: base}\n",
            "service base",
        ),
        (
            "include:\n  - /etc/compose.yml\n",
            "not a file of the bundle",
        ),
        (
            "services:\n  db:\n    extends: {file: ../x.yml, service: base}\n",
            "not a file of the bundle",
        ),
    ] {
        let e = open_bundle(&[
            ("docker-compose.yml", compose.as_bytes()),
            ("extra.yml", base),
        ])
        .unwrap_err();
        assert_eq!(e.code, codes::PRIVILEGED_FORBIDDEN, "{compose}: {e}");
        assert!(e.detail.contains(why), "{e}");
    }
    let fine = "services:\n  db:\n    cap_add: [NET_ADMIN]\n    network_mode: bridge\n";
    open_bundle(&[("docker-compose.yml", fine.as_bytes())]).unwrap();
    let e = open_bundle(&[("docker-compose.yml", b"services: [")]).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_INVALID);
}

fn values(items: &[(&str, &str)]) -> BTreeMap<String, String> {
    items
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn env_render() {
    let template = b"# comment\nGEMINI_API_KEY=\nDSN=postgres://u:${POSTGRES_PASSWORD}@db/x\r\nOTHER=${NOT_A_SECRET}\nPLAIN=1";
    let b = open_bundle(&[
        ("secrets.manifest.json", MANIFEST),
        (".env.template", template),
    ])
    .unwrap();
    let v = values(&[
        ("GEMINI_API_KEY", "g k#1"),
        ("POSTGRES_PASSWORD", "${SEE_ADMIN_TOKEN}"),
        ("SEE_ADMIN_TOKEN", "tok"),
        ("UNUSED", "u"),
    ]);
    assert_eq!(
        b.render_env(&v).unwrap(),
        "# comment\nGEMINI_API_KEY=g k#1\nDSN=postgres://u:${SEE_ADMIN_TOKEN}@db/x\r\nOTHER=${NOT_A_SECRET}\nPLAIN=1\nSEE_ADMIN_TOKEN=tok\n"
    );
    // Missing values: sorted, never a value.
    let e = b
        .render_env(&values(&[("POSTGRES_PASSWORD", "pw")]))
        .unwrap_err();
    assert_eq!(e.code, codes::ENV_INCOMPLETE);
    assert_eq!(e.detail, "unresolved: GEMINI_API_KEY, SEE_ADMIN_TOKEN");
    // A value with a line break would inject a line: refused, naming only the var.
    let mut bad = v.clone();
    bad.insert("SEE_ADMIN_TOKEN".into(), "tok\nPRIV=true".into());
    let e = b.render_env(&bad).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_INVALID);
    assert!(
        e.detail.contains("SEE_ADMIN_TOKEN") && !e.detail.contains("tok"),
        "{e}"
    );
    // No template: every var appended.
    let b = open_bundle(&[("secrets.manifest.json", MANIFEST)]).unwrap();
    assert_eq!(
        b.render_env(&v).unwrap(),
        "GEMINI_API_KEY=g k#1\nPOSTGRES_PASSWORD=${SEE_ADMIN_TOKEN}\nSEE_ADMIN_TOKEN=tok\n"
    );
}

#[test]
fn write_to_writes_members_but_not_env_and_stays_inside() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("deploy");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join("keep.txt"), b"old").unwrap();
    let b = open_bundle(&[("conf/app.ini", b"k=v"), (".env", b"LEAK=1")]).unwrap();
    b.write_to(&root).unwrap();
    assert_eq!(std::fs::read(root.join("conf/app.ini")).unwrap(), b"k=v");
    assert_eq!(
        std::fs::read(root.join("docker-compose.yml")).unwrap(),
        COMPOSE
    );
    assert!(!root.join(".env").exists());
    assert_eq!(std::fs::read(root.join("keep.txt")).unwrap(), b"old");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(root.join("conf/app.ini"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);

    // A symlink already in the directory is not followed out of it.
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let root2 = dir.path().join("deploy2");
    std::fs::create_dir(&root2).unwrap();
    std::os::unix::fs::symlink(&outside, root2.join("conf")).unwrap();
    let e = b.write_to(&root2).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_UNSAFE, "{e}");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);

    // A hand-built Bundle with a `..` name (read_tar would never make one) is refused too.
    let mut evil = b.clone();
    evil.files.insert("../escape".into(), b"x".to_vec());
    assert_eq!(evil.write_to(&root).unwrap_err().code, codes::BUNDLE_UNSAFE);
    assert!(!dir.path().join("escape").exists());
}

#[test]
fn build_dir_refuses_links_and_devices() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a"), b"x").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", dir.path().join("l")).unwrap();
    let e = berth_bundle::build_dir(dir.path()).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_UNSAFE);
    assert!(e.detail.contains("symbolic link"), "{e}");
    std::fs::remove_file(dir.path().join("l")).unwrap();
    let fifo = dir.path().join("p");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(status.success());
    let e = berth_bundle::build_dir(dir.path()).unwrap_err();
    assert_eq!(e.code, codes::BUNDLE_UNSAFE);
    assert!(e.detail.contains("not a regular file"), "{e}");
}

/// GNU tar reads what `to_tar` writes, and `read_tar` reads what GNU tar writes (gnu and pax
/// formats, long names included).
#[test]
fn interoperates_with_gnu_tar() {
    let dir = tempfile::tempdir().unwrap();
    let long = format!("{}/{}", "d".repeat(130), "f".repeat(120));
    let f = files(&[
        ("docker-compose.yml", COMPOSE),
        ("a/b/c.txt", b"abc"),
        (long.as_str(), b"long"),
        ("empty", b""),
    ]);
    let tar_path = dir.path().join("b.tar");
    std::fs::write(&tar_path, to_tar(&f)).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let status = std::process::Command::new("tar")
        .arg("-xf")
        .arg(&tar_path)
        .arg("-C")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let (read_back, _, digest) = berth_bundle::build_dir(&out).unwrap();
    assert_eq!(read_back, f);
    assert_eq!(digest, sha(&f));
    for format in ["gnu", "pax"] {
        let produced = dir.path().join(format!("{format}.tar"));
        let status = std::process::Command::new("tar")
            .arg(format!("--format={format}"))
            .arg("-cf")
            .arg(&produced)
            .arg("-C")
            .arg(&out)
            .arg(".")
            .status()
            .unwrap();
        assert!(status.success());
        let got = read_tar(&std::fs::read(&produced).unwrap(), &Limits::default()).unwrap();
        assert_eq!(got, f, "{format}");
    }
}
