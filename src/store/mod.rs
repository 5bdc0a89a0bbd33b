//! The control plane: a key-value store that ranks use to find each other.
//!
//! [`Store`] has the operations of PyTorch's `c10d::Store`. Four implementations share it:
//!
//! | type | where the data lives | use |
//! | --- | --- | --- |
//! | [`TcpStore`] / [`TcpStoreServer`] | a server thread in one process | multi-process, multi-host; speaks PyTorch's TCPStore wire protocol |
//! | [`FileStore`] | an append-only file guarded by `flock` | processes sharing a file system (NFS included) |
//! | [`HashStore`] | process memory | threads as ranks, tests |
//! | [`PrefixStore`] | another store, keys under `prefix/` | isolating jobs or sub-groups on one store |
//!
//! Semantics common to all of them (checked by one conformance suite in `tests/`):
//! `get` and `multi_get` wait for their keys up to the store's timeout; `add` keeps the
//! counter as an ASCII decimal value (so `get` on a counter returns e.g. `b"42"`);
//! `compare_set` follows PyTorch (a missing key with an empty `expected` is created);
//! `wait` past its timeout fails with [`Error::StoreTimeout`]
//! naming the keys still missing.
//!
//! ```
//! use std::time::Duration;
//! use ferroccl::store::{ServerOptions, Store, TcpStore, TcpStoreOptions};
//!
//! // Host a server on a free loopback port and talk to it, as PyTorch's
//! // `TCPStore(is_master=True)` does.
//! let store = TcpStore::host("127.0.0.1:0", ServerOptions::default(), TcpStoreOptions::default())?;
//! store.set("answer", b"42")?;
//! assert_eq!(store.get("answer")?, b"42");
//! assert_eq!(store.add("answer", 1)?, 43); // counters are ASCII decimal
//! let late = store.wait(&["answer", "missing"], Duration::from_millis(50));
//! assert!(matches!(late, Err(ferroccl::Error::StoreTimeout { missing, .. }) if missing == ["missing"]));
//! # Ok::<(), ferroccl::Error>(())
//! ```

pub mod auth;
mod file;
mod hash;
mod kv;
mod prefix;
mod tcp_client;
mod tcp_server;
pub mod wire;

use std::time::Duration;

pub use file::FileStore;
pub use hash::HashStore;
pub use prefix::PrefixStore;
pub use tcp_client::{TcpStore, TcpStoreOptions};
pub use tcp_server::{ServerOptions, TcpStoreServer};

use crate::error::{Error, Result};

/// Default time a store waits for keys, as in PyTorch (`default_pg_timeout`, 30 minutes,
/// is for collectives; the store's own default is 300 seconds).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Longest key accepted, in bytes (PyTorch's libuv TCPStore backend: `MAX_STRING_LEN`).
pub const MAX_KEY_LEN: usize = 8 * 1024;

/// Largest value accepted, in bytes (PyTorch's libuv TCPStore backend: `MAX_PAYLOAD_LEN`).
pub const MAX_VALUE_LEN: usize = 8 * 1024 * 1024;

/// Most keys in one `check`, `wait`, `multi_get` or `multi_set` (PyTorch: `MAX_KEY_COUNT`).
pub const MAX_KEY_COUNT: usize = 128 * 1024;

/// A key-value store shared by the ranks of a job.
///
/// All methods take `&self`; implementations are internally synchronised so one store can
/// be shared by threads (`Arc<dyn Store>`).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Waits (up to [`Store::timeout`]) until `key` exists, then returns its value.
    fn get(&self, key: &str) -> Result<Vec<u8>>;

    /// Atomically adds `delta` to the counter at `key` (created at 0) and returns the new
    /// value. The counter is stored as ASCII decimal.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Atomically sets `key` to `desired` if its value equals `expected`, and returns the
    /// value the key holds afterwards. A missing key counts as matching an empty
    /// `expected`; a missing key with a non-empty `expected` is left missing and
    /// `expected` is returned (PyTorch's behaviour).
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Returns whether every key in `keys` exists, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Waits until every key in `keys` exists, or fails with
    /// [`Error::StoreTimeout`] after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Number of keys in the store (for a [`PrefixStore`], in the whole underlying store,
    /// as in PyTorch).
    fn num_keys(&self) -> Result<usize>;

    /// Waits (up to [`Store::timeout`]) for all `keys`, then returns their values in order.
    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>>;

    /// Sets each `keys[i]` to `values[i]`.
    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()>;

    /// Appends `value` to the value at `key` (creating it if missing).
    fn append(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The timeout used by [`Store::get`] and [`Store::multi_get`].
    fn timeout(&self) -> Duration;

    /// Changes the timeout used by [`Store::get`] and [`Store::multi_get`].
    fn set_timeout(&self, timeout: Duration);

    /// Waits for `keys` using the store's own timeout.
    fn wait_default(&self, keys: &[&str]) -> Result<()> {
        self.wait(keys, self.timeout())
    }
}

/// Checks a key against [`MAX_KEY_LEN`].
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::KeyTooLong {
            len: key.len(),
            max: MAX_KEY_LEN,
        });
    }
    Ok(())
}

/// Checks a value against [`MAX_VALUE_LEN`].
pub(crate) fn check_value(value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::ValueTooLarge {
            len: value.len(),
            max: MAX_VALUE_LEN,
        });
    }
    Ok(())
}

/// Checks every key of a multi-key request and the key count.
pub(crate) fn check_keys(keys: &[&str]) -> Result<()> {
    if keys.len() > MAX_KEY_COUNT {
        return Err(Error::invalid(format!(
            "{} keys in one request exceed the limit of {MAX_KEY_COUNT}",
            keys.len()
        )));
    }
    keys.iter().try_for_each(|k| check_key(k))
}

/// Checks that `multi_set` got as many values as keys.
pub(crate) fn check_multi_set(keys: &[&str], values: &[&[u8]]) -> Result<()> {
    if keys.len() != values.len() {
        return Err(Error::invalid(format!(
            "multi_set got {} keys but {} values",
            keys.len(),
            values.len()
        )));
    }
    check_keys(keys)?;
    values.iter().try_for_each(|v| check_value(v))
}
