//! Properties: (a) any safe tree round-trips through `to_tar`/`read_tar` and `build_dir` with
//! one sha; (b) any hostile tar is refused, or unpacks to nothing outside the directory.

mod common;

use std::path::Path;

use berth_bundle::{
    build_dir, read_tar, sha, to_tar, Bundle, BundleMeta, Files, Limits, SecretsManifest,
};
use berth_proto::error::codes;
use common::*;
use proptest::prelude::*;

/// A name segment from a safe alphabet, never `.` or `..`; sometimes long (pax names).
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9_.-]{1,12}",
        1 => "[a-z]{60,90}",
    ]
    .prop_filter("not . or ..", |s| s != "." && s != "..")
}

/// Random trees: nested names, random contents, no file that is also a directory.
fn tree() -> impl Strategy<Value = Files> {
    prop::collection::vec(
        (
            prop::collection::vec(segment(), 1..5),
            prop::collection::vec(any::<u8>(), 0..700),
        ),
        0..12,
    )
    .prop_map(|items| {
        let mut files: Files = items.into_iter().map(|(s, c)| (s.join("/"), c)).collect();
        let dirs: Vec<String> = files
            .keys()
            .flat_map(|n| {
                n.match_indices('/')
                    .map(|(i, _)| n[..i].to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        for d in dirs {
            files.remove(&d);
        }
        files
    })
}

fn write_tree(root: &Path, files: &Files) {
    for (name, content) in files {
        let path = root.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn trees_round_trip(files in tree()) {
        let tar = to_tar(&files);
        let read = read_tar(&tar, &Limits::default()).unwrap();
        prop_assert_eq!(&read, &files);
        prop_assert_eq!(sha(&read), sha(&files));
        let dir = tempfile::tempdir().unwrap();
        write_tree(dir.path(), &files);
        let (built, built_tar, built_sha) = build_dir(dir.path()).unwrap();
        prop_assert_eq!(&built, &files);
        prop_assert_eq!(built_sha, sha(&files));
        prop_assert_eq!(built_tar, tar, "the tar is deterministic");
    }
}

/// Names a hostile server might try. `link/…` goes through a symlink the test plants in the
/// target directory, pointing at the sentinel.
fn hostile_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        12 => "[a-z]{1,6}(/[a-z]{1,6}){0,2}".prop_map(String::into_bytes),
        2 => Just(b"link/x".to_vec()),
        6 => hostile_only(),
    ]
}

fn hostile_only() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"a".to_vec()),
        Just(b"./a".to_vec()),
        Just(b"a/".to_vec()),
        Just(b"a//b".to_vec()),
        Just(b"..".to_vec()),
        Just(b"../x".to_vec()),
        Just(b"a/../../x".to_vec()),
        Just(b"/abs/x".to_vec()),
        Just(b"/".to_vec()),
        Just(b".".to_vec()),
        Just(b"link/x".to_vec()),
        Just(b"link".to_vec()),
        Just(b"a\\..\\x".to_vec()),
        Just(b"dir/f".to_vec()),
        Just(b"../sentinel/x".to_vec()),
        Just(format!("{}/../../../x", "d".repeat(120)).into_bytes()),
        Just(format!("{}/ok", "e".repeat(150)).into_bytes()),
        "[a-z./]{1,20}".prop_map(String::into_bytes),
    ]
}

#[derive(Debug, Clone)]
enum Entry {
    /// A plain header of this type, its size field possibly lying about the data after it.
    Plain {
        typeflag: u8,
        name: Vec<u8>,
        link: Vec<u8>,
        data: Vec<u8>,
        size_lie: Option<u64>,
    },
    /// A GNU `L` long name, then a member of this type.
    GnuLong {
        long: Vec<u8>,
        typeflag: u8,
        short: Vec<u8>,
    },
    /// A pax `x` (or global `g`) header with these records, then a member of this type.
    Pax {
        global: bool,
        records: Vec<(String, Vec<u8>)>,
        typeflag: u8,
        short: Vec<u8>,
        data: Vec<u8>,
    },
}

fn typeflag() -> impl Strategy<Value = u8> {
    prop_oneof![
        12 => Just(b'0'),
        2 => Just(b'5'),
        3 => prop::sample::select(vec![b'\0', b'1', b'2', b'3', b'4', b'6', b'7', b'K', b'S', b'L']),
    ]
}

fn entry() -> impl Strategy<Value = Entry> {
    let data = prop::collection::vec(any::<u8>(), 0..1100);
    let link = prop::sample::select(vec![
        b"/etc/passwd".to_vec(),
        b"../../outside".to_vec(),
        b"a".to_vec(),
    ]);
    let size_lie = prop::option::weighted(
        0.05,
        prop::sample::select(vec![0u64, 1, 511, 513, 4096, 1 << 30]),
    );
    let record = prop_oneof![
        (Just("path".to_string()), hostile_name()),
        (
            Just("size".to_string()),
            prop::sample::select(vec![
                b"0".to_vec(),
                b"5".to_vec(),
                b"600".to_vec(),
                b"x".to_vec()
            ])
        ),
        (Just("linkpath".to_string()), Just(b"/etc".to_vec())),
        (Just("mtime".to_string()), Just(b"1".to_vec())),
        (Just("GNU.sparse.map".to_string()), Just(b"0,1".to_vec())),
    ];
    prop_oneof![
        4 => (typeflag(), hostile_name(), link, data.clone(), size_lie).prop_map(
            |(typeflag, name, link, data, size_lie)| Entry::Plain { typeflag, name, link, data, size_lie }),
        1 => (hostile_name(), typeflag(), hostile_name()).prop_map(
            |(long, typeflag, short)| Entry::GnuLong { long, typeflag, short }),
        1 => (any::<bool>(), prop::collection::vec(record, 1..3), typeflag(), hostile_name(), data).prop_map(
            |(global, records, typeflag, short, data)| Entry::Pax { global, records, typeflag, short, data }),
    ]
}

fn encode(entries: &[Entry], ended: bool) -> Vec<u8> {
    let mut t = Vec::new();
    for e in entries {
        match e {
            Entry::Plain {
                typeflag,
                name,
                link,
                data,
                size_lie,
            } => {
                t.extend(header(
                    name,
                    *typeflag,
                    size_lie.unwrap_or(data.len() as u64),
                    link,
                ));
                pad(&mut t, data);
            }
            Entry::GnuLong {
                long,
                typeflag,
                short,
            } => {
                member(&mut t, b"././@LongLink", b'L', long, b"");
                member(&mut t, short, *typeflag, b"x", b"");
            }
            Entry::Pax {
                global,
                records,
                typeflag,
                short,
                data,
            } => {
                let body: Vec<u8> = records.iter().flat_map(|(k, v)| pax_record(k, v)).collect();
                member(
                    &mut t,
                    b"pax",
                    if *global { b'g' } else { b'x' },
                    &body,
                    b"",
                );
                member(&mut t, short, *typeflag, data, b"");
            }
        }
    }
    if ended {
        end(&mut t);
    }
    t
}

/// Every path under `dir`, without following links.
fn walk(dir: &Path, out: &mut Vec<(std::path::PathBuf, std::fs::FileType)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let kind = std::fs::symlink_metadata(entry.path()).unwrap().file_type();
        out.push((entry.path(), kind));
        if kind.is_dir() {
            walk(&entry.path(), out);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn hostile_tars_are_refused_or_stay_inside(
        entries in prop::collection::vec(entry(), 1..6),
        ended in prop::bool::weighted(0.9),
    ) {
        let tar = encode(&entries, ended);
        let limits = Limits { max_member_bytes: 1 << 20, max_total_bytes: 2 << 20, max_members: 16 };
        let files = match read_tar(&tar, &limits) {
            Err(e) => {
                prop_assert!(
                    [codes::BUNDLE_UNSAFE, codes::BUNDLE_TOO_LARGE, codes::BUNDLE_INVALID].contains(&e.code),
                    "{}", e
                );
                return Ok(());
            }
            Ok(files) => files,
        };
        for name in files.keys() {
            prop_assert!(!name.starts_with('/') && !name.split('/').any(|c| c == ".." || c.is_empty() || c == "."), "{}", name);
        }
        let parent = tempfile::tempdir().unwrap();
        let root = parent.path().join("root");
        let sentinel = parent.path().join("sentinel");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir(&sentinel).unwrap();
        std::os::unix::fs::symlink(&sentinel, root.join("link")).unwrap();
        let bundle = Bundle {
            sha: sha(&files),
            files: files.clone(),
            compose_file: "docker-compose.yml".into(),
            manifest: SecretsManifest::default(),
            meta: BundleMeta::default(),
        };
        if let Err(e) = bundle.write_to(&root) {
            prop_assert!(
                e.code == codes::BUNDLE_UNSAFE || e.code == codes::INTERNAL,
                "{}", e
            );
        }
        prop_assert_eq!(std::fs::read_dir(&sentinel).unwrap().count(), 0, "the sentinel was written");
        let top: Vec<_> = std::fs::read_dir(parent.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        prop_assert_eq!(top.len(), 2, "{:?}", top);
        let mut all = Vec::new();
        walk(&root, &mut all);
        for (path, kind) in all {
            if path == root.join("link") {
                continue;
            }
            prop_assert!(!kind.is_symlink(), "{}", path.display());
            if kind.is_file() {
                let name = path.strip_prefix(&root).unwrap().to_str().unwrap().to_string();
                prop_assert_eq!(Some(&std::fs::read(&path).unwrap()), files.get(&name));
            }
        }
    }
}
