//! FIFOs between ranks of one host, and RDMA links between hosts, made on first use.
//!
//! At establishment a rank makes only the FIFOs every ring uses (from its previous rank
//! on each channel's ring, to its next). A FIFO that a plan needs beyond those — a
//! tree's parent or child, a direct algorithm's peers, a send or receive on the
//! point-to-point channel — is made before the first call that uses it, by the two
//! ranks it joins, through the bootstrap store:
//!
//! 1. the receiver creates the segment and sets `…/made`;
//! 2. the sender waits for `…/made`, maps the segment and sets `…/opened`;
//! 3. the receiver waits for `…/opened` and removes the name.
//!
//! An RDMA link to a peer on another host (built with the `rdma` feature) is made the
//! same way, in the same three steps: each side creates its FIFOs and queue pairs and
//! publishes their description (`…/ib/…/desc`, or why it could not); then connects to
//! the peer's and says so (`…/up`); then waits for the peer's `up` before its link may
//! send probes.
//!
//! A rank does step 1 for every FIFO and link it lacks before it waits on anything, and
//! both ranks of a FIFO need it in the same call (plans agree), so the steps cannot
//! wait on each other in a cycle. Every wait has the call's deadline and watches the peer: a
//! peer that died or failed meanwhile ends the call with an error naming it, as in the
//! engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bell::Closed;
use super::routes::{Routes, fifo_segment_name};
use super::segment::{Segment, SegmentKind};
use super::shm::CreatedNames;
use super::{Connections, Geometry, Protocol, fifo};
use crate::error::CallInfo;
use crate::error::{Error, Result};
use crate::store::Store;

/// What a rank needs to make FIFOs later.
pub(super) struct LazyFifos {
    /// The bootstrap store the pairs meet on.
    pub(super) store: Arc<dyn Store>,
    /// This communicator's segment-name prefix (also its key prefix in the store).
    pub(super) prefix: String,
    /// Per peer: the kind of segment shared with it, `None` for peers on other hosts
    /// (their links are made at establishment).
    pub(super) kinds: Vec<Option<SegmentKind>>,
    /// The FIFO format of each protocol ([`Protocol::index`]), if it exists.
    pub(super) formats: [Option<Geometry>; 2],
    /// Whether the FIFOs rotate short messages through their slots
    /// ([`fifo::SendEnd::set_rotating`]: where every rank has a core of its own).
    pub(super) rotating: bool,
    /// Whether the two FIFOs of a protocol between this rank and a peer exchange slots
    /// ([`fifo::exchange_slots`]; LL only where `rotating`, every rank with a core).
    pub(super) slot_exchange: bool,
}

impl LazyFifos {
    /// What this rank needs to make FIFOs to its local peers on first use, in `formats`
    /// (one per protocol, [`Protocol::index`]).
    pub(super) fn new(
        boot: &crate::bootstrap::Bootstrap,
        routes: &Routes,
        formats: [Option<Geometry>; 2],
        rotating: bool,
        slot_exchange: bool,
    ) -> Self {
        LazyFifos {
            rotating,
            slot_exchange,
            store: boot.store().clone(),
            kinds: (0..routes.nranks)
                .map(|p| {
                    let path = routes.to(p);
                    (!path.is_network()).then(|| path.segment_kind())
                })
                .collect(),
            formats,
            prefix: routes.prefix.clone(),
        }
    }
}

/// The FIFOs and links a call needs that a rank lacks.
#[derive(Default)]
struct Missing {
    /// FIFOs it receives on: (protocol index, channel index, peer).
    recv_from: Vec<(usize, usize, usize)>,
    /// FIFOs it sends on: (protocol index, channel index, peer).
    send_to: Vec<(usize, usize, usize)>,
    /// RDMA links to peers on other hosts not made yet: (channel index, peer).
    #[cfg(feature = "rdma")]
    rdma_links: Vec<(usize, usize)>,
}

/// What one call needs of a FIFO: its protocol, channel, and the peer it sends to and
/// the peer it receives from on it.
pub type FifoNeed = (Protocol, usize, Option<usize>, Option<usize>);

impl Connections {
    /// Makes the FIFOs to and from peers on this host that `needs` lists and this rank
    /// lacks (see the [module documentation](self)). Every peer involved must call it
    /// for the same call.
    pub fn connect(&mut self, needs: &[FifoNeed], call: &CallInfo) -> Result<()> {
        let rank = self.rank;
        let Missing {
            recv_from,
            send_to,
            #[cfg(feature = "rdma")]
            rdma_links,
        } = self.missing(needs);
        #[cfg(feature = "rdma")]
        let no_rdma_links = rdma_links.is_empty();
        #[cfg(not(feature = "rdma"))]
        let no_rdma_links = true;
        if recv_from.is_empty() && send_to.is_empty() && no_rdma_links {
            return Ok(());
        }
        let deadline = Instant::now() + call.timeout;
        let prefix = self.lazy.prefix.clone();
        let key = |f: usize, ci: usize, from: usize, to: usize, what: &str| {
            format!("{prefix}/fifo/{f}/{ci}/{from}-{to}/{what}")
        };
        // 1. Create what this rank receives on, and say so.
        let mut made = CreatedNames(Vec::new());
        for &(f, ci, p) in &recv_from {
            let g = self.lazy.formats[f].expect("checked above");
            let kind = self.lazy.kinds[p].expect("local peer");
            let name = fifo_segment_name(&self.lazy.prefix, g, ci, self.channels, p, rank);
            let seg = Segment::create(kind, &name, g.segment_bytes())?;
            made.0.push((kind, name));
            let mut end = fifo::recv_end(seg, g)?;
            end.set_rotating(self.lazy.rotating);
            self.recvs[f][ci][p] = Some(end);
            self.lazy.store.set(&key(f, ci, p, rank, "made"), b"")?;
        }
        #[cfg(feature = "rdma")]
        let pending = self.publish_rdma_links(&rdma_links)?;
        // 2. Map what this rank sends on, once its receiver made it.
        for &(f, ci, p) in &send_to {
            self.wait_for_peer(&key(f, ci, rank, p, "made"), p, deadline, call)?;
            let g = self.lazy.formats[f].expect("checked above");
            let kind = self.lazy.kinds[p].expect("local peer");
            let name = fifo_segment_name(&self.lazy.prefix, g, ci, self.channels, rank, p);
            let seg = Segment::open(kind, &name, g.segment_bytes())?;
            let mut end = fifo::send_end(seg, g, &name)?;
            end.set_rotating(self.lazy.rotating);
            self.sends[f][ci][p] = Some(end);
            self.lazy.store.set(&key(f, ci, rank, p, "opened"), b"")?;
        }
        #[cfg(feature = "rdma")]
        let made_links = self.connect_rdma_links(pending, deadline, call)?;
        // 3. Once each sender mapped its FIFO, its name can go (with `made`).
        for &(f, ci, p) in &recv_from {
            self.wait_for_peer(&key(f, ci, p, rank, "opened"), p, deadline, call)?;
        }
        #[cfg(feature = "rdma")]
        self.agree_rdma_links(&made_links, deadline, call)?;
        drop(made);
        for &(f, ci, p) in &recv_from {
            for what in ["made", "opened"] {
                let _ = self.lazy.store.delete(&key(f, ci, p, rank, what));
            }
        }
        // Both ranks of each new FIFO reach this point in the same call, before either
        // uses it.
        if self.lazy.slot_exchange {
            super::exchange_local_slots(
                &mut self.sends,
                &mut self.recvs,
                &self.links,
                rank,
                super::exchanging_protocols(self.lazy.rotating),
            )?;
        }
        tracing::debug!(
            "rank {rank}: {} {} #{}: made FIFOs from {:?}, to {:?}",
            "connected for",
            call.op,
            call.seq,
            recv_from.iter().map(|r| r.2).collect::<Vec<_>>(),
            send_to.iter().map(|s| s.2).collect::<Vec<_>>()
        );
        Ok(())
    }

    /// What `needs` lists that this rank lacks, each once, in order.
    fn missing(&self, needs: &[FifoNeed]) -> Missing {
        let mut m = Missing::default();
        for &(protocol, channel, to, from) in needs {
            let f = protocol.index();
            let Some(ci) = self.channel_index(channel) else {
                continue;
            };
            #[cfg(feature = "rdma")]
            for p in [to, from].into_iter().flatten() {
                if self.links[ci][p].is_none()
                    && self.lazy.kinds.get(p).is_some_and(Option::is_none)
                    && let Some(net) = &self.rdma
                    && net.index_of(ci, p).is_some_and(|i| !net.is_made(i))
                {
                    m.rdma_links.push((ci, p));
                }
            }
            if self.lazy.formats[f].is_none() {
                continue;
            }
            let local = |p: usize| self.lazy.kinds.get(p).is_some_and(Option::is_some);
            if let Some(p) = from
                && local(p)
                && self.recvs[f][ci][p].is_none()
            {
                m.recv_from.push((f, ci, p));
            }
            if let Some(p) = to
                && local(p)
                && self.sends[f][ci][p].is_none()
            {
                m.send_to.push((f, ci, p));
            }
        }
        #[cfg(feature = "rdma")]
        {
            m.rdma_links.sort_unstable();
            m.rdma_links.dedup();
        }
        m.recv_from.sort_unstable();
        m.recv_from.dedup();
        m.send_to.sort_unstable();
        m.send_to.dedup();
        m
    }

    /// The store key of what `from` says to `to` about their RDMA link on channel index
    /// `ci` (`what`: `desc`, its side's description; `up`, its side is connected).
    #[cfg(feature = "rdma")]
    fn rdma_key(&self, ci: usize, from: usize, to: usize, what: &str) -> String {
        format!("{}/ib/{ci}/{from}-{to}/{what}", self.lazy.prefix)
    }

    /// Step 1 for RDMA links (channel index, peer): creates this side of each and
    /// publishes its description, or why it could not (the peer then fails at once,
    /// naming this rank; so do the peers of links described already, at step 3).
    #[cfg(feature = "rdma")]
    fn publish_rdma_links(
        &self,
        links: &[(usize, usize)],
    ) -> Result<Vec<(usize, usize, super::rdma::PendingLink)>> {
        let Some(net) = &self.rdma else {
            return Ok(Vec::new());
        };
        let mut pending = Vec::new();
        for &(ci, p) in links {
            let index = net.index_of(ci, p).expect("listed by index_of");
            let key = self.rdma_key(ci, self.rank, p, "desc");
            match net.prepare_link(index) {
                Ok(link) => {
                    self.lazy.store.set(&key, &said(Ok(link.description())))?;
                    pending.push((ci, p, link));
                }
                Err(e) => {
                    let unfinished = pending.iter().map(|&(ci, p, _)| (ci, p));
                    self.tell_failed(&e, [key].into_iter().chain(self.up_keys(unfinished)));
                    return Err(e);
                }
            }
        }
        Ok(pending)
    }

    /// This rank's `up` keys of the RDMA links (channel index, peer).
    #[cfg(feature = "rdma")]
    fn up_keys(&self, links: impl Iterator<Item = (usize, usize)>) -> Vec<String> {
        links
            .map(|(ci, p)| self.rdma_key(ci, self.rank, p, "up"))
            .collect()
    }

    /// Publishes `e` under each of `keys`, so that the peers waiting on them fail at
    /// once, naming this rank (best effort: the call fails with `e` anyway).
    #[cfg(feature = "rdma")]
    fn tell_failed(&self, e: &Error, keys: impl Iterator<Item = String>) {
        let failed = said(Err(e));
        for key in keys {
            let _ = self.lazy.store.set(&key, &failed);
        }
    }

    /// Step 2: connects each link to its peer's side, once described, and says so (or
    /// why not, to this link's peer and to the peers of the links not reached).
    /// Returns the links made (channel index, peer, link index).
    #[cfg(feature = "rdma")]
    fn connect_rdma_links(
        &mut self,
        pending: Vec<(usize, usize, super::rdma::PendingLink)>,
        deadline: Instant,
        call: &CallInfo,
    ) -> Result<Vec<(usize, usize, usize)>> {
        let mut made = Vec::new();
        let mut pending = pending.into_iter();
        while let Some((ci, p, link)) = pending.next() {
            let up = self.rdma_key(ci, self.rank, p, "up");
            match self.connect_rdma_link(ci, p, link, deadline, call) {
                Ok(index) => {
                    self.lazy.store.set(&up, &said(Ok(&[])))?;
                    made.push((ci, p, index));
                }
                Err(e) => {
                    let unfinished = pending.map(|(ci, p, _)| (ci, p));
                    self.tell_failed(&e, [up].into_iter().chain(self.up_keys(unfinished)));
                    return Err(e);
                }
            }
        }
        Ok(made)
    }

    /// Step 2 for one link: waits for the peer's description and connects to it.
    /// Returns the link's index.
    #[cfg(feature = "rdma")]
    fn connect_rdma_link(
        &mut self,
        ci: usize,
        p: usize,
        link: super::rdma::PendingLink,
        deadline: Instant,
        call: &CallInfo,
    ) -> Result<usize> {
        let key = self.rdma_key(ci, p, self.rank, "desc");
        self.wait_for_peer(&key, p, deadline, call)?;
        let theirs = self.lazy.store.get(&key)?;
        let description = heard(&theirs, p, call, self.rank)?;
        let Some(net) = &self.rdma else {
            unreachable!("pending links come from the net");
        };
        let index = net.index_of(ci, p).expect("listed by index_of");
        let (tx, rx) = net.connect_link(link, description)?;
        self.sends[0][ci][p] = Some(tx);
        self.recvs[0][ci][p] = Some(rx);
        self.links[ci][p] = Some(super::NetLink::Rdma(net.link(index)));
        Ok(index)
    }

    /// Step 3: waits until each peer's side is connected too (only then may probes
    /// go out), and removes what the peers published.
    #[cfg(feature = "rdma")]
    fn agree_rdma_links(
        &self,
        made: &[(usize, usize, usize)],
        deadline: Instant,
        call: &CallInfo,
    ) -> Result<()> {
        let Some(net) = &self.rdma else {
            return Ok(());
        };
        for &(ci, p, index) in made {
            let up = self.rdma_key(ci, p, self.rank, "up");
            let agreed = self
                .wait_for_peer(&up, p, deadline, call)
                .and_then(|()| self.lazy.store.get(&up))
                .and_then(|value| heard(&value, p, call, self.rank).map(|_| ()));
            if let Err(e) = agreed {
                net.link_failed(index, e.to_string());
                return Err(e);
            }
            net.link_ready(index);
            for key in [self.rdma_key(ci, p, self.rank, "desc"), up] {
                let _ = self.lazy.store.delete(&key);
            }
        }
        Ok(())
    }

    /// Waits until `key` is set in the store by `peer`, watching the peer and the
    /// deadline.
    fn wait_for_peer(
        &self,
        key: &str,
        peer: usize,
        deadline: Instant,
        call: &CallInfo,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lazy.store.wait(
                &[key],
                left.min(Duration::from_millis(100))
                    .max(Duration::from_millis(1)),
            ) {
                Ok(()) => return Ok(()),
                Err(Error::StoreTimeout { .. }) => {}
                Err(e) => return Err(e),
            }
            // The peer, or any rank that reports a failure (a dead peer on another host
            // has no link to show it yet: its neighbours report it).
            if let Some((failed_rank, detail)) = self.peer_failure(&[peer], true) {
                return Err(call.peer_failed(
                    self.rank,
                    (failed_rank, format!("{detail}, while connecting")),
                ));
            }
            if Instant::now() >= deadline {
                return Err(call.timed_out(self.rank, vec![peer], None, start.elapsed()));
            }
            if self.bell.closed() != Closed::Open {
                return Err(Error::Aborted {
                    rank: self.rank,
                    reason: crate::error::ABORTED_BY_USER.into(),
                });
            }
        }
    }
}

/// What a rank publishes of a step of making an RDMA link: 1 and the payload, or 0 and
/// why it could not.
#[cfg(feature = "rdma")]
fn said(what: std::result::Result<&[u8], &Error>) -> Vec<u8> {
    match what {
        Ok(payload) => [&[1u8][..], payload].concat(),
        Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
    }
}

/// The payload of what `peer` published ([`said`]), or the error naming it.
#[cfg(feature = "rdma")]
fn heard<'a>(value: &'a [u8], peer: usize, call: &CallInfo, rank: usize) -> Result<&'a [u8]> {
    match value.split_first() {
        Some((1, payload)) => Ok(payload),
        _ => {
            let why = String::from_utf8_lossy(value.get(1..).unwrap_or_default());
            Err(call.peer_failed(
                rank,
                (
                    peer,
                    format!("rank {peer} could not make its side of the RDMA link: {why}"),
                ),
            ))
        }
    }
}
