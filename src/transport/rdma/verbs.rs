//! The verbs the RDMA transport needs, behind one narrow interface.
//!
//! [`Nic`] is an opened device port with one completion queue: register memory, create
//! and connect reliable-connected (RC) queue pairs, post RDMA writes (with or without
//! immediate data) and receives, poll and wait for completions, and read a queue pair's
//! state. [`Provider`] lists and opens devices. Two implementations exist:
//! [`super::ibv`] over libibverbs (loaded at run time) and [`super::sim`], an in-process
//! fabric with the same semantics for tests. The transport above is the same code for
//! both.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::gid::GidEntry;
use crate::store::wire::{Cursor, Writer};

/// A device port as listed by a [`Provider`].
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceInfo {
    /// Device name (`mlx5_0`, `rxe0`, …).
    pub name: String,
    /// Port number (from 1).
    pub port: u8,
    /// Link speed in Gb/s (active width × per-lane speed).
    pub gbps: f64,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: &'static str,
    /// The port's filled GID table entries, by index.
    pub gids: Vec<GidEntry>,
    /// Most entries a completion queue may have (the device's `max_cqe`).
    pub max_cqe: usize,
    /// Most outstanding work requests per queue (the device's `max_qp_wr`).
    pub max_qp_wr: usize,
}

impl DeviceInfo {
    /// Whether the link layer is Ethernet (RoCE), where packets are routed by GID.
    pub fn ethernet(&self) -> bool {
        self.link_layer == "Ethernet"
    }
}

impl fmt::Display for DeviceInfo {
    /// `mlx5_0:1 (InfiniBand, 200 Gb/s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{} ({}, {} Gb/s)",
            self.name, self.port, self.link_layer, self.gbps
        )
    }
}

/// Registered memory: what a local work request names (`lkey`) and what a peer writes
/// to (`addr`, `rkey`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

impl Region {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn covers(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.addr + self.len as u64)
    }
}

/// What a peer needs to connect to a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Port LID (InfiniBand).
    pub lid: u16,
    /// Port GID at the chosen index (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
    /// First packet sequence number.
    pub psn: u32,
    /// The port's active MTU (`ibv_mtu`: 1 = 256 B … 5 = 4096 B); a connection uses the
    /// smaller of both ends'.
    pub mtu: u32,
    /// Whether the port is RoCE (Ethernet) rather than InfiniBand: the two cannot connect.
    pub ethernet: bool,
}

impl Endpoint {
    /// Appends the wire form.
    pub fn encode(&self, w: &mut Writer) {
        w.u32(self.qpn)
            .u32(u32::from(self.lid))
            .bytes(&self.gid)
            .u32(self.psn)
            .u32(self.mtu)
            .u32(u32::from(self.ethernet));
    }

    /// Reads [`Endpoint::encode`]'s form.
    pub fn decode(c: &mut Cursor<'_>) -> Result<Self, String> {
        let e = |e| format!("{e:?}");
        let qpn = c.u32().map_err(e)?;
        let lid = u16::try_from(c.u32().map_err(e)?).map_err(|_| "LID above 16 bits")?;
        let gid: [u8; 16] = c
            .bytes(16, "GID")
            .map_err(e)?
            .try_into()
            .map_err(|_| "GID is not 16 bytes")?;
        let psn = c.u32().map_err(e)?;
        let mtu = c.u32().map_err(e)?;
        if !(1..=5).contains(&mtu) {
            return Err(format!("MTU code {mtu} is not 1 (256 B) to 5 (4096 B)"));
        }
        let ethernet = match c.u32().map_err(e)? {
            0 => false,
            1 => true,
            other => return Err(format!("link layer flag {other} is not 0 or 1")),
        };
        Ok(Endpoint {
            qpn,
            lid,
            gid,
            psn,
            mtu,
            ethernet,
        })
    }
}

/// Settings of a reliable-connected queue pair (NCCL's `NCCL_IB_*` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpOptions {
    /// Most outstanding send work requests.
    pub max_send: u32,
    /// Most outstanding receive work requests.
    pub max_recv: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (`NCCL_IB_TIMEOUT`).
    pub timeout: u8,
    /// Retries before a work request fails with retry-exceeded (`NCCL_IB_RETRY_CNT`).
    pub retry_cnt: u8,
    /// Traffic class of RoCE packets (`NCCL_IB_TC`).
    pub traffic_class: u8,
    /// InfiniBand service level (`NCCL_IB_SL`).
    pub service_level: u8,
}

impl QpOptions {
    /// How long a request to a silent peer is retried before it fails:
    /// 4.096 µs × 2^timeout per try, `retry_cnt + 1` tries.
    pub fn transport_timeout(&self) -> Duration {
        let one = Duration::from_nanos(4096) * (1u32 << self.timeout.min(31));
        one * (u32::from(self.retry_cnt) + 1)
    }
}

/// How a work request ended (`ibv_wc_status`, the ones the transport tells apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// Flushed: the queue pair went to the error state before it ran.
    Flushed,
    /// The local buffer is not registered memory (`IBV_WC_LOC_PROT_ERR`).
    LocalProtection,
    /// The peer refused the remote address or key (`IBV_WC_REM_ACCESS_ERR`).
    RemoteAccess,
    /// The peer did not answer within the transport timeout (`IBV_WC_RETRY_EXC_ERR`).
    RetryExceeded,
    /// The peer had no receive posted, too many times (`IBV_WC_RNR_RETRY_EXC_ERR`).
    RnrRetryExceeded,
    /// Another `ibv_wc_status` value.
    Other(u32),
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Success => write!(f, "success"),
            WcStatus::Flushed => write!(f, "work request flushed (queue pair in error state)"),
            WcStatus::LocalProtection => write!(f, "local protection error"),
            WcStatus::RemoteAccess => write!(f, "remote access error"),
            WcStatus::RetryExceeded => write!(f, "transport retry counter exceeded"),
            WcStatus::RnrRetryExceeded => write!(f, "RNR retry counter exceeded"),
            WcStatus::Other(s) => write!(f, "completion status {s}"),
        }
    }
}

/// Which queue a completion comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcKind {
    /// A write this side posted.
    Write,
    /// A receive consumed by the peer's write with immediate data.
    Recv,
}

/// One work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The id the work request was posted with.
    pub wr_id: u64,
    /// The local queue pair.
    pub qpn: u32,
    /// How it ended.
    pub status: WcStatus,
    /// Send or receive queue.
    pub kind: WcKind,
    /// Immediate data (receives of a write with immediate).
    pub imm: Option<u32>,
}

/// A queue pair's state (`ibv_qp_state`, the ones the transport tells apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created, not connected.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send: connected.
    ReadyToSend,
    /// Failed: every outstanding and later request completes flushed.
    Error,
    /// Destroyed or unknown.
    Gone,
}

/// A local buffer of a write: `len` bytes at `addr` in the region of `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    /// Start address.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// Where a write lands: `addr` in the peer's region of `rkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    /// Start address in the peer's memory.
    pub addr: u64,
    /// The peer region's remote key.
    pub rkey: u32,
}

/// An opened device port with one completion queue, shared by all its queue pairs.
pub trait Nic: Send + Sync {
    /// The device and port.
    fn device(&self) -> &DeviceInfo;

    /// The GID table entry its queue pairs use.
    fn gid(&self) -> GidEntry;

    /// Registers `len` bytes at `addr` for local use, and for peers' writes if
    /// `remote_write`.
    ///
    /// # Safety
    /// The memory must stay allocated until [`Nic::deregister`] (the device and peers
    /// may write it at any time until then).
    unsafe fn register(&self, addr: *mut u8, len: usize, remote_write: bool) -> io::Result<Region>;

    /// Ends a registration.
    fn deregister(&self, region: &Region) -> io::Result<()>;

    /// A new RC queue pair; its endpoint goes to the peer.
    fn create_qp(&self, options: &QpOptions) -> io::Result<Endpoint>;

    /// Connects queue pair `qpn` to the peer's `remote` (to ready-to-send).
    fn connect(&self, qpn: u32, remote: &Endpoint) -> io::Result<()>;

    /// Posts an RDMA write of `local` to `remote` on queue pair `qpn`, with immediate
    /// data `imm` (which consumes a receive on the peer and completes there) or without
    /// (which the peer's CPU never sees). Every write completes on this side.
    ///
    /// # Safety
    /// `local` must stay registered and unchanged until the write completes.
    unsafe fn post_write(
        &self,
        qpn: u32,
        wr_id: u64,
        local: Local,
        remote: Remote,
        imm: Option<u32>,
    ) -> io::Result<()>;

    /// Posts a receive (of no bytes: it only takes a write with immediate data).
    fn post_recv(&self, qpn: u32, wr_id: u64) -> io::Result<()>;

    /// Moves up to `max` completions into `out`.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<()>;

    /// Sleeps until a completion may be ready, [`Nic::interrupt`] is called, or
    /// `timeout` passes.
    fn wait(&self, timeout: Duration);

    /// Ends a [`Nic::wait`] now.
    fn interrupt(&self);

    /// Queue pair `qpn`'s state.
    fn qp_state(&self, qpn: u32) -> QpState;

    /// Destroys queue pair `qpn` (outstanding requests are dropped).
    fn destroy_qp(&self, qpn: u32);
}

/// A failed registration, with the usual cause named where the error is the one a
/// locked-memory limit gives (ENOMEM, EPERM): registered memory is pinned.
pub fn registration_error(e: io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(libc::ENOMEM | libc::EPERM) => io::Error::new(
            e.kind(),
            format!(
                "{e} (registered memory is pinned: is the locked-memory limit, `ulimit -l`, \
                 high enough?)"
            ),
        ),
        _ => e,
    }
}

/// Lists and opens devices.
pub trait Provider: Send + Sync + fmt::Debug {
    /// The device ports present, in the provider's order.
    fn devices(&self) -> io::Result<Vec<DeviceInfo>>;

    /// Opens `device` for rank `owner` (the owner only labels it, in logs and tests),
    /// with a completion queue of at least `cq_entries` entries (at most the device's
    /// `max_cqe`): enough for every work request its queue pairs can have outstanding, or
    /// the queue overruns (a fatal error of the device context). Its queue pairs use
    /// `gid`, an entry of the device's table.
    fn open(
        &self,
        device: &DeviceInfo,
        owner: usize,
        cq_entries: usize,
        gid: GidEntry,
    ) -> io::Result<Arc<dyn Nic>>;
}
