//! The page shell (head, navigation, sign-out form) and the small pieces every page uses.
//! Everything is interpolated through maud, which escapes it.

use std::sync::LazyLock;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use berth_proto::agent::AgentStatus;
use maud::{html, Markup, DOCTYPE};
use time::OffsetDateTime;

use super::session::UiCaller;
use crate::infra::error::ApiError;

/// Which navigation entry a page belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    Overview,
    Agents,
    Environments,
    Tasks,
    Audit,
}

const NAV: [(Nav, &str, &str); 5] = [
    (Nav::Overview, "/", "Overview"),
    (Nav::Agents, "/agents", "Agents"),
    (Nav::Environments, "/environments", "Environments"),
    (Nav::Tasks, "/tasks", "Tasks"),
    (Nav::Audit, "/audit", "Audit"),
];

fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            meta name="color-scheme" content="light dark";
            title { (title) " · berth" }
            link rel="stylesheet" href=(STYLE_ASSET.path);
            script src=(SCRIPT_ASSET.path) defer {}
        }
    }
}

/// What makes a page live: the event filter (query string of `/api/v1/events`) whose events make
/// the script re-render `<main>`, and the newest event id before the page read its data, so the
/// stream resumes from there and misses no change the page does not show.
pub struct Live {
    pub filter: String,
    pub cursor: i64,
}

/// A signed-in page; `live` is `None` for a page that does not change by itself.
pub fn page(ui: &UiCaller, nav: Nav, title: &str, live: Option<Live>, body: Markup) -> Markup {
    let token = &ui.caller.0;
    let (filter, cursor) = match live {
        Some(l) => (Some(l.filter), Some(l.cursor)),
        None => (None, None),
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                a.skip href="#main" { "Skip to content" }
                header.top {
                    a.brand href="/" { "berth" }
                    nav aria-label="Main" {
                        ul {
                            @for (entry, href, label) in NAV {
                                li {
                                    @if entry == nav {
                                        a href=(href) aria-current="page" { (label) }
                                    } @else {
                                        a href=(href) { (label) }
                                    }
                                }
                            }
                        }
                    }
                    div.who {
                        span { (token.name) " · " (token.role.as_str()) }
                        form method="post" action="/logout" {
                            input type="hidden" name="csrf" value=(ui.csrf);
                            button.link type="submit" { "Sign out" }
                        }
                    }
                }
                main #main data-live=[filter] data-cursor=[cursor] {
                    h1 { (title) }
                    (body)
                }
                p.live-status aria-live="polite" hidden { }
            }
        }
    }
}

/// A page without a session: sign-in and errors.
pub fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body.bare {
                main #main {
                    p.brand { "berth" }
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

pub fn error(e: &ApiError) -> Markup {
    bare(
        e.status.canonical_reason().unwrap_or("Error"),
        html! {
            p.error role="alert" { code { (e.code) } ": " (e.detail) }
            p { a href="/" { "Back to the overview" } }
        },
    )
}

pub fn status_badge(status: AgentStatus) -> Markup {
    badge(status.as_str())
}

/// A state word with a class of the same name, so the stylesheet colours it.
pub fn badge(state: &str) -> Markup {
    html! { span.badge data-state=(state) { (state) } }
}

pub fn time(t: Option<OffsetDateTime>) -> Markup {
    match t {
        Some(t) => {
            let text = t
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            // Shown to the second (the attribute keeps the full precision, for tools).
            let shown = t
                .replace_nanosecond(0)
                .ok()
                .and_then(|s| {
                    s.format(&time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .unwrap_or_else(|| text.clone());
            html! { time datetime=(text) title=(text) { (shown.replace('T', " ")) } }
        }
        None => html! { span.muted { "—" } },
    }
}

pub fn labels(labels: &std::collections::BTreeMap<String, String>) -> Markup {
    html! {
        @if labels.is_empty() {
            span.muted { "—" }
        } @else {
            ul.chips {
                @for (k, v) in labels {
                    li.chip { (k) "=" (v) }
                }
            }
        }
    }
}

/// A hidden CSRF field for a form of this session.
pub fn csrf(ui: &UiCaller) -> Markup {
    html! { input type="hidden" name="csrf" value=(ui.csrf); }
}

const SCRIPT: &str = include_str!("assets/app.js");
const STYLE: &str = include_str!("assets/app.css");

/// An embedded asset under its content-hashed name: the name changes when the bytes do, so it
/// can be cached for a year.
pub struct Asset {
    pub path: String,
    pub(super) body: &'static str,
    pub(super) content_type: &'static str,
}

fn asset(stem: &str, ext: &str, body: &'static str, content_type: &'static str) -> Asset {
    let hash = berth_crypto::sha256_hex(body.as_bytes());
    Asset {
        path: format!("/assets/{stem}.{}.{ext}", &hash[..16]),
        body,
        content_type,
    }
}

pub static SCRIPT_ASSET: LazyLock<Asset> =
    LazyLock::new(|| asset("app", "js", SCRIPT, "text/javascript; charset=utf-8"));
pub static STYLE_ASSET: LazyLock<Asset> =
    LazyLock::new(|| asset("app", "css", STYLE, "text/css; charset=utf-8"));

/// An HTML page with its status.
pub(crate) fn page_response(status: StatusCode, markup: Markup) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

/// A refusal as a page: the API's status, code and detail.
pub(crate) fn error_page(refusal: &ApiError) -> Response {
    page_response(refusal.status, error(refusal))
}

pub fn login(csrf: &str, refused: Option<&str>) -> Markup {
    bare(
        "Sign in",
        html! {
            @if let Some(why) = refused {
                p.error role="alert" { (why) }
            }
            form.card method="post" action="/login" {
                input type="hidden" name="csrf" value=(csrf);
                label for="token" { "API token" }
                input #token type="password" name="token" autocomplete="off" required autofocus;
                p.hint { "A token from " code { "berth token create" } "; the session acts with its tenant and role for 12 hours." }
                button type="submit" { "Sign in" }
            }
        },
    )
}
