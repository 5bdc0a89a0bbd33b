//! Store authentication (`FERROCCL_STORE_SECRET`): a challenge-response that a
//! [`TcpStoreServer`](super::TcpStoreServer) with a secret requires of every client
//! before any other command, so that only processes that know the job's secret can read
//! or write its rendezvous. Off by default, so that PyTorch's clients still connect.
//!
//! After `VALIDATE`, the client sends `AUTH_HELLO`; the server answers with 32 random
//! bytes (or none, when it has no secret); the client sends
//! `AUTH_PROOF HMAC-SHA256(SHA-256(secret), "ferroccl-store-auth" ‖ challenge)` and the
//! server answers `1`, or closes the connection. Only the client is authenticated: a
//! client with a secret also talks to a server without one.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Bytes of a challenge.
pub const CHALLENGE_BYTES: usize = 32;
const CONTEXT: &[u8] = b"ferroccl-store-auth";

/// A store secret, kept as its SHA-256 (so it is `Copy` and never printed).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct StoreSecret([u8; 32]);

impl std::fmt::Debug for StoreSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreSecret(..)")
    }
}

impl StoreSecret {
    /// The secret `text` (any bytes; leading and trailing whitespace, e.g. a file's
    /// final newline, are not part of it).
    pub fn new(text: &[u8]) -> Self {
        StoreSecret(Sha256::digest(text.trim_ascii()).into())
    }

    /// `FERROCCL_STORE_SECRET`, or the contents of the file `FERROCCL_STORE_SECRET_FILE`
    /// names; `None` when neither is set. An empty secret is an error.
    pub fn from_env() -> Result<Option<Self>> {
        let (var, text) = if let Ok(t) = std::env::var("FERROCCL_STORE_SECRET") {
            ("FERROCCL_STORE_SECRET", t.into_bytes())
        } else if let Ok(path) = std::env::var("FERROCCL_STORE_SECRET_FILE") {
            let t = std::fs::read(&path).map_err(|e| Error::Env {
                var: "FERROCCL_STORE_SECRET_FILE".into(),
                detail: format!("cannot read {path}: {e}"),
            })?;
            ("FERROCCL_STORE_SECRET_FILE", t)
        } else {
            return Ok(None);
        };
        if text.trim_ascii().is_empty() {
            return Err(Error::Env {
                var: var.into(),
                detail: "the secret is empty".into(),
            });
        }
        Ok(Some(StoreSecret::new(&text)))
    }

    fn mac(&self, challenge: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key");
        mac.update(CONTEXT);
        mac.update(challenge);
        mac
    }

    /// The client's answer to `challenge`.
    pub fn proof(&self, challenge: &[u8]) -> Vec<u8> {
        self.mac(challenge).finalize().into_bytes().to_vec()
    }

    /// Whether `proof` answers `challenge` (compared in constant time).
    pub fn verify(&self, challenge: &[u8], proof: &[u8]) -> bool {
        self.mac(challenge).verify_slice(proof).is_ok()
    }
}

/// A fresh challenge.
pub fn challenge() -> [u8; CHALLENGE_BYTES] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_secret_answers_a_challenge() {
        let (a, b) = (StoreSecret::new(b"s3cret\n"), StoreSecret::new(b"other"));
        assert_eq!(a, StoreSecret::new(b"  s3cret"));
        let c = challenge();
        assert!(a.verify(&c, &a.proof(&c)));
        assert!(!a.verify(&c, &b.proof(&c)));
        assert!(
            !a.verify(&challenge(), &a.proof(&c)),
            "a proof answers one challenge"
        );
        assert!(!a.verify(&c, &[]));
        assert_eq!(format!("{a:?}"), "StoreSecret(..)");
    }
}
