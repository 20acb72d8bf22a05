//! The berth control plane: one TLS 1.3 listener that knows each connection's client certificate,
//! the HTTP API (admin, agent runtime, meta), and the reconcilers that keep derived state true.
//!
//! It never trusts an agent's word without proof: agent-runtime routes require a client
//! certificate bound to the agent named in the path. All state lives in the [`berth_store::Store`].

// The layers, each calling only downward: `http` and `workers` call `services`, `services` call the
// store and `infra`. ARCHITECTURE.md has the map; `tidy_modules.rs` checks the rule.
mod http;
mod infra;
mod services;
mod workers;

pub use infra::openbao;

use std::future::Future;
use std::sync::Arc;

use berth_crypto::{Ca, JwtSigner, MasterKey, RegistryTokenKey};
use berth_store::DynStore;
use tokio::net::TcpListener;

/// The type of [`ServerConfig::database_pool`], so a caller needs no `berth-store` of its own.
pub use berth_store::PostgresPoolConfig;
pub use http::openapi::openapi_json;
pub use infra::bootstrap::{Bootstrapped, DataDir};
pub use infra::clock::{Clock, ManualClock, SystemClock};
pub use infra::config::{
    format_retry_schedule, parse_retry_schedule, NotifySettings, OpenBaoSettings,
    RegistryTokenSettings, ServerConfig,
};
pub use infra::error::ServerError;

/// Everything a request handler may reach.
pub(crate) struct AppState {
    pub config: ServerConfig,
    pub store: DynStore,
    pub ca: Ca,
    pub jwt: JwtSigner,
    /// Signs the registry pull tokens of deployment tasks (`registry_token.rs`).
    pub registry_token_key: RegistryTokenKey,
    pub master_key: MasterKey,
    /// Opens the result logs agents seal to it; its public key is in every session answer.
    pub sealing_key: berth_crypto::hpke::RecipientKey,
    /// `sealing_key`'s public key as the session answer carries it.
    pub sealing_public: String,
    pub wakeups: infra::wake::Wakeups,
    pub heartbeats: infra::heartbeat::HeartbeatWriter,
    pub metrics: infra::metrics::Metrics,
    /// The registry client that resolves release images to digests.
    pub registries: infra::registry::Registries,
    /// Turns true when the server starts to stop: open event streams end then, so draining
    /// connections does not wait on them.
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// The desired-state calls' rate buckets per environment.
    pub rate: infra::rate::RateLimiter,
    /// Verifies seed-compatible agents' OpenBao tokens; `None` without OpenBao (or without the
    /// server's own OpenBao token), when bearer-token agents are refused.
    pub bao: Option<Arc<openbao::TokenVerifier>>,
    /// Wakes the notification sender before its next sweep (a resend).
    pub notify_wake: tokio::sync::Notify,
    /// The agent binaries the install script downloads.
    pub downloads: infra::install::AgentDownloads,
}

pub(crate) type SharedState = Arc<AppState>;

/// A bootstrapped server, ready to serve on a listener.
pub struct Server {
    state: SharedState,
    tls: Arc<rustls::ServerConfig>,
    bootstrapped: Bootstrapped,
}

impl Server {
    /// Opens the data dir and store, creating the CA, certificates, keys and admin token on
    /// first start and reusing them afterwards.
    pub async fn bootstrap(mut config: ServerConfig) -> Result<Server, ServerError> {
        infra::fault::init();
        config.max_connections = http::tls::connection_budget(config.max_connections);
        let (bootstrapped, material) = infra::bootstrap::bootstrap(&config).await?;
        let tls = http::tls::server_config(&material)?;
        let metrics = infra::metrics::Metrics::new(material.store.clone());
        let heartbeats =
            infra::heartbeat::HeartbeatWriter::spawn(material.store.clone(), metrics.clone());
        let wakeups = infra::wake::Wakeups::spawn(material.store.task_events());
        let bao = match &config.openbao {
            Some(settings) if settings.token_file.is_some() => Some(Arc::new(
                openbao::TokenVerifier::new(settings).map_err(ServerError::new)?,
            )),
            _ => None,
        };
        let downloads = infra::install::AgentDownloads::new(config.agent_downloads.clone());
        let state = Arc::new(AppState {
            config,
            store: material.store,
            ca: material.ca,
            jwt: material.jwt,
            registry_token_key: material.registry_token_key,
            master_key: material.master_key,
            sealing_public: {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD
                    .encode(material.sealing_key.public_key().as_bytes())
            },
            sealing_key: material.sealing_key,
            wakeups,
            heartbeats,
            metrics,
            registries: infra::registry::Registries::new().map_err(ServerError::new)?,
            stopping: tokio::sync::watch::channel(false).0,
            rate: infra::rate::RateLimiter::default(),
            bao,
            notify_wake: tokio::sync::Notify::new(),
            downloads,
        });
        Ok(Server {
            state,
            tls,
            bootstrapped,
        })
    }

    /// What bootstrap found or created: paths, the CA fingerprint, and the admin token when it
    /// was created by this start (it is shown once).
    pub fn bootstrapped(&self) -> &Bootstrapped {
        &self.bootstrapped
    }

    /// Serves on an already-bound listener until `shutdown` resolves, then drains connections.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let workers = workers::spawn_all(&self.state, &stop_rx);
        let app = http::routes::router(self.state.clone());
        let state = self.state.clone();
        let shutdown = async move {
            shutdown.await;
            state.stopping.send_replace(true);
        };
        let result = http::tls::serve(
            listener,
            self.tls,
            app,
            shutdown,
            &self.state.config,
            self.state.metrics.clone(),
        )
        .await;
        let _ = stop_tx.send(true);
        for worker in workers {
            let _ = worker.await;
        }
        self.state.heartbeats.close().await;
        result
    }
}
