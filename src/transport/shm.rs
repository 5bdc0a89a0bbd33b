//! The shared-memory phases of connecting a rank: its bell and the ring FIFOs it
//! receives on, made before the network links; after them (once every rank has made
//! its own), its local peers' bells and the ring FIFOs it sends on.
//!
//! Between ranks of one host only the FIFOs every ring uses are made at establishment,
//! from the previous rank of each channel's ring and to the next, in every format. Trees,
//! direct algorithms and point-to-point calls make theirs on first use (see
//! [`lazy`](super::lazy)): memory grows with the peers used, not with the square of the
//! ranks.

use std::sync::Arc;

use super::Ends;
use super::bell::{BELL_BYTES, Bell};
use super::fifo::{self, Geometry};
use super::liveness::Liveness;
use super::routes::Routes;
use super::segment::{Segment, SegmentKind};
use crate::bootstrap::{Bootstrap, PeerInfo};
use crate::error::{Error, Result};

/// Names created by this rank, removed when dropped (on success after the final
/// barrier, on failure right away).
pub(super) struct CreatedNames(pub(super) Vec<(SegmentKind, String)>);

impl Drop for CreatedNames {
    fn drop(&mut self) {
        for (kind, name) in self.0.drain(..) {
            Segment::unlink(kind, &name);
        }
    }
}

/// A ring FIFO made at establishment: its format, channel index and peer.
type RingFifo = (Geometry, usize, usize);

/// Per peer: its bell, and the watch on its process (local peers only).
pub(super) type LocalPeers = (Vec<Option<Bell>>, Vec<Option<Liveness>>);

/// This rank's shared memory, as far as it is made before the network links.
pub(super) struct SharedMemory {
    /// This rank's bell.
    pub bell: Bell,
    /// A second view of it, for the network proxies (which ring it) and for aborting.
    pub own_bell: Arc<Bell>,
    /// Segments this rank created, unlinked once every peer has opened them.
    pub created: CreatedNames,
    /// The ring FIFOs this rank sends on (opened in [`SharedMemory::open_peers`]).
    sends: Vec<RingFifo>,
}

impl SharedMemory {
    /// Makes this rank's bell and the ring FIFOs it receives on (their ends go into
    /// `ends`), then tells every rank whether that worked (collective), so that one
    /// rank's failure (a full `/dev/shm`) is every rank's error now, not a wait at the
    /// next rendezvous.
    pub(super) fn create(
        boot: &Bootstrap,
        routes: &Routes,
        rings: &[Vec<usize>],
        formats: &[Geometry],
        ends: &mut Ends,
    ) -> Result<Self> {
        let (receives, sends) = ring_fifos(routes, rings, formats);
        let made = Self::create_own(routes, receives, sends, ends);
        report_readiness(boot, made.as_ref().err())?;
        made
    }

    fn create_own(
        routes: &Routes,
        receives: Vec<RingFifo>,
        sends: Vec<RingFifo>,
        ends: &mut Ends,
    ) -> Result<Self> {
        let rank = routes.rank;
        let (kind, name) = (routes.bell_kind(rank), routes.bell_name(rank));
        let mut created = CreatedNames(Vec::new());
        let bell = Bell::create(Segment::create(kind, &name, BELL_BYTES)?);
        created.0.push((kind, name.clone()));
        let own_bell = Arc::new(Bell::new(Segment::open(kind, &name, BELL_BYTES)?));
        for (g, ci, from) in receives {
            let (kind, name) = (
                routes.path(from, rank).segment_kind(),
                routes.fifo_name(g, ci, from, rank),
            );
            let seg = Segment::create(kind, &name, g.segment_bytes())?;
            created.0.push((kind, name));
            ends.recvs[g.protocol.index()][ci][from] = Some(fifo::recv_end(seg, g)?);
        }
        Ok(SharedMemory {
            bell,
            own_bell,
            created,
            sends,
        })
    }

    /// Opens the bells of this rank's local peers (and watches their processes), and
    /// the ring FIFOs it sends on (their ends go into `ends`). Every peer must have made
    /// its own first (after a barrier).
    pub(super) fn open_peers(
        &self,
        routes: &Routes,
        peers: &[PeerInfo],
        ends: &mut Ends,
    ) -> Result<LocalPeers> {
        let rank = routes.rank;
        let mut bells: Vec<Option<Bell>> = (0..routes.nranks).map(|_| None).collect();
        let mut liveness: Vec<Option<Liveness>> = (0..routes.nranks).map(|_| None).collect();
        for peer in (0..routes.nranks).filter(|&p| routes.is_local_peer(p)) {
            let seg = Segment::open(routes.bell_kind(peer), &routes.bell_name(peer), BELL_BYTES)?;
            bells[peer] = Some(Bell::new(seg));
            liveness[peer] = Some(if peers[peer].pid == peers[rank].pid {
                Liveness::SameProcess
            } else {
                Liveness::watch(peers[peer].pid)
            });
        }
        for &(g, ci, to) in &self.sends {
            let (kind, name) = (
                routes.to(to).segment_kind(),
                routes.fifo_name(g, ci, rank, to),
            );
            let seg = Segment::open(kind, &name, g.segment_bytes())?;
            ends.sends[g.protocol.index()][ci][to] = Some(fifo::send_end(seg, g, &name)?);
        }
        Ok((bells, liveness))
    }
}

/// The ring FIFOs between ranks of this host that this rank receives on and sends on:
/// from the previous rank of each channel's ring, to the next, in every format.
fn ring_fifos(
    routes: &Routes,
    rings: &[Vec<usize>],
    formats: &[Geometry],
) -> (Vec<RingFifo>, Vec<RingFifo>) {
    let (rank, n) = (routes.rank, routes.nranks);
    let mut receives = Vec::new();
    let mut sends = Vec::new();
    for &g in formats {
        for (ci, ring) in rings.iter().enumerate() {
            let at = ring
                .iter()
                .position(|&r| r == rank)
                .expect("every rank in every ring");
            let (prev, next) = (ring[(at + n - 1) % n], ring[(at + 1) % n]);
            if routes.is_local_peer(prev) {
                receives.push((g, ci, prev));
            }
            if routes.is_local_peer(next) {
                sends.push((g, ci, next));
            }
        }
    }
    (receives, sends)
}

/// Every rank says whether its shared memory was made (collective); the first rank
/// that failed is every rank's error.
fn report_readiness(boot: &Bootstrap, failed: Option<&Error>) -> Result<()> {
    let status = failed.map_or_else(Vec::new, |e| e.to_string().into_bytes());
    let all = boot.all_gather(&status)?;
    if failed.is_some() {
        // This rank's own error is the one it returns.
        return Ok(());
    }
    match all.iter().enumerate().find(|(_, s)| !s.is_empty()) {
        None => Ok(()),
        Some((r, why)) => Err(Error::PeerFailed {
            op: "init".into(),
            seq: 0,
            rank: boot.rank(),
            failed_rank: r,
            detail: format!(
                "rank {r} could not make its shared memory: {}",
                String::from_utf8_lossy(why)
            ),
        }),
    }
}
