//! The key-value semantics shared by the TCP store server and [`HashStore`](super::HashStore).
//!
//! Pure data and rules, no I/O and no waiting: the server wraps it in an event loop and a
//! table of waiting clients, the hash store in a mutex and a condition variable. Keeping
//! the rules here means the two can never disagree about what `add` or `compare_set` do.

use std::collections::{HashMap, VecDeque};

/// Why an `add` could not be applied to an existing value.
#[derive(Debug)]
pub(crate) struct NotACounter {
    /// The value found, lossily decoded for the message.
    pub found: String,
}

impl std::fmt::Display for NotACounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "value {:?} is not a decimal integer counter", self.found)
    }
}

/// Keys and values (keys are raw bytes: PyTorch clients may send any byte string), plus
/// the FIFO queues of `QUEUE_PUSH`/`QUEUE_POP`.
#[derive(Default, Debug)]
pub(crate) struct KvState {
    values: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
}

impl KvState {
    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &[u8], value: Vec<u8>) {
        self.values.insert(key.to_vec(), value);
    }

    /// The value at `key`, if any.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.values.get(key).map(Vec::as_slice)
    }

    /// Whether `key` is "set" for the purpose of `check` and `wait`: it holds a value, or
    /// it names a non-empty queue.
    pub fn is_ready(&self, key: &[u8]) -> bool {
        self.values.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Adds `delta` to the decimal counter at `key` (0 if missing); returns the new value.
    /// Overflow wraps, as the two's-complement arithmetic of PyTorch's server does.
    pub fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, NotACounter> {
        let current = match self.values.get(key) {
            None => 0,
            Some(v) => parse_counter(v).ok_or_else(|| NotACounter {
                found: String::from_utf8_lossy(&v[..v.len().min(64)]).into_owned(),
            })?,
        };
        let new = current.wrapping_add(delta);
        self.values
            .insert(key.to_vec(), new.to_string().into_bytes());
        Ok(new)
    }

    /// PyTorch's compare-and-set; returns the value the caller is told about.
    pub fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: Vec<u8>) -> Vec<u8> {
        match self.values.get_mut(key) {
            None if expected.is_empty() => {
                self.values.insert(key.to_vec(), desired.clone());
                desired
            }
            None => expected.to_vec(),
            Some(current) => {
                if current.as_slice() == expected {
                    *current = desired;
                }
                current.clone()
            }
        }
    }

    /// Deletes `key`; returns whether it held a value.
    pub fn delete(&mut self, key: &[u8]) -> bool {
        self.values.remove(key).is_some()
    }

    /// Number of keys holding values.
    pub fn num_keys(&self) -> usize {
        self.values.len()
    }

    /// Appends to the value at `key`, creating it if missing.
    pub fn append(&mut self, key: &[u8], value: &[u8]) {
        self.values
            .entry(key.to_vec())
            .or_default()
            .extend_from_slice(value);
    }

    /// Pushes `value` at the back of the queue named `key`.
    pub fn queue_push(&mut self, key: &[u8], value: Vec<u8>) {
        self.queues
            .entry(key.to_vec())
            .or_default()
            .push_back(value);
    }

    /// Pops the front of the queue named `key`.
    pub fn queue_pop(&mut self, key: &[u8]) -> Option<Vec<u8>> {
        let queue = self.queues.get_mut(key)?;
        let value = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(key);
        }
        value
    }

    /// Length of the queue named `key`.
    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }
}

/// Reads a counter the way PyTorch's server does (`std::stoll`): leading whitespace, an
/// optional sign, at least one digit; anything after the digits is ignored.
fn parse_counter(v: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(v).ok()?.trim_start();
    let digits_start = usize::from(s.starts_with(['+', '-']));
    let digits_len = s[digits_start..]
        .bytes()
        .take_while(u8::is_ascii_digit)
        .count();
    if digits_len == 0 {
        return None;
    }
    s[..digits_start + digits_len].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_parses_and_stores_decimal() {
        let mut kv = KvState::default();
        assert_eq!(kv.add(b"c", 5).unwrap(), 5);
        assert_eq!(kv.add(b"c", -7).unwrap(), -2);
        assert_eq!(kv.get(b"c").unwrap(), b"-2");
        kv.set(b"x", b"abc".to_vec());
        let err = kv.add(b"x", 1).unwrap_err();
        assert!(err.to_string().contains("abc"));
        kv.set(b"y", b" 12abc".to_vec());
        assert_eq!(kv.add(b"y", 1).unwrap(), 13);
    }

    #[test]
    fn compare_set_follows_pytorch() {
        let mut kv = KvState::default();
        // Missing key, non-empty expected: nothing is created, expected is echoed.
        assert_eq!(kv.compare_set(b"k", b"old", b"new".to_vec()), b"old");
        assert!(kv.get(b"k").is_none());
        // Missing key, empty expected: created.
        assert_eq!(kv.compare_set(b"k", b"", b"v1".to_vec()), b"v1");
        // Mismatch: unchanged, current returned.
        assert_eq!(kv.compare_set(b"k", b"zz", b"v2".to_vec()), b"v1");
        // Match: swapped.
        assert_eq!(kv.compare_set(b"k", b"v1", b"v2".to_vec()), b"v2");
        assert_eq!(kv.get(b"k").unwrap(), b"v2");
    }

    #[test]
    fn queues_are_fifo_and_count_as_ready() {
        let mut kv = KvState::default();
        assert!(!kv.is_ready(b"q"));
        kv.queue_push(b"q", b"1".to_vec());
        kv.queue_push(b"q", b"2".to_vec());
        assert!(kv.is_ready(b"q"));
        assert_eq!(kv.queue_len(b"q"), 2);
        assert_eq!(kv.queue_pop(b"q").unwrap(), b"1");
        assert_eq!(kv.queue_pop(b"q").unwrap(), b"2");
        assert!(kv.queue_pop(b"q").is_none());
        assert!(!kv.is_ready(b"q"));
    }
}
