//! The RDMA transport over the simulated fabric (`transport::rdma::sim`): the real
//! transport and engine, ranks as threads standing for hosts of their own. Needs the
//! `rdma` feature (`cargo test --features rdma --test rdma`; the README's test command
//! runs it).
#![cfg(feature = "rdma")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroccl::bootstrap::Bootstrap;
use ferroccl::comm::CommConfig;
use ferroccl::plan::{Algorithm, Collective};
use ferroccl::store::{HashStore, Store};
use ferroccl::transport::NetChoice;
use ferroccl::transport::rdma::gid::{AddrFamily, AddrRange, GidEntry, GidSelection};
use ferroccl::transport::rdma::sim::{Fault, SimFabric};
use ferroccl::transport::rdma::verbs::{DeviceInfo, Provider, QpOptions};
use ferroccl::transport::rdma::{HcaFilter, RdmaConfig, describe, open_nic};
use ferroccl::tune::LinkCost;
use ferroccl::{Communicator, DataType, Error, ReduceOp};

/// `hosts` × `per_host` ranks (rank r on host r / per_host) whose hosts reach each other
/// over `fabric` only (`NCCL_NET=IB`: a fallback to TCP would be an error).
fn start(
    fabric: &Arc<SimFabric>,
    hosts: usize,
    per_host: usize,
    config: &CommConfig,
) -> Vec<Communicator> {
    let provider: Arc<dyn Provider> = fabric.clone();
    start_on(Some(provider), hosts, per_host, config)
}

/// As [`start`], over `provider` (`None`: libibverbs, the real devices).
fn start_on(
    provider: Option<Arc<dyn Provider>>,
    hosts: usize,
    per_host: usize,
    config: &CommConfig,
) -> Vec<Communicator> {
    let n = hosts * per_host;
    let store = HashStore::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let store: Arc<dyn Store> = Arc::new(store.clone());
                let mut config = config.clone();
                config.net = NetChoice::Ib;
                config.rdma.provider = provider.clone();
                config.bootstrap.host_id = Some(format!("simhost{}", rank / per_host));
                s.spawn(move || {
                    let boot = Bootstrap::new(store, rank, n, &config.bootstrap)?;
                    Communicator::from_bootstrap(boot, config)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    })
}

fn small_fifos(channels: usize) -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(120),
        channels,
        // Small slots so that the larger counts take many slots, and FIFOs fill up.
        slots: 4,
        slot_bytes: 4 << 10,
        chunk_bytes: 8 << 10,
        ..CommConfig::default()
    }
}

/// Queue pairs the fabric should hold: per rank, one per queue pair of every link to a
/// rank on another host, on every channel and the point-to-point one.
fn expected_qps(hosts: usize, per_host: usize, channels: usize, qps: usize) -> usize {
    let n = hosts * per_host;
    n * (n - per_host) * (channels + 1) * qps
}

fn assert_nothing_left(fabric: &SimFabric) {
    assert_eq!(fabric.live_qps(), 0, "queue pairs left");
    assert_eq!(fabric.live_regions(), 0, "registrations left");
    assert_eq!(fabric.open_devices(), 0, "devices left open");
}

fn check_grid(
    hosts: usize,
    per_host: usize,
    config: CommConfig,
    counts: &[usize],
    dtypes: &[DataType],
) {
    let fabric = SimFabric::new();
    let comms = start(&fabric, hosts, per_host, &config);
    let all_links = expected_qps(
        hosts,
        per_host,
        config.channels,
        config.rdma.qps_per_connection,
    );
    // Only the rings' links are made at creation.
    assert!(
        fabric.live_qps() < all_links,
        "{} queue pairs",
        fabric.live_qps()
    );
    // The cost model's network is the simulated NIC (100 Gb/s), on every rank.
    for comm in &comms {
        assert_eq!(comm.cost_model().0.net, LinkCost::rdma(100.0));
    }
    common::check_grid(
        &comms,
        dtypes,
        counts,
        &format!("on {hosts}x{per_host} hosts over RDMA"),
    );
    // The grid's direct algorithms and trees made more, every one over RDMA (a TCP
    // fallback would be an error under NCCL_NET=IB), and never more than every pair.
    let made = fabric.live_qps();
    assert!(
        made > 0 && made <= all_links,
        "{made} of {all_links} queue pairs"
    );
    drop(comms);
    assert_nothing_left(&fabric);
}

/// Between hosts, a communicator makes only its rings' RDMA links at creation (each
/// rank: from its previous rank, to its next); any other link is made by its two ranks
/// before the first call that needs it, once.
#[test]
fn links_beyond_the_rings_are_made_on_first_use() {
    let fabric = SimFabric::new();
    let config = CommConfig {
        algorithms: vec![Algorithm::OneShot],
        ..small_fifos(1)
    };
    let comms = start(&fabric, 4, 1, &config);
    let regions = |fabric: &SimFabric| fabric.live_regions();
    // 4 ranks x 2 ring neighbours; each link registers its 2 FIFOs.
    assert_eq!(fabric.live_qps(), 4 * 2);
    assert_eq!(regions(&fabric), 4 * 2 * 2);
    // Rank 0 sends to rank 2 (across the ring): their point-to-point link, no other.
    let sendrecv = |comms: &[Communicator]| {
        std::thread::scope(|s| {
            let a = s.spawn(|| comms[0].send(&[7u32; 1000], 2));
            let b = s.spawn(|| {
                let mut buf = [0u32; 1000];
                comms[2].recv(&mut buf, 0).map(|()| buf)
            });
            a.join().unwrap().unwrap();
            assert_eq!(b.join().unwrap().unwrap(), [7u32; 1000]);
        })
    };
    sendrecv(&comms);
    assert_eq!(fabric.live_qps(), 4 * 2 + 2);
    sendrecv(&comms);
    assert_eq!(fabric.live_qps(), 4 * 2 + 2, "made once");
    // A one-shot all-reduce needs every pair on channel 0: each rank adds the rank
    // opposite.
    let wrong = common::run_calls(
        &comms,
        &[(
            Collective::AllReduce,
            DataType::Int64,
            ReduceOp::Sum,
            3,
            false,
        )],
    );
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(fabric.live_qps(), 4 * 3 + 2);
    assert_eq!(regions(&fabric), (4 * 3 + 2) * 2);
    drop(comms);
    assert_nothing_left(&fabric);
}

const COUNTS: [usize; 6] = [0, 1, 2, 7, 1023, 65_537];

#[test]
fn the_collective_grid_on_two_hosts_of_two_ranks() {
    check_grid(2, 2, small_fifos(2), &COUNTS, &DataType::ALL);
}

#[test]
fn the_collective_grid_on_four_hosts_of_one_rank() {
    check_grid(4, 1, small_fifos(1), &COUNTS, &DataType::ALL);
}

#[test]
fn slots_are_striped_over_several_queue_pairs() {
    let mut config = small_fifos(1);
    config.rdma.qps_per_connection = 3;
    check_grid(
        2,
        1,
        config.clone(),
        &COUNTS,
        &[DataType::Int32, DataType::Float64],
    );
    check_grid(3, 1, config, &[0, 5, 4099], &[DataType::Uint8]);
}

/// Every slot length from 0 to a slot and a half, byte by byte, between two hosts:
/// point-to-point and broadcast, through a FIFO of two slots of 256 bytes.
#[test]
fn slots_of_every_length() {
    let config = CommConfig {
        slots: 2,
        slot_bytes: 256,
        chunk_bytes: 256,
        ll_payload_bytes: 256,
        ..small_fifos(1)
    };
    let fabric = SimFabric::new();
    let comms = start(&fabric, 2, 1, &config);
    for len in 0..=384usize {
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        std::thread::scope(|s| {
            let (a, b) = (&comms[0], &comms[1]);
            let p = payload.clone();
            s.spawn(move || a.send(&p, 1).unwrap());
            let mut got = vec![0u8; len];
            b.recv(&mut got, 0).unwrap();
            assert_eq!(got, payload, "{len} bytes sent to rank 1");
        });
        let wrong = common::run_calls(
            &comms,
            &[(
                Collective::Broadcast { root: 1 },
                DataType::Uint8,
                ReduceOp::Sum,
                len,
                false,
            )],
        );
        assert!(wrong.is_empty(), "{wrong:?}");
    }
    drop(comms);
    assert_nothing_left(&fabric);
}

/// A receiver that comes late: the sender fills the peer's FIFO (and its own), then
/// waits for credits; nothing is lost or overwritten when the receiver catches up.
#[test]
fn a_full_fifo_and_a_slow_receiver() {
    let config = CommConfig {
        slots: 2,
        slot_bytes: 1024,
        chunk_bytes: 1024,
        ll_payload_bytes: 1024,
        ..small_fifos(1)
    };
    let fabric = SimFabric::new();
    let comms = start(&fabric, 2, 1, &config);
    // 100 slots' worth, many times what the two FIFOs hold.
    let data: Vec<u32> = (0..25_600u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    std::thread::scope(|s| {
        let (a, b) = (&comms[0], &comms[1]);
        let d = &data;
        let sender = s.spawn(move || {
            let t = Instant::now();
            a.send(d, 1).unwrap();
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(300));
        let mut got = vec![0u32; data.len()];
        b.recv(&mut got, 0).unwrap();
        assert_eq!(got, data);
        // The sender could not finish before the receiver started.
        assert!(sender.join().unwrap() >= Duration::from_millis(250));
    });
    // Many rounds in both directions at once: slot numbers wrap their 6-bit sequence
    // many times over.
    for round in 0..20u32 {
        let wrong = common::run_calls(
            &comms,
            &[(
                Collective::AllReduce,
                DataType::Int32,
                ReduceOp::Sum,
                1000 + round as usize,
                round % 2 == 0,
            )],
        );
        assert!(wrong.is_empty(), "{wrong:?}");
    }
    drop(comms);
    assert_nothing_left(&fabric);
}

/// Settings for the fault tests: a short transport timeout (4.096 µs × 2^14 × 2 tries
/// ≈ 134 ms), a link timeout of a second (probes every third of it) and a deadline.
fn fault_config() -> CommConfig {
    let mut c = small_fifos(1);
    c.timeout = Duration::from_secs(20);
    c.link_timeout = Duration::from_secs(1);
    c.rdma.timeout = 14;
    c.rdma.retry_cnt = 1;
    c
}

/// Injects `fault` into rank 0 (of 2 hosts × 2 ranks; rank 0 talks across hosts in
/// both the ring and the tree) once a first all-reduce went through, then runs
/// all-reduces large enough to take many slots: every rank must fail, well within the
/// deadline, with an error that names a rank, and every queue pair, registration and
/// device must be gone once the communicators are dropped. For the ring and the tree.
fn every_rank_fails_naming_a_peer(fault: Fault) {
    for algorithm in [Algorithm::Ring, Algorithm::Tree] {
        let mut config = fault_config();
        config.algorithms = vec![algorithm];
        every_rank_fails_with(fault, &config);
    }
}

fn every_rank_fails_with(fault: Fault, config: &CommConfig) {
    let fabric = SimFabric::new();
    let comms = start(&fabric, 2, 2, config);
    let n = comms.len();
    let count = 20_000usize;
    let barrier = std::sync::Barrier::new(n);
    let errors: Vec<(Error, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let (fabric, barrier) = (&fabric, &barrier);
                s.spawn(move || {
                    let mut buf = vec![1.0f32; count];
                    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
                    assert!(buf.iter().all(|&x| x == n as f32));
                    barrier.wait();
                    if comm.rank() == 0 {
                        fabric.inject(0, fault);
                    }
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..50 {
                        if let Err(e) = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
                            return (e, start.elapsed());
                        }
                    }
                    panic!(
                        "rank {}: 50 all-reduces succeeded after {fault:?}",
                        comm.rank()
                    );
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (e, took)) in errors.iter().enumerate() {
        let named = match e {
            Error::PeerFailed { failed_rank, .. } => Some(*failed_rank),
            Error::Timeout { waiting_on, .. } => waiting_on.first().copied(),
            _ => None,
        };
        // The culprit is rank 0 or its peer on the other host (ranks 2, 3): never rank
        // 1, whose own links are healthy.
        assert!(
            named.is_some_and(|r| r < n && r != 1),
            "rank {rank} after {fault:?}: {e}"
        );
        assert!(*took < config.timeout, "rank {rank} took {took:?}: {e}");
        eprintln!(
            "{fault:?}, {:?}: rank {rank} after {took:?}: {e}",
            config.algorithms
        );
    }
    drop(comms);
    assert_nothing_left(&fabric);
}

#[test]
fn a_queue_pair_in_the_error_state_fails_every_rank() {
    every_rank_fails_naming_a_peer(Fault::QpsToError);
}

#[test]
fn a_lost_completion_fails_every_rank() {
    every_rank_fails_naming_a_peer(Fault::LoseCompletion);
}

#[test]
fn a_remote_access_error_fails_every_rank() {
    every_rank_fails_naming_a_peer(Fault::RefuseNextWrite);
}

#[test]
fn a_peer_that_stops_answering_fails_every_rank() {
    every_rank_fails_naming_a_peer(Fault::Unplug);
}

/// A rank that vanishes while its peers wait for it (nothing is being sent to it) is
/// found by the probes: its queue pairs are gone, a probe fails with retry-exceeded.
#[test]
fn a_vanished_peer_is_found_by_the_probes() {
    let fabric = SimFabric::new();
    let config = fault_config();
    let mut comms = start(&fabric, 2, 1, &config);
    let gone = comms.pop().unwrap();
    // Rank 1 stops answering before it closes (as a killed process or host would), so
    // its close notices never arrive either.
    fabric.inject(1, Fault::Unplug);
    let dropping = std::thread::spawn(move || drop(gone));
    let start = Instant::now();
    let mut buf = vec![0u8; 10];
    let e = comms[0].recv(&mut buf, 1).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, Error::PeerFailed { failed_rank: 1, .. }), "{e}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {e}");
    dropping.join().unwrap();
    drop(comms);
    assert_nothing_left(&fabric);
}

/// What each of 2 ranks on hosts of their own gets from initialising with
/// `NCCL_NET=IB` over `fabric`, rank r with `config_of(r)`, which must fail.
fn init_errors(fabric: &Arc<SimFabric>, config_of: impl Fn(usize) -> CommConfig) -> Vec<String> {
    let store = HashStore::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store: Arc<dyn Store> = Arc::new(store.clone());
                let mut config = config_of(rank);
                config.net = NetChoice::Ib;
                config.rdma.provider = Some(fabric.clone());
                config.bootstrap.host_id = Some(format!("h{rank}"));
                s.spawn(move || {
                    let boot = Bootstrap::new(store, rank, 2, &config.bootstrap).unwrap();
                    Communicator::from_bootstrap(boot, config)
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn nccl_net_ib_without_a_device_names_the_rank() {
    let errors = init_errors(&SimFabric::with_devices(Vec::new()), |_| small_fifos(1));
    for e in &errors {
        assert!(e.contains("NCCL_NET=IB") && e.contains("rank 0"), "{e}");
    }
    assert!(errors[0].contains("no RDMA device"), "{}", errors[0]);
}

fn gid(index: u8, addr: &str, roce_version: u8) -> GidEntry {
    GidEntry::of_address(index, addr.parse().unwrap(), Some(roce_version))
}

/// A rank that cannot make its side of a link on first use (here: its registrations
/// refused, as over the locked-memory limit) fails the call saying why, and its peer
/// fails at once naming it, without waiting for the deadline; nothing is left.
#[test]
fn a_link_that_cannot_be_made_on_first_use_is_named() {
    let fabric = SimFabric::new();
    let comms = start(&fabric, 2, 1, &small_fifos(1));
    let before = fabric.live_qps();
    fabric.inject(1, Fault::RefuseRegistrations);
    let start = Instant::now();
    let (sent, received) = std::thread::scope(|s| {
        let a = s.spawn(|| comms[0].send(&[1u8; 100], 1));
        let b = s.spawn(|| comms[1].recv(&mut [0u8; 100], 0));
        (a.join().unwrap(), b.join().unwrap())
    });
    let took = start.elapsed();
    let (sent, received) = (sent.unwrap_err(), received.unwrap_err());
    let why = received.to_string();
    assert!(
        why.contains("register a FIFO for rank 0") && why.contains("ulimit -l"),
        "{why}"
    );
    assert!(
        matches!(sent, Error::PeerFailed { failed_rank: 1, .. }),
        "{sent}"
    );
    assert!(
        sent.to_string()
            .contains("rank 1 could not make its side of the RDMA link")
            && sent.to_string().contains("ulimit -l"),
        "{sent}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(fabric.live_qps(), before, "the half-made side is gone");
    drop(comms);
    assert_nothing_left(&fabric);
}

/// A peer that never comes to make a link (it never posts the matching receive) is
/// named when the call's deadline passes.
#[test]
fn a_peer_that_never_makes_its_side_is_named_at_the_deadline() {
    let fabric = SimFabric::new();
    let config = CommConfig {
        timeout: Duration::from_secs(2),
        ..small_fifos(1)
    };
    let comms = start(&fabric, 2, 1, &config);
    let start = Instant::now();
    let e = comms[0].send(&[1u8; 100], 1).unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(e, Error::Timeout { ref waiting_on, .. } if waiting_on == &[1]),
        "{e}"
    );
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(6),
        "{took:?}"
    );
    drop(comms);
    assert_nothing_left(&fabric);
}

/// On hosts with several NICs every rank uses the first allowed port (in natural name
/// order: `sim2` before `sim10`), which reaches every peer's on any fabric; with
/// `FERROCCL_IB_SPREAD=1` the ranks of a host take the ports of the first one's kind and
/// speed in turn (not the slower or other-kind ones), so that all carry traffic.
#[test]
fn the_ranks_of_a_host_share_or_spread_over_its_nics() {
    let nics = || {
        SimFabric::with_devices(vec![
            SimFabric::device("sim10", "InfiniBand", Vec::new()),
            SimFabric::device("sim2", "InfiniBand", Vec::new()),
            DeviceInfo {
                gbps: 25.0,
                ..SimFabric::device("sim3", "InfiniBand", Vec::new())
            },
            SimFabric::device("sim4", "Ethernet", roce_table()),
        ])
    };
    let opened = |fabric: &SimFabric| -> Vec<String> {
        fabric
            .opened_by_owner()
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    };
    let fabric = nics();
    let comms = start(&fabric, 2, 2, &small_fifos(1));
    assert_eq!(opened(&fabric), ["sim2:1", "sim2:1", "sim2:1", "sim2:1"]);
    drop(comms);
    assert_nothing_left(&fabric);
    let fabric = nics();
    let mut config = small_fifos(1);
    config.rdma.spread_ports = true;
    let comms = start(&fabric, 2, 2, &config);
    assert_eq!(opened(&fabric), ["sim2:1", "sim10:1", "sim2:1", "sim10:1"]);
    common::check_grid(
        &comms,
        &[DataType::Int32, DataType::Float64],
        &[0, 1, 1023, 65_537],
        "on 2x2 hosts over two NICs each",
    );
    drop(comms);
    assert_nothing_left(&fabric);
    let fabric = nics();
    config.rdma.hca = Some(HcaFilter::parse("=sim10").unwrap());
    let comms = start(&fabric, 2, 2, &config);
    assert_eq!(opened(&fabric), ["sim10:1"; 4]);
    drop(comms);
    assert_nothing_left(&fabric);
}

/// A RoCE port and an InfiniBand port cannot connect: ranks whose chosen ports differ in
/// kind fail at initialisation, naming the peer and both kinds, instead of timing out
/// on the first write.
#[test]
fn roce_and_infiniband_ports_are_refused_by_name() {
    let fabric = SimFabric::with_devices(vec![
        SimFabric::device("ib0", "InfiniBand", Vec::new()),
        SimFabric::device("roce0", "Ethernet", roce_table()),
    ]);
    let errors = init_errors(&fabric, |rank| {
        let mut config = small_fifos(1);
        config.rdma.hca = Some(HcaFilter::parse(["=ib0", "=roce0"][rank]).unwrap());
        config
    });
    assert!(
        errors[0].contains("rank 1") && errors[0].contains("its RDMA port is RoCE"),
        "{}",
        errors[0]
    );
    assert!(
        errors[0].contains("this rank's is ib0:1 (InfiniBand, 100 Gb/s): they cannot connect"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("rank 0") && errors[1].contains("its RDMA port is InfiniBand"),
        "{}",
        errors[1]
    );
    assert_nothing_left(&fabric);
}

/// A RoCE port's GID table as a ConnectX shows it for one IPv4 address: link-local v1
/// and v2 entries, then the IPv4 address as v1 (index 2) and v2 (index 3).
fn roce_table() -> Vec<GidEntry> {
    vec![
        gid(0, "fe80::a288:c2ff:fe3b:506a", 1),
        gid(1, "fe80::a288:c2ff:fe3b:506a", 2),
        gid(2, "10.200.1.10", 1),
        gid(3, "10.200.1.10", 2),
    ]
}

/// On RoCE the queue pairs use the GID chosen as NCCL chooses it (the IPv4 RoCE v2
/// entry, not index 0) and carry it to their peers; the grid runs over it.
#[test]
fn roce_ports_use_the_ipv4_roce_v2_gid() {
    let fabric =
        SimFabric::with_devices(vec![SimFabric::device("roce0", "Ethernet", roce_table())]);
    let config = RdmaConfig {
        provider: Some(fabric.clone()),
        ..RdmaConfig::default()
    };
    let nic = open_nic(&config, 0, 0, 1, 8).unwrap();
    assert_eq!(nic.gid(), roce_table()[3]);
    assert_eq!(
        describe(nic.as_ref()),
        "roce0:1 (Ethernet, 100 Gb/s), GID 3 (10.200.1.10, RoCE v2)"
    );
    let e = nic.create_qp(&QpOptions {
        max_send: 4,
        max_recv: 4,
        timeout: 14,
        retry_cnt: 1,
        traffic_class: 0,
        service_level: 0,
    });
    let endpoint = e.unwrap();
    assert_eq!(
        endpoint.gid,
        roce_table()[3].gid,
        "the endpoint carries the GID"
    );
    nic.destroy_qp(endpoint.qpn);
    drop(nic);
    let comms = start(&fabric, 2, 1, &small_fifos(1));
    common::check_grid(&comms, &[DataType::Float32], &[0, 1, 4099], "over RoCE");
    drop(comms);
    assert_nothing_left(&fabric);
    // NCCL_IB_GID_INDEX names one instead; RoCE v1 and a range narrow the choice.
    for (gid, index) in [
        (GidSelection::Index(1), 1),
        (
            GidSelection::Auto {
                roce_version: 1,
                family: AddrFamily::V4,
                range: Some(AddrRange::parse("10.200.0.0/16").unwrap()),
            },
            2,
        ),
    ] {
        let config = RdmaConfig {
            gid,
            ..config.clone()
        };
        assert_eq!(open_nic(&config, 0, 0, 1, 8).unwrap().gid().index, index);
    }
}

/// A RoCE port without a routable IPv4 RoCE v2 GID (here: only link-local ones) fails
/// every rank at initialisation, saying what was looked for and what the table holds.
#[test]
fn a_roce_port_without_a_suitable_gid_is_named() {
    let fabric = SimFabric::with_devices(vec![SimFabric::device(
        "roce0",
        "Ethernet",
        roce_table()[..2].to_vec(),
    )]);
    let errors = init_errors(&fabric, |_| small_fifos(1));
    for e in &errors {
        assert!(e.contains("NCCL_NET=IB") && e.contains("rank 0"), "{e}");
    }
    let e = &errors[0];
    assert!(
        e.contains("RDMA device roce0:1: no GID is a RoCE v2 AF_INET entry, not link-local"),
        "{e}"
    );
    assert!(
        e.contains("1 (fe80::a288:c2ff:fe3b:506a, RoCE v2)") && e.contains("NCCL_IB_GID_INDEX"),
        "{e}"
    );
    assert_nothing_left(&fabric);
}

/// Queues larger than the device allows (`max_cqe`, `max_qp_wr`) are refused before
/// anything is created, naming the limit and the settings that shrink them.
#[test]
fn queues_beyond_the_device_limits_are_named() {
    let limited = |max_cqe, max_qp_wr| {
        SimFabric::with_devices(vec![DeviceInfo {
            max_cqe,
            max_qp_wr,
            ..SimFabric::device("small0", "InfiniBand", Vec::new())
        }])
    };
    // 2 channels and the point-to-point one, 1 peer, FIFOs of 4 slots: 3 links of
    // 2 x (2 x 4 + 4) entries = 72.
    let fabric = limited(71, 1024);
    let errors = init_errors(&fabric, |_| small_fifos(2));
    let e = &errors[0];
    assert!(
        e.contains("completion queue of 72 entries") && e.contains("max_cqe of 71"),
        "{e}"
    );
    assert!(
        e.contains("NCCL_NCHANNELS") && e.contains("NCCL_IB_QPS_PER_CONNECTION"),
        "{e}"
    );
    assert_nothing_left(&fabric);
    let fabric = limited(72, 1024);
    drop(start(&fabric, 2, 1, &small_fifos(2)));
    assert_nothing_left(&fabric);
    let fabric = limited(1 << 20, 11);
    let e = &init_errors(&fabric, |_| small_fifos(1))[0];
    assert!(
        e.contains("queue pairs of 12 work requests") && e.contains("max_qp_wr of 11"),
        "{e}"
    );
    assert!(e.contains("FERROCCL_SLOTS"), "{e}");
}

/// Without `NCCL_NET=IB`, ranks without a device fall back to TCP (and say so).
#[test]
fn without_a_device_hosts_fall_back_to_tcp() {
    let fabric = SimFabric::with_devices(Vec::new());
    let store = HashStore::new();
    let comms: Vec<Communicator> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store: Arc<dyn Store> = Arc::new(store.clone());
                let mut config = small_fifos(1);
                config.rdma.provider = Some(fabric.clone());
                config.bootstrap.host_id = Some(format!("h{rank}"));
                s.spawn(move || {
                    let boot = Bootstrap::new(store, rank, 2, &config.bootstrap).unwrap();
                    Communicator::from_bootstrap(boot, config).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wrong = common::run_calls(
        &comms,
        &[(
            Collective::AllReduce,
            DataType::Int64,
            ReduceOp::Max,
            5000,
            false,
        )],
    );
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(fabric.live_qps(), 0);
    assert_ne!(comms[0].cost_model().0.net, LinkCost::rdma(100.0));
}

/// `ncclCommRegister` through the communicator: buffers are registered with the device
/// once (a part of a registered buffer shares it), counted, and gone at the last
/// deregistration or when the communicator is dropped.
#[test]
fn user_buffers_are_registered_through_a_cache() {
    let fabric = SimFabric::new();
    let comms = start(&fabric, 2, 1, &small_fifos(1));
    let fifos = fabric.live_regions();
    let mut a = vec![0u8; 1 << 16];
    let mut b = vec![0u8; 4096];
    let comm = &comms[0];
    // SAFETY: the buffers outlive their registrations (ended below, or by the drop of
    // the communicators before the buffers).
    let (ra, ra_part, rb) = unsafe {
        (
            comm.register(a.as_mut_ptr(), a.len()).unwrap(),
            comm.register(a.as_mut_ptr().add(100), 1000).unwrap(),
            comm.register(b.as_mut_ptr(), b.len()).unwrap(),
        )
    };
    assert_eq!(
        fabric.live_regions(),
        fifos + 2,
        "the part shares its buffer's registration"
    );
    assert_eq!(ra.region, ra_part.region);
    assert!(ra.region.is_some() && rb.region.is_some());
    comm.deregister(&ra).unwrap();
    assert_eq!(fabric.live_regions(), fifos + 2, "still used by the part");
    comm.deregister(&ra_part).unwrap();
    assert_eq!(fabric.live_regions(), fifos + 1);
    let e = comm.deregister(&ra).unwrap_err().to_string();
    assert!(e.contains("not registered"), "{e}");
    // A registration left behind goes with the communicator; so does everything else.
    drop(comms);
    assert_nothing_left(&fabric);
    drop((a, b));
}

/// The same transport on this machine's real RDMA device, when it has one (an
/// InfiniBand or RoCE NIC, or SoftRoCE: `tools/rdma-check` sets one up): ranks as
/// threads standing for 2 hosts, each with its own device context, their queue pairs
/// connected through the NIC. Skips, saying why, without a device.
#[test]
fn the_collective_grid_on_a_real_rdma_device() {
    let config = RdmaConfig::from_env().unwrap();
    let nic = match open_nic(&config, 0, 0, 1, 8) {
        Ok(nic) => nic,
        Err(why) => {
            eprintln!("SKIPPED the_collective_grid_on_a_real_rdma_device: {why}");
            return;
        }
    };
    eprintln!("running on {}", describe(nic.as_ref()));
    drop(nic);
    for (hosts, per_host) in [(2, 1), (2, 2)] {
        let mut comm_config = small_fifos(2);
        comm_config.rdma = config.clone();
        let comms = start_on(None, hosts, per_host, &comm_config);
        common::check_grid(
            &comms,
            &[DataType::Int32, DataType::Float32, DataType::Uint8],
            &COUNTS,
            "on the real device",
        );
    }
}

/// Starts `n` ranks, each on a host of its own, with `configure(rank, config)` applied
/// to its settings; returns what each rank's initialisation gave.
fn start_each(
    n: usize,
    configure: impl Fn(usize, &mut CommConfig) + Sync,
) -> Vec<ferroccl::Result<Communicator>> {
    let store = HashStore::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let store: Arc<dyn Store> = Arc::new(store.clone());
                let mut config = small_fifos(1);
                config.bootstrap.host_id = Some(format!("h{rank}"));
                config.bootstrap.timeout = Duration::from_secs(20);
                configure(rank, &mut config);
                s.spawn(move || {
                    let boot = Bootstrap::new(store, rank, n, &config.bootstrap)?;
                    Communicator::from_bootstrap(boot, config)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Three hosts, the third without a device: ranks 0 and 1 talk over RDMA, every pair
/// with rank 2 over TCP, and the collectives are right.
#[test]
fn rdma_and_tcp_pairs_in_one_job() {
    let fabric = SimFabric::new();
    let no_device = SimFabric::with_devices(Vec::new());
    let comms: Vec<Communicator> = start_each(3, |rank, config| {
        let provider: Arc<dyn Provider> = if rank == 2 {
            no_device.clone()
        } else {
            fabric.clone()
        };
        config.rdma.provider = Some(provider);
    })
    .into_iter()
    .map(Result::unwrap)
    .collect();
    // Ranks 0 and 1, ring neighbours: their link on the ring's channel, made at
    // creation (the point-to-point one comes on first use).
    assert_eq!(fabric.live_qps(), 2);
    // The cost model keeps TCP's numbers: not every pair is over RDMA.
    assert_ne!(comms[0].cost_model().0.net, LinkCost::rdma(100.0));
    common::check_grid(
        &comms,
        &[DataType::Int32],
        &[0, 1, 7, 5000],
        "on RDMA and TCP pairs",
    );
    drop(comms);
    assert_nothing_left(&fabric);
}

/// Ranks that disagree on the queue pairs per link all fail at initialisation, at
/// once and naming a rank, instead of waiting for one another.
#[test]
fn ranks_that_disagree_on_queue_pairs_fail_at_init() {
    let fabric = SimFabric::new();
    let start = Instant::now();
    let results = start_each(3, |rank, config| {
        config.net = NetChoice::Ib;
        config.rdma.provider = Some(fabric.clone());
        config.rdma.qps_per_connection = if rank == 1 { 2 } else { 1 };
    });
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().map(|_| ()).unwrap_err().to_string();
        eprintln!("rank {rank}: {e}");
        assert!(e.contains("rank "), "rank {rank}: {e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_nothing_left(&fabric);
}
