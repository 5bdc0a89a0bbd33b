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

use std::io::{self, Read, Write};
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
    Ok(Bell::new(seg))
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

/// Most frames one `sendmsg` carries: gathering the frames committed meanwhile into one
/// system call (rather than one per slot) is what lets a socket keep up with the engine
/// (2 ranks, 64 MiB all-reduce over loopback: see the README).
const GATHER_FRAMES: usize = 16;

/// Writes, with one `sendmsg` (no `SIGPIPE` on a closed peer), what socket `index` of
/// the link has to send from `pos` on: the rest of frame `pos.next`, then the frames
/// committed after it, at most `max_frames` (and [`GATHER_FRAMES`]) in all, each a
/// header and the socket's stripe of the slot. With `dontwait` it returns at once (`WouldBlock`) when the socket
/// takes nothing. Returns the bytes written, 0 when nothing is committed, and moves
/// `pos` past them. The caller holds the cursor `pos` belongs to.
fn send_gathered(
    sock: &TcpStream,
    shared: &Shared,
    index: usize,
    pos: &mut StreamPos,
    max_frames: usize,
    dontwait: bool,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let nsocks = shared.striping.sockets();
    let mut headers = [[0u8; 8]; GATHER_FRAMES];
    let mut stripes = [(std::ptr::null::<u8>(), 0usize); GATHER_FRAMES];
    let mut frames = 0;
    while frames < max_frames.min(GATHER_FRAMES) {
        let Some((slot, len)) = shared.peek(pos.next + frames as u64) else {
            break;
        };
        let range = stripe(len, index, nsocks);
        headers[frames] = frame(FRAME_DATA, len as u32);
        // SAFETY: the stripe lies inside the slot's `len` published bytes.
        stripes[frames] = (unsafe { slot.add(range.start) }, range.len());
        frames += 1;
    }
    if frames == 0 {
        return Ok(0);
    }
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut iov = [empty; 2 * GATHER_FRAMES];
    for j in 0..frames {
        // Only the first frame can be partly written.
        let skip = if j == 0 { pos.done } else { 0 };
        let (data, len) = stripes[j];
        let (h, d) = (skip.min(8), skip.saturating_sub(8));
        iov[2 * j] = libc::iovec {
            iov_base: headers[j][h..].as_mut_ptr() as *mut libc::c_void,
            iov_len: 8 - h,
        };
        iov[2 * j + 1] = libc::iovec {
            // SAFETY: `d <= len`: a frame's written bytes never pass its end.
            iov_base: unsafe { data.add(d) } as *mut libc::c_void,
            iov_len: len - d,
        };
    }
    let msg = message(&mut iov[..2 * frames]);
    let flags = libc::MSG_NOSIGNAL | if dontwait { libc::MSG_DONTWAIT } else { 0 };
    // SAFETY: the iovecs point at `headers`, which outlives the call, and at committed
    // slots that stay readable until released, which needs `pos` (the caller's) to pass
    // them; the kernel only reads them. The socket is open while `sock` is borrowed.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    #[cfg(test)]
    if n as usize > 8 + stripes[0].1 - pos.done {
        shared.gathers.fetch_add(1, Ordering::Relaxed);
    }
    let mut left = n as usize;
    for &(_, len) in &stripes[..frames] {
        let rest = 8 + len - pos.done;
        if left < rest {
            pos.done += left;
            break;
        }
        left -= rest;
        pos.next += 1;
        pos.done = 0;
    }
    Ok(n as usize)
}

/// A `sendmsg`/`recvmsg` header for the buffers `iov` points at (no address, no
/// control data); valid while `iov` is.
fn message(iov: &mut [libc::iovec]) -> libc::msghdr {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    msg
}

/// Waits up to `timeout` until one of `fds` is ready for the events it asks for.
fn wait_ready(fds: &mut [libc::pollfd], timeout: Duration) {
    // SAFETY: `fds` is a valid array of pollfd of the length given.
    unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            timeout.as_millis() as i32,
        )
    };
}

/// A mutex's guard if it is free now (poisoning ignored, as [`lock`] does).
fn try_lock<T>(m: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

fn frame(kind: u32, value: u32) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[4..].copy_from_slice(&value.to_le_bytes());
    h
}

/// Engine → sockets: helper thread `t` sends its stripes of every slot (continuing
/// what the engine started in line, on a link of one socket). It never waits inside a
/// socket: each socket takes what it can, and the thread waits for any of them to have
/// room, so one slow socket does not hold back the others.
fn send_proxy(t: usize, mut socks: Vec<TcpStream>, shared: &Shared, rank_bell: &Bell) {
    use std::os::fd::AsRawFd;
    let first = t * shared.striping.sockets_per_thread;
    let mut drain_deadline: Option<Instant> = None;
    let pending = || shared.peek(lock(&shared.sending[t]).sent()).is_some();
    let outcome: io::Result<()> = (|| {
        loop {
            let stopping = shared.stop.load(Ordering::SeqCst);
            if stopping {
                // Closing: send what is committed, unless the close is abrupt.
                let deadline = *drain_deadline.get_or_insert_with(|| Instant::now() + DRAIN_LIMIT);
                if shared.abrupt.load(Ordering::SeqCst) || Instant::now() >= deadline {
                    break;
                }
            }
            let mut cur = lock(&shared.sending[t]);
            let mut moved = false;
            let mut full = Vec::new();
            for (k, sock) in socks.iter().enumerate() {
                match send_gathered(
                    sock,
                    shared,
                    first + k,
                    &mut cur.socks[k],
                    GATHER_FRAMES,
                    true,
                ) {
                    Ok(0) => {}
                    Ok(_) => moved = true,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => full.push(libc::pollfd {
                        fd: sock.as_raw_fd(),
                        events: libc::POLLOUT,
                        revents: 0,
                    }),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            if moved {
                shared.sent[t].store(cur.sent(), Ordering::Release);
                drop(cur);
                shared.release_sent(rank_bell);
                continue;
            }
            drop(cur);
            if !full.is_empty() {
                wait_ready(&mut full, Duration::from_millis(100));
                continue;
            }
            if stopping && !pending() {
                break;
            }
            let seq = shared.send_bell.prepare_sleep();
            if pending() || shared.stop.load(Ordering::SeqCst) {
                shared.send_bell.cancel_sleep();
                continue;
            }
            shared.send_bell.sleep(seq, Duration::from_millis(100));
        }
        // CLOSE must follow the same slots on every socket (the receiver checks): bring
        // each socket to the frame boundary the furthest one reached. Those slots stay
        // committed until every socket has passed them.
        let mut cur = lock(&shared.sending[t]);
        let target = cur
            .socks
            .iter()
            .map(|p| p.next + u64::from(p.done > 0))
            .max()
            .unwrap_or(0);
        for (k, sock) in socks.iter().enumerate() {
            let pos = &mut cur.socks[k];
            while pos.next < target {
                let frames = (target - pos.next) as usize;
                match send_gathered(sock, shared, first + k, pos, frames, false) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        drop(cur);
        let cause = shared.close_cause.load(Ordering::SeqCst);
        for sock in &mut socks {
            sock.write_all(&frame(FRAME_CLOSE, cause))?;
            sock.flush()?;
            let _ = sock.shutdown(Shutdown::Write);
        }
        Ok(())
    })();
    if let Err(e) = outcome
        && !shared.stop.load(Ordering::SeqCst)
    {
        shared.set_state(LinkState::Broken(format!("sending failed: {e}")));
        rank_bell.ring_always();
    }
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

/// Why [`pull`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pulled {
    /// The socket has nothing more now.
    Drained,
    /// The next frame needs a slot the engine has not handed back yet.
    FifoFull,
    /// The peer sent `CLOSE`.
    Closed,
}

/// Reads, without waiting, what socket `index` of the link has brought: frames into
/// slots of the incoming FIFO (socket `index`'s stripe of each), each read also taking
/// what has arrived of the next header, until the socket is drained, the FIFO has no
/// free slot for the next frame, or `CLOSE` came. Returns whether anything was read,
/// and why it stopped. The caller holds the cursor `pos` belongs to.
fn pull(
    sock: &TcpStream,
    shared: &Shared,
    index: usize,
    pos: &mut RecvPos,
) -> io::Result<(bool, Pulled)> {
    use std::os::fd::AsRawFd;
    let nsocks = shared.striping.sockets();
    let mut moved = false;
    loop {
        if pos.closed.is_some() {
            return Ok((moved, Pulled::Closed));
        }
        let Some((len, got)) = pos.frame else {
            if pos.header_got == 8 {
                pos.header_got = 0;
                let h = &pos.header;
                let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
                let value = u32::from_le_bytes(h[4..].try_into().expect("4 bytes"));
                match kind {
                    FRAME_DATA if value as usize <= shared.slot_bytes => {
                        pos.frame = Some((value as usize, 0));
                    }
                    FRAME_CLOSE => pos.closed = Some(value),
                    _ => {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("bad frame (kind {kind}, value {value}) on socket {index}"),
                        ));
                    }
                }
                continue;
            }
            // Read the header even when no slot is free: it may be CLOSE, which needs
            // none (a peer that fills the FIFO and then aborts is still heard).
            let header = &mut pos.header[pos.header_got..];
            // SAFETY: reads into the unfilled part of the header, which outlives the
            // call; the socket is open while `sock` is borrowed.
            let n = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    header.as_mut_ptr() as *mut libc::c_void,
                    header.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            match received(n)? {
                Some(n) => {
                    pos.header_got += n;
                    moved = true;
                }
                None => return Ok((moved, Pulled::Drained)),
            }
            continue;
        };
        let Some(slot) = shared.incoming_slot(pos.next, Some(len)) else {
            return Ok((moved, Pulled::FifoFull));
        };
        let range = stripe(len, index, nsocks);
        if got == range.len() {
            pos.next += 1;
            pos.frame = None;
            moved = true;
            continue;
        }
        let header = &mut pos.header[pos.header_got..];
        let mut iov = [
            libc::iovec {
                // SAFETY: `range.start + got < range.end <= len <= slot_bytes`: inside
                // the slot, which stays this side's until committed.
                iov_base: unsafe { slot.add(range.start + got) } as *mut libc::c_void,
                iov_len: range.len() - got,
            },
            libc::iovec {
                iov_base: header.as_mut_ptr() as *mut libc::c_void,
                iov_len: header.len(),
            },
        ];
        let mut msg = message(&mut iov);
        // SAFETY: the iovecs point at the rest of this socket's stripe of a reserved
        // slot (no other socket writes that range) and at the header, both writable for
        // their lengths; the socket is open while `sock` is borrowed.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
        match received(n)? {
            Some(n) => {
                let data = n.min(range.len() - got);
                pos.frame = Some((len, got + data));
                pos.header_got += n - data;
                moved = true;
            }
            None => return Ok((moved, Pulled::Drained)),
        }
    }
}

/// A `recv` result: the bytes read, `None` when nothing was there to read, an error for
/// end-of-file (the peer is gone without a goodbye) or a failure.
fn received(n: isize) -> io::Result<Option<usize>> {
    match n {
        0 => Err(io::ErrorKind::UnexpectedEof.into()),
        n if n > 0 => Ok(Some(n as usize)),
        _ => {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e),
            }
        }
    }
}

/// The state of a link whose reading failed with `e`.
fn broken(e: io::Error) -> LinkState {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        LinkState::Broken("the connection was closed without a goodbye".into())
    } else {
        LinkState::Broken(format!("the connection failed: {e}"))
    }
}

/// Sockets → engine: helper thread `t` reads its stripes of every slot, unless the
/// engine reads the link in line. It never waits inside a socket: it `poll`s its
/// sockets for data, or sleeps on the link's bell while the FIFO is full or the engine
/// reads.
fn recv_proxy(t: usize, socks: Vec<TcpStream>, shared: &Shared, rank_bell: &Bell) {
    use std::os::fd::AsRawFd;
    let first = t * shared.striping.sockets_per_thread;
    let in_line = shared.striping.sockets() == 1;
    let outcome: io::Result<()> = (|| {
        loop {
            if shared.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            let wait_for_bell = if in_line && shared.engine_reads.load(Ordering::SeqCst) {
                true
            } else {
                let mut cur = lock(&shared.receiving[t]);
                #[cfg(test)]
                let before = cur.received();
                let (mut moved, mut full) = (false, false);
                let mut empty = Vec::new();
                for (k, sock) in socks.iter().enumerate() {
                    let (m, why) = pull(sock, shared, first + k, &mut cur.socks[k])?;
                    moved |= m;
                    match why {
                        Pulled::Drained => empty.push(libc::pollfd {
                            fd: sock.as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        }),
                        Pulled::FifoFull => full = true,
                        Pulled::Closed => {}
                    }
                }
                shared.after_reading(t, &mut cur, rank_bell)?;
                #[cfg(test)]
                shared.frames_read[1].fetch_add(cur.received() - before, Ordering::Relaxed);
                if cur.reported {
                    // Every socket of this thread delivered CLOSE.
                    return Ok(());
                }
                drop(cur);
                if moved {
                    continue;
                }
                if !empty.is_empty() {
                    // Wait for data. A socket that is ahead of the others waits for a
                    // slot as well, which comes only once the others' data has: look
                    // again soon.
                    let ms = if full { 1 } else { 100 };
                    wait_ready(&mut empty, Duration::from_millis(ms));
                    continue;
                }
                true
            };
            if wait_for_bell {
                // The engine reads, or has a slot to hand back: it rings when either
                // changes.
                let seq = shared.recv_bell.prepare_sleep();
                let changed = !(in_line && shared.engine_reads.load(Ordering::SeqCst))
                    && lock(&shared.receiving[t]).socks.iter().any(|p| {
                        p.closed.is_none() && shared.incoming_slot(p.next, None).is_some()
                    });
                if changed || shared.stop.load(Ordering::SeqCst) {
                    shared.recv_bell.cancel_sleep();
                    continue;
                }
                shared.recv_bell.sleep(seq, Duration::from_millis(100));
            }
        }
    })();
    if let Err(e) = outcome
        && !shared.stop.load(Ordering::SeqCst)
    {
        shared.set_state(broken(e));
        rank_bell.ring_always();
    }
}

/// How a connection introduces itself: the job's key, then rank, channel index, socket
/// index and sockets per link.
const INTRO_BYTES: usize = 8 + 16;

/// How long an accepted connection has to introduce itself: peers do it at once, so
/// only a stranger that says nothing waits this long.
const INTRO_TIMEOUT: Duration = Duration::from_secs(1);

/// The TCP phase of connecting a rank: one link per channel index and peer on another
/// host that RDMA does not reach, each over `striping.sockets()` sockets opened by the
/// lower rank and accepted on `listener` by the higher. The links' FIFO ends go into
/// `ends`; their proxies ring `own_bell`. Returns how many links were made.
pub(super) fn connect_links(
    routes: &super::routes::Routes,
    config: &super::TransportConfig,
    listener: Option<&std::net::TcpListener>,
    own_bell: &std::sync::Arc<Bell>,
    ends: &mut super::Ends,
) -> Result<usize> {
    let pairs: Vec<(usize, usize)> = (0..=routes.channels)
        .flat_map(|ci| routes.neighbours(ci).into_iter().map(move |p| (ci, p)))
        .filter(|&(_, peer)| routes.to(peer) == super::routes::Path::Tcp)
        .collect();
    let mut streams = open_sockets(routes, config, listener, &pairs)?;
    for &(ci, peer) in &pairs {
        let socks: Vec<TcpStream> = streams[ci][peer]
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        let chan = if ci == routes.channels {
            "p".to_string()
        } else {
            ci.to_string()
        };
        let tag = format!("r{}-c{chan}-p{peer}", routes.rank);
        let (link, tx, rx) = TcpLink::start(
            socks,
            config.striping,
            config.geometry,
            own_bell.clone(),
            &tag,
            config.link_timeout,
        )?;
        ends.sends[0][ci][peer] = Some(tx);
        ends.recvs[0][ci][peer] = Some(rx);
        ends.links[ci][peer] = Some(super::NetLink::Tcp(link));
    }
    Ok(pairs.len())
}

/// The sockets of the links `pairs` (channel index, peer), `[channel index][peer]
/// [socket]`: connected to higher ranks, accepted from lower ones, by the deadline.
fn open_sockets(
    routes: &super::routes::Routes,
    config: &super::TransportConfig,
    listener: Option<&std::net::TcpListener>,
    pairs: &[(usize, usize)],
) -> Result<Vec<Vec<Vec<Option<TcpStream>>>>> {
    let (rank, nranks, channels) = (routes.rank, routes.nranks, routes.channels);
    let deadline = Instant::now() + config.connect_timeout;
    let striping = config.striping;
    let nsocks = striping.sockets();
    let mut streams: Vec<Vec<Vec<Option<TcpStream>>>> = (0..=channels)
        .map(|_| {
            (0..nranks)
                .map(|_| (0..nsocks).map(|_| None).collect())
                .collect()
        })
        .collect();
    for &(ci, peer) in pairs.iter().filter(|(_, p)| *p > rank) {
        let addr = routes.tcp_addr(peer)?;
        for (sock, cell) in streams[ci][peer].iter_mut().enumerate() {
            let stream = connect(addr, routes.job_key, rank, ci, sock, striping, deadline)
                .map_err(|e| {
                    Error::io(
                        format!("connect to rank {peer} (channel {ci}, socket {sock})"),
                        e,
                    )
                })?;
            *cell = Some(stream);
        }
    }
    let expected = nsocks * pairs.iter().filter(|(_, p)| *p < rank).count();
    let Some(listener) = listener else {
        return Ok(streams);
    };
    for a in accept(
        listener,
        routes.job_key,
        expected,
        deadline,
        nranks,
        channels,
        striping,
    )
    .map_err(|e| Error::io(format!("rank {rank}: accept peer connections"), e))?
    {
        let cell = &mut streams[a.channel][a.peer][a.socket];
        if !pairs.contains(&(a.channel, a.peer)) || a.peer >= rank || cell.is_some() {
            return Err(Error::BootstrapData {
                rank: a.peer,
                detail: format!(
                    "unexpected TCP connection for channel {}, socket {}",
                    a.channel, a.socket
                ),
            });
        }
        *cell = Some(a.stream);
    }
    Ok(streams)
}

/// The key that identifies one communicator's connections (random, chosen by rank 0 and
/// shared through the bootstrap store): a connection that does not present it is not
/// one of the job's and is dropped.
pub type JobKey = [u8; 8];

/// Opens socket `sock` of the link for channel index `ci` to the rank listening at
/// `addr`, retrying until `deadline`, and introduces this rank with the job's key.
pub fn connect(
    addr: std::net::SocketAddr,
    job: JobKey,
    rank: usize,
    ci: usize,
    sock: usize,
    striping: Striping,
    deadline: Instant,
) -> io::Result<TcpStream> {
    let mut intro = [0u8; INTRO_BYTES];
    intro[..8].copy_from_slice(&job);
    for (i, v) in [rank, ci, sock, striping.sockets()].into_iter().enumerate() {
        intro[8 + 4 * i..8 + 4 * i + 4].copy_from_slice(&(v as u32).to_le_bytes());
    }
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(mut s) => {
                s.write_all(&intro)?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(io::Error::new(e.kind(), format!("{addr}: {e}")));
            }
            Err(_) => {
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// A connection accepted and introduced.
pub struct Accepted {
    /// Channel index.
    pub channel: usize,
    /// The peer's rank.
    pub peer: usize,
    /// Which socket of the link it is.
    pub socket: usize,
    /// The connection.
    pub stream: TcpStream,
}

/// Reads a new connection's introduction: `Ok(None)` for a stranger (no introduction in
/// time, the wrong key, or numbers that name no link), which is dropped.
fn introduction(
    mut s: TcpStream,
    job: JobKey,
    nranks: usize,
    channels: usize,
    striping: Striping,
    from: std::net::SocketAddr,
) -> io::Result<Option<Accepted>> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(INTRO_TIMEOUT))?;
    let mut intro = [0u8; INTRO_BYTES];
    if let Err(e) = s.read_exact(&mut intro) {
        tracing::info!("dropped a connection from {from}: no introduction ({e})");
        return Ok(None);
    }
    if intro[..8] != job {
        tracing::info!("dropped a connection from {from}: not this communicator's key");
        return Ok(None);
    }
    s.set_read_timeout(None)?;
    let field = |i: usize| {
        u32::from_le_bytes(intro[8 + 4 * i..8 + 4 * i + 4].try_into().expect("4 bytes")) as usize
    };
    let (peer, channel, socket, sockets) = (field(0), field(1), field(2), field(3));
    if sockets != striping.sockets() {
        // One of the job's ranks, set up differently: an error, not a stranger.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "rank {peer} ({from}) uses {sockets} sockets per link, this rank {} \
                 (FERROCCL_SOCKET_NTHREADS x FERROCCL_NSOCKS_PERTHREAD must agree on every \
                 rank)",
                striping.sockets()
            ),
        ));
    }
    if peer >= nranks || channel > channels || socket >= sockets {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{from} introduced itself as rank {peer}, channel {channel}, socket {socket}"),
        ));
    }
    Ok(Some(Accepted {
        channel,
        peer,
        socket,
        stream: s,
    }))
}

/// Accepts `expected` connections made by [`connect`] with the same key and striping;
/// connections without the key are dropped and do not count.
pub fn accept(
    listener: &std::net::TcpListener,
    job: JobKey,
    expected: usize,
    deadline: Instant,
    nranks: usize,
    channels: usize,
    striping: Striping,
) -> io::Result<Vec<Accepted>> {
    listener.set_nonblocking(true)?;
    let mut out = Vec::with_capacity(expected);
    while out.len() < expected {
        match listener.accept() {
            Ok((s, from)) => {
                if let Some(a) = introduction(s, job, nranks, channels, striping, from)? {
                    out.push(a);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("{} of {expected} peer connections arrived", out.len()),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
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
                    if let Some(p) = tx.try_reserve() {
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
            let slot = tx.try_reserve().expect("a free slot");
            let m = slot_message(i, g.slot_bytes);
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
