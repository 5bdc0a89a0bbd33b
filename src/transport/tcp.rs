//! The TCP transport: a FIFO on each side and two proxy threads that move slots across
//! one socket, so the engine sees the same FIFOs as over shared memory.
//!
//! For each (channel, peer) pair that crosses hosts (or when `FERROCCL_TRANSPORT=tcp`)
//! there is one TCP connection, used in both directions. On each side:
//! - the *send proxy* takes the slots the engine committed to the local outgoing FIFO,
//!   writes each as a frame (`kind: u32`, `value: u32`, then `value` bytes), and hands the
//!   slot back;
//! - the *receive proxy* reads frames into slots of the local incoming FIFO and commits
//!   them.
//!
//! Each proxy sleeps on a bell of its own that the engine rings after committing or
//! releasing a slot on that connection, and rings the rank's bell after it moved one.
//! A communicator that closes sends a `CLOSE` frame with its cause before shutting the
//! socket (after sending what it had committed, when it closes normally), so the peer
//! learns which rank failed first; end-of-file or a reset without one means the peer's
//! process or link is gone.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::bell::{BELL_BYTES, Bell, Closed};
use super::fifo::{self, Geometry, RecvEnd, SendEnd};
use super::segment::{Segment, SegmentKind};
use crate::error::{Error, Result};

const FRAME_DATA: u32 = 0;
const FRAME_CLOSE: u32 = 1;
/// How long a closing send proxy keeps sending what the engine committed.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

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
}

impl Shared {
    fn set_state(&self, s: LinkState) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if *st == LinkState::Up {
            *st = s;
        }
    }
}

/// One TCP connection to a peer on one channel, with its proxies.
pub struct TcpLink {
    shared: Arc<Shared>,
    stream: TcpStream,
    threads: Vec<JoinHandle<()>>,
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

/// Two ends of one local FIFO.
fn local_fifo(geometry: Geometry, tag: &str) -> Result<(SendEnd, RecvEnd)> {
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

impl TcpLink {
    /// Starts the proxies on a connected socket. Returns the link and the engine's ends:
    /// the FIFO it sends into and the FIFO it receives from. `rank_bell` is a second
    /// view of the rank's own bell (the proxies ring it).
    pub fn start(
        stream: TcpStream,
        geometry: Geometry,
        rank_bell: Arc<Bell>,
        tag: &str,
        link_timeout: Duration,
    ) -> Result<(Self, SendEnd, RecvEnd)> {
        stream
            .set_nodelay(true)
            .map_err(|e| Error::io("TCP_NODELAY", e))?;
        set_link_timeout(&stream, link_timeout)?;
        let (engine_tx, proxy_rx) = local_fifo(geometry, tag)?;
        let (proxy_tx, engine_rx) = local_fifo(geometry, tag)?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            close_cause: AtomicU32::new(0),
            abrupt: AtomicBool::new(false),
            state: Mutex::new(LinkState::Up),
            send_bell: private_bell(tag)?,
            recv_bell: private_bell(tag)?,
        });
        let writer = stream
            .try_clone()
            .map_err(|e| Error::io("clone socket", e))?;
        let reader = stream
            .try_clone()
            .map_err(|e| Error::io("clone socket", e))?;
        let mut threads = Vec::new();
        {
            let (shared, bell) = (shared.clone(), rank_bell.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ferroccl-tx-{tag}"))
                    .spawn(move || send_proxy(writer, proxy_rx, &shared, &bell))
                    .map_err(|e| Error::io("start a TCP send proxy", e))?,
            );
        }
        {
            let (shared, bell) = (shared.clone(), rank_bell);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ferroccl-rx-{tag}"))
                    .spawn(move || recv_proxy(reader, proxy_tx, &shared, &bell))
                    .map_err(|e| Error::io("start a TCP receive proxy", e))?,
            );
        }
        Ok((
            TcpLink {
                shared,
                stream,
                threads,
            },
            engine_tx,
            engine_rx,
        ))
    }

    /// Wakes the send proxy (the engine committed a slot).
    pub fn ring_send(&self) {
        self.shared.send_bell.ring();
    }

    /// Wakes the receive proxy (the engine freed a slot).
    pub fn ring_recv(&self) {
        self.shared.recv_bell.ring();
    }

    /// The link's state.
    pub fn state(&self) -> LinkState {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Closes this side: a normal close sends what was committed first; then a `CLOSE`
    /// frame with the cause goes out and the socket is shut.
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
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        if !self.shared.stop.load(Ordering::SeqCst) {
            self.close(Closed::ByOwner);
        }
        // The send proxy sends CLOSE and shuts writing; wait for it (bounded by the
        // drain limit), then cut the socket so the receive proxy ends too.
        if let Some(tx) = self.threads.first() {
            let start = Instant::now();
            while !tx.is_finished() && start.elapsed() < DRAIN_LIMIT + Duration::from_secs(1) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        for t in self.threads.drain(..) {
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

/// Writes a frame header and its data with one system call where the socket takes it
/// all (a vectored write).
fn write_frame(sock: &mut TcpStream, header: &[u8; 8], data: &[u8]) -> io::Result<()> {
    let mut parts = [io::IoSlice::new(header), io::IoSlice::new(data)];
    let mut parts: &mut [io::IoSlice<'_>] = &mut parts;
    while !parts.is_empty() {
        match sock.write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn frame(kind: u32, value: u32) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[4..].copy_from_slice(&value.to_le_bytes());
    h
}

/// Engine → socket.
fn send_proxy(mut sock: TcpStream, mut fifo: RecvEnd, shared: &Shared, rank_bell: &Bell) {
    let mut drain_deadline: Option<Instant> = None;
    let outcome: io::Result<()> = (|| {
        loop {
            if let Some((slot, len)) = fifo.try_peek() {
                if shared.abrupt.load(Ordering::SeqCst) {
                    break;
                }
                // SAFETY: the peeked slot holds `len` published bytes and stays ours
                // until release.
                let data = unsafe { std::slice::from_raw_parts(slot, len) };
                write_frame(&mut sock, &frame(FRAME_DATA, len as u32), data)?;
                fifo.release();
                rank_bell.ring();
                continue;
            }
            if shared.stop.load(Ordering::SeqCst) {
                // Closing: the FIFO is empty now (or the close is abrupt).
                let deadline = *drain_deadline.get_or_insert_with(|| Instant::now() + DRAIN_LIMIT);
                if fifo.try_peek().is_none() || Instant::now() >= deadline {
                    break;
                }
                continue;
            }
            let seq = shared.send_bell.prepare_sleep();
            if fifo.try_peek().is_some() || shared.stop.load(Ordering::SeqCst) {
                shared.send_bell.cancel_sleep();
                continue;
            }
            shared.send_bell.sleep(seq, Duration::from_millis(100));
        }
        let cause = shared.close_cause.load(Ordering::SeqCst);
        sock.write_all(&frame(FRAME_CLOSE, cause))?;
        sock.flush()?;
        let _ = sock.shutdown(Shutdown::Write);
        Ok(())
    })();
    if let Err(e) = outcome
        && !shared.stop.load(Ordering::SeqCst)
    {
        shared.set_state(LinkState::Broken(format!("sending failed: {e}")));
        rank_bell.ring_always();
    }
}

/// Socket → engine.
fn recv_proxy(mut sock: TcpStream, mut fifo: SendEnd, shared: &Shared, rank_bell: &Bell) {
    let slot_bytes = fifo.slot_bytes();
    let outcome: io::Result<LinkState> = (|| {
        loop {
            let mut h = [0u8; 8];
            sock.read_exact(&mut h)?;
            let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
            let value = u32::from_le_bytes(h[4..].try_into().expect("4 bytes"));
            match kind {
                FRAME_DATA if value as usize <= slot_bytes => {
                    let slot = loop {
                        if let Some(p) = fifo.try_reserve() {
                            break p;
                        }
                        if shared.stop.load(Ordering::SeqCst) {
                            return Ok(LinkState::Up);
                        }
                        let seq = shared.recv_bell.prepare_sleep();
                        if let Some(p) = fifo.try_reserve() {
                            shared.recv_bell.cancel_sleep();
                            break p;
                        }
                        shared.recv_bell.sleep(seq, Duration::from_millis(100));
                    };
                    // SAFETY: the reserved slot has `slot_bytes >= value` bytes and is ours
                    // until commit.
                    let buf = unsafe { std::slice::from_raw_parts_mut(slot, value as usize) };
                    sock.read_exact(buf)?;
                    fifo.commit(value as usize);
                    rank_bell.ring();
                }
                FRAME_CLOSE => {
                    return Ok(LinkState::Closed(match value {
                        0 => Closed::ByOwner,
                        r => Closed::PeerFailed(r as usize - 1),
                    }));
                }
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("bad frame (kind {kind}, value {value})"),
                    ));
                }
            }
        }
    })();
    if shared.stop.load(Ordering::SeqCst) {
        return;
    }
    let state = match outcome {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            LinkState::Broken("the connection was closed without a goodbye".into())
        }
        Err(e) => LinkState::Broken(format!("the connection failed: {e}")),
    };
    if state != LinkState::Up {
        shared.set_state(state);
        rank_bell.ring_always();
    }
}

/// Opens the connection for channel index `ci` to the rank listening at `addr`,
/// retrying until `deadline`, and introduces this rank.
pub fn connect(
    addr: std::net::SocketAddr,
    rank: usize,
    ci: usize,
    deadline: Instant,
) -> io::Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(mut s) => {
                s.write_all(&frame(rank as u32, ci as u32))?;
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

/// Accepts `expected` connections made by [`connect`]; returns `(channel index, peer
/// rank, socket)` for each.
pub fn accept(
    listener: &std::net::TcpListener,
    expected: usize,
    deadline: Instant,
    nranks: usize,
    channels: usize,
) -> io::Result<Vec<(usize, usize, TcpStream)>> {
    listener.set_nonblocking(true)?;
    let mut out = Vec::with_capacity(expected);
    while out.len() < expected {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(100)),
                ))?;
                let mut h = [0u8; 8];
                s.read_exact(&mut h)?;
                s.set_read_timeout(None)?;
                let peer = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
                let ci = u32::from_le_bytes(h[4..].try_into().expect("4 bytes")) as usize;
                if peer >= nranks || ci > channels {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{from} introduced itself as rank {peer}, channel {ci}"),
                    ));
                }
                out.push((ci, peer, s));
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
