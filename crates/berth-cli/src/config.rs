//! The config files of both binaries, generically: reading one (unknown keys refused), laying
//! one set of settings over another (flags and environment > file > defaults), and printing the
//! result. What the settings are is `server_config.rs` and `agent_config.rs`; this module holds
//! no setting and no default.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The exit code of every configuration error (EX_CONFIG), as the agent's.
pub const EXIT_CONFIG: u8 = berth_proto::desired::exit::CONFIG as u8;

/// A configuration the binary cannot start with: a missing or unreadable file, an unknown key, a
/// bad value. Binaries exit [`EXIT_CONFIG`] on it.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Which file a binary reads: the one `--config` (or its variable) names, which must exist, else
/// `default`, read only when it exists.
pub fn read_file<T: DeserializeOwned + Default>(
    named: Option<&Path>,
    default: &Path,
) -> Result<T, ConfigError> {
    let (path, required) = match named {
        Some(path) => (path, true),
        None => (default, false),
    };
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => return Ok(T::default()),
        Err(e) => {
            return Err(ConfigError(format!(
                "reading config file {}: {e}",
                path.display()
            )))
        }
    };
    parse(&text, path)
}

/// `text` as the settings of file `path`; an unknown key is an error naming it, its file and
/// line.
pub fn parse<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
        let at = match line {
            Some(line) => format!("{}:{line}", path.display()),
            None => path.display().to_string(),
        };
        let message = e.message().replace("unknown field", "unknown key");
        ConfigError(format!("config file {at}: {message}"))
    })
}

/// `upper` laid over `lower`, key by key: every key `upper` sets wins, the rest are `lower`'s.
/// Works on any settings struct whose fields are all `Option`.
pub fn layer<T: Serialize + DeserializeOwned>(upper: &T, lower: &T) -> Result<T, ConfigError> {
    let broken = |e: serde_json::Error| ConfigError(format!("merging settings: {e}"));
    let mut merged = serde_json::to_value(lower).map_err(broken)?;
    let serde_json::Value::Object(upper) = serde_json::to_value(upper).map_err(broken)? else {
        return Err(ConfigError("settings are not a struct".into()));
    };
    if let serde_json::Value::Object(merged) = &mut merged {
        for (key, value) in upper.into_iter().filter(|(_, v)| !v.is_null()) {
            merged.insert(key, value);
        }
    }
    serde_json::from_value(merged).map_err(broken)
}

/// The settings as TOML (unset keys left out) under a comment saying where they came from.
pub fn to_toml<T: Serialize>(
    settings: &T,
    program: &str,
    file: &Path,
) -> Result<String, ConfigError> {
    let body = toml::to_string(settings)
        .map_err(|e| ConfigError(format!("printing the settings: {e}")))?;
    Ok(format!(
        "# {program}: the effective configuration (flags > environment > {} > defaults);\n\
         # secrets are shown as {}, unset keys are left out.\n{body}",
        file.display(),
        berth_proto::redact::MASK
    ))
}

/// `cmd` with each default of `defaults` shown in its flag's help, `[default: …]` as clap's own
/// (the flags carry no clap default, so that "not given" stays visible and the file can fill it).
pub fn document_defaults<T: Serialize>(mut cmd: clap::Command, defaults: &T) -> clap::Command {
    let Ok(serde_json::Value::Object(values)) = serde_json::to_value(defaults) else {
        return cmd;
    };
    for (key, value) in values {
        let shown = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::String(s) => s,
            serde_json::Value::Array(items) => items
                .iter()
                .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_string))
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        if cmd.get_arguments().any(|a| a.get_id().as_str() == key) {
            cmd = cmd.mut_arg(key, |arg| {
                let with = |help: Option<&clap::builder::StyledStr>| {
                    let help = help.map(ToString::to_string).unwrap_or_default();
                    format!("{help} [default: {shown}]")
                        .trim_start()
                        .to_string()
                };
                let help = with(arg.get_help());
                let long = arg.get_long_help().map(|h| with(Some(h)));
                let arg = arg.help(help);
                match long {
                    Some(long) => arg.long_help(long),
                    None => arg,
                }
            });
        }
    }
    cmd
}

/// The file a binary reads, for messages: the named one or the default.
pub fn file_in_use(named: Option<&Path>, default: &Path) -> PathBuf {
    named.unwrap_or(default).to_path_buf()
}

/// A URL with its password masked: the `user:PASSWORD@` of its authority and any
/// `password=…` query parameter (PostgreSQL's URLs take both).
pub fn mask_url(url: &str) -> String {
    use berth_proto::redact::MASK;
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let mut out = match head.split_once("://") {
        Some((scheme, rest)) => {
            let end = rest.find(['/', '#']).unwrap_or(rest.len());
            let (authority, path) = rest.split_at(end);
            match authority.rsplit_once('@') {
                Some((userinfo, host)) => match userinfo.split_once(':') {
                    Some((user, _)) => format!("{scheme}://{user}:{MASK}@{host}{path}"),
                    None => head.to_string(),
                },
                None => head.to_string(),
            }
        }
        None => head.to_string(),
    };
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some(("password", _)) => format!("password={MASK}"),
                _ => pair.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Settings {
        listen: Option<String>,
        days: Option<u32>,
        names: Option<Vec<String>>,
    }

    #[test]
    fn an_unknown_key_is_refused_naming_it_the_file_and_the_line() {
        let err = parse::<Settings>(
            "listen = \"x\"\n# a comment\nlisten_addr = \"y\"\n",
            Path::new("/etc/x.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("/etc/x.toml:3"), "{err}");
        assert!(err.contains("unknown key `listen_addr`"), "{err}");
        let err = parse::<Settings>("days = \"ten\"", Path::new("f.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("f.toml:1"), "{err}");
    }

    #[test]
    fn a_missing_default_file_is_empty_a_missing_named_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("absent.toml");
        assert_eq!(
            read_file::<Settings>(None, &absent).unwrap(),
            Settings::default()
        );
        let err = read_file::<Settings>(Some(&absent), Path::new("/nonexistent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent.toml"), "{err}");
        let present = dir.path().join("present.toml");
        std::fs::write(&present, "days = 3\nnames = [\"a\", \"b\"]\n").unwrap();
        let read: Settings = read_file(None, &present).unwrap();
        assert_eq!(read.days, Some(3));
        assert_eq!(read.names, Some(vec!["a".into(), "b".into()]));
    }

    #[test]
    fn the_upper_layer_wins_key_by_key() {
        let upper = Settings {
            listen: Some("flag".into()),
            ..Settings::default()
        };
        let lower = Settings {
            listen: Some("file".into()),
            days: Some(7),
            names: None,
        };
        assert_eq!(
            layer(&upper, &lower).unwrap(),
            Settings {
                listen: Some("flag".into()),
                days: Some(7),
                names: None
            }
        );
    }

    #[test]
    fn url_passwords_are_masked() {
        assert_eq!(
            mask_url("postgres://berth:s3cret@db:5432/berth?sslmode=require"),
            "postgres://berth:***@db:5432/berth?sslmode=require"
        );
        assert_eq!(
            mask_url("postgres://db/berth?user=berth&password=pw&x=1"),
            "postgres://db/berth?user=berth&password=***&x=1"
        );
        assert_eq!(
            mask_url("/var/lib/berth/berth.db"),
            "/var/lib/berth/berth.db"
        );
        assert_eq!(mask_url("postgres://berth@db/b"), "postgres://berth@db/b");
        // The password alone, even where its text appears elsewhere.
        assert_eq!(
            mask_url("postgres://db:db@db/db"),
            "postgres://db:***@db/db"
        );
    }
}
