//! TLS for tests of TLS clients, without a TLS-enabled server: [`TestCa`], a private
//! certificate authority made at run time (nothing on disk, nothing that expires between
//! runs), which issues server and client certificates; and [`TlsTerminator`], a proxy that
//! completes the TLS handshake on a loopback port with one of those certificates and forwards
//! the decrypted bytes to a plain TCP server (a real broker's plain port), the way stunnel or
//! a load balancer in front of a broker does. It counts the handshakes that succeed and fail,
//! and connects upstream only after a successful one: a client that sent plain text, or
//! distrusted the certificate, never reaches the server.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::rustls::crypto::ring::default_provider;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// A certificate and its private key, as DER (for a server here) and PEM (for a client's
/// configuration files).
pub struct Issued {
    cert: CertificateDer<'static>,
    cert_pem: String,
    key_pkcs8: Vec<u8>,
    key_pem: String,
}

impl Issued {
    /// The certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The private key, PKCS #8 PEM.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }
}

/// A private certificate authority.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    pem: String,
    key_pem: String,
}

impl TestCa {
    /// A new CA named `name` (its common name), with a new key.
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().expect("a key pair");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("a self-signed CA");
        TestCa {
            cert: cert.der().clone(),
            pem: cert.pem(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA's certificate, PEM: what a client is told to trust.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The CA's own certificate and key, as a server would be given them by mistake (a
    /// self-signed certificate with `CA:TRUE`, what `openssl req -x509` makes).
    pub fn itself(&self) -> Issued {
        let key = KeyPair::from_pem(&self.key_pem).expect("the CA's key");
        Issued {
            cert: self.cert.clone(),
            cert_pem: self.pem.clone(),
            key_pkcs8: key.serialize_der(),
            key_pem: self.key_pem.clone(),
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses, as text).
    pub fn server(&self, names: &[&str]) -> Issued {
        self.issue(names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A server certificate for `names` that expires `days` from now, at midnight UTC
    /// (rcgen takes a date).
    pub fn server_expiring_in(&self, names: &[&str], days: i64) -> Issued {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs() as i64;
        let (year, month, day) = hooklatch_core::time::civil_date(now.div_euclid(86_400) + days);
        let mut params = self.server_params(names);
        params.not_after = rcgen::date_time_ymd(year as i32, month as u8, day as u8);
        self.sign(params)
    }

    /// A client certificate named `name`, for mutual TLS.
    pub fn client(&self, name: &str) -> Issued {
        self.issue(&[name], ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Issued {
        let mut params = self.server_params(names);
        params.extended_key_usages = vec![usage];
        self.sign(params)
    }

    /// A leaf's parameters: `names` as subject alternative names, the first as its common
    /// name, for a server.
    fn server_params(&self, names: &[&str]) -> CertificateParams {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names.clone()).expect("certificate parameters");
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, first);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params
    }

    /// `params` signed by this CA, with a new key.
    fn sign(&self, params: CertificateParams) -> Issued {
        let key = KeyPair::generate().expect("a key pair");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("a signed certificate");
        Issued {
            cert: cert.der().clone(),
            cert_pem: cert.pem(),
            key_pkcs8: key.serialize_der(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// What a [`TlsTerminator`] has seen.
#[derive(Debug, Default)]
struct Counts {
    /// Handshakes completed (the client trusted the certificate, and presented its own when
    /// asked).
    handshakes: AtomicUsize,
    /// Handshakes that failed: plain text, a client that refused the certificate, or a
    /// missing or untrusted client certificate.
    refused: AtomicUsize,
    /// Connections made to the upstream server.
    upstream: AtomicUsize,
}

/// A TLS-terminating proxy from a loopback port to a plain TCP server.
pub struct TlsTerminator {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl TlsTerminator {
    /// Listens on a free loopback port with `server`'s certificate and forwards each
    /// connection whose handshake completes to `upstream`. With `clients`, a client must
    /// present a certificate that CA issued (mutual TLS).
    pub async fn start(
        upstream: SocketAddr,
        server: &Issued,
        clients: Option<&TestCa>,
    ) -> std::io::Result<TlsTerminator> {
        let provider = Arc::new(default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(std::io::Error::other)?;
        let builder = match clients {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                roots.add(ca.cert.clone()).map_err(std::io::Error::other)?;
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(std::io::Error::other)?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server.key_pkcs8.clone()));
        let config = builder
            .with_single_cert(vec![server.cert.clone()], key)
            .map_err(std::io::Error::other)?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(Counts::default());
        let seen = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (acceptor, seen) = (acceptor.clone(), seen.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(client).await else {
                        seen.refused.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    seen.handshakes.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    seen.upstream.fetch_add(1, Ordering::SeqCst);
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                });
            }
        });
        Ok(TlsTerminator { addr, counts, task })
    }

    /// The loopback address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Handshakes completed so far.
    pub fn handshakes(&self) -> usize {
        self.counts.handshakes.load(Ordering::SeqCst)
    }

    /// Handshakes that failed so far.
    pub fn refused(&self) -> usize {
        self.counts.refused.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` handshakes have failed, or `within` has passed; returns how
    /// many have. A client's failed handshake ends on its side before the proxy's task has
    /// counted it.
    pub async fn refused_at_least(&self, n: usize, within: std::time::Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        while self.refused() < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.refused()
    }

    /// Connections made to the upstream server so far.
    pub fn upstream_connections(&self) -> usize {
        self.counts.upstream.load(Ordering::SeqCst)
    }
}

impl Drop for TlsTerminator {
    fn drop(&mut self) {
        self.task.abort();
    }
}
