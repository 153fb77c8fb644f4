//! TLS to the broker (`amqps://`): the destination's [`TlsFiles`] in the form lapin connects
//! with. The handshake is rustls's (through lapin): the broker's certificate must chain to one
//! of the Mozilla roots built into the binary or to a CA the destination adds, and must name
//! the URL's host; an `amqps://` connection never falls back to plain text.

use hooklatch_core::tls::TlsFiles;

/// `files` as lapin's TLS settings: the CA certificates added to the built-in roots, the
/// client certificate and key presented when the broker asks.
pub(crate) fn to_lapin(files: &TlsFiles) -> lapin::tcp::OwnedTLSConfig {
    lapin::tcp::OwnedTLSConfig {
        identity: files
            .client
            .as_ref()
            .map(|c| lapin::tcp::OwnedIdentity::PKCS8 {
                pem: c.cert_pem.clone().into_bytes(),
                key: c.key_pem.expose().to_vec(),
            }),
        cert_chain: files.ca_pem.clone(),
    }
}
