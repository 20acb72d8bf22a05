//! Tidy checks on the dependency graph, in the manner of rust-analyzer's tidy tests: the
//! architecture's invariants about who may depend on what, read from `cargo metadata` and
//! enforced on every test run.
//!
//! - `berth-proto` knows nothing about I/O: no tokio, hyper, axum or sqlx among its normal
//!   dependencies, direct or transitive.
//! - `berth-agent` never depends on `berth-store` or `berth-server`.
//! - `berth-bundle` (the agent unpacks bundles with it) stays synchronous and client-side: no
//!   tokio, `berth-store`, `berth-server` or `berth-client`.
//! - One crypto provider: `ring` is nowhere in the graph, whatever the dependency kind.
//! - Library crates return typed errors: no `anyhow` among their normal dependencies (the
//!   binaries `berth-cli` and `berth-bench` may use it).
//!
//! `cargo metadata` lists optional dependencies that only a weak feature (`dep?/feature`)
//! names, although nothing builds them (rust-lang/cargo#10801): `rustls-webpki` lists `ring`
//! that way. An edge to an optional dependency therefore counts only when an enabled feature of
//! its dependent turns it on.
//!
//! Each rule is proven able to fail by a test on a hand-made graph below.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

/// The workspace's library crates; `berth-cli` and `berth-bench` are binaries here.
const LIBRARY_CRATES: &[&str] = &[
    "berth-proto",
    "berth-crypto",
    "berth-store",
    "berth-client",
    "berth-exec",
    "berth-server",
    "berth-agent",
    "berth-bundle",
];

const PROTO_FORBIDDEN: &[&str] = &["tokio", "hyper", "axum", "sqlx"];
const AGENT_FORBIDDEN: &[&str] = &["berth-store", "berth-server"];
const BUNDLE_FORBIDDEN: &[&str] = &["tokio", "berth-store", "berth-server", "berth-client"];

/// The resolved graph: package ids to names, and each package's built dependency edges with
/// whether any of them is a normal (not dev, not build) dependency.
struct Graph {
    names: BTreeMap<String, String>,
    /// package id -> [(dependency id, is a normal dependency)]
    edges: BTreeMap<String, Vec<(String, bool)>>,
    members: BTreeMap<String, String>,
}

impl Graph {
    fn from_metadata(metadata: &Value) -> Graph {
        let packages: BTreeMap<&str, &Value> = metadata["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .map(|p| (p["id"].as_str().expect("package id"), p))
            .collect();
        let names: BTreeMap<String, String> = packages
            .iter()
            .map(|(id, p)| (id.to_string(), p["name"].as_str().unwrap().to_string()))
            .collect();
        let mut edges = BTreeMap::new();
        for node in metadata["resolve"]["nodes"].as_array().expect("resolve") {
            let id = node["id"].as_str().expect("node id");
            let package = packages[id];
            let enabled: BTreeSet<&str> = node["features"]
                .as_array()
                .map(|f| f.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut out = Vec::new();
            for dep in node["deps"].as_array().into_iter().flatten() {
                let dep_id = dep["pkg"].as_str().expect("dep pkg");
                let dep_name = &names[dep_id];
                if !activated(package, &enabled, dep_name) {
                    continue;
                }
                let normal = dep["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["kind"].is_null());
                out.push((dep_id.to_string(), normal));
            }
            edges.insert(id.to_string(), out);
        }
        let members = metadata["workspace_members"]
            .as_array()
            .expect("workspace_members")
            .iter()
            .filter_map(Value::as_str)
            .map(|id| (names[id].clone(), id.to_string()))
            .collect();
        Graph {
            names,
            edges,
            members,
        }
    }

    /// Names of every package reachable from `name` over normal dependencies.
    fn normal_closure(&self, name: &str) -> BTreeSet<&str> {
        let Some(start) = self.members.get(name) else {
            return BTreeSet::new();
        };
        let mut seen = BTreeSet::new();
        let mut stack = vec![start.as_str()];
        while let Some(id) = stack.pop() {
            for (dep, normal) in self.edges.get(id).into_iter().flatten() {
                if *normal && seen.insert(dep.as_str()) {
                    stack.push(dep);
                }
            }
        }
        seen.iter().map(|id| self.names[*id].as_str()).collect()
    }

    /// Names of every package some member reaches over built edges of any kind.
    fn all_reachable(&self) -> BTreeSet<&str> {
        let mut seen: BTreeSet<&str> = self.members.values().map(String::as_str).collect();
        let mut stack: Vec<&str> = seen.iter().copied().collect();
        while let Some(id) = stack.pop() {
            for (dep, _) in self.edges.get(id).into_iter().flatten() {
                if seen.insert(dep.as_str()) {
                    stack.push(dep);
                }
            }
        }
        seen.iter().map(|id| self.names[*id].as_str()).collect()
    }
}

/// Whether `package` builds its dependency on `dep_name`: always when some declaration of it
/// is not optional; otherwise only when an enabled feature turns it on (`dep_name` itself, or a
/// feature listing `dep:dep_name` or `dep_name/…`; a weak `dep_name?/…` does not).
fn activated(package: &Value, enabled: &BTreeSet<&str>, dep_name: &str) -> bool {
    let declarations: Vec<&Value> = package["dependencies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d["name"] == dep_name)
        .collect();
    if declarations.is_empty() || declarations.iter().any(|d| d["optional"] != true) {
        return true;
    }
    let local: BTreeSet<&str> = declarations
        .iter()
        .map(|d| d["rename"].as_str().unwrap_or(dep_name))
        .collect();
    enabled.iter().any(|feature| {
        local.contains(feature)
            || package["features"][*feature]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .any(|item| {
                    local
                        .iter()
                        .any(|l| item == format!("dep:{l}") || item.starts_with(&format!("{l}/")))
                })
    })
}

/// Every violation of the rules in the module doc, one line each.
fn violations(metadata: &Value) -> Vec<String> {
    let graph = Graph::from_metadata(metadata);
    let mut found = Vec::new();
    let proto = graph.normal_closure("berth-proto");
    for forbidden in PROTO_FORBIDDEN {
        if proto.contains(forbidden) {
            found.push(format!("berth-proto depends on {forbidden}"));
        }
    }
    let agent = graph.normal_closure("berth-agent");
    for forbidden in AGENT_FORBIDDEN {
        if agent.contains(forbidden) {
            found.push(format!("berth-agent depends on {forbidden}"));
        }
    }
    let bundle = graph.normal_closure("berth-bundle");
    for forbidden in BUNDLE_FORBIDDEN {
        if bundle.contains(forbidden) {
            found.push(format!("berth-bundle depends on {forbidden}"));
        }
    }
    if graph.all_reachable().contains("ring") {
        found.push("ring is in the dependency graph".to_string());
    }
    for library in LIBRARY_CRATES {
        if graph.normal_closure(library).contains("anyhow") {
            found.push(format!("library crate {library} depends on anyhow"));
        }
    }
    found
}

fn cargo_metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--manifest-path",
        ])
        .arg(&manifest)
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata JSON")
}

#[test]
fn the_dependency_graph_keeps_the_architecture() {
    let found = violations(&cargo_metadata());
    assert!(
        found.is_empty(),
        "the dependency graph breaks ARCHITECTURE.md's invariants:\n  {}",
        found.join("\n  ")
    );
}

// ---------------------------------------------------------------------------------------------
// The checker on hand-made graphs: every rule can fire.
// ---------------------------------------------------------------------------------------------

/// A package description: (name, [(dependency, kind, optional)], enabled features, feature map).
type Package<'a> = (
    &'a str,
    Vec<(&'a str, Option<&'a str>, bool)>,
    Vec<&'a str>,
    Value,
);

/// Metadata for `packages`; every `berth-*` package is a workspace member.
fn metadata(packages: Vec<Package<'_>>) -> Value {
    let id = |name: &str| format!("path+file:///{name}#0.1.0");
    let mut manifests = Vec::new();
    let mut nodes = Vec::new();
    for (name, deps, enabled, features) in &packages {
        manifests.push(json!({
            "id": id(name),
            "name": name,
            "features": features,
            "dependencies": deps.iter().map(|(d, kind, optional)| json!({
                "name": d, "kind": kind, "optional": optional, "rename": null,
            })).collect::<Vec<_>>(),
        }));
        nodes.push(json!({
            "id": id(name),
            "features": enabled,
            "deps": deps.iter().map(|(d, kind, _)| json!({
                "name": d.replace('-', "_"),
                "pkg": id(d),
                "dep_kinds": [{"kind": kind, "target": null}],
            })).collect::<Vec<_>>(),
        }));
    }
    let members: Vec<String> = packages
        .iter()
        .filter(|(name, ..)| name.starts_with("berth-"))
        .map(|(name, ..)| id(name))
        .collect();
    json!({"packages": manifests, "workspace_members": members, "resolve": {"nodes": nodes}})
}

fn leaf(name: &str) -> Package<'_> {
    (name, vec![], vec![], json!({}))
}

/// The rules' happy shape: proto on serde, the agent on the client, the server on the store.
fn clean() -> Vec<Package<'static>> {
    vec![
        (
            "berth-proto",
            vec![("serde", None, false)],
            vec![],
            json!({}),
        ),
        (
            "berth-client",
            vec![("berth-proto", None, false), ("tokio", None, false)],
            vec![],
            json!({}),
        ),
        (
            "berth-agent",
            vec![("berth-client", None, false)],
            vec![],
            json!({}),
        ),
        (
            "berth-store",
            vec![("sqlx", None, false)],
            vec![],
            json!({}),
        ),
        (
            "berth-server",
            vec![("berth-store", None, false), ("anyhow", Some("dev"), false)],
            vec![],
            json!({}),
        ),
        (
            "berth-cli",
            vec![("berth-server", None, false), ("anyhow", None, false)],
            vec![],
            json!({}),
        ),
        // ring only behind a weak feature: listed by cargo metadata, never built.
        (
            "rustls-webpki",
            vec![("ring", None, true)],
            vec!["alloc"],
            json!({"alloc": ["ring?/alloc"], "ring": ["dep:ring"]}),
        ),
        (
            "sqlx",
            vec![("rustls-webpki", None, false)],
            vec![],
            json!({}),
        ),
        leaf("serde"),
        leaf("tokio"),
        leaf("anyhow"),
        leaf("ring"),
    ]
}

fn with(
    mut packages: Vec<Package<'static>>,
    name: &str,
    dep: &'static str,
    kind: Option<&'static str>,
) -> Vec<Package<'static>> {
    let package = packages.iter_mut().find(|p| p.0 == name).expect(name);
    package.1.push((dep, kind, false));
    if !packages.iter().any(|p| p.0 == dep) {
        packages.push(leaf(dep));
    }
    packages
}

#[test]
fn a_clean_graph_passes_and_dev_deps_and_weak_features_do_not_count() {
    assert_eq!(violations(&metadata(clean())), Vec::<String>::new());
}

#[test]
fn proto_reaching_io_crates_fails_directly_or_transitively() {
    for io in PROTO_FORBIDDEN {
        let found = violations(&metadata(with(clean(), "berth-proto", io, None)));
        assert_eq!(found, vec![format!("berth-proto depends on {io}")]);
    }
    // Transitively: proto -> serde -> tokio.
    let found = violations(&metadata(with(clean(), "serde", "tokio", None)));
    assert_eq!(found, vec!["berth-proto depends on tokio".to_string()]);
    // A dev-dependency is not a dependency of the library.
    assert!(violations(&metadata(with(
        clean(),
        "berth-proto",
        "tokio",
        Some("dev")
    )))
    .is_empty());
}

#[test]
fn the_agent_reaching_the_store_or_the_server_fails() {
    let found = violations(&metadata(with(
        clean(),
        "berth-agent",
        "berth-server",
        None,
    )));
    assert_eq!(
        found,
        vec![
            "berth-agent depends on berth-store".to_string(),
            "berth-agent depends on berth-server".to_string(),
        ]
    );
    let found = violations(&metadata(with(
        clean(),
        "berth-client",
        "berth-store",
        None,
    )));
    assert_eq!(
        found,
        vec!["berth-agent depends on berth-store".to_string()]
    );
}

#[test]
fn the_bundle_crate_reaching_async_or_server_crates_fails() {
    let mut packages = clean();
    packages.push((
        "berth-bundle",
        vec![("berth-proto", None, false)],
        vec![],
        json!({}),
    ));
    assert!(violations(&metadata(packages.clone())).is_empty());
    let found = violations(&metadata(with(
        packages.clone(),
        "berth-bundle",
        "berth-client",
        None,
    )));
    assert_eq!(
        found,
        vec![
            "berth-bundle depends on tokio".to_string(),
            "berth-bundle depends on berth-client".to_string(),
        ]
    );
    let found = violations(&metadata(with(packages, "berth-bundle", "anyhow", None)));
    assert_eq!(
        found,
        vec!["library crate berth-bundle depends on anyhow".to_string()]
    );
}

#[test]
fn ring_anywhere_fails_whatever_the_kind() {
    for kind in [None, Some("dev"), Some("build")] {
        let found = violations(&metadata(with(clean(), "berth-cli", "ring", kind)));
        assert_eq!(
            found,
            vec!["ring is in the dependency graph".to_string()],
            "{kind:?}"
        );
    }
    // The weak feature's optional dependency, once a feature really enables it.
    let mut packages = clean();
    packages
        .iter_mut()
        .find(|p| p.0 == "rustls-webpki")
        .unwrap()
        .2
        .push("ring");
    assert_eq!(
        violations(&metadata(packages)),
        vec!["ring is in the dependency graph".to_string()]
    );
}

#[test]
fn anyhow_in_a_library_crate_fails_and_every_violation_is_reported() {
    let found = violations(&metadata(with(clean(), "berth-server", "anyhow", None)));
    assert_eq!(
        found,
        vec!["library crate berth-server depends on anyhow".to_string()]
    );
    // Everything at once, in one report.
    let mut packages = with(clean(), "berth-proto", "hyper", None);
    packages = with(packages, "berth-agent", "berth-store", None);
    packages = with(packages, "sqlx", "ring", Some("build"));
    packages = with(packages, "berth-store", "anyhow", None);
    assert_eq!(
        violations(&metadata(packages)),
        vec![
            "berth-proto depends on hyper".to_string(),
            "berth-agent depends on berth-store".to_string(),
            "ring is in the dependency graph".to_string(),
            "library crate berth-store depends on anyhow".to_string(),
            "library crate berth-server depends on anyhow".to_string(),
            "library crate berth-agent depends on anyhow".to_string(),
        ]
    );
}
