//! One conformance suite for every [`Store`] implementation.
//!
//! Each `suite_*` function takes a factory that opens a fresh handle onto one shared store
//! (a new TCP client, a new `FileStore::open` of the same file, a `HashStore` clone, a
//! `PrefixStore` over one of those) and checks one part of the `Store` contract. The
//! `conformance!` macro at the bottom instantiates every suite for every implementation,
//! each test on a store of its own, so tests run in parallel and start from an empty store.

use std::any::Any;
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use ferroccl::Error;
use ferroccl::store::{
    FileStore, HashStore, MAX_KEY_LEN, MAX_VALUE_LEN, PrefixStore, ServerOptions, Store, TcpStore,
    TcpStoreOptions, TcpStoreServer,
};

/// Store timeout of every handle: long enough never to fire in a passing test, short
/// enough that a missed wake-up fails the test instead of hanging it.
const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// Timeout used where a test wants a wait to expire.
const SHORT: Duration = Duration::from_millis(200);

/// Slack for comparing a reported wait against the timeout asked for.
const CLOCK_SLACK: Duration = Duration::from_millis(10);

/// How soon a wait must return once its key appears (far below any timeout in play).
const PROMPT: Duration = Duration::from_secs(2);

type Make<'a> = &'a dyn Fn() -> Arc<dyn Store>;

/// A store under test: a handle factory plus whatever must outlive the handles.
struct Fixture {
    make: Box<dyn Fn() -> Arc<dyn Store>>,
    _keep: Vec<Box<dyn Any>>,
}

fn tcp_options() -> TcpStoreOptions {
    TcpStoreOptions {
        timeout: STORE_TIMEOUT,
        connect_timeout: STORE_TIMEOUT,
        ..Default::default()
    }
}

fn tcp_client(addr: &str) -> TcpStore {
    TcpStore::connect(addr, tcp_options()).expect("connect to test store server")
}

/// A `TcpStoreServer` bound to an ephemeral port; each handle is a new client.
fn fixture_tcp() -> Fixture {
    let server = TcpStoreServer::bind("127.0.0.1:0", ServerOptions::default()).unwrap();
    let addr = server.local_addr().to_string();
    Fixture {
        make: Box::new(move || Arc::new(tcp_client(&addr))),
        _keep: vec![Box::new(server)],
    }
}

/// A server hosted by a `TcpStore` (`TcpStore::host`); handles are further clients.
fn fixture_tcp_hosted() -> (TcpStore, String) {
    let host = TcpStore::host("127.0.0.1:0", ServerOptions::default(), tcp_options()).unwrap();
    assert!(host.hosted_server().unwrap().is_running());
    let addr = host.server_addr().to_string();
    (host, addr)
}

/// Every handle is a separate `FileStore::open` of one file in a fresh temporary directory.
fn fixture_file() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    Fixture {
        make: Box::new(move || {
            let store = FileStore::open(&path).unwrap();
            store.set_timeout(STORE_TIMEOUT);
            Arc::new(store)
        }),
        _keep: vec![Box::new(dir)],
    }
}

/// Every handle is a clone of one `HashStore`.
fn fixture_hash() -> Fixture {
    let base = HashStore::new();
    base.set_timeout(STORE_TIMEOUT);
    Fixture {
        make: Box::new(move || Arc::new(base.clone())),
        _keep: vec![],
    }
}

/// Every handle is a `PrefixStore` over a clone of one `HashStore`.
fn fixture_prefix_hash() -> Fixture {
    let base = HashStore::new();
    base.set_timeout(STORE_TIMEOUT);
    Fixture {
        make: Box::new(move || Arc::new(PrefixStore::new("job", Arc::new(base.clone())))),
        _keep: vec![],
    }
}

/// Every handle is a `PrefixStore` over a new client of a server hosted by a `TcpStore`.
fn fixture_prefix_tcp() -> Fixture {
    let (host, addr) = fixture_tcp_hosted();
    Fixture {
        make: Box::new(move || Arc::new(PrefixStore::new("job", Arc::new(tcp_client(&addr))))),
        _keep: vec![Box::new(host)],
    }
}

fn test_name() -> String {
    thread::current().name().unwrap_or("?").to_string()
}

fn assert_timeout(result: Result<impl std::fmt::Debug, Error>, want_op: &str, want: &[&str]) {
    match result {
        Err(Error::StoreTimeout {
            op,
            waited,
            missing,
        }) => {
            assert_eq!(op, want_op);
            assert_eq!(missing, want, "missing keys of {op}");
            assert!(
                waited + CLOCK_SLACK >= SHORT,
                "{op} reported waiting only {waited:?}"
            );
        }
        other => panic!("expected StoreTimeout from {want_op}, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// The suites.
// ---------------------------------------------------------------------------------------

fn suite_round_trip(make: Make) {
    let w = make();
    let r = make();
    let every_byte: Vec<u8> = (0..=255u8).collect();
    let mib: Vec<u8> = (0..1usize << 20).map(|i| (i * 31 % 251) as u8).collect();

    w.set("empty", b"").unwrap();
    w.set("binary", &every_byte).unwrap();
    w.set("mib", &mib).unwrap();
    w.set("dir/sub/ключ", b"utf8 key").unwrap();

    assert!(r.check(&["empty"]).unwrap(), "an empty value is still set");
    assert_eq!(r.get("empty").unwrap(), b"");
    assert_eq!(r.get("binary").unwrap(), every_byte);
    assert_eq!(r.get("mib").unwrap(), mib);
    assert_eq!(r.get("dir/sub/ключ").unwrap(), b"utf8 key");

    // Overwrite, seen by the other handle.
    r.set("binary", b"second").unwrap();
    assert_eq!(w.get("binary").unwrap(), b"second");

    // Counters are ASCII decimal and shared.
    assert_eq!(w.add("ctr", 5).unwrap(), 5);
    assert_eq!(r.add("ctr", -7).unwrap(), -2);
    assert_eq!(w.get("ctr").unwrap(), b"-2");
    assert_eq!(w.add("ctr", 0).unwrap(), -2);
}

fn suite_concurrent_add(make: Make) {
    const CLIENTS: usize = 16;
    const ADDS: usize = 1000;
    let handles: Vec<Arc<dyn Store>> = (0..CLIENTS).map(|_| make()).collect();
    let barrier = Barrier::new(CLIENTS + 1);
    let (mut seen, elapsed) = thread::scope(|s| {
        let joins: Vec<_> = handles
            .iter()
            .map(|h| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let mut got = Vec::with_capacity(ADDS);
                    for _ in 0..ADDS {
                        got.push(h.add("counter", 1).unwrap());
                    }
                    got
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut seen = Vec::with_capacity(CLIENTS * ADDS);
        for j in joins {
            let got = j.join().unwrap();
            assert!(
                got.windows(2).all(|w| w[0] < w[1]),
                "one client's adds must return increasing values"
            );
            seen.extend(got);
        }
        (seen, start.elapsed())
    });
    eprintln!(
        "{}: {CLIENTS} clients x {ADDS} adds took {elapsed:?}",
        test_name()
    );
    // Atomic: every add saw a distinct value, together exactly 1..=16000.
    seen.sort_unstable();
    let want: Vec<i64> = (1..=(CLIENTS * ADDS) as i64).collect();
    assert!(seen == want, "add results are not exactly 1..=16000");
    assert_eq!(make().get("counter").unwrap(), b"16000");
}

#[derive(Clone, Copy, Debug)]
enum Wake {
    Set,
    Add,
    Append,
}

fn suite_wait_wakes(make: Make, how: Wake) {
    let waiter = make();
    let writer = make();
    writer.set("already", b"here").unwrap();
    let (started_tx, started_rx) = mpsc::channel();
    thread::scope(|s| {
        let t = s.spawn(move || {
            started_tx.send(()).unwrap();
            let r = waiter.wait(&["already", "wake"], Duration::from_secs(10));
            (r, Instant::now())
        });
        started_rx.recv().unwrap();
        // Gives the waiter time to block, so the wake-up path (not the "already there"
        // path) is what usually runs; the assertions hold either way.
        thread::sleep(Duration::from_millis(50));
        let before_write = Instant::now();
        match how {
            Wake::Set => writer.set("wake", b"v").unwrap(),
            Wake::Add => assert_eq!(writer.add("wake", 3).unwrap(), 3),
            Wake::Append => writer.append("wake", b"x").unwrap(),
        }
        let (result, returned_at) = t.join().unwrap();
        result.unwrap_or_else(|e| panic!("wait woken by {how:?} failed: {e}"));
        assert!(
            returned_at > before_write,
            "wait returned before the key was written"
        );
        let lag = returned_at - before_write;
        assert!(lag < PROMPT, "wait took {lag:?} to notice the {how:?}");
    });
    let want: &[u8] = match how {
        Wake::Set => b"v",
        Wake::Add => b"3",
        Wake::Append => b"x",
    };
    assert_eq!(make().get("wake").unwrap(), want);
}

fn suite_wait_wakes_on_set(make: Make) {
    suite_wait_wakes(make, Wake::Set)
}

fn suite_wait_wakes_on_add(make: Make) {
    suite_wait_wakes(make, Wake::Add)
}

fn suite_wait_wakes_on_append(make: Make) {
    suite_wait_wakes(make, Wake::Append)
}

fn suite_timeouts(make: Make) {
    let h = make();
    h.set("present", b"1").unwrap();

    let start = Instant::now();
    let result = h.wait(&["missing-a", "present", "missing-b"], SHORT);
    let elapsed = start.elapsed();
    assert_timeout(result, "wait", &["missing-a", "missing-b"]);
    assert!(elapsed < PROMPT, "wait({SHORT:?}) took {elapsed:?}");

    // A wait for present keys only succeeds at once.
    h.wait(&["present"], SHORT).unwrap();

    // get / multi_get wait up to the store timeout set on the handle.
    let g = make();
    g.set_timeout(SHORT);
    assert_eq!(g.timeout(), SHORT);
    let start = Instant::now();
    assert_timeout(g.get("absent"), "get", &["absent"]);
    assert_timeout(
        g.multi_get(&["present", "absent-2"]),
        "multi_get",
        &["absent-2"],
    );
    assert!(start.elapsed() < 2 * PROMPT);
    // No key was created by the failed reads, and the handle still works.
    assert!(!h.check(&["absent"]).unwrap());
    assert!(!h.check(&["absent-2"]).unwrap());
    g.set("after", b"ok").unwrap();
    assert_eq!(g.get("after").unwrap(), b"ok");
    g.set_timeout(STORE_TIMEOUT);
}

fn suite_compare_set(make: Make) {
    let h = make();
    let o = make();
    // Missing key + empty expected: created.
    assert_eq!(h.compare_set("cas", b"", b"v1").unwrap(), b"v1");
    assert_eq!(o.get("cas").unwrap(), b"v1");
    // Missing key + non-empty expected: expected echoed, nothing created.
    assert_eq!(h.compare_set("cas-absent", b"exp", b"v").unwrap(), b"exp");
    assert!(!o.check(&["cas-absent"]).unwrap());
    // Mismatch: current returned, value unchanged.
    assert_eq!(h.compare_set("cas", b"wrong", b"v2").unwrap(), b"v1");
    assert_eq!(o.get("cas").unwrap(), b"v1");
    // An existing value does not match an empty expected.
    assert_eq!(h.compare_set("cas", b"", b"v2").unwrap(), b"v1");
    // Match: swapped.
    assert_eq!(h.compare_set("cas", b"v1", b"v2").unwrap(), b"v2");
    assert_eq!(o.get("cas").unwrap(), b"v2");
    // An existing empty value matches an empty expected.
    h.set("cas-empty", b"").unwrap();
    assert_eq!(h.compare_set("cas-empty", b"", b"full").unwrap(), b"full");
    assert_eq!(o.get("cas-empty").unwrap(), b"full");

    // Atomic: of 8 racing creators exactly one wins and everyone sees the winner.
    const RACERS: usize = 8;
    let handles: Vec<Arc<dyn Store>> = (0..RACERS).map(|_| make()).collect();
    let barrier = Barrier::new(RACERS);
    let results: Vec<(Vec<u8>, Vec<u8>)> = thread::scope(|s| {
        let joins: Vec<_> = handles
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mine = format!("racer-{i}").into_bytes();
                    barrier.wait();
                    let got = h.compare_set("leader", b"", &mine).unwrap();
                    (mine, got)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let winner = o.get("leader").unwrap();
    assert!(results.iter().all(|(_, got)| *got == winner));
    assert_eq!(
        results.iter().filter(|(mine, _)| *mine == winner).count(),
        1
    );
}

fn suite_delete(make: Make) {
    let h = make();
    let o = make();
    h.set("d", b"x").unwrap();
    assert!(o.check(&["d"]).unwrap());
    assert!(
        h.delete("d").unwrap(),
        "deleting an existing key returns true"
    );
    assert!(!o.check(&["d"]).unwrap(), "a deleted key is gone");
    assert!(!o.delete("d").unwrap(), "deleting it again returns false");
    assert!(!h.delete("never-set").unwrap());
    // A deleted key can be set again, and counters restart from 0.
    h.set("d", b"y").unwrap();
    assert_eq!(o.get("d").unwrap(), b"y");
    assert_eq!(h.add("dc", 5).unwrap(), 5);
    assert!(o.delete("dc").unwrap());
    assert_eq!(h.add("dc", 1).unwrap(), 1);
    // A get on a deleted key waits like one on a key never set.
    h.delete("d").unwrap();
    o.set_timeout(SHORT);
    assert_timeout(o.get("d"), "get", &["d"]);
    o.set_timeout(STORE_TIMEOUT);
}

fn suite_num_keys(make: Make) {
    let h = make();
    assert_eq!(h.num_keys().unwrap(), 0, "a fresh store has no keys");
    h.set("n1", b"a").unwrap();
    h.set("n2", b"").unwrap();
    h.add("n3", 1).unwrap();
    h.append("n4", b"x").unwrap();
    assert_eq!(h.num_keys().unwrap(), 4);
    h.set("n1", b"again").unwrap();
    h.add("n3", 1).unwrap();
    assert_eq!(h.num_keys().unwrap(), 4, "overwrites do not add keys");
    assert!(h.delete("n2").unwrap());
    assert_eq!(h.num_keys().unwrap(), 3);
    h.compare_set("n5", b"", b"x").unwrap();
    h.compare_set("n6", b"expected", b"x").unwrap();
    h.multi_set(&["n7", "n8"], &[b"1", b"2"]).unwrap();
    assert!(!h.delete("never").unwrap());
    assert_eq!(h.num_keys().unwrap(), 6);
    assert_eq!(
        make().num_keys().unwrap(),
        6,
        "another handle counts the same"
    );
}

fn suite_multi(make: Make) {
    let h = make();
    let o = make();
    h.multi_set(&["m1", "m2", "m3"], &[b"one", b"", b"three"])
        .unwrap();
    assert_eq!(
        o.multi_get(&["m3", "m1", "m2"]).unwrap(),
        vec![b"three".to_vec(), b"one".to_vec(), b"".to_vec()]
    );
    assert_eq!(
        o.multi_get(&["m1", "m1"]).unwrap(),
        vec![b"one".to_vec(), b"one".to_vec()]
    );
    assert_eq!(o.get("m2").unwrap(), b"");
    assert!(o.check(&["m1", "m2", "m3"]).unwrap());
    assert!(!o.check(&["m1", "nope"]).unwrap());
    assert!(o.check(&[]).unwrap(), "check of no keys is vacuously true");

    // Empty requests are fine.
    h.multi_set(&[], &[]).unwrap();
    assert!(o.multi_get(&[]).unwrap().is_empty());

    // Mismatched lengths are rejected before anything is written.
    for (keys, values) in [
        (&["x1", "x2"][..], &[&b"only"[..]][..]),
        (&["x1"][..], &[&b"a"[..], &b"b"[..]][..]),
    ] {
        match h.multi_set(keys, values) {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("multi_set with mismatched lengths: {other:?}"),
        }
    }
    assert!(!o.check(&["x1"]).unwrap());
    assert!(!o.check(&["x2"]).unwrap());
    // The handle still works afterwards.
    h.multi_set(&["x1"], &[b"fine"]).unwrap();
    assert_eq!(o.multi_get(&["x1"]).unwrap(), vec![b"fine".to_vec()]);
}

fn suite_add_non_counter(make: Make) {
    let h = make();
    h.set("text", b"abc").unwrap();
    h.set("empty", b"").unwrap();
    for key in ["text", "empty"] {
        // A TCP server closes the connection that sent the bad ADD: use a throwaway handle.
        let throwaway = make();
        match throwaway.add(key, 1) {
            Err(Error::StoreValue { key: named, .. }) => assert_eq!(named, key),
            other => panic!("add on non-counter {key:?}: expected StoreValue, got {other:?}"),
        }
    }
    // Nothing was changed and the store keeps working.
    assert_eq!(h.get("text").unwrap(), b"abc");
    assert_eq!(h.get("empty").unwrap(), b"");
    assert_eq!(h.add("real", 2).unwrap(), 2);
    assert_eq!(make().add("real", 2).unwrap(), 4);
}

fn suite_limits(make: Make) {
    let h = make();
    let long = "k".repeat(MAX_KEY_LEN + 1);
    let long = long.as_str();
    let results: Vec<(&str, Result<(), Error>)> = vec![
        ("set", h.set(long, b"v")),
        ("get", h.get(long).map(drop)),
        ("add", h.add(long, 1).map(drop)),
        ("append", h.append(long, b"v")),
        ("compare_set", h.compare_set(long, b"", b"v").map(drop)),
        ("check", h.check(&["ok", long]).map(drop)),
        ("wait", h.wait(&["ok", long], STORE_TIMEOUT)),
        ("delete", h.delete(long).map(drop)),
        ("multi_get", h.multi_get(&["ok", long]).map(drop)),
        ("multi_set", h.multi_set(&["ok", long], &[b"1", b"2"])),
    ];
    for (op, result) in results {
        match result {
            Err(Error::KeyTooLong { len, max }) => {
                assert!(len > max, "{op}: KeyTooLong {{ len: {len}, max: {max} }}");
                assert!(max <= MAX_KEY_LEN);
            }
            other => panic!("{op} with a {}-byte key: {other:?}", long.len()),
        }
    }

    let huge = vec![7u8; MAX_VALUE_LEN + 1];
    let results: Vec<(&str, Result<(), Error>)> = vec![
        ("set", h.set("big", &huge)),
        ("append", h.append("big", &huge)),
        ("compare_set", h.compare_set("big", b"", &huge).map(drop)),
        ("multi_set", h.multi_set(&["ok", "big"], &[b"1", &huge])),
    ];
    for (op, result) in results {
        match result {
            Err(Error::ValueTooLarge { len, max }) => {
                assert_eq!(len, MAX_VALUE_LEN + 1, "{op}");
                assert_eq!(max, MAX_VALUE_LEN, "{op}");
            }
            other => panic!("{op} with a {}-byte value: {other:?}", huge.len()),
        }
    }
    assert!(
        !h.check(&["ok"]).unwrap(),
        "rejected requests wrote nothing"
    );
    assert!(!h.check(&["big"]).unwrap());

    // The limits themselves are accepted.
    let max_value = &huge[..MAX_VALUE_LEN];
    h.set("big", max_value).unwrap();
    assert_eq!(make().get("big").unwrap().len(), MAX_VALUE_LEN);
    h.set(&"k".repeat(1000), b"v").unwrap();
    assert_eq!(make().get(&"k".repeat(1000)).unwrap(), b"v");
}

fn suite_append(make: Make) {
    let h = make();
    let o = make();
    h.append("ap", b"ab").unwrap();
    assert_eq!(o.get("ap").unwrap(), b"ab", "append creates a missing key");
    o.append("ap", b"cd").unwrap();
    assert_eq!(h.get("ap").unwrap(), b"abcd");
    h.append("ap", b"").unwrap();
    assert_eq!(o.get("ap").unwrap(), b"abcd");
    h.append("ap", &[0, 255]).unwrap();
    assert_eq!(o.get("ap").unwrap(), b"abcd\x00\xff");
    // Appending digits to a counter makes a bigger counter (values are plain bytes).
    assert_eq!(h.add("apc", 1).unwrap(), 1);
    o.append("apc", b"0").unwrap();
    assert_eq!(h.add("apc", 1).unwrap(), 11);
}

/// Prefix stores "a" and "b" over one handle of the store under test.
fn suite_prefix_isolation(make: Make) {
    let base = make();
    let a = PrefixStore::new("a", base.clone());
    let b = PrefixStore::new("b", make());
    assert_eq!(a.prefix(), "a");

    a.set("k", b"from a").unwrap();
    assert!(a.check(&["k"]).unwrap());
    assert!(!b.check(&["k"]).unwrap(), "b must not see a's key");
    assert!(
        !base.check(&["k"]).unwrap(),
        "the bare key is not set underneath"
    );
    b.set("k", b"from b").unwrap();
    assert_eq!(a.get("k").unwrap(), b"from a");
    assert_eq!(b.get("k").unwrap(), b"from b");
    assert_eq!(base.get("a/k").unwrap(), b"from a");
    assert_eq!(base.get("b/k").unwrap(), b"from b");

    // Counters, deletes and multi-key operations stay inside the prefix too.
    assert_eq!(a.add("n", 1).unwrap(), 1);
    assert_eq!(b.add("n", 10).unwrap(), 10);
    assert_eq!(base.get("a/n").unwrap(), b"1");
    assert!(b.delete("k").unwrap());
    assert!(!b.delete("k").unwrap());
    assert_eq!(a.get("k").unwrap(), b"from a");
    b.multi_set(&["m", "k"], &[b"bm", b"bk"]).unwrap();
    assert_eq!(
        base.multi_get(&["b/m", "b/k", "a/k"]).unwrap(),
        vec![b"bm".to_vec(), b"bk".to_vec(), b"from a".to_vec()]
    );
    base.set("a/direct", b"d").unwrap();
    assert_eq!(a.get("direct").unwrap(), b"d");

    // Timeouts name the keys as the caller wrote them, without the prefix.
    assert_timeout(a.wait(&["k", "gone"], SHORT), "wait", &["gone"]);
    a.set_timeout(SHORT);
    assert_timeout(a.get("gone"), "get", &["gone"]);
    assert_timeout(a.multi_get(&["k", "gone"]), "multi_get", &["gone"]);
    a.set_timeout(STORE_TIMEOUT);

    // Nested prefixes compose.
    let nested = PrefixStore::new("inner", Arc::new(a.clone()));
    nested.set("deep", b"x").unwrap();
    assert_eq!(base.get("a/inner/deep").unwrap(), b"x");
}

// ---------------------------------------------------------------------------------------
// Instantiation for every implementation.
// ---------------------------------------------------------------------------------------

macro_rules! conformance {
    ($module:ident, $fixture:expr) => {
        mod $module {
            use super::*;
            conformance!(@tests $fixture;
                round_trip => suite_round_trip,
                concurrent_add_is_atomic => suite_concurrent_add,
                wait_wakes_on_set => suite_wait_wakes_on_set,
                wait_wakes_on_add => suite_wait_wakes_on_add,
                wait_wakes_on_append => suite_wait_wakes_on_append,
                timeouts_name_missing_keys => suite_timeouts,
                compare_set_semantics => suite_compare_set,
                delete => suite_delete,
                num_keys => suite_num_keys,
                multi_get_multi_set => suite_multi,
                add_on_non_counter_fails => suite_add_non_counter,
                size_limits => suite_limits,
                append_creates_then_extends => suite_append,
                prefix_isolation => suite_prefix_isolation,
            );
        }
    };
    (@tests $fixture:expr; $($name:ident => $suite:path),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let fixture = $fixture;
                $suite(&*fixture.make);
            }
        )*
    };
}

conformance!(tcp, fixture_tcp());
conformance!(file, fixture_file());
conformance!(hash, fixture_hash());
conformance!(prefix_over_hash, fixture_prefix_hash());
conformance!(prefix_over_tcp, fixture_prefix_tcp());

// ---------------------------------------------------------------------------------------
// Behaviour that differs between implementations by design.
// ---------------------------------------------------------------------------------------

/// A `PrefixStore` counts every key of the store underneath (PyTorch's behaviour).
fn check_prefix_num_keys_counts_underlying(base: Arc<dyn Store>) {
    assert_eq!(base.num_keys().unwrap(), 0);
    let a = PrefixStore::new("a", base.clone());
    let b = PrefixStore::new("b", base.clone());
    a.set("k", b"1").unwrap();
    b.set("k", b"2").unwrap();
    base.set("bare", b"3").unwrap();
    assert_eq!(a.num_keys().unwrap(), 3);
    assert_eq!(b.num_keys().unwrap(), 3);
    assert_eq!(base.num_keys().unwrap(), 3);
}

#[test]
fn prefix_num_keys_counts_underlying_hash() {
    check_prefix_num_keys_counts_underlying(Arc::new(HashStore::new()));
}

#[test]
fn prefix_num_keys_counts_underlying_tcp() {
    let fixture = fixture_tcp();
    check_prefix_num_keys_counts_underlying((fixture.make)());
}

#[test]
fn prefix_num_keys_counts_underlying_file() {
    let fixture = fixture_file();
    check_prefix_num_keys_counts_underlying((fixture.make)());
}

/// The TCP server counts keys holding values; queues are not counted (but are "ready").
#[test]
fn tcp_num_keys_counts_values_not_queues() {
    let (host, addr) = fixture_tcp_hosted();
    let other = tcp_client(&addr);
    assert_eq!(host.num_keys().unwrap(), 0, "connecting creates no keys");
    host.set("v", b"1").unwrap();
    other.queue_push("q", b"item").unwrap();
    assert_eq!(other.queue_len("q").unwrap(), 1);
    assert_eq!(host.num_keys().unwrap(), 1);
    assert!(
        host.check(&["q"]).unwrap(),
        "a non-empty queue counts as set"
    );
    assert_eq!(host.queue_pop("q", false).unwrap().unwrap(), b"item");
    assert_eq!(host.queue_pop("q", false).unwrap(), None);
    assert!(!host.check(&["q"]).unwrap());
    assert_eq!(other.num_keys().unwrap(), 1);
}

/// Many clients of one TCP store each see the others' writes (a smoke test of the
/// hosting variant itself, which `prefix_over_tcp` uses for the full suite).
#[test]
fn tcp_hosted_serves_other_clients() {
    let (host, addr) = fixture_tcp_hosted();
    let others: Vec<TcpStore> = (0..4).map(|_| tcp_client(&addr)).collect();
    for (i, c) in others.iter().enumerate() {
        c.set(&format!("from-{i}"), i.to_string().as_bytes())
            .unwrap();
    }
    let keys: Vec<String> = (0..4).map(|i| format!("from-{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(
        host.multi_get(&refs).unwrap(),
        vec![b"0".to_vec(), b"1".to_vec(), b"2".to_vec(), b"3".to_vec()]
    );
    host.ping().unwrap();
}
