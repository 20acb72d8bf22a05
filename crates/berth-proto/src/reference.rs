//! Image references, `repository[:tag][@sha256:<64 hex>]`, checked strictly: the executors parse
//! them before they reach the engine or a `docker compose` argument, and the server before it
//! asks a registry for a release's digests. Anything outside the docker grammar (spaces, `$`,
//! quotes…) is refused.

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `[host[:port]/]path`, without tag or digest.
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl ImageRef {
    /// The registry the engine pulls from: the first path component when it looks like a host.
    pub fn registry(&self) -> &str {
        match self.repository.split_once('/') {
            Some((first, _))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                first
            }
            _ => "docker.io",
        }
    }

    /// The repository as the engine lists it in `RepoDigests` (Docker Hub names are shortened).
    pub fn familiar(&self) -> &str {
        let r = self
            .repository
            .strip_prefix("docker.io/")
            .unwrap_or(&self.repository);
        r.strip_prefix("library/").unwrap_or(r)
    }
}

/// `sha256:` and 64 lowercase hex digits: the only digest berth deploys.
pub fn is_sha256_digest(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

pub fn parse_image(reference: &str) -> Result<ImageRef, String> {
    let bad = |why: &str| format!("image reference {reference:?} is invalid: {why}");
    if reference.is_empty() || reference.len() > 512 {
        return Err(bad("empty or longer than 512 characters"));
    }
    let (name_tag, digest) = match reference.split_once('@') {
        Some((n, d)) => {
            if !is_sha256_digest(d) {
                return Err(bad(
                    "the digest must be sha256: followed by 64 lowercase hex digits",
                ));
            }
            (n, Some(d.to_string()))
        }
        None => (reference, None),
    };
    // A ':' after the last '/' starts the tag; one before it is a registry port.
    let last_slash = name_tag.rfind('/').map_or(0, |i| i + 1);
    let (repository, tag) = match name_tag[last_slash..].rfind(':') {
        Some(i) => (
            &name_tag[..last_slash + i],
            Some(&name_tag[last_slash + i + 1..]),
        ),
        None => (name_tag, None),
    };
    if let Some(tag) = tag {
        let ok = !tag.is_empty()
            && tag.len() <= 128
            && !tag.starts_with(['.', '-'])
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !ok {
            return Err(bad("the tag must be 1-128 of A-Z a-z 0-9 _ . -"));
        }
    }
    let mut parts: Vec<&str> = repository.split('/').collect();
    let first = parts[0];
    if parts.len() > 1 && (first.contains('.') || first.contains(':') || first == "localhost") {
        let (host, port) = match first.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (first, None),
        };
        let host_ok = !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'));
        let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
        if !host_ok || !port_ok {
            return Err(bad("the registry host is malformed"));
        }
        parts.remove(0);
    }
    for part in &parts {
        let ok = !part.is_empty()
            && part.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
            })
            && part.starts_with(|c: char| c.is_ascii_alphanumeric())
            && part.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !ok {
            return Err(bad(
                "path components must be lowercase letters, digits and . _ - between them",
            ));
        }
    }
    Ok(ImageRef {
        repository: repository.to_string(),
        tag: tag.map(str::to_string),
        digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_references() {
        let r = parse_image(&format!("127.0.0.1:5000/team/web:1.4@{D}")).unwrap();
        assert_eq!(r.repository, "127.0.0.1:5000/team/web");
        assert_eq!(r.tag.as_deref(), Some("1.4"));
        assert_eq!(r.digest.as_deref(), Some(D));
        assert_eq!(r.registry(), "127.0.0.1:5000");

        let r = parse_image("127.0.0.1:5000/web").unwrap();
        assert_eq!(
            (r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000/web", None)
        );

        let r = parse_image("docker.io/library/nginx:latest").unwrap();
        assert_eq!((r.registry(), r.familiar()), ("docker.io", "nginx"));
        assert_eq!(parse_image("nginx").unwrap().registry(), "docker.io");
    }

    #[test]
    fn refuses_what_is_not_a_reference() {
        for bad in [
            "",
            "Web",
            "web:",
            "web@sha256:abc",
            &format!("web@{}", D.to_uppercase()),
            "web@md5:0123",
            "web $(id)",
            "${IMAGE}",
            "web;rm",
            "host:0/web",
            "/web",
            "web//x",
            "-web",
        ] {
            assert!(parse_image(bad).is_err(), "{bad:?}");
        }
    }
}
