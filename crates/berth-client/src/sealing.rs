//! The agent's side of sealing (issue 17): opening an assignment's box with the key of the
//! certificate its poll presented, and sealing a result's logs to the server's key. The one
//! implementation berth-agent, berth-bench and the tests use; the server's side is in
//! `berth-server/src/routes/transport.rs`.

use berth_crypto::hpke::{self, RecipientKey, RecipientPublicKey};
use berth_proto::transport::{
    AgentTaskAssignment, SealedAssignment, SealedBox, ASSIGNMENT_SEAL_INFO, SEAL_ALG,
};
use berth_proto::AssignmentId;

/// The payload and credentials of `a`, opened with `key`, the assignment id as associated data.
/// A missing box, another suite, another key's or another assignment's box, or any changed
/// byte is an error (which never quotes the box).
pub fn open_assignment(
    a: &AgentTaskAssignment,
    key: &RecipientKey,
) -> Result<SealedAssignment, String> {
    let Some(sealed) = &a.sealed else {
        return Err("the assignment carries no sealed payload".into());
    };
    if sealed.alg != SEAL_ALG {
        return Err(format!(
            "the assignment is sealed with {:?}, not {SEAL_ALG}",
            sealed.alg
        ));
    }
    let clear = hpke::Sealed::from_base64(&sealed.enc, &sealed.ciphertext)
        .and_then(|boxed| {
            key.open(
                hpke::Aead::Aes256Gcm,
                &boxed,
                ASSIGNMENT_SEAL_INFO,
                a.assignment_id.to_string().as_bytes(),
            )
        })
        .map_err(|_| {
            "the sealed payload does not open with this agent's key for this assignment".to_string()
        })?;
    serde_json::from_slice(&clear)
        .map_err(|e| format!("the opened payload is not an assignment: {e}"))
}

/// `text` sealed to `to` under `info` (which direction) for the delivery `assignment`, in its
/// wire form.
pub fn seal_box(
    to: &RecipientPublicKey,
    info: &[u8],
    assignment: AssignmentId,
    text: &[u8],
) -> Result<SealedBox, String> {
    let sealed = hpke::seal(
        hpke::Aead::Aes256Gcm,
        to,
        info,
        assignment.to_string().as_bytes(),
        text,
    )
    .map_err(|e| format!("sealing: {e}"))?;
    let (enc, ciphertext) = sealed.to_base64();
    Ok(SealedBox {
        alg: SEAL_ALG.into(),
        enc,
        ciphertext,
    })
}
