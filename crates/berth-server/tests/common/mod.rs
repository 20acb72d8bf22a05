//! An in-process server on 127.0.0.1:0 with a temp data dir, and clients that speak to it over
//! real TLS: admin (bearer) clients and agents with real keys and certificates.

#![allow(dead_code)]

use std::time::Duration;

use base64::Engine;
use berth_client::{Client, ClientConfig, Identity, Trust};
use berth_crypto::AgentKey;
use berth_proto::admin::CreateAgentToken;
use berth_proto::agent::RegisterAgent;
use berth_proto::result::TaskResult;
use berth_proto::transport::{
    AcquireSession, AgentTaskAssignment, AgentTaskPollRequest, AgentTaskPollResponse,
    AgentTaskResultEnvelope, ResultAck, SealedAssignment, StartTask, TaskStarted, ALG_ECDSA_SHA256,
    CONTRACT_VERSION, GENERATION_HEADER,
};
use berth_proto::AgentId;
use berth_proto::{AssignmentId, TaskId};
use berth_server::{Server, ServerConfig};

pub struct TestServer {
    pub url: String,
    pub addr: std::net::SocketAddr,
    pub ca_pem: String,
    pub ca_fingerprint: String,
    pub admin_token: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), berth_server::ServerError>>>,
    pub dir: tempfile::TempDir,
}

pub struct TestAgent {
    pub id: AgentId,
    pub key: AgentKey,
    pub cert_pem: String,
    pub client: Client,
}

pub async fn start() -> TestServer {
    start_with(|_| {}).await
}

pub async fn start_with(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().expect("temp dir");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut config = ServerConfig::new(dir.path().join("data"), addr);
    config.heartbeat_interval = Duration::from_secs(1);
    adjust(&mut config);
    let server = Server::bootstrap(config).await.expect("bootstrap");
    let boot = server.bootstrapped().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));
    TestServer {
        url: format!("https://{addr}"),
        addr,
        ca_pem: std::fs::read_to_string(boot.data_dir.ca_cert()).expect("ca"),
        ca_fingerprint: boot.ca_fingerprint,
        admin_token: boot.new_admin_token.expect("first start makes a token"),
        stop: Some(stop),
        task: Some(task),
        dir,
    }
}

/// A second replica of `primary`: a data dir of its own holding a copy of the primary's key
/// material (as an operator copies it to a new replica) and the same database, which `adjust`
/// must name (the primary's, on PostgreSQL). Its admin token is the primary's.
pub async fn start_replica(
    primary: &TestServer,
    adjust: impl FnOnce(&mut ServerConfig),
) -> TestServer {
    let dir = tempfile::tempdir().expect("temp dir");
    let from = berth_server::DataDir(primary.dir.path().join("data"));
    let to = berth_server::DataDir(dir.path().join("data"));
    std::fs::create_dir_all(&to.0).expect("replica data dir");
    for file in from.key_material() {
        let name = file.file_name().expect("a file name");
        std::fs::copy(&file, to.0.join(name)).expect("copy key material");
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut config = ServerConfig::new(to.0.clone(), addr);
    config.heartbeat_interval = Duration::from_secs(1);
    adjust(&mut config);
    let server = Server::bootstrap(config).await.expect("bootstrap replica");
    let boot = server.bootstrapped().clone();
    assert!(
        boot.new_admin_token.is_none(),
        "the replica shares the database"
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));
    TestServer {
        url: format!("https://{addr}"),
        addr,
        ca_pem: std::fs::read_to_string(boot.data_dir.ca_cert()).expect("ca"),
        ca_fingerprint: boot.ca_fingerprint,
        admin_token: primary.admin_token.clone(),
        stop: Some(stop),
        task: Some(task),
        dir,
    }
}

impl TestServer {
    pub fn client(&self, bearer: Option<&str>, identity: Option<Identity>) -> Client {
        Client::new(ClientConfig {
            server: self.url.clone(),
            trust: Trust::CaPem(self.ca_pem.clone()),
            identity,
            bearer: bearer.map(str::to_string),
            timeout: Duration::from_secs(30),
        })
        .expect("client")
    }

    pub fn admin(&self) -> Client {
        self.client(Some(&self.admin_token), None)
    }

    /// A plain reqwest client over the same TLS settings, for hand-crafted bad requests.
    pub fn raw(&self, identity: Option<&Identity>) -> reqwest::Client {
        let tls =
            berth_client::tls_config(&Trust::CaPem(self.ca_pem.clone()), identity).expect("tls");
        reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .build()
            .expect("raw client")
    }

    pub async fn registration_token(&self, admin: &Client) -> String {
        admin
            .send(&CreateAgentToken::default())
            .await
            .expect("registration token")
            .token
    }

    /// Registers an agent with a real key and returns it with an mTLS client.
    pub async fn agent(&self, name: &str) -> TestAgent {
        let token = self.registration_token(&self.admin()).await;
        self.agent_with_token(name, &token).await.expect("register")
    }

    pub async fn agent_with_token(
        &self,
        name: &str,
        token: &str,
    ) -> Result<TestAgent, berth_client::ClientError> {
        let key = AgentKey::generate().expect("key");
        let response = self
            .client(None, None)
            .send_with(
                &register_request(name, &key),
                &[(berth_proto::headers::REGISTRATION_TOKEN_HEADER, token)],
                None,
            )
            .await?;
        let identity = Identity {
            cert_pem: response.certificate.clone(),
            key_pem: key.to_pem(),
        };
        Ok(TestAgent {
            id: response.agent_id,
            cert_pem: response.certificate,
            client: self.client(None, Some(identity)),
            key,
        })
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("join").expect("server ran cleanly");
        }
    }
}

pub fn register_request(name: &str, key: &AgentKey) -> RegisterAgent {
    RegisterAgent {
        name: name.to_string(),
        version: "0.0.0-test".into(),
        capabilities: vec![],
        labels: Default::default(),
        csr: key.csr_pem(name).expect("csr"),
    }
}

impl TestAgent {
    pub fn identity(&self) -> Identity {
        Identity {
            cert_pem: self.cert_pem.clone(),
            key_pem: self.key.to_pem(),
        }
    }
}

impl TestAgent {
    /// Acquires a session as a fresh process instance; returns the generation.
    pub async fn session(&self) -> i64 {
        self.client
            .send(&AcquireSession {
                agent_id: self.id,
                instance_id: uuid::Uuid::new_v4().to_string(),
                boot_id: None,
                lock: None,
                version: None,
            })
            .await
            .expect("session")
            .generation
    }

    /// Acquires a session and sends one `online` heartbeat (no capabilities: it replaces what
    /// the agent reports, so equip after it), which makes a registered agent `online`.
    pub async fn go_online(&self) -> i64 {
        let generation = self.session().await;
        self.heartbeat(generation, next_sequence())
            .await
            .expect("heartbeat");
        generation
    }

    /// Sends one signed `online` heartbeat with `sequence` under `generation`.
    pub async fn heartbeat(
        &self,
        generation: i64,
        sequence: u64,
    ) -> Result<berth_proto::agent::HeartbeatResponse, berth_client::ClientError> {
        let g = generation.to_string();
        self.client
            .send_with(
                &sign_heartbeat(
                    berth_proto::agent::Heartbeat {
                        agent_id: self.id,
                        status: berth_proto::agent::AgentStatus::Online,
                        resource_usage: Default::default(),
                        capabilities: vec![],
                        generation,
                        sequence,
                        signature_algorithm: berth_proto::transport::ALG_ECDSA_SHA256.into(),
                        signature: None,
                    },
                    &self.key,
                ),
                &[(GENERATION_HEADER, &g)],
                None,
            )
            .await
    }

    /// The payload and credentials of `assignment`, opened with this agent's key as berth-agent
    /// opens them (the assignment id as associated data); `None` when they do not open.
    pub fn open(&self, assignment: &AgentTaskAssignment) -> Option<SealedAssignment> {
        let key = berth_crypto::hpke::RecipientKey::from_pkcs8_pem(&self.key.to_pem()).ok()?;
        berth_client::sealing::open_assignment(assignment, &key).ok()
    }

    /// Polls offering every capability, as an agent on a host with Docker and compose would.
    pub async fn poll(
        &self,
        generation: i64,
    ) -> Result<AgentTaskPollResponse, berth_client::ClientError> {
        self.poll_offering(generation, &["docker", "compose", "ssh"])
            .await
    }

    pub async fn poll_offering(
        &self,
        generation: i64,
        capabilities: &[&str],
    ) -> Result<AgentTaskPollResponse, berth_client::ClientError> {
        self.poll_request(generation, capabilities, false).await
    }

    /// A poll that promises the start handshake, as berth-agent polls.
    pub async fn poll_promising_start(
        &self,
        generation: i64,
    ) -> Result<AgentTaskPollResponse, berth_client::ClientError> {
        self.poll_request(generation, &["docker", "compose", "ssh"], true)
            .await
    }

    async fn poll_request(
        &self,
        generation: i64,
        capabilities: &[&str],
        start_handshake: bool,
    ) -> Result<AgentTaskPollResponse, berth_client::ClientError> {
        let request = AgentTaskPollRequest {
            contract_version: CONTRACT_VERSION.into(),
            agent_id: self.id,
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            start_handshake,
        };
        let g = generation.to_string();
        self.client
            .send_with(&request, &[(GENERATION_HEADER, &g)], None)
            .await
    }

    /// The typed, unsigned envelope of a finished assignment, as the JSON that is sent (tests
    /// that tamper with it edit this).
    pub fn envelope(&self, assignment: AssignmentId, result: TaskResult) -> serde_json::Value {
        serde_json::to_value(AgentTaskResultEnvelope {
            contract_version: CONTRACT_VERSION.into(),
            agent_id: self.id,
            task_id: result.task_id,
            assignment_id: Some(assignment),
            success: result.success,
            message: Some("done".into()),
            result_data: Some(serde_json::to_string(&result).expect("result data")),
            duration: "00:00:01".into(),
            completed_at: result.completed_at,
            signature_algorithm: ALG_ECDSA_SHA256.into(),
            signature: None,
        })
        .expect("envelope")
    }

    /// Signs an envelope with this agent's key (JCS of everything but `signature`).
    pub fn sign(&self, mut envelope: serde_json::Value) -> serde_json::Value {
        sign_with(&self.key, &mut envelope);
        envelope
    }

    pub async fn submit(
        &self,
        generation: i64,
        envelope: serde_json::Value,
    ) -> Result<ResultAck, berth_client::ClientError> {
        let g = generation.to_string();
        self.client
            .send_with(&RawResult(envelope), &[(GENERATION_HEADER, &g)], None)
            .await
    }

    /// The start handshake for `assignment` of `task`.
    pub async fn start(
        &self,
        generation: i64,
        task: TaskId,
        assignment: AssignmentId,
    ) -> Result<TaskStarted, berth_client::ClientError> {
        let g = generation.to_string();
        let request = StartTask {
            agent_id: self.id,
            task_id: task,
            assignment_id: assignment,
            phase: None,
        };
        self.client
            .send_with(&request, &[(GENERATION_HEADER, &g)], None)
            .await
    }
}

/// Seed 000's `TaskResult` of a task that succeeded.
pub fn ok(task: TaskId) -> TaskResult {
    let now = time::OffsetDateTime::now_utc();
    TaskResult {
        task_id: task,
        success: true,
        started_at: now,
        completed_at: now,
        outputs: Default::default(),
        artifacts: vec![],
        error: None,
        error_type: None,
        retriable: false,
        logs: String::new(),
        sealed_logs: None,
        metrics: Default::default(),
    }
}

/// ... and of one that failed.
pub fn failure(task: TaskId, error_type: &str, retriable: bool) -> TaskResult {
    TaskResult {
        success: false,
        error: Some("nope".into()),
        error_type: Some(error_type.into()),
        retriable,
        ..ok(task)
    }
}

/// A result envelope sent as the JSON given, to the path its own ids name: the typed
/// `SubmitResult` cannot carry a tampered envelope.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(transparent)]
pub struct RawResult(pub serde_json::Value);

impl berth_proto::Request for RawResult {
    type Response = ResultAck;
    const METHOD: berth_proto::Method = berth_proto::Method::Post;
    fn path(&self) -> String {
        let id = |name: &str| self.0[name].as_str().unwrap_or_default().to_string();
        format!(
            "/api/v1/release-orchestrator/agent-runtime/agents/{}/tasks/{}/result",
            id("agentId"),
            id("taskId")
        )
    }
}

pub fn sign_with(key: &AgentKey, envelope: &mut serde_json::Value) {
    let bytes = berth_proto::transport::signing_input(envelope).expect("jcs");
    let signature = key.sign(&bytes).expect("sign");
    envelope["signature"] = base64::engine::general_purpose::STANDARD
        .encode(signature)
        .into();
}

/// A heartbeat sequence above every one this test binary made before (the server compares them
/// per agent and generation; one counter for all keeps every test's increasing).
pub fn next_sequence() -> u64 {
    static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// `heartbeat` signed with `key` as berth-agent signs it.
pub fn sign_heartbeat(
    mut heartbeat: berth_proto::agent::Heartbeat,
    key: &AgentKey,
) -> berth_proto::agent::Heartbeat {
    heartbeat.signature = None;
    heartbeat.signature = Some(
        key.sign_base64(&heartbeat.signing_input().expect("signing input"))
            .expect("sign"),
    );
    heartbeat
}

/// Creates a task as the admin.
pub async fn create(
    server: &TestServer,
    request: berth_proto::task::CreateTask,
) -> berth_proto::task::TaskView {
    server.admin().send(&request).await.expect("create task")
}

/// The task as it is now.
pub async fn show(
    server: &TestServer,
    task: &berth_proto::task::TaskView,
) -> berth_proto::task::TaskView {
    server
        .admin()
        .send(&berth_proto::task::GetTask { id: task.id })
        .await
        .expect("show task")
}
