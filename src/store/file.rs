//! A store in a file shared by processes, e.g. on NFS.
//!
//! The file is an append-only log of records, each `op u8, key, value` in the wire
//! encoding (length-prefixed byte strings). Every handle keeps a [`KvState`] replayed from
//! the log and the offset it has read up to. An operation takes `flock` on the file
//! (exclusive to write, shared to read), replays records appended since its last visit,
//! then acts: so `add` and `compare_set` are atomic across processes. Waiting polls with
//! a growing sleep, as PyTorch's `FileStore` does.
//!
//! A writer that died mid-append leaves a truncated record at the end; the next writer
//! (holding the exclusive lock, so no append is in progress) cuts it off before appending.
//!
//! The file is never deleted by ferroccl: whoever chose its path owns it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::kv::KvState;
use super::wire::{Cursor, ParseError, Writer};
use super::{Store, check_key, check_keys, check_multi_set, check_value};
use crate::error::{Error, Result};

const OP_SET: u8 = 1;
const OP_APPEND: u8 = 2;
const OP_DELETE: u8 = 3;

/// Bounds for one record when replaying (generous: the log is trusted but may be torn).
const MAX_RECORD_FIELD: usize = 1 << 30;

/// A store backed by a file that several processes open by path.
pub struct FileStore {
    path: PathBuf,
    inner: Mutex<Inner>,
    timeout: Mutex<Duration>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

struct Inner {
    file: File,
    kv: KvState,
    /// Bytes of the log already replayed into `kv`.
    offset: u64,
}

/// Holds an `flock` on a descriptor until dropped. The descriptor must stay open for the
/// lock's lifetime (callers keep the `File` behind the mutex guard taken before the lock).
struct FileLock(RawFd);

impl FileLock {
    fn acquire(file: &File, exclusive: bool) -> Result<Self> {
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        loop {
            // SAFETY: flock on a file descriptor owned by `file`, which outlives the lock.
            let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
            if rc == 0 {
                return Ok(FileLock(file.as_raw_fd()));
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io("file store: flock", err));
            }
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: unlocking the descriptor locked in `acquire`; its `File` is still open
        // (see the type's contract).
        unsafe {
            libc::flock(self.0, libc::LOCK_UN);
        }
    }
}

impl FileStore {
    /// Opens (creating if needed) the store file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| Error::io(format!("file store: open {}", path.display()), e))?;
        Ok(FileStore {
            path,
            inner: Mutex::new(Inner {
                file,
                kv: KvState::default(),
                offset: 0,
            }),
            timeout: Mutex::new(super::DEFAULT_TIMEOUT),
        })
    }

    /// The path of the store file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        crate::lock(&self.inner)
    }

    /// Runs `f` on the up-to-date state under the file lock; `f` returns records to append.
    fn with_state<T>(
        &self,
        exclusive: bool,
        f: impl FnOnce(&mut KvState) -> Result<(T, Vec<u8>)>,
    ) -> Result<T> {
        let mut guard = self.lock_inner();
        let inner = &mut *guard;
        let _lock = FileLock::acquire(&inner.file, exclusive)?;
        let torn = inner.replay()?;
        let (out, records) = f(&mut inner.kv)?;
        if !records.is_empty() {
            debug_assert!(exclusive);
            if torn {
                inner
                    .file
                    .set_len(inner.offset)
                    .map_err(|e| Error::io("file store: cut torn record", e))?;
            }
            if let Err(e) = inner.file.write_all(&records) {
                // Nothing of a failed append may count (e.g. a full filesystem): cut
                // what part of it reached the file, and forget the state `f` changed,
                // so the next operation replays the log from the start.
                let _ = inner.file.set_len(inner.offset);
                inner.kv = KvState::default();
                inner.offset = 0;
                return Err(Error::io(
                    format!("file store {}: append", self.path.display()),
                    e,
                ));
            }
            // Our own records are already applied to `kv` by `f`.
            inner.offset += records.len() as u64;
        }
        Ok(out)
    }

    fn wait_for(&self, op: &'static str, keys: &[&str], timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut sleep = Duration::from_millis(1);
        loop {
            let missing: Vec<String> = self.with_state(false, |kv| {
                let missing = keys
                    .iter()
                    .filter(|k| !kv.is_ready(k.as_bytes()))
                    .map(|k| k.to_string())
                    .collect();
                Ok((missing, Vec::new()))
            })?;
            if missing.is_empty() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::StoreTimeout {
                    op,
                    waited,
                    missing,
                });
            }
            std::thread::sleep(sleep.min(timeout - waited));
            sleep = (sleep * 2).min(Duration::from_millis(10));
        }
    }
}

impl Inner {
    /// Applies records appended since `offset`; returns true if the log ends in a torn
    /// (incomplete) record.
    fn replay(&mut self) -> Result<bool> {
        let len = self
            .file
            .metadata()
            .map_err(|e| Error::io("file store: stat", e))?
            .len();
        if len < self.offset {
            return Err(Error::io(
                "file store",
                std::io::Error::other(format!(
                    "store file shrank from {} to {len} bytes under us",
                    self.offset
                )),
            ));
        }
        if len == self.offset {
            return Ok(false);
        }
        let mut fresh = Vec::with_capacity((len - self.offset) as usize);
        self.file
            .seek(SeekFrom::Start(self.offset))
            .map_err(|e| Error::io("file store: seek", e))?;
        (&self.file)
            .take(len - self.offset)
            .read_to_end(&mut fresh)
            .map_err(|e| Error::io("file store: read", e))?;
        let mut cursor = Cursor::new(&fresh);
        loop {
            let start = cursor.position();
            if cursor.is_empty() {
                break;
            }
            match decode_record(&mut cursor) {
                Ok((op, key, value)) => match op {
                    OP_SET => self.kv.set(key, value.to_vec()),
                    OP_APPEND => self.kv.append(key, value),
                    OP_DELETE => {
                        self.kv.delete(key);
                    }
                    other => return Err(corrupt(self.offset + start as u64, other)),
                },
                Err(ParseError::Incomplete) => {
                    self.offset += start as u64;
                    return Ok(true);
                }
                Err(ParseError::Malformed(why)) => {
                    return Err(Error::io(
                        "file store",
                        std::io::Error::other(format!(
                            "corrupt record at byte {}: {why}",
                            self.offset + start as u64
                        )),
                    ));
                }
            }
        }
        self.offset = len;
        Ok(false)
    }
}

fn corrupt(at: u64, op: u8) -> Error {
    Error::io(
        "file store",
        std::io::Error::other(format!("corrupt record at byte {at}: unknown op {op}")),
    )
}

fn decode_record<'a>(c: &mut Cursor<'a>) -> Result<(u8, &'a [u8], &'a [u8]), ParseError> {
    let op = c.u8()?;
    let key = c.bytes(MAX_RECORD_FIELD, "key")?;
    let value = c.bytes(MAX_RECORD_FIELD, "value")?;
    Ok((op, key, value))
}

fn record(out: &mut Writer, op: u8, key: &str, value: &[u8]) {
    out.u8(op).bytes(key.as_bytes()).bytes(value);
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        self.with_state(true, |kv| {
            kv.set(key.as_bytes(), value.to_vec());
            let mut w = Writer::default();
            record(&mut w, OP_SET, key, value);
            Ok(((), w.into_vec()))
        })
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key)?;
        self.wait_for("get", &[key], self.timeout())?;
        self.with_state(false, |kv| {
            Ok((kv.get(key.as_bytes()).unwrap_or_default().to_vec(), vec![]))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        self.with_state(true, |kv| {
            let new = kv
                .add(key.as_bytes(), delta)
                .map_err(|e| Error::StoreValue {
                    key: key.to_string(),
                    detail: e.to_string(),
                })?;
            let mut w = Writer::default();
            record(&mut w, OP_SET, key, new.to_string().as_bytes());
            Ok((new, w.into_vec()))
        })
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        check_key(key)?;
        check_value(expected)?;
        check_value(desired)?;
        self.with_state(true, |kv| {
            let before = kv.get(key.as_bytes()).map(<[u8]>::to_vec);
            let after = kv.compare_set(key.as_bytes(), expected, desired.to_vec());
            let mut w = Writer::default();
            if kv.get(key.as_bytes()).map(<[u8]>::to_vec) != before {
                record(&mut w, OP_SET, key, desired);
            }
            Ok((after, w.into_vec()))
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        check_keys(keys)?;
        self.with_state(false, |kv| {
            Ok((keys.iter().all(|k| kv.is_ready(k.as_bytes())), vec![]))
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        check_keys(keys)?;
        self.wait_for("wait", keys, timeout)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        self.with_state(true, |kv| {
            let existed = kv.delete(key.as_bytes());
            let mut w = Writer::default();
            if existed {
                record(&mut w, OP_DELETE, key, b"");
            }
            Ok((existed, w.into_vec()))
        })
    }

    fn num_keys(&self) -> Result<usize> {
        self.with_state(false, |kv| Ok((kv.num_keys(), vec![])))
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        check_keys(keys)?;
        self.wait_for("multi_get", keys, self.timeout())?;
        self.with_state(false, |kv| {
            let values = keys
                .iter()
                .map(|k| kv.get(k.as_bytes()).unwrap_or_default().to_vec())
                .collect();
            Ok((values, vec![]))
        })
    }

    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        check_multi_set(keys, values)?;
        self.with_state(true, |kv| {
            let mut w = Writer::default();
            for (key, value) in keys.iter().zip(values) {
                kv.set(key.as_bytes(), value.to_vec());
                record(&mut w, OP_SET, key, value);
            }
            Ok(((), w.into_vec()))
        })
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        self.with_state(true, |kv| {
            kv.append(key.as_bytes(), value);
            let mut w = Writer::default();
            record(&mut w, OP_APPEND, key, value);
            Ok(((), w.into_vec()))
        })
    }

    fn timeout(&self) -> Duration {
        *crate::lock(&self.timeout)
    }

    fn set_timeout(&self, timeout: Duration) {
        *crate::lock(&self.timeout) = timeout;
    }
}
