//! `berth backup FILE` and `berth restore FILE --data-dir D` (issue 16 item 4).
//!
//! A backup is a tar stream encrypted with age, to a passphrase (scrypt) or to X25519
//! recipients, so the `age` tool opens it too. It holds the data dir's key material
//! ([`DataDir::key_material`]) and, on SQLite, a copy of the database made with SQLite's online
//! backup API in one step: one read transaction, so the copy is the database as of one commit,
//! and the running server's writers never wait for it (WAL). A manifest (`berth-backup.json`,
//! last) names every file with its SHA-256. On PostgreSQL the database is the operator's
//! `pg_dump`; the backup then carries the key material alone.
//!
//! A restore opens the file, writes every entry into a fresh staging dir (0600, certificates
//! 0644), checks the manifest and SQLite's `integrity_check`, and only then renames the staging
//! dir to the data dir: it never writes into an existing, non-empty data dir, and a failed
//! restore leaves nothing behind. The restored server has the same CA and agent bindings, so
//! agents reconnect without registering again.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use age::secrecy::SecretString;
use anyhow::{bail, Context};
use berth_server::DataDir;
use berth_store::Database;
use serde::{Deserialize, Serialize};

const MANIFEST: &str = "berth-backup.json";
/// The database's name inside a backup, and in a restored data dir.
const DATABASE: &str = "berth.db";
const FORMAT: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    format: u32,
    #[serde(with = "time::serde::rfc3339")]
    created_at: time::OffsetDateTime,
    /// `sqlite`, or `none` (PostgreSQL: the database is backed up with `pg_dump`).
    database: String,
    /// Each file's name and lowercase hex SHA-256.
    files: BTreeMap<String, String>,
}

/// How a backup is encrypted.
pub enum Seal {
    Passphrase(SecretString),
    Recipients(Vec<age::x25519::Recipient>),
}

/// How a backup is opened.
pub enum Unseal {
    Passphrase(SecretString),
    Identities(Vec<age::x25519::Identity>),
}

impl Seal {
    /// `--recipient age1…` (repeatable), else the passphrase of `--passphrase-file` or
    /// `BERTH_BACKUP_PASSPHRASE`.
    pub fn from_args(
        recipients: &[String],
        passphrase_file: Option<&Path>,
    ) -> anyhow::Result<Seal> {
        if recipients.is_empty() {
            return Ok(Seal::Passphrase(passphrase(passphrase_file)?));
        }
        recipients
            .iter()
            .map(|r| {
                age::x25519::Recipient::from_str(r).map_err(|e| {
                    anyhow::anyhow!("--recipient {r:?} is not an age X25519 recipient: {e}")
                })
            })
            .collect::<anyhow::Result<_>>()
            .map(Seal::Recipients)
    }
}

impl Unseal {
    /// `--identity FILE` (age identity lines, `AGE-SECRET-KEY-1…`; `#` comments), else the
    /// passphrase.
    pub fn from_args(
        identity: Option<&Path>,
        passphrase_file: Option<&Path>,
    ) -> anyhow::Result<Unseal> {
        let Some(file) = identity else {
            return Ok(Unseal::Passphrase(passphrase(passphrase_file)?));
        };
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("--identity {}", file.display()))?;
        let keys = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| {
                age::x25519::Identity::from_str(l).map_err(|e| {
                    anyhow::anyhow!(
                        "--identity {}: not an age X25519 identity: {e}",
                        file.display()
                    )
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        if keys.is_empty() {
            bail!("--identity {}: no identity in it", file.display());
        }
        Ok(Unseal::Identities(keys))
    }
}

/// The passphrase: the first line of `file`, else `BERTH_BACKUP_PASSPHRASE`. Never an argument
/// (it would show in the process list).
fn passphrase(file: Option<&Path>) -> anyhow::Result<SecretString> {
    let text = match file {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("--passphrase-file {}", f.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        None => std::env::var("BERTH_BACKUP_PASSPHRASE").unwrap_or_default(),
    };
    if text.is_empty() {
        bail!("no passphrase: pass --passphrase-file FILE or set BERTH_BACKUP_PASSPHRASE (or --recipient age1… to back up, --identity FILE to restore)");
    }
    Ok(SecretString::from(text))
}

/// What [`backup`] wrote.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupReport {
    pub file: PathBuf,
    /// `sqlite`, or `none` (PostgreSQL).
    pub database: String,
    pub files: usize,
    /// The encrypted backup's size.
    pub bytes: u64,
    pub seconds: f64,
}

/// Backs up `data_dir` and, when `database` is a SQLite file, a consistent copy of it, into
/// `out` (written 0600 under a temp name, then renamed).
pub fn backup(
    data_dir: &Path,
    database: &str,
    seal: Seal,
    out: &Path,
) -> anyhow::Result<BackupReport> {
    let started = Instant::now();
    let staging = tempfile::Builder::new()
        .prefix(".berth-backup-")
        .tempdir_in(parent(out))
        .context("a staging dir beside the backup file")?;
    let sqlite = match Database::parse(database) {
        Database::Sqlite(path) => Some(path),
        Database::Postgres(_) => None,
    };
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    if let Some(path) = sqlite {
        let copy = staging.path().join(DATABASE);
        copy_sqlite(path, &copy)?;
        files.push((DATABASE.into(), copy));
    }
    for path in DataDir(data_dir.to_path_buf()).key_material() {
        if path.is_file() {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            files.push((name, path));
        }
    }
    if !files.iter().any(|(name, _)| name == "ca.key") {
        bail!(
            "{} holds no berth key material (no ca.key): is it the server's data dir?",
            data_dir.display()
        );
    }
    let mut manifest = Manifest {
        format: FORMAT,
        created_at: time::OffsetDateTime::now_utc(),
        database: if sqlite.is_some() { "sqlite" } else { "none" }.into(),
        files: BTreeMap::new(),
    };

    let partial = staging.path().join("backup.age");
    let file = private_file(&partial)?;
    let encryptor = match &seal {
        Seal::Passphrase(p) => age::Encryptor::with_user_passphrase(p.clone()),
        Seal::Recipients(rs) => {
            age::Encryptor::with_recipients(rs.iter().map(|r| r as &dyn age::Recipient))
                .context("encrypting to the recipients")?
        }
    };
    let sealed = encryptor.wrap_output(BufWriter::new(file))?;
    let mut tar = tar::Builder::new(sealed);
    for (name, path) in &files {
        let digest = berth_crypto::sha256_hex_reader(File::open(path)?)
            .with_context(|| format!("reading {}", path.display()))?;
        manifest.files.insert(name.clone(), digest);
        append(
            &mut tar,
            name,
            &mut File::open(path)?,
            std::fs::metadata(path)?.len(),
        )?;
    }
    let json = serde_json::to_vec_pretty(&manifest)?;
    append(&mut tar, MANIFEST, &mut json.as_slice(), json.len() as u64)?;
    let mut writer = tar.into_inner()?.finish()?;
    writer.flush()?;
    writer
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    std::fs::rename(&partial, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(BackupReport {
        file: out.to_path_buf(),
        database: manifest.database,
        files: files.len(),
        bytes: std::fs::metadata(out)?.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// What [`restore`] wrote.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreReport {
    pub data_dir: PathBuf,
    /// `sqlite` (restored to `<data-dir>/berth.db`), or `none`: restore the PostgreSQL dump and
    /// point `--database` at it.
    pub database: String,
    pub files: usize,
    #[serde(with = "time::serde::rfc3339")]
    pub backed_up_at: time::OffsetDateTime,
}

/// Restores `file` into `data_dir`, which must not exist or be empty.
pub fn restore(file: &Path, unseal: Unseal, data_dir: &Path) -> anyhow::Result<RestoreReport> {
    if std::fs::read_dir(data_dir).is_ok_and(|mut entries| entries.next().is_some()) {
        bail!(
            "{} is not empty: restore into a new data dir",
            data_dir.display()
        );
    }
    let input = File::open(file).with_context(|| format!("opening {}", file.display()))?;
    let decryptor =
        age::Decryptor::new(BufReader::new(input)).context("not an age-encrypted berth backup")?;
    let opened = match &unseal {
        Unseal::Passphrase(p) => {
            let identity = age::scrypt::Identity::new(p.clone());
            decryptor.decrypt(std::iter::once(&identity as &dyn age::Identity))
        }
        Unseal::Identities(ids) => decryptor.decrypt(ids.iter().map(|i| i as &dyn age::Identity)),
    }
    .context("cannot open the backup (wrong passphrase or identity?)")?;

    let staging = tempfile::Builder::new()
        .prefix(".berth-restore-")
        .tempdir_in(parent(data_dir))
        .context("a staging dir beside the data dir")?;
    std::fs::set_permissions(staging.path(), std::fs::Permissions::from_mode(0o700))?;
    let allowed: Vec<String> = DataDir(PathBuf::new())
        .key_material()
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .chain([DATABASE.to_string(), MANIFEST.to_string()])
        .collect();
    let mut archive = tar::Archive::new(opened);
    for entry in archive.entries().context("reading the backup")? {
        let mut entry = entry.context("reading the backup")?;
        let name = entry.path()?.to_string_lossy().into_owned();
        if !allowed.contains(&name) {
            bail!("the backup holds {name:?}, which no berth data dir has");
        }
        let mode = if name.ends_with(".crt") { 0o644 } else { 0o600 };
        let path = staging.path().join(&name);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .with_context(|| format!("writing {name}"))?;
        std::io::copy(&mut entry, &mut out).with_context(|| format!("writing {name}"))?;
        out.sync_all()?;
    }
    let manifest: Manifest = serde_json::from_slice(
        &std::fs::read(staging.path().join(MANIFEST)).context("the backup has no manifest")?,
    )
    .context("the backup's manifest")?;
    if manifest.format != FORMAT {
        bail!(
            "backup format {} is not one this berth reads ({FORMAT})",
            manifest.format
        );
    }
    for (name, digest) in &manifest.files {
        let path = staging.path().join(name);
        let actual = berth_crypto::sha256_hex_reader(
            File::open(&path).with_context(|| format!("the backup lacks {name}"))?,
        )?;
        if &actual != digest {
            bail!("{name} in the backup does not match its SHA-256 in the manifest");
        }
    }
    std::fs::remove_file(staging.path().join(MANIFEST))?;
    if manifest.database == "sqlite" {
        let db = staging.path().join(DATABASE);
        let conn = rusqlite::Connection::open(&db)?;
        let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))?;
        if check != "ok" {
            bail!("the restored database fails SQLite's integrity check: {check}");
        }
    }
    if data_dir.exists() {
        std::fs::remove_dir(data_dir)
            .with_context(|| format!("replacing the empty {}", data_dir.display()))?;
    }
    let staged = staging.keep();
    std::fs::rename(&staged, data_dir)
        .with_context(|| format!("moving the restored files to {}", data_dir.display()))?;
    Ok(RestoreReport {
        data_dir: data_dir.to_path_buf(),
        database: manifest.database,
        files: manifest.files.len(),
        backed_up_at: manifest.created_at,
    })
}

/// A consistent copy of a live SQLite database: SQLite's online backup API, all pages in one
/// step (one read transaction), retried while the database is busy.
fn copy_sqlite(source: &Path, copy: &Path) -> anyhow::Result<()> {
    use rusqlite::backup::{Backup, StepResult};
    let src =
        rusqlite::Connection::open_with_flags(source, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .with_context(|| format!("opening the database {}", source.display()))?;
    src.busy_timeout(Duration::from_secs(30))?;
    let mut dst = rusqlite::Connection::open(copy)?;
    let backup = Backup::new(&src, &mut dst)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match backup.step(-1).context("copying the database")? {
            StepResult::Done => break,
            StepResult::More => continue,
            StepResult::Busy | StepResult::Locked if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            other => bail!("copying the database: {other:?} for two minutes"),
        }
    }
    drop(backup);
    dst.execute_batch("PRAGMA journal_mode = DELETE")?;
    Ok(())
}

fn append<W: Write>(
    tar: &mut tar::Builder<W>,
    name: &str,
    data: &mut impl Read,
    len: u64,
) -> anyhow::Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_size(len);
    header.set_mode(0o600);
    header.set_mtime(0);
    header.set_entry_type(tar::EntryType::Regular);
    tar.append_data(&mut header, name, data)
        .with_context(|| format!("adding {name} to the backup"))
}

fn private_file(path: &Path) -> anyhow::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}
