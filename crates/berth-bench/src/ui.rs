//! `berth-bench ui`: the web UI in headless Chromium (through a chromedriver the caller started)
//! against a real server holding `--agents` registered agents, measured by the browser itself.
//!
//! 1. **The agents page.** Time to first byte of `/agents` (its first page of 50 rows, read from
//!    the store and rendered by maud) against the same page of the JSON API
//!    (`/api/v1/agents?limit=50`, serialized by serde), both requested by the same browser over
//!    the same connection, alternating, `--rounds` each. The figure is the browser's own timing
//!    (Navigation and Resource Timing: `responseStart - requestStart`, and `responseEnd -
//!    requestStart` for the whole body).
//! 2. **Event to DOM.** On the tasks page, a task is created through the admin API every
//!    `--interval-ms`. Its `task.state` event carries `createdAt`, stamped by the server in the
//!    commit. Measured from then: (a) the baseline, the event reaching a plain `EventSource`
//!    opened in the same page; (b) the task's row appearing in the page's DOM, which is what
//!    `app.js` does on an event: it refetches the page and swaps in the new `<main>`. Browser
//!    and server read the same system clock (one host); the server's stamp has microseconds, the
//!    browser's `Date.now()` milliseconds.

use std::time::Duration;

use anyhow::{bail, Context};
use berth_proto::TaskId;
use clap::Args;
use fantoccini::{Client as Browser, ClientBuilder, Locator};
use serde_json::{json, Value};

use crate::stats::Latencies;
use crate::Common;

#[derive(Args, Debug)]
pub struct UiArgs {
    #[command(flatten)]
    common: Common,
    /// Agents registered before the agents page is measured.
    #[arg(long, default_value_t = 10_000)]
    agents: usize,
    /// A running chromedriver, e.g. http://127.0.0.1:9515.
    #[arg(long)]
    webdriver: String,
    /// Requests of each page (UI and API), alternating.
    #[arg(long, default_value_t = 50)]
    rounds: usize,
    /// Tasks created (so `task.state` events) for the event-to-DOM figure.
    #[arg(long, default_value_t = 100)]
    events: usize,
    /// Time between two creates: longer than one refetch, so each event is measured alone.
    #[arg(long, default_value_t = 700)]
    interval_ms: u64,
}

/// Installed in the tasks page: records, per task id, the event's commit stamp, when a plain
/// EventSource got the event, and when the task's row first appeared in the DOM.
const PROBE: &str = r#"
const cursor = document.getElementById('main').dataset.cursor || '0';
window.berthProbe = { at: {}, sse: {}, dom: {} };
const p = window.berthProbe;
const source = new EventSource('/api/v1/events?after=' + cursor);
source.addEventListener('task.state', function (e) {
  const now = Date.now();
  const event = JSON.parse(e.data);
  const id = event.taskId;
  if (id && !(id in p.sse)) {
    p.sse[id] = now;
    p.at[id] = Date.parse(event.createdAt.replace(/(\.\d{3})\d+/, '$1'));
  }
});
new MutationObserver(function () {
  const now = Date.now();
  document.querySelectorAll('tr[data-task]').forEach(function (row) {
    const id = row.getAttribute('data-task');
    if (!(id in p.dom)) { p.dom[id] = now; }
  });
}).observe(document.getElementById('main'), { childList: true, subtree: true });
document.querySelectorAll('tr[data-task]').forEach(function (row) {
  p.dom[row.getAttribute('data-task')] = 0;
});
return true;
"#;

pub async fn ui(args: UiArgs) -> anyhow::Result<()> {
    let (target, fleet, _) = crate::setup(&args.common, args.agents, None).await?;
    let admin = target.client(Some(target.admin_token.clone()))?;
    let browser = connect(&args.webdriver).await?;
    let outcome = measure(
        &args,
        &browser,
        &target.server,
        &target.admin_token,
        &admin,
        &fleet,
    )
    .await;
    browser.close().await.context("closing the browser")?;
    outcome
}

async fn measure(
    args: &UiArgs,
    browser: &Browser,
    server: &str,
    token: &str,
    admin: &berth_client::Client,
    fleet: &crate::fleet::Fleet,
) -> anyhow::Result<()> {
    sign_in(browser, server, token).await?;
    let (page, api) = agents_page(browser, server, token, args.rounds).await?;
    let (sse, dom, missed) = event_to_dom(browser, server, admin, fleet, args).await?;
    let ms = |us: u64| (us as f64 / 10.0).round() / 100.0;
    let first_byte = |l: &Latencies| json!({"p50_ms": ms(l.p50_us), "p99_ms": ms(l.p99_us), "max_ms": ms(l.max_us)});
    println!(
        "agents page of 50 rows, {} agents, {} rounds:\n  UI  first byte p50 {} ms, p99 {} ms; whole page p50 {} ms\n  API first byte p50 {} ms, p99 {} ms; whole page p50 {} ms",
        args.agents,
        args.rounds,
        ms(page.0.p50_us),
        ms(page.0.p99_us),
        ms(page.1.p50_us),
        ms(api.0.p50_us),
        ms(api.0.p99_us),
        ms(api.1.p50_us),
    );
    println!(
        "event to page, {} events ({} missed):\n  EventSource p50 {} ms, p99 {} ms\n  DOM row     p50 {} ms, p99 {} ms",
        sse.count,
        missed,
        ms(sse.p50_us),
        ms(sse.p99_us),
        ms(dom.p50_us),
        ms(dom.p99_us),
    );
    println!(
        "SUMMARY {}",
        json!({
            "agents": args.agents,
            "agents_page": {
                "ui_first_byte": first_byte(&page.0), "ui_whole": first_byte(&page.1),
                "api_first_byte": first_byte(&api.0), "api_whole": first_byte(&api.1),
            },
            "event_to_page": {
                "events": sse.count, "missed": missed,
                "event_source": first_byte(&sse), "dom": first_byte(&dom),
            },
        })
    );
    if missed > 0 {
        bail!("{missed} created tasks never reached the page");
    }
    Ok(())
}

async fn connect(webdriver: &str) -> anyhow::Result<Browser> {
    let caps = json!({
        "acceptInsecureCerts": true,
        "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--ignore-certificate-errors",
                     "--window-size=1280,900"],
        }
    });
    let Value::Object(caps) = caps else {
        unreachable!("a JSON object")
    };
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(webdriver)
        .await
        .context("starting a Chromium session")
}

async fn sign_in(browser: &Browser, server: &str, token: &str) -> anyhow::Result<()> {
    browser.goto(&format!("{server}/login")).await?;
    browser
        .find(Locator::Css("#token"))
        .await?
        .send_keys(token)
        .await?;
    browser
        .find(Locator::Css("form button[type=submit]"))
        .await?
        .click()
        .await?;
    wait_for(
        browser,
        "the overview after sign-in",
        "document.querySelector('h1') && document.querySelector('h1').textContent === 'Overview'",
    )
    .await
}

/// Polls a JS expression until it is true (at most 30 s).
async fn wait_for(browser: &Browser, what: &str, expression: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = browser
            .execute(&format!("return !!({expression});"), vec![])
            .await?;
        if v == Value::Bool(true) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// (first byte, whole body) of the UI's agents page and of the API's, `rounds` each.
async fn agents_page(
    browser: &Browser,
    server: &str,
    token: &str,
    rounds: usize,
) -> anyhow::Result<((Latencies, Latencies), (Latencies, Latencies))> {
    let (mut ui, mut api) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    let micros = |v: &Value, key: &str| -> anyhow::Result<u64> {
        let ms = v[key]
            .as_f64()
            .with_context(|| format!("no {key} in {v}"))?;
        Ok((ms * 1000.0).round() as u64)
    };
    for _ in 0..rounds {
        browser.goto(&format!("{server}/agents")).await?;
        let rows = browser
            .execute(
                "return document.querySelectorAll('tr[data-agent]').length;",
                vec![],
            )
            .await?;
        if rows.as_u64() != Some(50) {
            bail!("the agents page has {rows} rows, not 50");
        }
        let t = browser
            .execute(
                "const n = performance.getEntriesByType('navigation')[0]; \
                 return { first: n.responseStart - n.requestStart, whole: n.responseEnd - n.requestStart };",
                vec![],
            )
            .await?;
        ui.0.push(micros(&t, "first")?);
        ui.1.push(micros(&t, "whole")?);
        let t = browser
            .execute_async(
                "const [token, done] = arguments; performance.clearResourceTimings(); \
                 const url = location.origin + '/api/v1/agents?limit=50'; \
                 fetch(url, { headers: { Authorization: 'Bearer ' + token } }) \
                   .then(r => r.json()).then(body => { \
                     const e = performance.getEntriesByName(url)[0]; \
                     done({ rows: body.items.length, first: e.responseStart - e.requestStart, whole: e.responseEnd - e.requestStart }); })",
                vec![json!(token)],
            )
            .await?;
        if t["rows"].as_u64() != Some(50) {
            bail!("the API's page has {} rows, not 50", t["rows"]);
        }
        api.0.push(micros(&t, "first")?);
        api.1.push(micros(&t, "whole")?);
    }
    Ok((
        (Latencies::from_micros(ui.0), Latencies::from_micros(ui.1)),
        (Latencies::from_micros(api.0), Latencies::from_micros(api.1)),
    ))
}

/// (event to EventSource, event to DOM row, tasks never seen) over `args.events` tasks.
async fn event_to_dom(
    browser: &Browser,
    server: &str,
    admin: &berth_client::Client,
    fleet: &crate::fleet::Fleet,
    args: &UiArgs,
) -> anyhow::Result<(Latencies, Latencies, usize)> {
    browser.goto(&format!("{server}/tasks")).await?;
    wait_for(
        browser,
        "the live stream",
        "document.getElementById('main').dataset.stream === 'open'",
    )
    .await?;
    browser.execute(PROBE, vec![]).await?;
    let mut created: Vec<TaskId> = Vec::with_capacity(args.events);
    for i in 0..args.events {
        // Round robin over the fleet: no agent's queue comes near its cap.
        let agent = fleet.agents[i % fleet.agents.len()].id;
        let task = admin
            .send(&crate::tasks::create_request(agent))
            .await
            .context("creating a task")?;
        created.push(task.id);
        tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let probe = browser.execute("return window.berthProbe;", vec![]).await?;
    let (mut sse, mut dom, mut missed) = (Vec::new(), Vec::new(), 0);
    for id in &created {
        let key = id.to_string();
        let (Some(at), Some(seen), Some(row)) = (
            probe["at"][&key].as_f64(),
            probe["sse"][&key].as_f64(),
            probe["dom"][&key].as_f64(),
        ) else {
            missed += 1;
            continue;
        };
        let us = |t: f64| ((t - at).max(0.0) * 1000.0).round() as u64;
        sse.push(us(seen));
        dom.push(us(row));
    }
    Ok((
        Latencies::from_micros(sse),
        Latencies::from_micros(dom),
        missed,
    ))
}
