//! First start and every start after it: the data dir's key material and the bootstrap tenant.
//!
//! Creates what is missing (CA, server certificate, JWT key, master key, admin token) and reuses
//! what exists. Key files are written 0600 through a temp file and a rename, so a crash never
//! leaves a half-written key. The admin token's secret is shown once and stored only as a hash.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::infra::error::{Context, ServerError};
use berth_crypto::hpke::RecipientKey;
use berth_crypto::{Ca, JwtSigner, MasterKey, RegistryTokenKey};
use berth_proto::admin::Role;
use berth_proto::{TenantId, TokenId};
use berth_store::{DynStore, NewApiToken};
use time::OffsetDateTime;

use crate::ServerConfig;

pub const DEFAULT_TENANT: &str = "default";
/// The server certificate is reissued when it would expire within this margin.
const SERVER_CERT_RENEW_MARGIN: time::Duration = time::Duration::days(30);
const SERVER_CERT_VALIDITY: time::Duration = time::Duration::days(365);

/// The files of a data dir.
#[derive(Debug, Clone)]
pub struct DataDir(pub PathBuf);

impl DataDir {
    pub fn ca_cert(&self) -> PathBuf {
        self.0.join("ca.crt")
    }
    pub fn ca_key(&self) -> PathBuf {
        self.0.join("ca.key")
    }
    pub fn server_cert(&self) -> PathBuf {
        self.0.join("server.crt")
    }
    pub fn server_key(&self) -> PathBuf {
        self.0.join("server.key")
    }
    /// The names the server certificate was issued for, one a line.
    fn server_names(&self) -> PathBuf {
        self.0.join("server.names")
    }
    pub fn jwt_key(&self) -> PathBuf {
        self.0.join("jwt.key")
    }
    /// The key that signs registry pull tokens (0600), and its certificate: what an operator
    /// puts in a registry's `auth: token: rootcertbundle`.
    pub fn registry_token_key(&self) -> PathBuf {
        self.0.join("registry-token.key")
    }
    pub fn registry_token_cert(&self) -> PathBuf {
        self.0.join("registry-token.crt")
    }
    pub fn master_key(&self) -> PathBuf {
        self.0.join("master.key")
    }
    /// The P-256 key agents seal their result logs to (PKCS#8 PEM, 0600).
    pub fn sealing_key(&self) -> PathBuf {
        self.0.join("sealing.key")
    }
    pub fn admin_token(&self) -> PathBuf {
        self.0.join("admin.token")
    }

    /// Every file of key material (the database aside): what a backup carries and a replica
    /// copies. Private keys, `master.key` and the admin token's hash are secrets (0600).
    pub fn key_material(&self) -> Vec<PathBuf> {
        vec![
            self.ca_cert(),
            self.ca_key(),
            self.server_cert(),
            self.server_key(),
            self.server_names(),
            self.jwt_key(),
            self.registry_token_key(),
            self.registry_token_cert(),
            self.master_key(),
            self.sealing_key(),
            self.admin_token(),
        ]
    }
}

/// What bootstrap found or made, for the CLI to print.
#[derive(Debug, Clone)]
pub struct Bootstrapped {
    pub data_dir: DataDir,
    pub ca_fingerprint: String,
    /// The admin token's secret, only on the start that created it.
    pub new_admin_token: Option<String>,
}

pub(crate) struct Material {
    pub store: DynStore,
    pub ca: Ca,
    pub jwt: JwtSigner,
    pub registry_token_key: RegistryTokenKey,
    pub master_key: MasterKey,
    pub sealing_key: RecipientKey,
    pub server_cert_pem: String,
    pub server_key_pem: String,
}

pub(crate) async fn bootstrap(
    config: &ServerConfig,
) -> Result<(Bootstrapped, Material), ServerError> {
    let dir = DataDir(config.data_dir.clone());
    std::fs::create_dir_all(&dir.0)
        .with_context(|| format!("creating data dir {}", dir.0.display()))?;
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("restricting data dir {}", dir.0.display()))?;
    let now = config.clock.now();

    let ca = load_or_create_ca(&dir, now)?;

    let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    for h in &config.hostnames {
        if !names.contains(h) {
            names.push(h.clone());
        }
    }
    let (server_cert_pem, server_key_pem) = server_certificate(&dir, &ca, &names, now)?;

    let jwt = load_or_create_jwt(&dir)?;
    let registry_token_key = load_or_create_registry_token_key(&dir, now)?;
    let sealing_key = load_or_create_sealing_key(&dir)?;
    let master = load_or_create_master(&dir)?;
    let master_key =
        MasterKey::from_bytes(&master).context("the master key file is not 32 bytes")?;

    if config.database.is_none() {
        // SQLite gives its -wal and -shm files the database file's mode: create it 0600.
        let db = dir.0.join("berth.db");
        if !db.exists() {
            write_secret(&db, b"")?;
        }
    }
    // Task payloads are sealed at rest under the master key (`berth_store::PayloadKey`).
    let payload_key = berth_store::PayloadKey::new(
        MasterKey::from_bytes(&master).context("the master key file is not 32 bytes")?,
    );
    let store = berth_store::open_with(&config.database_url(), payload_key, config.database_pool)
        .await
        .context("opening the database")?;
    let tenant = store
        .ensure_tenant(DEFAULT_TENANT, now)
        .await
        .context("creating the default tenant")?;
    let new_admin_token = ensure_operator_token(&store, &dir, tenant.id, now).await?;

    Ok((
        Bootstrapped {
            ca_fingerprint: ca.fingerprint(),
            data_dir: dir,
            new_admin_token,
        },
        Material {
            store,
            ca,
            jwt,
            registry_token_key,
            master_key,
            sealing_key,
            server_cert_pem,
            server_key_pem,
        },
    ))
}

/// The CA: loaded, or generated on first start.
fn load_or_create_ca(dir: &DataDir, now: time::OffsetDateTime) -> Result<Ca, ServerError> {
    Ok(
        match (read_opt(&dir.ca_cert())?, read_opt(&dir.ca_key())?) {
            (Some(cert), Some(key)) => Ca::from_pem(&cert, &key).context("loading the CA")?,
            (None, None) => {
                let ca = Ca::generate("berth CA", now).context("generating the CA")?;
                write_secret(&dir.ca_key(), ca.key_pem().as_bytes())?;
                write_public(&dir.ca_cert(), ca.cert_pem().as_bytes())?;
                ca
            }
            _ => {
                return Err(ServerError::new(format!(
                    "{} and {} must both exist or both be absent",
                    dir.ca_cert().display(),
                    dir.ca_key().display()
                )))
            }
        },
    )
}

/// The key that signs agent JWTs and deploy grants.
fn load_or_create_jwt(dir: &DataDir) -> Result<JwtSigner, ServerError> {
    Ok(match read_opt(&dir.jwt_key())? {
        Some(pem) => JwtSigner::from_pem(&pem).context("loading the JWT key")?,
        None => {
            let signer = JwtSigner::generate().context("generating the JWT key")?;
            write_secret(&dir.jwt_key(), signer.to_pem().as_bytes())?;
            signer
        }
    })
}

/// Its own key, not the JWT key: a registry that trusts it trusts nothing else berth signs.
fn load_or_create_registry_token_key(
    dir: &DataDir,
    now: time::OffsetDateTime,
) -> Result<RegistryTokenKey, ServerError> {
    Ok(
        match (
            read_opt(&dir.registry_token_key())?,
            read_opt(&dir.registry_token_cert())?,
        ) {
            (Some(key), Some(cert)) => {
                RegistryTokenKey::from_pem(&key, &cert).context("loading the registry token key")?
            }
            (None, None) => {
                let key = RegistryTokenKey::generate("berth registry tokens", now)
                    .context("generating the registry token key")?;
                write_secret(&dir.registry_token_key(), key.key_pem().as_bytes())?;
                write_public(&dir.registry_token_cert(), key.cert_pem().as_bytes())?;
                key
            }
            _ => {
                return Err(ServerError::new(format!(
                    "{} and {} must both exist or both be absent",
                    dir.registry_token_key().display(),
                    dir.registry_token_cert().display()
                )))
            }
        },
    )
}

/// The key agents seal their result logs to.
fn load_or_create_sealing_key(dir: &DataDir) -> Result<RecipientKey, ServerError> {
    Ok(match read_opt(&dir.sealing_key())? {
        Some(pem) => RecipientKey::from_pkcs8_pem(&pem).context("loading the sealing key")?,
        None => {
            let key = RecipientKey::generate().context("generating the sealing key")?;
            let pem = key.to_pkcs8_pem().context("encoding the sealing key")?;
            write_secret(&dir.sealing_key(), pem.as_bytes())?;
            key
        }
    })
}

/// The master key's bytes (32), generated on first start.
fn load_or_create_master(dir: &DataDir) -> Result<Vec<u8>, ServerError> {
    if !dir.master_key().exists() {
        write_secret(&dir.master_key(), MasterKey::generate().as_bytes())?;
    }
    std::fs::read(dir.master_key()).context("reading the master key")
}

/// The operator token of the default tenant: created (and written to `admin.token`) on first
/// start, when it is returned so it can be shown once.
async fn ensure_operator_token(
    store: &DynStore,
    dir: &DataDir,
    tenant: TenantId,
    now: time::OffsetDateTime,
) -> Result<Option<String>, ServerError> {
    Ok(
        if store
            .has_operator_token(tenant)
            .await
            .context("looking up the operator token")?
        {
            None
        } else {
            let token = berth_crypto::random_token("bat_");
            store
                .create_api_token(NewApiToken {
                    id: TokenId::new(),
                    tenant_id: tenant,
                    name: "bootstrap-admin".into(),
                    role: Role::Admin,
                    operator: true,
                    token_hash: berth_crypto::hash_token(&token),
                    created_at: now,
                    // Nobody issued it: it exists before any token that could.
                    created_by: None,
                })
                .await
                .context("creating the operator token")?;
            write_secret(&dir.admin_token(), format!("{token}\n").as_bytes())?;
            Some(token)
        },
    )
}

/// Reuses the server certificate while it covers `names`, was issued by this CA and is not
/// about to expire; otherwise issues a new one. The stored chain is server cert + CA cert, so
/// agents that pin the CA by fingerprint find it in the handshake.
fn server_certificate(
    dir: &DataDir,
    ca: &Ca,
    names: &[String],
    now: OffsetDateTime,
) -> Result<(String, String), ServerError> {
    let wanted_names = names.join("\n");
    if let (Some(chain), Some(key), Some(issued_names)) = (
        read_opt(&dir.server_cert())?,
        read_opt(&dir.server_key())?,
        read_opt(&dir.server_names())?,
    ) {
        let fresh = berth_crypto::cert_pem_to_der(&chain)
            .and_then(|der| berth_crypto::cert_not_after(&der))
            .map(|not_after| not_after - SERVER_CERT_RENEW_MARGIN > now)
            .unwrap_or(false);
        if fresh && issued_names == wanted_names && chain.contains(ca.cert_pem().trim()) {
            return Ok((chain, key));
        }
    }
    let issued = ca
        .issue_server_cert(names, now, SERVER_CERT_VALIDITY)
        .context("issuing the server certificate")?;
    let key = issued
        .key_pem
        .ok_or_else(|| ServerError::new("server certificate issued without its key"))?;
    let chain = format!("{}\n{}", issued.cert_pem.trim(), ca.cert_pem().trim());
    write_secret(&dir.server_key(), key.as_bytes())?;
    write_public(&dir.server_cert(), chain.as_bytes())?;
    write_public(&dir.server_names(), wanted_names.as_bytes())?;
    Ok((chain, key))
}

fn read_opt(path: &Path) -> Result<Option<String>, ServerError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Writes key material: mode 0600 from creation, atomically replaced.
pub fn write_secret(path: &Path, contents: &[u8]) -> Result<(), ServerError> {
    write_atomic(path, contents, 0o600)
}

fn write_public(path: &Path, contents: &[u8]) -> Result<(), ServerError> {
    write_atomic(path, contents, 0o644)
}

fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), ServerError> {
    berth_fs::write_atomic(path, contents, mode)
        .with_context(|| format!("writing {}", path.display()))
}
