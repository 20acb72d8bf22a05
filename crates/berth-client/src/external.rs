//! The HTTP client for a service that is not berth (OpenBao): the agent's logins and KV reads,
//! the server's token lookups. One place decides how such a service is trusted, so the agent and
//! the server cannot drift apart.

use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;

/// Where the system's CA bundle lives on Debian (and what `SSL_CERT_FILE` overrides).
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// An HTTP client for `addr` (`https://…`, or `http://` to a loopback address only: a test
/// server, or a local proxy that does its own TLS).
///
/// HTTPS is validated against `ca_pem` (one or more PEM certificates, e.g. OpenBao's CA) when
/// given, else against the system's bundle. Redirects are never followed: a request carries a
/// token, and a redirect would carry it elsewhere.
pub fn external_http_client(
    addr: &str,
    ca_pem: Option<&[u8]>,
    timeout: Duration,
) -> Result<reqwest::Client, String> {
    check_addr(addr)?;
    build(ca_pem, timeout, Duration::from_secs(10))
}

/// The HTTP client for webhook deliveries: any `http://` or `https://` URL (an admin chose it),
/// HTTPS against the system's bundle, no redirects (the signed body would follow them), and
/// `timeout` for the whole exchange, so a receiver that never answers ends the send.
///
/// Connecting gets at most half of `timeout` (and 10 s), so a connection that is never made
/// ends as a connect error, which the sender may retry, and not as the whole exchange's
/// timeout, which it must take as "maybe delivered".
pub fn webhook_http_client(timeout: Duration) -> Result<reqwest::Client, String> {
    build(None, timeout, (timeout / 2).min(Duration::from_secs(10)))
}

fn build(
    ca_pem: Option<&[u8]>,
    timeout: Duration,
    connect_timeout: Duration,
) -> Result<reqwest::Client, String> {
    let mut roots = RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("CA bundle: {e}"))?;
            if certs.is_empty() {
                return Err("CA bundle holds no certificate".into());
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| format!("CA bundle certificate: {e}"))?;
            }
        }
        None => {
            let bundle = std::env::var_os("SSL_CERT_FILE").unwrap_or_else(|| SYSTEM_BUNDLE.into());
            // No bundle only means no public CA verifies; a loopback http address still works.
            if let Ok(certs) = CertificateDer::pem_file_iter(&bundle) {
                for cert in certs.flatten() {
                    let _ = roots.add(cert);
                }
            }
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("tls versions: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(connect_timeout)
        .build()
        .map_err(|e| format!("http client: {e}"))
}

/// `https://` anywhere; `http://` only to `127.0.0.1`, `[::1]` or `localhost`.
fn check_addr(addr: &str) -> Result<(), String> {
    if addr.starts_with("https://") {
        return Ok(());
    }
    let Some(rest) = addr.strip_prefix("http://") else {
        return Err(format!("{addr}: not an http(s) address"));
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.split(':').next().unwrap_or_default(),
    };
    if matches!(host, "127.0.0.1" | "::1" | "localhost") {
        Ok(())
    } else {
        Err(format!(
            "{addr}: plain http is allowed to a loopback address only"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_only_to_loopback() {
        assert!(check_addr("https://bao.cbs.tikali.net:8200").is_ok());
        assert!(check_addr("http://127.0.0.1:58200").is_ok());
        assert!(check_addr("http://[::1]:8200/").is_ok());
        assert!(check_addr("http://localhost:8200").is_ok());
        assert!(check_addr("http://bao.example:8200").is_err());
        assert!(check_addr("http://127.0.0.1.evil:8200").is_err());
        assert!(check_addr("ftp://127.0.0.1").is_err());
    }

    #[test]
    fn a_ca_bundle_must_hold_a_certificate() {
        let err = external_http_client("https://x", Some(b"not pem"), Duration::from_secs(1))
            .unwrap_err();
        assert!(err.contains("CA bundle"), "{err}");
    }
}
