//! The TCP store server under misbehaving and numerous clients, and clients under a dying
//! server.
//!
//! Misbehaving clients are raw `std::net::TcpStream`s speaking the wire format of
//! `src/store/wire.rs` by hand: a 1-byte command, little-endian integers, strings as a
//! `u64` length and the bytes; the first request must be VALIDATE (byte 0 and the `u32`
//! magic `0x3C85F7CE`). `TcpStore` clients prefix user keys with `/` on the wire.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use ferroccl::Error;
use ferroccl::store::{ServerOptions, Store, TcpStore, TcpStoreOptions, TcpStoreServer};

/// Store timeout of well-behaved clients: a lost reply fails the test instead of hanging.
const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a raw client waits for the server to close its connection.
const CLOSE_WITHIN: Duration = Duration::from_secs(2);

// Command bytes (PyTorch's `QueryType`) and reply bytes.
const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const WAIT: u8 = 6;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;
const WAIT_STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

// ---------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------

fn options(timeout: Duration) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout,
        connect_timeout: STORE_TIMEOUT,
        ..Default::default()
    }
}

fn server() -> (TcpStoreServer, String) {
    let server = TcpStoreServer::bind("127.0.0.1:0", ServerOptions::default()).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn client(addr: &str) -> TcpStore {
    TcpStore::connect(addr, options(STORE_TIMEOUT)).unwrap()
}

fn raw(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(STORE_TIMEOUT)).unwrap();
    s
}

/// Encodes requests by hand, independently of the crate's own encoder.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn cmd(mut self, c: u8) -> Self {
        self.0.push(c);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut m = self.u64(b.len() as u64);
        m.0.extend_from_slice(b);
        m
    }
    fn validate(self) -> Self {
        self.cmd(VALIDATE).u32(MAGIC)
    }
    fn set(self, key: &[u8], value: &[u8]) -> Self {
        self.cmd(SET).bytes(key).bytes(value)
    }
    fn get(self, key: &[u8]) -> Self {
        self.cmd(GET).bytes(key)
    }
    fn add(self, key: &[u8], delta: i64) -> Self {
        self.cmd(ADD).bytes(key).i64(delta)
    }
    fn wait(self, keys: &[&[u8]]) -> Self {
        keys.iter()
            .fold(self.cmd(WAIT).u64(keys.len() as u64), |m, k| m.bytes(k))
    }
    fn ping(self, nonce: u32) -> Self {
        self.cmd(PING).u32(nonce)
    }
}

fn read_u8(s: &mut TcpStream) -> u8 {
    let mut b = [0u8; 1];
    s.read_exact(&mut b).unwrap();
    b[0]
}

fn read_u32(s: &mut TcpStream) -> u32 {
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    u32::from_le_bytes(b)
}

fn read_i64(s: &mut TcpStream) -> i64 {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).unwrap();
    i64::from_le_bytes(b)
}

fn read_value(s: &mut TcpStream) -> Vec<u8> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).unwrap();
    let n = u64::from_le_bytes(b);
    assert!(n < 1 << 20, "implausible value length {n}");
    let mut v = vec![0u8; n as usize];
    s.read_exact(&mut v).unwrap();
    v
}

/// Asserts that nothing arrives on `s` for a short while (no stray reply bytes).
fn assert_silent(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) => {}
        Ok(0) => panic!("server closed a connection that did nothing wrong"),
        Ok(n) => panic!("unexpected bytes from server: {:?}", &b[..n]),
        Err(e) => panic!("read failed: {e}"),
    }
    s.set_read_timeout(Some(STORE_TIMEOUT)).unwrap();
}

/// Asserts that the server closes `s` (EOF or reset) within [`CLOSE_WITHIN`], sending
/// nothing first.
fn assert_closed_by_server(s: &mut TcpStream) {
    s.set_read_timeout(Some(CLOSE_WITHIN)).unwrap();
    let start = Instant::now();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
            ) => {}
        Ok(n) => panic!("server answered garbage with {:?}", &b[..n]),
        Err(e) => panic!(
            "server did not close the connection within {CLOSE_WITHIN:?} ({:?}): {e}",
            start.elapsed()
        ),
    }
}

/// Sends `garbage` on a raw connection and checks that only that connection is closed:
/// clients connected before and after keep working and see each other's writes.
fn assert_garbage_isolated(garbage: &[u8]) {
    let (server, addr) = server();
    let before = client(&addr);
    before.set("before", b"1").unwrap();

    let mut bad = raw(&addr);
    bad.write_all(garbage).unwrap();
    assert_closed_by_server(&mut bad);

    let after = client(&addr);
    after.set("after", b"2").unwrap();
    assert_eq!(before.get("after").unwrap(), b"2");
    assert_eq!(after.get("before").unwrap(), b"1");
    assert_eq!(before.add("n", 1).unwrap(), 1);
    assert_eq!(after.add("n", 1).unwrap(), 2);
    before.ping().unwrap();
    assert!(server.is_running());
}

// ---------------------------------------------------------------------------------------
// Garbage.
// ---------------------------------------------------------------------------------------

#[test]
fn unknown_command_byte_closes_only_that_connection() {
    // After a valid handshake.
    assert_garbage_isolated(&Msg::default().validate().cmd(200).0);
    // As the very first byte.
    assert_garbage_isolated(&[0xFF, 1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn first_request_not_validate_closes_only_that_connection() {
    // A complete, well-formed GET before any VALIDATE.
    assert_garbage_isolated(&Msg::default().get(b"/before").0);
    // VALIDATE with the wrong magic.
    assert_garbage_isolated(&Msg::default().cmd(VALIDATE).u32(0xDEAD_BEEF).0);
    // VALIDATE twice.
    assert_garbage_isolated(&Msg::default().validate().validate().0);
}

#[test]
fn huge_lengths_are_rejected_without_waiting_for_the_data() {
    let huge = 1u64 << 40;
    // Key length 2^40: only the header is sent; the server must not wait for the rest.
    assert_garbage_isolated(&Msg::default().validate().cmd(SET).u64(huge).0);
    // Value length 2^40 after a valid key.
    assert_garbage_isolated(&Msg::default().validate().cmd(SET).bytes(b"/k").u64(huge).0);
    // Key count 2^40.
    assert_garbage_isolated(&Msg::default().validate().cmd(WAIT).u64(huge).0);
}

#[test]
fn truncated_request_then_close_leaves_server_serving() {
    let (server, addr) = server();
    let before = client(&addr);
    before.set("before", b"1").unwrap();

    let mut bad = raw(&addr);
    // A SET whose value claims 100 bytes, of which only 50 are sent.
    let mut msg = Msg::default()
        .validate()
        .cmd(SET)
        .bytes(b"/torn")
        .u64(100)
        .0;
    msg.extend_from_slice(&[b'x'; 50]);
    bad.write_all(&msg).unwrap();
    bad.shutdown(std::net::Shutdown::Write).unwrap();
    // The server sees EOF with a partial request pending and closes its side.
    assert_closed_by_server(&mut bad);
    drop(bad);

    assert!(
        !before.check(&["torn"]).unwrap(),
        "half a SET must not apply"
    );
    let after = client(&addr);
    after.set("after", b"2").unwrap();
    assert_eq!(before.get("after").unwrap(), b"2");
    assert_eq!(after.get("before").unwrap(), b"1");
    assert!(server.is_running());
}

#[test]
fn request_split_byte_by_byte_is_served() {
    let (_server, addr) = server();
    let mut slow = raw(&addr);
    let value = b"hello, split world";
    let msg = Msg::default()
        .validate()
        .set(b"/split", value)
        .get(b"/split")
        .0;
    for byte in &msg {
        slow.write_all(std::slice::from_ref(byte)).unwrap();
        // Small sleeps so that bytes arrive in separate segments and reads.
        thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(read_value(&mut slow), value);
    assert_silent(&mut slow);
    assert_eq!(client(&addr).get("split").unwrap(), value);
}

#[test]
fn pipelined_requests_in_one_write_are_answered_in_order() {
    let (_server, addr) = server();
    let mut fast = raw(&addr);
    let msg = Msg::default()
        .validate()
        .set(b"/p", b"one")
        .get(b"/p")
        .add(b"/c", 5)
        .ping(0x1234_5678)
        .add(b"/c", -2)
        .get(b"/c")
        .0;
    fast.write_all(&msg).unwrap();
    assert_eq!(read_value(&mut fast), b"one");
    assert_eq!(read_i64(&mut fast), 5);
    assert_eq!(read_u32(&mut fast), 0x1234_5678);
    assert_eq!(read_i64(&mut fast), 3);
    assert_eq!(read_value(&mut fast), b"3");
    assert_silent(&mut fast);
}

// ---------------------------------------------------------------------------------------
// Many clients.
// ---------------------------------------------------------------------------------------

#[test]
fn two_hundred_concurrent_clients() {
    const CLIENTS: usize = 200;
    let (_server, addr) = server();
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let start = Instant::now();
    let results: Vec<Result<i64, String>> = thread::scope(|s| {
        let joins: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let barrier = barrier.clone();
                let addr = addr.as_str();
                thread::Builder::new()
                    .stack_size(256 * 1024)
                    .spawn_scoped(s, move || {
                        // Connect concurrently, then act concurrently. A failed connect
                        // still reaches the barrier so the others are not stranded.
                        let connected = TcpStore::connect(addr, options(STORE_TIMEOUT));
                        barrier.wait();
                        let c = connected.map_err(|e| format!("client {i}: connect: {e}"))?;
                        let key = format!("client-{i}");
                        let value = format!("value of {i}");
                        c.set(&key, value.as_bytes())
                            .map_err(|e| format!("client {i}: set: {e}"))?;
                        let n = c
                            .add("counter", 1)
                            .map_err(|e| format!("client {i}: add: {e}"))?;
                        let got = c.get(&key).map_err(|e| format!("client {i}: get: {e}"))?;
                        if got != value.as_bytes() {
                            return Err(format!("client {i}: got {got:?}"));
                        }
                        Ok(n)
                    })
                    .unwrap()
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    eprintln!("{CLIENTS} concurrent clients took {:?}", start.elapsed());
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        errors.is_empty(),
        "{} clients failed: {errors:?}",
        errors.len()
    );
    // Every add returned a distinct value: together exactly 1..=200.
    let mut counts: Vec<i64> = results.into_iter().map(Result::unwrap).collect();
    counts.sort_unstable();
    assert_eq!(counts, (1..=CLIENTS as i64).collect::<Vec<_>>());
    let check = client(&addr);
    assert_eq!(
        check.get("counter").unwrap(),
        CLIENTS.to_string().as_bytes()
    );
    assert_eq!(check.num_keys().unwrap(), CLIENTS + 1);
    assert_eq!(check.get("client-123").unwrap(), b"value of 123");
}

// ---------------------------------------------------------------------------------------
// A dying server.
// ---------------------------------------------------------------------------------------

/// Long enough that a client noticing only by timeout fails the promptness checks.
const LONG_TIMEOUT: Duration = Duration::from_secs(10);
const PROMPT: Duration = Duration::from_secs(2);

fn assert_connection_error<T: std::fmt::Debug>(result: Result<T, Error>, what: &str) {
    match result {
        Err(Error::StoreConnection { .. }) => {}
        other => panic!("{what}: expected StoreConnection, got {other:?}"),
    }
}

/// Blocks `blocked` in a `get` of a missing key on another thread, runs `kill` (on a
/// thread of its own, so a hanging server shutdown fails the test instead of hanging it),
/// and checks the get fails promptly with `StoreConnection`; returns the client for
/// further checks.
fn get_blocked_across(blocked: TcpStore, kill: impl FnOnce() + Send + 'static) -> TcpStore {
    let (started_tx, started_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    thread::spawn(move || {
        started_tx.send(()).unwrap();
        let start = Instant::now();
        let result = blocked.get("never-set");
        let _ = done_tx.send((result, start.elapsed(), blocked));
    });
    started_rx.recv().unwrap();
    // Lets the GET's WAIT reach the server and block there; the checks below hold even
    // if the server dies first.
    thread::sleep(Duration::from_millis(100));
    let killed_at = Instant::now();
    let (killed_tx, killed_rx) = mpsc::channel();
    thread::spawn(move || {
        kill();
        let _ = killed_tx.send(());
    });
    killed_rx
        .recv_timeout(PROMPT)
        .expect("dropping the server did not return promptly");
    let (result, elapsed, blocked) = done_rx
        .recv_timeout(PROMPT)
        .expect("get blocked on a dead server did not return promptly");
    let since_kill = killed_at.elapsed();
    match result {
        Err(Error::StoreConnection { op, .. }) => assert_eq!(op, "get"),
        other => panic!("get across a server death: expected StoreConnection, got {other:?}"),
    }
    assert!(
        since_kill < PROMPT,
        "get noticed the dead server only after {since_kill:?}"
    );
    assert!(elapsed < LONG_TIMEOUT / 2, "get took {elapsed:?}");
    blocked
}

fn assert_dead(blocked: &TcpStore, idle: &TcpStore, addr: &str) {
    // The broken client refuses everything, without hanging.
    let start = Instant::now();
    assert_connection_error(blocked.set("x", b"y"), "set after failure");
    assert_connection_error(blocked.get("k"), "get after failure");
    assert_connection_error(blocked.check(&["k"]), "check after failure");
    assert_connection_error(blocked.ping(), "ping after failure");
    // An idle client finds out on its next request that has a reply; for `add` that
    // must not be mistaken for the server refusing a non-counter value.
    assert_connection_error(idle.add("n", 1), "add on idle client");
    assert_connection_error(idle.check(&["k"]), "check on idle client");
    assert_connection_error(idle.num_keys(), "num_keys on idle client");
    assert!(
        start.elapsed() < PROMPT,
        "errors took {:?}",
        start.elapsed()
    );
    // Nobody listens any more.
    let retry = TcpStoreOptions {
        timeout: Duration::from_millis(300),
        connect_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    match TcpStore::connect(addr, retry) {
        Err(Error::StoreConnect { .. }) => {}
        other => panic!("connect to a dead server: {other:?}"),
    }
}

#[test]
fn server_drop_fails_blocked_and_later_requests() {
    let (server, addr) = server();
    let blocked = TcpStore::connect(&addr, options(LONG_TIMEOUT)).unwrap();
    let idle = TcpStore::connect(&addr, options(LONG_TIMEOUT)).unwrap();
    idle.set("k", b"v").unwrap();
    assert_eq!(idle.get("k").unwrap(), b"v");
    let blocked = get_blocked_across(blocked, || drop(server));
    assert_dead(&blocked, &idle, &addr);
}

#[test]
fn hosting_store_drop_fails_blocked_and_later_requests() {
    let host = TcpStore::host(
        "127.0.0.1:0",
        ServerOptions::default(),
        options(LONG_TIMEOUT),
    )
    .unwrap();
    let addr = host.server_addr().to_string();
    let blocked = TcpStore::connect(&addr, options(LONG_TIMEOUT)).unwrap();
    let idle = TcpStore::connect(&addr, options(LONG_TIMEOUT)).unwrap();
    host.set("k", b"v").unwrap();
    assert_eq!(idle.get("k").unwrap(), b"v");
    // The hosting client holds the only reference to the server.
    let blocked = get_blocked_across(blocked, || drop(host));
    assert_dead(&blocked, &idle, &addr);
}

// ---------------------------------------------------------------------------------------
// Cancelled waits.
// ---------------------------------------------------------------------------------------

#[test]
fn timed_out_wait_is_cancelled_and_connection_reused() {
    let (_server, addr) = server();
    let c = client(&addr);
    let other = client(&addr);
    let short = Duration::from_millis(200);

    match c.wait(&["late"], short) {
        Err(Error::StoreTimeout { op, missing, .. }) => {
            assert_eq!(op, "wait");
            assert_eq!(missing, ["late"]);
        }
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    // Same connection, next requests.
    c.set("after", b"ok").unwrap();
    assert_eq!(c.get("after").unwrap(), b"ok");

    // The key of the cancelled wait appears: no stray wake-up reaches the client.
    other.set("late", b"now").unwrap();
    assert_eq!(c.add("n", 2).unwrap(), 2);
    c.ping().unwrap();
    assert_eq!(c.get("late").unwrap(), b"now");

    // A get that times out (WAIT + CANCEL_WAIT inside) also leaves the connection usable,
    // and a later wait on the same connection is woken normally.
    c.set_timeout(short);
    assert!(matches!(c.get("later"), Err(Error::StoreTimeout { .. })));
    c.set_timeout(STORE_TIMEOUT);
    thread::scope(|s| {
        let waiter = s.spawn(|| c.wait(&["later"], STORE_TIMEOUT));
        other.set("later", b"1").unwrap();
        waiter.join().unwrap().unwrap();
    });
    assert_eq!(c.get("later").unwrap(), b"1");
}

#[test]
fn cancel_wait_on_the_wire() {
    let (_server, addr) = server();
    let other = client(&addr);
    let mut s = raw(&addr);
    s.write_all(&Msg::default().validate().wait(&[b"/late"]).0)
        .unwrap();
    // No reply while the key is missing.
    assert_silent(&mut s);
    s.write_all(&[CANCEL_WAIT]).unwrap();
    assert_eq!(read_u8(&mut s), WAIT_CANCELED);

    // A new wait, on another key.
    s.write_all(&Msg::default().wait(&[b"/second"]).0).unwrap();
    assert_silent(&mut s);
    // The key of the cancelled wait appears (`check` makes sure the server has applied
    // it): the stale waiter entry must neither answer nor count towards the new wait.
    other.set("late", b"v").unwrap();
    assert!(other.check(&["late"]).unwrap());
    assert_silent(&mut s);
    other.set("second", b"2").unwrap();
    assert_eq!(read_u8(&mut s), WAIT_STOP_WAITING);
    // Exactly one answer: the next bytes are the PING's.
    s.write_all(&Msg::default().ping(0xDEAD_BEEF).0).unwrap();
    assert_eq!(read_u32(&mut s), 0xDEAD_BEEF);
    assert_silent(&mut s);

    // The same connection can wait again: at once for a present key...
    s.write_all(&Msg::default().wait(&[b"/late"]).0).unwrap();
    assert_eq!(read_u8(&mut s), WAIT_STOP_WAITING);
    // ...and until woken for a missing one.
    s.write_all(&Msg::default().wait(&[b"/later", b"/late"]).0)
        .unwrap();
    assert_silent(&mut s);
    other.set("later", b"w").unwrap();
    assert_eq!(read_u8(&mut s), WAIT_STOP_WAITING);
    s.write_all(&Msg::default().get(b"/later").0).unwrap();
    assert_eq!(read_value(&mut s), b"w");
    assert_silent(&mut s);
}
