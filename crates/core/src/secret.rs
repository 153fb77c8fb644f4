//! Signing secrets and the only ways hooklatch compares signatures.
//!
//! [`Secret`] never prints its bytes (`Debug` says `Secret([redacted])`). A computed MAC is a
//! [`Mac256`], which has no `PartialEq`: the only comparison is [`Mac256::matches`], which is
//! constant-time (`subtle`), so `==` on a signature cannot compile.

use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretSlice};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Bytes used as an HMAC key (or an Ed25519 public key). Never shown.
#[derive(Clone)]
pub struct Secret(SecretSlice<u8>);

impl Secret {
    /// Wraps key bytes.
    pub fn new(bytes: Vec<u8>) -> Secret {
        Secret(SecretSlice::from(bytes))
    }

    /// Wraps the UTF-8 bytes of a secret string, as most providers use it.
    pub fn from_text(text: &str) -> Secret {
        Secret::new(text.as_bytes().to_vec())
    }

    /// The key bytes, for computing a MAC. Never log them.
    pub fn expose(&self) -> &[u8] {
        self.0.expose_secret()
    }

    /// The key as text, if it is UTF-8 (for schemes that decode it, like `whsec_…`).
    pub fn expose_text(&self) -> Option<&str> {
        std::str::from_utf8(self.expose()).ok()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

/// An HMAC-SHA256 value. Deliberately without `PartialEq`: compare with [`Mac256::matches`],
/// which takes the same time wherever the bytes first differ:
///
/// ```
/// use hooklatch_core::secret::Mac256;
/// let mac = Mac256::compute(b"key", &[b"body"]);
/// assert!(!mac.matches(&[0u8; 32]));
/// let received = hex::decode(Mac256::compute(b"key", &[b"body"]).to_hex()).unwrap();
/// assert!(mac.matches(&received));
/// ```
///
/// An early-exit `==` between two of them does not compile (RELIABILITY.md T18):
///
/// ```compile_fail,E0369
/// use hooklatch_core::secret::Mac256;
/// let mac = Mac256::compute(b"key", &[b"body"]);
/// assert!(mac == Mac256::compute(b"key", &[b"body"]));
/// ```
pub struct Mac256([u8; 32]);

impl Mac256 {
    /// HMAC-SHA256 of the concatenation of `parts` under `key`.
    pub fn compute(key: &[u8], parts: &[&[u8]]) -> Mac256 {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts keys of any length");
        for part in parts {
            mac.update(part);
        }
        Mac256(mac.finalize().into_bytes().into())
    }

    /// Constant-time comparison with a received signature (any length; wrong length = no match).
    pub fn matches(&self, received: &[u8]) -> bool {
        received.len() == self.0.len() && bool::from(self.0.ct_eq(received))
    }

    /// Lowercase hex, for signing outgoing requests.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Standard base64 with padding, for signing outgoing requests.
    pub fn to_base64(&self) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(self.0)
    }
}

/// SHA-256 of a body, used to tell a duplicate from a conflict.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    Sha256::digest(bytes).into()
}

/// Constant-time equality of two byte strings (for bearer tokens).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_secret() {
        let secret = Secret::from_text("whsec_canary_123");
        assert_eq!(format!("{secret:?}"), "Secret([redacted])");
    }

    #[test]
    fn github_docs_vector() {
        let mac = Mac256::compute(b"It's a Secret to Everybody", &[b"Hello, World!"]);
        assert_eq!(
            mac.to_hex(),
            "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        );
        let wrong = hex::decode("757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e18")
            .unwrap();
        assert!(!mac.matches(&wrong));
        assert!(!mac.matches(&[]));
    }
}
