//! The TCP store server: one mio event-loop thread serving any number of clients.
//!
//! Each connection has an input buffer that accumulates whatever bytes arrive; complete
//! requests are cut off its front by [`wire::parse_request`], so requests split across
//! reads (or several in one read) are normal. A connection that sends anything that can
//! never be a valid request is closed, with a log line saying why; everyone else is
//! unaffected.
//!
//! Waiting clients are kept in a table `key → [(client, generation)]` with a count of keys
//! still missing per client. The generation makes stale entries (left by a cancelled wait
//! or a closed client) harmless without scanning the table, and tokens are never reused.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use super::auth::{self, StoreSecret};
use super::kv::KvState;
use super::wire::{self, Limits, ParseError, Request, Writer};
use crate::error::{Error, Result};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CLIENT: usize = 2;

/// Settings of a [`TcpStoreServer`].
#[derive(Clone, Copy, Debug)]
pub struct ServerOptions {
    /// Longest key accepted (default [`MAX_KEY_LEN`](super::MAX_KEY_LEN)).
    pub max_key_len: usize,
    /// Largest value accepted (default [`MAX_VALUE_LEN`](super::MAX_VALUE_LEN)).
    pub max_value_len: usize,
    /// Most keys per request (default [`MAX_KEY_COUNT`](super::MAX_KEY_COUNT)).
    pub max_key_count: usize,
    /// When set, every client must answer a challenge with it before any command (see
    /// [`super::auth`]); PyTorch's clients cannot. Default: none.
    pub secret: Option<StoreSecret>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_key_len: super::MAX_KEY_LEN,
            max_value_len: super::MAX_VALUE_LEN,
            max_key_count: super::MAX_KEY_COUNT,
            secret: None,
        }
    }
}

impl ServerOptions {
    /// Defaults with the secret of `FERROCCL_STORE_SECRET` / `_FILE`, if set.
    pub fn from_env() -> Result<Self> {
        Ok(ServerOptions {
            secret: StoreSecret::from_env()?,
            ..ServerOptions::default()
        })
    }
}

/// A running TCP store server. Dropping it stops the server and closes every connection.
#[derive(Debug)]
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving on a new thread.
    pub fn bind(addr: impl ToSocketAddrs, options: ServerOptions) -> Result<Self> {
        let std_listener =
            std::net::TcpListener::bind(addr).map_err(|e| Error::io("store server: bind", e))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("store server: set_nonblocking", e))?;
        let addr = std_listener
            .local_addr()
            .map_err(|e| Error::io("store server: local_addr", e))?;
        let mut listener = TcpListener::from_std(std_listener);
        let poll = Poll::new().map_err(|e| Error::io("store server: epoll", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("store server: register listener", e))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER).map_err(|e| Error::io("store server: waker", e))?,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let mut event_loop = EventLoop {
            poll,
            listener,
            stop: stop.clone(),
            limits: Limits {
                max_key_len: options.max_key_len,
                max_value_len: options.max_value_len,
                max_key_count: options.max_key_count,
            },
            secret: options.secret,
            conns: HashMap::new(),
            next_token: FIRST_CLIENT,
            kv: KvState::default(),
            waiting: HashMap::new(),
            awaited: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("ferroccl-store-{}", addr.port()))
            .spawn(move || {
                if let Err(e) = event_loop.run() {
                    tracing::error!("store server on {addr} stopped: {e}");
                }
            })
            .map_err(|e| Error::io("store server: spawn thread", e))?;
        tracing::debug!("store server listening on {addr}");
        Ok(TcpStoreServer {
            addr,
            stop,
            waker,
            thread: Some(thread),
        })
    }

    /// The address the server listens on (with the real port if 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the server thread is still running.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.waker.wake() {
            tracing::warn!("store server: could not wake event loop to stop it: {e}");
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One client connection.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    /// Bytes of `outbuf` already written.
    written: usize,
    validated: bool,
    /// Whether the client answered the challenge (or none is needed).
    authenticated: bool,
    /// The challenge sent to the client, once it asked.
    challenge: Option<[u8; auth::CHALLENGE_BYTES]>,
    /// Whether WRITABLE interest is registered.
    want_write: bool,
    /// Bumped by every WAIT, so entries of an earlier wait are recognisably stale.
    wait_generation: u64,
}

struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    limits: Limits,
    secret: Option<StoreSecret>,
    conns: HashMap<Token, Conn>,
    next_token: usize,
    kv: KvState,
    /// Key → clients waiting for it, with the generation of their wait.
    waiting: HashMap<Vec<u8>, Vec<(Token, u64)>>,
    /// Client → (generation, number of keys still missing) for clients in a WAIT.
    awaited: HashMap<Token, (u64, usize)>,
}

/// Why a connection is being closed.
enum Close {
    Eof,
    Io(io::Error),
    Protocol(String),
}

impl EventLoop {
    fn run(&mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(256);
        loop {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {
                        if self.stop.load(Ordering::SeqCst) {
                            return Ok(());
                        }
                    }
                    token => {
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.on_readable(token);
                        }
                        if event.is_writable() {
                            self.flush(token);
                        }
                    }
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    let token = Token(self.next_token);
                    self.next_token += 1;
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, token, Interest::READABLE)
                    {
                        tracing::warn!("store server: cannot register client {peer}: {e}");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.conns.insert(
                        token,
                        Conn {
                            stream,
                            peer,
                            inbuf: Vec::new(),
                            outbuf: Vec::new(),
                            written: 0,
                            validated: false,
                            authenticated: self.secret.is_none(),
                            challenge: None,
                            want_write: false,
                            wait_generation: 0,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Typically EMFILE: leave the backlog for the next readiness event.
                    tracing::warn!("store server: accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn on_readable(&mut self, token: Token) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        // mio is edge-triggered: drain the socket completely.
        let mut eof = false;
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match conn.stream.read(&mut chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => conn.inbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.close(token, Close::Io(e));
                    return;
                }
            }
        }
        if let Err(reason) = self.process_input(token) {
            self.close(token, reason);
            return;
        }
        if eof {
            let pending = self.conns.get(&token).map_or(0, |c| c.inbuf.len());
            let reason = if pending > 0 {
                Close::Protocol(format!(
                    "connection closed with a truncated request ({pending} bytes pending)"
                ))
            } else {
                Close::Eof
            };
            self.close(token, reason);
        }
    }

    /// Executes every complete request in the connection's input buffer.
    fn process_input(&mut self, token: Token) -> std::result::Result<(), Close> {
        loop {
            let conn = self.conns.get_mut(&token).ok_or(Close::Eof)?;
            let (request, used) = match wire::parse_request(&conn.inbuf, &self.limits) {
                Ok(parsed) => parsed,
                Err(ParseError::Incomplete) => return Ok(()),
                Err(ParseError::Malformed(why)) => return Err(Close::Protocol(why)),
            };
            conn.inbuf.drain(..used);
            if !conn.validated {
                match request {
                    Request::Validate(wire::VALIDATION_MAGIC) => {
                        conn.validated = true;
                        continue;
                    }
                    Request::Validate(magic) => {
                        return Err(Close::Protocol(format!(
                            "bad validation magic {magic:#x} (expected {:#x})",
                            wire::VALIDATION_MAGIC
                        )));
                    }
                    other => {
                        return Err(Close::Protocol(format!(
                            "first request must be VALIDATE, got {other:?}"
                        )));
                    }
                }
            }
            if !conn.authenticated {
                self.authenticate(token, request)?;
                self.flush(token);
                continue;
            }
            self.execute(token, request)?;
            self.flush(token);
        }
    }

    /// The challenge-response of a server with a secret: nothing but `AUTH_HELLO` and
    /// then a right `AUTH_PROOF` is accepted before it; anything else closes the
    /// connection, so a stranger never reads or changes a key.
    fn authenticate(&mut self, token: Token, request: Request) -> std::result::Result<(), Close> {
        let secret = self
            .secret
            .expect("only servers with a secret authenticate");
        let conn = self.conns.get_mut(&token).ok_or(Close::Eof)?;
        let mut reply = Writer::default();
        match (request, conn.challenge) {
            (Request::AuthHello, None) => {
                let c = auth::challenge();
                conn.challenge = Some(c);
                reply.bytes(&c);
            }
            (Request::AuthProof(proof), Some(c)) if secret.verify(&c, &proof) => {
                conn.authenticated = true;
                reply.u8(1);
            }
            (Request::AuthProof(_), Some(_)) => {
                return Err(Close::Protocol(
                    "authentication failed: wrong store secret (FERROCCL_STORE_SECRET)".into(),
                ));
            }
            (other, _) => {
                return Err(Close::Protocol(format!(
                    "authentication required (the server has FERROCCL_STORE_SECRET), got \
                     {other:?}"
                )));
            }
        }
        self.queue_output(token, reply.as_slice());
        Ok(())
    }

    fn execute(&mut self, token: Token, request: Request) -> std::result::Result<(), Close> {
        let mut reply = Writer::default();
        match request {
            Request::Validate(_) => {
                return Err(Close::Protocol("VALIDATE sent twice".into()));
            }
            Request::Set(key, value) => {
                self.kv.set(&key, value);
                self.wake_all(&key);
            }
            Request::CompareSet(key, expected, desired) => {
                let value = self.kv.compare_set(&key, &expected, desired);
                reply.bytes(&value);
                self.wake_all(&key);
            }
            Request::Get(key) => {
                reply.bytes(self.kv.get(&key).unwrap_or_default());
            }
            Request::Add(key, delta) => {
                let new = self.kv.add(&key, delta).map_err(|e| {
                    Close::Protocol(format!("ADD on {:?}: {e}", String::from_utf8_lossy(&key)))
                })?;
                reply.i64(new);
                self.wake_all(&key);
            }
            Request::Check(keys) => {
                let ready = keys.iter().all(|k| self.kv.is_ready(k));
                reply.u8(if ready {
                    wire::CHECK_READY
                } else {
                    wire::CHECK_NOT_READY
                });
            }
            Request::Wait(keys) => {
                let conn = self.conns.get_mut(&token).ok_or(Close::Eof)?;
                conn.wait_generation += 1;
                let generation = conn.wait_generation;
                let missing: Vec<Vec<u8>> =
                    keys.into_iter().filter(|k| !self.kv.is_ready(k)).collect();
                if missing.is_empty() {
                    reply.u8(wire::WAIT_STOP_WAITING);
                } else {
                    self.awaited.insert(token, (generation, missing.len()));
                    for key in missing {
                        self.waiting
                            .entry(key)
                            .or_default()
                            .push((token, generation));
                    }
                }
            }
            Request::GetNumKeys => {
                reply.i64(self.kv.num_keys() as i64);
            }
            Request::DeleteKey(key) => {
                reply.i64(i64::from(self.kv.delete(&key)));
            }
            Request::Append(key, value) => {
                self.kv.append(&key, &value);
                self.wake_all(&key);
            }
            Request::MultiGet(keys) => {
                for key in keys {
                    reply.bytes(self.kv.get(&key).unwrap_or_default());
                }
            }
            Request::MultiSet(pairs) => {
                for (key, value) in pairs {
                    self.kv.set(&key, value);
                    self.wake_all(&key);
                }
            }
            Request::CancelWait => {
                // Entries left in `waiting` carry the old generation and are skipped.
                self.awaited.remove(&token);
                reply.u8(wire::WAIT_CANCELED);
            }
            Request::Ping(nonce) => {
                reply.u32(nonce);
            }
            Request::QueuePush(key, value) => {
                self.kv.queue_push(&key, value);
                self.wake_one(&key);
            }
            Request::QueuePop(key) => {
                let len = self.kv.queue_len(&key);
                reply.i64(len as i64);
                if let Some(value) = self.kv.queue_pop(&key) {
                    reply.bytes(&value);
                }
            }
            Request::QueueLen(key) => {
                reply.i64(self.kv.queue_len(&key) as i64);
            }
            // No secret, or already authenticated: an empty challenge, nothing to prove.
            Request::AuthHello => {
                reply.bytes(&[]);
            }
            Request::AuthProof(_) => {
                return Err(Close::Protocol("AUTH_PROOF without a challenge".into()));
            }
        }
        self.queue_output(token, reply.as_slice());
        Ok(())
    }

    /// Counts `key` as arrived for one waiter entry; true if that waiter is now complete.
    fn satisfy(&mut self, token: Token, generation: u64) -> bool {
        let Some(entry) = self.awaited.get_mut(&token) else {
            return false;
        };
        if entry.0 != generation {
            return false;
        }
        entry.1 -= 1;
        if entry.1 > 0 {
            return false;
        }
        self.awaited.remove(&token);
        self.queue_output(token, &[wire::WAIT_STOP_WAITING]);
        self.flush(token);
        true
    }

    /// A key was set: every client waiting on it counts it as arrived.
    fn wake_all(&mut self, key: &[u8]) {
        if !self.kv.is_ready(key) {
            return;
        }
        if let Some(list) = self.waiting.remove(key) {
            for (token, generation) in list {
                self.satisfy(token, generation);
            }
        }
    }

    /// A queue item was pushed: wake waiters in order until one completes, so that one
    /// item releases one blocked pop (PyTorch's `wakeupOneWaitingClient`).
    fn wake_one(&mut self, key: &[u8]) {
        let Some(mut list) = self.waiting.remove(key) else {
            return;
        };
        let mut released = 0;
        for (i, &(token, generation)) in list.iter().enumerate() {
            released = i + 1;
            if self.satisfy(token, generation) {
                break;
            }
        }
        list.drain(..released);
        if !list.is_empty() {
            self.waiting.insert(key.to_vec(), list);
        }
    }

    fn queue_output(&mut self, token: Token, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Some(conn) = self.conns.get_mut(&token) {
            conn.outbuf.extend_from_slice(bytes);
        }
    }

    /// Writes as much pending output as the socket takes; registers for writability if
    /// some is left.
    fn flush(&mut self, token: Token) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        while conn.written < conn.outbuf.len() {
            match conn.stream.write(&conn.outbuf[conn.written..]) {
                Ok(0) => {
                    self.close(token, Close::Eof);
                    return;
                }
                Ok(n) => conn.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.close(token, Close::Io(e));
                    return;
                }
            }
        }
        if conn.written == conn.outbuf.len() {
            conn.outbuf.clear();
            conn.written = 0;
        }
        let want_write = !conn.outbuf.is_empty();
        if want_write != conn.want_write {
            let interest = if want_write {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            if let Err(e) = self
                .poll
                .registry()
                .reregister(&mut conn.stream, token, interest)
            {
                self.close(token, Close::Io(e));
                return;
            }
            conn.want_write = want_write;
        }
    }

    fn close(&mut self, token: Token, reason: Close) {
        let Some(mut conn) = self.conns.remove(&token) else {
            return;
        };
        self.awaited.remove(&token);
        let _ = self.poll.registry().deregister(&mut conn.stream);
        match reason {
            Close::Eof => tracing::trace!("store server: client {} disconnected", conn.peer),
            Close::Io(e) => tracing::debug!("store server: client {}: {e}; closed", conn.peer),
            Close::Protocol(why) => {
                tracing::warn!("store server: closing client {}: {why}", conn.peer)
            }
        }
    }
}
