//! The checks a connection's TLS files get when the configuration is loaded, with the rustls
//! the clients connect with: certificates that parse, a key that is the certificate's. A
//! mistake stops the gateway at start-up with the reason, not at the first connection.

use hooklatch_core::tls::ClientIdentity;
use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

/// Checks a CA bundle: at least one PEM certificate, and each one usable as a trust anchor.
/// Returns how many it holds. lapin's connector would skip a certificate that does not parse,
/// and fail only when the server's certificate is not trusted; here it is an error
/// naming the certificate's position.
pub fn check_ca_pem(pem: &str) -> Result<usize, String> {
    let mut roots = RootCertStore::empty();
    for (i, cert) in CertificateDer::pem_slice_iter(pem.as_bytes()).enumerate() {
        let cert = cert.map_err(|e| format!("certificate {}: not PEM: {e}", i + 1))?;
        roots
            .add(cert)
            .map_err(|e| format!("certificate {}: {e}", i + 1))?;
    }
    match roots.len() {
        0 => Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned()),
        n => Ok(n),
    }
}

/// Checks a client identity: a PEM certificate, a PEM private key, and the key is the
/// certificate's. Errors name what is wrong, never the key.
pub fn check_client_identity(identity: &ClientIdentity) -> Result<(), String> {
    certified_key(identity).map(drop)
}

/// A certificate chain and its key as rustls serves them, checked as
/// [`check_client_identity`] says.
pub fn certified_key(identity: &ClientIdentity) -> Result<CertifiedKey, String> {
    let certs = CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the certificate is not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("the certificate file holds no PEM certificate".to_owned());
    }
    let key = PrivateKeyDer::from_pem_slice(identity.key_pem.expose()).map_err(|_| {
        if is_encrypted(identity.key_pem.expose()) {
            "the key is encrypted with a passphrase, which the gateway has no way to ask for: \
             write it out unencrypted (`openssl pkey -in KEY -out KEY.plain`) and keep that \
             file readable by the gateway's user alone"
                .to_owned()
        } else {
            "the key holds no PEM private key (PKCS #8, PKCS #1 or SEC1, unencrypted)".to_owned()
        }
    })?;
    CertifiedKey::from_der(certs, key, &default_provider())
        .map_err(|e| format!("the key cannot be used with the certificate: {e}"))
}

/// Whether a PEM text holds a passphrase-encrypted key: PKCS #8's `ENCRYPTED PRIVATE KEY`,
/// or OpenSSL's older `Proc-Type: 4,ENCRYPTED` header inside an RSA or EC key.
fn is_encrypted(pem: &[u8]) -> bool {
    let has = |needle: &[u8]| pem.windows(needle.len()).any(|w| w == needle);
    has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED")
}

#[cfg(test)]
mod tests {
    use super::*;
    use hooklatch_core::secret::Secret;
    use hooklatch_testkit::tls::TestCa;

    /// `pem` with the middle of its base64 cut out: the DER inside ends early.
    fn truncated(pem: &str) -> String {
        let lines: Vec<&str> = pem.lines().collect();
        let (first, last) = (lines[..3].join("\n"), lines[lines.len() - 1]);
        format!("{first}\n{last}\n")
    }

    #[test]
    fn a_bundle_counts_its_certificates_and_needs_one() {
        let (one, two) = (TestCa::new("one"), TestCa::new("two"));
        assert_eq!(check_ca_pem(&format!("{}{}", one.pem(), two.pem())), Ok(2));
        assert!(check_ca_pem("")
            .unwrap_err()
            .contains("holds no PEM certificate"));
        let key_only = one.server(&["localhost"]).key_pem().to_owned();
        assert!(check_ca_pem(&key_only)
            .unwrap_err()
            .contains("holds no PEM certificate"));
    }

    #[test]
    fn a_certificate_that_does_not_parse_is_named_by_its_position() {
        let ca = TestCa::new("ca");
        let both = format!("{}{}", ca.pem(), truncated(ca.pem()));
        let msg = check_ca_pem(&both).unwrap_err();
        assert!(msg.starts_with("certificate 2: "), "{msg}");
    }

    #[test]
    fn a_client_identity_needs_its_own_key_and_errors_never_show_a_key() {
        let ca = TestCa::new("ca");
        let (mine, other) = (ca.client("hooklatch"), ca.client("someone-else"));
        let identity = ClientIdentity {
            cert_pem: mine.cert_pem().to_owned(),
            key_pem: Secret::from_text(mine.key_pem()),
        };
        assert_eq!(check_client_identity(&identity), Ok(()));

        let wrong_key = ClientIdentity {
            key_pem: Secret::from_text(other.key_pem()),
            ..identity.clone()
        };
        let msg = check_client_identity(&wrong_key).unwrap_err();
        assert!(msg.contains("cannot be used with the certificate"), "{msg}");

        let garbage = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleQ==\n-----END PRIVATE KEY-----\n";
        let not_a_key = ClientIdentity {
            key_pem: Secret::from_text(garbage),
            ..identity.clone()
        };
        let msg = check_client_identity(&not_a_key).unwrap_err();
        assert!(!msg.contains("c2VjcmV0"), "{msg}");

        // A passphrase-protected key, in both of OpenSSL's forms, is named as such.
        for encrypted in [
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nc2VjcmV0LWtleQ==\n-----END ENCRYPTED PRIVATE KEY-----\n",
            "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,00\n\nc2VjcmV0LWtleQ==\n-----END RSA PRIVATE KEY-----\n",
        ] {
            let locked = ClientIdentity {
                key_pem: Secret::from_text(encrypted),
                ..identity.clone()
            };
            let msg = check_client_identity(&locked).unwrap_err();
            assert!(msg.starts_with("the key is encrypted with a passphrase"), "{msg}");
            assert!(!msg.contains("c2VjcmV0"), "{msg}");
        }

        let no_cert = ClientIdentity {
            cert_pem: String::new(),
            ..identity
        };
        assert!(check_client_identity(&no_cert)
            .unwrap_err()
            .contains("holds no PEM certificate"));
    }
}
