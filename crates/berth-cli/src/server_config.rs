//! `berth server`'s settings: each one a flag, an environment variable and a key of
//! `/etc/berth/server.toml` (the flag's long name, `-` as `_`), in one struct. Precedence: flag >
//! environment (clap) > file > default. The defaults are [`ServerConfig::new`]'s, plus the two
//! only the binary has ([`DEFAULT_DATA_DIR`], [`DEFAULT_LISTEN`]); none is written anywhere else.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_server::{OpenBaoSettings, ServerConfig};
use serde::{Deserialize, Serialize};

use crate::config::{self, ConfigError};

/// Read when present; `--config FILE` / `BERTH_CONFIG` names another, which must exist.
pub const DEFAULT_FILE: &str = "/etc/berth/server.toml";
pub const DEFAULT_DATA_DIR: &str = "./berth-data";
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8443));

/// `--agent-transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Switch {
    Enabled,
    Disabled,
}

/// Every setting of `berth server`; `None`: not given at this layer. Run
/// `berth server --print-config` for the effective values, defaults included.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// CA, keys, admin token and (by default) the SQLite database.
    #[arg(long, env = "BERTH_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// The address the server listens on.
    #[arg(long, env = "BERTH_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// A SQLite file or a postgres:// URL; default <data-dir>/berth.db.
    #[arg(long, env = "BERTH_DATABASE", hide_env_values = true)]
    pub database: Option<String>,
    /// PostgreSQL: most connections this server's pool opens (its LISTEN and sequencer
    /// connections are two more); every replica opens its own. SQLite ignores it.
    #[arg(long, env = "BERTH_DATABASE_MAX_CONNECTIONS")]
    pub database_max_connections: Option<u32>,
    /// PostgreSQL: a request that gets no pooled connection within this is answered 503
    /// UNAVAILABLE (retry). SQLite ignores it.
    #[arg(long, env = "BERTH_DATABASE_ACQUIRE_TIMEOUT_SECS")]
    pub database_acquire_timeout_secs: Option<u64>,
    /// PostgreSQL: the statement_timeout of every pooled connection; a statement past it is
    /// cancelled and its request answered 503 UNAVAILABLE (retry). 0: berth sets none.
    /// Migrations run without it. SQLite ignores it.
    #[arg(long, env = "BERTH_DATABASE_STATEMENT_TIMEOUT_SECS")]
    pub database_statement_timeout_secs: Option<u64>,
    /// Extra names for the server certificate (repeatable).
    #[arg(long, env = "BERTH_HOSTNAMES", value_delimiter = ',')]
    pub hostname: Option<Vec<String>>,
    /// The URL agents reach this server at (install kits, builtin leases); default
    /// https://<first hostname or localhost>:<listen port>.
    #[arg(long, env = "BERTH_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Agent heartbeat interval; agents are offline after 3 missed intervals.
    #[arg(long, env = "BERTH_HEARTBEAT_INTERVAL_SECS")]
    pub heartbeat_interval_secs: Option<u64>,
    /// Agent certificate lifetime; agents renew after two thirds of it.
    #[arg(long, env = "BERTH_AGENT_CERT_VALIDITY_SECS")]
    pub agent_cert_validity_secs: Option<u64>,
    /// `disabled` makes every task poll and result fail closed, and /readyz report it.
    #[arg(long, env = "BERTH_AGENT_TRANSPORT", value_enum)]
    pub agent_transport: Option<Switch>,
    /// Added to a task's timeout to form its delivery lease.
    #[arg(long, env = "BERTH_LEASE_GRACE_SECS")]
    pub lease_grace_secs: Option<u64>,
    /// Most connections from one source address (IPv6: per /64); 0 for no cap. Agents behind
    /// one NAT share an address (about one connection each): set it above that fleet's size.
    #[arg(long, env = "BERTH_MAX_CONNECTIONS_PER_SOURCE")]
    pub max_connections_per_source: Option<usize>,
    /// A connection that sends no complete request head for this long is closed (slow or idle).
    #[arg(long, env = "BERTH_HEADER_READ_TIMEOUT_SECS")]
    pub header_read_timeout_secs: Option<u64>,
    /// A request whose body does not arrive within this long is refused and its connection closed.
    #[arg(long, env = "BERTH_BODY_READ_TIMEOUT_SECS")]
    pub body_read_timeout_secs: Option<u64>,
    /// Most open tasks one agent may hold before a create for it is refused (429 QUEUE_FULL);
    /// the server's own deployment, drift and readiness tasks wait for room, read-backs never do.
    #[arg(long, env = "BERTH_MAX_OPEN_TASKS_PER_AGENT")]
    pub max_open_tasks_per_agent: Option<u32>,
    /// Finished tasks (with their attempts) and events older than this many days are deleted,
    /// in small batches; 0 keeps them. The audit log is never pruned.
    #[arg(long, env = "BERTH_RETENTION_DAYS")]
    pub retention_days: Option<u32>,
    /// The delays before each retry of a webhook send that was refused or answered 5xx, then
    /// the notification is dead (units ms, s, m, h).
    #[arg(long, env = "BERTH_NOTIFY_RETRY_SCHEDULE")]
    pub notify_retry_schedule: Option<String>,
    /// The longest one webhook send may take; one that times out after the request left is
    /// `unknown` and is never resent by itself.
    #[arg(long, env = "BERTH_NOTIFY_TIMEOUT_SECS")]
    pub notify_timeout_secs: Option<u64>,
    /// OpenBao holds desired-state secrets (seed 001's `openbao` provider): its address, given
    /// to agents in leases. Without it the `builtin` store serves them.
    #[arg(long, env = "BERTH_OPENBAO_ADDR")]
    pub openbao_addr: Option<String>,
    /// The KV v2 mount agents read secrets from (checkin's `vault.mount`); needs openbao-addr.
    #[arg(long, env = "BERTH_OPENBAO_KV_MOUNT")]
    pub openbao_kv_mount: Option<String>,
    /// The JWT auth mount agents log in at with a deploy grant (its `jwks_url` is this server's
    /// /.well-known/agent-jwks.json), and its role; need openbao-addr.
    #[arg(long, env = "BERTH_OPENBAO_AUTH_MOUNT")]
    pub openbao_auth_mount: Option<String>,
    #[arg(long, env = "BERTH_OPENBAO_ROLE")]
    pub openbao_role: Option<String>,
    /// The CA (PEM) OpenBao's certificate is checked against; default the system's.
    #[arg(long, env = "BERTH_OPENBAO_CA_FILE")]
    pub openbao_ca_file: Option<PathBuf>,
    /// A file (0600) with the server's own OpenBao token (`auth/token/lookup`, the JWT mount's
    /// config): needed to accept agents that authenticate with their OpenBao token.
    #[arg(long, env = "BERTH_OPENBAO_TOKEN_FILE")]
    pub openbao_token_file: Option<PathBuf>,
    /// A registry berth is the token server of, HOST=SERVICE (repeatable): HOST as image
    /// references name it (`host[:port]`), SERVICE its `auth.token.service`. Deployments pull
    /// from it with a per-task pull token; its `rootcertbundle` is the data dir's
    /// `registry-token.crt` (also `GET /api/v1/registry-token/certificate`).
    #[arg(long, env = "BERTH_REGISTRY_TOKEN_ISSUERS", value_delimiter = ',')]
    pub registry_token_issuer: Option<Vec<String>>,
    /// `iss` of berth's registry tokens: the registries' `auth.token.issuer`.
    #[arg(long, env = "BERTH_REGISTRY_TOKEN_ISS")]
    pub registry_token_iss: Option<String>,
    /// A directory of agent binaries, berth-agent-<os>-<arch> (e.g. berth-agent-linux-x86_64),
    /// that the install line of `berth token create` downloads; default the berth-agent beside
    /// this binary, for this machine's platform.
    #[arg(long, value_name = "DIR", env = "BERTH_AGENT_DOWNLOADS")]
    pub agent_downloads: Option<PathBuf>,
    /// text (plain unless stderr is a terminal) or json (one object per line, for log
    /// shippers).
    #[arg(long, value_name = "FORMAT", env = "BERTH_LOG_FORMAT")]
    pub log_format: Option<crate::LogFormat>,
}

impl ServerSettings {
    /// Every default of `berth server`, taken from the library that owns it.
    pub fn defaults() -> ServerSettings {
        let c = ServerConfig::new(PathBuf::from(DEFAULT_DATA_DIR), DEFAULT_LISTEN);
        ServerSettings {
            data_dir: Some(c.data_dir.clone()),
            listen: Some(c.listen),
            database_max_connections: Some(c.database_pool.max_connections),
            database_acquire_timeout_secs: Some(c.database_pool.acquire_timeout.as_secs()),
            database_statement_timeout_secs: Some(
                c.database_pool.statement_timeout.map_or(0, |d| d.as_secs()),
            ),
            heartbeat_interval_secs: Some(c.heartbeat_interval.as_secs()),
            agent_cert_validity_secs: Some(c.agent_cert_validity.as_secs()),
            agent_transport: Some(if c.agent_transport_enabled {
                Switch::Enabled
            } else {
                Switch::Disabled
            }),
            lease_grace_secs: Some(c.lease_grace.as_secs()),
            max_connections_per_source: Some(c.max_connections_per_source),
            header_read_timeout_secs: Some(c.header_read_timeout.as_secs()),
            body_read_timeout_secs: Some(c.body_read_timeout.as_secs()),
            max_open_tasks_per_agent: Some(c.max_open_tasks_per_agent),
            retention_days: Some(
                c.retention
                    .map_or(0, |d| u32::try_from(d.whole_days()).unwrap_or(u32::MAX)),
            ),
            notify_retry_schedule: Some(berth_server::format_retry_schedule(
                &c.notify.retry_schedule,
            )),
            notify_timeout_secs: Some(c.notify.timeout.as_secs()),
            openbao_kv_mount: Some(OpenBaoSettings::DEFAULT_KV_MOUNT.into()),
            openbao_auth_mount: Some(OpenBaoSettings::DEFAULT_AUTH_MOUNT.into()),
            openbao_role: Some(OpenBaoSettings::DEFAULT_ROLE.into()),
            registry_token_iss: Some(c.registry_tokens.issuer.clone()),
            log_format: Some(crate::LogFormat::default()),
            ..ServerSettings::default()
        }
    }

    /// `given` (flags and environment) over the file (`named`, else [`DEFAULT_FILE`] when it
    /// exists) over [`ServerSettings::defaults`].
    pub fn resolve(
        given: &ServerSettings,
        named: Option<&Path>,
    ) -> Result<ServerSettings, ConfigError> {
        let file: ServerSettings = config::read_file(named, Path::new(DEFAULT_FILE))?;
        let set = config::layer(given, &file)?;
        if set.openbao_addr.is_none() {
            let needs_addr = [
                ("openbao_kv_mount", set.openbao_kv_mount.is_some()),
                ("openbao_auth_mount", set.openbao_auth_mount.is_some()),
                ("openbao_role", set.openbao_role.is_some()),
                ("openbao_ca_file", set.openbao_ca_file.is_some()),
                ("openbao_token_file", set.openbao_token_file.is_some()),
            ];
            if let Some((key, _)) = needs_addr.iter().find(|(_, set)| *set) {
                return Err(ConfigError(format!(
                    "{key} (--{}) needs openbao_addr (--openbao-addr)",
                    key.replace('_', "-")
                )));
            }
        }
        let mut resolved = config::layer(&set, &ServerSettings::defaults())?;
        if resolved.openbao_addr.is_none() {
            // Without OpenBao its mounts mean nothing; left out, the printed settings read back.
            resolved.openbao_kv_mount = None;
            resolved.openbao_auth_mount = None;
            resolved.openbao_role = None;
        }
        Ok(resolved)
    }

    /// The settings as TOML, the database password masked.
    pub fn to_toml(&self, named: Option<&Path>) -> Result<String, ConfigError> {
        let mut shown = self.clone();
        shown.database = shown.database.as_deref().map(config::mask_url);
        shown.public_url = shown.public_url.as_deref().map(config::mask_url);
        shown.openbao_addr = shown.openbao_addr.as_deref().map(config::mask_url);
        config::to_toml(
            &shown,
            "berth server",
            &config::file_in_use(named, Path::new(DEFAULT_FILE)),
        )
    }

    /// The server's configuration; refuses a value it cannot run with. Reads `openbao_ca_file`.
    pub fn server_config(&self) -> Result<ServerConfig, ConfigError> {
        let bad = |m: &str| Err(ConfigError(m.to_string()));
        let mut c = ServerConfig::new(
            self.data_dir
                .clone()
                .unwrap_or_else(|| DEFAULT_DATA_DIR.into()),
            self.listen.unwrap_or(DEFAULT_LISTEN),
        );
        let secs = Duration::from_secs;
        c.database = self.database.clone();
        if let Some(v) = self.database_max_connections {
            if v == 0 {
                return bad("database_max_connections must be at least 1");
            }
            c.database_pool.max_connections = v;
        }
        if let Some(v) = self.database_acquire_timeout_secs {
            if v == 0 {
                return bad("database_acquire_timeout_secs must be at least 1");
            }
            c.database_pool.acquire_timeout = secs(v);
        }
        if let Some(v) = self.database_statement_timeout_secs {
            c.database_pool.statement_timeout = (v > 0).then(|| secs(v));
        }
        c.hostnames = self.hostname.clone().unwrap_or_default();
        c.public_url = self.public_url.clone();
        c.agent_downloads = self.agent_downloads.clone();
        if let Some(v) = self.heartbeat_interval_secs {
            if v == 0 {
                return bad("heartbeat_interval_secs must be at least 1");
            }
            c.heartbeat_interval = secs(v);
        }
        if let Some(v) = self.agent_cert_validity_secs {
            if v < 60 {
                return bad("agent_cert_validity_secs must be at least 60");
            }
            c.agent_cert_validity = secs(v);
        }
        if let Some(v) = self.agent_transport {
            c.agent_transport_enabled = v == Switch::Enabled;
        }
        if let Some(v) = self.lease_grace_secs {
            c.lease_grace = secs(v);
        }
        if let Some(v) = self.max_connections_per_source {
            c.max_connections_per_source = v;
        }
        if let Some(v) = self.header_read_timeout_secs {
            if v == 0 {
                return bad("header_read_timeout_secs must be at least 1");
            }
            c.header_read_timeout = secs(v);
        }
        if let Some(v) = self.body_read_timeout_secs {
            if v == 0 {
                return bad("body_read_timeout_secs must be at least 1");
            }
            c.body_read_timeout = secs(v);
        }
        if let Some(v) = self.max_open_tasks_per_agent {
            c.max_open_tasks_per_agent = v;
        }
        if let Some(days) = self.retention_days {
            c.retention = (days > 0).then(|| time::Duration::days(days.into()));
        }
        if let Some(text) = &self.notify_retry_schedule {
            c.notify.retry_schedule = berth_server::parse_retry_schedule(text)
                .map_err(|e| ConfigError(format!("notify_retry_schedule: {e}")))?;
        }
        if let Some(v) = self.notify_timeout_secs {
            if v == 0 {
                return bad("notify_timeout_secs must be at least 1");
            }
            c.notify.timeout = secs(v);
        }
        if let Some(iss) = &self.registry_token_iss {
            c.registry_tokens.issuer = iss.clone();
        }
        for entry in self.registry_token_issuer.iter().flatten() {
            let Some((host, service)) = entry
                .split_once('=')
                .filter(|(h, s)| !h.is_empty() && !s.is_empty())
            else {
                return Err(ConfigError(format!(
                    "registry_token_issuer {entry:?} is not HOST=SERVICE"
                )));
            };
            c.registry_tokens
                .registries
                .insert(host.to_string(), service.to_string());
        }
        if let Some(addr) = &self.openbao_addr {
            let ca_pem =
                match &self.openbao_ca_file {
                    Some(f) => Some(std::fs::read_to_string(f).map_err(|e| {
                        ConfigError(format!("openbao_ca_file {}: {e}", f.display()))
                    })?),
                    None => None,
                };
            let mut bao = OpenBaoSettings::new(
                addr.clone(),
                self.openbao_kv_mount
                    .as_deref()
                    .unwrap_or(OpenBaoSettings::DEFAULT_KV_MOUNT),
            );
            if let Some(mount) = &self.openbao_auth_mount {
                bao.auth_mount = mount.clone();
            }
            if let Some(role) = &self.openbao_role {
                bao.role = role.clone();
            }
            bao.ca_pem = ca_pem;
            bao.token_file = self.openbao_token_file.clone();
            c.openbao = Some(bao);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        settings: ServerSettings,
    }

    /// One test sets the variables, so no other test of this binary sees them.
    #[test]
    fn flag_beats_environment_beats_file_beats_default() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("server.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:1001\"\nretention_days = 7\nlease_grace_secs = 11\n\
             heartbeat_interval_secs = 12\nhostname = [\"from-file\"]\n",
        )
        .unwrap();
        std::env::set_var("BERTH_RETENTION_DAYS", "8");
        std::env::set_var("BERTH_LEASE_GRACE_SECS", "21");
        let given = Cli::try_parse_from(["x", "--lease-grace-secs", "31"])
            .unwrap()
            .settings;
        std::env::remove_var("BERTH_RETENTION_DAYS");
        std::env::remove_var("BERTH_LEASE_GRACE_SECS");
        let s = ServerSettings::resolve(&given, Some(&file)).unwrap();
        assert_eq!(s.lease_grace_secs, Some(31), "flag over environment");
        assert_eq!(s.retention_days, Some(8), "environment over file");
        assert_eq!(s.heartbeat_interval_secs, Some(12), "file over default");
        assert_eq!(s.listen, Some("127.0.0.1:1001".parse().unwrap()));
        assert_eq!(s.hostname, Some(vec!["from-file".to_string()]));
        assert_eq!(s.data_dir, Some(PathBuf::from(DEFAULT_DATA_DIR)), "default");
        let c = s.server_config().unwrap();
        assert_eq!(c.lease_grace, Duration::from_secs(31));
        assert_eq!(c.retention, Some(time::Duration::days(8)));
        assert_eq!(c.heartbeat_interval, Duration::from_secs(12));
    }

    #[test]
    fn the_defaults_are_the_libraries_own() {
        let from_defaults = ServerSettings::defaults().server_config().unwrap();
        let library = ServerConfig::new(DEFAULT_DATA_DIR.into(), DEFAULT_LISTEN);
        assert_eq!(from_defaults.heartbeat_interval, library.heartbeat_interval);
        assert_eq!(from_defaults.retention, library.retention);
        assert_eq!(
            from_defaults.notify.retry_schedule,
            library.notify.retry_schedule
        );
        assert_eq!(
            from_defaults.registry_tokens.issuer,
            library.registry_tokens.issuer
        );
        assert_eq!(from_defaults.database_pool, library.database_pool);
        assert!(from_defaults.openbao.is_none());
    }

    #[test]
    fn the_database_pool_settings_reach_the_store_config() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("server.toml");
        std::fs::write(
            &file,
            "database_max_connections = 4\ndatabase_statement_timeout_secs = 0\n",
        )
        .unwrap();
        let given = ServerSettings {
            database_acquire_timeout_secs: Some(3),
            ..ServerSettings::default()
        };
        let c = ServerSettings::resolve(&given, Some(&file))
            .unwrap()
            .server_config()
            .unwrap();
        assert_eq!(
            c.database_pool,
            berth_server::PostgresPoolConfig {
                max_connections: 4,
                acquire_timeout: Duration::from_secs(3),
                // 0: berth sets no statement_timeout.
                statement_timeout: None,
            }
        );
    }

    #[test]
    fn an_unknown_key_names_itself_and_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("server.toml");
        std::fs::write(&file, "retention_days = 3\nretention = 4\n").unwrap();
        let err = ServerSettings::resolve(&ServerSettings::default(), Some(&file))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown key `retention`"), "{err}");
        assert!(err.contains(&format!("{}:2", file.display())), "{err}");
    }

    #[test]
    fn openbao_keys_need_the_address_and_bad_values_are_refused() {
        let only_role = ServerSettings {
            openbao_role: Some("r".into()),
            ..ServerSettings::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.toml");
        std::fs::write(&empty, "").unwrap();
        let err = ServerSettings::resolve(&only_role, Some(&empty))
            .unwrap_err()
            .to_string();
        assert!(err.contains("openbao_role"), "{err}");
        for bad in [
            ServerSettings {
                heartbeat_interval_secs: Some(0),
                ..ServerSettings::default()
            },
            ServerSettings {
                registry_token_issuer: Some(vec!["nohost".into()]),
                ..ServerSettings::default()
            },
            ServerSettings {
                notify_retry_schedule: Some("5".into()),
                ..ServerSettings::default()
            },
            ServerSettings {
                database_max_connections: Some(0),
                ..ServerSettings::default()
            },
            ServerSettings {
                database_acquire_timeout_secs: Some(0),
                ..ServerSettings::default()
            },
        ] {
            assert!(bad.server_config().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_printed_config_masks_the_database_password() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.toml");
        std::fs::write(&empty, "").unwrap();
        let given = ServerSettings {
            database: Some("postgres://berth:hunter2@db/berth".into()),
            ..ServerSettings::default()
        };
        let s = ServerSettings::resolve(&given, Some(&empty)).unwrap();
        let text = s.to_toml(None).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("postgres://berth:***@db/berth"), "{text}");
        // What it prints reads back as a config file, to the same settings.
        let printed = dir.path().join("printed.toml");
        std::fs::write(&printed, &text).unwrap();
        let back = ServerSettings::resolve(&ServerSettings::default(), Some(&printed)).unwrap();
        assert_eq!(
            back,
            ServerSettings {
                database: back.database.clone(),
                ..s
            }
        );
        assert_eq!(back.retention_days, Some(30));
    }
}
