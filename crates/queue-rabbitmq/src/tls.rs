//! TLS to the broker (`amqps://`): what the client trusts and, for brokers that ask for one,
//! the certificate it presents. The handshake is rustls's (through lapin): the broker's
//! certificate must chain to one of the Mozilla roots built into the binary or to a CA the
//! destination adds, and must name the URL's host; an `amqps://` connection never falls back
//! to plain text.

use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

/// A client certificate and its private key, PEM, for mutual TLS. Its `Debug` shows neither.
#[derive(Clone)]
pub struct ClientIdentity {
    /// The certificate, then any intermediates, PEM.
    pub cert_pem: String,
    /// The private key (PKCS #8, PKCS #1 or SEC1), PEM. A secret.
    pub key_pem: String,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientIdentity { .. }")
    }
}

/// TLS settings for the `amqps://` URLs of a destination; `amqp://` URLs ignore them.
#[derive(Clone, Debug, Default)]
pub struct TlsConfig {
    /// CA certificates, PEM, trusted besides the built-in roots (a private CA).
    pub ca_pem: Option<String>,
    /// The certificate to present when the broker asks for one.
    pub client: Option<ClientIdentity>,
}

impl TlsConfig {
    /// The settings in the form lapin connects with.
    pub(crate) fn to_lapin(&self) -> lapin::tcp::OwnedTLSConfig {
        lapin::tcp::OwnedTLSConfig {
            identity: self
                .client
                .as_ref()
                .map(|c| lapin::tcp::OwnedIdentity::PKCS8 {
                    pem: c.cert_pem.clone().into_bytes(),
                    key: c.key_pem.clone().into_bytes(),
                }),
            cert_chain: self.ca_pem.clone(),
        }
    }
}

/// Checks a CA bundle: at least one PEM certificate, and each one usable as a trust anchor.
/// Returns how many it holds. The connection would skip a certificate that does not parse,
/// and then fail only when the broker's certificate is not trusted; here it is an error
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
    let certs = CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the certificate is not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("the certificate file holds no PEM certificate".to_owned());
    }
    let key = PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes()).map_err(|_| {
        "the key holds no PEM private key (PKCS #8, PKCS #1 or SEC1, unencrypted)".to_owned()
    })?;
    CertifiedKey::from_der(certs, key, &default_provider())
        .map(drop)
        .map_err(|e| format!("the key cannot be used with the certificate: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
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
            key_pem: mine.key_pem().to_owned(),
        };
        assert_eq!(check_client_identity(&identity), Ok(()));
        assert_eq!(format!("{identity:?}"), "ClientIdentity { .. }");

        let wrong_key = ClientIdentity {
            key_pem: other.key_pem().to_owned(),
            ..identity.clone()
        };
        let msg = check_client_identity(&wrong_key).unwrap_err();
        assert!(msg.contains("cannot be used with the certificate"), "{msg}");

        let garbage = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleQ==\n-----END PRIVATE KEY-----\n";
        let not_a_key = ClientIdentity {
            key_pem: garbage.to_owned(),
            ..identity.clone()
        };
        let msg = check_client_identity(&not_a_key).unwrap_err();
        assert!(!msg.contains("c2VjcmV0"), "{msg}");

        let no_cert = ClientIdentity {
            cert_pem: String::new(),
            ..identity
        };
        assert!(check_client_identity(&no_cert)
            .unwrap_err()
            .contains("holds no PEM certificate"));
    }
}
