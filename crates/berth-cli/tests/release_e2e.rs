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

// ---------------------------------------------------------------------------------------------
// A registry behind bearer-token auth: the real registry (`docker-registry`, the one
// `scripts/registry.sh` runs) configured with `auth.token`, and a token service in this test
// that checks basic credentials and signs ES256 tokens with a key the registry trusts.
// ---------------------------------------------------------------------------------------------

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use rcgen::PublicKeyData as _;

const SERVICE: &str = "berth-test-registry";
const ISSUER: &str = "berth-test-token-service";

/// The key id the registry looks a token's `kid` up by (libtrust's): base32 of the first 240
/// bits of sha256 over the key's SubjectPublicKeyInfo, in twelve groups of four.
fn libtrust_key_id(spki: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, spki);
    let bytes = &digest.as_ref()[..30];
    let mut bits = 0u64;
    let mut n = 0;
    let mut out = String::new();
    for b in bytes {
        bits = (bits << 8) | u64::from(*b);
        n += 8;
        while n >= 5 {
            n -= 5;
            out.push(ALPHABET[((bits >> n) & 31) as usize] as char);
        }
    }
    let groups: Vec<String> = out
        .as_bytes()
        .chunks(4)
        .map(|c| String::from_utf8(c.to_vec()).unwrap())
        .collect();
    groups.join(":")
}

/// Serves `GET /token?service=…&scope=…`: 401 without the right basic credentials, else a
/// token granting what the scope asks. Counts the tokens it issued.
fn token_service(user: &str, password: &str) -> (u16, String, Arc<AtomicUsize>) {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let signer =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref()).unwrap();
    let key = rcgen::KeyPair::try_from(pkcs8.as_ref()).unwrap();
    let cert = rcgen::CertificateParams::new(vec!["token-service".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let kid = libtrust_key_id(&key.subject_public_key_info());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let expected = format!("Basic {}", STANDARD.encode(format!("{user}:{password}")));
    let issued = Arc::new(AtomicUsize::new(0));
    let counter = issued.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let request = String::from_utf8_lossy(&request).to_string();
            let authorized = request.lines().any(|l| {
                l.to_ascii_lowercase().starts_with("authorization:") && l[14..].trim() == expected
            });
            let target = request
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_string();
            let scope = target
                .split(['?', '&'])
                .find_map(|p| p.strip_prefix("scope="))
                .map(|s| {
                    s.replace("%3A", ":")
                        .replace("%2F", "/")
                        .replace("%2C", ",")
                });
            let (status, body) = if authorized {
                let access: Vec<serde_json::Value> = scope
                    .iter()
                    .filter_map(|s| {
                        let mut parts = s.splitn(3, ':');
                        let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
                        Some(serde_json::json!({
                            "type": kind, "name": name,
                            "actions": actions.split(',').collect::<Vec<_>>(),
                        }))
                    })
                    .collect();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs();
                let header = serde_json::json!({"typ": "JWT", "alg": "ES256", "kid": kid});
                let claims = serde_json::json!({
                    "iss": ISSUER, "sub": "tester", "aud": SERVICE,
                    "iat": now, "nbf": now - 60, "exp": now + 300,
                    "jti": uuid::Uuid::new_v4().to_string(), "access": access,
                });
                let signing_input = format!(
                    "{}.{}",
                    URL_SAFE_NO_PAD.encode(header.to_string()),
                    URL_SAFE_NO_PAD.encode(claims.to_string())
                );
                let signature = signer
                    .sign(&SystemRandom::new(), signing_input.as_bytes())
                    .unwrap();
                let token = format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature));
                counter.fetch_add(1, Ordering::SeqCst);
                ("200 OK", serde_json::json!({ "token": token }).to_string())
            } else {
                (
                    "401 Unauthorized",
                    r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#.to_string(),
                )
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (port, cert.pem(), issued)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn bearer_token_registries_are_followed() {
    let Some(env) = fixtures::env("bearer_token_registries_are_followed") else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let tmp = tempdir();
    let (token_port, root_pem, issued) = token_service(&env.user, &env.password);
    let root = tmp.path().join("token-root.crt");
    std::fs::write(&root, root_pem).unwrap();
    let port = free_port();
    let config = tmp.path().join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\nauth:\n  token:\n    realm: http://127.0.0.1:{token_port}/token\n    service: {SERVICE}\n    issuer: {ISSUER}\n    rootcertbundle: {}\n",
            tmp.path().join("data").display(),
            root.display()
        ),
    )
    .unwrap();
    let mut registry_cmd = command("/usr/bin/docker-registry");
    registry_cmd.arg("serve").arg(&config);
    let _registry = Proc::spawn("docker-registry (token auth)", registry_cmd);
    wait_for(
        std::time::Duration::from_secs(30),
        "the token registry to listen",
        || {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .map(drop)
                .map_err(|e| e.to_string())
        },
    );
    let registry = format!("127.0.0.1:{port}");
    let image = make_image(
        &registry,
        &cleanup.prefix,
        "web",
        Variant::Healthy,
        "bearer v1",
        Some((&env.user, &env.password)),
    );
    let pushed = issued.load(Ordering::SeqCst);
    assert!(pushed > 0, "docker's push went through the token service");

    let server = Server::start(&tmp.path().join("server"), &[]);
    let tag = format!("web={}:t", image.repository);
    let release = server
        .try_cli_env(
            &server.admin_token,
            &["release", "create", "b1", "--image", &tag],
            &[
                ("BERTH_REGISTRY_USERNAME", env.user.as_str()),
                ("BERTH_REGISTRY_PASSWORD", env.password.as_str()),
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(component(&release, "web")["digest"], image.digest.as_str());
    assert!(
        issued.load(Ordering::SeqCst) > pushed,
        "the server asked the token service for its token"
    );
    refused(
        &server,
        &["release", "create", "b2", "--image", &tag],
        &[
            ("BERTH_REGISTRY_USERNAME", env.user.as_str()),
            ("BERTH_REGISTRY_PASSWORD", "not-the-password"),
        ],
        "REGISTRY_UNAUTHORIZED",
        "component web",
    );
}
