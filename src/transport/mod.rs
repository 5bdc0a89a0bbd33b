//! Point-to-point connections between the ranks of a communicator.
//!
//! Every transport presents the same thing to the engine: one [`fifo`] per (channel,
//! sender, receiver), with flow control by slot counters, and one [`bell`] per rank to
//! sleep on. When LL is allowed, ranks of one host have a second, small FIFO per
//! (channel, sender, receiver) in the [LL](Protocol::LL) format, for calls the cost
//! model gives to LL; over TCP every call uses the Simple FIFOs (the proxies and the
//! socket set the pace there, not the FIFO format). What differs is where the memory lives:
//!
//! | transport | used between | memory |
//! | --- | --- | --- |
//! | in-process | ranks that are threads of one process | heap blocks, found by name in a process-wide table |
//! | shared memory | processes on one host | files in `/dev/shm`, mapped by both sides and unlinked as soon as both have |
//! | [`tcp`] | ranks on different hosts (or any, when forced) | a FIFO on each side, proxy threads moving slots over one socket per channel and pair |
//! | `rdma` (cargo feature `rdma`) | ranks on different hosts that both have an RDMA device (`NCCL_NET`) | a FIFO on each side, registered with the NIC, which writes slots straight into the peer's |
//!
//! [`Connections::establish`] is collective over the communicator's [`Bootstrap`]: every
//! rank creates the FIFOs it receives on and its bell, all meet at a barrier, every rank
//! maps its peers' FIFOs and bells, all meet again, and the creators remove the names.
//! A crash leaves nothing in `/dev/shm` after that point.

pub mod bell;
pub mod cuda_ipc;
pub mod fifo;
pub mod lazy;
pub mod liveness;
#[cfg(feature = "rdma")]
pub mod rdma;
mod routes;
pub mod segment;
mod shm;
pub mod single_copy;
pub mod tcp;
pub mod window;

use std::sync::Arc;
use std::time::Duration;

use bell::{Bell, Closed};
pub use fifo::Protocol;
use fifo::{Geometry, RecvEnd, SendEnd};
use liveness::Liveness;
pub use tcp::Striping;
use tcp::{LinkState, TcpLink};

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::plan::P2P_CHANNEL;
use crate::tune::Crowding;

/// How the engine writes the slots of FIFOs to peers on its host
/// (`FERROCCL_SLOT_STORES`; see [`fifo`], "far" peers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SlotStores {
    /// Plain stores, and towards a peer whose cache the hand-offs measure as far, the
    /// faster of plain and non-temporal ones, timed on the calls
    /// ([`crate::tune::stores`]).
    #[default]
    Auto,
    /// Plain stores always.
    Plain,
    /// Non-temporal stores always (slices of
    /// [`FAR_SLOT_STREAMING_FROM`](crate::engine::FAR_SLOT_STREAMING_FROM) or more).
    Streaming,
}

impl SlotStores {
    /// Reads `auto`, `plain` or `streaming` (case-insensitive; empty is auto).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(SlotStores::Auto),
            "plain" => Ok(SlotStores::Plain),
            "streaming" => Ok(SlotStores::Streaming),
            other => Err(format!("{other:?} is not one of auto, plain, streaming")),
        }
    }
}

/// Which transport to use between ranks on one host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory between processes, process memory between threads, TCP across
    /// hosts.
    #[default]
    Auto,
    /// `/dev/shm` FIFOs even between threads of one process (`FERROCCL_TRANSPORT=shm`).
    Shm,
    /// TCP between every pair of ranks, even on one host (`FERROCCL_TRANSPORT=tcp`).
    Tcp,
}

impl TransportChoice {
    /// The host each rank counts as on (labels as [`crate::topo::host_labels`]): ranks
    /// with the same host id share one, except that with TCP forced every rank is a
    /// host of its own. Plans, the cost model and the transports all go by this.
    pub fn host_labels(self, peers: &[crate::bootstrap::PeerInfo]) -> Vec<usize> {
        match self {
            TransportChoice::Tcp => (0..peers.len()).collect(),
            _ => crate::topo::host_labels(peers),
        }
    }
}

/// Which network carries traffic between hosts (`NCCL_NET`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NetChoice {
    /// RDMA between ranks that both have a usable device (with the `rdma` feature),
    /// TCP otherwise.
    #[default]
    Auto,
    /// TCP sockets (`NCCL_NET=Socket`).
    Socket,
    /// RDMA only (`NCCL_NET=IB`): a rank without a usable device fails at
    /// initialisation, naming why.
    Ib,
}

impl NetChoice {
    /// Reads NCCL's names (`IB`, `Socket`, case-insensitive; empty is auto).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(NetChoice::Auto),
            "socket" => Ok(NetChoice::Socket),
            "ib" => Ok(NetChoice::Ib),
            other => Err(format!("{other:?} is not one of IB, Socket")),
        }
    }
}

/// How to connect a communicator's ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportConfig {
    /// Shape of every Simple FIFO, but those of `dedicated` and `crowded`.
    pub geometry: Geometry,
    /// Shape of the Simple FIFOs between ranks of one host where every rank there has a
    /// core of its own (more slots than `geometry`).
    pub dedicated: Geometry,
    /// Shape of the Simple FIFOs between ranks of one host whose ranks outnumber its
    /// cores (fewer slots than `geometry`).
    pub crowded: Geometry,
    /// Shape of the LL FIFOs between ranks of one host that outnumber its cores; `None`:
    /// no LL FIFOs.
    pub ll: Option<Geometry>,
    /// Shape of the LL FIFOs between ranks of one host that each have a core (the same
    /// payload as `ll`, more slots); `None`: no LL FIFOs.
    pub dedicated_ll: Option<Geometry>,
    /// Whether calls may use single copy (`FERROCCL_PROTO` allows it): without it the
    /// probe at initialisation, two all-gathers, is skipped.
    pub single_copy: bool,
    /// How slots towards peers on this host are written.
    pub slot_stores: SlotStores,
    /// Whether the two FIFOs of a protocol between two ranks of this host exchange
    /// slots ([`fifo::exchange_slots`]; LL FIFOs only where every rank has a core).
    pub slot_exchange: bool,
    /// The ring of each collective channel (every channel connects every pair of ranks).
    pub rings: Vec<Vec<usize>>,
    /// Which transport to use.
    pub choice: TransportChoice,
    /// How long to wait for peers' connections.
    pub connect_timeout: Duration,
    /// How long a TCP peer may stay silent (data unacknowledged, or keep-alive probes
    /// unanswered) before its connection counts as broken.
    pub link_timeout: Duration,
    /// Sockets and helper threads per TCP link.
    pub striping: Striping,
    /// Which network to use between hosts.
    pub net: NetChoice,
    /// RDMA settings.
    #[cfg(feature = "rdma")]
    pub rdma: rdma::RdmaConfig,
}

impl TransportConfig {
    /// The formats of the Simple and the LL FIFOs between ranks of one host. Where every
    /// rank of the host has a core, they are `dedicated`, deeper: short Simple messages
    /// rotate through all of their memory ([`fifo::SendEnd::set_rotating`]), and a walk
    /// longer than the reader's L2 cache comes back to lines the reader has dropped,
    /// which the writer takes without invalidating the reader's copy. Measured,
    /// 2 ranks on 2 cores (1 MiB of L2 each), all-reduce: 8 slots of 128 KiB (1 MiB a
    /// FIFO) → 16 (2 MiB): 32 KiB 3.4 → 2.3 µs, 64 KiB 5.9 → 4.2, 128 KiB 9.8 → 7.9. An LL
    /// message lies at its slot's start, so there more slots are the longer walk (see
    /// `CommConfig::dedicated_ll_slots`). Ranks that take turns on a core walk all of
    /// their FIFOs through that core's caches, so there they are `crowded`, shorter: the
    /// larger FIFO measured slower (4 ranks on 2 cores: 16 slots against 8, 256 KiB 52 →
    /// 65–71 µs; 8 ranks, 2 slots against 8: see
    /// [`crate::comm::CommConfig::crowded_slots`]).
    fn local_geometries(&self, oversubscribed: bool) -> (Geometry, Option<Geometry>) {
        match oversubscribed {
            true => (self.crowded, self.ll),
            false => (self.dedicated, self.dedicated_ll),
        }
    }

    /// Checks the FIFO formats and that every ring lists all `nranks` ranks.
    fn validate(&self, nranks: usize) -> Result<()> {
        self.geometry.validate()?;
        self.dedicated.validate()?;
        self.crowded.validate()?;
        let lls = [self.ll, self.dedicated_ll];
        if self.geometry.protocol != Protocol::Simple
            || lls.iter().flatten().any(|g| g.protocol != Protocol::LL)
            || self.ll.map(|g| g.payload()) != self.dedicated_ll.map(|g| g.payload())
        {
            return Err(Error::invalid(format!(
                "transport: FIFO formats {:?}, {:?} and {:?} are not Simple and LL of one \
                 payload",
                self.geometry, self.ll, self.dedicated_ll
            )));
        }
        for ll in lls.iter().flatten() {
            ll.validate()?;
        }
        let channels = self.rings.len();
        if channels == 0 || self.rings.iter().any(|r| r.len() != nranks) {
            return Err(Error::invalid(format!(
                "transport: {channels} rings, each must list all {nranks} ranks"
            )));
        }
        Ok(())
    }
}

/// The RDMA device ports the ranks of this host would use for peers on other hosts, as
/// the transport picks them (`rdma::open_nic`, built with the `rdma` feature), or why
/// there is none. For `ferroccl-topo`.
pub fn rdma_device_here() -> std::result::Result<String, String> {
    #[cfg(feature = "rdma")]
    {
        let config = rdma::RdmaConfig::from_env().map_err(|e| e.to_string())?;
        let (_, allowed) = rdma::allowed_ports(&config)?;
        let in_turn = rdma::ports_in_turn(&config, &allowed);
        let first = rdma::open_nic(&config, 0, 0, 1, 8).map(|nic| rdma::describe(nic.as_ref()))?;
        Ok(if in_turn.len() > 1 {
            let ports: Vec<String> = in_turn
                .iter()
                .map(|d| format!("{}:{}", d.name, d.port))
                .collect();
            format!(
                "{first} for local rank 0; the ranks of a host take the {} ports in turn \
                 (FERROCCL_IB_SPREAD=1): {}",
                ports.len(),
                ports.join(", ")
            )
        } else {
            first
        })
    }
    #[cfg(not(feature = "rdma"))]
    Err("ferroccl was built without the `rdma` feature".into())
}

/// A link to a peer on another host, over TCP or RDMA: the engine sees the same FIFOs.
enum NetLink {
    Tcp(TcpLink),
    #[cfg(feature = "rdma")]
    Rdma(rdma::RdmaLink),
}

impl NetLink {
    fn ring_send(&self) {
        match self {
            NetLink::Tcp(l) => l.ring_send(),
            #[cfg(feature = "rdma")]
            NetLink::Rdma(l) => l.ring_send(),
        }
    }

    fn ring_recv(&self) {
        match self {
            NetLink::Tcp(l) => l.ring_recv(),
            #[cfg(feature = "rdma")]
            NetLink::Rdma(l) => l.ring_recv(),
        }
    }

    fn read_in_line(&self) {
        match self {
            NetLink::Tcp(l) => l.read_in_line(),
            #[cfg(feature = "rdma")]
            NetLink::Rdma(l) => l.read_in_line(),
        }
    }

    /// Before the engine looks for room in the FIFO towards the peer: RDMA links poll
    /// their completions (credits) in line; TCP links have nothing to do.
    fn poll_for_room(&self) {
        match self {
            NetLink::Tcp(_) => {}
            #[cfg(feature = "rdma")]
            NetLink::Rdma(l) => l.read_in_line(),
        }
    }

    fn stop_reading(&self) {
        match self {
            NetLink::Tcp(l) => l.stop_reading(),
            #[cfg(feature = "rdma")]
            NetLink::Rdma(_) => {}
        }
    }

    fn state(&self) -> LinkState {
        match self {
            NetLink::Tcp(l) => l.state(),
            #[cfg(feature = "rdma")]
            NetLink::Rdma(l) => l.state(),
        }
    }

    fn close(&mut self, why: Closed) {
        match self {
            NetLink::Tcp(l) => l.close(why),
            #[cfg(feature = "rdma")]
            NetLink::Rdma(l) => l.close(why),
        }
    }
}

/// A peer's state, as far as this rank can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerState {
    /// Running and connected.
    Alive,
    /// Its process is gone.
    Exited,
    /// It closed its communicator (see [`Closed`]).
    Closed(Closed),
    /// Its connection broke (process, host or link gone), with what was seen.
    Unreachable(String),
}

impl PeerState {
    /// The rank to blame and what happened, as seen by looking at `peer`; `None` while
    /// `peer` is alive. A peer that aborted because another rank failed passes the blame
    /// on to that rank, so news of a failure spreads to every rank at once.
    pub fn failure(&self, peer: usize) -> Option<(usize, String)> {
        Some(match self {
            PeerState::Alive => return None,
            PeerState::Closed(Closed::PeerFailed(first)) => (
                *first,
                format!("rank {first} failed (reported by rank {peer}, which aborted)"),
            ),
            PeerState::Exited => (peer, format!("rank {peer} died (its process is gone)")),
            PeerState::Unreachable(what) => (peer, format!("rank {peer} is unreachable: {what}")),
            PeerState::Closed(_) => (
                peer,
                format!("rank {peer} aborted or destroyed its communicator"),
            ),
        })
    }
}

/// One rank's connections to its peers.
pub struct Connections {
    rank: usize,
    nranks: usize,
    channels: usize,
    /// `[protocol index][channel index][peer]` (see [`Protocol::index`]); the last
    /// channel index is the point-to-point channel.
    sends: Vec<Vec<Vec<Option<SendEnd>>>>,
    recvs: Vec<Vec<Vec<Option<RecvEnd>>>>,
    bell: Bell,
    peer_bells: Vec<Option<Bell>>,
    liveness: Vec<Option<Liveness>>,
    /// `[channel index][peer]`: the network link, for peers on other hosts.
    links: Vec<Vec<Option<NetLink>>>,
    /// This rank's RDMA links' device and proxy (dropped after the links are closed).
    #[cfg(feature = "rdma")]
    rdma: Option<rdma::RdmaNet>,
    /// A second view of this rank's bell, for [`Connections::abort_handle`].
    own_bell: Arc<Bell>,
    /// How FIFOs not made at establishment are made on first use.
    lazy: lazy::LazyFifos,
    geometry: Geometry,
    ll: Option<Geometry>,
    /// More ranks on this machine than CPUs they may use (see [`oversubscribed`]).
    oversubscribed: bool,
    /// The job's most crowded machine (see [`crowding`]), for the cost model.
    crowding: Crowding,
    /// How slots towards peers on this host are written.
    slot_stores: SlotStores,
    /// Link speed (Gb/s) of the slowest RDMA device in the job, when every pair of
    /// ranks on different hosts talks over RDMA.
    rdma_link_gbps: Option<f64>,
    /// How this rank reads its peers' memory for single-copy calls, or why it may not
    /// (the same verdict on every rank).
    peer_memory: std::result::Result<single_copy::PeerMemory, String>,
    /// Where single-copy calls stage what they read before reducing it.
    staging: Vec<u8>,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("channels", &self.channels)
            .field("geometry", &self.geometry)
            .finish_non_exhaustive()
    }
}

/// The FIFO ends and network links a rank's connection phases make.
pub(crate) struct Ends {
    /// `[protocol index][channel index][peer]`.
    pub(crate) sends: Vec<Vec<Vec<Option<SendEnd>>>>,
    /// `[protocol index][channel index][peer]`.
    pub(crate) recvs: Vec<Vec<Vec<Option<RecvEnd>>>>,
    /// `[channel index][peer]`.
    links: Vec<Vec<Option<NetLink>>>,
}

impl Ends {
    /// Sets whether the FIFOs to and from this host's ranks rotate short messages
    /// through their slots ([`fifo::SendEnd::set_rotating`]); network FIFOs, which
    /// proxies fill and drain, never do.
    fn rotate_local(&mut self, routes: &routes::Routes, on: bool) {
        /// Calls `set` on every end of `table` (`[protocol][channel][peer]`) whose
        /// peer is on this host.
        fn each_local<E>(
            table: &mut [Vec<Vec<Option<E>>>],
            routes: &routes::Routes,
            set: impl Fn(&mut E),
        ) {
            for per_peer in table.iter_mut().flatten() {
                for (p, end) in per_peer.iter_mut().enumerate() {
                    if let Some(end) = end.as_mut().filter(|_| routes.is_local_peer(p)) {
                        set(end);
                    }
                }
            }
        }
        each_local(&mut self.sends, routes, |e| e.set_rotating(on));
        each_local(&mut self.recvs, routes, |e| e.set_rotating(on));
    }

    /// Where `on`, pairs this rank's FIFOs to and from each peer of this host to exchange
    /// slots ([`exchange_local_slots`]; LL ones only where every rank has a core,
    /// `dedicated`), and says at INFO with which peers it does, or that it is off.
    fn exchange_local_slots(&mut self, rank: usize, on: bool, dedicated: bool) -> Result<()> {
        if !on {
            tracing::info!(
                "rank {rank}: slot exchange off (FERROCCL_SLOT_EXCHANGE=0, or \
                 CommConfig::slot_exchange): the FIFOs between ranks of this host keep \
                 their slots"
            );
            return Ok(());
        }
        exchange_local_slots(
            &mut self.sends,
            &mut self.recvs,
            &self.links,
            rank,
            exchanging_protocols(dedicated),
        )?;
        let simple = &self.sends[Protocol::Simple.index()];
        // Peers in order, each once (a peer's FIFOs on several channels pair alike), as
        // the routes line lists them.
        let paired: Vec<usize> = (0..simple.first().map_or(0, Vec::len))
            .filter(|&peer| {
                simple.iter().any(|per_peer| {
                    per_peer[peer]
                        .as_ref()
                        .is_some_and(SendEnd::exchanges_slots)
                })
            })
            .collect();
        if !paired.is_empty() {
            let which = match dedicated {
                true => "Simple and LL",
                false => "Simple",
            };
            tracing::info!(
                "rank {rank}: the {which} FIFOs to and from ranks {paired:?} exchange slots \
                 (a rank sends in the memory it has just drained)"
            );
        }
        Ok(())
    }

    /// None yet, for `channels` ring channels (and the point-to-point one) and `nranks`.
    fn new(channels: usize, nranks: usize) -> Self {
        Ends {
            recvs: (0..2).map(|_| table(channels + 1, nranks)).collect(),
            sends: (0..2).map(|_| table(channels + 1, nranks)).collect(),
            links: table(channels + 1, nranks),
        }
    }
}

/// The protocols whose FIFOs between ranks of one host exchange slots: Simple always,
/// LL only where every rank of the host has a core (`dedicated`). An LL slot that moves
/// costs its next reader a look at a record the other rank wrote; with a core each, the
/// writer saves more than that by writing lines its own cache holds (2 ranks, 2 KiB
/// all-reduce, 0.86–0.97 → 0.70–0.78 µs), but ranks that take turns on a core find the
/// lines in that core's cache anyway, and there the records only cost (8 ranks on 2
/// cores, 4–8 KiB: 14.6 → 14.8–17.7 µs and 19.6–20.3 → 21.1–22.7).
fn exchanging_protocols(dedicated: bool) -> &'static [Protocol] {
    match dedicated {
        true => &[Protocol::Simple, Protocol::LL],
        false => &[Protocol::Simple],
    }
}

/// Pairs every FIFO of `protocols` this rank sends on towards a peer of this host with
/// the one it receives on from the same peer on the same channel, where both exist and
/// are not paired yet, so that the two exchange slots ([`fifo::exchange_slots`]). Every
/// rank calls it at the same points (after establishment, after each connection phase),
/// so both ranks of a pair pair their ends before either uses them again. FIFOs of a
/// network link (`links`) are filled and drained by proxies and never pair.
fn exchange_local_slots(
    sends: &mut [Vec<Vec<Option<SendEnd>>>],
    recvs: &mut [Vec<Vec<Option<RecvEnd>>>],
    links: &[Vec<Option<NetLink>>],
    rank: usize,
    protocols: &[Protocol],
) -> Result<()> {
    for &protocol in protocols {
        let f = protocol.index();
        for (ci, (to, from)) in sends[f].iter_mut().zip(recvs[f].iter_mut()).enumerate() {
            for (peer, (send, recv)) in to.iter_mut().zip(from.iter_mut()).enumerate() {
                let other_on_host = peer != rank && on_host(links, ci, peer);
                if let (Some(send), Some(recv), true) = (send, recv, other_on_host)
                    && !send.exchanges_slots()
                {
                    fifo::exchange_slots(send, recv, rank < peer)?;
                }
            }
        }
    }
    Ok(())
}

/// Whether `peer` is reached on channel index `ci` through memory this rank shares with
/// it (or is this rank), not through a network link.
fn on_host(links: &[Vec<Option<NetLink>>], ci: usize, peer: usize) -> bool {
    links[ci].get(peer).is_some_and(Option::is_none)
}

/// Says at INFO how this rank reaches its peers.
fn log_routes(
    routes: &routes::Routes,
    config: &TransportConfig,
    local: Geometry,
    local_ll: Option<Geometry>,
    net: &NetDevice,
    tcp_links: usize,
) {
    use routes::Path;
    let (rank, nranks) = (routes.rank, routes.nranks);
    let tcp = routes.via(Path::Tcp);
    let rdma = routes.via(Path::Rdma);
    if !tcp.is_empty()
        && let Some(why) = &net.unusable
    {
        tracing::info!("rank {rank}: no RDMA ({why}); peers on other hosts use TCP");
    }
    let ll = match local_ll {
        Some(g) if nranks == 1 || tcp.len() + rdma.len() < nranks - 1 => {
            format!(
                "of {} x {} B (between ranks of one host)",
                g.slots,
                g.payload()
            )
        }
        Some(_) => "unused (every peer is on another host)".to_string(),
        None => "off".to_string(),
    };
    tracing::info!(
        "rank {rank}: peers {:?} via shared memory, {:?} in process, {rdma:?} via RDMA{}, \
         {tcp:?} via TCP ({tcp_links} links of {} threads x {} sockets); {} channel(s), \
         FIFOs of {} x {} B ({} slots between ranks of one host), LL FIFOs {ll}",
        routes.via(Path::Shm),
        routes.via(Path::InProcess),
        net.device
            .as_deref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default(),
        config.striping.threads,
        config.striping.sockets_per_thread,
        routes.channels,
        config.geometry.slots,
        config.geometry.slot_bytes,
        local.slots,
    );
}

/// A `rows` × `cols` table of empty cells.
fn table<T>(rows: usize, cols: usize) -> Vec<Vec<Option<T>>> {
    (0..rows)
        .map(|_| (0..cols).map(|_| None).collect())
        .collect()
}

impl Connections {
    /// Connects this rank to its peers (collective: every rank of `boot` must call it
    /// with the same configuration), in phases: decide how each peer is reached
    /// (`routes`), make this rank's shared memory (`shm`), connect TCP ([`tcp`]),
    /// connect RDMA (`rdma`), open the local peers' shared memory, agree on CPU
    /// sharing; FIFOs beyond the rings are made on first use ([`lazy`]).
    pub fn establish(boot: &Bootstrap, config: &TransportConfig) -> Result<Self> {
        config.validate(boot.world_size())?;
        let rank = boot.rank();
        let hosts = config.choice.host_labels(boot.peers());
        // This rank's place among the ranks of its host: they take the RDMA ports in turn.
        let local_rank = (0..rank).filter(|&r| hosts[r] == hosts[rank]).count();
        #[cfg_attr(not(feature = "rdma"), allow(unused_mut))]
        let mut net = NetDevice::open(
            config,
            rank,
            local_rank,
            routes::wants_rdma(config, &hosts, rank),
        );
        let listener = routes::listen_for_other_hosts(boot, &hosts)?;
        let routes = routes::Routes::agree(boot, config, &net, listener.as_ref())?;
        let mut ends = Ends::new(routes.channels, routes.nranks);
        // Every rank says which machine it runs on and which of its CPUs it may use; both
        // ends of a FIFO between ranks of this host see the same answer.
        let (oversubscribed, crowding) = CpuShare::gather(boot)?;
        let (local, local_ll) = config.local_geometries(oversubscribed);
        let formats: Vec<Geometry> = std::iter::once(local).chain(local_ll).collect();
        let shm = shm::SharedMemory::create(boot, &routes, &config.rings, &formats, &mut ends)?;
        let tcp_links =
            tcp::connect_links(&routes, config, listener.as_ref(), &shm.own_bell, &mut ends)?;
        #[cfg(feature = "rdma")]
        let rdma_net = rdma::connect_links(
            boot,
            &routes,
            config,
            net.nic.take(),
            &shm.own_bell,
            &mut ends,
        )?;
        boot.barrier()?;
        let (peer_bells, liveness) = shm.open_peers(&routes, boot.peers(), &mut ends)?;
        // Every rank has opened its FIFOs (their names may go), and nothing has been
        // sent yet.
        boot.barrier()?;
        ends.rotate_local(&routes, !oversubscribed);
        ends.exchange_local_slots(rank, config.slot_exchange, !oversubscribed)?;
        if !oversubscribed {
            tracing::info!(
                "rank {rank}: every rank here has a core: short messages rotate through \
                 their FIFO slots"
            );
        }
        // Every rank has the same protocols (checked at initialisation), so all skip
        // the probe alike.
        let peer_memory = if config.single_copy {
            single_copy::agree(boot, &routes)?
        } else {
            Err("FERROCCL_PROTO leaves it out".to_string())
        };
        match &peer_memory {
            Ok(_) => tracing::info!(
                "rank {rank}: single copy available (ranks read each other's buffers)"
            ),
            Err(why) => tracing::info!("rank {rank}: single copy off: {why}"),
        }
        let shm::SharedMemory {
            bell,
            own_bell,
            created,
            ..
        } = shm;
        drop(created);
        log_routes(&routes, config, local, local_ll, &net, tcp_links);
        Ok(Connections {
            lazy: lazy::LazyFifos::new(
                boot,
                &routes,
                [Some(local), local_ll],
                !oversubscribed,
                config.slot_exchange,
            ),
            rank,
            nranks: routes.nranks,
            channels: routes.channels,
            sends: ends.sends,
            recvs: ends.recvs,
            bell,
            peer_bells,
            liveness,
            links: ends.links,
            #[cfg(feature = "rdma")]
            rdma: rdma_net,
            own_bell,
            geometry: config.geometry,
            ll: local_ll,
            oversubscribed,
            crowding,
            slot_stores: config.slot_stores,
            rdma_link_gbps: routes.rdma_link_gbps,
            staging: if peer_memory.is_ok() {
                vec![0; single_copy::STAGING_BYTES]
            } else {
                Vec::new()
            },
            peer_memory,
        })
    }

    /// Link speed (Gb/s) of the slowest RDMA device of the job, when every pair of ranks
    /// on different hosts talks over RDMA (the same on every rank): the cost model's
    /// network bandwidth then.
    pub fn rdma_link_gbps(&self) -> Option<f64> {
        self.rdma_link_gbps
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The Simple FIFOs' shape.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Bytes of one slice of a call that uses `protocol`: what one slot of that
    /// protocol carries (LL slices also travel through Simple FIFOs, to peers reached
    /// over TCP, so every rank cuts a call the same way).
    pub fn slice_bytes(&self, protocol: Protocol) -> usize {
        match (protocol, self.ll) {
            (Protocol::LL, Some(ll)) => ll.payload(),
            _ => self.geometry.payload(),
        }
    }

    /// How this rank reads its peers' buffers for single-copy calls, or why it may not
    /// (every rank has the same verdict, so the protocol is chosen alike).
    pub fn peer_memory(&self) -> std::result::Result<&single_copy::PeerMemory, &str> {
        self.peer_memory.as_ref().map_err(String::as_str)
    }

    /// [`Connections::peer_memory`], to add or drop windows.
    pub(crate) fn peer_memory_mut(&mut self) -> Option<&mut single_copy::PeerMemory> {
        self.peer_memory.as_mut().ok()
    }

    /// The staging buffer of single-copy reductions ([`single_copy::STAGING_BYTES`]),
    /// with the reader of peers' memory.
    pub(crate) fn single_copy_parts(
        &mut self,
    ) -> Option<(&single_copy::PeerMemory, *mut u8, usize)> {
        let memory = self.peer_memory.as_ref().ok()?;
        Some((memory, self.staging.as_mut_ptr(), self.staging.len()))
    }

    /// Whether this machine runs more ranks than they have CPUs (waiting then yields the
    /// core instead of spinning, and TCP links are read by their proxies only).
    pub fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    /// Ranks against CPUs on the job's most crowded machine (the same on every rank).
    pub fn crowding(&self) -> Crowding {
        self.crowding
    }

    fn channel_index(&self, channel: usize) -> Option<usize> {
        if channel == P2P_CHANNEL {
            Some(self.channels)
        } else {
            (channel < self.channels).then_some(channel)
        }
    }

    /// The sending end towards `to` on `channel`, and the receiving end from `from`
    /// on the same channel (either may be absent), borrowed together: the FIFOs of
    /// `protocol`, except that peers over TCP have only Simple ones.
    pub fn ends(
        &mut self,
        channel: usize,
        protocol: Protocol,
        to: Option<usize>,
        from: Option<usize>,
    ) -> (Option<&mut SendEnd>, Option<&mut RecvEnd>) {
        let Some(ci) = self.channel_index(channel) else {
            return (None, None);
        };
        // LL calls to a peer over TCP use the Simple FIFOs of its link; single-copy
        // descriptors travel in the Simple FIFOs.
        let f = protocol.fifo().index();
        let place = |p: usize| {
            (p < self.nranks).then(|| (if self.links[ci][p].is_some() { 0 } else { f }, p))
        };
        let (to, from) = (to.and_then(place), from.and_then(place));
        let send = to.and_then(|(f, p)| self.sends[f][ci][p].as_mut());
        let recv = from.and_then(|(f, p)| self.recvs[f][ci][p].as_mut());
        (send, recv)
    }

    /// Whether a call's slots of `protocol` towards `peer` should be written with
    /// non-temporal stores: it is on this host, and `FERROCCL_SLOT_STORES=streaming`, or
    /// (`auto`) the call `may_stream` (the trial of its size chose non-temporal stores)
    /// and `peer` finds this rank's slots of that protocol coming from a far cache
    /// ([`fifo::SendEnd::receiver_finds_far`]: each receiver judges its own sender, so
    /// the next rank of a ring judges this one; the FIFOs of the call's own protocol, so
    /// that the verdict is as recent as the calls that use it).
    pub fn streams_slots_to(&self, peer: usize, protocol: Protocol, may_stream: bool) -> bool {
        let on_host = |ci: usize| on_host(&self.links, ci, peer);
        match self.slot_stores {
            SlotStores::Plain => false,
            SlotStores::Streaming => {
                peer != self.rank && peer < self.nranks && (0..self.links.len()).all(on_host)
            }
            SlotStores::Auto if !may_stream => false,
            SlotStores::Auto => {
                let f = protocol.fifo().index();
                self.sends[f].iter().enumerate().any(|(ci, per_peer)| {
                    on_host(ci)
                        && per_peer
                            .get(peer)
                            .and_then(Option::as_ref)
                            .is_some_and(SendEnd::receiver_finds_far)
                })
            }
        }
    }

    /// This rank's own bell (to sleep on).
    pub fn bell(&self) -> &Bell {
        &self.bell
    }

    /// A handle that closes this rank's bell from any thread, without the
    /// `Connections` (which a running call holds): the call sees it at its next wait and
    /// fails, and so do peers waiting on this rank.
    pub fn abort_handle(&self) -> Arc<Bell> {
        self.own_bell.clone()
    }

    /// After committing a slot towards `peer` on `channel`: wakes whoever drains it
    /// (the peer, or the TCP send proxy).
    pub fn ring_send(&self, channel: usize, peer: usize) {
        match self.link(channel, peer) {
            Some(link) => link.ring_send(),
            None => self.ring_peer(peer),
        }
    }

    /// After releasing a slot received from `peer` on `channel`: wakes whoever fills it.
    pub fn ring_recv(&self, channel: usize, peer: usize) {
        match self.link(channel, peer) {
            Some(link) => link.ring_recv(),
            None => self.ring_peer(peer),
        }
    }

    /// Before the engine looks at the FIFO from `peer` on `channel`: a TCP link of one
    /// socket is read in line, without waking its receive proxy (see
    /// [`TcpLink::read_in_line`]). Not when ranks outnumber cores: an engine that
    /// yields its core reads only when it runs again, while a proxy woken by arriving
    /// data runs at once (4 namespaced hosts of one rank on 2 cores, tree all-reduce of
    /// 8 B: 150 µs with the proxies reading against 300 µs in line).
    pub fn read_in_line(&self, channel: usize, peer: usize) {
        if self.oversubscribed {
            return;
        }
        if let Some(link) = self.link(channel, peer) {
            link.read_in_line();
        }
    }

    /// Before the engine looks for room in the FIFO towards `peer` on `channel`: an RDMA
    /// link polls its completions in line, so credits are seen without waking its proxy.
    pub fn poll_for_room(&self, channel: usize, peer: usize) {
        if let Some(link) = self.link(channel, peer) {
            link.poll_for_room();
        }
    }

    /// Hands the reading of every TCP link back to its receive proxy (the engine is
    /// about to sleep, or its call ended).
    pub fn stop_reading(&self) {
        for link in self.links.iter().flatten().flatten() {
            link.stop_reading();
        }
    }

    /// Registers `len` bytes at `addr` (see [`Registration`]).
    ///
    /// # Safety
    /// The memory must stay allocated until [`Connections::deregister`] or until these
    /// connections are dropped.
    pub unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Registration> {
        #[cfg(feature = "rdma")]
        let region = match &self.rdma {
            // SAFETY: forwarded from this function's contract.
            Some(net) if len > 0 => Some(unsafe { net.register(addr, len) }?),
            _ => None,
        };
        Ok(Registration {
            addr: addr as usize,
            len,
            #[cfg(feature = "rdma")]
            region,
        })
    }

    /// Ends a registration.
    pub fn deregister(&self, registration: &Registration) -> Result<()> {
        #[cfg(feature = "rdma")]
        if let (Some(net), Some(region)) = (&self.rdma, &registration.region) {
            return net.deregister(region);
        }
        let _ = registration;
        Ok(())
    }

    fn ring_peer(&self, peer: usize) {
        if peer == self.rank {
            self.bell.ring();
        } else if let Some(Some(b)) = self.peer_bells.get(peer) {
            b.ring();
        }
    }

    fn link(&self, channel: usize, peer: usize) -> Option<&NetLink> {
        let ci = self.channel_index(channel)?;
        self.links.get(ci)?.get(peer)?.as_ref()
    }

    /// The first failure among the peers: those this rank waits on (any way they can fail),
    /// then every other peer that aborted because some rank failed, so that news of a
    /// failure spreads to every rank at once. Returns the rank that failed first and what
    /// happened.
    pub(crate) fn peer_failure(
        &self,
        waiting_on: &[usize],
        check_process: bool,
    ) -> Option<(usize, String)> {
        let others = (0..self.nranks()).filter(|p| *p != self.rank() && !waiting_on.contains(p));
        for (peer, waited) in waiting_on
            .iter()
            .map(|&p| (p, true))
            .chain(others.map(|p| (p, false)))
        {
            let state = self.peer_state(peer, check_process && waited);
            // Of a peer not waited on, only a failure it reports counts: it may well have
            // finished and gone.
            if !waited && !matches!(state, PeerState::Closed(Closed::PeerFailed(_))) {
                continue;
            }
            if let Some(failure) = state.failure(peer) {
                return Some(failure);
            }
        }
        None
    }

    /// Whether `peer`, a rank of this host, may still read regions this rank published
    /// by reference in call `seq` ([`Bell::reading`]); `false` for a peer with no bell.
    pub fn peer_reading(&self, peer: usize, seq: u64) -> bool {
        matches!(self.peer_bells.get(peer), Some(Some(b)) if b.reading(seq))
    }

    /// What this rank can tell about `peer`. `check_process` also asks the kernel
    /// whether its process still exists (a system call; the flags are free).
    pub fn peer_state(&self, peer: usize, check_process: bool) -> PeerState {
        // The process is asked first and the flags read after: a peer that aborts closes
        // its bell and links before it exits, so once it is seen gone, they show
        // whatever it said on the way out. Read the other way round, a peer that aborted
        // because of another rank and exited between the two looks (ranks that share a
        // core are descheduled between any two instructions) would be blamed itself.
        let exited = check_process
            && self
                .liveness
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(Liveness::has_exited);
        if let Some(Some(b)) = self.peer_bells.get(peer) {
            match b.closed() {
                Closed::Open => {}
                why => return PeerState::Closed(why),
            }
        }
        // Over TCP a peer that leaves normally closes each connection after sending what
        // it had committed on it: it has left only once every connection says so.
        let (mut links, mut closed) = (0, 0);
        for row in &self.links {
            if let Some(Some(link)) = row.get(peer) {
                links += 1;
                match link.state() {
                    LinkState::Up => {}
                    LinkState::Closed(Closed::PeerFailed(first)) => {
                        return PeerState::Closed(Closed::PeerFailed(first));
                    }
                    LinkState::Closed(_) => closed += 1,
                    LinkState::Broken(what) => return PeerState::Unreachable(what),
                }
            }
        }
        if links > 0 && closed == links {
            return PeerState::Closed(Closed::ByOwner);
        }
        if exited {
            return PeerState::Exited;
        }
        PeerState::Alive
    }

    /// After a timeout waiting on `waiting_on`: searches the graph of waits from them,
    /// breadth first, through the peers on this host (each lists in its bell whom it
    /// waits on) for a rank that is not running — a peer that did not wake once in
    /// `watch` although a waiting engine wakes at least every 50 ms: it is stopped, or
    /// busy outside the call. `None` when every reachable peer on this host is waiting
    /// normally (the search does not cross hosts).
    pub fn stalled_rank(&self, waiting_on: &[usize], watch: std::time::Duration) -> Option<usize> {
        let bell = |p: usize| self.peer_bells.get(p)?.as_ref();
        let before: Vec<Option<u32>> = (0..self.nranks).map(|p| Some(bell(p)?.wakes())).collect();
        // Watching, this rank keeps its own count moving: a peer watching at the same
        // time must not take it for the stalled one.
        let start = std::time::Instant::now();
        while start.elapsed() < watch {
            self.bell.note_awake();
            std::thread::sleep(watch.min(std::time::Duration::from_millis(20)));
        }
        let mut seen = vec![false; self.nranks];
        seen[self.rank] = true;
        let mut queue: std::collections::VecDeque<usize> = waiting_on.iter().copied().collect();
        while let Some(p) = queue.pop_front() {
            if p >= self.nranks || std::mem::replace(&mut seen[p], true) {
                continue;
            }
            let Some(b) = bell(p) else { continue };
            if b.closed() != Closed::Open {
                continue;
            }
            if before[p] == Some(b.wakes()) {
                return Some(p);
            }
            queue.extend(b.waiting_on());
        }
        None
    }

    /// Marks this rank's communicator closed for everyone and wakes every peer, so that
    /// any of them waiting on this rank notices now.
    pub fn close(&mut self, why: Closed) {
        self.bell.close(why);
        for b in self.peer_bells.iter().flatten() {
            b.ring_always();
        }
        for link in self.links.iter_mut().flatten().flatten() {
            link.close(why);
        }
    }
}

/// The RDMA device a rank opened for its peers on other hosts, or why it has none.
struct NetDevice {
    #[cfg(feature = "rdma")]
    nic: Option<Arc<dyn rdma::verbs::Nic>>,
    /// `name:port` of the device.
    device: Option<String>,
    /// Why there is no device (when one was wanted).
    unusable: Option<String>,
    /// The device's link speed in Gb/s (0 without one).
    gbps: f64,
}

impl NetDevice {
    /// Opens this rank's device if it `wants` one (it has peers on other hosts and the
    /// configuration allows RDMA): the port its `local_rank` takes (see
    /// [`rdma::open_nic`]).
    fn open(config: &TransportConfig, rank: usize, local_rank: usize, wants: bool) -> Self {
        let mut d = NetDevice {
            #[cfg(feature = "rdma")]
            nic: None,
            device: None,
            unusable: None,
            gbps: 0.0,
        };
        if !wants {
            return d;
        }
        #[cfg(feature = "rdma")]
        {
            // At most one link per channel (and the point-to-point one) and peer.
            let links = (config.rings.len() + 1)
                * config
                    .rings
                    .first()
                    .map_or(0, |r| r.len().saturating_sub(1));
            match rdma::open_nic(&config.rdma, rank, local_rank, links, config.geometry.slots) {
                Ok(nic) => {
                    d.device = Some(rdma::describe(nic.as_ref()));
                    d.gbps = nic.device().gbps;
                    d.nic = Some(nic);
                }
                Err(why) => d.unusable = Some(why),
            }
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (config, rank, local_rank);
            d.unusable = Some("ferroccl was built without the `rdma` feature".into());
        }
        d
    }

    fn usable(&self) -> bool {
        self.device.is_some()
    }

    /// With `NCCL_NET=IB`, fails unless every rank with a peer on another host has a
    /// device (every rank reaches the same verdict, from the gathered flags).
    fn check_everyone_has_it(
        &self,
        choice: NetChoice,
        rdma_ranks: &[bool],
        hosts: &[usize],
        rank: usize,
    ) -> Result<()> {
        if choice != NetChoice::Ib {
            return Ok(());
        }
        let lacking =
            (0..hosts.len()).find(|&r| hosts.iter().any(|&h| h != hosts[r]) && !rdma_ranks[r]);
        match lacking {
            None => Ok(()),
            Some(r) => Err(Error::invalid(format!(
                "NCCL_NET=IB, but rank {r} has no usable RDMA device{}",
                if r == rank {
                    format!(
                        ": {}",
                        self.unusable
                            .as_deref()
                            .unwrap_or("TCP was forced (FERROCCL_TRANSPORT=tcp)")
                    )
                } else {
                    String::new()
                }
            ))),
        }
    }
}

/// A buffer registered with a communicator (`ncclCommRegister`): with the RDMA device
/// when the communicator has RDMA links, else only recorded (shared memory and TCP need
/// no registration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Start address.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
    /// The device registration, if any.
    #[cfg(feature = "rdma")]
    pub region: Option<rdma::verbs::Region>,
}

/// Which machine a rank runs on, and which of its CPUs the rank may use.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CpuShare {
    /// The kernel's boot id; without one, the host id (hostname, or `FERROCCL_HOSTID`)
    /// is the best guess.
    machine: String,
    cpus: Vec<u32>,
}

impl CpuShare {
    /// Whether the ranks on this rank's machine outnumber the CPUs they may use, and
    /// the job's most crowded machine (collective: every rank says which machine it
    /// runs on and which of its CPUs it may use; see [`oversubscribed`], [`crowding`]).
    fn gather(boot: &Bootstrap) -> Result<(bool, Crowding)> {
        let mine = CpuShare::here();
        let all = boot
            .all_gather(&mine.encode())?
            .iter()
            .enumerate()
            .map(|(r, bytes)| CpuShare::decode(r, bytes))
            .collect::<Result<Vec<_>>>()?;
        Ok((oversubscribed(&all, &mine), crowding(&all)))
    }

    /// Most CPUs accepted from a peer.
    const MAX_CPUS: usize = 1 << 16;

    fn here() -> Self {
        CpuShare {
            machine: Some(crate::bootstrap::boot_id())
                .filter(|id| !id.is_empty())
                .unwrap_or_else(crate::bootstrap::host_id),
            cpus: crate::topo::available_cpus()
                .unwrap_or_default()
                .into_iter()
                .map(|c| c as u32)
                .collect(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut w = crate::store::wire::Writer::default();
        w.bytes(self.machine.as_bytes()).u64(self.cpus.len() as u64);
        for &c in &self.cpus {
            w.u32(c);
        }
        w.into_vec()
    }

    fn decode(rank: usize, bytes: &[u8]) -> Result<Self> {
        let mut c = crate::store::wire::Cursor::new(bytes);
        let mut parse = || -> std::result::Result<Self, crate::store::wire::ParseError> {
            let machine = String::from_utf8_lossy(c.bytes(4096, "machine id")?).into_owned();
            let n = c.count(Self::MAX_CPUS, "CPU")?;
            let cpus = (0..n)
                .map(|_| c.u32())
                .collect::<std::result::Result<_, _>>()?;
            Ok(CpuShare { machine, cpus })
        };
        parse().map_err(|e| Error::BootstrapData {
            rank,
            detail: format!("CPU share: {e:?}"),
        })
    }
}

/// Whether the ranks sharing `mine`'s machine (same boot id, whatever hosts they count
/// as) outnumber the CPUs they may use between them. Ranks bound to a CPU each do not;
/// ranks confined to one CPU do, and so do ranks of simulated hosts (network
/// namespaces) sharing one machine.
fn oversubscribed(all: &[CpuShare], mine: &CpuShare) -> bool {
    machine_crowding(all, &mine.machine).outnumbered()
}

/// The ranks of `all` on `machine`, and the CPUs they may use between them.
fn machine_crowding(all: &[CpuShare], machine: &str) -> Crowding {
    let here: Vec<&CpuShare> = all.iter().filter(|s| s.machine == machine).collect();
    let cpus: std::collections::BTreeSet<u32> =
        here.iter().flat_map(|s| s.cpus.iter().copied()).collect();
    Crowding {
        ranks: here.len(),
        cpus: cpus.len(),
    }
}

/// The machine of `all` whose ranks have the smallest share of a CPU each (the same on
/// every rank: it depends on the gathered facts alone).
fn crowding(all: &[CpuShare]) -> Crowding {
    all.iter()
        .map(|s| machine_crowding(all, &s.machine))
        .min_by(|a, b| a.running_share().total_cmp(&b.running_share()))
        .unwrap_or(Crowding::NONE)
}

impl Drop for Connections {
    fn drop(&mut self) {
        if self.bell.closed() == Closed::Open {
            self.close(Closed::ByOwner);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{
        CpuShare, Crowding, Geometry, NetChoice, Protocol, SlotStores, Striping, TransportChoice,
        TransportConfig, crowding, oversubscribed,
    };

    #[test]
    fn fifos_between_ranks_with_a_core_each_have_the_dedicated_slots_and_crowded_ones_few() {
        let geometry = Geometry {
            slots: 8,
            slot_bytes: 128 << 10,
            protocol: Protocol::Simple,
        };
        let config = TransportConfig {
            geometry,
            dedicated: Geometry {
                slots: 16,
                ..geometry
            },
            crowded: Geometry {
                slots: 2,
                ..geometry
            },
            ll: Some(Geometry::ll(8, 4096)),
            dedicated_ll: Some(Geometry::ll(32, 4096)),
            single_copy: false,
            slot_stores: SlotStores::Auto,
            slot_exchange: true,
            rings: vec![vec![0, 1]],
            choice: TransportChoice::Auto,
            connect_timeout: Duration::from_secs(1),
            link_timeout: Duration::from_secs(1),
            striping: Striping::default(),
            net: NetChoice::Auto,
            #[cfg(feature = "rdma")]
            rdma: super::rdma::RdmaConfig::default(),
        };
        let (local, local_ll) = config.local_geometries(false);
        assert_eq!((local.slots, local.slot_bytes), (16, 128 << 10));
        let (crowded, crowded_ll) = config.local_geometries(true);
        assert_eq!((crowded.slots, crowded.slot_bytes), (2, 128 << 10));
        let ll = |g: Option<Geometry>| g.map(|g| (g.slots, g.payload(), g.protocol));
        assert_eq!(ll(local_ll), Some((32, 4096, Protocol::LL)));
        assert_eq!(ll(crowded_ll), Some((8, 4096, Protocol::LL)));
        config.validate(2).unwrap();
        for (dedicated_ll, wrong) in [
            (Geometry::ll(32, 2048), "of one payload"),
            (Geometry::ll(24, 4096), "FIFO slots 24"),
        ] {
            let odd = TransportConfig {
                dedicated_ll: Some(dedicated_ll),
                ..config.clone()
            };
            let err = odd.validate(2).unwrap_err().to_string();
            assert!(err.contains(wrong), "{err}");
        }
        let odd = TransportConfig {
            dedicated: Geometry {
                slots: 6,
                ..geometry
            },
            ..config.clone()
        };
        let err = odd.validate(2).unwrap_err().to_string();
        assert!(err.contains("FIFO slots 6"), "{err}");
        let one = TransportConfig {
            crowded: Geometry {
                slots: 1,
                ..geometry
            },
            ..config
        };
        let err = one.validate(2).unwrap_err().to_string();
        assert!(err.contains("FIFO slots 1"), "{err}");
    }

    #[test]
    fn slot_stores_parse_their_three_names_and_name_a_wrong_one() {
        for (text, want) in [
            ("", SlotStores::Auto),
            (" Auto ", SlotStores::Auto),
            ("plain", SlotStores::Plain),
            ("STREAMING", SlotStores::Streaming),
        ] {
            assert_eq!(SlotStores::parse(text), Ok(want), "{text:?}");
        }
        let err = SlotStores::parse("nt").unwrap_err();
        assert!(err.contains("\"nt\"") && err.contains("streaming"), "{err}");
    }

    /// What a rank says at establishment, through its encoding: its machine and CPUs.
    fn facts(machine: &str, cpus: &[u32]) -> CpuShare {
        let share = CpuShare {
            machine: machine.into(),
            cpus: cpus.to_vec(),
        };
        CpuShare::decode(0, &share.encode()).unwrap()
    }

    #[test]
    fn ranks_oversubscribe_a_machine_when_they_outnumber_its_cpus_they_may_use() {
        let all = |v: &[(&str, &[u32])]| -> Vec<CpuShare> {
            v.iter().map(|(m, c)| facts(m, c)).collect()
        };
        // Two ranks bound to a CPU each: a core each.
        let bound = all(&[("a", &[0]), ("a", &[1])]);
        assert!(!oversubscribed(&bound, &bound[0]));
        // Both on the same CPU, or three on two.
        let shared = all(&[("a", &[0]), ("a", &[0])]);
        assert!(oversubscribed(&shared, &shared[1]));
        let three = all(&[("a", &[0, 1]), ("a", &[0, 1]), ("a", &[0, 1])]);
        assert!(oversubscribed(&three, &three[2]));
        // Ranks on other machines do not count, whatever their CPUs.
        let two_machines = all(&[("a", &[0, 1]), ("a", &[0, 1]), ("b", &[0, 1]), ("b", &[0])]);
        assert!(!oversubscribed(&two_machines, &two_machines[0]));
        assert!(!oversubscribed(&two_machines, &two_machines[3]));
        // Unknown CPUs count as one.
        let unknown = all(&[("a", &[]), ("a", &[])]);
        assert!(oversubscribed(&unknown, &unknown[0]));
        assert_eq!(crowding(&unknown).running_share(), 0.5);

        // The cost model's view, the same from every rank: the most crowded machine.
        assert_eq!(crowding(&bound).running_share(), 1.0);
        assert_eq!(crowding(&three), Crowding { ranks: 3, cpus: 2 });
        let uneven = all(&[
            ("a", &[0, 1]),
            ("a", &[0, 1]),
            ("b", &[0, 1]),
            ("b", &[0, 1]),
            ("b", &[0, 1]),
            ("b", &[0, 1]),
        ]);
        assert_eq!(crowding(&uneven), Crowding { ranks: 4, cpus: 2 });
        assert_eq!(crowding(&uneven).running_share(), 0.5);
    }
}
