//! TLS files for the gateway's own connections to its infrastructure (a RabbitMQ
//! destination, the Redis key store): what to trust besides a client's built-in roots, and the
//! certificate to present to a server that asks for one. Plain data: the configuration loader
//! reads and checks the files; each client crate turns them into its library's settings.

use crate::secret::Secret;

/// A client certificate and its private key, PEM, for mutual TLS.
#[derive(Clone)]
pub struct ClientIdentity {
    /// The certificate, then any intermediates, PEM.
    pub cert_pem: String,
    /// The private key (PKCS #8, PKCS #1 or SEC1, unencrypted), PEM.
    pub key_pem: Secret,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientIdentity { .. }")
    }
}

/// The TLS files of one connection; the default (neither) trusts the built-in roots only and
/// presents no certificate.
#[derive(Clone, Default)]
pub struct TlsFiles {
    /// CA certificates, PEM.
    pub ca_pem: Option<String>,
    /// The certificate to present when the server asks for one.
    pub client: Option<ClientIdentity>,
}

impl TlsFiles {
    /// Whether any file is set.
    pub fn is_set(&self) -> bool {
        self.ca_pem.is_some() || self.client.is_some()
    }
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_which_files_are_set_never_their_contents() {
        let files = TlsFiles {
            ca_pem: Some("-----BEGIN CERTIFICATE-----\nQ0E=\n".to_owned()),
            client: Some(ClientIdentity {
                cert_pem: "-----BEGIN CERTIFICATE-----\nY2VydA==\n".to_owned(),
                key_pem: Secret::from_text("-----BEGIN PRIVATE KEY-----\nc2VjcmV0\n"),
            }),
        };
        let shown = format!("{files:?} {:?}", files.client);
        assert_eq!(
            shown,
            "TlsFiles { ca: true, client_certificate: true } Some(ClientIdentity { .. })"
        );
        assert!(files.is_set() && !TlsFiles::default().is_set());
    }
}
