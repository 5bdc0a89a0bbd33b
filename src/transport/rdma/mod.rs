//! The RDMA transport (cargo feature `rdma`): the same FIFOs as over shared memory and
//! TCP, moved between hosts by the NIC.
//!
//! For each (channel, peer) pair that crosses hosts there is one *link*: a FIFO on each
//! side, both registered with the NIC, and `NCCL_IB_QPS_PER_CONNECTION` reliable
//! connected queue pairs (their endpoints and the FIFOs' addresses and keys exchanged
//! through the bootstrap store).
//! - **Data.** After the engine commits a slot, the committing thread posts one RDMA
//!   write per queue pair (the slot cut into stripes as over TCP) straight from the
//!   slot of its outgoing FIFO into the same slot of the peer's incoming FIFO: no copy
//!   on either side. The write carries immediate data, the slot's sequence number
//!   (mod 64) and byte count, so it completes on the receiver, which publishes the slot
//!   once every queue pair delivered its stripe.
//! - **Credits.** After the engine releases slots of an incoming FIFO, the releasing
//!   thread posts a write with immediate data carrying the FIFO's `tail` (mod 2³⁰) on
//!   queue pair 0. The sender hands a slot back to its engine once the peer has
//!   consumed it *and* this side's NIC has finished reading it (its write completed).
//!   Flow control is therefore the FIFO's own: a sender writes slot `k` only after the
//!   peer's engine released slot `k − slots`.
//! - **Completions** land on one completion queue per rank, polled by the engine in
//!   line while it waits for a peer (as the TCP links are read in line) and otherwise by
//!   one proxy thread per rank, which sleeps on the queue's completion channel.
//! - **Closing** sends a write with immediate data carrying the cause on every queue
//!   pair (after the data already posted, which the queue pair delivers first); a link
//!   is closed once every queue pair delivered it, as over TCP.
//! - **Failures**: a completion with an error status (a queue pair in the error state,
//!   a remote access error, the transport retry counter exceeded) breaks the link, and
//!   the engine reports the peer as unreachable, naming it. A peer that vanishes while
//!   nothing is sent to it is found by a probe (a write of no bytes, which the peer's
//!   CPU never sees) every third of the link timeout: its queue pair no longer answers,
//!   and the probe fails with retry-exceeded after the transport timeout.
//!
//! The verbs are reached through one narrow interface ([`verbs::Nic`]), so the
//! transport runs unchanged over libibverbs ([`ibv`]) and over the in-process fabric the
//! tests use ([`sim`]). The settings and the choice of device and port are in
//! `config.rs`; the GID choice in [`gid`].

pub mod gid;
pub mod ibv;
pub mod sim;
pub mod verbs;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::bell::{Bell, Closed};
use super::fifo::{DATA_OFFSET, Geometry, RecvEnd, SendEnd};
use super::tcp::{LinkState, local_fifo, stripe};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::lock;
use crate::store::wire::{Cursor, Writer};
use verbs::{Completion, Endpoint, Local, Nic, Region, Remote};

/// Largest slot an RDMA link carries: the byte count travels in 24 bits of the
/// immediate data.
pub const MAX_SLOT_BYTES: usize = (1 << 24) - 64;
/// Most queue pairs per link (`NCCL_IB_QPS_PER_CONNECTION`, NCCL's limit).
pub const MAX_QPS_PER_CONNECTION: usize = 128;
/// How long a closing rank waits for its writes in flight to complete.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

mod config;
pub use config::*;

// Immediate data: 2 bits of kind, 30 of value.
const KIND_SHIFT: u32 = 30;
const VALUE_MASK: u32 = (1 << KIND_SHIFT) - 1;
const KIND_DATA: u32 = 0;
const KIND_CREDIT: u32 = 1;
const KIND_CLOSE: u32 = 2;
/// Data: 6 bits of slot sequence number, 24 of byte count.
const LEN_BITS: u32 = 24;
const SEQ_MASK: u64 = 63;

fn data_imm(slot: u64, len: usize) -> u32 {
    ((slot & SEQ_MASK) as u32) << LEN_BITS | len as u32
}

// Work request ids: link index << 16 | queue pair index << 8 | what.
const WR_DATA: u64 = 1;
const WR_CREDIT: u64 = 2;
const WR_CLOSE: u64 = 3;
const WR_PROBE: u64 = 4;
const WR_RECV: u64 = 5;

fn wr_id(link: usize, qp: usize, what: u64) -> u64 {
    (link as u64) << 16 | (qp as u64) << 8 | what
}

/// The sending side of a link, as the posting threads share it.
struct Outgoing {
    /// The proxy's view of the engine's outgoing FIFO.
    fifo: RecvEnd,
    /// Slots whose writes are posted on every queue pair.
    posted: u64,
    /// Per queue pair: data writes completed (they complete in order).
    written: Vec<u64>,
    /// Slots the peer has consumed (its `tail`, from credits).
    credited: u64,
    /// Slots handed back to the engine.
    released: u64,
    /// Writes posted and not completed (data, close, probe).
    in_flight: usize,
}

/// The receiving side of a link.
struct Incoming {
    /// The writer's view of the engine's incoming FIFO.
    fifo: SendEnd,
    /// Per queue pair: stripes received.
    received: Vec<u64>,
    /// Byte count of each slot being received, by slot number modulo the slot count.
    lens: Vec<usize>,
    /// Slots published to the engine.
    committed: u64,
    /// The `tail` last sent as a credit.
    credit_sent: u32,
    /// Credits posted and not completed.
    credits_in_flight: usize,
    /// Per queue pair: whether the peer's close arrived, and its cause.
    closed: Vec<bool>,
}

/// One link's state, shared by the engine, the proxy and the poller.
struct LinkShared {
    peer: usize,
    qpns: Vec<u32>,
    geometry: Geometry,
    out_region: Region,
    in_region: Region,
    /// The peer's incoming FIFO (start of its segment).
    remote: Remote,
    out: Mutex<Outgoing>,
    inc: Mutex<Incoming>,
    state: Mutex<LinkState>,
    /// Set once this side closed (later flushes are expected).
    closing: AtomicBool,
    probe_in_flight: AtomicBool,
    /// Whether the peer's queue pairs are connected too, so that probes may go out (a
    /// link made on first use is not, between its making and the peer's word).
    ready: AtomicBool,
}

impl LinkShared {
    fn set_state(&self, s: LinkState) -> bool {
        let mut st = lock(&self.state);
        if *st == LinkState::Up {
            *st = s;
            true
        } else {
            false
        }
    }
}

/// Shared by every link of a rank, its proxy and the engine.
struct NetShared {
    rank: usize,
    nic: Arc<dyn Nic>,
    config: RdmaConfig,
    geometry: Geometry,
    /// Every link this rank may have, by index (see [`RdmaNet::establish`]); made at
    /// creation for the rings, on first use for the others.
    specs: Vec<LinkSpec>,
    links: Vec<OnceLock<LinkShared>>,
    rank_bell: Arc<Bell>,
    stop: AtomicBool,
    /// Held while polling the completion queue (completions are handled in order).
    polling: Mutex<Vec<Completion>>,
    probe_every: Duration,
    /// User buffers registered with the device (`ncclCommRegister`), with how many
    /// registrations each one serves.
    registrations: Mutex<Vec<(Region, usize)>>,
}

impl NetShared {
    /// Link `index`, if it is made.
    fn link(&self, index: usize) -> Option<&LinkShared> {
        self.links.get(index)?.get()
    }

    /// The links made so far, with their indices.
    fn made(&self) -> impl Iterator<Item = (usize, &LinkShared)> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.get().map(|l| (i, l)))
    }

    fn fail(&self, link: &LinkShared, what: String) {
        if link.set_state(LinkState::Broken(what.clone())) {
            tracing::info!(
                "rank {}: RDMA link to rank {} broke: {what}",
                self.rank,
                link.peer
            );
        }
        self.rank_bell.ring_always();
    }

    /// Polls the completion queue until it is empty; `wait_for_lock` decides whether to
    /// wait for another poller. Returns whether anything completed.
    fn progress(&self, wait_for_lock: bool) -> bool {
        let mut buf = if wait_for_lock {
            lock(&self.polling)
        } else {
            match self.polling.try_lock() {
                Ok(b) => b,
                Err(_) => return false,
            }
        };
        let mut any = false;
        loop {
            buf.clear();
            if let Err(e) = self.nic.poll(&mut buf, 64) {
                for (_, link) in self.made() {
                    self.fail(link, format!("polling the completion queue failed: {e}"));
                }
                return any;
            }
            if buf.is_empty() {
                return any;
            }
            any = true;
            for &c in buf.iter() {
                self.handle(c);
            }
        }
    }

    fn handle(&self, c: Completion) {
        let (index, qp, what) = (
            (c.wr_id >> 16) as usize,
            ((c.wr_id >> 8) & 0xff) as usize,
            c.wr_id & 0xff,
        );
        let Some(link) = self.link(index) else {
            return;
        };
        let kind = match what {
            WR_DATA => "data write",
            WR_CREDIT => "credit write",
            WR_CLOSE => "close notice",
            WR_PROBE => "probe",
            _ => "receive",
        };
        if c.status != verbs::WcStatus::Success {
            let expected = c.status == verbs::WcStatus::Flushed
                && (link.closing.load(Ordering::SeqCst) || *lock(&link.state) != LinkState::Up);
            if !expected {
                self.fail(
                    link,
                    format!(
                        "{kind} on queue pair {} (rank {} to rank {}) failed: {}",
                        c.qpn, self.rank, link.peer, c.status
                    ),
                );
            }
            if what == WR_CREDIT {
                lock(&link.inc).credits_in_flight -= 1;
            } else if what != WR_RECV {
                let mut out = lock(&link.out);
                out.in_flight = out.in_flight.saturating_sub(1);
            }
            return;
        }
        match what {
            WR_DATA => {
                let mut out = lock(&link.out);
                out.written[qp] += 1;
                out.in_flight -= 1;
                self.release_sent(&mut out);
            }
            WR_CREDIT => {
                lock(&link.inc).credits_in_flight -= 1;
                self.return_credits(index);
            }
            WR_CLOSE => lock(&link.out).in_flight -= 1,
            WR_PROBE => {
                lock(&link.out).in_flight -= 1;
                link.probe_in_flight.store(false, Ordering::SeqCst);
            }
            _ => self.received(index, qp, c),
        }
    }

    /// A write with immediate data arrived on queue pair `qp` of link `index`.
    fn received(&self, index: usize, qp: usize, c: Completion) {
        let Some(link) = self.link(index) else {
            return;
        };
        let imm = c.imm.unwrap_or(0);
        let (kind, value) = (imm >> KIND_SHIFT, imm & VALUE_MASK);
        if kind != KIND_CLOSE
            && let Err(e) = self.nic.post_recv(link.qpns[qp], wr_id(index, qp, WR_RECV))
        {
            self.fail(link, format!("posting a receive failed: {e}"));
        }
        match kind {
            KIND_DATA => {
                let mut inc = lock(&link.inc);
                let n = inc.received[qp];
                let (seq, len) = (
                    u64::from(value >> LEN_BITS),
                    (value & ((1 << LEN_BITS) - 1)) as usize,
                );
                if seq != n & SEQ_MASK {
                    drop(inc);
                    self.fail(
                        link,
                        format!(
                            "slot {n} from rank {} arrived as slot number {seq} mod 64 on queue \
                             pair {}: a completion was lost",
                            link.peer, c.qpn
                        ),
                    );
                    return;
                }
                if len > link.geometry.slot_bytes {
                    drop(inc);
                    self.fail(
                        link,
                        format!(
                            "rank {} announced a slot of {len} bytes, more than the {} a slot \
                             holds",
                            link.peer, link.geometry.slot_bytes
                        ),
                    );
                    return;
                }
                let slots = inc.lens.len() as u64;
                inc.lens[(n % slots) as usize] = len;
                inc.received[qp] = n + 1;
                let done = inc.received.iter().copied().min().unwrap_or(0);
                let mut moved = false;
                while inc.committed < done {
                    let len = inc.lens[(inc.committed % slots) as usize];
                    inc.fifo.commit(len);
                    inc.committed += 1;
                    moved = true;
                }
                drop(inc);
                if moved {
                    self.rank_bell.ring();
                }
            }
            KIND_CREDIT => {
                let mut out = lock(&link.out);
                let delta = value.wrapping_sub(out.credited as u32 & VALUE_MASK) & VALUE_MASK;
                out.credited += u64::from(delta);
                self.release_sent(&mut out);
            }
            KIND_CLOSE => {
                let all = {
                    let mut inc = lock(&link.inc);
                    inc.closed[qp] = true;
                    inc.closed.iter().all(|&c| c)
                };
                if all {
                    let why = match value {
                        0 => Closed::ByOwner,
                        r => Closed::PeerFailed(r as usize - 1),
                    };
                    link.set_state(LinkState::Closed(why));
                    self.rank_bell.ring_always();
                }
            }
            _ => self.fail(
                link,
                format!(
                    "rank {} sent immediate data of unknown kind {imm:#x}",
                    link.peer
                ),
            ),
        }
    }

    /// Hands back to the engine every slot the peer consumed and this side's NIC read.
    fn release_sent(&self, out: &mut Outgoing) {
        let read = out.written.iter().copied().min().unwrap_or(0);
        let done = read.min(out.credited);
        let mut moved = false;
        while out.released < done {
            out.fifo.release();
            out.released += 1;
            moved = true;
        }
        if moved {
            self.rank_bell.ring();
        }
    }

    /// Posts the writes of every slot the engine committed on link `index`.
    fn post_committed(&self, index: usize) {
        let Some(link) = self.link(index) else {
            return;
        };
        let mut out = lock(&link.out);
        let nq = link.qpns.len();
        let g = link.geometry;
        loop {
            let ahead = (out.posted - out.released) as u32;
            let Some((ptr, len)) = out.fifo.try_peek_ahead(ahead) else {
                return;
            };
            let slot = out.posted;
            let remote_slot = link.remote.addr
                + (DATA_OFFSET + (slot % g.slots as u64) as usize * g.slot_bytes) as u64;
            for (qi, &qpn) in link.qpns.iter().enumerate() {
                let piece = stripe(len, qi, nq);
                let local = Local {
                    addr: ptr as u64 + piece.start as u64,
                    len: piece.len() as u32,
                    lkey: link.out_region.lkey,
                };
                let remote = Remote {
                    addr: remote_slot + piece.start as u64,
                    rkey: link.remote.rkey,
                };
                // SAFETY: the slot lies in the registered outgoing FIFO and stays
                // unchanged until handed back to the engine, which `release_sent` does
                // only after this write completed.
                let posted = unsafe {
                    self.nic.post_write(
                        qpn,
                        wr_id(index, qi, WR_DATA),
                        local,
                        remote,
                        Some(data_imm(slot, len)),
                    )
                };
                if let Err(e) = posted {
                    drop(out);
                    self.fail(
                        link,
                        format!("posting a data write to rank {} failed: {e}", link.peer),
                    );
                    return;
                }
                out.in_flight += 1;
            }
            out.posted += 1;
        }
    }

    /// Tells the peer of link `index` how far this side's engine has consumed.
    fn return_credits(&self, index: usize) {
        let Some(link) = self.link(index) else {
            return;
        };
        let mut inc = lock(&link.inc);
        let tail = inc.fifo.consumed();
        if tail == inc.credit_sent || inc.credits_in_flight >= link.geometry.slots {
            return;
        }
        let local = Local {
            addr: link.in_region.addr,
            len: 0,
            lkey: link.in_region.lkey,
        };
        // SAFETY: a write of no bytes reads no memory.
        let posted = unsafe {
            self.nic.post_write(
                link.qpns[0],
                wr_id(index, 0, WR_CREDIT),
                local,
                link.remote,
                Some(KIND_CREDIT << KIND_SHIFT | (tail & VALUE_MASK)),
            )
        };
        match posted {
            Ok(()) => {
                inc.credit_sent = tail;
                inc.credits_in_flight += 1;
            }
            Err(e) => {
                drop(inc);
                self.fail(
                    link,
                    format!("posting a credit to rank {} failed: {e}", link.peer),
                );
            }
        }
    }

    /// Posts a write of no bytes on `link`'s queue pair `qp` (a close notice with
    /// immediate data, or a probe without).
    fn post_empty(&self, index: usize, qp: usize, what: u64, imm: Option<u32>) -> bool {
        let Some(link) = self.link(index) else {
            return false;
        };
        let local = Local {
            addr: link.out_region.addr,
            len: 0,
            lkey: link.out_region.lkey,
        };
        // Counted under the lock held while posting, so that the completion, which
        // takes the lock, is never handled before the count.
        let mut out = lock(&link.out);
        // SAFETY: a write of no bytes reads no memory.
        let posted = unsafe {
            self.nic.post_write(
                link.qpns[qp],
                wr_id(index, qp, what),
                local,
                link.remote,
                imm,
            )
        };
        if posted.is_ok() {
            out.in_flight += 1;
        }
        posted.is_ok()
    }

    /// Closes link `index`: a close notice with the cause on every queue pair, unless
    /// the link is closed or broken already (the peer would never answer it).
    fn close(&self, index: usize, why: Closed) {
        let Some(link) = self.link(index) else {
            return;
        };
        if link.closing.swap(true, Ordering::SeqCst) || *lock(&link.state) != LinkState::Up {
            return;
        }
        let cause = match why {
            Closed::PeerFailed(r) => r as u32 + 1,
            _ => 0,
        };
        for qp in 0..link.qpns.len() {
            self.post_empty(index, qp, WR_CLOSE, Some(KIND_CLOSE << KIND_SHIFT | cause));
        }
    }

    /// The proxy: polls the completion queue whenever it has something, returns credits
    /// the engine left, probes idle peers.
    fn run_proxy(&self) {
        let mut last_probe = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            self.progress(true);
            for index in 0..self.links.len() {
                self.return_credits(index);
            }
            if last_probe.elapsed() >= self.probe_every {
                last_probe = Instant::now();
                for (index, link) in self.made() {
                    if *lock(&link.state) == LinkState::Up
                        && link.ready.load(Ordering::SeqCst)
                        && !link.closing.load(Ordering::SeqCst)
                        && !link.probe_in_flight.swap(true, Ordering::SeqCst)
                        && !self.post_empty(index, 0, WR_PROBE, None)
                    {
                        link.probe_in_flight.store(false, Ordering::SeqCst);
                    }
                }
            }
            self.nic
                .wait(self.probe_every.min(Duration::from_millis(200)));
        }
    }
}

/// One rank's RDMA links: the device, the proxy, and what every link shares.
pub struct RdmaNet {
    shared: Arc<NetShared>,
    proxy: Option<JoinHandle<()>>,
}

/// One link, as [`super::Connections`] holds it.
pub struct RdmaLink {
    shared: Arc<NetShared>,
    index: usize,
}

/// A link made at establishment: its index and the engine's ends (the FIFO it sends
/// into, the FIFO it receives from).
pub type EagerLink = (usize, SendEnd, RecvEnd);

/// A link a rank may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkSpec {
    /// Channel index (the last one is point-to-point).
    pub channel: usize,
    /// The peer rank.
    pub peer: usize,
}

/// Every rank says whether its links are ready (collective), whatever happened before:
/// `connected` is this rank's outcome; the first rank that failed is every rank's error.
fn agree_ready(boot: &Bootstrap, connected: Result<()>) -> Result<()> {
    let ready = boot.all_gather(&[u8::from(connected.is_ok())]);
    connected.and(ready).and_then(
        |ready| match ready.iter().position(|r| r.first() != Some(&1)) {
            None => Ok(()),
            Some(r) => Err(Error::BootstrapData {
                rank: r,
                detail: "could not set up its RDMA links".into(),
            }),
        },
    )
}

/// The RDMA phase of connecting a rank (collective whenever any two ranks of the job
/// talk over RDMA): the links of the rings (from the previous rank of each channel's
/// ring, to the next) are made now, the others on first use (see
/// [`lazy`](super::lazy)), so that registered memory grows with the peers used. The
/// links' FIFO ends go into `ends`; their proxy rings `own_bell`.
pub(super) fn connect_links(
    boot: &Bootstrap,
    routes: &super::routes::Routes,
    config: &super::TransportConfig,
    nic: Option<Arc<dyn Nic>>,
    own_bell: &Arc<Bell>,
    ends: &mut super::Ends,
) -> Result<Option<RdmaNet>> {
    let (rank, nranks) = (routes.rank, routes.nranks);
    let rdma = super::routes::Path::Rdma;
    if !(0..nranks).any(|a| (0..nranks).any(|b| routes.path(a, b) == rdma)) {
        return Ok(None);
    }
    // Every link this rank may have.
    let specs: Vec<LinkSpec> = (0..=routes.channels)
        .flat_map(|ci| {
            routes
                .neighbours(ci)
                .into_iter()
                .filter(|&p| routes.to(p) == rdma)
                .map(move |peer| LinkSpec { channel: ci, peer })
        })
        .collect();
    let ring_neighbour = |spec: &LinkSpec| {
        config.rings.get(spec.channel).is_some_and(|ring| {
            let at = ring.iter().position(|&r| r == rank).expect("in every ring");
            let n = ring.len();
            spec.peer == ring[(at + 1) % n] || spec.peer == ring[(at + n - 1) % n]
        })
    };
    let eager: Vec<usize> = (0..specs.len())
        .filter(|&i| ring_neighbour(&specs[i]))
        .collect();
    let (net, made) = RdmaNet::establish(
        boot,
        nic,
        &config.rdma,
        config.geometry,
        specs.clone(),
        &eager,
        own_bell.clone(),
        config.link_timeout,
    )?;
    for (i, tx, rx) in made {
        let spec = specs[i];
        ends.sends[0][spec.channel][spec.peer] = Some(tx);
        ends.recvs[0][spec.channel][spec.peer] = Some(rx);
        let link = net.as_ref().expect("links need the net").link(i);
        ends.links[spec.channel][spec.peer] = Some(super::NetLink::Rdma(link));
    }
    Ok(net)
}

impl RdmaNet {
    /// Connects this rank's RDMA links (collective over `boot`: every rank calls it,
    /// with no links if it has none). `specs` lists every link this rank may have; the
    /// ones at the indices `eager` (the rings') are made now, the others on first use
    /// ([`RdmaNet::prepare_link`]). Returns the net and, per eager link, its index and the
    /// engine's ends: the FIFO it sends into and the FIFO it receives from.
    #[allow(clippy::too_many_arguments)]
    pub fn establish(
        boot: &Bootstrap,
        nic: Option<Arc<dyn Nic>>,
        config: &RdmaConfig,
        geometry: Geometry,
        specs: Vec<LinkSpec>,
        eager: &[usize],
        rank_bell: Arc<Bell>,
        link_timeout: Duration,
    ) -> Result<(Option<RdmaNet>, Vec<EagerLink>)> {
        config.validate()?;
        let rank = boot.rank();
        let eager: Vec<(usize, &LinkSpec)> = eager.iter().map(|&i| (i, &specs[i])).collect();
        let (mut local, nets_error) = match &nic {
            Some(nic) if !specs.is_empty() => {
                match Self::prepare(nic.as_ref(), config, geometry, &eager, rank) {
                    Ok(prepared) => (prepared, None),
                    Err(e) => (Vec::new(), Some(e)),
                }
            }
            _ => (Vec::new(), None),
        };
        let mut blob = Writer::default();
        encode_links(&mut blob, eager.iter().map(|(_, spec)| *spec).zip(&local));
        // Everyone publishes, even a rank that failed (with no links), so that the
        // others fail on its missing links instead of waiting.
        let all = boot.all_gather(&blob.into_vec());
        let cleanup = |nic: &Option<Arc<dyn Nic>>, local: Vec<Prepared>| {
            if let Some(nic) = nic {
                for p in local {
                    p.destroy(nic.as_ref());
                }
            }
        };
        let all = match all {
            Ok(all) => all,
            Err(e) => {
                cleanup(&nic, local);
                return Err(e);
            }
        };
        let connected = (|| -> Result<()> {
            if let Some(e) = nets_error {
                return Err(e);
            }
            let Some(nic) = nic.as_ref().filter(|_| !specs.is_empty()) else {
                return Ok(());
            };
            for ((_, spec), p) in eager.iter().zip(&mut local) {
                let bytes = all.get(spec.peer).ok_or_else(|| Error::BootstrapData {
                    rank: spec.peer,
                    detail: "published no RDMA links".into(),
                })?;
                connect_prepared(nic.as_ref(), spec, p, bytes, rank)?;
            }
            Ok(())
        })();
        // Every rank says whether its links are ready, whatever happened above: no queue
        // pair is written before every one is connected, and a rank that failed is named
        // by every other instead of leaving them to wait.
        if let Err(e) = agree_ready(boot, connected) {
            cleanup(&nic, local);
            return Err(e);
        }
        let Some(nic) = nic.filter(|_| !specs.is_empty()) else {
            return Ok((None, Vec::new()));
        };
        let links: Vec<OnceLock<LinkShared>> = specs.iter().map(|_| OnceLock::new()).collect();
        let mut engine_ends = Vec::new();
        for ((index, spec), p) in eager.iter().zip(local) {
            let (link, tx, rx) = p.into_link(spec.peer, geometry, true);
            let _ = links[*index].set(link);
            engine_ends.push((*index, tx, rx));
        }
        let shared = Arc::new(NetShared {
            rank,
            nic,
            config: config.clone(),
            geometry,
            specs,
            links,
            rank_bell,
            stop: AtomicBool::new(false),
            polling: Mutex::new(Vec::with_capacity(64)),
            registrations: Mutex::new(Vec::new()),
            probe_every: (link_timeout / 3).max(Duration::from_millis(10)),
        });
        let sh = shared.clone();
        let proxy = std::thread::Builder::new()
            .name(format!("ferroccl-ib-r{rank}"))
            .spawn(move || sh.run_proxy())
            .map_err(|e| Error::io("start the RDMA proxy", e))?;
        Ok((
            Some(RdmaNet {
                shared,
                proxy: Some(proxy),
            }),
            engine_ends,
        ))
    }

    /// The index of the link to `peer` on channel index `channel`, if this rank may
    /// have one.
    pub fn index_of(&self, channel: usize, peer: usize) -> Option<usize> {
        self.shared
            .specs
            .iter()
            .position(|s| s.channel == channel && s.peer == peer)
    }

    /// Whether link `index` is made.
    pub fn is_made(&self, index: usize) -> bool {
        self.shared.link(index).is_some()
    }

    /// First step of making link `index` on first use (see [`super::lazy`]): creates
    /// and registers this side's FIFOs and queue pairs. What the peer needs is
    /// [`PendingLink::description`]; the peer makes its side in the same call.
    pub fn prepare_link(&self, index: usize) -> Result<PendingLink> {
        let sh = &self.shared;
        let spec = sh.specs[index];
        let prepared = Self::prepare(
            sh.nic.as_ref(),
            &sh.config,
            sh.geometry,
            &[(index, &spec)],
            sh.rank,
        )?
        .pop()
        .expect("one link prepared");
        let mut blob = Writer::default();
        encode_links(&mut blob, std::iter::once((&spec, &prepared)));
        Ok(PendingLink {
            nic: sh.nic.clone(),
            index,
            prepared: Some(prepared),
            description: blob.into_vec(),
        })
    }

    /// Second step: connects `pending` to the peer's description. The link is made (its
    /// completions are handled) but sends no probe until [`RdmaNet::link_ready`].
    /// Returns the engine's ends.
    pub fn connect_link(
        &self,
        mut pending: PendingLink,
        theirs: &[u8],
    ) -> Result<(SendEnd, RecvEnd)> {
        let sh = &self.shared;
        let spec = sh.specs[pending.index];
        let mut prepared = pending.prepared.take().expect("prepared until connected");
        if let Err(e) = connect_prepared(sh.nic.as_ref(), &spec, &mut prepared, theirs, sh.rank) {
            prepared.destroy(sh.nic.as_ref());
            return Err(e);
        }
        let (link, tx, rx) = prepared.into_link(spec.peer, sh.geometry, false);
        let _ = sh.links[pending.index].set(link);
        Ok((tx, rx))
    }

    /// Last step: the peer's side is connected too; link `index` may probe.
    pub fn link_ready(&self, index: usize) {
        if let Some(link) = self.shared.link(index) {
            link.ready.store(true, Ordering::SeqCst);
        }
    }

    /// Marks link `index` broken (making it failed on the peer's side), so that the
    /// engine reports `why`.
    pub fn link_failed(&self, index: usize, why: String) {
        if let Some(link) = self.shared.link(index) {
            self.shared.fail(link, why);
        }
    }

    /// Creates and registers each link's FIFOs and queue pairs, with receives posted (an
    /// error if the FIFOs' slots are too large for an RDMA link).
    fn prepare(
        nic: &dyn Nic,
        config: &RdmaConfig,
        geometry: Geometry,
        specs: &[(usize, &LinkSpec)],
        rank: usize,
    ) -> Result<Vec<Prepared>> {
        if geometry.slot_bytes > MAX_SLOT_BYTES {
            return Err(Error::invalid(format!(
                "FIFO slots of {} bytes are too large for RDMA links (at most {} bytes: the \
                 byte count travels in 24 bits); lower FERROCCL_SLOT_SIZE",
                geometry.slot_bytes, MAX_SLOT_BYTES
            )));
        }
        let options = config.qp_options(geometry.slots);
        let mut done: Vec<Prepared> = Vec::new();
        let result = (|| -> Result<()> {
            for &(index, spec) in specs {
                let tag = format!("ib-r{rank}-c{}-p{}", spec.channel, spec.peer);
                let (engine_tx, proxy_rx) = local_fifo(geometry, &tag)?;
                let (proxy_tx, engine_rx) = local_fifo(geometry, &tag)?;
                let register = |(ptr, len): (*mut u8, usize), remote_write: bool| {
                    // SAFETY: the FIFO's segment stays allocated while the proxy's end
                    // lives, and `Prepared::destroy` / `RdmaNet`'s drop deregister it
                    // before dropping that end.
                    unsafe { nic.register(ptr, len, remote_write) }.map_err(|e| {
                        Error::io(format!("register a FIFO for rank {}", spec.peer), e)
                    })
                };
                // The NIC only reads the outgoing FIFO; the peer writes the incoming one.
                let out_region = register(proxy_rx.memory(), false)?;
                let mut p = Prepared {
                    engine_tx,
                    engine_rx,
                    proxy_rx,
                    proxy_tx,
                    out_region,
                    in_region: out_region,
                    endpoints: Vec::new(),
                    remote: Remote { addr: 0, rkey: 0 },
                };
                match register(p.proxy_tx.memory(), true) {
                    Ok(r) => p.in_region = r,
                    Err(e) => {
                        let _ = nic.deregister(&p.out_region);
                        return Err(e);
                    }
                }
                let filled = (|| -> Result<()> {
                    for qi in 0..config.qps_per_connection {
                        let e = nic.create_qp(&options).map_err(|e| {
                            Error::io(format!("create a queue pair for rank {}", spec.peer), e)
                        })?;
                        p.endpoints.push(e);
                        for _ in 0..options.max_recv {
                            nic.post_recv(e.qpn, wr_id(index, qi, WR_RECV))
                                .map_err(|e| Error::io("post a receive", e))?;
                        }
                    }
                    Ok(())
                })();
                done.push(p);
                filled?;
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(done),
            Err(e) => {
                for p in done {
                    p.destroy(nic);
                }
                Err(e)
            }
        }
    }

    /// The handle of link `index` (in the order of the `specs` given to
    /// [`RdmaNet::establish`]).
    pub fn link(&self, index: usize) -> RdmaLink {
        RdmaLink {
            shared: self.shared.clone(),
            index,
        }
    }

    /// Registers `len` bytes at `addr` with the device, through a cache: a buffer inside
    /// one registered before shares its registration (counted), so registering the same
    /// buffer again, or a part of it, costs no device call.
    ///
    /// # Safety
    /// The memory must stay allocated until the matching [`RdmaNet::deregister`] (or
    /// until this net is dropped).
    pub unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Region> {
        let mut cache = lock(&self.shared.registrations);
        if let Some((region, refs)) = cache.iter_mut().find(|(r, _)| r.covers(addr as u64, len)) {
            *refs += 1;
            return Ok(*region);
        }
        // SAFETY: forwarded from this function's contract.
        let region = unsafe { self.shared.nic.register(addr, len, true) }.map_err(|e| {
            Error::io(
                format!(
                    "register {len} bytes at {addr:p} with {}",
                    self.shared.nic.device().name
                ),
                e,
            )
        })?;
        cache.push((region, 1));
        Ok(region)
    }

    /// Ends one registration that [`RdmaNet::register`] returned; the device
    /// registration goes when the last one that shares it does.
    pub fn deregister(&self, region: &Region) -> Result<()> {
        let mut cache = lock(&self.shared.registrations);
        let at = cache.iter().position(|(r, _)| r == region).ok_or_else(|| {
            Error::invalid(format!(
                "{region:?} is not registered with this communicator"
            ))
        })?;
        cache[at].1 -= 1;
        if cache[at].1 == 0 {
            let (region, _) = cache.remove(at);
            self.shared
                .nic
                .deregister(&region)
                .map_err(|e| Error::io(format!("deregister {region:?}"), e))?;
        }
        Ok(())
    }
}

/// A link's local half before its peer's is known.
struct Prepared {
    engine_tx: SendEnd,
    engine_rx: RecvEnd,
    proxy_rx: RecvEnd,
    proxy_tx: SendEnd,
    out_region: Region,
    in_region: Region,
    endpoints: Vec<Endpoint>,
    remote: Remote,
}

impl Prepared {
    fn destroy(self, nic: &dyn Nic) {
        for e in &self.endpoints {
            nic.destroy_qp(e.qpn);
        }
        let _ = nic.deregister(&self.out_region);
        if self.in_region != self.out_region {
            let _ = nic.deregister(&self.in_region);
        }
    }

    /// The connected link to `peer` (probes allowed once `ready`), and the engine's ends.
    fn into_link(
        self,
        peer: usize,
        geometry: Geometry,
        ready: bool,
    ) -> (LinkShared, SendEnd, RecvEnd) {
        let nq = self.endpoints.len();
        let link = LinkShared {
            peer,
            qpns: self.endpoints.iter().map(|e| e.qpn).collect(),
            geometry,
            out_region: self.out_region,
            in_region: self.in_region,
            remote: self.remote,
            out: Mutex::new(Outgoing {
                fifo: self.proxy_rx,
                posted: 0,
                written: vec![0; nq],
                credited: 0,
                released: 0,
                in_flight: 0,
            }),
            inc: Mutex::new(Incoming {
                fifo: self.proxy_tx,
                received: vec![0; nq],
                lens: vec![0; geometry.slots],
                committed: 0,
                credit_sent: 0,
                credits_in_flight: 0,
                closed: vec![false; nq],
            }),
            state: Mutex::new(LinkState::Up),
            closing: AtomicBool::new(false),
            probe_in_flight: AtomicBool::new(false),
            ready: AtomicBool::new(ready),
        };
        (link, self.engine_tx, self.engine_rx)
    }
}

/// One side of a link being made on first use, between [`RdmaNet::prepare_link`] and
/// [`RdmaNet::connect_link`]; dropped before, it destroys what it created.
pub struct PendingLink {
    nic: Arc<dyn Nic>,
    index: usize,
    prepared: Option<Prepared>,
    description: Vec<u8>,
}

impl PendingLink {
    /// What the peer needs to connect to this side.
    pub fn description(&self) -> &[u8] {
        &self.description
    }
}

impl Drop for PendingLink {
    fn drop(&mut self) {
        if let Some(p) = self.prepared.take() {
            p.destroy(self.nic.as_ref());
        }
    }
}

/// Appends what a peer needs of each link: channel, peer, the queue pairs' endpoints and
/// the incoming FIFO.
fn encode_links<'a>(blob: &mut Writer, links: impl Iterator<Item = (&'a LinkSpec, &'a Prepared)>) {
    let links: Vec<_> = links.collect();
    blob.u64(links.len() as u64);
    for (spec, p) in links {
        blob.u64(spec.channel as u64)
            .u64(spec.peer as u64)
            .u64(p.endpoints.len() as u64);
        for e in &p.endpoints {
            e.encode(blob);
        }
        blob.u64(p.in_region.addr).u32(p.in_region.rkey);
    }
}

/// Connects `p`, this rank's side of `spec`, to what the peer published (`bytes`, in
/// [`encode_links`]' form): the same number of queue pairs, ports of the same kind.
fn connect_prepared(
    nic: &dyn Nic,
    spec: &LinkSpec,
    p: &mut Prepared,
    bytes: &[u8],
    rank: usize,
) -> Result<()> {
    let (endpoints, remote) = find_peer_link(bytes, spec.peer, spec.channel, rank)?;
    if endpoints.len() != p.endpoints.len() {
        return Err(Error::BootstrapData {
            rank: spec.peer,
            detail: format!(
                "{} queue pairs per connection, this rank has {} \
                 (NCCL_IB_QPS_PER_CONNECTION must be the same everywhere)",
                endpoints.len(),
                p.endpoints.len()
            ),
        });
    }
    if let Some(theirs) = endpoints.first()
        && theirs.ethernet != nic.device().ethernet()
    {
        let kind = |ethernet| if ethernet { "RoCE" } else { "InfiniBand" };
        return Err(Error::BootstrapData {
            rank: spec.peer,
            detail: format!(
                "its RDMA port is {}, this rank's is {}: they cannot connect \
                 (NCCL_IB_HCA can choose ports of one kind)",
                kind(theirs.ethernet),
                describe(nic),
            ),
        });
    }
    for (mine, theirs) in p.endpoints.iter().zip(&endpoints) {
        nic.connect(mine.qpn, theirs).map_err(|e| {
            Error::io(
                format!("connect queue pair {} to rank {}", mine.qpn, spec.peer),
                e,
            )
        })?;
    }
    p.remote = remote;
    Ok(())
}

/// What `peer` published (`bytes`) for its link to `me` on `channel`: its queue pairs'
/// endpoints and its incoming FIFO.
fn find_peer_link(
    bytes: &[u8],
    peer: usize,
    channel: usize,
    me: usize,
) -> Result<(Vec<Endpoint>, Remote)> {
    let bad = |detail: String| Error::BootstrapData { rank: peer, detail };
    let mut c = Cursor::new(bytes);
    let e = |e| format!("RDMA links: {e:?}");
    let n = c.count(1 << 20, "link").map_err(|x| bad(e(x)))?;
    for _ in 0..n {
        let ch = c.u64().map_err(|x| bad(e(x)))? as usize;
        let to = c.u64().map_err(|x| bad(e(x)))? as usize;
        let nq = c
            .count(MAX_QPS_PER_CONNECTION, "queue pair")
            .map_err(|x| bad(e(x)))?;
        let endpoints = (0..nq)
            .map(|_| Endpoint::decode(&mut c))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|x| bad(format!("RDMA endpoint: {x}")))?;
        let addr = c.u64().map_err(|x| bad(e(x)))?;
        let rkey = c.u32().map_err(|x| bad(e(x)))?;
        if ch == channel && to == me {
            return Ok((endpoints, Remote { addr, rkey }));
        }
    }
    Err(bad(format!(
        "no RDMA link to rank {me} on channel {channel} (its device failed to open, or it \
         counts this pair as another transport)"
    )))
}

impl Drop for RdmaNet {
    fn drop(&mut self) {
        let sh = &self.shared;
        for index in 0..sh.links.len() {
            sh.close(index, Closed::ByOwner);
        }
        // The proxy stops first, so that this thread alone polls and waits below.
        sh.stop.store(true, Ordering::SeqCst);
        sh.nic.interrupt();
        if let Some(t) = self.proxy.take() {
            let _ = t.join();
        }
        // Let the writes in flight on working links finish (the close notices among
        // them), bounded: a peer that is gone fails them only after the transport
        // timeout.
        let start = Instant::now();
        while start.elapsed() < DRAIN_LIMIT
            && sh.made().any(|(_, l)| {
                *lock(&l.state) == LinkState::Up
                    && (lock(&l.out).in_flight > 0 || lock(&l.inc).credits_in_flight > 0)
            })
        {
            if !sh.progress(true) {
                sh.nic.wait(Duration::from_millis(1));
            }
        }
        for (_, link) in sh.made() {
            for &qpn in &link.qpns {
                sh.nic.destroy_qp(qpn);
            }
            let _ = sh.nic.deregister(&link.out_region);
            let _ = sh.nic.deregister(&link.in_region);
        }
        for (region, _) in lock(&sh.registrations).drain(..) {
            let _ = sh.nic.deregister(&region);
        }
    }
}

impl RdmaLink {
    fn link(&self) -> &LinkShared {
        self.shared
            .link(self.index)
            .expect("an RdmaLink is handed out only for a made link")
    }

    /// After the engine committed slots: posts their writes.
    pub fn ring_send(&self) {
        self.shared.post_committed(self.index);
    }

    /// After the engine released slots: returns credits.
    pub fn ring_recv(&self) {
        self.shared.return_credits(self.index);
    }

    /// The engine, about to look at a FIFO of this link (either way): polls the
    /// completion queue in line.
    pub fn read_in_line(&self) {
        self.shared.progress(false);
    }

    /// The link's state.
    pub fn state(&self) -> LinkState {
        lock(&self.link().state).clone()
    }

    /// Closes this side, telling the peer why.
    pub fn close(&self, why: Closed) {
        self.shared.close(self.index, why);
    }
}

#[cfg(test)]
mod tests {
    use super::gid::{AddrFamily, AddrRange, GidSelection};
    use super::verbs::DeviceInfo;
    use super::*;

    fn dev(name: &str, port: u8) -> DeviceInfo {
        DeviceInfo {
            port,
            ..sim::SimFabric::device(name, "InfiniBand", Vec::new())
        }
    }

    #[test]
    fn nccl_ib_hca_selects_excludes_and_matches_exactly_as_nccl() {
        let f = HcaFilter::parse("mlx5").unwrap();
        assert!(f.allows(&dev("mlx5_0", 1)) && f.allows(&dev("mlx5_10", 2)));
        assert!(!f.allows(&dev("rxe0", 1)));
        let f = HcaFilter::parse("mlx5_0:1,mlx5_1").unwrap();
        assert!(f.allows(&dev("mlx5_0", 1)) && !f.allows(&dev("mlx5_0", 2)));
        assert!(f.allows(&dev("mlx5_1", 2)));
        // Prefix matching: mlx5_1 also selects mlx5_10, unless exact.
        assert!(f.allows(&dev("mlx5_10", 1)));
        let f = HcaFilter::parse("=mlx5_1").unwrap();
        assert!(f.allows(&dev("mlx5_1", 1)) && !f.allows(&dev("mlx5_10", 1)));
        let f = HcaFilter::parse("^=mlx5_1").unwrap();
        assert!(!f.allows(&dev("mlx5_1", 1)) && f.allows(&dev("mlx5_10", 1)));
        let f = HcaFilter::parse("^mlx5_0:2").unwrap();
        assert!(f.allows(&dev("mlx5_0", 1)) && !f.allows(&dev("mlx5_0", 2)));
        for bad in ["", "^", "mlx5_0:x", "mlx5_0:0", ":1", "=,"] {
            assert!(HcaFilter::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_gid_settings_read_as_nccl_reads_them() {
        let read = |vars: &[(&str, &str)]| {
            let vars: std::collections::HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            gid_selection(|name| vars.get(name).cloned())
        };
        assert_eq!(read(&[]).unwrap(), GidSelection::default());
        assert_eq!(
            read(&[("NCCL_IB_GID_INDEX", "-1")]).unwrap(),
            GidSelection::default()
        );
        assert_eq!(
            read(&[
                ("NCCL_IB_GID_INDEX", "3"),
                ("NCCL_IB_ROCE_VERSION_NUM", "1")
            ])
            .unwrap(),
            GidSelection::Index(3),
            "an index wins over what the choice would look for"
        );
        assert_eq!(
            read(&[
                ("NCCL_IB_ROCE_VERSION_NUM", "1"),
                ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
                ("NCCL_IB_ADDR_RANGE", "fd00::/8"),
            ])
            .unwrap(),
            GidSelection::Auto {
                roce_version: 1,
                family: AddrFamily::V6,
                range: Some(AddrRange::parse("fd00::/8").unwrap()),
            }
        );
        for (vars, named) in [
            (&[("NCCL_IB_GID_INDEX", "256")][..], "NCCL_IB_GID_INDEX"),
            (&[("NCCL_IB_GID_INDEX", "x")], "NCCL_IB_GID_INDEX"),
            (
                &[("NCCL_IB_ROCE_VERSION_NUM", "3")],
                "NCCL_IB_ROCE_VERSION_NUM",
            ),
            (&[("NCCL_IB_ADDR_FAMILY", "inet")], "NCCL_IB_ADDR_FAMILY"),
            (&[("NCCL_IB_ADDR_RANGE", "10.0.0.0")], "NCCL_IB_ADDR_RANGE"),
            // An IPv6 range under the default family AF_INET.
            (&[("NCCL_IB_ADDR_RANGE", "fd00::/8")], "NCCL_IB_ADDR_RANGE"),
        ] {
            let e = read(vars).unwrap_err().to_string();
            assert!(e.contains(named), "{vars:?}: {e}");
        }
    }

    #[test]
    fn settings_out_of_range_are_refused_naming_them() {
        let c = RdmaConfig {
            timeout: 0,
            ..RdmaConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("NCCL_IB_TIMEOUT")
        );
        let c = RdmaConfig {
            retry_cnt: 8,
            ..RdmaConfig::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("NCCL_IB_RETRY_CNT")
        );
        let c = RdmaConfig {
            qps_per_connection: 0,
            ..RdmaConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_QPS_PER_CONNECTION"), "{e}");
        assert!(RdmaConfig::default().validate().is_ok());
        // NCCL's default timeout (20) and retry count (7): 4.3 s a try, 8 tries.
        let o = RdmaConfig::default().qp_options(8);
        assert_eq!(
            o.transport_timeout(),
            Duration::from_nanos(4096) * (1 << 20) * 8
        );
    }

    #[test]
    fn immediate_data_carries_kind_sequence_and_length() {
        for (slot, len) in [
            (0u64, 0usize),
            (63, 1),
            (64, MAX_SLOT_BYTES),
            (1 << 40, 12345),
        ] {
            let imm = data_imm(slot, len);
            assert_eq!(imm >> KIND_SHIFT, KIND_DATA);
            assert_eq!(u64::from((imm & VALUE_MASK) >> LEN_BITS), slot & SEQ_MASK);
            assert_eq!((imm & ((1 << LEN_BITS) - 1)) as usize, len);
        }
        // Credits carry the tail mod 2^30; the sender's count grows by the difference,
        // across the wrap of the 32-bit tail too.
        let mut credited: u64 = (1 << 32) - 3;
        for tail in [u32::MAX - 1, u32::MAX, 0, 5] {
            let value = tail & VALUE_MASK;
            let delta = value.wrapping_sub(credited as u32 & VALUE_MASK) & VALUE_MASK;
            credited += u64::from(delta);
            assert_eq!(credited as u32, tail);
        }
    }

    #[test]
    fn without_an_rdma_device_libibverbs_says_why() {
        let present = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|d| d.count() > 0);
        match open_nic(&RdmaConfig::default(), 0, 0, 1, 8) {
            Ok(nic) => assert!(
                present,
                "opened {:?} without /sys/class/infiniband",
                nic.device()
            ),
            Err(why) => {
                eprintln!("no RDMA here: {why}");
                assert!(why.contains("RDMA") || why.contains("libibverbs"), "{why}");
            }
        }
    }
}
