//! PyTorch's TCPStore wire protocol (the libuv-era one), both directions.
//!
//! Every request is a 1-byte [`QueryType`] followed by its fields. Integers are
//! little-endian (PyTorch sends them in host order; every platform it runs on is
//! little-endian); strings and byte arrays are a `u64` length followed by the bytes.
//! The server never reports errors in-band: a malformed request closes the connection.
//!
//! | query | request fields | response |
//! | --- | --- | --- |
//! | VALIDATE | u32 magic `0x3C85F7CE` | none |
//! | SET | key, value | none |
//! | COMPARE_SET | key, expected, desired | value |
//! | GET | key | value (empty if missing) |
//! | ADD | key, i64 delta | i64 new value |
//! | CHECK | u64 n, n keys | u8 READY 0 / NOT_READY 1 |
//! | WAIT | u64 n, n keys | u8 STOP_WAITING 0, once all exist |
//! | GETNUMKEYS | — | i64 |
//! | DELETE_KEY | key | i64 number deleted |
//! | APPEND | key, value | none |
//! | MULTI_GET | u64 n, n keys | n values |
//! | MULTI_SET | u64 n, n × (key, value) | none |
//! | CANCEL_WAIT | — | u8 WAIT_CANCELED 1 |
//! | PING | u32 nonce | u32 nonce |
//! | QUEUE_PUSH | key, value | none |
//! | QUEUE_POP | key | i64 length before the pop, then value if it was > 0 |
//! | QUEUE_LEN | key | i64 |
//!
//! Parsing works on whatever bytes have arrived: [`parse_request`] answers
//! [`ParseError::Incomplete`] until a whole request is buffered, and rejects impossible
//! lengths at once so that garbage cannot make the server wait for gigabytes.

use std::io::{self, Read};

/// `VALIDATE`'s magic number (PyTorch: `validationMagicNumber`).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// `CHECK` answer: all keys exist.
pub const CHECK_READY: u8 = 0;
/// `CHECK` answer: some key is missing.
pub const CHECK_NOT_READY: u8 = 1;
/// `WAIT` answer: all keys now exist.
pub const WAIT_STOP_WAITING: u8 = 0;
/// `CANCEL_WAIT` answer: the pending wait was removed.
pub const WAIT_CANCELED: u8 = 1;

/// The 1-byte command codes (PyTorch's `QueryType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    /// Client handshake carrying [`VALIDATION_MAGIC`].
    Validate = 0,
    /// Set a key.
    Set = 1,
    /// Compare-and-set a key.
    CompareSet = 2,
    /// Read a key.
    Get = 3,
    /// Add to a counter.
    Add = 4,
    /// Test keys without waiting.
    Check = 5,
    /// Wait for keys.
    Wait = 6,
    /// Count keys.
    GetNumKeys = 7,
    /// Delete a key.
    DeleteKey = 8,
    /// Append to a key.
    Append = 9,
    /// Read several keys.
    MultiGet = 10,
    /// Set several keys.
    MultiSet = 11,
    /// Cancel this connection's pending wait.
    CancelWait = 12,
    /// Liveness check echoing a nonce.
    Ping = 13,
    /// Push onto a queue.
    QueuePush = 14,
    /// Pop from a queue.
    QueuePop = 15,
    /// Length of a queue.
    QueueLen = 16,
    /// ferroccl's own: ask for an authentication challenge (see [`super::auth`]).
    AuthHello = 64,
    /// ferroccl's own: answer the challenge.
    AuthProof = 65,
}

impl QueryType {
    fn from_u8(b: u8) -> Option<Self> {
        use QueryType::*;
        Some(match b {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            64 => AuthHello,
            65 => AuthProof,
            _ => return None,
        })
    }
}

/// Size limits a server enforces on incoming requests.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest key.
    pub max_key_len: usize,
    /// Largest value.
    pub max_value_len: usize,
    /// Most keys in one request.
    pub max_key_count: usize,
}

/// One decoded request. Keys are raw bytes: PyTorch does not require UTF-8.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// `VALIDATE magic`.
    Validate(u32),
    /// `SET key value`.
    Set(Vec<u8>, Vec<u8>),
    /// `COMPARE_SET key expected desired`.
    CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
    /// `GET key`.
    Get(Vec<u8>),
    /// `ADD key delta`.
    Add(Vec<u8>, i64),
    /// `CHECK keys`.
    Check(Vec<Vec<u8>>),
    /// `WAIT keys`.
    Wait(Vec<Vec<u8>>),
    /// `GETNUMKEYS`.
    GetNumKeys,
    /// `DELETE_KEY key`.
    DeleteKey(Vec<u8>),
    /// `APPEND key value`.
    Append(Vec<u8>, Vec<u8>),
    /// `MULTI_GET keys`.
    MultiGet(Vec<Vec<u8>>),
    /// `MULTI_SET (key, value)*`.
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    /// `CANCEL_WAIT`.
    CancelWait,
    /// `PING nonce`.
    Ping(u32),
    /// `QUEUE_PUSH key value`.
    QueuePush(Vec<u8>, Vec<u8>),
    /// `QUEUE_POP key`.
    QueuePop(Vec<u8>),
    /// `QUEUE_LEN key`.
    QueueLen(Vec<u8>),
    /// `AUTH_HELLO`.
    AuthHello,
    /// `AUTH_PROOF proof`.
    AuthProof(Vec<u8>),
}

/// Why a buffer does not (yet) hold a valid request.
#[derive(Debug, PartialEq, Eq)]
pub enum ParseError {
    /// More bytes are needed.
    Incomplete,
    /// The bytes can never form a valid request; the connection must be closed.
    Malformed(String),
}

/// A read position in a byte slice that reports [`ParseError::Incomplete`] when it runs
/// out. Also used to decode bootstrap payloads and the records ranks exchange about
/// their memory (windows, CUDA IPC FIFOs), which use the same encoding.
pub struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// Starts reading at the beginning of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Whether every byte has been consumed.
    pub fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ParseError> {
        if self.buf.len() - self.pos < n {
            return Err(ParseError::Incomplete);
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// Reads `N` bytes as they are (a magic number, a handle).
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], ParseError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// Reads a `u8`.
    pub fn u8(&mut self) -> Result<u8, ParseError> {
        Ok(self.take(1)?[0])
    }

    /// Reads a little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian `i32`.
    pub fn i32(&mut self) -> Result<i32, ParseError> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian `i64`.
    pub fn i64(&mut self) -> Result<i64, ParseError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// Reads a `u64` count, rejecting counts above `max` before any element arrives.
    pub fn count(&mut self, max: usize, what: &str) -> Result<usize, ParseError> {
        let n = self.u64()?;
        if n > max as u64 {
            return Err(ParseError::Malformed(format!(
                "{what} count {n} exceeds the limit of {max}"
            )));
        }
        Ok(n as usize)
    }

    /// Reads a length-prefixed byte string of at most `max` bytes.
    pub fn bytes(&mut self, max: usize, what: &str) -> Result<&'a [u8], ParseError> {
        let n = self.u64()?;
        if n > max as u64 {
            return Err(ParseError::Malformed(format!(
                "{what} of {n} bytes exceeds the limit of {max} bytes"
            )));
        }
        self.take(n as usize)
    }
}

/// Decodes one request from the front of `buf`; returns it with the bytes it used.
pub fn parse_request(buf: &[u8], limits: &Limits) -> Result<(Request, usize), ParseError> {
    let mut c = Cursor::new(buf);
    let code = c.u8()?;
    let query = QueryType::from_u8(code)
        .ok_or_else(|| ParseError::Malformed(format!("unknown command byte {code}")))?;
    let key = |c: &mut Cursor<'_>| c.bytes(limits.max_key_len, "key").map(<[u8]>::to_vec);
    let value = |c: &mut Cursor<'_>| c.bytes(limits.max_value_len, "value").map(<[u8]>::to_vec);
    let keys = |c: &mut Cursor<'_>| -> Result<Vec<Vec<u8>>, ParseError> {
        let n = c.count(limits.max_key_count, "key")?;
        (0..n).map(|_| key(c)).collect()
    };
    let request = match query {
        QueryType::Validate => Request::Validate(c.u32()?),
        QueryType::Set => Request::Set(key(&mut c)?, value(&mut c)?),
        QueryType::CompareSet => Request::CompareSet(key(&mut c)?, value(&mut c)?, value(&mut c)?),
        QueryType::Get => Request::Get(key(&mut c)?),
        QueryType::Add => Request::Add(key(&mut c)?, c.i64()?),
        QueryType::Check => Request::Check(keys(&mut c)?),
        QueryType::Wait => Request::Wait(keys(&mut c)?),
        QueryType::GetNumKeys => Request::GetNumKeys,
        QueryType::DeleteKey => Request::DeleteKey(key(&mut c)?),
        QueryType::Append => Request::Append(key(&mut c)?, value(&mut c)?),
        QueryType::MultiGet => Request::MultiGet(keys(&mut c)?),
        QueryType::MultiSet => {
            let n = c.count(limits.max_key_count, "key")?;
            let pairs = (0..n)
                .map(|_| Ok((key(&mut c)?, value(&mut c)?)))
                .collect::<Result<_, ParseError>>()?;
            Request::MultiSet(pairs)
        }
        QueryType::CancelWait => Request::CancelWait,
        QueryType::Ping => Request::Ping(c.u32()?),
        QueryType::QueuePush => Request::QueuePush(key(&mut c)?, value(&mut c)?),
        QueryType::QueuePop => Request::QueuePop(key(&mut c)?),
        QueryType::QueueLen => Request::QueueLen(key(&mut c)?),
        QueryType::AuthHello => Request::AuthHello,
        QueryType::AuthProof => Request::AuthProof(c.bytes(64, "proof")?.to_vec()),
    };
    Ok((request, c.position()))
}

/// Builds a message (request or response) in the wire encoding.
#[derive(Default, Debug)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// Starts a request with its command byte.
    pub fn request(query: QueryType) -> Self {
        Writer {
            buf: vec![query as u8],
        }
    }

    /// Appends a `u8`.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// Appends a little-endian `u32`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian `i32`.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian `i64`.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends bytes as they are, without a length (a magic number, a handle).
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }

    /// Appends a length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
        self
    }

    /// The encoded bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// Consumes the writer, returning the encoded bytes.
    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }
}

/// Blocking reads of response fields from a stream.
pub trait ReadWire: Read {
    /// Reads a `u8`.
    fn read_u8(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    /// Reads a little-endian `u32`.
    fn read_u32(&mut self) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Reads a little-endian `i64`.
    fn read_i64(&mut self) -> io::Result<i64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(i64::from_le_bytes(b))
    }

    /// Reads a length-prefixed byte string of at most `max` bytes.
    fn read_bytes(&mut self, max: usize) -> io::Result<Vec<u8>> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        let n = u64::from_le_bytes(b);
        if n > max as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("server sent a value of {n} bytes, above the limit of {max}"),
            ));
        }
        // Grow with what arrives: a server that announces a huge value and sends
        // nothing must not make the client allocate it.
        let mut v = Vec::with_capacity((n as usize).min(64 << 10));
        self.take(n).read_to_end(&mut v)?;
        if v.len() as u64 != n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("server announced {n} bytes and sent {}", v.len()),
            ));
        }
        Ok(v)
    }
}

impl<R: Read + ?Sized> ReadWire for R {}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_key_len: 16,
        max_value_len: 64,
        max_key_count: 4,
    };

    #[test]
    fn every_prefix_of_a_request_is_incomplete() {
        let mut w = Writer::request(QueryType::CompareSet);
        w.bytes(b"key").bytes(b"old").bytes(b"new");
        let bytes = w.into_vec();
        for n in 0..bytes.len() {
            assert_eq!(
                parse_request(&bytes[..n], &LIMITS).unwrap_err(),
                ParseError::Incomplete
            );
        }
        let (req, used) = parse_request(&bytes, &LIMITS).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(
            req,
            Request::CompareSet(b"key".to_vec(), b"old".to_vec(), b"new".to_vec())
        );
    }

    #[test]
    fn known_bytes_decode() {
        // SET "/a" = [1, 2]: code 1, u64 len 2, "/a", u64 len 2, 1 2.
        let bytes = [
            1u8, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'a', 2, 0, 0, 0, 0, 0, 0, 0, 1, 2,
        ];
        let (req, used) = parse_request(&bytes, &LIMITS).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(req, Request::Set(b"/a".to_vec(), vec![1, 2]));
        let validate = [0u8, 0xCE, 0xF7, 0x85, 0x3C];
        assert_eq!(
            parse_request(&validate, &LIMITS).unwrap().0,
            Request::Validate(VALIDATION_MAGIC)
        );
    }

    #[test]
    fn oversized_lengths_are_rejected_before_the_data_arrives() {
        let mut w = Writer::request(QueryType::Set);
        w.u64(1 << 40);
        assert!(matches!(
            parse_request(w.as_slice(), &LIMITS),
            Err(ParseError::Malformed(m)) if m.contains("key")
        ));
        let mut w = Writer::request(QueryType::Wait);
        w.u64(5);
        assert!(matches!(
            parse_request(w.as_slice(), &LIMITS),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse_request(&[200], &LIMITS),
            Err(ParseError::Malformed(m)) if m.contains("200")
        ));
    }
}
