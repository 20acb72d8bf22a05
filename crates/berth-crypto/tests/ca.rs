//! The CA: round trip via PEM, server certificates chaining to it, and agent CSRs that try to
//! smuggle another identity or a bad key past `sign_agent_csr`.

mod common;

use berth_crypto::{
    agent_id_from_cert, cert_not_after, cert_pem_to_der, fingerprint, verify_cert_issued_by,
    AgentKey, Ca, CryptoError,
};
use common::{pem, unpem};
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, RsaKeySize, SanType,
    PKCS_ECDSA_P256_SHA256, PKCS_ECDSA_P384_SHA384, PKCS_RSA_SHA256,
};
use time::macros::datetime;
use time::{Duration, OffsetDateTime};
use uuid::Uuid;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

const NOW: OffsetDateTime = datetime!(2025-06-01 12:00:00 UTC);

fn ca() -> Ca {
    Ca::generate("berth test ca", NOW).unwrap()
}

fn parse(der: &[u8]) -> X509Certificate<'_> {
    X509Certificate::from_der(der).unwrap().1
}

fn sans(cert: &X509Certificate<'_>) -> Vec<String> {
    cert.subject_alternative_name()
        .unwrap()
        .map(|s| {
            s.value
                .general_names
                .iter()
                .map(|g| match g {
                    GeneralName::DNSName(d) => format!("dns:{d}"),
                    GeneralName::URI(u) => format!("uri:{u}"),
                    GeneralName::IPAddress(ip) => format!("ip:{ip:?}"),
                    other => format!("other:{other:?}"),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn common_names(cert: &X509Certificate<'_>) -> Vec<String> {
    cert.subject()
        .iter_common_name()
        .map(|cn| cn.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn generated_ca_has_ca_properties() {
    let ca = ca();
    let cert = parse(ca.cert_der());
    let bc = cert.basic_constraints().unwrap().unwrap().value;
    assert!(bc.ca);
    assert_eq!(bc.path_len_constraint, Some(0));
    let ku = cert.key_usage().unwrap().unwrap().value;
    assert!(ku.key_cert_sign() && ku.crl_sign());
    assert_eq!(common_names(&cert), ["berth test ca"]);
    assert_eq!(
        cert.validity().not_before.to_datetime(),
        NOW - Duration::hours(1)
    );
    assert_eq!(
        cert.validity().not_after.to_datetime(),
        NOW + Duration::days(3650)
    );
    assert_eq!(ca.fingerprint(), fingerprint(ca.cert_der()));
    assert!(ca.fingerprint().starts_with("sha256:"));
    assert_eq!(ca.fingerprint().len(), "sha256:".len() + 64);
}

#[test]
fn ca_round_trips_through_pem() {
    let ca = ca();
    let reloaded = Ca::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap();
    assert_eq!(reloaded.cert_der(), ca.cert_der());
    assert_eq!(reloaded.fingerprint(), ca.fingerprint());
    assert_eq!(cert_pem_to_der(ca.cert_pem()).unwrap(), ca.cert_der());
    assert!(ca.key_pem().starts_with("-----BEGIN PRIVATE KEY-----"));

    // The reloaded CA signs certificates that chain to the original certificate.
    let leaf = reloaded
        .issue_server_cert(&["localhost".into()], NOW, Duration::days(30))
        .unwrap();
    verify_cert_issued_by(&leaf.cert_der, ca.cert_der()).unwrap();
}

#[test]
fn ca_from_pem_refuses_mismatched_or_bad_input() {
    let ca = ca();
    let other = Ca::generate("other", NOW).unwrap();
    assert!(matches!(
        Ca::from_pem(ca.cert_pem(), &other.key_pem()),
        Err(CryptoError::KeyMismatch)
    ));
    assert!(matches!(
        Ca::from_pem("garbage", &ca.key_pem()),
        Err(CryptoError::InvalidPem(_))
    ));
    assert!(matches!(
        Ca::from_pem(ca.cert_pem(), "garbage"),
        Err(CryptoError::InvalidPem(_))
    ));
    // A P-384 key is not a berth CA key.
    let p384 = KeyPair::generate_for(&PKCS_ECDSA_P384_SHA384).unwrap();
    assert!(matches!(
        Ca::from_pem(ca.cert_pem(), &p384.serialize_pem()),
        Err(CryptoError::InvalidKey(_))
    ));
    // A leaf certificate (CA:false) with its own key is not a CA.
    let leaf = ca
        .issue_server_cert(&["localhost".into()], NOW, Duration::days(1))
        .unwrap();
    assert!(matches!(
        Ca::from_pem(&leaf.cert_pem, leaf.key_pem.as_deref().unwrap()),
        Err(CryptoError::InvalidCertificate(_))
    ));
    // A PEM whose body is not a certificate.
    let junk = pem("CERTIFICATE", b"not der at all");
    assert!(matches!(
        Ca::from_pem(&junk, &ca.key_pem()),
        Err(CryptoError::InvalidCertificate(_))
    ));
}

#[test]
fn server_cert_chains_to_ca_with_hostnames_as_sans() {
    let ca = ca();
    let hosts = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
        "berth.example.com".to_string(),
    ];
    let issued = ca
        .issue_server_cert(&hosts, NOW, Duration::days(90))
        .unwrap();
    verify_cert_issued_by(&issued.cert_der, ca.cert_der()).unwrap();

    let cert = parse(&issued.cert_der);
    assert_eq!(
        cert.issuer().as_raw(),
        parse(ca.cert_der()).subject().as_raw()
    );
    assert_eq!(
        sans(&cert),
        [
            "dns:localhost",
            "ip:[127, 0, 0, 1]",
            "ip:[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]",
            "dns:berth.example.com"
        ]
    );
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && !eku.client_auth);
    assert!(!cert.is_ca());
    assert_eq!(issued.not_after, NOW + Duration::days(90));
    assert_eq!(cert_not_after(&issued.cert_der).unwrap(), issued.not_after);
    assert_eq!(issued.fingerprint, fingerprint(&issued.cert_der));
    assert_eq!(cert_pem_to_der(&issued.cert_pem).unwrap(), issued.cert_der);

    // The returned key is the certificate's key.
    let key = KeyPair::from_pem(issued.key_pem.as_deref().unwrap()).unwrap();
    assert_eq!(
        key.public_key_raw(),
        cert.public_key().subject_public_key.data.as_ref()
    );

    // Not issued by another CA; and a signature check is not fooled by a same-named CA.
    let impostor = Ca::generate("berth test ca", NOW).unwrap();
    assert!(matches!(
        verify_cert_issued_by(&issued.cert_der, impostor.cert_der()),
        Err(CryptoError::BadSignature)
    ));
    let other = Ca::generate("other", NOW).unwrap();
    assert!(verify_cert_issued_by(&issued.cert_der, other.cert_der()).is_err());
    // A leaf is not an issuer.
    let leaf2 = ca
        .issue_server_cert(&["x".into()], NOW, Duration::days(1))
        .unwrap();
    assert!(verify_cert_issued_by(&issued.cert_der, &leaf2.cert_der).is_err());
}

#[test]
fn server_cert_refuses_bad_hostnames_and_validity() {
    let ca = ca();
    assert!(matches!(
        ca.issue_server_cert(&[], NOW, Duration::days(1)),
        Err(CryptoError::InvalidHostname(_))
    ));
    for bad in ["", "bad host", "host/evil", "ünïcode.example"] {
        assert!(
            matches!(
                ca.issue_server_cert(&[bad.to_string()], NOW, Duration::days(1)),
                Err(CryptoError::InvalidHostname(_))
            ),
            "{bad:?} accepted"
        );
    }
    for validity in [Duration::ZERO, Duration::days(-1)] {
        assert!(matches!(
            ca.issue_server_cert(&["localhost".into()], NOW, validity),
            Err(CryptoError::InvalidValidity(_))
        ));
    }
    // Overflowing arithmetic is an error, not a panic.
    assert!(matches!(
        ca.issue_server_cert(&["localhost".into()], NOW, Duration::MAX),
        Err(CryptoError::InvalidValidity(_))
    ));
    // A leaf never outlives its CA: the validity is cut at the CA's notAfter.
    let long = ca
        .issue_server_cert(&["localhost".into()], NOW, Duration::days(365 * 100))
        .unwrap();
    assert_eq!(long.not_after, ca.not_after());
    // Issuing after the CA has expired, or before X.509 time begins, is refused.
    assert!(matches!(
        ca.issue_server_cert(
            &["localhost".into()],
            NOW + Duration::days(3651),
            Duration::days(1)
        ),
        Err(CryptoError::InvalidValidity(_))
    ));
    assert!(matches!(
        ca.issue_server_cert(
            &["localhost".into()],
            datetime!(1900-01-01 00:00 UTC),
            Duration::days(1)
        ),
        Err(CryptoError::InvalidValidity(_))
    ));
}

#[test]
fn agent_cert_from_honest_csr() {
    let ca = ca();
    let key = AgentKey::generate().unwrap();
    let id = Uuid::new_v4();
    let issued = ca
        .sign_agent_csr(&key.csr_pem("web-1").unwrap(), id, NOW, Duration::days(30))
        .unwrap();
    assert!(issued.key_pem.is_none());
    verify_cert_issued_by(&issued.cert_der, ca.cert_der()).unwrap();
    assert!(key.matches_cert(&issued.cert_der).unwrap());
    assert!(!AgentKey::generate()
        .unwrap()
        .matches_cert(&issued.cert_der)
        .unwrap());
    assert_eq!(agent_id_from_cert(&issued.cert_der).unwrap(), id);

    let cert = parse(&issued.cert_der);
    assert_eq!(common_names(&cert), [id.to_string()]);
    assert_eq!(sans(&cert), [format!("uri:urn:berth:agent:{id}")]);
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth && !eku.any);
    assert!(!cert.is_ca());
    assert_eq!(
        cert.validity().not_before.to_datetime(),
        NOW - Duration::minutes(5)
    );
    assert_eq!(issued.not_after, NOW + Duration::days(30));
    assert_eq!(cert_not_after(&issued.cert_der).unwrap(), issued.not_after);
}

#[test]
fn agent_serials_are_random_even_for_the_same_key() {
    let ca = ca();
    let key = AgentKey::generate().unwrap();
    let csr = key.csr_pem("a").unwrap();
    let id = Uuid::new_v4();
    let a = ca
        .sign_agent_csr(&csr, id, NOW, Duration::days(30))
        .unwrap();
    let b = ca
        .sign_agent_csr(&csr, id, NOW, Duration::days(30))
        .unwrap();
    assert_ne!(
        parse(&a.cert_der).raw_serial(),
        parse(&b.cert_der).raw_serial()
    );
    assert_ne!(a.fingerprint, b.fingerprint);
}

/// A CSR that claims everything it can: CN=admin, another agent's URI, DNS names, an IP, a
/// server EKU, CA:true, keyCertSign, and an unknown extension. None of it may survive.
#[test]
fn agent_csr_cannot_choose_its_identity() {
    let ca = ca();
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
    let other = Uuid::new_v4();
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "admin");
    dn.push(DnType::OrganizationName, "berth");
    params.distinguished_name = dn;
    params.subject_alt_names = vec![
        SanType::URI(format!("urn:berth:agent:{other}").try_into().unwrap()),
        SanType::DnsName("localhost".try_into().unwrap()),
        SanType::DnsName("berth.example.com".try_into().unwrap()),
        SanType::IpAddress("127.0.0.1".parse().unwrap()),
    ];
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::Any,
    ];
    params.custom_extensions = vec![CustomExtension::from_oid_content(
        &[1, 3, 6, 1, 4, 1, 99999, 1],
        vec![0x05, 0x00],
    )];
    let csr = params.serialize_request(&key).unwrap().pem().unwrap();
    // The request really does carry the claims (so the test is not vacuous).
    let csr_der = unpem(&csr);
    let parsed = x509_parser::certification_request::X509CertificationRequest::from_der(&csr_der)
        .unwrap()
        .1;
    let requested = format!(
        "{:?}",
        parsed.requested_extensions().unwrap().collect::<Vec<_>>()
    );
    assert!(requested.contains(&other.to_string()) && requested.contains("berth.example.com"));

    let id = Uuid::new_v4();
    let issued = ca
        .sign_agent_csr(&csr, id, NOW, Duration::days(30))
        .unwrap();
    let cert = parse(&issued.cert_der);

    assert_eq!(agent_id_from_cert(&issued.cert_der).unwrap(), id);
    assert_eq!(common_names(&cert), [id.to_string()]);
    assert_eq!(cert.subject().iter_organization().count(), 0);
    assert_eq!(sans(&cert), [format!("uri:urn:berth:agent:{id}")]);
    assert!(!cert.is_ca());
    let ku = cert.key_usage().unwrap().unwrap().value;
    assert!(!ku.key_cert_sign() && ku.digital_signature());
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth && !eku.any);
    assert!(cert
        .extensions()
        .iter()
        .all(|e| e.oid.to_id_string() != "1.3.6.1.4.1.99999.1"));
    // The public key is the only thing taken from the CSR.
    assert_eq!(
        cert.public_key().subject_public_key.data.as_ref(),
        key.public_key_raw()
    );
}

fn flip_byte(csr_pem: &str, index_from_end: usize) -> String {
    let mut der = unpem(csr_pem);
    let i = der.len() - index_from_end;
    der[i] ^= 0x01;
    pem("CERTIFICATE REQUEST", &der)
}

#[test]
fn agent_csr_with_broken_self_signature_is_refused() {
    let ca = ca();
    let key = AgentKey::generate().unwrap();
    let csr = key.csr_pem("admin").unwrap();
    let id = Uuid::new_v4();

    // A flipped byte inside the signature value.
    let bad_sig = flip_byte(&csr, 3);
    assert!(matches!(
        ca.sign_agent_csr(&bad_sig, id, NOW, Duration::days(1)),
        Err(CryptoError::InvalidCsr(_))
    ));

    // A flipped byte inside the signed subject ("admin" -> "aemin"): parses, does not verify.
    let mut der = unpem(&csr);
    let pos = der.windows(5).position(|w| w == b"admin").unwrap();
    der[pos + 1] ^= 0x01;
    let bad_subject = pem("CERTIFICATE REQUEST", &der);
    assert!(matches!(
        ca.sign_agent_csr(&bad_subject, id, NOW, Duration::days(1)),
        Err(CryptoError::InvalidCsr(_))
    ));

    // Someone else's public key spliced into an otherwise valid CSR: no proof of possession.
    let mut der = unpem(&csr);
    let victim = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
    let own = {
        let c = x509_parser::certification_request::X509CertificationRequest::from_der(&der)
            .unwrap()
            .1;
        c.certification_request_info
            .subject_pki
            .subject_public_key
            .data
            .to_vec()
    };
    let pos = der.windows(65).position(|w| w == own.as_slice()).unwrap();
    der[pos..pos + 65].copy_from_slice(victim.public_key_raw());
    let spliced = pem("CERTIFICATE REQUEST", &der);
    assert!(matches!(
        ca.sign_agent_csr(&spliced, id, NOW, Duration::days(1)),
        Err(CryptoError::InvalidCsr(_))
    ));
}

#[test]
fn garbage_csrs_are_refused_without_panicking() {
    let ca = ca();
    let id = Uuid::new_v4();
    let cert_pem = ca.cert_pem().to_string();
    let inputs = [
        String::new(),
        "garbage".to_string(),
        "-----BEGIN CERTIFICATE REQUEST-----\n!!!!\n-----END CERTIFICATE REQUEST-----\n"
            .to_string(),
        pem("CERTIFICATE REQUEST", b""),
        pem("CERTIFICATE REQUEST", b"\x30\x03\x02\x01\x00"),
        pem("CERTIFICATE REQUEST", &[0xff; 300]),
        // A certificate is not a request.
        cert_pem,
    ];
    for input in &inputs {
        let res = ca.sign_agent_csr(input, id, NOW, Duration::days(1));
        assert!(
            matches!(res, Err(CryptoError::InvalidCsr(_))),
            "{input:?}: {res:?}"
        );
    }
    // Truncations of a valid CSR.
    let good = unpem(&AgentKey::generate().unwrap().csr_pem("x").unwrap());
    for len in [1, 10, good.len() / 2, good.len() - 1] {
        let res = ca.sign_agent_csr(
            &pem("CERTIFICATE REQUEST", &good[..len]),
            id,
            NOW,
            Duration::days(1),
        );
        assert!(res.is_err(), "truncated to {len}");
    }
    // Trailing bytes after a valid CSR.
    let mut long = good.clone();
    long.push(0);
    assert!(ca
        .sign_agent_csr(
            &pem("CERTIFICATE REQUEST", &long),
            id,
            NOW,
            Duration::days(1)
        )
        .is_err());
}

#[test]
fn non_p256_csrs_are_refused() {
    let ca = ca();
    let id = Uuid::new_v4();
    let params = CertificateParams::new(vec!["agent".to_string()]).unwrap();

    let p384 = KeyPair::generate_for(&PKCS_ECDSA_P384_SHA384).unwrap();
    let csr = params.serialize_request(&p384).unwrap().pem().unwrap();
    let res = ca.sign_agent_csr(&csr, id, NOW, Duration::days(1));
    assert!(
        matches!(&res, Err(CryptoError::UnsupportedKey(m)) if m.contains("P-384")),
        "{res:?}"
    );

    let rsa = KeyPair::generate_rsa_for(&PKCS_RSA_SHA256, RsaKeySize::_2048).unwrap();
    let csr = params.serialize_request(&rsa).unwrap().pem().unwrap();
    let res = ca.sign_agent_csr(&csr, id, NOW, Duration::days(1));
    assert!(
        matches!(&res, Err(CryptoError::UnsupportedKey(m)) if m.contains("RSA")),
        "{res:?}"
    );

    let ed = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let csr = params.serialize_request(&ed).unwrap().pem().unwrap();
    assert!(matches!(
        ca.sign_agent_csr(&csr, id, NOW, Duration::days(1)),
        Err(CryptoError::UnsupportedKey(_))
    ));
}

#[test]
fn agent_id_from_cert_refuses_certs_without_one_canonical_agent_uri() {
    let ca = ca();
    let server = ca
        .issue_server_cert(&["localhost".into()], NOW, Duration::days(1))
        .unwrap();
    assert!(matches!(
        agent_id_from_cert(&server.cert_der),
        Err(CryptoError::InvalidCertificate(_))
    ));
    assert!(agent_id_from_cert(b"junk").is_err());
    assert!(cert_not_after(b"junk").is_err());
    assert!(matches!(
        cert_pem_to_der("nothing here"),
        Err(CryptoError::InvalidPem(_))
    ));

    // Self-made certificates with two agent URIs, or a non-canonical uuid.
    let key = KeyPair::generate().unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    for uris in [
        vec![
            format!("urn:berth:agent:{a}"),
            format!("urn:berth:agent:{b}"),
        ],
        vec![format!("urn:berth:agent:{}", a.simple())],
        vec![format!("urn:berth:agent:{}", a.to_string().to_uppercase())],
        vec!["urn:berth:agent:not-a-uuid".to_string()],
    ] {
        let mut params = CertificateParams::default();
        params.subject_alt_names = uris
            .iter()
            .map(|u| SanType::URI(u.as_str().try_into().unwrap()))
            .collect();
        let cert = params.self_signed(&key).unwrap();
        assert!(
            matches!(
                agent_id_from_cert(cert.der()),
                Err(CryptoError::InvalidCertificate(_))
            ),
            "{uris:?}"
        );
    }
}
