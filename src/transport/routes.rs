//! The first phase of connecting a rank: deciding how it reaches each peer.
//!
//! Every rank says, in one all-gather, whether it has a usable RDMA device (and its
//! speed) and where it listens for TCP; rank 0's random nonce names the communicator's
//! shared-memory segments and keys its TCP connections. From that every rank computes
//! the same [`Path`] for every pair of ranks: in process, shared memory, TCP or RDMA.

use std::net::{SocketAddr, TcpListener};

use super::fifo::Geometry;
use super::segment::SegmentKind;
use super::{NetChoice, NetDevice, Protocol, TransportChoice, TransportConfig, tcp};
use crate::bootstrap::{Bootstrap, netif};
use crate::error::{Error, Result};

/// How two ranks are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    InProcess,
    Shm,
    Tcp,
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Rdma,
}

impl Path {
    /// Whether the pair talks over the network (a link with proxies), not through
    /// memory both ranks map.
    pub(super) fn is_network(self) -> bool {
        matches!(self, Path::Tcp | Path::Rdma)
    }

    /// The kind of segment a FIFO over this path lives in.
    pub(super) fn segment_kind(self) -> SegmentKind {
        match self {
            Path::Shm => SegmentKind::Shm,
            _ => SegmentKind::InProcess,
        }
    }
}

/// How this rank reaches every peer, as every rank agrees on it.
pub(super) struct Routes {
    pub(super) rank: usize,
    pub(super) nranks: usize,
    /// Ring channels (the point-to-point channel is index `channels`).
    pub(super) channels: usize,
    /// Each rank's host label.
    pub(super) hosts: Vec<usize>,
    /// Which ranks have a usable RDMA device.
    pub(super) rdma_ranks: Vec<bool>,
    /// Link speed (Gb/s) of the slowest RDMA device, when every pair of ranks on
    /// different hosts talks over RDMA (the cost model's network then).
    pub(super) rdma_link_gbps: Option<f64>,
    /// The communicator's name space for segments.
    pub(super) prefix: String,
    /// What the communicator's TCP connections present (strangers cannot).
    pub(super) job_key: tcp::JobKey,
    /// Each rank's TCP listening address, if it published one.
    tcp_addrs: Vec<Option<SocketAddr>>,
    choice: TransportChoice,
    pids: Vec<u32>,
}

impl Routes {
    /// Agrees on the routes (collective): publishes this rank's RDMA device `net` and its
    /// TCP `listener`, gathers everyone's, and checks that `NCCL_NET=IB` is met.
    pub(super) fn agree(
        boot: &Bootstrap,
        config: &TransportConfig,
        net: &NetDevice,
        listener: Option<&TcpListener>,
    ) -> Result<Self> {
        let (rank, nranks) = (boot.rank(), boot.world_size());
        let hosts = config.choice.host_labels(boot.peers());
        let mut hello = rand::random::<[u8; 8]>().to_vec();
        hello.push(u8::from(net.usable()));
        hello.extend_from_slice(&net.gbps.to_le_bytes());
        if let Some(l) = listener {
            let addr = l
                .local_addr()
                .map_err(|e| Error::io("listener address", e))?;
            hello.extend_from_slice(addr.to_string().as_bytes());
        }
        let all = boot.all_gather(&hello)?;
        let nonce: [u8; 8] = all[0]
            .get(..8)
            .and_then(|n| n.try_into().ok())
            .ok_or_else(|| Error::BootstrapData {
                rank: 0,
                detail: "segment name nonce is not 8 bytes".into(),
            })?;
        let rdma_ranks: Vec<bool> = all.iter().map(|b| b.get(8) == Some(&1)).collect();
        let speed = |b: &[u8]| {
            b.get(9..17)
                .and_then(|s| s.try_into().ok())
                .map_or(0.0, f64::from_le_bytes)
        };
        let slowest_rdma = all
            .iter()
            .zip(&rdma_ranks)
            .filter(|(_, has)| **has)
            .map(|(b, _)| speed(b))
            .fold(f64::INFINITY, f64::min);
        let tcp_addrs = all
            .iter()
            .map(|b| {
                std::str::from_utf8(b.get(17..).unwrap_or_default())
                    .ok()
                    .and_then(|t| t.parse().ok())
            })
            .collect();
        net.check_everyone_has_it(config.net, &rdma_ranks, &hosts, rank)?;
        let mut routes = Routes {
            rank,
            nranks,
            channels: config.rings.len(),
            hosts,
            rdma_ranks,
            rdma_link_gbps: None,
            prefix: format!(
                "{}{:016x}",
                super::segment::job_shm_prefix(boot.peers()[0].pid),
                u64::from_le_bytes(nonce)
            ),
            job_key: nonce,
            tcp_addrs,
            choice: config.choice,
            pids: boot.peers().iter().map(|p| p.pid).collect(),
        };
        routes.rdma_link_gbps = (routes.all_cross_host_pairs_use_rdma()
            && slowest_rdma.is_finite()
            && slowest_rdma > 0.0)
            .then_some(slowest_rdma);
        Ok(routes)
    }

    /// Whether there are pairs of ranks on different hosts and every one talks over RDMA
    /// (every rank computes the same).
    fn all_cross_host_pairs_use_rdma(&self) -> bool {
        let mut cross = (0..self.nranks)
            .flat_map(|a| (0..self.nranks).map(move |b| (a, b)))
            .filter(|&(a, b)| self.hosts[a] != self.hosts[b])
            .peekable();
        cross.peek().is_some() && cross.all(|(a, b)| self.path(a, b) == Path::Rdma)
    }

    /// How rank `a` reaches rank `b`.
    pub(super) fn path(&self, a: usize, b: usize) -> Path {
        if a == b {
            Path::InProcess
        } else if self.hosts[a] != self.hosts[b] {
            if self.rdma_ranks[a] && self.rdma_ranks[b] {
                Path::Rdma
            } else {
                Path::Tcp
            }
        } else if self.choice == TransportChoice::Shm || self.pids[a] != self.pids[b] {
            Path::Shm
        } else {
            Path::InProcess
        }
    }

    /// How this rank reaches `peer`.
    pub(super) fn to(&self, peer: usize) -> Path {
        self.path(self.rank, peer)
    }

    /// Whether `peer` is another rank this one shares memory with (FIFOs and bells).
    pub(super) fn is_local_peer(&self, peer: usize) -> bool {
        peer != self.rank && !self.to(peer).is_network()
    }

    /// The peers this rank reaches over `path`.
    pub(super) fn via(&self, path: Path) -> Vec<usize> {
        (0..self.nranks)
            .filter(|&r| r != self.rank && self.to(r) == path)
            .collect()
    }

    /// The kind of segment of `owner`'s bell: shared memory if any rank reaches it so.
    pub(super) fn bell_kind(&self, owner: usize) -> SegmentKind {
        if (0..self.nranks).any(|r| self.path(owner, r) == Path::Shm) {
            SegmentKind::Shm
        } else {
            SegmentKind::InProcess
        }
    }

    /// The name of `owner`'s bell segment.
    pub(super) fn bell_name(&self, owner: usize) -> String {
        format!("{}-b{owner}", self.prefix)
    }

    /// The name of the segment of the FIFO of format `g` on channel index `ci` from rank
    /// `from` to rank `to`.
    pub(super) fn fifo_name(&self, g: Geometry, ci: usize, from: usize, to: usize) -> String {
        fifo_segment_name(&self.prefix, g, ci, self.channels, from, to)
    }

    /// The peers this rank links to over the network (both ways) on channel index `ci`:
    /// every one, made at establishment (rings use two neighbours, trees parents and
    /// children, direct algorithms everyone; point-to-point calls any rank).
    pub(super) fn neighbours(&self, ci: usize) -> Vec<usize> {
        if ci == self.channels {
            (0..self.nranks).collect()
        } else {
            (0..self.nranks).filter(|&r| r != self.rank).collect()
        }
    }

    /// Where rank `r` listens for TCP connections.
    pub(super) fn tcp_addr(&self, r: usize) -> Result<SocketAddr> {
        self.tcp_addrs[r].ok_or_else(|| Error::BootstrapData {
            rank: r,
            detail: "no TCP address published".into(),
        })
    }
}

/// The name of the segment of the FIFO of format `g` on channel index `ci` (of
/// `channels`; the last is point-to-point) from rank `from` to rank `to`.
pub(super) fn fifo_segment_name(
    prefix: &str,
    g: Geometry,
    ci: usize,
    channels: usize,
    from: usize,
    to: usize,
) -> String {
    let ll = if g.protocol == Protocol::LL { "l" } else { "" };
    let chan = if ci == channels {
        "p".to_string()
    } else {
        ci.to_string()
    };
    format!("{prefix}-f{chan}{ll}-{from}-{to}")
}

/// Whether `rank` wants an RDMA device: it has a peer on another host and the settings
/// allow RDMA. RDMA is tried by ranks with a peer on another host, unless TCP is asked
/// for.
pub(super) fn wants_rdma(config: &TransportConfig, hosts: &[usize], rank: usize) -> bool {
    config.choice != TransportChoice::Tcp
        && config.net != NetChoice::Socket
        && hosts.iter().any(|&h| h != hosts[rank])
}

/// A TCP listener for this rank's peers on other hosts (opened whenever there is one:
/// which of them RDMA reaches is known only once every rank has said).
pub(super) fn listen_for_other_hosts(
    boot: &Bootstrap,
    hosts: &[usize],
) -> Result<Option<TcpListener>> {
    let rank = boot.rank();
    if hosts.iter().all(|&h| h == hosts[rank]) {
        return Ok(None);
    }
    let ip = netif::listen_addr(boot.store_addr())?;
    TcpListener::bind(SocketAddr::new(ip, 0))
        .map(Some)
        .map_err(|e| Error::io(format!("listen for peers on {ip}"), e))
}
