//! Certificate renewal: a new key and CSR once two thirds of the certificate's life have passed,
//! stored (key and certificate in one atomic write) before the link switches to it.

use std::time::Duration;

use berth_client::Client;
use berth_crypto::AgentKey;
use berth_proto::agent::RenewCertificate;
use berth_proto::headers::GENERATION_HEADER;
use time::OffsetDateTime;

use crate::retry::with_retries_or_fail_over;
use crate::state::{Identity, IdentityFile, StateDir};
use crate::AgentError;

/// Renewal is due once two thirds of the certificate's life have passed.
pub(crate) fn renewal_due(file: &IdentityFile, now: OffsetDateTime) -> bool {
    let life = file.certificate_expires_at - file.certificate_issued_at;
    now >= file.certificate_issued_at + life * 2 / 3
}

pub(crate) async fn renew(
    state: &StateDir,
    client: &Client,
    identity: &Identity,
    budget: Duration,
    generation: &str,
    fail_over: bool,
) -> Result<Identity, AgentError> {
    let key =
        AgentKey::generate().map_err(|e| AgentError::Fatal(format!("generating the key: {e}")))?;
    let request = RenewCertificate {
        agent_id: identity.file.agent_id,
        csr: key
            .csr_pem(&identity.file.name)
            .map_err(|e| AgentError::Fatal(format!("building the CSR: {e}")))?,
    };
    let headers = [(GENERATION_HEADER, generation)];
    let response = with_retries_or_fail_over("certificate renewal", budget, fail_over, || {
        client.send_with(&request, &headers, None)
    })
    .await?;
    let renewed = Identity {
        file: IdentityFile {
            certificate_issued_at: OffsetDateTime::now_utc(),
            certificate_expires_at: response.expires_at,
            ..identity.file.clone()
        },
        cert_pem: response.certificate,
        key_pem: key.to_pem(),
        ca_pem: identity.ca_pem.clone(),
    };
    state.save(&renewed)?;
    tracing::info!(expires_at = %response.expires_at, "certificate renewed");
    Ok(renewed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_is_due_after_two_thirds_of_the_life() {
        let issued = OffsetDateTime::UNIX_EPOCH;
        let file = IdentityFile {
            agent_id: berth_proto::AgentId(uuid::Uuid::nil()),
            name: "n".into(),
            server: "https://s".into(),
            ca_fingerprint: "sha256:00".into(),
            certificate_issued_at: issued,
            certificate_expires_at: issued + time::Duration::hours(30),
        };
        assert!(!renewal_due(&file, issued + time::Duration::hours(19)));
        assert!(renewal_due(&file, issued + time::Duration::hours(20)));
    }
}
