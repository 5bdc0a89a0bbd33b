//! Property-based fuzzing of the parsers that read bytes or text from outside the
//! process: the store's wire protocol (requests as the server reads them), bootstrap
//! payloads (`PeerInfo`), `UniqueId` bytes, rank 0's cost model and settings, topology
//! JSON, the perf tools' command lines, the store client's reading of replies from a
//! hostile server, the C ABI's arguments, and with the `rdma` feature the RDMA
//! endpoints and `NCCL_IB_HCA`. Inputs are random bytes and mutations of valid encodings (a few
//! bytes flipped, the message cut short or extended), so that they reach past the first
//! length check.
//!
//! Every target asserts that the parser returns (never panics), that what it accepts
//! round-trips where an encoder exists, and that one call allocates at most a bounded
//! amount (a counting allocator watches: a length field claiming gigabytes must not make
//! the parser reserve them).
//!
//! CI runs `FUZZ_CASES_DEFAULT` inputs per target. The long run:
//!
//! ```sh
//! FERROCCL_FUZZ_CASES=1000000 cargo test --release --features rdma --test fuzz -- --nocapture --test-threads 1
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::IpAddr;

use ferroccl::bootstrap::{PeerInfo, UniqueId};
use ferroccl::store::wire::{Limits, Request, Writer, parse_request};
use ferroccl::tune::CostModel;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Inputs per target in CI.
const FUZZ_CASES_DEFAULT: u32 = 20_000;

/// Most bytes one parse may allocate beyond a multiple of its input.
const ALLOC_SLACK: usize = 64 << 10;

thread_local! {
    /// Bytes allocated by this thread since the last reset.
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, counting what each thread allocates.
struct Counting;

// SAFETY: forwards to the system allocator; the counter is thread-local plain data.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get().saturating_add(layout.size())));
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get().saturating_add(new_size)));
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` and returns its result with the bytes it allocated.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    ALLOCATED.with(|a| a.set(0));
    let out = f();
    (out, ALLOCATED.with(Cell::get))
}

fn cases() -> u32 {
    std::env::var("FERROCCL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FUZZ_CASES_DEFAULT)
}

/// Runs `check` on `cases()` inputs from `strategy`; reports how many ran.
fn fuzz<S: Strategy>(
    name: &str,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let start = std::time::Instant::now();
    if let Err(e) = runner.run(&strategy, check) {
        panic!("{name}: {e}");
    }
    eprintln!(
        "fuzz {name}: {} inputs in {:.1?}, no failure",
        cases(),
        start.elapsed()
    );
}

/// A mutation of `valid`: some bytes overwritten, then cut or extended.
fn mutated(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    (
        valid,
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        any::<prop::sample::Index>(),
        prop::collection::vec(any::<u8>(), 0..16),
        any::<bool>(),
    )
        .prop_map(|(mut v, flips, cut, tail, extend)| {
            if !v.is_empty() {
                for (at, byte) in flips {
                    let i = at.index(v.len());
                    v[i] = byte;
                }
            }
            if extend {
                v.extend(tail);
            } else {
                let keep = cut.index(v.len() + 1);
                v.truncate(keep);
            }
            v
        })
}

/// Random bytes, or a mutation of a valid encoding.
fn bytes_or_mutation(
    valid: impl Strategy<Value = Vec<u8>> + 'static,
) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(any::<u8>(), 0..256), mutated(valid)]
}

const LIMITS: Limits = Limits {
    max_key_len: 1024,
    max_value_len: 1 << 20,
    max_key_count: 64,
};

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..24)
}

/// A request as a client encodes it, and the request itself.
fn request() -> impl Strategy<Value = (Vec<u8>, Request)> {
    let keys = || prop::collection::vec(key(), 0..5);
    prop_oneof![
        any::<u32>().prop_map(|m| {
            let mut w = Writer::default();
            w.u8(0).u32(m);
            (w.into_vec(), Request::Validate(m))
        }),
        (key(), key()).prop_map(|(k, v)| {
            let mut w = Writer::default();
            w.u8(1).bytes(&k).bytes(&v);
            (w.into_vec(), Request::Set(k, v))
        }),
        (key(), any::<i64>()).prop_map(|(k, d)| {
            let mut w = Writer::default();
            w.u8(4).bytes(&k).i64(d);
            (w.into_vec(), Request::Add(k, d))
        }),
        keys().prop_map(|ks| {
            let mut w = Writer::default();
            w.u8(5).u64(ks.len() as u64);
            for k in &ks {
                w.bytes(k);
            }
            (w.into_vec(), Request::Check(ks))
        }),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(|proof| {
            let mut w = Writer::default();
            w.u8(65).bytes(&proof);
            (w.into_vec(), Request::AuthProof(proof))
        }),
        prop::collection::vec((key(), key()), 0..4).prop_map(|kvs| {
            let mut w = Writer::default();
            w.u8(11).u64(kvs.len() as u64);
            for (k, v) in &kvs {
                w.bytes(k).bytes(v);
            }
            (w.into_vec(), Request::MultiSet(kvs))
        }),
    ]
}

#[test]
fn store_requests_as_the_server_reads_them() {
    // Valid encodings round-trip.
    fuzz("store request round trip", request(), |(bytes, want)| {
        let (got, used) =
            parse_request(&bytes, &LIMITS).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        prop_assert_eq!(got, want);
        prop_assert_eq!(used, bytes.len());
        Ok(())
    });
    // Anything else: an answer, bounded allocation, never more bytes used than given.
    fuzz(
        "store request bytes",
        bytes_or_mutation(request().prop_map(|(b, _)| b)),
        |bytes| {
            let (result, allocated) = allocated_by(|| parse_request(&bytes, &LIMITS));
            if let Ok((_, used)) = result {
                prop_assert!(used <= bytes.len());
            }
            prop_assert!(
                allocated <= 4 * bytes.len() + ALLOC_SLACK,
                "{allocated} bytes for {}",
                bytes.len()
            );
            Ok(())
        },
    );
}

fn peer_info() -> impl Strategy<Value = PeerInfo> {
    (
        0usize..64,
        "[a-z0-9.-]{0,12}",
        "[a-z0-9:.-]{0,24}",
        any::<u32>(),
        prop::collection::vec(any::<[u8; 4]>(), 0..3),
    )
        .prop_map(|(rank, hostname, host_id, pid, v4)| PeerInfo {
            rank,
            world_size: 64,
            hostname,
            host_id,
            pid,
            addrs: v4.into_iter().map(IpAddr::from).collect(),
        })
}

#[test]
fn bootstrap_peer_info() {
    fuzz("peer info round trip", peer_info(), |info| {
        let back = PeerInfo::decode(info.rank, &info.encode())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(back, info);
        Ok(())
    });
    fuzz(
        "peer info bytes",
        (
            0usize..64,
            bytes_or_mutation(peer_info().prop_map(|p| p.encode())),
        ),
        |(from, bytes)| {
            let (result, allocated) = allocated_by(|| PeerInfo::decode(from, &bytes));
            if let Ok(info) = result {
                prop_assert_eq!(info.rank, from);
            }
            prop_assert!(allocated <= 4 * bytes.len() + ALLOC_SLACK);
            Ok(())
        },
    );
}

#[test]
fn unique_id_bytes() {
    let valid = UniqueId::hosted_on("127.0.0.1".parse().unwrap()).unwrap();
    let template = valid.as_bytes().to_vec();
    fuzz(
        "unique id bytes",
        prop_oneof![
            prop::collection::vec(any::<u8>(), 128),
            mutated(Just(template)).prop_map(|mut v| {
                v.resize(128, 0);
                v
            }),
        ],
        |bytes| {
            let array: [u8; 128] = bytes.as_slice().try_into().expect("128 bytes");
            if let Ok(id) = UniqueId::from_bytes(&array) {
                // An accepted id names an address (any port, any address).
                let _ = id.store_addr();
                prop_assert_eq!(id.as_bytes(), &array);
            }
            Ok(())
        },
    );
}

#[test]
fn rank_zeros_cost_model_and_settings() {
    let model = CostModel::default().to_text();
    fuzz(
        "cost model text",
        prop_oneof![
            "\\PC{0,64}",
            mutated(Just(model.clone().into_bytes()))
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        ],
        |text| {
            if let Ok(m) = CostModel::parse("fuzz", &text) {
                // Whatever is accepted is usable: finite, positive bandwidths.
                for l in [m.local, m.local_ll, m.local_single, m.local_in_place, m.net] {
                    prop_assert!(l.beta > 0.0 && l.beta.is_finite() && l.alpha >= 0.0);
                }
            }
            Ok(())
        },
    );
    let settings = ferroccl::comm::CommConfig::default().shared_settings();
    fuzz(
        "shared settings text",
        mutated(Just(settings.clone().into_bytes()))
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        |theirs| {
            let diff = ferroccl::comm::CommConfig::settings_differ(&settings, &theirs);
            // Agreement is line by line (a trailing newline changes nothing).
            prop_assert_eq!(diff.is_none(), theirs.lines().eq(settings.lines()));
            Ok(())
        },
    );
}

#[test]
fn topology_json() {
    let valid = r#"{"name": "t", "hosts": 2, "ranks_per_host": 4, "cores_per_host": 8,
        "local": {"latency_us": 1, "bandwidth_GBps": 10},
        "net": {"latency_us": 30, "bandwidth_GBps": 1.25}, "channels": 2}"#;
    fuzz(
        "topology json",
        prop_oneof![
            "\\PC{0,80}",
            mutated(Just(valid.as_bytes().to_vec()))
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            (0u64..u64::MAX, 0u64..u64::MAX).prop_map(|(h, r)| valid
                .replace("\"hosts\": 2", &format!("\"hosts\": {h}"))
                .replace("\"ranks_per_host\": 4", &format!("\"ranks_per_host\": {r}"))),
        ],
        |text| {
            let (result, allocated) = allocated_by(|| {
                ferroccl::viz::predict::Topology::from_json(&text).map(|t| t.host_labels().len())
            });
            if let Ok(ranks) = result {
                prop_assert!((2..=4096).contains(&ranks));
            }
            prop_assert!(allocated <= 64 * text.len() + ALLOC_SLACK);
            Ok(())
        },
    );
}

#[test]
fn perf_tool_command_lines() {
    let word = prop_oneof![
        Just("-b".to_string()),
        Just("-e".to_string()),
        Just("-f".to_string()),
        Just("-np".to_string()),
        Just("-n".to_string()),
        Just("-c".to_string()),
        Just("--csv".to_string()),
        Just("-d".to_string()),
        "[0-9]{0,20}[kKmMgG]?",
        "\\PC{0,12}",
    ];
    fuzz(
        "perf tool arguments",
        prop::collection::vec(word, 0..8),
        |argv| {
            if let Ok(Some(a)) = ferroccl::perf::args::parse(&argv) {
                prop_assert!(a.min_bytes <= a.max_bytes, "{a:?}");
            }
            Ok(())
        },
    );
}

#[cfg(feature = "rdma")]
#[test]
fn rdma_endpoints_and_hca_lists() {
    use ferroccl::store::wire::Cursor;
    use ferroccl::transport::rdma::HcaFilter;
    use ferroccl::transport::rdma::gid::{
        AddrFamily, AddrRange, GidEntry, GidSelection, choose_gid,
    };
    use ferroccl::transport::rdma::verbs::Endpoint;
    let endpoint = (
        any::<u32>(),
        any::<u16>(),
        any::<[u8; 16]>(),
        any::<u32>(),
        1u32..=5,
        any::<bool>(),
    )
        .prop_map(|(qpn, lid, gid, psn, mtu, ethernet)| Endpoint {
            qpn,
            lid,
            gid,
            psn,
            mtu,
            ethernet,
        });
    fuzz("rdma endpoint round trip", endpoint.clone(), |e| {
        let mut w = Writer::default();
        e.encode(&mut w);
        let bytes = w.into_vec();
        let back = Endpoint::decode(&mut Cursor::new(&bytes)).map_err(TestCaseError::fail)?;
        prop_assert_eq!(back, e);
        Ok(())
    });
    fuzz(
        "rdma endpoint bytes",
        bytes_or_mutation(endpoint.prop_map(|e| {
            let mut w = Writer::default();
            e.encode(&mut w);
            w.into_vec()
        })),
        |bytes| {
            let (_, allocated) = allocated_by(|| Endpoint::decode(&mut Cursor::new(&bytes)));
            prop_assert!(allocated <= ALLOC_SLACK);
            Ok(())
        },
    );
    fuzz(
        "NCCL_IB_ADDR_RANGE",
        "[0-9a-f.:/]{0,24}|[0-9]{1,3}(\\.[0-9]{1,3}){3}/[0-9]{1,3}",
        |text| {
            if let Ok(r) = AddrRange::parse(&text) {
                let most = if r.base.is_ipv4() { 32 } else { 128 };
                prop_assert!(r.prefix <= most, "{r}");
                prop_assert!(r.contains(r.base), "{r} holds its own base");
            }
            Ok(())
        },
    );
    let entry = (
        any::<u8>(),
        any::<[u8; 16]>(),
        prop::option::of(1u8..=2),
        any::<bool>(),
    )
        .prop_map(|(index, mut gid, roce_version, mapped)| {
            if mapped {
                gid[..12].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
            }
            GidEntry {
                index,
                gid,
                roce_version,
            }
        });
    let selection = prop_oneof![
        any::<u8>().prop_map(GidSelection::Index),
        (
            1u8..=2,
            any::<bool>(),
            any::<bool>(),
            any::<[u8; 4]>(),
            0u8..=32
        )
            .prop_map(
                |(roce_version, v6, ranged, base, prefix)| GidSelection::Auto {
                    roce_version,
                    family: if v6 { AddrFamily::V6 } else { AddrFamily::V4 },
                    range: (ranged && !v6).then(|| AddrRange {
                        base: std::net::IpAddr::from(base),
                        prefix,
                    }),
                }
            ),
    ];
    fuzz(
        "GID choice",
        (prop::collection::vec(entry, 0..8), any::<bool>(), selection),
        |(table, ethernet, selection)| {
            match choose_gid(&table, ethernet, &selection) {
                Ok(e) if ethernet => {
                    prop_assert!(table.contains(&e), "a RoCE GID comes from the table");
                    if let GidSelection::Auto {
                        roce_version,
                        family,
                        range,
                    } = selection
                    {
                        prop_assert!(e.roce_version.is_none_or(|v| v == roce_version));
                        prop_assert_eq!(e.address().is_ipv4(), family == AddrFamily::V4);
                        prop_assert!(range.is_none_or(|r| r.contains(e.address())));
                    }
                }
                Ok(_) => {}
                Err(why) => prop_assert!(ethernet && why.contains("NCCL_IB_GID_INDEX"), "{why}"),
            }
            Ok(())
        },
    );
    fuzz("NCCL_IB_HCA", "[=^]{0,2}[a-z0-9_:,=^ ]{0,24}", |text| {
        if let Ok(f) = HcaFilter::parse(&text) {
            prop_assert!(!f.entries.is_empty());
            prop_assert!(
                f.entries
                    .iter()
                    .all(|(n, p)| !n.is_empty() && *p != Some(0))
            );
        }
        Ok(())
    });
}

/// One reply field a store server sends: a byte, an integer, or a length-prefixed string.
fn reply_fields() -> impl Strategy<Value = Vec<u8>> {
    let field = prop_oneof![
        any::<u8>().prop_map(|b| vec![b]),
        (0u8..3).prop_map(|b| vec![b]),
        any::<i64>().prop_map(|v| v.to_le_bytes().to_vec()),
        (0i64..4).prop_map(|v| v.to_le_bytes().to_vec()),
        prop::collection::vec(any::<u8>(), 0..12).prop_map(|v| {
            let mut out = (v.len() as u64).to_le_bytes().to_vec();
            out.extend(v);
            out
        }),
        // A length announcing far more than follows.
        prop_oneof![Just(1u64 << 29), Just(u64::MAX), Just(1u64 << 40)]
            .prop_map(|n| n.to_le_bytes().to_vec()),
    ];
    prop::collection::vec(field, 0..5).prop_map(|fs| fs.concat())
}

#[test]
fn store_client_against_a_hostile_server() {
    use ferroccl::store::{Store, TcpStore, TcpStoreOptions};
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;
    // For each case, a server that answers the client's handshake properly, then
    // replies to its next request with the case's bytes and hangs up.
    let serve = |reply: Vec<u8>| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let mut hello = [0u8; 10];
            if s.read_exact(&mut hello).is_err() {
                return;
            }
            let _ = s.write_all(&std::process::id().to_le_bytes());
            let mut request = [0u8; 4096];
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = s.read(&mut request);
            let _ = s.write_all(&reply);
        });
        (addr, server)
    };
    let ops = 0u8..10;
    fuzz(
        "store client replies",
        (ops, bytes_or_mutation(reply_fields())),
        |(op, reply)| {
            let (addr, server) = serve(reply.clone());
            let options = TcpStoreOptions {
                timeout: Duration::from_secs(2),
                connect_timeout: Duration::from_secs(2),
                secret: None,
            };
            let client = TcpStore::connect(&addr, options)
                .map_err(|e| TestCaseError::fail(format!("the handshake itself failed: {e}")))?;
            let start = std::time::Instant::now();
            let (_, bytes) = allocated_by(|| {
                let _ = match op {
                    0 => client.get("k").map(drop),
                    1 => client.add("k", 1).map(drop),
                    2 => client.check(&["k", "j"]).map(drop),
                    3 => client.compare_set("k", b"a", b"b").map(drop),
                    4 => client.num_keys().map(drop),
                    5 => client.multi_get(&["k", "j"]).map(drop),
                    6 => client.delete("k").map(drop),
                    7 => client.queue_pop("q", false).map(drop),
                    8 => client.queue_len("q").map(drop),
                    _ => client.wait(&["k"], Duration::from_millis(50)),
                };
            });
            prop_assert!(
                bytes <= 64 * reply.len() + (256 << 10),
                "op {op}: {bytes} bytes allocated for a {}-byte reply",
                reply.len()
            );
            // The server hung up after its reply: the client never waits out its timeout
            // for bytes that cannot come.
            prop_assert!(
                start.elapsed() < Duration::from_secs(1),
                "op {op} took {:?}",
                start.elapsed()
            );
            drop(client);
            server.join().unwrap();
            Ok(())
        },
    );
}

#[test]
fn c_abi_arguments() {
    use ferroccl::capi::*;
    use std::ffi::{c_int, c_void};
    // A live 1-rank communicator; calls get random counts, datatypes, ops, roots and
    // peers, and buffers that may be NULL. Invalid ones must be refused with
    // ncclInvalidArgument (never a crash); valid ones must work.
    let mut comm: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer, 1 rank, NULL device list.
    assert_eq!(
        unsafe { ncclCommInitAll(&mut comm, 1, std::ptr::null()) },
        SUCCESS
    );
    let comm = comm as usize;
    let mut buf = vec![0u8; 2 * HALF];
    let base = buf.as_mut_ptr() as usize;
    fuzz(
        "C ABI arguments",
        (
            0u8..6,
            prop_oneof![0usize..64, Just(usize::MAX), Just(usize::MAX / 2)],
            prop_oneof![0 as c_int..13, any::<c_int>()],
            prop_oneof![0 as c_int..6, any::<c_int>()],
            prop_oneof![0 as c_int..2, any::<c_int>()],
            any::<bool>(),
            any::<bool>(),
        ),
        |(call, count, dtype, op, peer, null_buf, null_comm)| {
            // Send from the first half of the buffer, receive into the second.
            let (p, q) = if null_buf {
                (std::ptr::null_mut(), std::ptr::null_mut())
            } else {
                (base as *mut c_void, (base + HALF) as *mut c_void)
            };
            let c = if null_comm { 0 } else { comm } as *mut c_void;
            let known_dtype = (0..12).contains(&dtype);
            let elem = if known_dtype {
                [1usize, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1][dtype as usize]
            } else {
                1
            };
            // The library cannot know how long a buffer is: counts the half-buffers
            // cannot hold are not tried with real buffers.
            let fits = count.checked_mul(elem).is_some_and(|b| b <= HALF);
            if !fits && !null_buf {
                return Ok(());
            }
            let s = std::ptr::null_mut();
            // SAFETY: every pointer is NULL or inside the live buffer, with room for
            // `count` elements of the datatype when the datatype is known.
            let r = unsafe {
                match call {
                    0 => ncclAllReduce(p, q, count, dtype, op, c, s),
                    1 => ncclBroadcast(p, q, count, dtype, peer, c, s),
                    2 => ncclReduce(p, q, count, dtype, op, peer, c, s),
                    3 => ncclAllGather(p, q, count, dtype, c, s),
                    4 => ncclReduceScatter(p, q, count, dtype, op, c, s),
                    _ => ncclAlltoAll(p, q, count, dtype, c, s),
                }
            };
            let reduces = matches!(call, 0 | 2 | 4);
            let valid = !null_comm
                && known_dtype
                && (!reduces || (0..5).contains(&op))
                && (!matches!(call, 1 | 2) || peer == 0)
                && (!null_buf || count == 0);
            if valid {
                prop_assert_eq!(
                    r,
                    SUCCESS,
                    "call {} count {} dtype {} op {} refused",
                    call,
                    count,
                    dtype,
                    op
                );
            } else {
                prop_assert!(
                    r != SUCCESS,
                    "call {call} count {count} dtype {dtype} op {op} peer {peer} null \
                     buffer {null_buf} null comm {null_comm}: accepted"
                );
            }
            Ok(())
        },
    );
    drop(buf);
    // SAFETY: the live communicator, destroyed once.
    assert_eq!(unsafe { ncclCommDestroy(comm as *mut c_void) }, SUCCESS);
}

/// Bytes of each half of the C ABI target's buffer.
const HALF: usize = 2048;
