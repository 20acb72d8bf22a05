//! Adding a host in one command (issue 16 item 1). `berth token create` prints an install line
//! ([`install_line`]); on the new host it fetches the CA without trusting anything, checks it
//! against the fingerprint written in the line, and only then fetches `/install.sh`
//! ([`install_script`]) over TLS pinned to that CA. The script downloads the agent binary
//! ([`AgentDownloads`], `GET /downloads/berth-agent/{os}-{arch}`), checks the sha256 the script
//! carries, installs it with a systemd unit, registers with the one-time token and starts it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// The binary file names in `--agent-downloads DIR`: `berth-agent-<os>-<arch>`, as `uname -s`
/// (lowercased) and `uname -m` name them, e.g. `berth-agent-linux-x86_64`.
const FILE_PREFIX: &str = "berth-agent-";

/// The agent binaries the server hands out, and their digests (computed once per file version).
pub struct AgentDownloads {
    /// `--agent-downloads`; `None`: the `berth-agent` beside the running `berth`, for this
    /// machine's platform.
    dir: Option<PathBuf>,
    digests: Mutex<HashMap<PathBuf, (SystemTime, u64, String)>>,
}

impl AgentDownloads {
    pub fn new(dir: Option<PathBuf>) -> AgentDownloads {
        AgentDownloads {
            dir,
            digests: Mutex::new(HashMap::new()),
        }
    }

    /// `(platform, file)` of every binary on offer, sorted by platform.
    pub fn files(&self) -> Vec<(String, PathBuf)> {
        let mut files = match &self.dir {
            Some(dir) => std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|entry| {
                    let name = entry.file_name().into_string().ok()?;
                    let platform = name.strip_prefix(FILE_PREFIX)?;
                    (is_platform(platform) && entry.path().is_file())
                        .then(|| (platform.to_string(), entry.path()))
                })
                .collect(),
            None => std::env::current_exe()
                .ok()
                .and_then(|exe| Some(exe.parent()?.join("berth-agent")))
                .filter(|agent| agent.is_file())
                .map(|agent| (this_platform(), agent))
                .into_iter()
                .collect::<Vec<_>>(),
        };
        files.sort();
        files
    }

    pub fn file(&self, platform: &str) -> Option<PathBuf> {
        self.files()
            .into_iter()
            .find(|(p, _)| p == platform)
            .map(|(_, file)| file)
    }

    /// Lowercase hex SHA-256 of `file`, remembered while its mtime and length stay the same.
    pub async fn sha256(&self, file: &Path) -> std::io::Result<String> {
        let meta = tokio::fs::metadata(file).await?;
        let version = (meta.modified()?, meta.len());
        if let Some((modified, len, digest)) = self.digests.lock().unwrap().get(file) {
            if (*modified, *len) == version {
                return Ok(digest.clone());
            }
        }
        let owned = file.to_path_buf();
        let digest = tokio::task::spawn_blocking(move || {
            std::fs::read(&owned).map(|bytes| berth_crypto::sha256_hex(&bytes))
        })
        .await
        .map_err(std::io::Error::other)??;
        self.digests
            .lock()
            .unwrap()
            .insert(file.to_path_buf(), (version.0, version.1, digest.clone()));
        Ok(digest)
    }
}

/// `linux-x86_64` on the machine this runs on (`uname -s`, lowercased, and `uname -m`).
pub fn this_platform() -> String {
    format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH)
}

/// `<os>-<arch>`: lowercase letters, digits, `_` and one `-`; nothing a path could misuse.
pub fn is_platform(s: &str) -> bool {
    s.split_once('-').is_some_and(|(os, arch)| {
        let word = |w: &str| {
            !w.is_empty()
                && w.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        };
        word(os) && word(arch)
    })
}

/// Quotes a word for a POSIX shell: single quotes, each `'` written as `'\''`.
pub fn sh_word(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// The line to run as root on a new host. The CA is fetched unauthenticated (`-k`) and used
/// only if the SHA-256 of its DER (the PEM body, base64-decoded) is the fingerprint written
/// here; every later request is pinned to it. The token reaches the script through the
/// environment, not an argument, so it shows in no process list.
pub fn install_line(server: &str, ca_fingerprint: &str, token: &str) -> String {
    let hex = ca_fingerprint
        .strip_prefix("sha256:")
        .unwrap_or(ca_fingerprint);
    format!(
        "ca=$(mktemp) && curl -fsSk {ca_url} -o \"$ca\" && \
         {{ [ \"$(sed '/-----/d' \"$ca\" | base64 -d | sha256sum | cut -c1-64)\" = {hex} ] || \
         {{ echo 'berth: the server CA does not match the fingerprint' >&2; false; }}; }} && \
         curl -fsS --cacert \"$ca\" {script_url} | BERTH_REGISTRATION_TOKEN={token} sh",
        ca_url = sh_word(&format!("{server}/ca.crt")),
        hex = sh_word(hex),
        script_url = sh_word(&format!("{server}/install.sh")),
        token = sh_word(token),
    )
}

/// The agent's systemd unit, as the `berth-agent` package ships it.
const PACKAGED_UNIT: &str = include_str!("../../../../packaging/systemd/berth-agent.service");
const SCRIPT: &str = include_str!("install.sh");

/// `/install.sh` for this server: its URL and CA fingerprint, the sha256 of each binary on
/// offer, and the packaged unit with the binary where the script puts it.
pub fn install_script(server: &str, ca_fingerprint: &str, binaries: &[(String, String)]) -> String {
    let cases: String = binaries
        .iter()
        .map(|(platform, sha)| format!("    {platform}) sha256={} ;;\n", sh_word(sha)))
        .collect();
    let unit = PACKAGED_UNIT.replace("/usr/bin/berth-agent", "/usr/local/bin/berth-agent");
    SCRIPT
        .replace("@SERVER@", &sh_word(server))
        .replace("@CA_FINGERPRINT@", &sh_word(ca_fingerprint))
        .replace("@PLATFORMS@\n", &cases)
        .replace("@UNIT@\n", &unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn platforms_are_plain_names() {
        assert!(is_platform("linux-x86_64"));
        assert!(is_platform("linux-aarch64"));
        for bad in [
            "linux",
            "../x-y",
            "linux-x86 64",
            "Linux-x86_64",
            "a-b-c",
            "-x",
        ] {
            assert!(!is_platform(bad), "{bad}");
        }
    }

    #[test]
    fn the_line_quotes_its_words_and_pins_the_ca() {
        let line = install_line("https://b:8443", "sha256:ab", "reg_x'y");
        assert!(line.starts_with("ca=$(mktemp) && curl -fsSk 'https://b:8443/ca.crt'"));
        assert!(line.contains("= 'ab' ]"), "{line}");
        assert!(line.contains("--cacert \"$ca\" 'https://b:8443/install.sh'"));
        assert!(
            line.ends_with("BERTH_REGISTRATION_TOKEN='reg_x'\\''y' sh"),
            "{line}"
        );
    }

    #[test]
    fn the_script_carries_each_binary_and_the_packaged_unit() {
        let script = install_script(
            "https://b:8443",
            "sha256:ab",
            &[("linux-x86_64".into(), "00ff".into())],
        );
        assert!(script.contains("server='https://b:8443'"));
        assert!(script.contains("    linux-x86_64) sha256='00ff' ;;\n"));
        assert!(script.contains("ExecStart=/usr/local/bin/berth-agent $BERTH_AGENT_OPTS"));
        for placeholder in ["@SERVER@", "@CA_FINGERPRINT@", "@PLATFORMS@", "@UNIT@"] {
            assert!(!script.contains(placeholder), "{placeholder} is left");
        }
    }
}
