//! The web UI's rules without a browser, against an in-process server over real TLS: the
//! security headers on every UI response, sign-in making an expiring `__Host-` session cookie
//! and sign-out ending it, CSRF tokens checked on every POST (per session), the API's roles
//! deciding what a viewer may do, and every value escaped. `berth-cli/tests/ui_e2e.rs` drives
//! the same pages in Chromium.

mod common;

use std::collections::BTreeMap;

use berth_proto::admin::{CreateAgentToken, CreateApiToken, Role};
use reqwest::header::{CONTENT_SECURITY_POLICY, LOCATION, SET_COOKIE};
use reqwest::{Client, Response, StatusCode};

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
    connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

fn client(server: &common::TestServer) -> Client {
    let tls = berth_client::tls_config(&berth_client::Trust::CaPem(server.ca_pem.clone()), None)
        .expect("tls");
    Client::builder()
        .use_preconfigured_tls(tls)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

fn assert_security_headers(response: &Response) {
    let h = response.headers();
    assert_eq!(h[CONTENT_SECURITY_POLICY], CSP, "{}", response.url());
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["referrer-policy"], "no-referrer");
    assert_eq!(
        h["strict-transport-security"],
        "max-age=63072000; includeSubDomains"
    );
}

/// `name=value` of a `Set-Cookie` the response sets, with its attributes.
fn set_cookie(response: &Response, name: &str) -> Option<String> {
    response
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .map(str::to_string)
}

fn cookie_value(set_cookie: &str) -> String {
    set_cookie
        .split(';')
        .next()
        .and_then(|p| p.split_once('='))
        .map(|(_, v)| v.to_string())
        .unwrap_or_default()
}

/// The value of the first `name="csrf" value="…"` in a page.
fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    page[at..].split('"').next().unwrap_or_default().to_string()
}

/// A signed-in browser: its session cookie.
struct Browser {
    http: Client,
    base: String,
    session: String,
}

impl Browser {
    async fn sign_in(server: &common::TestServer, token: &str) -> Browser {
        let http = client(server);
        let (status, session) = sign_in(&http, &server.url, token).await;
        assert_eq!(status, StatusCode::SEE_OTHER);
        Browser {
            http,
            base: server.url.clone(),
            session: session.expect("a session cookie"),
        }
    }

    fn cookie(&self) -> String {
        format!("__Host-berth_session={}", self.session)
    }

    /// A GET of the API (no UI headers to check).
    async fn api(&self, path: &str) -> Response {
        self.http
            .get(format!("{}{path}", self.base))
            .header("cookie", self.cookie())
            .send()
            .await
            .expect("get")
    }

    async fn get(&self, path: &str) -> Response {
        let response = self.api(path).await;
        assert_security_headers(&response);
        response
    }

    async fn page(&self, path: &str) -> String {
        let response = self.get(path).await;
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        response.text().await.expect("body")
    }

    async fn post(&self, path: &str, form: &[(&str, &str)]) -> (StatusCode, String) {
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .header("cookie", self.cookie())
            .form(form)
            .send()
            .await
            .expect("post");
        assert_security_headers(&response);
        (response.status(), response.text().await.expect("body"))
    }
}

/// Signs in with `token`: the status and the session cookie's value, if one was set.
async fn sign_in(http: &Client, base: &str, token: &str) -> (StatusCode, Option<String>) {
    let form = http
        .get(format!("{base}/login"))
        .send()
        .await
        .expect("login page");
    let login = cookie_value(&set_cookie(&form, "__Host-berth_login").expect("login cookie"));
    let page = form.text().await.expect("body");
    let response = http
        .post(format!("{base}/login"))
        .header("cookie", format!("__Host-berth_login={login}"))
        .form(&[("token", token), ("csrf", &csrf_of(&page))])
        .send()
        .await
        .expect("sign in");
    assert_security_headers(&response);
    let session = set_cookie(&response, "__Host-berth_session").map(|c| {
        assert!(
            c.contains("; HttpOnly; Secure; SameSite=Strict; Path=/; Max-Age=43200"),
            "{c}"
        );
        cookie_value(&c)
    });
    (response.status(), session)
}

async fn api_token(server: &common::TestServer, role: Role, name: &str) -> String {
    server
        .admin()
        .send(&CreateApiToken {
            role,
            name: Some(name.to_string()),
        })
        .await
        .expect("api token")
        .token
}

#[tokio::test]
async fn every_ui_response_carries_the_security_headers() {
    let server = common::start().await;
    let http = client(&server);
    for path in ["/", "/agents", "/login", "/assets/nope.js"] {
        let response = http
            .get(format!("{}{path}", server.url))
            .send()
            .await
            .expect("get");
        assert_security_headers(&response);
    }
    // Without a session a page sends the browser to sign in.
    let response = http
        .get(format!("{}/agents", server.url))
        .send()
        .await
        .expect("get");
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(response.headers()[LOCATION], "/login");

    // The assets are served under their content hash, cached for a year, and the page names
    // them; nothing inline.
    let page = http
        .get(format!("{}/login", server.url))
        .send()
        .await
        .expect("login")
        .text()
        .await
        .expect("body");
    for ext in ["js", "css"] {
        let at = page.find("/assets/app.").expect("an asset");
        let path: String = page[at..].split('"').next().unwrap_or_default().to_string();
        let path = if path.ends_with(ext) {
            path
        } else {
            let at = page.rfind("/assets/app.").expect("the other asset");
            page[at..].split('"').next().unwrap_or_default().to_string()
        };
        let response = http
            .get(format!("{}{path}", server.url))
            .send()
            .await
            .expect("asset");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert_eq!(
            response.headers()["cache-control"],
            "public, max-age=31536000, immutable"
        );
        assert_security_headers(&response);
    }
    assert!(!page.contains("<script>"), "no inline script");
    assert!(!page.contains("style="), "no inline style");
    assert!(!page.contains("<style"), "no inline style");
    server.stop().await;
}

#[tokio::test]
async fn sign_in_makes_a_session_and_sign_out_ends_it() {
    let server = common::start().await;
    let http = client(&server);

    let (status, session) = sign_in(&http, &server.url, "bat_not-a-token").await;
    assert_eq!((status, session), (StatusCode::UNAUTHORIZED, None));

    // A sign-in posted without the form's own token (another site's form) is refused.
    let response = http
        .post(format!("{}/login", server.url))
        .form(&[("token", server.admin_token.as_str()), ("csrf", "x")])
        .send()
        .await
        .expect("forged sign in");
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert!(set_cookie(&response, "__Host-berth_session").is_none());
    assert!(response
        .text()
        .await
        .expect("body")
        .contains("CSRF_INVALID"));

    let browser = Browser::sign_in(&server, &server.admin_token).await;
    let overview = browser.page("/").await;
    assert!(overview.contains("Sign out"));
    // The session reads the API a browser reaches directly: the event stream and the audit
    // export.
    let events = browser.api("/api/v1/events?follow=false").await;
    assert_eq!(events.status(), StatusCode::OK);
    let audit = browser.api("/api/v1/audit").await;
    assert_eq!(audit.status(), StatusCode::OK);

    let (status, body) = browser.post("/logout", &[]).await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "sign out needs the CSRF token"
    );
    assert!(body.contains("CSRF_INVALID"));
    let (status, _) = browser
        .post("/logout", &[("csrf", &csrf_of(&overview))])
        .await;
    assert_eq!(status, StatusCode::SEE_OTHER);

    let after = browser.get("/").await;
    assert_eq!(after.status(), StatusCode::SEE_OTHER, "the session is gone");
    let events = browser.api("/api/v1/events?follow=false").await;
    assert_eq!(events.status(), StatusCode::UNAUTHORIZED);
    server.stop().await;
}

#[tokio::test]
async fn a_viewer_sees_no_deploy_controls_and_its_posts_are_refused() {
    let server = common::start().await;
    let created = server
        .raw(None)
        .post(format!("{}/api/v1/environments", server.url))
        .bearer_auth(&server.admin_token)
        .json(&serde_json::json!({"name": "web", "tier": "dev", "selector": {"app": "web"}}))
        .send()
        .await
        .expect("create environment");
    assert_eq!(created.status(), StatusCode::CREATED);

    let viewer = Browser::sign_in(&server, &api_token(&server, Role::Viewer, "viewer").await).await;
    let page = viewer.page("/environments/web").await;
    assert!(!page.contains("data-action=\"plan\""), "no deploy form");
    assert!(!page.contains("data-action=\"rollback\""));
    let csrf = csrf_of(&page);

    let (status, body) = viewer
        .post("/environments/web/deploy", &[("release", "r1")])
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("CSRF_INVALID"), "{body}");
    let (status, body) = viewer
        .post(
            "/environments/web/deploy",
            &[("release", "r1"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        body.contains("FORBIDDEN") && !body.contains("CSRF_INVALID"),
        "{body}"
    );
    let (status, _) = viewer
        .post("/environments/web/rollback", &[("csrf", &csrf)])
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    let deployer = Browser::sign_in(
        &server,
        &api_token(&server, Role::Deployer, "deployer").await,
    )
    .await;
    let page = deployer.page("/environments/web").await;
    assert!(
        page.contains("data-action=\"plan\""),
        "a deployer has the form"
    );
    // One session's CSRF token is no good for another session.
    let (status, body) = deployer
        .post(
            "/environments/web/plan",
            &[("release", "r1"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("CSRF_INVALID"));
    // With its own, the API decides: no such release.
    let (status, body) = deployer
        .post(
            "/environments/web/plan",
            &[("release", "r1"), ("csrf", &csrf_of(&page))],
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(body.contains("RELEASE_NOT_FOUND"), "{body}");

    // A session without a cookie is refused, not redirected, for an action.
    let response = client(&server)
        .post(format!("{}/environments/web/deploy", server.url))
        .form(&[("release", "r1")])
        .send()
        .await
        .expect("post");
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    server.stop().await;
}

#[tokio::test]
async fn labels_are_shown_as_text() {
    let server = common::start().await;
    let hostile = [
        ("a", "<script>alert(1)</script>"),
        ("b", "\"><img src=x onerror=alert(1)>"),
    ];
    let labels: BTreeMap<String, String> = hostile
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let token = server
        .admin()
        .send(&CreateAgentToken {
            labels: Some(labels),
            ..Default::default()
        })
        .await
        .expect("registration token")
        .token;
    let agent = server
        .agent_with_token("hostile", &token)
        .await
        .expect("register");

    let browser = Browser::sign_in(&server, &server.admin_token).await;
    for path in [
        "/agents".to_string(),
        format!("/agents/{}", agent.id),
        format!(
            "/agents?label={}",
            "a%3D%3Cscript%3Ealert(1)%3C%2Fscript%3E"
        ),
    ] {
        let page = browser.page(&path).await;
        assert!(!page.contains("<script>alert"), "{path}: {page}");
        assert!(!page.contains("<img src=x"), "{path}");
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{path}"
        );
        assert!(
            page.contains("&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"),
            "{path}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn a_task_shows_its_signed_result_and_the_audit_chain_verifies() {
    use berth_proto::task::{CreateTask, TaskView};
    let server = common::start().await;
    let agent = server.agent("worker").await;
    let generation = agent.session().await;
    let task: TaskView = server
        .admin()
        .send(&CreateTask {
            task_type: "inspect".into(),
            agent_id: Some(agent.id),
            payload: serde_json::json!({}),
            ..Default::default()
        })
        .await
        .expect("create task");
    let assignment = agent
        .poll(generation)
        .await
        .expect("poll")
        .assignment
        .expect("an assignment");
    let envelope = agent.sign(agent.envelope(assignment.assignment_id, common::ok(task.id)));
    agent
        .submit(generation, envelope.clone())
        .await
        .expect("result accepted");

    let browser = Browser::sign_in(&server, &server.admin_token).await;
    let page = browser.page(&format!("/tasks/{}", task.id)).await;
    assert!(page.contains("verified: the agent"), "{page}");
    assert!(page.contains("Signed result as received"));
    let signature = envelope["signature"].as_str().expect("signature");
    assert!(page.contains(signature), "the envelope as received");
    let list = browser.page("/tasks?state=succeeded&type=inspect").await;
    assert!(list.contains(&format!("/tasks/{}", task.id)), "{list}");
    let none = browser.page("/tasks?state=failed&type=").await;
    assert!(!none.contains(&format!("/tasks/{}", task.id)));

    let audit = browser.page("/audit").await;
    assert!(audit.contains("chain verified"), "{audit}");
    assert!(audit.contains("task.result"), "{audit}");
    // The audit log is the API's: admins only.
    let viewer = Browser::sign_in(&server, &api_token(&server, Role::Viewer, "viewer").await).await;
    assert_eq!(viewer.get("/audit").await.status(), StatusCode::FORBIDDEN);
    server.stop().await;
}
