//! `berth-bench retention-sim`: issue 16 item 6's bound, on the store's clock. A SQLite store
//! (the server's own backend, opened directly) lives through `--days` simulated days of
//! `--agents` agents running `--per-day` tasks each, the retention sweep's prune after every
//! day (`berth_store::conformance::retention_simulation`); the database file's size is read
//! after each day. Nothing waits: a day is a timestamp.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use berth_store::conformance::{retention_simulation, RetentionDay};
use clap::Args;

#[derive(Args, Debug)]
pub struct RetentionArgs {
    /// The SQLite file to create (it must not exist).
    #[arg(long)]
    database: PathBuf,
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// Tasks each agent runs a day.
    #[arg(long, default_value_t = 2)]
    per_day: usize,
    #[arg(long, default_value_t = 60)]
    days: u32,
    /// `--retention-days`: what finished longer ago is pruned.
    #[arg(long, default_value_t = 30)]
    keep_days: u32,
}

pub async fn retention(args: RetentionArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.database.exists(),
        "{} exists; name a new file",
        args.database.display()
    );
    let key = berth_store::PayloadKey::new(berth_crypto::MasterKey::generate());
    let store: berth_store::DynStore = std::sync::Arc::new(
        berth_store::SqliteStore::open(&args.database, key)
            .await
            .context("opening the database")?,
    );
    let wal = PathBuf::from(format!("{}-wal", args.database.display()));
    let size = |p: &PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
    println!("day  tasks kept  pruned tasks  pruned events  db MiB  wal MiB  s");
    let started = Instant::now();
    let mut sizes = Vec::new();
    retention_simulation(
        &store,
        args.agents,
        args.per_day,
        args.days,
        args.keep_days,
        |d: RetentionDay| {
            let (db, w) = (size(&args.database), size(&wal));
            sizes.push(db);
            println!(
                "{:>3}  {:>10}  {:>12}  {:>13}  {:>6.1}  {:>7.1}  {:.0}",
                d.day,
                d.tasks_kept,
                d.tasks_pruned,
                d.events_pruned,
                db as f64 / 1048576.0,
                w as f64 / 1048576.0,
                started.elapsed().as_secs_f64()
            );
        },
    )
    .await;
    let at_keep = sizes[(args.keep_days as usize + 1).min(sizes.len() - 1)];
    let last = *sizes.last().unwrap_or(&0);
    println!(
        "SUMMARY {{\"days\":{},\"agents\":{},\"per_day\":{},\"keep_days\":{},\"db_bytes_after_first_prune\":{at_keep},\"db_bytes_at_end\":{last},\"growth_after_first_prune\":{:.3}}}",
        args.days,
        args.agents,
        args.per_day,
        args.keep_days,
        last as f64 / at_keep.max(1) as f64
    );
    Ok(())
}
