//! A view of another store with every key under `prefix/`.

use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::error::{Error, Result};

/// Wraps a store so that key `k` is stored as `prefix/k` (PyTorch's `PrefixStore`).
///
/// Two prefix stores with different prefixes over one store never see each other's keys.
/// Errors that name keys (timeouts, `add` on a non-counter) name them without the prefix,
/// as the caller wrote them.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl PrefixStore {
    /// Keys of this store live under `prefix/` in `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store underneath.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn full(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn full_all(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.full(k)).collect()
    }

    /// Strips the prefix from keys named in an error.
    fn strip(&self, err: Error) -> Error {
        match err {
            Error::StoreTimeout {
                op,
                waited,
                missing,
            } => {
                let head = format!("{}/", self.prefix);
                let missing = missing
                    .into_iter()
                    .map(|k| k.strip_prefix(&head).map(str::to_string).unwrap_or(k))
                    .collect();
                Error::StoreTimeout {
                    op,
                    waited,
                    missing,
                }
            }
            Error::StoreValue { key, detail } => {
                let head = format!("{}/", self.prefix);
                let key = key.strip_prefix(&head).map(str::to_string).unwrap_or(key);
                Error::StoreValue { key, detail }
            }
            other => other,
        }
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.full(key), value)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.full(key)).map_err(|e| self.strip(e))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner
            .add(&self.full(key), delta)
            .map_err(|e| self.strip(e))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.full(key), expected, desired)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(&refs(&self.full_all(keys)))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner
            .wait(&refs(&self.full_all(keys)), timeout)
            .map_err(|e| self.strip(e))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.full(key))
    }

    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        self.inner
            .multi_get(&refs(&self.full_all(keys)))
            .map_err(|e| self.strip(e))
    }

    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        self.inner.multi_set(&refs(&self.full_all(keys)), values)
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.append(&self.full(key), value)
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
}
