//! `berth dev`: a server and one local agent in one process, like `vault server -dev`. State is
//! kept in a data dir, so a second run reuses the same CA, admin token and agent identity.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use berth_agent::{AgentConfig, RegisterOptions, StateDir};
use berth_client::{Client, ClientConfig, Trust};
use berth_proto::admin::CreateAgentToken;
use berth_server::{Server, ServerConfig};

pub async fn run(
    data_dir: PathBuf,
    listen: SocketAddr,
    heartbeat_interval_secs: u64,
) -> anyhow::Result<()> {
    let data_dir = std::path::absolute(&data_dir).context("resolving the data dir")?;
    let mut config = ServerConfig::new(data_dir.join("server"), listen);
    config.heartbeat_interval = Duration::from_secs(heartbeat_interval_secs.max(1));
    let server = Server::bootstrap(config).await?;
    let boot = server.bootstrapped().clone();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let url = format!("https://{}", listener.local_addr()?);
    let admin_token = match &boot.new_admin_token {
        Some(t) => t.clone(),
        None => std::fs::read_to_string(boot.data_dir.admin_token())
            .context("reading admin.token")?
            .trim()
            .to_string(),
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let server_task = tokio::spawn(server.run(listener, stopped(stop_rx.clone())));

    let agent_dir = data_dir.join("agent");
    if !StateDir(agent_dir.clone()).is_registered() {
        let ca_pem = std::fs::read_to_string(boot.data_dir.ca_cert())?;
        let admin = Client::new(ClientConfig {
            server: url.clone(),
            trust: Trust::CaPem(ca_pem),
            identity: None,
            bearer: Some(admin_token.clone()),
            timeout: Duration::from_secs(30),
        })?;
        let token = admin
            .send(&CreateAgentToken {
                labels: Some([("berth.dev".to_string(), "true".to_string())].into()),
                environment: None,
                expires_in_seconds: Some(300),
            })
            .await
            .context("creating the local agent's registration token")?;
        berth_agent::register(RegisterOptions {
            server: url.clone(),
            state_dir: agent_dir.clone(),
            token: token.token,
            ca_fingerprint: token.ca_fingerprint,
            name: crate::default_agent_name(),
            labels: Default::default(),
            retry_budget: Duration::from_secs(30),
        })
        .await
        .context("registering the local agent")?;
    }
    let agent_task = tokio::spawn(berth_agent::run(
        AgentConfig {
            servers: vec![url.clone()],
            // Ctrl-C on a laptop should not wait minutes for a task.
            shutdown_grace: Duration::from_secs(10),
            ..AgentConfig::new(agent_dir)
        },
        stopped(stop_rx),
    ));

    println!("berth dev is running: a server and one local agent.\n");
    println!("  URL:            {url}");
    println!(
        "  web UI:         {url}/ (sign in with the admin token; the browser must trust the CA)"
    );
    println!("  admin token:    {admin_token}");
    println!("  CA fingerprint: {}", boot.ca_fingerprint);
    println!("  data dir:       {}\n", data_dir.display());
    println!("Use the CLI from another shell:\n");
    println!("  export BERTH_SERVER={url}");
    println!("  export BERTH_TOKEN={admin_token}");
    println!(
        "  export BERTH_CA_FILE={}",
        boot.data_dir.ca_cert().display()
    );
    println!("  berth agents list\n");
    println!("Press Ctrl-C to stop.");

    crate::shutdown_signal().await;
    let _ = stop_tx.send(true);
    if let Ok(Err(e)) = agent_task.await {
        eprintln!("berth dev: the agent stopped: {e}");
    }
    server_task.await.context("server task")??;
    Ok(())
}
