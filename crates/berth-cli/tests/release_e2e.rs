//! Releases end to end: `berth server` (SQLite, temp data dir), the admin CLI
//! (`berth release … -o json`) and the real local registries of `scripts/registry.sh`, one
//! open and one behind htpasswd basic auth. Images are made and pushed with the executor tests'
//! fixture (`berth_test_utils::docker::make_image`), whose `docker push` reports the digest the
//! server must resolve the tag to.
//!
//! Without an engine or the `BERTH_TEST_REGISTRY*` variables the test prints a SKIP line, except
//! under `CI=true` or `BERTH_REQUIRE_SERVICES=1`, where it fails.

#![cfg(unix)]

mod common;

use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Variant};
use common::*;
use serde_json::Value;

fn component<'a>(release: &'a Value, name: &str) -> &'a Value {
    release["components"]
        .as_array()
        .expect("components")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no component {name} in {release}"))
}

/// A refusal's stderr names its code (and the detail, the component).
fn refused(server: &Server, args: &[&str], env: &[(&str, &str)], code: &str, detail: &str) {
    let err = server
        .try_cli_env(&server.admin_token, args, env)
        .expect_err("the command must be refused");
    assert!(
        err.contains(code) && err.contains(detail),
        "expected {code} naming {detail:?}: {err}"
    );
}

#[test]
fn releases_pin_digests_from_the_registries() {
    let Some(env) = fixtures::env("releases_pin_digests_from_the_registries") else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let tmp = tempdir();
    let server = Server::start(&tmp.path().join("data"), &[]);
    let open = make_image(
        &env.registry,
        &cleanup.prefix,
        "web",
        Variant::Healthy,
        "web v1",
        None,
    );
    let private = make_image(
        &env.auth_registry,
        &cleanup.prefix,
        "api",
        Variant::Healthy,
        "api v1",
        Some((&env.user, &env.password)),
    );
    let web_tag = format!("web={}:t", open.repository);
    let api_tag = format!("api={}:t", private.repository);
    // Through the environment, as an operator should pass them: a failure prints the arguments.
    let creds = [
        ("BERTH_REGISTRY_USERNAME", env.user.as_str()),
        ("BERTH_REGISTRY_PASSWORD", env.password.as_str()),
    ];
    let cli_with_creds = |args: &[&str]| {
        server
            .try_cli_env(&server.admin_token, args, &creds)
            .unwrap_or_else(|e| panic!("{e}"))
    };

    // By tag, on both registries (the private one with basic credentials): the digests the
    // pushes reported, and nothing but digests.
    let r1 = cli_with_creds(&[
        "release",
        "create",
        "r1",
        "--image",
        &web_tag,
        "--image",
        &api_tag,
        "--config",
        r#"web={"containerName":"shop-web","ports":["8080:8080"]}"#,
    ]);
    let web = component(&r1, "web");
    assert_eq!(web["image"], open.repository.as_str());
    assert_eq!(web["digest"], open.digest.as_str());
    assert_eq!(web["resolvedFrom"], "t");
    assert_eq!(web["config"]["containerName"], "shop-web");
    let api = component(&r1, "api");
    assert_eq!(api["image"], private.repository.as_str());
    assert_eq!(api["digest"], private.digest.as_str());

    // By digest: checked against the registry, kept as given.
    let by_digest = format!("web={}", open.reference());
    let r2 = server.cli(&["release", "create", "r2", "--image", &by_digest]);
    assert_eq!(component(&r2, "web")["digest"], open.digest.as_str());
    assert!(component(&r2, "web")["resolvedFrom"].is_null());

    // Refusals, each with its code, none of which stores anything.
    let missing_tag = format!("web={}:missing", open.repository);
    refused(
        &server,
        &["release", "create", "r3", "--image", &missing_tag],
        &[],
        "DIGEST_UNRESOLVABLE",
        "component web",
    );
    let absent_digest = format!("web={}@sha256:{}", open.repository, "0".repeat(64));
    refused(
        &server,
        &["release", "create", "r3", "--image", &absent_digest],
        &[],
        "DIGEST_UNRESOLVABLE",
        "component web",
    );
    let private_only = format!("api={}:t", private.repository);
    refused(
        &server,
        &["release", "create", "r3", "--image", &private_only],
        &[
            ("BERTH_REGISTRY_USERNAME", env.user.as_str()),
            ("BERTH_REGISTRY_PASSWORD", "not-the-password"),
        ],
        "REGISTRY_UNAUTHORIZED",
        "component api",
    );
    refused(
        &server,
        &["release", "create", "r3", "--image", &private_only],
        &[],
        "REGISTRY_UNAUTHORIZED",
        "component api",
    );
    refused(
        &server,
        &["release", "create", "r1", "--image", &by_digest],
        &[],
        "RELEASE_EXISTS",
        "r1",
    );
    refused(
        &server,
        &["release", "show", "r3"],
        &[],
        "RELEASE_NOT_FOUND",
        "r3",
    );

    // A compose file: the lock pins every service by digest and lands beside the file.
    let compose = tmp.path().join("compose.yml");
    std::fs::write(
        &compose,
        format!(
            "services:\n  web:\n    image: {}:t\n    ports:\n      - \"8080:8080\"\n  api:\n    image: {}:t\n",
            open.repository, private.repository
        ),
    )
    .unwrap();
    let compose_arg = compose.display().to_string();
    let rc = cli_with_creds(&["release", "create", "r-compose", "--compose", &compose_arg]);
    let lock = std::fs::read_to_string(tmp.path().join("compose.yml.lock.yml")).expect("lock");
    assert_eq!(rc["composeLock"], lock.as_str());
    for image in [&open, &private] {
        assert!(
            lock.contains(&format!("image: {}", image.reference())),
            "{} pinned in the lock:\n{lock}",
            image.repository
        );
    }
    assert!(
        !lock.contains(":t\n"),
        "no tag is left in the lock:\n{lock}"
    );
    assert!(
        lock.contains("8080:8080"),
        "the rest of the file is kept:\n{lock}"
    );
    assert_eq!(component(&rc, "api")["digest"], private.digest.as_str());

    // ls and show.
    let listed = server.cli(&["release", "ls"]);
    let names: Vec<&str> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["r1", "r2", "r-compose"]);
    assert_eq!(server.cli(&["release", "show", "r1"]), r1);

    // Registry credentials are used, never kept: not in any release, not in the server's log.
    let everything = format!("{listed} {}", server.proc.stderr());
    assert!(!everything.contains(&env.password) && !everything.contains("not-the-password"));
}
