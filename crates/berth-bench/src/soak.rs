//! `berth-bench soak-check`: the verdict of a `scripts/soak.sh` run. It reads the run's
//! PostgreSQL database, the task ids the load generators were acknowledged (2xx) for, and each
//! real agent's state dir (its sticker history and its journal), and prints one row per
//! invariant of issue 29 item 7. It only reads: it never changes the database or a state dir.
//!
//! Exit status: 0 when every invariant holds, 1 when one is violated (the rows say which).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use sqlx::postgres::PgPoolOptions;
use sqlx::Row;
use uuid::Uuid;

#[derive(Args, Debug)]
pub struct SoakCheckArgs {
    /// The run's database (postgres://…).
    #[arg(long)]
    database: String,
    /// A file of acknowledged task ids, one per line (the first word of each line counts);
    /// repeatable.
    #[arg(long = "created")]
    created: Vec<PathBuf>,
    /// A real agent's state dir (`stickers/history.log`, `journal/`); repeatable.
    #[arg(long = "agent-state")]
    agent_states: Vec<PathBuf>,
    /// A leased task whose lease ran out, or an `unknown` task without a read-back, counts as
    /// stuck only once it has been so for this long (the sweeps run every few seconds).
    #[arg(long, default_value_t = 60)]
    slack_secs: i64,
    /// Write the rows as JSON lines here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row of the verdict. `gate`: a count above 0 fails the run; informational rows never do.
struct Line {
    name: &'static str,
    count: Option<u64>,
    gate: bool,
    detail: String,
}

pub async fn soak_check(args: SoakCheckArgs) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&args.database)
        .await
        .context("connecting to the run's database")?;
    let mut rows = Vec::new();
    rows.push(lost_creates(&pool, &args.created).await?);
    let stickers = sticker_writes(&args.agent_states)?;
    rows.push(twice_on_hosts(&stickers));
    rows.push(unjournaled_stickers(&pool, &stickers, &args.agent_states).await?);
    rows.push(twice_on_server(&pool).await?);
    rows.push(leased_without_owner(&pool, args.slack_secs).await?);
    rows.push(unknown_without_read_back(&pool, args.slack_secs).await?);
    rows.push(reconciler_units(&pool).await?);
    rows.extend(figures(&pool, &stickers).await?);
    let violated = print(&rows);
    if let Some(path) = &args.json {
        let lines: Vec<String> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"invariant": r.name, "count": r.count, "gate": r.gate,
                                   "detail": r.detail})
                .to_string()
            })
            .collect();
        std::fs::write(path, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if violated {
        std::process::exit(1);
    }
    Ok(())
}

/// Prints the table; true when a gating row is above 0.
fn print(rows: &[Line]) -> bool {
    let mut violated = false;
    println!(
        "{:<52} {:>8}  {:<10} detail",
        "invariant", "count", "verdict"
    );
    for r in rows {
        let verdict = match (r.gate, r.count) {
            (false, _) => "info",
            (true, None) => "n/a",
            (true, Some(0)) => "ok",
            (true, Some(_)) => {
                violated = true;
                "VIOLATED"
            }
        };
        let count = r.count.map_or("-".to_string(), |c| c.to_string());
        println!("{:<52} {:>8}  {:<10} {}", r.name, count, verdict, r.detail);
    }
    println!(
        "VERDICT {}",
        if violated {
            "VIOLATED"
        } else {
            "all invariants hold"
        }
    );
    violated
}

/// Every id a load generator was acknowledged for must be a row of `tasks`.
async fn lost_creates(pool: &sqlx::PgPool, files: &[PathBuf]) -> anyhow::Result<Line> {
    let mut acked = BTreeSet::new();
    for f in files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        for line in text.lines() {
            let Some(word) = line.split_whitespace().next() else {
                continue;
            };
            let id = Uuid::parse_str(word)
                .with_context(|| format!("{}: not a task id: {word}", f.display()))?;
            acked.insert(id);
        }
    }
    let ids: Vec<Uuid> = acked.iter().copied().collect();
    let found: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM tasks WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_all(pool)
        .await
        .context("looking the acknowledged ids up")?;
    let found: BTreeSet<Uuid> = found.into_iter().collect();
    let lost: Vec<String> = acked
        .difference(&found)
        .take(5)
        .map(Uuid::to_string)
        .collect();
    let n = acked.len() - found.len();
    Ok(Line {
        name: "acknowledged creates lost",
        count: Some(n as u64),
        gate: true,
        detail: if n == 0 {
            format!("{} acknowledged ids, all in tasks", acked.len())
        } else {
            format!("{n} of {} missing, e.g. {}", acked.len(), lost.join(" "))
        },
    })
}

/// Each real agent's sticker writes: (state dir, task id) → times written.
type StickerWrites = BTreeMap<(PathBuf, String), u64>;

fn sticker_writes(states: &[PathBuf]) -> anyhow::Result<StickerWrites> {
    let mut writes = StickerWrites::new();
    for state in states {
        let history = state.join("stickers").join("history.log");
        let text = match std::fs::read_to_string(&history) {
            Ok(t) => t,
            // An agent that never ran a write task has no history.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", history.display())),
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            // The agent appends each line whole and fsyncs it, but a kill -9 can still cut the
            // last one short: skip what does not parse rather than guess.
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if let Some(task) = v.get("taskId").and_then(|t| t.as_str()) {
                *writes.entry((state.clone(), task.to_string())).or_default() += 1;
            }
        }
    }
    Ok(writes)
}

/// A task's side effect (its sticker write) recorded more than once on its host.
fn twice_on_hosts(writes: &StickerWrites) -> Line {
    let twice: Vec<&(PathBuf, String)> = writes
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| k)
        .collect();
    Line {
        name: "side effects run twice (stickers)",
        count: Some(twice.len() as u64),
        gate: true,
        detail: if twice.is_empty() {
            format!("{} sticker writes, each task once", writes.len())
        } else {
            twice
                .iter()
                .take(5)
                .map(|(dir, task)| format!("{task} on {}", short_dir(dir)))
                .collect::<Vec<_>>()
                .join(", ")
        },
    }
}

fn short_dir(dir: &Path) -> String {
    dir.file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into())
}

/// A side effect on the host with no journal entry under its task's key: a redelivery would
/// run it again. Informational: a kill -9 between the write and the journal's fsync leaves
/// exactly this, and the server must then resolve the task by read-back, not redeliver it
/// (which the row above would show).
async fn unjournaled_stickers(
    pool: &sqlx::PgPool,
    writes: &StickerWrites,
    states: &[PathBuf],
) -> anyhow::Result<Line> {
    let ids: Vec<Uuid> = writes
        .keys()
        .filter_map(|(_, t)| Uuid::parse_str(t).ok())
        .collect();
    let tenants: HashMap<Uuid, Uuid> =
        sqlx::query("SELECT id, tenant_id FROM tasks WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(pool)
            .await
            .context("reading the sticker tasks' tenants")?
            .into_iter()
            .map(|r| (r.get::<Uuid, _>(0), r.get::<Uuid, _>(1)))
            .collect();
    let mut journals: HashMap<&Path, BTreeSet<String>> = HashMap::new();
    for s in states {
        let names = std::fs::read_dir(s.join("journal"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        journals.insert(s.as_path(), names);
    }
    let mut missing = Vec::new();
    for (dir, task) in writes.keys() {
        let Some(tenant) = Uuid::parse_str(task).ok().and_then(|t| tenants.get(&t)) else {
            continue;
        };
        // The agent's journal file: sha256 of the server's key `<tenant>/<task>` (journal.rs).
        let file = format!(
            "{}.json",
            berth_crypto::sha256_hex(format!("{tenant}/{task}").as_bytes())
        );
        if !journals
            .get(dir.as_path())
            .is_some_and(|j| j.contains(&file))
        {
            missing.push(format!("{task} on {}", short_dir(dir)));
        }
    }
    Ok(Line {
        name: "sticker writes without a journal entry",
        count: Some(missing.len() as u64),
        gate: false,
        detail: missing.into_iter().take(5).collect::<Vec<_>>().join(", "),
    })
}

/// The server's view of the same: a side-effecting task with more than one succeeded
/// delivery. Informational: a redelivery answered from the journal would also count here.
async fn twice_on_server(pool: &sqlx::PgPool) -> anyhow::Result<Line> {
    let ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT a.task_id FROM task_attempts a JOIN tasks t ON t.id = a.task_id
         WHERE t.side_effects AND a.state = 'succeeded'
         GROUP BY a.task_id HAVING count(*) > 1",
    )
    .fetch_all(pool)
    .await
    .context("counting succeeded deliveries")?;
    Ok(Line {
        name: "side-effecting tasks with 2+ succeeded deliveries",
        count: Some(ids.len() as u64),
        gate: false,
        detail: ids
            .iter()
            .take(5)
            .map(Uuid::to_string)
            .collect::<Vec<_>>()
            .join(" "),
    })
}

/// `leased` with nobody holding it: its lease ran out (by the database's clock) and the sweep
/// has not moved it for `slack` seconds, or its agent holds no session.
async fn leased_without_owner(pool: &sqlx::PgPool, slack: i64) -> anyhow::Result<Line> {
    let ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT t.id FROM tasks t LEFT JOIN agents a ON a.id = t.agent_id
         WHERE t.state = 'leased'
           AND (t.lease_expires_at < now() - make_interval(secs => $1)
                OR a.id IS NULL OR a.session_instance_id IS NULL
                OR a.session_expires_at < now() - make_interval(secs => $1))",
    )
    .bind(slack as f64)
    .fetch_all(pool)
    .await
    .context("counting leased tasks without an owner")?;
    let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks WHERE state = 'leased'")
        .fetch_one(pool)
        .await?;
    Ok(Line {
        name: "tasks leased with no owner",
        count: Some(ids.len() as u64),
        gate: true,
        detail: format!("{leased} leased in all{}", examples(&ids)),
    })
}

/// `unknown` for longer than `slack` with no read-back task made for it.
async fn unknown_without_read_back(pool: &sqlx::PgPool, slack: i64) -> anyhow::Result<Line> {
    let ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT t.id FROM tasks t
         WHERE t.state = 'unknown' AND t.updated_at < now() - make_interval(secs => $1)
           AND NOT EXISTS (SELECT 1 FROM tasks r WHERE r.read_back_of = t.id)",
    )
    .bind(slack as f64)
    .fetch_all(pool)
    .await
    .context("counting unknown tasks without a read-back")?;
    let unknown: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks WHERE state = 'unknown'")
        .fetch_one(pool)
        .await?;
    Ok(Line {
        name: "tasks unknown with no read-back",
        count: Some(ids.len() as u64),
        gate: true,
        detail: format!("{unknown} unknown in all{}", examples(&ids)),
    })
}

/// Duplicate reconciler units need the claims the reconciler driver records (issue 29 item 3).
/// A build without such a table cannot show them: the row says so instead of a number.
async fn reconciler_units(pool: &sqlx::PgPool) -> anyhow::Result<Line> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
         WHERE table_schema = current_schema() AND table_name ILIKE '%reconcil%'
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .context("looking for the reconciler's claims")?;
    Ok(Line {
        name: "duplicate reconciler units",
        count: None,
        gate: true,
        detail: if tables.is_empty() {
            "not measurable on this build: no table records reconciler claims".into()
        } else {
            format!(
                "not measured: this checker does not know the shape of {}",
                tables.join(", ")
            )
        },
    })
}

/// What the run did: tasks by state, deployments by state, sticker writes.
async fn figures(pool: &sqlx::PgPool, writes: &StickerWrites) -> anyhow::Result<Vec<Line>> {
    let mut rows = Vec::new();
    let by_state = |sql: &'static str| async move {
        let r: Vec<(String, i64)> = sqlx::query_as(sql).fetch_all(pool).await?;
        let total: i64 = r.iter().map(|(_, n)| n).sum();
        let detail = r
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        anyhow::Ok((total as u64, detail))
    };
    let (n, detail) =
        by_state("SELECT state, count(*) FROM tasks GROUP BY state ORDER BY state").await?;
    rows.push(Line {
        name: "tasks (by state)",
        count: Some(n),
        gate: false,
        detail,
    });
    let (n, detail) =
        by_state("SELECT task_type, count(*) FROM tasks GROUP BY task_type ORDER BY task_type")
            .await?;
    rows.push(Line {
        name: "tasks (by type)",
        count: Some(n),
        gate: false,
        detail,
    });
    let (n, detail) = by_state(
        "SELECT CASE WHEN read_back_of IS NULL THEN 'other' ELSE 'read-back' END, count(*)
         FROM tasks GROUP BY 1 ORDER BY 1",
    )
    .await?;
    rows.push(Line {
        name: "tasks (read-backs)",
        count: Some(n),
        gate: false,
        detail,
    });
    let (n, detail) =
        by_state("SELECT state, count(*) FROM deployments GROUP BY state ORDER BY state").await?;
    rows.push(Line {
        name: "deployments (by state)",
        count: Some(n),
        gate: false,
        detail,
    });
    rows.push(Line {
        name: "sticker writes on the real agents",
        count: Some(writes.values().sum()),
        gate: false,
        detail: format!("{} tasks", writes.len()),
    });
    Ok(rows)
}

/// Up to five of `ids` after "; e.g.", or nothing when there are none: a violation's detail
/// names tasks to look at.
fn examples(ids: &[Uuid]) -> String {
    if ids.is_empty() {
        return String::new();
    }
    let some: Vec<String> = ids.iter().take(5).map(Uuid::to_string).collect();
    format!("; e.g. {}", some.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state dir with a sticker history, in a fresh directory under the system's temp dir.
    fn state_with_history(lines: &[&str]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("berth-soak-check-{}", Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("stickers")).unwrap();
        std::fs::write(dir.join("stickers/history.log"), lines.join("\n") + "\n").unwrap();
        dir
    }

    #[test]
    fn a_task_written_twice_on_a_host_is_a_violation() {
        let once = r#"{"name":"a","taskId":"t1","writtenAt":"2026-01-01T00:00:00Z"}"#;
        let again = r#"{"name":"a","taskId":"t1","writtenAt":"2026-01-01T00:00:09Z"}"#;
        let other = r#"{"name":"b","taskId":"t2","writtenAt":"2026-01-01T00:00:01Z"}"#;
        // A line a kill -9 cut short is skipped, not counted and not fatal.
        let cut = r#"{"name":"c","taskId":"t"#;
        let dir = state_with_history(&[once, other, again, cut]);
        let writes = sticker_writes(std::slice::from_ref(&dir)).unwrap();
        let row = twice_on_hosts(&writes);
        assert_eq!(row.count, Some(1), "{}", row.detail);
        assert!(row.detail.contains("t1"), "{}", row.detail);
        assert!(print(&[row]));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_same_task_on_two_hosts_and_a_missing_history_are_not() {
        let line = r#"{"name":"a","taskId":"t1","writtenAt":"2026-01-01T00:00:00Z"}"#;
        let a = state_with_history(&[line]);
        let b = state_with_history(&[line]);
        let never_wrote = std::env::temp_dir().join(format!("berth-soak-check-{}", Uuid::new_v4()));
        let writes = sticker_writes(&[a.clone(), b.clone(), never_wrote]).unwrap();
        let row = twice_on_hosts(&writes);
        assert_eq!(row.count, Some(0), "{}", row.detail);
        assert!(!print(&[row]));
        std::fs::remove_dir_all(a).unwrap();
        std::fs::remove_dir_all(b).unwrap();
    }

    #[test]
    fn a_row_without_a_count_never_passes_for_zero() {
        let row = Line {
            name: "duplicate reconciler units",
            count: None,
            gate: true,
            detail: String::new(),
        };
        // Not measurable is shown as such ("n/a"); it neither fails nor counts as 0.
        assert!(!print(&[row]));
    }
}
