//! FIFOs in device memory between the GPUs of one host, for the device executor.
//!
//! The same FIFO contract as the host transports (slots, `head` written by the sender,
//! `tail` by the receiver, per-slot byte counts for Simple, flags in line for LL; see
//! [`fifo`](super::fifo)), with the memory on the receiver's GPU: the receiver allocates
//! each FIFO it reads (`cuMemAlloc`, zeroed), exports it with CUDA IPC and publishes the
//! handle in the communicator's store; the sender maps it (`cuIpcOpenMemHandle`, peer
//! access enabled lazily when the GPUs differ) and its executor writes the slots straight
//! into the receiver's memory (P2P writes; reads stay local). Ranks of one process use
//! the receiver's pointer as it is (CUDA cannot open its own IPC handles), with peer
//! access enabled when their GPUs differ. Several ranks may share one GPU (each on a
//! stream of its own, not the legacy default stream: their kernels must run at once).
//!
//! Two GPUs of one host without P2P between them (many cloud VMs, some PCIe topologies)
//! cannot reach each other's memory: a FIFO between them is staged through page-locked
//! host memory instead, a shared-memory segment the receiver makes and both sides
//! register with the driver (portable, mapped for the device), which the executor reads
//! and writes as it would device memory, over PCIe. Said at INFO. As between the host
//! FIFOs, the segment's name goes once both sides have mapped it (the sender removes
//! it), so a process that dies later leaves nothing in `/dev/shm`; each staged FIFO of a
//! process has a name of its own, so communicators of one process never meet there.
//!
//! Connections are made on first use, for the FIFO ends a plan names, in three steps
//! none of which waits on a later one, so no two ranks wait on each other: every rank
//! says where each sending end is (process, GPU); then makes and publishes the FIFOs it
//! receives on, each where its sender can reach it; then maps those it sends on.
//!
//! Layout of one FIFO's allocation (bytes): `head` at 0, `tail` at 128, per-slot byte
//! counts from 256, slots from [`DATA_OFFSET`]. An LL sender keeps its `head` (its own
//! position, which an LL receiver never reads) in its own memory instead: no write of
//! its ever lands in the receiver's memory after the receiver has what it needs.

use std::collections::HashMap;
use std::time::Duration;

use crate::cuda::work::{FcclFifo, FifoEnd};
use crate::cuda::{DeviceBuffer, ImportedBuffer, RegisteredHost};
use crate::error::{Error, Result};
use crate::store::Store;
use crate::store::wire::{Cursor, ParseError, Writer};

use super::Protocol;
use super::fifo::Geometry;
use super::segment::{Segment, SegmentKind};

/// Where `head` lies in a FIFO's allocation.
pub const HEAD_OFFSET: u64 = 0;
/// Where `tail` lies (a GPU cache line, 128 bytes, away from `head`).
pub const TAIL_OFFSET: u64 = 128;
/// Where the per-slot byte counts start.
pub const SIZES_OFFSET: u64 = 256;
/// Where the slots start.
pub const DATA_OFFSET: u64 = 4096;
/// Most slots a device FIFO may have (their counts must fit before the data).
pub const MAX_SLOTS: usize = ((DATA_OFFSET - SIZES_OFFSET) / 4) as usize;

const EXPORT_MAGIC: &[u8; 8] = b"FCCLCIP4";
/// Bytes of a published FIFO: magic, process token, pid, device ordinal, staged flag,
/// staged segment's serial number, device address, IPC handle.
const EXPORT_BYTES: usize = 8 + 8 + 4 + 4 + 4 + 4 + 8 + 64;
/// Bytes of a sender's whereabouts: process token, host hash, device ordinal.
const SENDER_BYTES: usize = 8 + 8 + 4;

/// A random number drawn once per process: two ranks are in one process exactly when
/// their tokens are equal. (A pid alone is not: processes on two hosts, or in two pid
/// namespaces of one host, may share it.)
pub fn process_token() -> u64 {
    static TOKEN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| rand::random::<u64>() | 1)
}

/// A FIFO as its receiver publishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Export {
    /// The receiver's [`process_token`] (a sender in the same process uses `ptr`
    /// directly).
    pub process: u64,
    /// The receiver's process id (for messages).
    pub pid: u32,
    /// The receiver's GPU (a sender of the same process on another GPU enables peer
    /// access to it).
    pub device: u32,
    /// The FIFO is in page-locked host memory (the segment [`staged_name`] names), not
    /// on the receiver's GPU: the two GPUs have no P2P.
    pub staged: bool,
    /// For a staged FIFO, the number in its segment's name (see [`staged_name`]).
    pub serial: u32,
    /// The allocation's device address in the receiver's process.
    pub ptr: u64,
    /// Its CUDA IPC handle.
    pub handle: [u8; 64],
}

impl Export {
    /// The bytes stored for it.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.raw(EXPORT_MAGIC)
            .u64(self.process)
            .u32(self.pid)
            .u32(self.device)
            .u32(u32::from(self.staged))
            .u32(self.serial)
            .u64(self.ptr)
            .raw(&self.handle);
        w.into_vec()
    }

    /// Reads what [`encode`](Self::encode) wrote; `key` names it in errors.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Self> {
        if bytes.len() != EXPORT_BYTES || &bytes[..8] != EXPORT_MAGIC {
            return Err(Error::invalid(format!(
                "cuda_ipc: store key {key} does not hold a device FIFO ({} bytes; another \
                 program or version wrote it?)",
                bytes.len()
            )));
        }
        let read = |c: &mut Cursor<'_>| -> std::result::Result<Export, ParseError> {
            c.array::<8>()?;
            let (process, pid, device, staged) = (c.u64()?, c.u32()?, c.u32()?, c.u32()?);
            Ok(Export {
                process,
                pid,
                device,
                staged: staged != 0,
                serial: c.u32()?,
                ptr: c.u64()?,
                handle: c.array()?,
            })
        };
        Ok(read(&mut Cursor::new(bytes)).expect("the length was checked above"))
    }
}

/// The store key of the FIFO carrying `from` → `to` on `channel` with `protocol`.
pub fn key(channel: usize, from: usize, to: usize, protocol: Protocol) -> String {
    format!("cuda_ipc/{channel}/{from}-{to}/{}", protocol.name())
}

/// The store key where the sender of that FIFO says where it is.
pub fn sender_key(channel: usize, from: usize, to: usize, protocol: Protocol) -> String {
    format!("cuda_ipc/sender/{channel}/{from}-{to}/{}", protocol.name())
}

/// The shared-memory segment of the staged FIFO that `receiver` published: its process
/// id (for whoever lists `/dev/shm`), process token (unique on the host, where pids of
/// two namespaces may not be) and serial number, then what the FIFO carries.
pub fn staged_name(
    receiver: &Export,
    channel: usize,
    from: usize,
    to: usize,
    protocol: Protocol,
) -> String {
    format!(
        "{}{:016x}-{}-{channel}-{from}-{to}-{}",
        super::segment::staged_shm_prefix(receiver.pid),
        receiver.process,
        receiver.serial,
        protocol.name()
    )
}

/// A new serial number for a staged FIFO of this process.
fn next_staged_serial() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Where a FIFO's sender is: its process, host and GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sender {
    /// Its [`process_token`].
    pub process: u64,
    /// A hash of its host's identity ([`crate::bootstrap::host_id`]).
    pub host: u64,
    /// Its GPU.
    pub device: u32,
}

impl Sender {
    /// This process on `device`.
    pub fn here(device: usize) -> Self {
        // The host's identity reads files: once per process.
        static HOST: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let host =
            *HOST.get_or_init(|| crate::bootstrap::host_hash_of(&crate::bootstrap::host_id()));
        Sender {
            process: process_token(),
            host,
            device: device as u32,
        }
    }

    /// The bytes stored for it.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.process).u64(self.host).u32(self.device);
        w.into_vec()
    }

    /// Reads what [`encode`](Self::encode) wrote; `key` names it in errors.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Self> {
        if bytes.len() != SENDER_BYTES {
            return Err(Error::invalid(format!(
                "cuda_ipc: store key {key} does not hold a FIFO sender ({} bytes)",
                bytes.len()
            )));
        }
        let mut c = Cursor::new(bytes);
        let mut read = || -> std::result::Result<Sender, ParseError> {
            Ok(Sender {
                process: c.u64()?,
                host: c.u64()?,
                device: c.u32()?,
            })
        };
        Ok(read().expect("the length was checked above"))
    }

    /// Whether a FIFO to a receiver on `device` of this host must be staged through host
    /// memory: the GPUs differ and the driver says there is no P2P between them.
    pub fn needs_staging(&self, device: usize) -> Result<bool> {
        if self.host != Sender::here(device).host || self.device as usize == device {
            return Ok(false);
        }
        Ok(!crate::cuda::can_access_peer(device, self.device as usize)?)
    }
}

/// Bytes of one FIFO's allocation.
pub fn allocation_bytes(g: &Geometry) -> usize {
    DATA_OFFSET as usize + g.slots * g.slot_bytes
}

/// The executor's view of a FIFO whose allocation starts at `base` (device address),
/// with this end's private staging at `stage`.
pub fn fifo_at(base: u64, g: &Geometry, stage: u64) -> FcclFifo {
    FcclFifo {
        head: (base + HEAD_OFFSET) as *mut u64,
        tail: (base + TAIL_OFFSET) as *mut u64,
        sizes: (base + SIZES_OFFSET) as *mut u32,
        data: (base + DATA_OFFSET) as *mut u8,
        stage: stage as *mut u8,
        slots: g.slots as u32,
        slot_bytes: g.slot_bytes as u32,
        protocol: match g.protocol {
            Protocol::Simple | Protocol::SingleCopy => 0,
            Protocol::LL => 1,
        },
        pad: 0,
    }
}

/// The device FIFOs of one rank, connected on first use.
pub struct DeviceFifos {
    rank: usize,
    simple: Geometry,
    ll: Geometry,
    connected: HashMap<FifoEnd, FcclFifo>,
    /// FIFOs this rank receives on (its allocations) and every end's staging.
    owned: Vec<DeviceBuffer>,
    /// FIFOs of other processes this rank sends on.
    imported: Vec<ImportedBuffer>,
    /// Staged FIFOs' registrations (dropped before their segments), then segments.
    registered: Vec<RegisteredHost>,
    segments: Vec<(Segment, Option<String>)>,
    /// Whether the warning about processes time-slicing one GPU was given.
    warned_time_slicing: bool,
}

impl std::fmt::Debug for DeviceFifos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFifos")
            .field("rank", &self.rank)
            .field("connected", &self.connected.len())
            .field("staged", &self.segments.len())
            .finish_non_exhaustive()
    }
}

impl DeviceFifos {
    /// No FIFOs yet, for `rank`, with the host FIFOs' shapes.
    pub fn new(rank: usize, simple: Geometry, ll: Geometry) -> Result<Self> {
        for g in [&simple, &ll] {
            g.validate()?;
            if g.slots > MAX_SLOTS {
                return Err(Error::invalid(format!(
                    "cuda_ipc: {} slots per FIFO, at most {MAX_SLOTS}",
                    g.slots
                )));
            }
        }
        Ok(DeviceFifos {
            rank,
            simple,
            ll,
            connected: HashMap::new(),
            owned: Vec::new(),
            imported: Vec::new(),
            registered: Vec::new(),
            segments: Vec::new(),
            warned_time_slicing: false,
        })
    }

    /// The shape of `protocol`'s FIFOs.
    pub fn geometry(&self, protocol: Protocol) -> Geometry {
        match protocol.fifo() {
            Protocol::Simple | Protocol::SingleCopy => self.simple,
            Protocol::LL => self.ll,
        }
    }

    /// Frees every FIFO and staging buffer (the executors must be done with them).
    pub fn release(&mut self) {
        self.connected.clear();
        self.imported.clear();
        self.owned.clear();
        self.registered.clear();
        for (_, name) in self.segments.drain(..) {
            if let Some(name) = name {
                Segment::unlink(SegmentKind::Shm, &name);
            }
        }
    }

    /// Maps the shared segment `name` of `bytes` (making it when `create`), registers it
    /// with the driver and returns the address kernels use.
    fn staged(&mut self, name: &str, bytes: usize, create: bool) -> Result<u64> {
        let segment = if create {
            Segment::create(SegmentKind::Shm, name, bytes)?
        } else {
            Segment::open(SegmentKind::Shm, name, bytes)?
        };
        // SAFETY: the segment stays mapped (in `segments`) until after the registration
        // is dropped (`registered` is cleared first).
        let registered = unsafe { RegisteredHost::new(segment.as_ptr(), bytes) };
        let registered = registered.inspect_err(|_| {
            // Made here and never to be used: its sender must not find it.
            if create {
                Segment::unlink(SegmentKind::Shm, name);
            }
        })?;
        let device = registered.device();
        self.registered.push(registered);
        self.segments
            .push((segment, create.then(|| name.to_string())));
        Ok(device)
    }

    /// Warns once when `sender` (rank `peer`) is another process on this rank's GPU
    /// `here` and no MPS daemon runs: their kernels time-slice.
    fn warn_if_time_slicing(&mut self, sender: &Sender, here: usize, peer: usize) {
        if sender.process != process_token()
            && sender.host == Sender::here(here).host
            && sender.device as usize == here
            && !crate::cuda::mps_running()
            && !self.warned_time_slicing
        {
            self.warned_time_slicing = true;
            tracing::warn!(
                "rank {}: rank {peer} is another process on this rank's GPU {here}, and no \
                 MPS daemon runs: their kernels time-slice, and each hand-off between them \
                 waits for a slice switch (expect device calls to be very slow). Start MPS \
                 (nvidia-cuda-mps-control -d) or run one process per GPU",
                self.rank
            );
        }
    }

    /// The executor's view of each of `ends`, connecting those not yet connected through
    /// `store` (waiting at most `timeout` for a peer's handle).
    pub fn connect(
        &mut self,
        ends: &[FifoEnd],
        store: &dyn Store,
        timeout: Duration,
    ) -> Result<Vec<FcclFifo>> {
        let me = self.rank;
        let here = crate::cuda::runtime()?;
        // 1. Where each sending end is (never waits).
        for end in ends
            .iter()
            .filter(|e| e.sends && !self.connected.contains_key(e))
        {
            store.set(
                &sender_key(end.channel, me, end.peer, end.protocol),
                &Sender::here(here).encode(),
            )?;
        }
        // 2. Each receiving FIFO, where its sender can reach it (waits only for step 1).
        for end in ends.iter().filter(|e| !e.sends) {
            if self.connected.contains_key(end) {
                continue;
            }
            let g = self.geometry(end.protocol);
            let sk = sender_key(end.channel, end.peer, me, end.protocol);
            store.wait(&[&sk], timeout)?;
            let sender = Sender::decode(&sk, &store.get(&sk)?)?;
            let stage = DeviceBuffer::zeroed(g.payload())?;
            let mut export = Export {
                process: process_token(),
                pid: std::process::id(),
                device: here as u32,
                staged: false,
                serial: 0,
                ptr: 0,
                handle: [0; 64],
            };
            self.warn_if_time_slicing(&sender, here, end.peer);
            let base = if sender.needs_staging(here)? {
                tracing::info!(
                    "rank {me}: the FIFO from rank {} (GPU {}) to rank {me} (GPU {here}) is \
                     staged through page-locked host memory: no P2P between the GPUs",
                    end.peer,
                    sender.device
                );
                export.staged = true;
                export.serial = next_staged_serial();
                let name = staged_name(&export, end.channel, end.peer, me, end.protocol);
                self.staged(&name, allocation_bytes(&g), true)?
            } else {
                let fifo = DeviceBuffer::zeroed(allocation_bytes(&g))?;
                export.ptr = fifo.ptr();
                export.handle = fifo.ipc_handle()?;
                let base = fifo.ptr();
                self.owned.push(fifo);
                base
            };
            store.set(
                &key(end.channel, end.peer, me, end.protocol),
                &export.encode(),
            )?;
            self.connected.insert(*end, fifo_at(base, &g, stage.ptr()));
            self.owned.push(stage);
        }
        // 3. Each sending FIFO, as its receiver made it (waits only for step 2).
        for end in ends.iter().filter(|e| e.sends) {
            if self.connected.contains_key(end) {
                continue;
            }
            let g = self.geometry(end.protocol);
            let k = key(end.channel, me, end.peer, end.protocol);
            store.wait(&[&k], timeout)?;
            let export = Export::decode(&k, &store.get(&k)?)?;
            let base = if export.staged {
                let name = staged_name(&export, end.channel, me, end.peer, end.protocol);
                let base = self.staged(&name, allocation_bytes(&g), false);
                // Both sides have it mapped (or this side never will): the name can go.
                Segment::unlink(SegmentKind::Shm, &name);
                base?
            } else if export.process == process_token() {
                // Same process: the receiver's pointer, reachable once peer access to
                // its GPU is on (IPC handles cannot be opened in their own process).
                crate::cuda::enable_peer_access(export.device as usize)?;
                export.ptr
            } else {
                let mapped = ImportedBuffer::open(&export.handle)?;
                let ptr = mapped.ptr();
                self.imported.push(mapped);
                ptr
            };
            // Staging, and after it (64-byte aligned) an LL sender's own position.
            let stage = DeviceBuffer::zeroed(g.payload() + 64)?;
            let mut fifo = fifo_at(base, &g, stage.ptr());
            if g.protocol == Protocol::LL {
                fifo.head = (stage.ptr() + g.payload() as u64) as *mut u64;
            }
            self.connected.insert(*end, fifo);
            self.owned.push(stage);
        }
        Ok(ends.iter().map(|e| self.connected[e]).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_round_trips_and_garbage_is_named() {
        let e = Export {
            process: 0x1234_5678_9abc_def1,
            pid: 4242,
            device: 3,
            staged: true,
            serial: 77,
            ptr: 0x7f00_0000_1000,
            handle: std::array::from_fn(|i| i as u8),
        };
        assert_eq!(e.encode().len(), EXPORT_BYTES);
        assert_eq!(Export::decode("k", &e.encode()).unwrap(), e);
        assert_eq!(
            staged_name(&e, 0, 1, 2, Protocol::LL),
            "ferroccl-cudafifo-4242-123456789abcdef1-77-0-1-2-LL"
        );
        let err = Export::decode("cuda_ipc/0/1-2/LL", b"short").unwrap_err();
        assert!(err.to_string().contains("cuda_ipc/0/1-2/LL"), "{err}");
        let s = Sender {
            process: 7,
            host: u64::MAX - 1,
            device: 2,
        };
        assert_eq!(s.encode().len(), SENDER_BYTES);
        let back = Sender::decode("k", &s.encode()).unwrap();
        assert_eq!((back.process, back.host, back.device), (7, u64::MAX - 1, 2));
        assert!(Sender::decode("cuda_ipc/s", &[0; 19]).is_err());
        assert_eq!(key(1, 2, 3, Protocol::Simple), "cuda_ipc/1/2-3/Simple");
    }

    #[test]
    fn the_executor_view_follows_the_layout() {
        let g = Geometry::ll(8, 4096);
        let f = fifo_at(0x10000, &g, 0x90000);
        assert_eq!(f.head as u64, 0x10000);
        assert_eq!(f.tail as u64, 0x10080);
        assert_eq!(f.sizes as u64, 0x10100);
        assert_eq!(f.data as u64, 0x11000);
        assert_eq!((f.slots, f.protocol), (8, 1));
        assert_eq!(allocation_bytes(&g), 4096 + 8 * g.slot_bytes);
        // The executor's LL payload formula is the host's.
        assert_eq!(g.payload(), ((g.slot_bytes / 8 - 1) * 4) & !63);
    }
}
