//! Desired-state environments from the command line: `berth bundle push`, and `berth env
//! set-desired | retire | desired`. The server computes a bundle's sha; the CLI only prints it.

use std::path::PathBuf;

use anyhow::Context;
use berth_client::Client;
use berth_proto::desired::{
    bundles_path, BundleView, DesiredStateView, GetDesiredState, PutDesired, RetireEnvironment,
    BUNDLE_CONTENT_TYPE,
};

use crate::output::{table, Output};

/// `berth bundle push FILE --env E`: stores the tar content-addressed; prints its sha.
pub async fn push_bundle(
    client: &Client,
    out: Output,
    file: PathBuf,
    environment: String,
) -> anyhow::Result<()> {
    let tar = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let view: BundleView = client
        .post_bytes(&bundles_path(&environment), BUNDLE_CONTENT_TYPE, tar)
        .await?;
    out.print(&view, || view.sha.clone())
}

pub async fn set_desired(
    client: &Client,
    out: Output,
    environment: String,
    sha: String,
) -> anyhow::Result<()> {
    print_state(out, &client.send(&PutDesired { environment, sha }).await?)
}

pub async fn retire(
    client: &Client,
    out: Output,
    environment: String,
    purge_volumes: bool,
) -> anyhow::Result<()> {
    let state = client
        .send(&RetireEnvironment {
            environment,
            purge_volumes,
        })
        .await?;
    print_state(out, &state)
}

pub async fn show(client: &Client, out: Output, environment: String) -> anyhow::Result<()> {
    print_state(out, &client.send(&GetDesiredState { environment }).await?)
}

fn dash(value: Option<&str>) -> String {
    value.unwrap_or("-").to_string()
}

/// The desired sha and one row per agent: applied sha, last result, detail, last checkin.
pub fn print_state(out: Output, state: &DesiredStateView) -> anyhow::Result<()> {
    out.print(state, || {
        let mut text = format!(
            "environment {}  desired {}{}\n",
            state.environment,
            dash(state.desired_sha.as_deref()),
            match (state.retired, state.purge_volumes) {
                (true, true) => "  RETIRED (purge volumes)",
                (true, false) => "  RETIRED",
                _ => "",
            }
        );
        let rows: Vec<Vec<String>> = state
            .agents
            .iter()
            .map(|a| {
                vec![
                    a.agent.clone(),
                    dash(a.applied_sha.as_deref()),
                    dash(a.last_result.as_deref()),
                    dash(a.detail.as_deref()),
                    a.last_checkin_at
                        .map(|t| t.to_string())
                        .unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        text.push_str(&table(
            &["AGENT", "APPLIED", "RESULT", "DETAIL", "LAST CHECKIN"],
            &rows,
        ));
        text
    })
}
