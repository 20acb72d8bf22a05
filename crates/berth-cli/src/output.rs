//! Human tables by default, `--output json` for scripts.

use berth_proto::agent::Agent;
use berth_proto::release::ReleaseView;
use berth_proto::task::TaskView;
use serde::Serialize;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

impl Output {
    /// JSON of `value`, or the human rendering.
    pub fn print<T: Serialize>(
        self,
        value: &T,
        human: impl FnOnce() -> String,
    ) -> anyhow::Result<()> {
        match self {
            Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
            Output::Table => println!("{}", human()),
        }
        Ok(())
    }
}

/// Left-aligned columns sized to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(header.iter().map(|h| h.to_string()).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

fn labels(agent: &Agent) -> String {
    agent
        .labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn capabilities(agent: &Agent) -> String {
    agent
        .capabilities
        .iter()
        .map(|c| {
            let mut s = c.name.clone();
            if let Some(v) = &c.version {
                s.push_str(&format!(" {v}"));
            }
            if !c.healthy {
                s.push_str(" (broken)");
            }
            s
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

fn when(t: Option<time::OffsetDateTime>) -> String {
    t.map(rfc3339).unwrap_or_else(|| "never".into())
}

/// The status, with `,cordoned` when no new work is routed to it (`blocked` already says
/// suspended).
fn status(a: &Agent) -> String {
    if a.cordoned {
        format!("{},cordoned", a.status.as_str())
    } else {
        a.status.as_str().to_string()
    }
}

pub fn print_agents(out: Output, agents: &[Agent]) -> anyhow::Result<()> {
    out.print(&agents, || {
        let rows: Vec<Vec<String>> = agents
            .iter()
            .map(|a| {
                vec![
                    a.id.to_string(),
                    a.name.clone(),
                    status(a),
                    when(a.last_heartbeat),
                    capabilities(a),
                    labels(a),
                ]
            })
            .collect();
        table(
            &[
                "ID",
                "NAME",
                "STATUS",
                "LAST HEARTBEAT",
                "CAPABILITIES",
                "LABELS",
            ],
            &rows,
        )
    })
}

pub fn print_agent(out: Output, a: &Agent) -> anyhow::Result<()> {
    out.print(a, || {
        let usage = a
            .resource_usage
            .as_ref()
            .map(|u| {
                format!(
                    "cpu {:.1}% of {} cores, memory {} / {} MiB, disk free {} / {} GiB",
                    u.cpu_percent,
                    u.cpu_cores,
                    u.memory_used_bytes >> 20,
                    u.memory_total_bytes >> 20,
                    u.disk_free_bytes >> 30,
                    u.disk_total_bytes >> 30
                )
            })
            .unwrap_or_else(|| "-".into());
        let rows = vec![
            vec!["id".into(), a.id.to_string()],
            vec!["name".into(), a.name.clone()],
            vec!["status".into(), status(a)],
            vec!["cordoned".into(), a.cordoned.to_string()],
            vec!["suspended".into(), a.suspended.to_string()],
            vec!["version".into(), a.version.clone()],
            vec![
                "environment".into(),
                a.environment.clone().unwrap_or_else(|| "-".into()),
            ],
            vec!["labels".into(), labels(a)],
            vec!["capabilities".into(), capabilities(a)],
            vec!["last heartbeat".into(), when(a.last_heartbeat)],
            vec!["resources".into(), usage],
            vec![
                "certificate".into(),
                a.certificate_fingerprint
                    .clone()
                    .unwrap_or_else(|| "-".into()),
            ],
            vec!["certificate expires".into(), when(a.certificate_expires_at)],
            vec!["registered".into(), when(Some(a.created_at))],
        ];
        table(&["FIELD", "VALUE"], &rows)
    })
}

pub fn print_tasks(out: Output, tasks: &[TaskView]) -> anyhow::Result<()> {
    out.print(&tasks, || {
        let rows: Vec<Vec<String>> = tasks
            .iter()
            .map(|t| {
                vec![
                    t.id.to_string(),
                    t.task_type.clone(),
                    state_label(t),
                    t.agent_id.to_string(),
                    t.attempt_count.to_string(),
                    t.error_code.clone().unwrap_or_default(),
                    rfc3339(t.created_at),
                ]
            })
            .collect();
        table(
            &[
                "ID", "TYPE", "STATE", "AGENT", "ATTEMPTS", "ERROR", "CREATED",
            ],
            &rows,
        )
    })
}

fn state_label(t: &TaskView) -> String {
    if t.read_back {
        format!("{} (read-back)", t.state)
    } else {
        t.state.to_string()
    }
}

pub fn print_task(out: Output, t: &TaskView) -> anyhow::Result<()> {
    out.print(t, || {
        let mut rows = vec![
            vec!["id".into(), t.id.to_string()],
            vec!["type".into(), t.task_type.clone()],
            vec!["state".into(), state_label(t)],
            vec!["agent".into(), t.agent_id.to_string()],
            vec!["side effects".into(), t.side_effects.to_string()],
            vec!["attempts".into(), t.attempt_count.to_string()],
            vec![
                "error".into(),
                t.error_code.clone().unwrap_or_else(|| "-".into()),
            ],
            vec!["created".into(), rfc3339(t.created_at)],
            vec!["finished".into(), when(t.finished_at)],
        ];
        if let Some(result) = &t.result {
            rows.push(vec!["result".into(), result.to_string()]);
        }
        for a in &t.attempts {
            let signed = a
                .result
                .as_ref()
                .and_then(|r| r.get("signatureAlgorithm"))
                .and_then(|v| v.as_str())
                .map(|alg| format!(", signed {alg}, verified"))
                .unwrap_or_default();
            rows.push(vec![
                format!("attempt {}", a.assignment_id),
                format!("{} (generation {}{signed})", a.state, a.generation),
            ]);
        }
        table(&["FIELD", "VALUE"], &rows)
    })
}

pub fn print_releases(out: Output, releases: &[ReleaseView]) -> anyhow::Result<()> {
    out.print(&releases, || {
        let rows: Vec<Vec<String>> = releases
            .iter()
            .map(|r| {
                let components: Vec<&str> = r.components.iter().map(|c| c.name.as_str()).collect();
                vec![
                    r.name.clone(),
                    components.join(","),
                    if r.compose_lock.is_some() {
                        "yes"
                    } else {
                        "no"
                    }
                    .into(),
                    rfc3339(r.created_at),
                ]
            })
            .collect();
        table(&["NAME", "COMPONENTS", "COMPOSE", "CREATED"], &rows)
    })
}

pub fn print_release(out: Output, r: &ReleaseView) -> anyhow::Result<()> {
    out.print(r, || {
        let mut rows = vec![
            vec!["id".into(), r.id.to_string()],
            vec!["name".into(), r.name.clone()],
            vec!["created".into(), rfc3339(r.created_at)],
        ];
        for c in &r.components {
            let from = c
                .resolved_from
                .as_ref()
                .map(|t| format!(" (from tag {t})"))
                .unwrap_or_default();
            rows.push(vec![
                format!("component {}", c.name),
                format!("{}{from}", c.pinned()),
            ]);
        }
        if let Some(ssh) = &r.ssh {
            rows.push(vec!["ssh deploy dir".into(), ssh.deploy_directory.clone()]);
            for a in &ssh.artifacts {
                rows.push(vec![
                    format!("ssh artifact {}", a.name),
                    a.sha256.clone().unwrap_or_default(),
                ]);
            }
            if let Some(script) = &ssh.script {
                rows.push(vec!["ssh script".into(), script.command.join(" ")]);
            }
        }
        table(&["FIELD", "VALUE"], &rows)
    })
}
