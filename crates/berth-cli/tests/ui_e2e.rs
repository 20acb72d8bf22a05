//! The web UI in a real browser: headless Debian `chromium` driven through `chromedriver`
//! (WebDriver, fantoccini) against a real `berth server` process with real `berth-agent`s.
//! Each test saves screenshots at desktop and 390 px widths to `target/ui-screenshots/`.
//!
//! `scripts/test.sh` installs `chromium` and `chromium-driver`; without them these tests SKIP,
//! and FAIL under `CI=true` or `BERTH_REQUIRE_SERVICES=1`.

mod common;

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Variant};
use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

const DESKTOP: (u32, u32) = (1280, 900);
const PHONE: (u32, u32) = (390, 844);

/// A running chromedriver on a free loopback port, in a process group of its own with the
/// Chromium it starts: dropping it kills that group, so a failed test leaves no browser behind.
struct Driver {
    proc: Proc,
    url: String,
    /// One browser test at a time: a container another test starts adds a network interface,
    /// and Chromium aborts a navigation in flight when the host's interfaces change
    /// (`ERR_NETWORK_CHANGED`, seen in CI). Held for the test's whole life.
    _serial: std::sync::MutexGuard<'static, ()>,
    /// Chromium's profile and scratch directories (its TMPDIR): removed after the browser is
    /// killed, which leaves it no chance to remove them itself.
    _tmp: tempfile::TempDir,
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: signals the process group this test created for chromedriver (pgid = its pid).
        unsafe { libc::kill(-self.proc.pid(), libc::SIGKILL) };
    }
}

fn chromedriver(test: &str) -> Option<Driver> {
    // A test that failed while holding it poisons it; the next one still runs.
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let found = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let program = found.or_else(|| {
        berth_test_utils::require_service(
            test,
            "chromedriver is not installed (scripts/test.sh installs chromium-driver)",
        )
    })?;
    let port = free_port();
    let tmp = tempdir();
    let mut cmd = Command::new(program);
    cmd.env("TMPDIR", tmp.path())
        .arg(format!("--port={port}"))
        .arg("--allowed-ips=127.0.0.1")
        .process_group(0);
    let mut proc = Proc::spawn("chromedriver", cmd);
    wait_for(SETTLE, "chromedriver to listen", || {
        proc.assert_running();
        TcpStream::connect(("127.0.0.1", port))
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    Some(Driver {
        proc,
        url: format!("http://127.0.0.1:{port}"),
        _serial: serial,
        _tmp: tmp,
    })
}

/// A headless Chromium session. The server's certificate is from berth's own CA, which this
/// throwaway browser profile does not know: the session accepts it (`acceptInsecureCerts`).
async fn browser(driver: &Driver) -> Client {
    let (w, h) = DESKTOP;
    let caps = json!({
        "acceptInsecureCerts": true,
        "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--ignore-certificate-errors", format!("--window-size={w},{h}")],
        }
    });
    let Value::Object(caps) = caps else {
        unreachable!()
    };
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a chromium session")
}

fn screenshot_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is <target>/tmp.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .map(|p| p.join("ui-screenshots"))
        .unwrap_or_else(|| PathBuf::from("ui-screenshots"));
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    dir
}

/// Saves the current page at desktop and phone widths as `<name>-desktop.png`, `<name>-390.png`.
async fn screenshots(client: &Client, name: &str) {
    let dir = screenshot_dir();
    for ((w, h), suffix) in [(DESKTOP, "desktop"), (PHONE, "390")] {
        client.set_window_size(w, h).await.expect("resize");
        let png = client.screenshot().await.expect("screenshot");
        std::fs::write(dir.join(format!("{name}-{suffix}.png")), png).expect("write screenshot");
    }
    client
        .set_window_size(DESKTOP.0, DESKTOP.1)
        .await
        .expect("resize back");
}

/// Polls `check` (a JS expression's value) until it is true or the deadline passes.
async fn wait_js(client: &Client, what: &str, script: &str) -> Value {
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        let value = client
            .execute(&format!("return {script};"), vec![])
            .await
            .expect("execute");
        if value.as_bool() == Some(true) || (!value.is_null() && value.as_bool().is_none()) {
            return value;
        }
        if std::time::Instant::now() >= deadline {
            let text = client
                .execute("return document.body.innerText;", vec![])
                .await
                .unwrap_or_default();
            panic!("timed out waiting for {what}: {script} is {value}; the page says: {text}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn sign_in(client: &Client, server: &Server, token: &str) {
    // WebDriver's find does not wait, and on a loaded machine a first navigation can end on
    // the browser's own error page: look for the form for a while, then load the page again.
    let mut ready = false;
    for _ in 0..3 {
        client
            .goto(&format!("{}/login", server.url))
            .await
            .expect("login page");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !ready && std::time::Instant::now() < deadline {
            let found = client
                .execute("return !!document.querySelector('#token');", vec![])
                .await
                .expect("execute");
            ready = found == Value::Bool(true);
            if !ready {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if ready {
            break;
        }
    }
    if !ready {
        let text = client
            .execute("return document.body.innerText;", vec![])
            .await
            .unwrap_or_default();
        panic!("no sign-in form after three loads; the page says: {text}");
    }
    client
        .find(Locator::Css("#token"))
        .await
        .expect("token field")
        .send_keys(token)
        .await
        .expect("type the token");
    client
        .find(Locator::Css("form button[type=submit]"))
        .await
        .expect("sign-in button")
        .click()
        .await
        .expect("sign in");
    wait_js(
        client,
        "the overview",
        "document.querySelector('h1') && document.querySelector('h1').textContent === 'Overview'",
    )
    .await;
}

fn api_token(server: &Server, role: &str) -> String {
    let created = server.cli(&["api-token", "create", "--role", role, "--name", role]);
    str_of(&created, "token").to_string()
}

/// The newest event id the API has for the admin's tenant.
fn latest_event(server: &Server) -> u64 {
    let out = Command::new("curl")
        .args(["-sS", "-k", "--max-time", "30", "-H"])
        .arg(format!("Authorization: Bearer {}", server.admin_token))
        .arg(format!("{}/api/v1/events?follow=false", server.url))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .filter_map(|id| id.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn sign_in_and_watch_an_agent_come_online() {
    let Some(driver) = chromedriver("sign_in_and_watch_an_agent_come_online") else {
        return;
    };
    let dir = tempdir();
    let server = Server::start(&dir.path().join("data"), &[]);
    let client = browser(&driver).await;
    sign_in(&client, &server, &server.admin_token).await;
    screenshots(&client, "overview").await;

    client
        .goto(&format!("{}/agents", server.url))
        .await
        .expect("agents");
    wait_js(
        &client,
        "the live stream",
        "document.getElementById('main').dataset.stream === 'open'",
    )
    .await;
    // A reload would lose this mark: the agent must appear without one.
    client
        .execute("window.berthMark = 1; return true;", vec![])
        .await
        .expect("mark");
    let agent = Agent::register(
        &server,
        dir.path(),
        "web-1",
        &["--labels", "role=web,zone=eu-1"],
    );
    let online = format!(
        "!!document.querySelector('tr[data-agent=\"{}\"] .badge[data-state=\"online\"]')",
        agent.id
    );
    wait_js(&client, "the agent online in the list", &online).await;
    let mark = client
        .execute("return window.berthMark === 1;", vec![])
        .await
        .expect("mark");
    assert_eq!(mark, Value::Bool(true), "the page was not reloaded");
    screenshots(&client, "agents").await;

    client
        .goto(&format!("{}/agents/{}", server.url, agent.id))
        .await
        .expect("agent page");
    wait_js(
        &client,
        "the usage chart",
        "!!document.querySelector('svg.chart') || !!document.querySelector('main p.muted')",
    )
    .await;
    screenshots(&client, "agent").await;
    client.close().await.expect("close");
}

#[tokio::test]
async fn hostile_labels_render_as_text() {
    let Some(driver) = chromedriver("hostile_labels_render_as_text") else {
        return;
    };
    let dir = tempdir();
    let server = Server::start(&dir.path().join("data"), &[]);
    let script = "<script>window.berthOwned=1</script>";
    let img = "\"><img src=x onerror=window.berthOwned=2>";
    let labels = format!("a={script},b={img}");
    let agent = Agent::register(&server, dir.path(), "hostile", &["--labels", &labels]);
    let client = browser(&driver).await;
    sign_in(&client, &server, &server.admin_token).await;
    for path in ["/agents".to_string(), format!("/agents/{}", agent.id)] {
        client
            .goto(&format!("{}{path}", server.url))
            .await
            .expect("page");
        let chips = client
            .find_all(Locator::Css("main .chip"))
            .await
            .expect("chips");
        let mut texts = Vec::new();
        for chip in chips {
            texts.push(chip.text().await.expect("chip text"));
        }
        assert!(texts.contains(&format!("a={script}")), "{path}: {texts:?}");
        assert!(texts.contains(&format!("b={img}")), "{path}: {texts:?}");
        let injected = client
            .execute(
                "return document.querySelectorAll('main img, main script').length + ':' + (window.berthOwned || 0);",
                vec![],
            )
            .await
            .expect("inspect");
        assert_eq!(injected, Value::String("0:0".into()), "{path}");
    }
    screenshots(&client, "hostile-labels").await;
    client.close().await.expect("close");
}

#[tokio::test]
async fn a_viewer_has_no_deploy_buttons_and_forged_posts_are_refused() {
    let Some(driver) = chromedriver("a_viewer_has_no_deploy_buttons_and_forged_posts_are_refused")
    else {
        return;
    };
    let dir = tempdir();
    let server = Server::start(&dir.path().join("data"), &[]);
    server.cli(&[
        "env",
        "create",
        "web",
        "--tier",
        "dev",
        "--selector",
        "role=web",
    ]);
    let _agent = Agent::register(&server, dir.path(), "web-1", &["--labels", "role=web"]);
    let viewer = api_token(&server, "viewer");

    let client = browser(&driver).await;
    sign_in(&client, &server, &viewer).await;
    client
        .goto(&format!("{}/environments/web", server.url))
        .await
        .expect("environment");
    let buttons = client
        .find_all(Locator::Css("[data-action]"))
        .await
        .expect("buttons");
    assert!(
        buttons.is_empty(),
        "a viewer sees no deploy, rollback or approve button"
    );
    screenshots(&client, "environment-viewer").await;

    // Forged from the page itself, with the session cookie: without the CSRF token, and with it
    // (the viewer's own, taken from the sign-out form): both refused, nothing created.
    let forge = r#"
        const done = arguments[arguments.length - 1];
        const csrf = document.querySelector('input[name=csrf]').value;
        const post = (body) => fetch('/environments/web/deploy', {method: 'POST', body: new URLSearchParams(body)})
            .then(async (r) => r.status + ' ' + ((await r.text()).match(/CSRF_INVALID|FORBIDDEN/) || [''])[0]);
        Promise.all([post({release: 'r1'}), post({release: 'r1', csrf})]).then(done);
    "#;
    let answers = client.execute_async(forge, vec![]).await.expect("forge");
    assert_eq!(
        answers,
        json!(["403 CSRF_INVALID", "403 FORBIDDEN"]),
        "the forged POSTs"
    );
    let deployments = server.cli(&["deployment", "ls"]);
    assert_eq!(
        deployments["items"].as_array().map(Vec::len).unwrap_or(0),
        0,
        "{deployments}"
    );

    // A deployer sees the form.
    let deployer = api_token(&server, "deployer");
    let client2 = browser(&driver).await;
    sign_in(&client2, &server, &deployer).await;
    client2
        .goto(&format!("{}/environments/web", server.url))
        .await
        .expect("environment");
    client2
        .find(Locator::Css("[data-action=plan]"))
        .await
        .expect("a deployer has the plan button");
    screenshots(&client2, "environment-deployer").await;
    client.close().await.expect("close");
    client2.close().await.expect("close");
}

#[tokio::test]
async fn a_server_restart_loses_no_event() {
    let Some(driver) = chromedriver("a_server_restart_loses_no_event") else {
        return;
    };
    let dir = tempdir();
    let data = dir.path().join("data");
    let mut server = Server::start(&data, &[]);
    let listen = server
        .url
        .strip_prefix("https://")
        .expect("https url")
        .to_string();
    let client = browser(&driver).await;
    sign_in(&client, &server, &server.admin_token).await;
    client
        .goto(&format!("{}/agents", server.url))
        .await
        .expect("agents");
    wait_js(
        &client,
        "the live stream",
        "document.getElementById('main').dataset.stream === 'open'",
    )
    .await;
    let first = Agent::register(&server, dir.path(), "before", &[]);
    let before = latest_event(&server);
    let (seen_before, last_before) = received(&client, before).await;

    server.proc.terminate();
    wait_js(
        &client,
        "the stream to notice",
        "document.getElementById('main').dataset.stream === 'reconnecting'",
    )
    .await;
    let server = Server::start_at(&data, &listen, &[], Some(&server.admin_token));
    // Changes made before the page has reconnected: the resumed stream must deliver each.
    let second = Agent::register(&server, dir.path(), "after", &[]);
    let after = latest_event(&server);
    assert!(after > before);
    let (seen, last) = received(&client, after).await;
    assert_eq!(
        seen - seen_before,
        events_between(&server, last_before, last),
        "every event after {last_before} up to {last} arrived, once"
    );
    let row = format!(
        "!!document.querySelector('tr[data-agent=\"{}\"]')",
        second.id
    );
    wait_js(&client, "the new agent listed", &row).await;
    screenshots(&client, "agents-after-restart").await;
    drop(first);
    client.close().await.expect("close");
}

/// Waits until the page has received event `id` (or a later one); then how many events it has
/// received and the last one's id, read together.
async fn received(client: &Client, id: u64) -> (u64, u64) {
    let main = "document.getElementById('main').dataset";
    wait_js(
        client,
        &format!("event {id} in the page"),
        &format!("Number({main}.lastEvent || 0) >= {id}"),
    )
    .await;
    let pair = client
        .execute(
            &format!("return [Number({main}.events), Number({main}.lastEvent)];"),
            vec![],
        )
        .await
        .expect("counts");
    let n = |i: usize| pair[i].as_u64().expect("a number");
    (n(0), n(1))
}

/// How many events the API has with ids in `(after, upto]`.
fn events_between(server: &Server, after: u64, upto: u64) -> u64 {
    let out = Command::new("curl")
        .args(["-sS", "-k", "--max-time", "30", "-H"])
        .arg(format!("Authorization: Bearer {}", server.admin_token))
        .arg(format!(
            "{}/api/v1/events?follow=false&after={after}",
            server.url
        ))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .filter_map(|id| id.trim().parse::<u64>().ok())
        .filter(|id| *id <= upto)
        .count() as u64
}

/// Registers a Docker agent (the host's engine) named `name` with `labels`, online with docker.
fn docker_target(server: &Server, root: &std::path::Path, name: &str, labels: &[String]) -> Agent {
    let agent = Agent::spawn_registered(server, root, name, &[], |dir, args| {
        let mut cmd = command(BERTH_AGENT);
        cmd.arg("--state-dir").arg(dir).args(args);
        cmd
    });
    let mut args = vec!["agents", "label", agent.id.as_str()];
    args.extend(labels.iter().map(String::as_str));
    server.cli(&args);
    server.wait_agent(&agent.id, "online with docker", |a| {
        a["status"] == "online"
            && a["capabilities"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["name"] == "docker"))
    });
    agent
}

#[tokio::test]
async fn deploy_from_the_form_approve_as_another_user_and_watch_it_go_green() {
    const TEST: &str = "deploy_from_the_form_approve_as_another_user_and_watch_it_go_green";
    let Some(env) = fixtures::env(TEST) else {
        return;
    };
    let Some(driver) = chromedriver(TEST) else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let prefix = cleanup.prefix.clone();
    let dir = tempdir();
    let server = Server::start(&dir.path().join("data"), &[]);
    let port = free_port();
    let _agent = docker_target(
        &server,
        dir.path(),
        "web-1",
        &["app=web".into(), format!("port={port}")],
    );
    let image = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let config = json!({
        "containerName": format!("{prefix}-{{{{target.name}}}}"),
        "ports": ["127.0.0.1:{{target.labels.port}}:8080/tcp"],
        "restartPolicy": "no",
        "healthCheck": {"type": "http", "interval": 1,
                        "url": "http://127.0.0.1:{{target.labels.port}}/"},
    });
    server.cli(&[
        "release",
        "create",
        "r1",
        "--image",
        &format!("web={}", image.reference()),
        "--config",
        &format!("web={config}"),
    ]);
    server.cli(&[
        "env",
        "create",
        "web",
        "--tier",
        "dev",
        "--selector",
        "app=web",
        "--approvals",
        "1",
    ]);

    // The first deployer plans, then confirms, from the environment's page.
    let alice = browser(&driver).await;
    sign_in(&alice, &server, &api_token(&server, "deployer")).await;
    alice
        .goto(&format!("{}/environments/web", server.url))
        .await
        .expect("environment");
    alice
        .find(Locator::Css("#release"))
        .await
        .expect("release field")
        .send_keys("r1")
        .await
        .expect("type");
    alice
        .find(Locator::Css("[data-action=plan]"))
        .await
        .expect("plan button")
        .click()
        .await
        .expect("plan");
    wait_js(&alice, "the plan", "!!document.querySelector('ol.waves')").await;
    screenshots(&alice, "deploy-plan").await;
    alice
        .find(Locator::Css("[data-action=deploy]"))
        .await
        .expect("confirm button")
        .click()
        .await
        .expect("deploy");
    wait_js(
        &alice,
        "the deployment awaiting approval",
        "!!document.querySelector('main .badge[data-state=awaiting_approval]')",
    )
    .await;
    let url = alice.current_url().await.expect("url").to_string();
    assert!(
        alice
            .find_all(Locator::Css("[data-action=approve]"))
            .await
            .expect("find")
            .is_empty(),
        "the requester has no approve button"
    );
    wait_js(
        &alice,
        "the live stream",
        "document.getElementById('main').dataset.stream === 'open'",
    )
    .await;
    alice
        .execute("window.berthMark = 1; return true;", vec![])
        .await
        .expect("mark");

    // A second deployer approves; the first one's page follows the rollout live.
    let bob = browser(&driver).await;
    sign_in(&bob, &server, &api_token(&server, "deployer")).await;
    bob.goto(&url).await.expect("deployment");
    bob.find(Locator::Css("[data-action=approve]"))
        .await
        .expect("approve button")
        .click()
        .await
        .expect("approve");
    wait_js(
        &alice,
        "the target to turn green",
        "!!document.querySelector('ul.targets .badge[data-state=succeeded]') \
         && !!document.querySelector('dl .badge[data-state=succeeded]') \
         && !!document.querySelector('svg.timeline rect[data-phase=succeeded]')",
    )
    .await;
    let mark = alice
        .execute("return window.berthMark === 1;", vec![])
        .await
        .expect("mark");
    assert_eq!(mark, Value::Bool(true), "followed live, without a reload");
    screenshots(&alice, "deployment-succeeded").await;
    alice.close().await.expect("close");
    bob.close().await.expect("close");
    drop(cleanup);
}

/// Readiness verified from the environment's page; then a rollout that fails on its second
/// target: the page follows it live to `rolled_back`, with
/// the failing target's code and the redacted tail of its task's log; then the agent's page
/// shows its session generation and the stickers an `inspect` read back, and the audit export
/// downloaded from the UI verifies offline with `berth audit verify`.
#[tokio::test]
async fn a_failed_deployment_rolls_back_live_and_the_audit_export_verifies() {
    const TEST: &str = "a_failed_deployment_rolls_back_live_and_the_audit_export_verifies";
    let Some(env) = fixtures::env(TEST) else {
        return;
    };
    let Some(driver) = chromedriver(TEST) else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let prefix = cleanup.prefix.clone();
    let dir = tempdir();
    let server = Server::start(&dir.path().join("data"), &[]);
    // web-1's health check reaches its own container; web-2's a port nobody listens on.
    let (port1, port2) = (free_port(), free_port());
    let first = docker_target(
        &server,
        dir.path(),
        "web-1",
        &[
            "app=web".into(),
            format!("port={port1}"),
            format!("health={port1}"),
        ],
    );
    let _second = docker_target(
        &server,
        dir.path(),
        "web-2",
        &["app=web".into(), format!("port={port2}"), "health=9".into()],
    );
    let image = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    for (release, health) in [("r1", "port"), ("r2", "health")] {
        let config = json!({
            "containerName": format!("{prefix}-{{{{target.name}}}}"),
            "ports": ["127.0.0.1:{{target.labels.port}}:8080/tcp"],
            "restartPolicy": "no",
            "healthCheck": {"type": "http", "interval": 1,
                            "url": format!("http://127.0.0.1:{{{{target.labels.{health}}}}}/")},
        });
        server.cli(&[
            "release",
            "create",
            release,
            "--image",
            &format!("web={}", image.reference()),
            "--config",
            &format!("web={config}"),
        ]);
    }
    server.cli(&[
        "env",
        "create",
        "web",
        "--tier",
        "dev",
        "--selector",
        "app=web",
        "--max-parallel",
        "1",
        "--health-timeout",
        "5",
    ]);
    let (code, out, err) = server.run_as(
        &server.admin_token,
        &["deploy", "r1", "--env", "web", "--wait"],
        SETTLE,
    );
    assert_eq!(code, 0, "deploy r1: {out}\n{err}");

    let client = browser(&driver).await;
    sign_in(&client, &server, &server.admin_token).await;
    client
        .goto(&format!("{}/environments/web", server.url))
        .await
        .expect("environment");
    // Readiness: "Verify now" runs a fresh pass; the page follows it live until the nonce is
    // answered, with all seven conditions true.
    client
        .find(Locator::Css("[data-action=verify]"))
        .await
        .expect("verify button")
        .click()
        .await
        .expect("verify");
    wait_js(
        &client,
        "the verify answered, every condition true",
        "document.body.textContent.includes('the last verify was answered') \
         && document.querySelectorAll('table.conditions tr[data-condition] .badge[data-state=succeeded]').length === 7",
    )
    .await;
    screenshots(&client, "environment-readiness").await;
    client
        .find(Locator::Css("#release"))
        .await
        .expect("release field")
        .send_keys("r2")
        .await
        .expect("type");
    client
        .find(Locator::Css("[data-action=plan]"))
        .await
        .expect("plan button")
        .click()
        .await
        .expect("plan");
    wait_js(&client, "the plan", "!!document.querySelector('ol.waves')").await;
    client
        .find(Locator::Css("[data-action=deploy]"))
        .await
        .expect("confirm button")
        .click()
        .await
        .expect("deploy");
    wait_js(
        &client,
        "the deployment's page, live",
        "document.querySelector('h1').textContent.startsWith('Deployment') \
         && document.getElementById('main').dataset.stream === 'open'",
    )
    .await;
    client
        .execute("window.berthMark = 1; return true;", vec![])
        .await
        .expect("mark");
    for (what, selector) in [
        (
            "the deployment rolled back",
            "dl .badge[data-state=rolled_back]",
        ),
        (
            "a target rolled back",
            "ul.targets .badge[data-state=rolled_back]",
        ),
        (
            "a failed task's code",
            "ul.targets details.log code.failure",
        ),
        ("its log's tail", "ul.targets details.log pre"),
    ] {
        wait_js(
            &client,
            what,
            &format!("!!document.querySelector({})", json!(selector)),
        )
        .await;
    }
    let mark = client
        .execute("return window.berthMark === 1;", vec![])
        .await
        .expect("mark");
    assert_eq!(mark, Value::Bool(true), "followed live, without a reload");
    let codes = client
        .execute(
            "return Array.from(document.querySelectorAll('ul.targets code.failure')).map(c => c.textContent);",
            vec![],
        )
        .await
        .expect("codes");
    assert!(
        codes.to_string().contains("HEALTH_CHECK_FAILED"),
        "the failing target's code: {codes}"
    );
    screenshots(&client, "deployment-rolled-back").await;
    client.goto(&server.url).await.expect("overview");
    wait_js(
        &client,
        "the environment on the overview",
        "document.body.textContent.includes('r1')",
    )
    .await;
    screenshots(&client, "overview-after-rollback").await;

    // The agent's page: its session generation, and the stickers an inspect read back.
    server.cli(&[
        "task",
        "create",
        "--agent",
        first.id.as_str(),
        "--type",
        "inspect",
        "--wait",
    ]);
    client
        .goto(&format!("{}/agents/{}", server.url, first.id))
        .await
        .expect("agent page");
    let facts = client
        .execute(
            "return document.querySelector('dl.facts').textContent;",
            vec![],
        )
        .await
        .expect("facts");
    assert!(
        facts.to_string().contains("Session generation1"),
        "the generation of its one session: {facts}"
    );
    let sticker = format!("{prefix}-web-1");
    wait_js(
        &client,
        "its sticker",
        &format!(
            "Array.from(document.querySelectorAll('section[aria-labelledby=stickers] td')).some(td => td.textContent === {})",
            json!(sticker)
        ),
    )
    .await;
    screenshots(&client, "agent-stickers").await;

    // The audit export, as the browser downloads it, verifies offline.
    client
        .goto(&format!("{}/audit", server.url))
        .await
        .expect("audit page");
    let export = client
        .execute_async(
            "const done = arguments[arguments.length - 1]; \
             fetch(document.querySelector('a[download]').href).then(r => r.text()).then(done);",
            vec![],
        )
        .await
        .expect("export");
    let export = export.as_str().expect("the export's text");
    assert!(export.lines().count() > 5, "{export}");
    let file = dir.path().join("audit.jsonl");
    std::fs::write(&file, export).expect("write the export");
    let ca = dir.path().join("data").join("ca.crt");
    let (code, out, err) = server.run_as(
        &server.admin_token,
        &[
            "audit",
            "verify",
            file.to_str().unwrap(),
            "--ca",
            ca.to_str().unwrap(),
        ],
        SETTLE,
    );
    assert_eq!(code, 0, "berth audit verify: {out}\n{err}");
    client.close().await.expect("close");
    drop(cleanup);
}
