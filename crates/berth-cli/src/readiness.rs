//! `berth env verify` and `berth env readiness`: an environment's readiness conditions.

use std::time::Duration;

use anyhow::bail;
use berth_client::Client;
use berth_proto::readiness::{EnvironmentReadiness, GetReadiness, VerifyEnvironment};

use crate::output::{rfc3339, table, Output};

/// `berth env verify` exits with this when the verification completed and the environment is
/// not OperationalReady (1 stays for errors and timeouts).
pub const EXIT_NOT_READY: u8 = 3;

/// The verification completed and found the environment not ready: `main` exits
/// [`EXIT_NOT_READY`].
#[derive(Debug)]
pub struct NotReady(pub String);

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "environment {} is not OperationalReady", self.0)
    }
}

impl std::error::Error for NotReady {}

const POLL: Duration = Duration::from_millis(500);

pub fn print(out: Output, r: &EnvironmentReadiness) -> anyhow::Result<()> {
    out.print(r, || {
        let rows: Vec<Vec<String>> = r
            .conditions
            .iter()
            .map(|c| {
                vec![
                    c.kind.to_string(),
                    c.status.as_str().into(),
                    c.reason.clone(),
                    c.message.clone(),
                    rfc3339(c.observed_at),
                ]
            })
            .collect();
        format!(
            "environment {}, generation {}: OperationalReady {}\n{}",
            r.environment,
            r.generation,
            if r.operational_ready { "True" } else { "False" },
            table(
                &["CONDITION", "STATUS", "REASON", "MESSAGE", "OBSERVED"],
                &rows
            )
        )
    })
}

pub async fn show(client: &Client, out: Output, name: String) -> anyhow::Result<()> {
    print(out, &client.send(&GetReadiness { name }).await?)
}

/// Sets a fresh nonce, waits until a pass answered it (every condition terminal), prints the
/// table; [`NotReady`] unless the environment is OperationalReady.
pub async fn verify(
    client: &Client,
    out: Output,
    name: String,
    timeout: Duration,
) -> anyhow::Result<()> {
    let nonce = client
        .send(&VerifyEnvironment { name: name.clone() })
        .await?
        .nonce;
    let deadline = tokio::time::Instant::now() + timeout;
    let readiness = loop {
        let r = client.send(&GetReadiness { name: name.clone() }).await?;
        if r.verify_observed.as_deref() == Some(nonce.as_str()) {
            break r;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "the verification of {name} did not complete within {}s (nonce {nonce}); \
                 `berth env readiness {name}` shows where it is",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    };
    print(out, &readiness)?;
    if readiness.operational_ready {
        Ok(())
    } else {
        Err(NotReady(name).into())
    }
}
