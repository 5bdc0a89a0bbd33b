//! An in-process store: the shared [`KvState`] behind a mutex, waiters on a condvar.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::kv::KvState;
use super::{Store, check_key, check_keys, check_multi_set, check_value};
use crate::error::{Error, Result};

/// A store in process memory, for ranks that are threads of one process.
///
/// Cloning gives another handle on the same data (like a second client of a server).
///
/// # Example
///
/// ```
/// use ferroccl::store::{HashStore, Store};
///
/// let store = HashStore::new();
/// let other = store.clone(); // another handle on the same data
/// store.set("answer", b"42")?;
/// assert_eq!(other.get("answer")?, b"42"); // waits until the key is there
/// assert_eq!(other.add("counter", 5)?, 5);
/// # Ok::<(), ferroccl::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct HashStore {
    shared: Arc<Shared>,
    timeout: Arc<Mutex<Duration>>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<KvState>,
    changed: Condvar,
}

impl Default for HashStore {
    fn default() -> Self {
        Self::new()
    }
}

impl HashStore {
    /// An empty store with the default timeout.
    pub fn new() -> Self {
        HashStore {
            shared: Arc::default(),
            timeout: Arc::new(Mutex::new(super::DEFAULT_TIMEOUT)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, KvState> {
        // A panic while holding this lock cannot leave KvState half-updated (every
        // method is a single map operation), so a poisoned lock is still usable.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn mutate<T>(&self, f: impl FnOnce(&mut KvState) -> T) -> T {
        let out = f(&mut self.lock());
        self.shared.changed.notify_all();
        out
    }

    /// Blocks until all keys are ready, returning the guard so callers can read atomically.
    fn wait_locked(
        &self,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<MutexGuard<'_, KvState>> {
        let start = Instant::now();
        let mut state = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !state.is_ready(k.as_bytes()))
                .map(|k| k.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(state);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::StoreTimeout {
                    op,
                    waited,
                    missing,
                });
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, timeout - waited)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        self.mutate(|s| s.set(key.as_bytes(), value.to_vec()));
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key)?;
        let state = self.wait_locked("get", &[key], self.timeout())?;
        Ok(state.get(key.as_bytes()).unwrap_or_default().to_vec())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        self.mutate(|s| s.add(key.as_bytes(), delta))
            .map_err(|e| Error::StoreValue {
                key: key.to_string(),
                detail: e.to_string(),
            })
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        check_key(key)?;
        check_value(expected)?;
        check_value(desired)?;
        Ok(self.mutate(|s| s.compare_set(key.as_bytes(), expected, desired.to_vec())))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        check_keys(keys)?;
        let state = self.lock();
        Ok(keys.iter().all(|k| state.is_ready(k.as_bytes())))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        check_keys(keys)?;
        self.wait_locked("wait", keys, timeout).map(drop)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        Ok(self.mutate(|s| s.delete(key.as_bytes())))
    }

    fn num_keys(&self) -> Result<usize> {
        Ok(self.lock().num_keys())
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        check_keys(keys)?;
        let state = self.wait_locked("multi_get", keys, self.timeout())?;
        Ok(keys
            .iter()
            .map(|k| state.get(k.as_bytes()).unwrap_or_default().to_vec())
            .collect())
    }

    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        check_multi_set(keys, values)?;
        self.mutate(|s| {
            for (k, v) in keys.iter().zip(values) {
                s.set(k.as_bytes(), v.to_vec());
            }
        });
        Ok(())
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        self.mutate(|s| s.append(key.as_bytes(), value));
        Ok(())
    }

    fn timeout(&self) -> Duration {
        *crate::lock(&self.timeout)
    }

    fn set_timeout(&self, timeout: Duration) {
        *crate::lock(&self.timeout) = timeout;
    }
}
