//! Point-to-point connections between the ranks of a communicator.
//!
//! Every transport presents the same thing to the engine: one [`fifo`] per (channel,
//! sender, receiver), with flow control by slot counters, and one [`bell`] per rank to
//! sleep on. What differs is where the memory lives:
//!
//! | transport | used between | memory |
//! | --- | --- | --- |
//! | in-process | ranks that are threads of one process | heap blocks, found by name in a process-wide table |
//! | shared memory | processes on one host | files in `/dev/shm`, mapped by both sides and unlinked as soon as both have |
//!
//! A network transport (next) keeps a FIFO on each side and a proxy thread that moves
//! slots across the socket, so the engine stays the same.
//!
//! [`Connections::establish`] is collective over the communicator's [`Bootstrap`]: every
//! rank creates the FIFOs it receives on and its bell, all meet at a barrier, every rank
//! maps its peers' FIFOs and bells, all meet again, and the creators remove the names.
//! A crash leaves nothing in `/dev/shm` after that point.

pub mod bell;
pub mod fifo;
pub mod liveness;
pub mod segment;

use bell::{BELL_BYTES, Bell, Closed};
use fifo::{Geometry, RecvEnd, SendEnd};
use liveness::Liveness;
use segment::{Segment, SegmentKind};

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::plan::P2P_CHANNEL;

/// How to connect a communicator's ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportConfig {
    /// Shape of every FIFO.
    pub geometry: Geometry,
    /// The ring of each collective channel. Channel 0 connects every pair of ranks
    /// (rings and direct algorithms); the others connect only their ring's edges.
    pub rings: Vec<Vec<usize>>,
    /// Use `/dev/shm` segments even between threads of one process
    /// (`FERROCCL_TRANSPORT=shm`), e.g. to measure the shared-memory path in one process.
    pub force_shm: bool,
}

/// A peer's state, as far as this rank can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerState {
    /// Running and connected.
    Alive,
    /// Its process is gone.
    Exited,
    /// It closed its communicator (see [`Closed`]).
    Closed(Closed),
}

/// One rank's connections to its peers.
pub struct Connections {
    rank: usize,
    nranks: usize,
    channels: usize,
    /// `[channel index][peer]`; the last channel index is the point-to-point channel.
    sends: Vec<Vec<Option<SendEnd>>>,
    recvs: Vec<Vec<Option<RecvEnd>>>,
    bell: Bell,
    peer_bells: Vec<Option<Bell>>,
    liveness: Vec<Option<Liveness>>,
    geometry: Geometry,
    /// More ranks on this host than cores to run them.
    oversubscribed: bool,
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

/// Names created by this rank, removed when dropped (on success after the final
/// barrier, on failure right away).
struct CreatedNames(Vec<(SegmentKind, String)>);

impl Drop for CreatedNames {
    fn drop(&mut self) {
        for (kind, name) in self.0.drain(..) {
            Segment::unlink(kind, &name);
        }
    }
}

impl Connections {
    /// Connects this rank to its peers (collective: every rank of `boot` must call it
    /// with the same configuration).
    pub fn establish(boot: &Bootstrap, config: &TransportConfig) -> Result<Self> {
        config.geometry.validate()?;
        let (rank, nranks) = (boot.rank(), boot.world_size());
        let peers = boot.peers();
        let me = &peers[rank];
        if let Some(remote) = peers.iter().find(|p| p.host_id != me.host_id) {
            return Err(Error::Unsupported {
                what: format!(
                    "rank {} is on host {} and rank {rank} on {}: connecting ranks on \
                     different hosts needs the TCP transport, which is not built yet",
                    remote.rank, remote.hostname, me.hostname
                ),
            });
        }
        let channels = config.rings.len();
        if channels == 0 || config.rings.iter().any(|r| r.len() != nranks) {
            return Err(Error::invalid(format!(
                "transport: {channels} rings, each must list all {nranks} ranks"
            )));
        }

        // A name space for this communicator's segments, chosen by rank 0.
        let nonce: [u8; 8] = rand::random();
        let all = boot.all_gather(&nonce)?;
        let prefix = format!(
            "ferroccl-{}-{:016x}",
            peers[0].pid,
            u64::from_le_bytes(all[0].as_slice().try_into().map_err(|_| {
                Error::BootstrapData {
                    rank: 0,
                    detail: "segment name nonce is not 8 bytes".into(),
                }
            })?)
        );
        let same_process = |a: usize, b: usize| !config.force_shm && peers[a].pid == peers[b].pid;
        let fifo_kind = |a: usize, b: usize| {
            if same_process(a, b) {
                SegmentKind::InProcess
            } else {
                SegmentKind::Shm
            }
        };
        let bell_kind = |owner: usize| {
            if (0..nranks).all(|r| same_process(owner, r)) {
                SegmentKind::InProcess
            } else {
                SegmentKind::Shm
            }
        };
        let chan_name = |ci: usize| {
            if ci == channels {
                "p".to_string()
            } else {
                ci.to_string()
            }
        };
        let fifo_name =
            |ci: usize, from: usize, to: usize| format!("{prefix}-f{}-{from}-{to}", chan_name(ci));
        let bell_name = |owner: usize| format!("{prefix}-b{owner}");
        // Peers this rank receives from / sends to on channel index `ci`.
        let neighbours = |ci: usize, incoming: bool| -> Vec<usize> {
            if ci == channels {
                // Point-to-point: every rank, this one included (a rank may send to
                // itself, as in NCCL).
                (0..nranks).collect()
            } else if ci == 0 {
                (0..nranks).filter(|&r| r != rank).collect()
            } else {
                let ring = &config.rings[ci];
                let pos = ring.iter().position(|&r| r == rank).unwrap_or(0);
                let peer = if incoming {
                    ring[(pos + nranks - 1) % nranks]
                } else {
                    ring[(pos + 1) % nranks]
                };
                if peer == rank { vec![] } else { vec![peer] }
            }
        };

        let mut created = CreatedNames(Vec::new());
        let bell_seg = Segment::create(bell_kind(rank), &bell_name(rank), BELL_BYTES)?;
        created.0.push((bell_kind(rank), bell_name(rank)));
        let bell = Bell::new(bell_seg);
        let bytes = config.geometry.segment_bytes();
        let mut recvs: Vec<Vec<Option<RecvEnd>>> = (0..=channels)
            .map(|_| (0..nranks).map(|_| None).collect())
            .collect();
        for (ci, row) in recvs.iter_mut().enumerate() {
            for from in neighbours(ci, true) {
                let (kind, name) = (fifo_kind(from, rank), fifo_name(ci, from, rank));
                let seg = Segment::create(kind, &name, bytes)?;
                created.0.push((kind, name));
                row[from] = Some(fifo::recv_end(seg, config.geometry)?);
            }
        }
        boot.barrier()?;

        let mut peer_bells: Vec<Option<Bell>> = (0..nranks).map(|_| None).collect();
        let mut liveness: Vec<Option<Liveness>> = (0..nranks).map(|_| None).collect();
        for peer in (0..nranks).filter(|&r| r != rank) {
            let seg = Segment::open(bell_kind(peer), &bell_name(peer), BELL_BYTES)?;
            peer_bells[peer] = Some(Bell::new(seg));
            liveness[peer] = Some(if peers[peer].pid == me.pid {
                Liveness::SameProcess
            } else {
                Liveness::watch(peers[peer].pid)
            });
        }
        let mut sends: Vec<Vec<Option<SendEnd>>> = (0..=channels)
            .map(|_| (0..nranks).map(|_| None).collect())
            .collect();
        for (ci, row) in sends.iter_mut().enumerate() {
            for to in neighbours(ci, false) {
                let (kind, name) = (fifo_kind(rank, to), fifo_name(ci, rank, to));
                let seg = Segment::open(kind, &name, bytes)?;
                row[to] = Some(fifo::send_end(seg, config.geometry, &name)?);
            }
        }
        boot.barrier()?;
        drop(created);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let oversubscribed = boot.local_ranks().len() > cores;
        tracing::debug!(
            "rank {rank}: connected to {} peers over {channels} channel(s), FIFOs of {} x {} B",
            nranks - 1,
            config.geometry.slots,
            config.geometry.slot_bytes
        );
        Ok(Connections {
            rank,
            nranks,
            channels,
            sends,
            recvs,
            bell,
            peer_bells,
            liveness,
            geometry: config.geometry,
            oversubscribed,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The FIFO shape.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Whether this host runs more ranks than it has cores (waiting then yields the core
    /// instead of spinning).
    pub fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    fn channel_index(&self, channel: usize) -> Option<usize> {
        if channel == P2P_CHANNEL {
            Some(self.channels)
        } else {
            (channel < self.channels).then_some(channel)
        }
    }

    /// The sending end towards `peer` on `channel`, and the receiving end from `from`
    /// on the same channel (either may be absent), borrowed together.
    pub fn ends(
        &mut self,
        channel: usize,
        to: Option<usize>,
        from: Option<usize>,
    ) -> (Option<&mut SendEnd>, Option<&mut RecvEnd>) {
        let Some(ci) = self.channel_index(channel) else {
            return (None, None);
        };
        let send = to.and_then(|p| self.sends[ci].get_mut(p)?.as_mut());
        let recv = from.and_then(|p| self.recvs[ci].get_mut(p)?.as_mut());
        (send, recv)
    }

    /// This rank's own bell (to sleep on).
    pub fn bell(&self) -> &Bell {
        &self.bell
    }

    /// Wakes `peer` if it sleeps (after giving it data or space).
    pub fn ring(&self, peer: usize) {
        if let Some(Some(b)) = self.peer_bells.get(peer) {
            b.ring();
        }
    }

    /// What this rank can tell about `peer`. `check_process` also asks the kernel
    /// whether its process still exists (a system call; the flags are free).
    pub fn peer_state(&self, peer: usize, check_process: bool) -> PeerState {
        if let Some(Some(b)) = self.peer_bells.get(peer) {
            match b.closed() {
                Closed::Open => {}
                why => return PeerState::Closed(why),
            }
        }
        if check_process
            && let Some(Some(l)) = self.liveness.get(peer)
            && l.has_exited()
        {
            return PeerState::Exited;
        }
        PeerState::Alive
    }

    /// Marks this rank's communicator closed for everyone and wakes every peer, so that
    /// any of them waiting on this rank notices now.
    pub fn close(&self, why: Closed) {
        self.bell.close(why);
        for b in self.peer_bells.iter().flatten() {
            b.ring_always();
        }
    }
}

impl Drop for Connections {
    fn drop(&mut self) {
        if self.bell.closed() == Closed::Open {
            self.close(Closed::ByOwner);
        }
    }
}
