//! A link's proxy threads: the send proxies write the engine's slots to the sockets,
//! each its stripe of every slot, gathered into few system calls; the receive proxies
//! read frames from the sockets into the incoming FIFO.

use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::*;
use crate::lock;

/// Most frames one `sendmsg` carries: gathering the frames committed meanwhile into one
/// system call (rather than one per slot) is what lets a socket keep up with the engine
/// (2 ranks, 64 MiB all-reduce over loopback: see the README).
pub(super) const GATHER_FRAMES: usize = 16;

/// Writes, with one `sendmsg` (no `SIGPIPE` on a closed peer), what socket `index` of
/// the link has to send from `pos` on: the rest of frame `pos.next`, then the frames
/// committed after it, at most `max_frames` (and [`GATHER_FRAMES`]) in all, each a
/// header and the socket's stripe of the slot. With `dontwait` it returns at once (`WouldBlock`) when the socket
/// takes nothing. Returns the bytes written, 0 when nothing is committed, and moves
/// `pos` past them. The caller holds the cursor `pos` belongs to.
pub(super) fn send_gathered(
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
pub(super) fn message(iov: &mut [libc::iovec]) -> libc::msghdr {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    msg
}

/// Waits up to `timeout` until one of `fds` is ready for the events it asks for.
pub(super) fn wait_ready(fds: &mut [libc::pollfd], timeout: Duration) {
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
pub(super) fn try_lock<T>(m: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

pub(super) fn frame(kind: u32, value: u32) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[4..].copy_from_slice(&value.to_le_bytes());
    h
}

/// Engine → sockets: helper thread `t` sends its stripes of every slot (continuing
/// what the engine started in line, on a link of one socket). It never waits inside a
/// socket: each socket takes what it can, and the thread waits for any of them to have
/// room, so one slow socket does not hold back the others.
pub(super) fn send_proxy(t: usize, mut socks: Vec<TcpStream>, shared: &Shared, rank_bell: &Bell) {
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

/// Why [`pull`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pulled {
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
pub(super) fn pull(
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
pub(super) fn received(n: isize) -> io::Result<Option<usize>> {
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
pub(super) fn broken(e: io::Error) -> LinkState {
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
pub(super) fn recv_proxy(t: usize, socks: Vec<TcpStream>, shared: &Shared, rank_bell: &Bell) {
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
