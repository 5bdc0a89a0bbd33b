//! The TCP store client, speaking PyTorch's TCPStore protocol.
//!
//! Like PyTorch's client it prefixes every user key with `/` on the wire, so a ferroccl
//! client and a `torch.distributed.TCPStore` client see the same keys on either server.
//! On connect it sends VALIDATE and a PING (PyTorch ≥ 2.5 does the same), retrying with
//! jittered exponential backoff until the connect deadline.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::Rng;

use super::auth::StoreSecret;
use super::tcp_server::{ServerOptions, TcpStoreServer};
use super::wire::{self, QueryType, ReadWire, Writer};
use super::{MAX_KEY_LEN, Store, check_multi_set, check_value};
use crate::error::{Error, Result};

/// The prefix PyTorch's TCPStore client puts before every user key.
const KEY_PREFIX: &str = "/";

/// Largest response value the client will allocate for (the server may grow values past
/// the request limit through APPEND; this only guards against a garbage length).
const MAX_RESPONSE_VALUE: usize = 1 << 30;

/// Settings of a [`TcpStore`] client.
#[derive(Clone, Copy, Debug)]
pub struct TcpStoreOptions {
    /// Timeout of `get`/`multi_get` waits and of every reply from the server.
    pub timeout: Duration,
    /// How long to keep retrying the initial connection.
    pub connect_timeout: Duration,
    /// The secret to answer a server's challenge with (see [`super::auth`]); `None`
    /// connects only to servers without one.
    pub secret: Option<StoreSecret>,
}

impl Default for TcpStoreOptions {
    fn default() -> Self {
        TcpStoreOptions {
            timeout: super::DEFAULT_TIMEOUT,
            connect_timeout: super::DEFAULT_TIMEOUT,
            secret: None,
        }
    }
}

/// A client of a TCP store server (ferroccl's [`TcpStoreServer`] or PyTorch's).
///
/// One connection, used by one request at a time; share it across threads freely
/// (requests are serialised) or open more clients for parallelism.
pub struct TcpStore {
    addr: String,
    conn: Mutex<Connection>,
    timeout: Mutex<Duration>,
    /// The server, when this client started it (keeps it alive as long as the client).
    server: Option<Arc<TcpStoreServer>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("hosts_server", &self.server.is_some())
            .finish_non_exhaustive()
    }
}

struct Connection {
    stream: TcpStream,
    /// Set after an I/O failure mid-request: the byte stream may be out of step with the
    /// requests, so the connection must not be used again.
    broken: Option<String>,
}

impl TcpStore {
    /// Connects to the server at `addr` (`"host:port"`), retrying until
    /// `options.connect_timeout`.
    pub fn connect(addr: &str, options: TcpStoreOptions) -> Result<Self> {
        let stream = connect_with_retry(addr, options)?;
        Ok(TcpStore {
            addr: addr.to_string(),
            conn: Mutex::new(Connection {
                stream,
                broken: None,
            }),
            timeout: Mutex::new(options.timeout),
            server: None,
        })
    }

    /// Starts a server on `bind_addr` in this process and connects to it (PyTorch's
    /// `TCPStore(is_master=True)`). Port 0 picks a free port; see [`TcpStore::server_addr`].
    pub fn host(
        bind_addr: impl ToSocketAddrs,
        server_options: ServerOptions,
        options: TcpStoreOptions,
    ) -> Result<Self> {
        let server = Arc::new(TcpStoreServer::bind(bind_addr, server_options)?);
        let mut local = server.local_addr();
        if local.ip().is_unspecified() {
            local.set_ip(match local {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let mut store = Self::connect(&local.to_string(), options)?;
        store.server = Some(server);
        Ok(store)
    }

    /// The address this client connects to.
    pub fn server_addr(&self) -> &str {
        &self.addr
    }

    /// The server hosted by this client, if it was created with [`TcpStore::host`].
    pub fn hosted_server(&self) -> Option<&Arc<TcpStoreServer>> {
        self.server.as_ref()
    }

    /// Checks that the server answers, echoing a nonce.
    pub fn ping(&self) -> Result<()> {
        let nonce: u32 = rand::rng().random();
        let mut msg = Writer::request(QueryType::Ping);
        msg.u32(nonce);
        let echoed = self.request("ping", msg.as_slice(), |s| s.read_u32())?;
        if echoed != nonce {
            return Err(Error::StoreProtocol {
                detail: format!("ping nonce {nonce:#x} came back as {echoed:#x}"),
            });
        }
        Ok(())
    }

    /// Pushes `value` onto the queue `key` (PyTorch ≥ 2.8 servers and ferroccl's).
    pub fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let mut msg = Writer::request(QueryType::QueuePush);
        msg.bytes(wire_key(key).as_bytes()).bytes(value);
        self.request("queue_push", msg.as_slice(), |_| Ok(()))
    }

    /// Pops the front of queue `key`; with `block`, first waits (up to the store timeout)
    /// for it to be non-empty. `Ok(None)` when it is empty.
    pub fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        if block {
            self.wait_op("queue_pop", &[key], self.timeout())?;
        }
        let mut msg = Writer::request(QueryType::QueuePop);
        msg.bytes(wire_key(key).as_bytes());
        self.request("queue_pop", msg.as_slice(), |s| {
            if s.read_i64()? > 0 {
                s.read_bytes(MAX_RESPONSE_VALUE).map(Some)
            } else {
                Ok(None)
            }
        })
    }

    /// Length of queue `key`.
    pub fn queue_len(&self, key: &str) -> Result<usize> {
        check_key(key)?;
        let mut msg = Writer::request(QueryType::QueueLen);
        msg.bytes(wire_key(key).as_bytes());
        let n = self.request("queue_len", msg.as_slice(), |s| s.read_i64())?;
        Ok(n.max(0) as usize)
    }

    /// Whether a fresh connection to the server succeeds (within a second).
    fn server_answers(&self) -> bool {
        self.addr.to_socket_addrs().is_ok_and(|mut addrs| {
            addrs.any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
        })
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        crate::lock(&self.conn)
    }

    fn broken_error(&self, op: &'static str, why: &str) -> Error {
        Error::StoreConnection {
            addr: self.addr.clone(),
            op,
            source: io::Error::new(
                io::ErrorKind::NotConnected,
                format!("connection unusable after an earlier failure: {why}"),
            ),
        }
    }

    fn conn_error(&self, op: &'static str, e: io::Error) -> Error {
        let e = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no reply within {:?}", self.timeout()),
            ),
            io::ErrorKind::UnexpectedEof => {
                io::Error::new(io::ErrorKind::UnexpectedEof, "server closed the connection")
            }
            _ => e,
        };
        Error::StoreConnection {
            addr: self.addr.clone(),
            op,
            source: e,
        }
    }

    /// Sends one request and reads its reply with `read`, under the store timeout.
    fn request<T>(
        &self,
        op: &'static str,
        msg: &[u8],
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let timeout = self.timeout();
        let mut conn = self.lock();
        if let Some(why) = &conn.broken {
            return Err(self.broken_error(op, why));
        }
        let result = (|| {
            conn.stream.set_read_timeout(Some(nonzero(timeout)))?;
            conn.stream.write_all(msg)?;
            read(&mut conn.stream)
        })();
        result.map_err(|e| {
            let err = self.conn_error(op, e);
            conn.broken = Some(err.to_string());
            err
        })
    }

    /// WAIT for `keys` (already prefixed) with CANCEL_WAIT on timeout, as PyTorch does.
    fn wait_op(&self, op: &'static str, keys: &[&str], timeout: Duration) -> Result<()> {
        check_keys(keys)?;
        let mut msg = Writer::request(QueryType::Wait);
        msg.u64(keys.len() as u64);
        for key in keys {
            msg.bytes(wire_key(key).as_bytes());
        }
        let start = Instant::now();
        let reply_timeout = self.timeout();
        let mut conn = self.lock();
        if let Some(why) = &conn.broken {
            return Err(self.broken_error(op, why));
        }
        let outcome: io::Result<bool> = (|| {
            conn.stream.set_read_timeout(Some(nonzero(timeout)))?;
            conn.stream.write_all(msg.as_slice())?;
            match conn.stream.read_u8() {
                Ok(wire::WAIT_STOP_WAITING) => return Ok(true),
                Ok(other) => return Err(unexpected("WAIT", other)),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
            // Timed out: cancel, then drain a STOP_WAITING that may have crossed it.
            conn.stream.set_read_timeout(Some(nonzero(reply_timeout)))?;
            conn.stream
                .write_all(Writer::request(QueryType::CancelWait).as_slice())?;
            match conn.stream.read_u8()? {
                wire::WAIT_CANCELED => Ok(false),
                wire::WAIT_STOP_WAITING => match conn.stream.read_u8()? {
                    wire::WAIT_CANCELED => Ok(true),
                    other => Err(unexpected("CANCEL_WAIT", other)),
                },
                other => Err(unexpected("CANCEL_WAIT", other)),
            }
        })();
        drop(conn);
        match outcome {
            Ok(true) => Ok(()),
            Ok(false) => {
                let waited = start.elapsed();
                let mut missing = Vec::new();
                for key in keys {
                    if !self.check(&[key])? {
                        missing.push(key.to_string());
                    }
                }
                Err(Error::StoreTimeout {
                    op,
                    waited,
                    missing,
                })
            }
            Err(e) => {
                let err = self.conn_error(op, e);
                self.lock().broken = Some(err.to_string());
                Err(err)
            }
        }
    }
}

/// Checks a user key so that, with the `/` prefix, it fits the server's key limit.
fn check_key(key: &str) -> Result<()> {
    let max = MAX_KEY_LEN - KEY_PREFIX.len();
    if key.len() > max {
        return Err(Error::KeyTooLong {
            len: key.len(),
            max,
        });
    }
    Ok(())
}

fn check_keys(keys: &[&str]) -> Result<()> {
    super::check_keys(keys)?;
    keys.iter().try_for_each(|k| check_key(k))
}

fn wire_key(key: &str) -> String {
    format!("{KEY_PREFIX}{key}")
}

fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

fn unexpected(what: &str, byte: u8) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("unexpected reply byte {byte} to {what}"),
    )
}

/// Connects, validates and pings, retrying with jittered exponential backoff.
fn connect_with_retry(addr: &str, options: TcpStoreOptions) -> Result<TcpStream> {
    let start = Instant::now();
    let deadline = start + options.connect_timeout;
    let mut backoff = Duration::from_millis(10);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let last_error = match try_connect(addr, deadline, options.timeout, options.secret) {
            Ok(stream) => {
                if attempt > 1 {
                    tracing::debug!("store client: connected to {addr} after {attempt} attempts");
                }
                return Ok(stream);
            }
            Err(e) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::StoreConnect {
                addr: addr.to_string(),
                waited: now - start,
                source: last_error,
            });
        }
        tracing::trace!("store client: connect to {addr} failed ({last_error}); retrying");
        let jitter = rand::rng().random_range(0.5..1.5);
        let sleep = backoff.mul_f64(jitter).min(deadline - now);
        std::thread::sleep(sleep);
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

fn try_connect(
    addr: &str,
    deadline: Instant,
    reply_timeout: Duration,
    secret: Option<StoreSecret>,
) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
    for sockaddr in addr.to_socket_addrs()? {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let per_try = nonzero(remaining.min(Duration::from_secs(5)));
        match TcpStream::connect_timeout(&sockaddr, per_try) {
            Ok(mut stream) => {
                stream.set_nodelay(true)?;
                let mut hello = Writer::request(QueryType::Validate);
                hello.u32(wire::VALIDATION_MAGIC);
                stream.set_read_timeout(Some(nonzero(reply_timeout.min(remaining))))?;
                if let Some(secret) = secret {
                    hello.u8(QueryType::AuthHello as u8);
                    stream.write_all(hello.as_slice())?;
                    authenticate(&mut stream, &secret)?;
                    hello = Writer::default();
                }
                let nonce = std::process::id();
                hello.u8(QueryType::Ping as u8).u32(nonce);
                stream.write_all(hello.as_slice())?;
                let echoed = stream.read_u32().map_err(|e| {
                    if secret.is_none() && e.kind() == io::ErrorKind::UnexpectedEof {
                        io::Error::new(
                            e.kind(),
                            "the server closed the connection (does it require a secret? set \
                             FERROCCL_STORE_SECRET)",
                        )
                    } else {
                        e
                    }
                })?;
                if echoed != nonce {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("ping nonce {nonce} came back as {echoed}"),
                    ));
                }
                return Ok(stream);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Answers the challenge the server sent after `AUTH_HELLO` (an empty one: the server has
/// no secret).
fn authenticate(stream: &mut TcpStream, secret: &StoreSecret) -> io::Result<()> {
    let len = stream.read_i64()? as u64;
    if len == 0 {
        return Ok(());
    }
    if len != super::auth::CHALLENGE_BYTES as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("authentication challenge of {len} bytes"),
        ));
    }
    let mut challenge = [0u8; super::auth::CHALLENGE_BYTES];
    stream.read_exact(&mut challenge)?;
    let mut proof = Writer::request(QueryType::AuthProof);
    proof.bytes(&secret.proof(&challenge));
    stream.write_all(proof.as_slice())?;
    match stream.read_u8() {
        Ok(1) => Ok(()),
        Ok(b) => Err(unexpected("AUTH_PROOF", b)),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the store server refused this secret (FERROCCL_STORE_SECRET differs)",
        )),
        Err(e) => Err(e),
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let mut msg = Writer::request(QueryType::Set);
        msg.bytes(wire_key(key).as_bytes()).bytes(value);
        self.request("set", msg.as_slice(), |_| Ok(()))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key)?;
        self.wait_op("get", &[key], self.timeout())?;
        let mut msg = Writer::request(QueryType::Get);
        msg.bytes(wire_key(key).as_bytes());
        self.request("get", msg.as_slice(), |s| s.read_bytes(MAX_RESPONSE_VALUE))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let mut msg = Writer::request(QueryType::Add);
        msg.bytes(wire_key(key).as_bytes()).i64(delta);
        self.request("add", msg.as_slice(), |s| s.read_i64())
            .map_err(|e| match e {
                // The server closes the connection when the value is not a counter; a
                // server that died closes it too, and then refuses new connections.
                Error::StoreConnection { source, .. }
                    if source.kind() == io::ErrorKind::UnexpectedEof && self.server_answers() =>
                {
                    Error::StoreValue {
                        key: key.to_string(),
                        detail: "server refused the add (value is not a decimal counter?) \
                                 and closed the connection"
                            .into(),
                    }
                }
                other => other,
            })
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        check_key(key)?;
        check_value(expected)?;
        check_value(desired)?;
        let mut msg = Writer::request(QueryType::CompareSet);
        msg.bytes(wire_key(key).as_bytes())
            .bytes(expected)
            .bytes(desired);
        self.request("compare_set", msg.as_slice(), |s| {
            s.read_bytes(MAX_RESPONSE_VALUE)
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        check_keys(keys)?;
        let mut msg = Writer::request(QueryType::Check);
        msg.u64(keys.len() as u64);
        for key in keys {
            msg.bytes(wire_key(key).as_bytes());
        }
        match self.request("check", msg.as_slice(), |s| s.read_u8())? {
            wire::CHECK_READY => Ok(true),
            wire::CHECK_NOT_READY => Ok(false),
            other => Err(Error::StoreProtocol {
                detail: format!("unexpected reply byte {other} to CHECK"),
            }),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_op("wait", keys, timeout)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        let mut msg = Writer::request(QueryType::DeleteKey);
        msg.bytes(wire_key(key).as_bytes());
        Ok(self.request("delete", msg.as_slice(), |s| s.read_i64())? > 0)
    }

    fn num_keys(&self) -> Result<usize> {
        let msg = Writer::request(QueryType::GetNumKeys);
        let n = self.request("num_keys", msg.as_slice(), |s| s.read_i64())?;
        Ok(n.max(0) as usize)
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        check_keys(keys)?;
        self.wait_op("multi_get", keys, self.timeout())?;
        let mut msg = Writer::request(QueryType::MultiGet);
        msg.u64(keys.len() as u64);
        for key in keys {
            msg.bytes(wire_key(key).as_bytes());
        }
        self.request("multi_get", msg.as_slice(), |s| {
            (0..keys.len())
                .map(|_| s.read_bytes(MAX_RESPONSE_VALUE))
                .collect()
        })
    }

    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        check_multi_set(keys, values)?;
        let mut msg = Writer::request(QueryType::MultiSet);
        msg.u64(keys.len() as u64);
        for (key, value) in keys.iter().zip(values) {
            msg.bytes(wire_key(key).as_bytes()).bytes(value);
        }
        self.request("multi_set", msg.as_slice(), |_| Ok(()))
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let mut msg = Writer::request(QueryType::Append);
        msg.bytes(wire_key(key).as_bytes()).bytes(value);
        self.request("append", msg.as_slice(), |_| Ok(()))
    }

    fn timeout(&self) -> Duration {
        *crate::lock(&self.timeout)
    }

    fn set_timeout(&self, timeout: Duration) {
        *crate::lock(&self.timeout) = timeout;
    }
}
