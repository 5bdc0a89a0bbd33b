//! The TCP transport: a FIFO on each side and proxy threads that move slots across
//! sockets, so the engine sees the same FIFOs as over shared memory.
//!
//! For each (channel, peer) pair that crosses hosts (or when `FERROCCL_TRANSPORT=tcp`)
//! there is one *link*: `threads × sockets_per_thread` TCP connections used in both
//! directions (NCCL's `NCCL_SOCKET_NTHREADS` × `NCCL_NSOCKS_PERTHREAD`, so a fast link
//! is filled by several flows and several cores). Every slot is cut into one stripe per
//! socket; socket `i` always carries stripe `i`, so the receiver knows where each stripe
//! goes without telling it. On each side, every helper thread runs
//! - a *send proxy* that takes the slots the engine committed to the local outgoing
//!   FIFO and writes its stripes of each as frames (`kind: u32`, `value: u32` = the
//!   slot's byte count, then the stripe), the slot being handed back once every thread
//!   has sent its stripes. One `sendmsg` gathers every frame committed so far (up to
//!   `GATHER_FRAMES`): per-call costs, not copies, bound loopback TCP here, so one
//!   system call per slot would cap the link well below what the socket can carry. The
//!   proxy never blocks inside a socket: each of its sockets takes what it can
//!   (`MSG_DONTWAIT`), and it `poll`s for room on any of them.
//! - a *receive proxy* that reads its stripes into slots of the local incoming FIFO,
//!   the slot being committed once every thread has filled its stripes. Each read also
//!   takes whatever has arrived of the next frame's header.
//!
//! Proxies sleep on a bell of their link that the engine rings after committing or
//! releasing a slot on it, and ring the rank's bell after they moved one. A link of one
//! socket is also written *in line*: after committing, the engine sends what the socket
//! takes at once itself (`MSG_DONTWAIT`), from its own CPU's cache, and wakes the send
//! proxy only for the rest. A cursor per socket under the thread's lock (slot number,
//! bytes of its frame written) lets either continue where the other stopped.
//! A communicator that closes sends a `CLOSE` frame with its cause on every socket
//! before shutting it (after sending what it had committed, when it closes normally),
//! so the peer learns which rank failed first; end-of-file or a reset without one means
//! the peer's process or link is gone. A link counts as closed once every socket
//! delivered its `CLOSE`, so data still in flight on one socket is never cut short.
//!
//! This file holds a link and its shared state; `proxy.rs` the proxy threads;
//! `setup.rs` making the sockets (connecting, accepting, the job's key) and the TCP
//! phase of connecting a rank.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::bell::{BELL_BYTES, Bell, Closed};
use super::fifo::{self, Geometry, RecvEnd, SendEnd};
use super::segment::{Segment, SegmentKind};
use crate::error::{Error, Result};
use crate::lock;

const FRAME_DATA: u32 = 0;
const FRAME_CLOSE: u32 = 1;
/// How long a closing send proxy keeps sending what the engine committed.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// Most helper threads per link, and most sockets per link (NCCL's limits).
pub const MAX_THREADS: usize = 16;
/// Most sockets per link.
pub const MAX_SOCKETS: usize = 64;

/// How many sockets and helper threads carry one link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Striping {
    /// Helper threads per link and direction (`FERROCCL_SOCKET_NTHREADS`).
    pub threads: usize,
    /// Sockets each helper thread drives (`FERROCCL_NSOCKS_PERTHREAD`).
    pub sockets_per_thread: usize,
}

impl Default for Striping {
    fn default() -> Self {
        Striping {
            threads: 1,
            sockets_per_thread: 1,
        }
    }
}

impl Striping {
    /// Sockets per link.
    pub fn sockets(&self) -> usize {
        self.threads * self.sockets_per_thread
    }

    /// Checks the shape against NCCL's limits.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_THREADS).contains(&self.threads) {
            return Err(Error::invalid(format!(
                "socket threads {} is not in 1..={MAX_THREADS}",
                self.threads
            )));
        }
        if self.sockets_per_thread == 0 || self.sockets() > MAX_SOCKETS {
            return Err(Error::invalid(format!(
                "{} threads x {} sockets per thread: need at least one socket and at most \
                 {MAX_SOCKETS} in all",
                self.threads, self.sockets_per_thread
            )));
        }
        Ok(())
    }
}

/// The byte range of stripe `i` of `n` in a slot of `len` bytes: equal 64-byte-aligned
/// pieces, the last ones shorter or empty.
pub fn stripe(len: usize, i: usize, n: usize) -> std::ops::Range<usize> {
    let piece = len.div_ceil(n).next_multiple_of(64);
    let start = (i * piece).min(len);
    start..(start + piece).min(len)
}

/// What happened to a link, as the engine asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// Working.
    Up,
    /// The peer closed its communicator (with this cause).
    Closed(Closed),
    /// The connection broke (peer process or link gone).
    Broken(String),
}

/// The outgoing FIFO as the send proxies share it.
struct Outgoing {
    fifo: RecvEnd,
    /// Slots handed back to the engine.
    released: u64,
}

/// The incoming FIFO as the receive proxies share it.
struct Incoming {
    fifo: SendEnd,
    /// Slots published to the engine.
    committed: u64,
    /// Byte count of each slot being filled, by slot number modulo the slot count.
    lens: Vec<usize>,
}

/// Where one socket's stream stands in the outgoing FIFO.
#[derive(Clone, Copy, Debug, Default)]
struct StreamPos {
    /// The frame being written: a slot number of the outgoing FIFO.
    next: u64,
    /// Bytes of that frame (its header and this socket's stripe) already written.
    done: usize,
}

/// How far one helper thread's sockets have sent (held while writing to them).
struct SendCursor {
    socks: Vec<StreamPos>,
}

impl SendCursor {
    /// Frames every one of the thread's sockets has written in full.
    fn sent(&self) -> u64 {
        self.socks.iter().map(|p| p.next).min().unwrap_or(0)
    }
}

/// Shared between a link's owner and its proxies.
struct Shared {
    stop: AtomicBool,
    /// Why this side is closing (encoded as in the bell: 0 by owner, r+1 peer r failed).
    close_cause: AtomicU32,
    /// Set once the close is a failure (no draining).
    abrupt: AtomicBool,
    state: Mutex<LinkState>,
    send_bell: Bell,
    recv_bell: Bell,
    outgoing: Mutex<Outgoing>,
    incoming: Mutex<Incoming>,
    /// Per thread: slots it has sent its stripes of.
    sent: Vec<AtomicU64>,
    /// Per thread: where its sending is (held while writing).
    sending: Vec<Mutex<SendCursor>>,
    /// Frames the engine started in line and left for the proxy (for tests).
    #[cfg(test)]
    split_frames: AtomicUsize,
    /// `sendmsg` calls that carried more than one frame (for tests).
    #[cfg(test)]
    gathers: AtomicUsize,
    /// Frames the engine read in line, and frames the receive proxies read (for tests).
    #[cfg(test)]
    frames_read: [AtomicU64; 2],
    /// Per thread: slots it has received its stripes of.
    received: Vec<AtomicU64>,
    /// Per thread: where its reading is (held while reading).
    receiving: Vec<Mutex<RecvCursor>>,
    /// Set while the engine reads a link of one socket in line: its receive proxy then
    /// stays off the socket, so arriving data wakes no one.
    engine_reads: AtomicBool,
    /// Receive proxies that read `CLOSE` on all their sockets, and the cause they read.
    closed_threads: AtomicUsize,
    peer_cause: AtomicU32,
    striping: Striping,
    /// Bytes per slot of the incoming FIFO.
    slot_bytes: usize,
}

impl Shared {
    /// Slot number `next` of the outgoing FIFO and its byte count, once committed.
    fn peek(&self, next: u64) -> Option<(*const u8, usize)> {
        let mut out = lock(&self.outgoing);
        let ahead = (next - out.released) as u32;
        out.fifo.try_peek_ahead(ahead)
    }

    fn set_state(&self, s: LinkState) {
        let mut st = lock(&self.state);
        if *st == LinkState::Up {
            *st = s;
        }
    }

    /// Hands back every slot all send proxies are done with.
    fn release_sent(&self, rank_bell: &Bell) {
        let mut out = lock(&self.outgoing);
        let done = self.sent.iter().map(|c| c.load(Ordering::Acquire)).min();
        let mut moved = false;
        while done.is_some_and(|d| d > out.released) {
            out.fifo.release();
            out.released += 1;
            moved = true;
        }
        drop(out);
        if moved {
            rank_bell.ring();
        }
    }

    /// Slot number `next` of the incoming FIFO, once the engine has handed it back;
    /// with `len`, notes that the slot will hold that many bytes.
    fn incoming_slot(&self, next: u64, len: Option<usize>) -> Option<*mut u8> {
        let mut inc = lock(&self.incoming);
        let ahead = (next - inc.committed) as u32;
        let p = inc.fifo.try_reserve_ahead(ahead)?;
        if let Some(len) = len {
            let n = inc.lens.len() as u64;
            inc.lens[(next % n) as usize] = len;
        }
        Some(p)
    }

    /// After thread `t` read frames: publishes the slots every thread has filled, and
    /// once all of the thread's sockets delivered `CLOSE`, records the peer's close
    /// (the link is closed when every thread's sockets are).
    fn after_reading(&self, t: usize, cur: &mut RecvCursor, rank_bell: &Bell) -> io::Result<()> {
        self.received[t].store(cur.received(), Ordering::Release);
        self.commit_received(rank_bell);
        let Some(cause) = cur.closed()? else {
            return Ok(());
        };
        if cur.reported {
            return Ok(());
        }
        cur.reported = true;
        self.peer_cause.store(cause, Ordering::SeqCst);
        if self.closed_threads.fetch_add(1, Ordering::SeqCst) + 1 == self.striping.threads {
            self.set_state(LinkState::Closed(match cause {
                0 => Closed::ByOwner,
                r => Closed::PeerFailed(r as usize - 1),
            }));
            rank_bell.ring_always();
        }
        Ok(())
    }

    /// Publishes every slot all receive proxies have filled.
    fn commit_received(&self, rank_bell: &Bell) {
        let mut inc = lock(&self.incoming);
        let done = self
            .received
            .iter()
            .map(|c| c.load(Ordering::Acquire))
            .min();
        let mut moved = false;
        while done.is_some_and(|d| d > inc.committed) {
            let len = inc.lens[(inc.committed % inc.lens.len() as u64) as usize];
            inc.fifo.commit(len);
            inc.committed += 1;
            moved = true;
        }
        drop(inc);
        if moved {
            rank_bell.ring();
        }
    }
}

/// One link to a peer on one channel: its sockets and proxies.
pub struct TcpLink {
    shared: Arc<Shared>,
    streams: Vec<TcpStream>,
    /// The rank's bell, rung when slots are handed back.
    rank_bell: Arc<Bell>,
    senders: Vec<JoinHandle<()>>,
    receivers: Vec<JoinHandle<()>>,
}

fn private_bell(tag: &str) -> Result<Bell> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = format!(
        "ferroccl-proxy-{}-{tag}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let seg = Segment::create(SegmentKind::InProcess, &name, BELL_BYTES)?;
    Segment::unlink(SegmentKind::InProcess, &name);
    Ok(Bell::create(seg))
}

/// Two ends of one local FIFO (for the network transports' proxies).
pub(super) fn local_fifo(geometry: Geometry, tag: &str) -> Result<(SendEnd, RecvEnd)> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = format!(
        "ferroccl-tcpfifo-{}-{tag}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let bytes = geometry.segment_bytes();
    let rx = fifo::recv_end(
        Segment::create(SegmentKind::InProcess, &name, bytes)?,
        geometry,
    )?;
    let tx = fifo::send_end(
        Segment::open(SegmentKind::InProcess, &name, bytes)?,
        geometry,
        &name,
    )?;
    Segment::unlink(SegmentKind::InProcess, &name);
    Ok((tx, rx))
}

impl Shared {
    /// The state of a new link of `striping` carrying FIFOs of `geometry`, whose proxies
    /// read the engine's slots from `outgoing` and write the peer's into `incoming`.
    fn new(
        striping: Striping,
        geometry: Geometry,
        outgoing: RecvEnd,
        incoming: SendEnd,
        tag: &str,
    ) -> Result<Self> {
        let threads = striping.threads;
        Ok(Shared {
            stop: AtomicBool::new(false),
            close_cause: AtomicU32::new(0),
            abrupt: AtomicBool::new(false),
            state: Mutex::new(LinkState::Up),
            send_bell: private_bell(tag)?,
            recv_bell: private_bell(tag)?,
            outgoing: Mutex::new(Outgoing {
                fifo: outgoing,
                released: 0,
            }),
            incoming: Mutex::new(Incoming {
                fifo: incoming,
                committed: 0,
                lens: vec![0; geometry.slots],
            }),
            sent: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            sending: (0..threads)
                .map(|_| {
                    Mutex::new(SendCursor {
                        socks: vec![StreamPos::default(); striping.sockets_per_thread],
                    })
                })
                .collect(),
            #[cfg(test)]
            split_frames: AtomicUsize::new(0),
            #[cfg(test)]
            gathers: AtomicUsize::new(0),
            #[cfg(test)]
            frames_read: Default::default(),
            received: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            receiving: (0..threads)
                .map(|_| {
                    Mutex::new(RecvCursor {
                        socks: (0..striping.sockets_per_thread)
                            .map(|_| RecvPos::default())
                            .collect(),
                        reported: false,
                    })
                })
                .collect(),
            engine_reads: AtomicBool::new(false),
            closed_threads: AtomicUsize::new(0),
            peer_cause: AtomicU32::new(0),
            striping,
            slot_bytes: geometry.slot_bytes,
        })
    }
}

impl TcpLink {
    /// Starts the proxies on connected sockets (`streams[i]` carries stripe `i`).
    /// Returns the link and the engine's ends: the FIFO it sends into and the FIFO it
    /// receives from. `rank_bell` is a second view of the rank's own bell (the proxies
    /// ring it).
    pub fn start(
        streams: Vec<TcpStream>,
        striping: Striping,
        geometry: Geometry,
        rank_bell: Arc<Bell>,
        tag: &str,
        link_timeout: Duration,
    ) -> Result<(Self, SendEnd, RecvEnd)> {
        striping.validate()?;
        if geometry.protocol != super::Protocol::Simple {
            return Err(Error::invalid(format!(
                "TCP links carry Simple FIFOs only, not {geometry:?}"
            )));
        }
        assert_eq!(streams.len(), striping.sockets(), "one stream per socket");
        for stream in &streams {
            stream
                .set_nodelay(true)
                .map_err(|e| Error::io("TCP_NODELAY", e))?;
            set_link_timeout(stream, link_timeout)?;
        }
        let (engine_tx, proxy_rx) = local_fifo(geometry, tag)?;
        let (proxy_tx, engine_rx) = local_fifo(geometry, tag)?;
        let threads = striping.threads;
        let shared = Arc::new(Shared::new(striping, geometry, proxy_rx, proxy_tx, tag)?);
        let clones = |range: std::ops::Range<usize>| -> Result<Vec<TcpStream>> {
            streams[range]
                .iter()
                .map(|s| s.try_clone().map_err(|e| Error::io("clone socket", e)))
                .collect()
        };
        let mut link = TcpLink {
            shared: shared.clone(),
            streams: Vec::new(),
            rank_bell: rank_bell.clone(),
            senders: Vec::new(),
            receivers: Vec::new(),
        };
        let per = striping.sockets_per_thread;
        for t in 0..threads {
            let (writers, readers) = (
                clones(t * per..(t + 1) * per)?,
                clones(t * per..(t + 1) * per)?,
            );
            let (sh, bell) = (shared.clone(), rank_bell.clone());
            link.senders.push(
                std::thread::Builder::new()
                    .name(format!("ferroccl-tx{t}-{tag}"))
                    .spawn(move || send_proxy(t, writers, &sh, &bell))
                    .map_err(|e| Error::io("start a TCP send proxy", e))?,
            );
            let (sh, bell) = (shared.clone(), rank_bell.clone());
            link.receivers.push(
                std::thread::Builder::new()
                    .name(format!("ferroccl-rx{t}-{tag}"))
                    .spawn(move || recv_proxy(t, readers, &sh, &bell))
                    .map_err(|e| Error::io("start a TCP receive proxy", e))?,
            );
        }
        link.streams = streams;
        Ok((link, engine_tx, engine_rx))
    }

    /// After the engine committed slots: on a link of one socket, sends in line what
    /// the socket takes at once; wakes the send proxies for anything left.
    pub fn ring_send(&self) {
        let sh = &self.shared;
        if sh.striping.sockets() == 1
            && !sh.stop.load(Ordering::SeqCst)
            && let Some(mut cur) = try_lock(&sh.sending[0])
        {
            loop {
                match send_gathered(
                    &self.streams[0],
                    sh,
                    0,
                    &mut cur.socks[0],
                    GATHER_FRAMES,
                    true,
                ) {
                    // Everything committed is on its way: no proxy needed.
                    Ok(0) => return,
                    Ok(_) => {
                        sh.sent[0].store(cur.sent(), Ordering::Release);
                        sh.release_sent(&self.rank_bell);
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                        ) =>
                    {
                        break;
                    }
                    Err(e) => {
                        // Report the socket's error here: the kernel hands it to one
                        // caller only, and the proxy would then see a bare EPIPE.
                        sh.set_state(LinkState::Broken(format!("sending failed: {e}")));
                        self.rank_bell.ring_always();
                        break;
                    }
                }
            }
            #[cfg(test)]
            if cur.socks[0].done > 0 {
                sh.split_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
        sh.send_bell.ring();
    }

    /// Wakes the receive proxies (the engine freed a slot), unless the engine reads the
    /// link itself: the proxy then needs no slot, and is woken when the engine stops.
    pub fn ring_recv(&self) {
        if !self.shared.engine_reads.load(Ordering::Relaxed) {
            self.shared.recv_bell.ring();
        }
    }

    /// The engine, about to look at the incoming FIFO: on a link of one socket, reads
    /// in line what has arrived into free slots and publishes them, and keeps the
    /// receive proxy off the socket until [`TcpLink::stop_reading`]. Arriving data then
    /// wakes no thread: on 2 cores that saves a wake-up and a preemption of the engine
    /// per burst of frames.
    pub fn read_in_line(&self) {
        let sh = &self.shared;
        if sh.striping.sockets() != 1 || sh.stop.load(Ordering::SeqCst) {
            return;
        }
        if !sh.engine_reads.load(Ordering::Relaxed) {
            sh.engine_reads.store(true, Ordering::SeqCst);
        }
        let Some(mut cur) = try_lock(&sh.receiving[0]) else {
            return;
        };
        #[cfg(test)]
        let before = cur.received();
        let result = pull(&self.streams[0], sh, 0, &mut cur.socks[0])
            .and_then(|_| sh.after_reading(0, &mut cur, &self.rank_bell));
        #[cfg(test)]
        sh.frames_read[0].fetch_add(cur.received() - before, Ordering::Relaxed);
        if let Err(e) = result {
            sh.set_state(broken(e));
            self.rank_bell.ring_always();
        }
    }

    /// The engine stops reading in line (it is about to sleep, or its call ended): the
    /// receive proxy takes the socket back.
    pub fn stop_reading(&self) {
        let sh = &self.shared;
        if sh.engine_reads.load(Ordering::Relaxed) {
            sh.engine_reads.store(false, Ordering::SeqCst);
            sh.recv_bell.ring();
        }
    }

    /// The link's state.
    pub fn state(&self) -> LinkState {
        lock(&self.shared.state).clone()
    }

    /// Closes this side: a normal close sends what was committed first; then a `CLOSE`
    /// frame with the cause goes out on every socket and the sockets are shut.
    pub fn close(&mut self, why: Closed) {
        let cause = match why {
            Closed::PeerFailed(r) => r as u32 + 1,
            _ => 0,
        };
        self.shared.close_cause.store(cause, Ordering::SeqCst);
        self.shared
            .abrupt
            .store(matches!(why, Closed::PeerFailed(_)), Ordering::SeqCst);
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.send_bell.ring_always();
        self.shared.recv_bell.ring_always();
        // After a failure, the call that saw it returns once the peer was told why (the
        // send proxies' CLOSE is out), briefly bounded: a process that exits right after
        // its failed call must not leave the peer to see a connection closed without a
        // goodbye, and blame this rank.
        if matches!(why, Closed::PeerFailed(_)) {
            let start = Instant::now();
            while !self.senders.iter().all(|t| t.is_finished())
                && start.elapsed() < ABRUPT_GOODBYE_LIMIT
            {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// How long closing a link after a failure waits for its CLOSE to be sent.
const ABRUPT_GOODBYE_LIMIT: Duration = Duration::from_millis(250);

impl Drop for TcpLink {
    fn drop(&mut self) {
        if !self.shared.stop.load(Ordering::SeqCst) {
            self.close(Closed::ByOwner);
        }
        // The send proxies send CLOSE and shut writing; wait for them (bounded by the
        // drain limit), then cut the sockets so the receive proxies end too.
        let start = Instant::now();
        while !self.senders.iter().all(|t| t.is_finished())
            && start.elapsed() < DRAIN_LIMIT + Duration::from_secs(1)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        for stream in &self.streams {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for t in self.senders.drain(..).chain(self.receivers.drain(..)) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// Makes a dead peer or link show up as a socket error within about `timeout`, even
/// when nothing is being sent: data unacknowledged that long fails the connection
/// (`TCP_USER_TIMEOUT`), and keep-alive probes check an idle one.
fn set_link_timeout(stream: &TcpStream, timeout: Duration) -> Result<()> {
    use std::os::fd::AsRawFd;
    let secs = timeout.as_secs().clamp(2, i32::MAX as u64 / 1000) as libc::c_int;
    let fd = stream.as_raw_fd();
    let options = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1, "SO_KEEPALIVE"),
        (
            libc::IPPROTO_TCP,
            libc::TCP_KEEPIDLE,
            secs / 2,
            "TCP_KEEPIDLE",
        ),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1, "TCP_KEEPINTVL"),
        (
            libc::IPPROTO_TCP,
            libc::TCP_KEEPCNT,
            secs / 2,
            "TCP_KEEPCNT",
        ),
        (
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            secs * 1000,
            "TCP_USER_TIMEOUT",
        ),
    ];
    for (level, name, value, what) in options {
        // SAFETY: setsockopt on a socket we own, with a pointer to a c_int that lives
        // for the call and its exact size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                &value as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(Error::io(format!("set {what}"), io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Where one socket's stream stands in the incoming FIFO.
#[derive(Default)]
struct RecvPos {
    /// The frame being read: a slot number of the incoming FIFO.
    next: u64,
    /// The frame's header, as far as it has arrived.
    header: [u8; 8],
    header_got: usize,
    /// Once the header is in: the slot's byte count, and bytes of this socket's stripe
    /// read.
    frame: Option<(usize, usize)>,
    /// The cause `CLOSE` carried, once it came.
    closed: Option<u32>,
}

/// How far one helper thread's sockets have read (held while reading them).
struct RecvCursor {
    socks: Vec<RecvPos>,
    /// Whether this thread's close was recorded.
    reported: bool,
}

impl RecvCursor {
    /// Frames every one of the thread's sockets has read in full.
    fn received(&self) -> u64 {
        self.socks.iter().map(|p| p.next).min().unwrap_or(0)
    }

    /// The peer's close cause once every socket delivered `CLOSE`; an error if they
    /// closed after different slots or with different causes.
    fn closed(&self) -> io::Result<Option<u32>> {
        let first = &self.socks[0];
        let Some(cause) = first.closed else {
            return Ok(None);
        };
        for p in &self.socks[1..] {
            match p.closed {
                None => return Ok(None),
                Some(c) if c == cause && p.next == first.next => {}
                Some(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "sockets of one link closed after different slots",
                    ));
                }
            }
        }
        Ok(Some(cause))
    }
}

mod proxy;
mod setup;

use proxy::*;
pub(super) use setup::connect_links;
pub use setup::{Accepted, JobKey, accept, connect};

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn stripes_cover_a_slot_once_in_order() {
        for n in 1..=9 {
            for len in [0, 1, 63, 64, 65, 1000, 4096, 131_072, 131_071] {
                let mut at = 0;
                for i in 0..n {
                    let r = stripe(len, i, n);
                    assert_eq!(r.start, at, "len {len} stripe {i} of {n}");
                    assert!(r.start.is_multiple_of(64) || r.is_empty());
                    at = r.end;
                }
                assert_eq!(at, len, "len {len}, {n} stripes");
            }
        }
    }

    /// Slot `i`'s bytes: its length varies, its content depends on `i`.
    fn slot_message(i: usize, slot_bytes: usize) -> Vec<u8> {
        let len = 1 + (i * 7919) % slot_bytes;
        (0..len).map(|k| (i * 31 + k * 7) as u8).collect()
    }

    /// `n` connected pairs of loopback sockets with tiny send buffers, so that writes
    /// stop part way through frames.
    fn socket_pairs(n: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut pairs = (Vec::new(), Vec::new());
        for _ in 0..n {
            let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (b, _) = listener.accept().unwrap();
            for s in [&a, &b] {
                use std::os::fd::AsRawFd;
                for (opt, v) in [(libc::SO_SNDBUF, 4096), (libc::SO_RCVBUF, 32768)] {
                    let v: libc::c_int = v;
                    // SAFETY: setsockopt on an open socket with a c_int of its exact size.
                    let rc = unsafe {
                        libc::setsockopt(
                            s.as_raw_fd(),
                            libc::SOL_SOCKET,
                            opt,
                            &v as *const libc::c_int as *const libc::c_void,
                            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                        )
                    };
                    assert_eq!(rc, 0);
                }
            }
            pairs.0.push(a);
            pairs.1.push(b);
        }
        pairs
    }

    /// Sends 300 slots of varied lengths over a link striped as `striping`, through a
    /// reader that pauses, and checks every byte. The reader reads the link in line as
    /// the engine does, and before each pause hands it back to its proxy, as an engine
    /// going to sleep does. Returns the sending and the receiving side's shared state,
    /// for the caller's assertions about how the frames went.
    fn deliver_through_a_slow_reader(striping: Striping) -> (Arc<Shared>, Arc<Shared>) {
        let (a, b) = socket_pairs(striping.sockets());
        let g = Geometry {
            slots: 4,
            slot_bytes: 64 << 10,
            protocol: super::super::Protocol::Simple,
        };
        let start = |s: Vec<TcpStream>, tag: &str| {
            let bell = Arc::new(private_bell(tag).unwrap());
            TcpLink::start(s, striping, g, bell, tag, Duration::from_secs(10)).unwrap()
        };
        let (link_a, mut tx, _rx_a) = start(a, "a");
        let (link_b, _tx_b, mut rx) = start(b, "b");
        let count = 300;
        let deadline = Instant::now() + Duration::from_secs(60);
        let writer = std::thread::spawn(move || {
            for i in 0..count {
                let m = slot_message(i, g.slot_bytes);
                let slot = loop {
                    if let Some(p) = tx.try_reserve(m.len()) {
                        break p;
                    }
                    assert_eq!(link_a.state(), LinkState::Up, "slot {i}");
                    assert!(Instant::now() < deadline, "writer stuck at slot {i}");
                    link_a.ring_send();
                    std::thread::sleep(Duration::from_micros(50));
                };
                // SAFETY: the reserved slot holds `slot_bytes` bytes until commit.
                unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), slot, m.len()) };
                tx.commit(m.len());
                link_a.ring_send();
            }
            link_a
        });
        for i in 0..count {
            let (p, len) = loop {
                link_b.read_in_line();
                if let Some(got) = rx.try_peek() {
                    break got;
                }
                assert_eq!(link_b.state(), LinkState::Up, "slot {i}");
                assert!(Instant::now() < deadline, "reader stuck at slot {i}");
                std::thread::sleep(Duration::from_micros(50));
            };
            // SAFETY: the slot holds `len` bytes until release.
            let got = unsafe { std::slice::from_raw_parts(p, len) };
            assert_eq!(got, slot_message(i, g.slot_bytes), "slot {i}");
            rx.release();
            link_b.ring_recv();
            if i % 16 == 0 {
                link_b.stop_reading();
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let link_a = writer.join().unwrap();
        assert_eq!(link_a.state(), LinkState::Up);
        assert_eq!(link_b.state(), LinkState::Up);
        let read = &link_b.shared.frames_read;
        assert_eq!(
            read[0].load(Ordering::Relaxed) + read[1].load(Ordering::Relaxed),
            (count * striping.threads) as u64,
            "frames read in line and by the proxies (each thread reads its stripes of all)"
        );
        (link_a.shared.clone(), link_b.shared.clone())
    }

    #[test]
    fn a_one_socket_link_delivers_frames_the_engine_and_its_proxy_share() {
        let (sent, received) = deliver_through_a_slow_reader(Striping::default());
        let split = sent.split_frames.load(Ordering::Relaxed);
        assert!(
            split > 0,
            "no frame was split between the engine and the proxy"
        );
        assert!(
            sent.gathers.load(Ordering::Relaxed) > 0,
            "no sendmsg carried more than one frame"
        );
        let [in_line, by_proxy] = &received.frames_read;
        assert!(
            in_line.load(Ordering::Relaxed) > 0 && by_proxy.load(Ordering::Relaxed) > 0,
            "frames read in line {in_line:?}, by the proxy {by_proxy:?}: both should read"
        );
    }

    #[test]
    fn a_striped_link_delivers_frames_each_socket_sends_at_its_own_pace() {
        let (sent, received) = deliver_through_a_slow_reader(Striping {
            threads: 2,
            sockets_per_thread: 2,
        });
        // Striped links are read by their proxies only.
        assert_eq!(received.frames_read[0].load(Ordering::Relaxed), 0);
        assert!(
            sent.gathers.load(Ordering::Relaxed) > 0,
            "no sendmsg carried more than one frame"
        );
    }

    /// The peer fills this side's FIFO, which nobody empties, then aborts: its CLOSE
    /// (which needs no slot) must still be heard, naming the rank that failed.
    fn abort_behind_a_full_fifo_is_heard(striping: Striping) {
        let (a, b) = socket_pairs(striping.sockets());
        let g = Geometry {
            slots: 4,
            slot_bytes: 4096,
            protocol: super::super::Protocol::Simple,
        };
        let start = |s: Vec<TcpStream>, tag: &str| {
            let bell = Arc::new(private_bell(tag).unwrap());
            TcpLink::start(s, striping, g, bell, tag, Duration::from_secs(10)).unwrap()
        };
        let (mut link_a, mut tx, _rx_a) = start(a, "a");
        let (link_b, _tx_b, mut rx) = start(b, "b");
        for i in 0..g.slots {
            let m = slot_message(i, g.slot_bytes);
            let slot = tx.try_reserve(m.len()).expect("a free slot");
            // SAFETY: the reserved slot holds `slot_bytes` bytes until commit.
            unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), slot, m.len()) };
            tx.commit(m.len());
            link_a.ring_send();
        }
        // Wait until B's FIFO is full, then abort A as a rank does when rank 3 failed.
        let deadline = Instant::now() + Duration::from_secs(20);
        while rx.try_peek_ahead(g.slots as u32 - 1).is_none() {
            assert!(Instant::now() < deadline, "the slots never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        link_a.close(Closed::PeerFailed(3));
        while link_b.state() == LinkState::Up {
            assert!(
                Instant::now() < deadline,
                "{striping:?}: the CLOSE behind a full FIFO was never read"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(link_b.state(), LinkState::Closed(Closed::PeerFailed(3)));
    }

    #[test]
    fn an_abort_behind_a_full_fifo_is_heard() {
        abort_behind_a_full_fifo_is_heard(Striping::default());
        abort_behind_a_full_fifo_is_heard(Striping {
            threads: 2,
            sockets_per_thread: 2,
        });
    }

    #[test]
    fn striping_limits_are_checked() {
        let bad = [(0, 1), (1, 0), (17, 1), (8, 9)];
        for (threads, sockets_per_thread) in bad {
            let s = Striping {
                threads,
                sockets_per_thread,
            };
            assert!(s.validate().is_err(), "{s:?}");
        }
        assert!(
            Striping {
                threads: 4,
                sockets_per_thread: 16
            }
            .validate()
            .is_ok()
        );
    }

    /// Strangers at a listening port (silent, garbage, another job's key) are dropped
    /// and do not count; the job's own connections are accepted, whatever arrives first.
    #[test]
    fn connections_without_the_jobs_key_are_dropped() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let job: JobKey = *b"job-key!";
        let striping = Striping::default();
        let deadline = Instant::now() + Duration::from_secs(20);
        // Strangers first, so the acceptor meets them before the peers.
        let silent = TcpStream::connect(addr).unwrap();
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[0xab; 64]).unwrap();
        let other_job = connect(addr, *b"otherjob", 1, 0, 0, striping, deadline).unwrap();
        let peers = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            [1usize, 2].map(|rank| connect(addr, job, rank, 0, 0, striping, deadline).unwrap())
        });
        let got = accept(&listener, job, 2, deadline, 3, 1, striping).unwrap();
        let mut ranks: Vec<usize> = got.iter().map(|a| a.peer).collect();
        ranks.sort();
        assert_eq!(ranks, [1, 2]);
        drop((silent, garbage, other_job, peers.join().unwrap()));
    }
}
