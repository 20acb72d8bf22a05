//! Server configuration: one struct, filled by the CLI from flags, environment variables and
//! `/etc/berth/server.toml` (`berth_cli::server_config`). [`ServerConfig::new`] owns the defaults.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Where berth's OpenBao is and how the server reaches it (seed 001: the `openbao` secrets
/// provider): agents log in with a deploy grant at `auth_mount` as `role` (what a lease names;
/// the mount's `jwks_url` is this server's `/.well-known/agent-jwks.json`) and read secrets from
/// the KV v2 `kv_mount` (checkin's `vault.mount`); `addr` is the lease's `addr`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenBaoSettings {
    /// `https://host:port` (or `http://127.0.0.1:port` for tests).
    pub addr: String,
    pub auth_mount: String,
    pub role: String,
    pub kv_mount: String,
    /// The CA certificate(s), PEM text, that OpenBao's TLS certificate is validated against;
    /// `None`: the system's CAs.
    pub ca_pem: Option<String>,
    /// A file holding the server's own OpenBao token (0600): `update` on `auth/token/lookup` and
    /// `auth/token/revoke-accessor`, `read`+`update` on `auth/<auth_mount>/config`.
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Holds the CA, certificates, keys, the admin token and (by default) the SQLite database.
    pub data_dir: PathBuf,
    /// Where the CLI binds; the server itself serves whatever listener it is given.
    pub listen: SocketAddr,
    /// A SQLite path or a `postgres://` URL; `None` means `<data_dir>/berth.db`.
    pub database: Option<String>,
    /// The PostgreSQL pool's bounds and statement timeout (SQLite ignores them); the defaults
    /// are `berth_store::PostgresPoolConfig`'s.
    pub database_pool: berth_store::PostgresPoolConfig,
    /// Extra names for the server certificate, besides `localhost` and `127.0.0.1`.
    pub hostnames: Vec<String>,
    /// How often agents heartbeat; late after 2 intervals (degraded), offline after 3.
    pub heartbeat_interval: Duration,
    /// Lifetime of agent certificates; agents renew after two thirds of it.
    pub agent_cert_validity: Duration,
    /// Lifetime of agent JWTs from `/api/v1/agents/token`.
    pub agent_jwt_ttl: Duration,
    /// `iss` of the JWTs this server signs.
    pub jwt_issuer: String,
    /// Largest request body accepted.
    pub body_limit: usize,
    /// Most concurrent connections; further ones wait for a slot. Lowered at start to what the
    /// open-files limit leaves room for (see `tls::connection_budget`).
    pub max_connections: usize,
    /// Most concurrent connections from one source address (IPv6: one /64); further ones are
    /// closed at accept. `0`: no cap. Agents behind one NAT share an address and hold about
    /// one connection each, so the default admits a large fleet behind a single address.
    pub max_connections_per_source: usize,
    /// How long a connection may go without a request: a request head must arrive within it,
    /// counted from the TLS handshake (HTTP/1.1: also from the previous answer). An HTTP/2
    /// connection that has made a request may idle for three heartbeat intervals.
    pub header_read_timeout: Duration,
    /// How long a request body may take to arrive, from the handler's first read of it.
    pub body_read_timeout: Duration,
    /// `--agent-transport disabled`: every poll and result fails closed and `/readyz` says so.
    pub agent_transport_enabled: bool,
    /// Longest a task poll waits for an assignment (at most 25 s).
    pub long_poll: Duration,
    /// Added to a task's timeout to form its delivery lease.
    pub lease_grace: Duration,
    /// Retry back-off and dead-letter threshold.
    pub retry_policy: berth_store::RetryPolicy,
    /// Where every handler and reconciler reads "now" (tests inject a `ManualClock`).
    pub clock: std::sync::Arc<dyn crate::Clock>,
    /// The URL agents reach this server at (kit install command, a `builtin` lease's `addr`);
    /// `None`: `https://<first hostname or localhost>:<listen port>`.
    pub public_url: Option<String>,
    /// The OpenBao that holds secrets; `None`: secrets are berth's own (`builtin`).
    pub openbao: Option<OpenBaoSettings>,
    /// The agent binaries `/install.sh` downloads, named `berth-agent-<os>-<arch>`; `None`: the
    /// `berth-agent` beside the running binary, for this machine's platform.
    pub agent_downloads: Option<PathBuf>,
    /// Most open (not terminal) tasks one agent may hold before a create for it is refused
    /// (`429 QUEUE_FULL` to a client; the server's own deployment, drift and readiness tasks
    /// wait for room, see `services::tasks`). Read-backs are never refused by it (they count).
    pub max_open_tasks_per_agent: u32,
    /// The webhook sender's schedule and timeout.
    pub notify: NotifySettings,
    /// Finished tasks and events older than this are pruned (`retention.rs`); `None`: kept.
    pub retention: Option<time::Duration>,
    /// The registries berth is the token server for (issue 17 item 3).
    pub registry_tokens: RegistryTokenSettings,
}

/// berth as the token server of registries configured with `auth: token` and berth's
/// `registry-token.crt` as their `rootcertbundle`: a deployment's `docker.run` of an image on one
/// of them carries a pull token for that repository only, never a password.
#[derive(Debug, Clone)]
pub struct RegistryTokenSettings {
    /// Registry host as image references name it (`host[:port]`) → that registry's
    /// `auth.token.service`, the tokens' `aud`.
    pub registries: std::collections::BTreeMap<String, String>,
    /// `iss` of the tokens: the registries' `auth.token.issuer`.
    pub issuer: String,
}

impl Default for RegistryTokenSettings {
    fn default() -> RegistryTokenSettings {
        RegistryTokenSettings {
            registries: Default::default(),
            issuer: "berth".into(),
        }
    }
}

/// How the notification sender delivers (issue 14 item 3).
#[derive(Debug, Clone)]
pub struct NotifySettings {
    /// The delay before each retry of a refused or 5xx send; once used up the notification is
    /// `dead`. Default seed 003's 1 s, 8 s, 64 s, 5 min.
    pub retry_schedule: Vec<Duration>,
    /// The longest one send may take; a send that times out after the request left is
    /// `unknown`.
    pub timeout: Duration,
    /// How often the sender looks for due rows when nothing wakes it.
    pub sweep_interval: Duration,
}

impl Default for NotifySettings {
    fn default() -> Self {
        NotifySettings {
            retry_schedule: [1, 8, 64, 300].map(Duration::from_secs).to_vec(),
            timeout: Duration::from_secs(10),
            sweep_interval: Duration::from_secs(1),
        }
    }
}

/// `1s,8s,64s,5m` (units `ms`, `s`, `m`, `h`; at most 16 steps, each at most a day).
pub fn parse_retry_schedule(text: &str) -> Result<Vec<Duration>, String> {
    let steps = text
        .split(',')
        .map(|step| {
            let step = step.trim();
            let split = step
                .find(|c: char| !c.is_ascii_digit())
                .ok_or_else(|| format!("{step:?}: give a unit (ms, s, m or h)"))?;
            let (digits, unit) = step.split_at(split);
            let n: u64 = digits
                .parse()
                .map_err(|_| format!("{step:?}: not a number of {unit}"))?;
            let d = match unit {
                "ms" => Duration::from_millis(n),
                "s" => Duration::from_secs(n),
                "m" => Duration::from_secs(n.saturating_mul(60)),
                "h" => Duration::from_secs(n.saturating_mul(3600)),
                _ => return Err(format!("{step:?}: the unit is one of ms, s, m, h")),
            };
            if d > Duration::from_secs(86_400) {
                return Err(format!("{step:?}: at most a day"));
            }
            Ok(d)
        })
        .collect::<Result<Vec<_>, _>>()?;
    if steps.len() > 16 {
        return Err("at most 16 retries".into());
    }
    Ok(steps)
}

/// The text [`parse_retry_schedule`] reads back: each step in its largest whole unit.
pub fn format_retry_schedule(steps: &[Duration]) -> String {
    let step = |d: &Duration| {
        let ms = d.as_millis();
        match ms {
            _ if ms.is_multiple_of(3_600_000) && ms > 0 => format!("{}h", ms / 3_600_000),
            _ if ms.is_multiple_of(60_000) && ms > 0 => format!("{}m", ms / 60_000),
            _ if ms.is_multiple_of(1_000) => format!("{}s", ms / 1_000),
            _ => format!("{ms}ms"),
        }
    };
    steps.iter().map(step).collect::<Vec<_>>().join(",")
}

impl OpenBaoSettings {
    pub const DEFAULT_AUTH_MOUNT: &'static str = berth_proto::desired::DEFAULT_OPENBAO_AUTH_MOUNT;
    pub const DEFAULT_ROLE: &'static str = berth_proto::desired::DEFAULT_OPENBAO_ROLE;
    /// The KV v2 mount `--openbao-kv-mount` defaults to.
    pub const DEFAULT_KV_MOUNT: &'static str = "berth";

    /// The defaults of seed 001 for everything but the address and the KV mount.
    pub fn new(addr: impl Into<String>, kv_mount: impl Into<String>) -> OpenBaoSettings {
        OpenBaoSettings {
            addr: addr.into(),
            auth_mount: Self::DEFAULT_AUTH_MOUNT.to_string(),
            role: Self::DEFAULT_ROLE.to_string(),
            kv_mount: kv_mount.into(),
            ca_pem: None,
            token_file: None,
        }
    }
}

impl ServerConfig {
    pub fn new(data_dir: PathBuf, listen: SocketAddr) -> ServerConfig {
        ServerConfig {
            data_dir,
            listen,
            database: None,
            database_pool: berth_store::PostgresPoolConfig::default(),
            hostnames: Vec::new(),
            heartbeat_interval: Duration::from_secs(30),
            agent_cert_validity: Duration::from_secs(30 * 24 * 3600),
            agent_jwt_ttl: Duration::from_secs(3600),
            jwt_issuer: "berth".to_string(),
            body_limit: 1024 * 1024,
            max_connections: 20_000,
            max_connections_per_source: 1_000,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
            agent_transport_enabled: true,
            long_poll: Duration::from_secs(25),
            lease_grace: Duration::from_secs(30),
            retry_policy: berth_store::RetryPolicy::default(),
            clock: std::sync::Arc::new(crate::SystemClock),
            public_url: None,
            openbao: None,
            agent_downloads: None,
            max_open_tasks_per_agent: 1_000,
            retention: Some(time::Duration::days(30)),
            notify: NotifySettings::default(),
            registry_tokens: RegistryTokenSettings::default(),
        }
    }

    /// [`ServerConfig::public_url`], or the URL the server's own certificate names.
    pub fn public_url(&self) -> String {
        match &self.public_url {
            Some(url) => url.trim_end_matches('/').to_string(),
            None => format!(
                "https://{}:{}",
                self.hostnames.first().map_or("localhost", String::as_str),
                self.listen.port()
            ),
        }
    }

    pub fn database_url(&self) -> String {
        match &self.database {
            Some(db) => db.clone(),
            None => self
                .data_dir
                .join("berth.db")
                .to_string_lossy()
                .into_owned(),
        }
    }
}

#[cfg(test)]
mod notify_tests {
    use super::*;

    #[test]
    fn the_seed_schedule_parses() {
        assert_eq!(
            parse_retry_schedule("1s,8s,64s,5m").unwrap(),
            NotifySettings::default().retry_schedule
        );
        assert_eq!(
            parse_retry_schedule("50ms, 2s").unwrap(),
            [Duration::from_millis(50), Duration::from_secs(2)]
        );
        for text in ["1s,8s,64s,5m", "50ms,2s,1h", "0s"] {
            assert_eq!(
                format_retry_schedule(&parse_retry_schedule(text).unwrap()),
                text
            );
        }
        for bad in ["", "5", "1x", "s", "2d", "25h"] {
            assert!(parse_retry_schedule(bad).is_err(), "{bad}");
        }
    }
}
