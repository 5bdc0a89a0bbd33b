//! Rendezvous: how ranks that know only a store find each other.
//!
//! A [`Bootstrap`] is one rank's handle on a job's rendezvous. Creating it publishes this
//! rank's [`PeerInfo`] and gathers everyone else's; afterwards it offers the two
//! collectives that set-up code needs before any transport exists, [`Bootstrap::all_gather`]
//! and [`Bootstrap::barrier`], both through the store.
//!
//! Three ways in, as with NCCL and `torch.distributed`:
//! - [`Bootstrap::from_unique_id`]: one rank makes a [`UniqueId`] (which starts a store
//!   server in its process), hands it to the others out of band, and every rank passes
//!   it with its rank and the world size (`ncclGetUniqueId` + `ncclCommInitRank`).
//! - [`Bootstrap::from_env`]: `env://` initialisation from the variables a launcher sets
//!   ([`LaunchEnv`]: ferrorun/torchrun, Slurm, Open MPI); rank 0 hosts the store at
//!   `MASTER_ADDR:MASTER_PORT` unless the launcher already does.
//! - [`Bootstrap::new`]: any [`Store`] the caller already has.
//!
//! Every wait has a deadline ([`BootstrapOptions::timeout`]). A rank that never arrives
//! makes the others fail with [`Error::BootstrapTimeout`] listing exactly the ranks that
//! are missing, and while they wait they log which ranks they are still waiting for.

mod launch_env;
pub mod netif;
mod peer;
mod unique_id;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use launch_env::{DEFAULT_MASTER_PORT, LaunchEnv, Launcher};
pub use peer::{PeerInfo, boot_id, host_hash_of, host_id, hostname};
pub use unique_id::{UNIQUE_ID_BYTES, UniqueId};

use crate::error::{Error, Result};
use crate::store::auth::StoreSecret;
use crate::store::{PrefixStore, ServerOptions, Store, TcpStore, TcpStoreOptions};

/// Default bootstrap timeout (NCCL waits as long for a missing rank; override with
/// `FERROCCL_BOOTSTRAP_TIMEOUT`, in seconds).
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(300);

/// How often a waiting rank logs the ranks it is still waiting for.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(10);

/// Longest a rank that hosts the store stays after a timed-out rendezvous, so that the
/// ranks that did arrive can still learn which ranks are missing.
const MAX_HOST_LINGER: Duration = Duration::from_secs(10);

/// Where the store server of a job whose `MASTER_ADDR` is `master_addr` listens: on that
/// address, when it is one of this host's (so the port is not opened on every
/// interface), else on every interface (`MASTER_ADDR` a name this host does not resolve
/// to itself, e.g. behind NAT). `FERROCCL_STORE_BIND_ALL=1` asks for every interface.
pub fn store_bind_addr(master_addr: &str, port: u16) -> std::net::SocketAddr {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
    let resolved: Vec<SocketAddr> = (master_addr, port)
        .to_socket_addrs()
        .map(|a| a.collect())
        .unwrap_or_default();
    let any = if resolved.iter().all(SocketAddr::is_ipv6) && !resolved.is_empty() {
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port)
    } else {
        SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port)
    };
    if std::env::var("FERROCCL_STORE_BIND_ALL").is_ok_and(|v| v.trim() == "1") {
        return any;
    }
    // An address of this host is one a socket can be bound to.
    resolved
        .into_iter()
        .find(|a| std::net::TcpListener::bind(SocketAddr::new(a.ip(), 0)).is_ok())
        .unwrap_or(any)
}

/// Settings of a rendezvous.
#[derive(Clone, Debug)]
pub struct BootstrapOptions {
    /// How long to wait for every rank at each rendezvous (and to reach the store).
    pub timeout: Duration,
    /// The host this rank counts as on, instead of [`host_id`] (`FERROCCL_HOSTID`):
    /// lets ranks that are threads of one process stand for several hosts, as tests of
    /// the network transports do.
    pub host_id: Option<String>,
}

impl Default for BootstrapOptions {
    fn default() -> Self {
        BootstrapOptions {
            timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
            host_id: None,
        }
    }
}

impl BootstrapOptions {
    /// Defaults, with `FERROCCL_BOOTSTRAP_TIMEOUT` (seconds, fractions allowed) applied.
    pub fn from_env() -> Result<Self> {
        let mut options = Self::default();
        if let Ok(text) = std::env::var("FERROCCL_BOOTSTRAP_TIMEOUT") {
            let secs: f64 = text.trim().parse().map_err(|_| Error::Env {
                var: "FERROCCL_BOOTSTRAP_TIMEOUT".into(),
                detail: format!("{text:?} is not a number of seconds"),
            })?;
            if !(secs.is_finite() && secs > 0.0) {
                return Err(Error::Env {
                    var: "FERROCCL_BOOTSTRAP_TIMEOUT".into(),
                    detail: format!("{text:?} is not a positive number of seconds"),
                });
            }
            options.timeout = Duration::from_secs_f64(secs);
        }
        Ok(options)
    }
}

/// One rank's handle on a job's rendezvous.
pub struct Bootstrap {
    rank: usize,
    world_size: usize,
    store: Arc<dyn Store>,
    timeout: Duration,
    peers: Vec<PeerInfo>,
    /// Sequence number of the next rendezvous; every rank calls them in the same order.
    next_seq: AtomicU64,
    /// Whether the store server may end when this rank does: it runs in this process,
    /// or in the launcher of this node (node 0 under an agent store), which exits once
    /// its ranks have. Such a rank leaves a round only after every rank has.
    store_ends_with_rank: bool,
    /// `host:port` of the store server, when known: the interface on the route to it is
    /// the one peers on other hosts can reach this rank through.
    store_addr: Option<String>,
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Bootstrap {
    /// Joins the rendezvous on `store` as `rank` of `world_size`: publishes this rank's
    /// [`PeerInfo`] and waits for everyone's.
    ///
    /// Fails with [`Error::BootstrapTimeout`] naming the missing ranks if some do not
    /// arrive within the timeout, and with [`Error::BootstrapData`] if two processes claim
    /// the same rank or ranks disagree about the world size.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        options: &BootstrapOptions,
    ) -> Result<Self> {
        Self::join(store, rank, world_size, options, false)
    }

    fn join(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        options: &BootstrapOptions,
        store_ends_with_rank: bool,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::invalid(
                "world size is 0; a job has at least one rank",
            ));
        }
        if rank >= world_size {
            return Err(Error::invalid(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let addrs = netif::usable_addrs(netif::IfaceFilter::from_env().as_ref())?;
        let mut me = PeerInfo::local(rank, world_size, addrs);
        if let Some(id) = &options.host_id {
            me.host_id = id.clone();
        }
        let mut boot = Bootstrap {
            rank,
            world_size,
            store,
            timeout: options.timeout,
            peers: Vec::new(),
            next_seq: AtomicU64::new(0),
            store_ends_with_rank,
            store_addr: None,
        };
        boot.peers = boot.exchange_peer_info(&me)?;
        tracing::debug!(
            "bootstrap: rank {rank}/{world_size} found every peer ({} hosts)",
            boot.host_count()
        );
        Ok(boot)
    }

    /// A rendezvous of some of this job's ranks (a split) on `store` (a prefix of this
    /// one's): the rank whose process hosts the store keeps that role.
    pub fn sub(
        &self,
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        options: &BootstrapOptions,
    ) -> Result<Self> {
        let mut boot = Self::join(store, rank, world_size, options, self.store_ends_with_rank)?;
        boot.store_addr = self.store_addr.clone();
        Ok(boot)
    }

    /// Joins the rendezvous named by `id` (see [`UniqueId`]).
    pub fn from_unique_id(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        options: &BootstrapOptions,
    ) -> Result<Self> {
        let client = TcpStore::connect(
            &id.store_addr().to_string(),
            TcpStoreOptions {
                timeout: options.timeout,
                connect_timeout: options.timeout,
                secret: StoreSecret::from_env()?,
            },
        )?;
        let store = PrefixStore::new(id.key_prefix(), Arc::new(client));
        let mut boot = Self::join(Arc::new(store), rank, world_size, options, id.hosted_here())?;
        boot.store_addr = Some(id.store_addr().to_string());
        Ok(boot)
    }

    /// `env://` initialisation: reads the launcher's variables ([`LaunchEnv`]), hosts or
    /// reaches the store at `MASTER_ADDR:MASTER_PORT`, and joins the rendezvous there.
    ///
    /// The n-th call in a process uses the key namespace `ferroccl/env/<n>`, so every
    /// rank's n-th call meets the others' n-th.
    pub fn from_env(options: &BootstrapOptions) -> Result<(Self, LaunchEnv)> {
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let env = LaunchEnv::from_env()?;
        let client_options = TcpStoreOptions {
            timeout: options.timeout,
            connect_timeout: options.timeout,
            secret: StoreSecret::from_env()?,
        };
        let hosts_store = env.rank == 0 && !env.agent_store;
        let store_ends_with_rank = hosts_store || (env.agent_store && env.group_rank == Some(0));
        let client = if hosts_store {
            TcpStore::host(
                store_bind_addr(&env.master_addr, env.master_port),
                ServerOptions::from_env()?,
                client_options,
            )
            .map_err(|e| match e {
                Error::Io { source, .. } => Error::io(
                    format!(
                        "rank 0: cannot host the store on port {} (MASTER_PORT)",
                        env.master_port
                    ),
                    source,
                ),
                other => other,
            })?
        } else {
            TcpStore::connect(&env.store_addr(), client_options)?
        };
        let generation = CALLS.fetch_add(1, Ordering::Relaxed);
        let store = PrefixStore::new(format!("ferroccl/env/{generation}"), Arc::new(client));
        let mut boot = Self::join(
            Arc::new(store),
            env.rank,
            env.world_size,
            options,
            store_ends_with_rank,
        )?;
        boot.store_addr = Some(env.store_addr());
        Ok((boot, env))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every rank's facts, indexed by rank.
    pub fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    /// The ranks on this rank's host (same [`PeerInfo::host_id`]), ascending.
    pub fn local_ranks(&self) -> Vec<usize> {
        let mine = &self.peers[self.rank].host_id;
        (0..self.world_size)
            .filter(|&r| &self.peers[r].host_id == mine)
            .collect()
    }

    /// This rank's index among [`Bootstrap::local_ranks`].
    pub fn local_rank(&self) -> usize {
        self.local_ranks()
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank is on its own host")
    }

    /// Number of distinct hosts in the job.
    pub fn host_count(&self) -> usize {
        let mut ids: Vec<&str> = self.peers.iter().map(|p| p.host_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// The store the rendezvous runs on (namespaced to this job).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// `host:port` of the store server, when this rendezvous knows it.
    pub fn store_addr(&self) -> Option<&str> {
        self.store_addr.as_deref()
    }

    /// The rendezvous timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Every rank contributes `data`; returns all contributions indexed by rank. Every
    /// rank must call it (in the same order as the other rendezvous calls).
    pub fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.next_seq.fetch_add(1, Ordering::SeqCst);
        self.gather_round(&format!("all_gather #{seq}"), seq, data)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        let seq = self.next_seq.fetch_add(1, Ordering::SeqCst);
        self.wait_round(&format!("barrier #{seq}"), seq, b"")
    }

    fn key(seq: u64, rank: usize) -> String {
        format!("round/{seq}/{rank}")
    }

    /// Claims this rank with compare-and-set on a key of its own, so that a second
    /// process (or thread) started with the same rank is reported instead of silently
    /// overwriting the first one's data.
    fn claim_rank(&self, me: &PeerInfo) -> Result<()> {
        let mut token = [0u8; 8];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut token);
        let mine = format!(
            "pid {} on {} (claim {:016x})",
            me.pid,
            me.hostname,
            u64::from_le_bytes(token)
        );
        let stored =
            self.store
                .compare_set(&format!("claim/{}", self.rank), b"", mine.as_bytes())?;
        if stored != mine.as_bytes() {
            let theirs = String::from_utf8_lossy(&stored);
            return Err(Error::BootstrapData {
                rank: self.rank,
                detail: format!(
                    "rank {} is claimed twice: by {theirs} and by {mine}",
                    self.rank
                ),
            });
        }
        Ok(())
    }

    fn exchange_peer_info(&self, me: &PeerInfo) -> Result<Vec<PeerInfo>> {
        self.claim_rank(me)?;
        let seq = self.next_seq.fetch_add(1, Ordering::SeqCst);
        let raw = self.gather_round("peer-info all-gather", seq, &me.encode())?;
        let peers = raw
            .iter()
            .enumerate()
            .map(|(r, bytes)| PeerInfo::decode(r, bytes))
            .collect::<Result<Vec<_>>>()?;
        if let Some(odd) = peers.iter().find(|p| p.world_size != self.world_size) {
            return Err(Error::BootstrapData {
                rank: odd.rank,
                detail: format!(
                    "it was started with world size {} but rank {} with {}",
                    odd.world_size, self.rank, self.world_size
                ),
            });
        }
        Ok(peers)
    }

    fn gather_round(&self, phase: &str, seq: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.wait_round(phase, seq, data)?;
        let keys: Vec<String> = (0..self.world_size).map(|r| Self::key(seq, r)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.store.multi_get(&refs)
    }

    /// Records that this rank gave up on round `seq`. The rank hosting the store then
    /// stays until every rank that arrived has given up too (at most
    /// [`MAX_HOST_LINGER`]): leaving at once would make the others fail with "connection
    /// reset" instead of learning which ranks are missing.
    fn abandon_round(&self, seq: u64, arrived: usize) {
        let key = format!("abandoned/{seq}");
        let Ok(mut count) = self.store.add(&key, 1) else {
            return;
        };
        if !self.store_ends_with_rank {
            return;
        }
        let deadline = Instant::now() + self.timeout.min(MAX_HOST_LINGER);
        while count < arrived as i64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            match self.store.add(&key, 0) {
                Ok(c) => count = c,
                Err(_) => return,
            }
        }
    }

    /// Publishes this rank's part of round `seq` and waits for every rank's.
    fn wait_round(&self, phase: &str, seq: u64, data: &[u8]) -> Result<()> {
        self.store.set(&Self::key(seq, self.rank), data)?;
        let start = Instant::now();
        let mut waiting: Vec<usize> = (0..self.world_size).collect();
        loop {
            let keys: Vec<String> = waiting.iter().map(|&r| Self::key(seq, r)).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let remaining = self.timeout.saturating_sub(start.elapsed());
            match self.store.wait(&refs, remaining.min(PROGRESS_INTERVAL)) {
                Ok(()) => break,
                Err(Error::StoreTimeout { missing, .. }) => {
                    waiting.retain(|&r| missing.contains(&Self::key(seq, r)));
                    if start.elapsed() >= self.timeout {
                        let waited = start.elapsed();
                        self.abandon_round(seq, self.world_size - waiting.len());
                        return Err(Error::BootstrapTimeout {
                            phase: phase.to_string(),
                            world_size: self.world_size,
                            missing: waiting,
                            waited,
                        });
                    }
                    tracing::warn!(
                        "bootstrap {phase}: rank {} still waiting after {:.0?} for ranks {waiting:?}",
                        self.rank,
                        start.elapsed()
                    );
                }
                Err(other) => return Err(other),
            }
        }
        // Everyone has posted round `seq`, so everyone is done reading round `seq - 1`.
        if seq > 0
            && let Err(e) = self.store.delete(&Self::key(seq - 1, self.rank))
        {
            tracing::debug!("bootstrap: could not delete an old rendezvous key: {e}");
        }
        self.depart_round(seq)
    }

    /// Records that this rank has seen round `seq` complete. A rank whose end can end the
    /// store (its process hosts it, or its node's launcher does) waits until every rank
    /// has: otherwise, when a round is a job's last, it could exit (taking the store with
    /// it) while a slower rank is still on its way through the round, and that rank would
    /// fail with "connection reset" (seen with `ferrorun` on two nodes: a node-1 rank's
    /// last `add` met node 0's launcher already gone).
    fn depart_round(&self, seq: u64) -> Result<()> {
        let counter = format!("departed/{seq}");
        let all_gone = format!("departed/{seq}/all");
        if self.store.add(&counter, 1)? == self.world_size as i64 {
            self.store.set(&all_gone, b"")?;
        }
        if self.store_ends_with_rank {
            // The two keys stay: several ranks of one process may all be hosts, and a
            // host that deleted them could strand another still about to wait.
            self.store.wait(&[&all_gone], self.timeout)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HashStore;

    fn run_ranks<T: Send + 'static>(
        world: usize,
        store: &HashStore,
        timeout: Duration,
        f: impl Fn(Result<Bootstrap>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let store: Arc<dyn Store> = Arc::new(store.clone());
                let f = f.clone();
                std::thread::spawn(move || {
                    f(Bootstrap::new(
                        store,
                        rank,
                        world,
                        &BootstrapOptions {
                            timeout,
                            ..Default::default()
                        },
                    ))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn threads_gather_peers_and_data() {
        let out = run_ranks(5, &HashStore::new(), Duration::from_secs(20), |boot| {
            let boot = boot.unwrap();
            assert_eq!(boot.peers().len(), 5);
            assert_eq!(boot.local_ranks(), vec![0, 1, 2, 3, 4]);
            assert_eq!(boot.local_rank(), boot.rank());
            let mut all = Vec::new();
            for round in 0..3u8 {
                let got = boot.all_gather(&[boot.rank() as u8, round]).unwrap();
                all.push(got);
                boot.barrier().unwrap();
            }
            all
        });
        for per_rank in out {
            for (round, got) in per_rank.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..5u8).map(|r| vec![r, round as u8]).collect();
                assert_eq!(got, &want);
            }
        }
    }

    #[test]
    fn a_missing_rank_is_named() {
        let store = HashStore::new();
        // World of 4, only ranks 0, 1 and 3 arrive.
        let handles: Vec<_> = [0usize, 1, 3]
            .into_iter()
            .map(|rank| {
                let store: Arc<dyn Store> = Arc::new(store.clone());
                std::thread::spawn(move || {
                    let options = BootstrapOptions {
                        timeout: Duration::from_millis(300),
                        ..Default::default()
                    };
                    Bootstrap::new(store, rank, 4, &options).unwrap_err()
                })
            })
            .collect();
        for h in handles {
            match h.join().unwrap() {
                Error::BootstrapTimeout {
                    missing,
                    world_size,
                    phase,
                    ..
                } => {
                    assert_eq!(missing, vec![2]);
                    assert_eq!(world_size, 4);
                    assert!(phase.contains("peer-info"), "{phase}");
                }
                other => panic!("unexpected error {other}"),
            }
        }
    }

    #[test]
    fn a_rank_claimed_twice_is_an_error() {
        let store = HashStore::new();
        let options = BootstrapOptions {
            timeout: Duration::from_millis(200),
            ..Default::default()
        };
        let first = Bootstrap::new(Arc::new(store.clone()), 0, 2, &options).unwrap_err();
        assert!(matches!(first, Error::BootstrapTimeout { .. }));
        let second = Bootstrap::new(Arc::new(store.clone()), 0, 2, &options).unwrap_err();
        assert!(second.to_string().contains("claimed twice"), "{second}");
    }

    #[test]
    fn bad_rank_and_world_size_are_rejected() {
        let store: Arc<dyn Store> = Arc::new(HashStore::new());
        let opts = BootstrapOptions::default();
        assert!(Bootstrap::new(store.clone(), 0, 0, &opts).is_err());
        let err = Bootstrap::new(store, 3, 3, &opts).unwrap_err().to_string();
        assert!(err.contains("rank 3"), "{err}");
    }

    #[test]
    fn world_size_disagreement_is_named() {
        let store = HashStore::new();
        let opts = BootstrapOptions {
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let s1: Arc<dyn Store> = Arc::new(store.clone());
        let o1 = opts.clone();
        // Rank 0 believes the world has 2 ranks, rank 1 that it has 3 (a third rank's
        // info is planted so that rank 1's wait completes too): each names the other.
        let h = std::thread::spawn(move || Bootstrap::new(s1, 1, 3, &o1));
        let peer2 = PeerInfo::local(2, 3, vec![]);
        let s0: Arc<dyn Store> = Arc::new(store.clone());
        s0.set(&Bootstrap::key(0, 2), &peer2.encode()).unwrap();
        let err = Bootstrap::new(Arc::new(store.clone()), 0, 2, &opts).unwrap_err();
        assert!(
            matches!(&err, Error::BootstrapData { rank: 1, detail } if detail.contains("world size 3")),
            "{err}"
        );
        let err1 = h.join().unwrap().unwrap_err();
        assert!(
            matches!(&err1, Error::BootstrapData { rank: 0, detail } if detail.contains("world size 2")),
            "{err1}"
        );
    }

    #[test]
    fn unique_id_rendezvous_over_tcp() {
        let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                std::thread::spawn(move || {
                    let opts = BootstrapOptions {
                        timeout: Duration::from_secs(20),
                        ..Default::default()
                    };
                    let boot = Bootstrap::from_unique_id(&id, rank, 4, &opts).unwrap();
                    boot.all_gather(&[rank as u8]).unwrap()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![vec![0], vec![1], vec![2], vec![3]]);
        }
        assert!(id.stop_server());
    }

    #[test]
    fn the_store_binds_to_master_addr_when_it_is_this_hosts() {
        let local = store_bind_addr("127.0.0.1", 0);
        assert_eq!(local.ip().to_string(), "127.0.0.1");
        // 192.0.2.1 (TEST-NET-1) is nobody's address here: every interface.
        let elsewhere = store_bind_addr("192.0.2.1", 29500);
        assert!(elsewhere.ip().is_unspecified() && elsewhere.port() == 29500);
    }
}
