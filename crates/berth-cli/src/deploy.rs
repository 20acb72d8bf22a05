//! `berth env`, `berth deploy`, `berth deployment` and `berth rollback`, and the `--wait`
//! follower: it reads the deployment's events (`GET /api/v1/events?deployment=`) and shows each
//! target's wave, phase and elapsed time — indicatif bars on a terminal, plain lines otherwise,
//! JSON lines with `--output json`. It exits 0 when the deployment succeeded and non-zero with
//! the failed targets' codes otherwise; Ctrl-C detaches without cancelling.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use berth_client::Client;
use berth_proto::deploy::{
    DeploymentPlan, DeploymentState, DeploymentView, EnvironmentStatus, EnvironmentView,
    GetDeployment, TargetPhase,
};
use berth_proto::event::EventQuery;
use berth_proto::AgentId;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::output::{rfc3339, table, Output};

fn or_dash(s: Option<&str>) -> String {
    s.unwrap_or("-").to_string()
}

pub fn print_environment(out: Output, e: &EnvironmentView) -> anyhow::Result<()> {
    out.print(e, || {
        let selector: Vec<String> = e.selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!(
            "name:            {}\ntier:            {}\nselector:        {}\npolicy:          maxParallel {}, stopOnFailure {}, autoRollback {}, healthTimeout {}s, requireReady {}\npromote from:    {}\napprovals:       {}\nauto heal:       {}\ndrift interval:  {}s\ncurrent release: {}\nprevious:        {}\npinned:          {}",
            e.name,
            e.tier.as_str(),
            selector.join(","),
            e.policy.max_parallel,
            e.policy.stop_on_failure,
            e.policy.auto_rollback,
            e.policy.health_timeout_secs,
            e.policy.require_ready,
            or_dash(e.promote_from.as_deref()),
            e.approvals,
            e.auto_heal,
            e.drift_interval_secs,
            or_dash(e.current_release.as_deref()),
            or_dash(e.previous_release.as_deref()),
            or_dash(e.pinned_release.as_deref()),
        )
    })
}

pub fn print_environments(out: Output, envs: &[EnvironmentView]) -> anyhow::Result<()> {
    out.print(&envs, || {
        let rows: Vec<Vec<String>> = envs
            .iter()
            .map(|e| {
                vec![
                    e.name.clone(),
                    e.tier.as_str().into(),
                    or_dash(e.current_release.as_deref()),
                    or_dash(e.pinned_release.as_deref()),
                    e.approvals.to_string(),
                ]
            })
            .collect();
        table(&["NAME", "TIER", "RELEASE", "PINNED", "APPROVALS"], &rows)
    })
}

pub fn print_status(out: Output, s: &EnvironmentStatus) -> anyhow::Result<()> {
    out.print(s, || {
        let rows: Vec<Vec<String>> = s
            .targets
            .iter()
            .map(|t| {
                vec![
                    t.agent_name.clone(),
                    or_dash(t.desired_release.as_deref()),
                    or_dash(t.running_release.as_deref()),
                    t.drift.as_str().into(),
                    t.verified_at.map(rfc3339).unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        format!(
            "environment {} ({}), release {}\n{}",
            s.environment.name,
            s.environment.tier.as_str(),
            or_dash(s.environment.current_release.as_deref()),
            table(
                &["TARGET", "DESIRED", "RUNNING", "DRIFT", "VERIFIED"],
                &rows
            )
        )
    })
}

fn short(digest: Option<&str>) -> String {
    match digest {
        Some(d) => d.chars().take(19).collect(),
        None => "-".into(),
    }
}

pub fn print_plan(out: Output, p: &DeploymentPlan) -> anyhow::Result<()> {
    out.print(p, || {
        let mut lines = vec![format!(
            "plan: release {} into {} (rollback to {}, {} approval(s)); nothing was changed",
            p.release,
            p.environment,
            or_dash(p.rollback_release.as_deref()),
            p.approvals
        )];
        for wave in &p.waves {
            lines.push(format!("wave {}:", wave.wave));
            for t in &wave.targets {
                lines.push(format!(
                    "  {}  now {} (verified {})",
                    t.agent_name,
                    or_dash(t.current_release.as_deref()),
                    t.verified_at.map(rfc3339).unwrap_or_else(|| "never".into())
                ));
                for c in &t.components {
                    lines.push(format!(
                        "    {}  {} -> {}{}",
                        c.name,
                        short(c.current_digest.as_deref()),
                        short(Some(&c.new_digest)),
                        if c.changes { "" } else { "  (unchanged)" }
                    ));
                }
            }
        }
        for t in &p.skipped {
            lines.push(format!("skipped: {} ({})", t.agent_name, t.reason));
        }
        lines.join("\n")
    })
}

pub fn print_deployments(out: Output, items: &[DeploymentView]) -> anyhow::Result<()> {
    out.print(&items, || {
        let rows: Vec<Vec<String>> = items
            .iter()
            .map(|d| {
                vec![
                    d.id.to_string(),
                    d.environment.clone(),
                    d.release.clone(),
                    d.kind.as_str().into(),
                    state_label(d),
                    rfc3339(d.created_at),
                ]
            })
            .collect();
        table(&["ID", "ENV", "RELEASE", "KIND", "STATE", "CREATED"], &rows)
    })
}

pub fn print_deployment(out: Output, d: &DeploymentView) -> anyhow::Result<()> {
    out.print(d, || {
        let rows: Vec<Vec<String>> = d
            .targets
            .iter()
            .map(|t| {
                vec![
                    t.wave.to_string(),
                    t.agent_name.clone(),
                    t.phase.as_str().into(),
                    or_dash(t.error_code.as_deref()),
                ]
            })
            .collect();
        format!(
            "deployment {}\nrelease {} into {} ({}), {}{}\napprovals {}/{}{}\n{}",
            d.id,
            d.release,
            d.environment,
            d.kind.as_str(),
            state_label(d),
            d.error_code
                .as_deref()
                .map(|c| format!(" ({c})"))
                .unwrap_or_default(),
            d.approvals.len(),
            d.approvals_required,
            d.detail
                .as_deref()
                .map(|x| format!("\n{x}"))
                .unwrap_or_default(),
            table(&["WAVE", "TARGET", "PHASE", "CODE"], &rows)
        )
    })
}

/// The state, with what is under way: `running, rolling back`.
fn state_label(d: &DeploymentView) -> String {
    let mut s = d.state.as_str().to_string();
    if d.rolling_back && d.state == DeploymentState::Running {
        s.push_str(", rolling back");
    }
    if d.cancel_requested && d.state.is_active() {
        s.push_str(", cancel requested");
    }
    s
}

/// Follows the deployment until it ends: exit status 0 only when it succeeded.
pub async fn wait(
    client: &Client,
    out: Output,
    id: berth_proto::DeploymentId,
) -> anyhow::Result<()> {
    let mut view = client.send(&GetDeployment { id }).await?;
    let started = std::time::Instant::now();
    let mut shown = Progress::new(out, &view);
    shown.update(&view, started);
    let query = EventQuery {
        deployment: Some(id),
        ..EventQuery::default()
    };
    let mut last = None;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    while view.state.is_active() {
        let mut stream = match client.events(&query, last, Duration::from_secs(3600)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "deployment event stream failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                view = client.send(&GetDeployment { id }).await?;
                shown.update(&view, started);
                continue;
            }
        };
        loop {
            tokio::select! {
                _ = &mut ctrl_c => {
                    shown.finish();
                    eprintln!("detached: deployment {id} goes on (berth deployment show {id})");
                    std::process::exit(130);
                }
                next = stream.next() => match next {
                    Ok(Some(event)) => {
                        last = Some(event.id);
                        view = client.send(&GetDeployment { id }).await?;
                        shown.update(&view, started);
                        if !view.state.is_active() {
                            break;
                        }
                    }
                    Ok(None) | Err(_) => break,
                },
            }
        }
    }
    shown.finish();
    summarize(out, &view)
}

fn summarize(out: Output, view: &DeploymentView) -> anyhow::Result<()> {
    if let Output::Json = out {
        println!("{}", serde_json::to_string(view)?);
    }
    if view.state == DeploymentState::Succeeded {
        if let Output::Table = out {
            println!(
                "deployment {} succeeded: {} on {} target(s) of {}",
                view.id,
                view.release,
                view.targets.len(),
                view.environment
            );
        }
        return Ok(());
    }
    let failed: Vec<String> = view
        .targets
        .iter()
        .filter(|t| t.error_code.is_some())
        .map(|t| {
            format!(
                "  {} (wave {}): {} {}",
                t.agent_name,
                t.wave,
                t.phase.as_str(),
                t.error_code.as_deref().unwrap_or_default()
            )
        })
        .collect();
    anyhow::bail!(
        "deployment {} ended {}{}\n{}",
        view.id,
        state_label(view),
        view.detail
            .as_deref()
            .map(|d| format!(": {d}"))
            .unwrap_or_default(),
        failed.join("\n")
    )
}

/// What `--wait` has shown so far.
struct Progress {
    out: Output,
    bars: Option<(MultiProgress, HashMap<AgentId, ProgressBar>)>,
    phases: HashMap<AgentId, TargetPhase>,
    state: Option<String>,
}

impl Progress {
    fn new(out: Output, view: &DeploymentView) -> Progress {
        let bars = (matches!(out, Output::Table) && std::io::stderr().is_terminal()).then(|| {
            let multi = MultiProgress::new();
            let style = ProgressStyle::with_template("{spinner} {prefix:<28} {wide_msg} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            let bars = view
                .targets
                .iter()
                .map(|t| {
                    let bar = multi.add(ProgressBar::new_spinner());
                    bar.set_style(style.clone());
                    bar.set_prefix(format!("wave {} {}", t.wave, t.agent_name));
                    bar.enable_steady_tick(Duration::from_millis(120));
                    (t.agent_id, bar)
                })
                .collect();
            (multi, bars)
        });
        Progress {
            out,
            bars,
            phases: HashMap::new(),
            state: None,
        }
    }

    fn update(&mut self, view: &DeploymentView, started: std::time::Instant) {
        let state = state_label(view);
        if self.state.as_deref() != Some(&state) {
            if let (Output::Table, None) = (self.out, &self.bars) {
                println!("deployment {} {}", view.id, state);
            }
            self.state = Some(state);
        }
        for t in &view.targets {
            if self.phases.get(&t.agent_id) == Some(&t.phase) {
                continue;
            }
            self.phases.insert(t.agent_id, t.phase);
            let elapsed = started.elapsed().as_secs_f64();
            let code = t.error_code.as_deref().unwrap_or_default();
            match (&self.bars, self.out) {
                (Some((_, bars)), _) => {
                    if let Some(bar) = bars.get(&t.agent_id) {
                        bar.set_message(format!("{} {code}", t.phase.as_str()));
                        if t.phase.is_settled() {
                            bar.finish();
                        }
                    }
                }
                (None, Output::Json) => println!(
                    "{}",
                    serde_json::json!({
                        "deployment": view.id, "target": t.agent_name, "agentId": t.agent_id,
                        "wave": t.wave, "phase": t.phase, "errorCode": t.error_code,
                        "elapsedSecs": (elapsed * 10.0).round() / 10.0,
                    })
                ),
                (None, Output::Table) => println!(
                    "[{elapsed:>6.1}s] wave {} {:<24} {} {code}",
                    t.wave,
                    t.agent_name,
                    t.phase.as_str()
                ),
            }
        }
    }

    fn finish(&self) {
        if let Some((_, bars)) = &self.bars {
            for bar in bars.values() {
                if !bar.is_finished() {
                    bar.abandon();
                }
            }
        }
    }
}

/// `NAME=VALUE` pairs for a selector.
pub fn selector(items: &[String]) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    crate::parse_labels(items)
        .map_err(anyhow::Error::msg)
        .context("--selector")
}
