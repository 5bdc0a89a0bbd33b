//! Making a link's sockets: connecting to higher ranks and accepting lower ones, each
//! connection introducing itself with the job's key (strangers are dropped), and the TCP
//! phase of connecting a rank.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::*;
use crate::error::{Error, Result};

/// How a connection introduces itself: the job's key, then rank, channel index, socket
/// index and sockets per link.
pub(super) const INTRO_BYTES: usize = 8 + 16;

/// How long an accepted connection has to introduce itself: peers do it at once, so
/// only a stranger that says nothing waits this long.
pub(super) const INTRO_TIMEOUT: Duration = Duration::from_secs(1);

/// The TCP phase of connecting a rank: one link per channel index and peer on another
/// host that RDMA does not reach, each over `striping.sockets()` sockets opened by the
/// lower rank and accepted on `listener` by the higher. The links' FIFO ends go into
/// `ends`; their proxies ring `own_bell`. Returns how many links were made.
pub(in crate::transport) fn connect_links(
    routes: &crate::transport::routes::Routes,
    config: &crate::transport::TransportConfig,
    listener: Option<&std::net::TcpListener>,
    own_bell: &std::sync::Arc<Bell>,
    ends: &mut crate::transport::Ends,
) -> Result<usize> {
    let pairs: Vec<(usize, usize)> = (0..=routes.channels)
        .flat_map(|ci| routes.neighbours(ci).into_iter().map(move |p| (ci, p)))
        .filter(|&(_, peer)| routes.to(peer) == crate::transport::routes::Path::Tcp)
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
        ends.links[ci][peer] = Some(crate::transport::NetLink::Tcp(link));
    }
    Ok(pairs.len())
}

/// The sockets of the links `pairs` (channel index, peer), `[channel index][peer]
/// [socket]`: connected to higher ranks, accepted from lower ones, by the deadline.
pub(super) fn open_sockets(
    routes: &crate::transport::routes::Routes,
    config: &crate::transport::TransportConfig,
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
pub(super) fn introduction(
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
