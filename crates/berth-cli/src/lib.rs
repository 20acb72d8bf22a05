//! Shared pieces of the `berth` and `berth-agent` binaries: logging, signals, label parsing.

use std::collections::BTreeMap;

/// How the binaries write their log (`--log-format`, `log_format` in the config file).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One line per event, for people; coloured only at a terminal.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields`, `spans`), for log
    /// shippers.
    Json,
}

/// Logs to stderr; `RUST_LOG` overrides the default `info`.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        // Colours only for a person at a terminal: a log file or journald gets plain text,
        // and the escape codes cost every line on a busy server.
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => logs.json().with_span_list(true).try_init(),
    };
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when the
/// future is first polled, so a signal that arrives early is not fatal. Call it inside a runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

/// `k=v` items (already split on commas) into a map.
pub fn parse_labels(items: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for item in items.iter().filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| format!("label {item:?} must be key=value"))?;
        labels.insert(k.trim().to_string(), v.trim().to_string());
    }
    Ok(labels)
}

/// The host name, made into a valid agent name.
pub fn default_agent_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        "agent".to_string()
    } else {
        name
    }
}

pub mod agent_config;
pub mod agents;
pub mod audit;
#[cfg(feature = "server")]
pub mod backup;
pub mod bundle;
pub mod config;
pub mod deploy;
pub mod desired;
#[cfg(feature = "server")]
pub mod dev;
pub mod docs;
pub mod notify;
pub mod output;
pub mod readiness;
pub mod secret;
#[cfg(feature = "server")]
pub mod server_config;
pub mod ssh_target;

/// `90`, `90s`, `30m`, `1h`, `7d`.
pub fn parse_duration(s: &str) -> anyhow::Result<std::time::Duration> {
    let s = s.trim();
    let (number, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| anyhow::anyhow!("duration {s:?}: expected a number with s, m, h or d"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86400,
        _ => anyhow::bail!("duration {s:?}: unit must be s, m, h or d"),
    };
    Ok(std::time::Duration::from_secs(secs))
}
