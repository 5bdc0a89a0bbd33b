//! An in-process RDMA fabric for tests: the [`Nic`] semantics the transport relies on,
//! without hardware.
//!
//! A [`SimFabric`] is a set of devices shared by every communicator given it (ranks as
//! threads of one process, on "hosts" of their own). One *wire* thread plays every
//! device's DMA engine, so that, as on real hardware:
//! - a write lands in the peer's registered memory without the peer's CPU (the wire
//!   thread copies it), checked against the peer's registrations (remote access error)
//!   and the local ones (local protection error);
//! - a write with immediate data consumes a receive the peer posted and completes there
//!   with the immediate value; without a posted receive it waits (RNR retries, as with
//!   NCCL's infinite `rnr_retry`);
//! - work requests of one queue pair run and complete in the order posted;
//! - a queue pair in the error state flushes every outstanding and later request;
//! - a request to a peer that does not answer (its queue pair destroyed or in error, its
//!   device unplugged) fails with retry-exceeded after the transport timeout of the
//!   queue pair's `timeout` and `retry_cnt`.
//!
//! Faults are injected per opened device ([`SimFabric::inject`]): its queue pairs to
//! the error state, its next receive completion lost, its next incoming write refused,
//! its cable pulled, or its registrations refused (a locked-memory limit).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::gid::GidEntry;
use super::verbs::{
    Completion, DeviceInfo, Endpoint, Local, Nic, Provider, QpOptions, QpState, Region, Remote,
    WcKind, WcStatus, registration_error,
};

/// A fault to inject into one opened device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every queue pair of the device goes to the error state now.
    QpsToError,
    /// The device's next receive completion is lost (the data still lands).
    LoseCompletion,
    /// The next write arriving at the device is refused (remote access error).
    RefuseNextWrite,
    /// The device stops answering: requests from and to it fail with retry-exceeded
    /// after the transport timeout.
    Unplug,
    /// Every later registration fails as over the locked-memory limit (ENOMEM).
    RefuseRegistrations,
}

/// A simulated RDMA fabric (see the [module documentation](self)).
#[derive(Debug)]
pub struct SimFabric {
    inner: Arc<Inner>,
    wire: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Debug)]
struct Inner {
    devices: Vec<DeviceInfo>,
    world: Mutex<World>,
    /// Rung when a request is posted (for the wire) or a completion queued (for waiters).
    changed: Condvar,
}

#[derive(Debug, Default)]
struct World {
    stop: bool,
    next_key: u32,
    next_qpn: u32,
    /// Opened devices, by id.
    nics: HashMap<u64, NicRec>,
    next_nic: u64,
    qps: HashMap<u32, QpRec>,
    /// Registrations and queue pairs still alive when their device was closed.
    leaked_regions: usize,
    leaked_qps: usize,
}

#[derive(Debug, Default)]
struct NicRec {
    owner: usize,
    /// `name:port` of the device opened.
    port: String,
    /// Completion queue entries; one more completion overruns it.
    cq_capacity: usize,
    /// Set once the queue overran: the device context is unusable.
    overrun: bool,
    /// Registrations, and whether peers may write each.
    regions: Vec<(Region, bool)>,
    cq: VecDeque<Completion>,
    interrupted: bool,
    lose_completions: usize,
    refuse_writes: usize,
    unplugged: bool,
    refuse_registrations: bool,
}

#[derive(Debug)]
struct QpRec {
    nic: u64,
    state: QpState,
    options: QpOptions,
    remote: Option<u32>,
    sends: VecDeque<Wr>,
    recvs: VecDeque<u64>,
}

#[derive(Debug)]
struct Wr {
    wr_id: u64,
    local: Local,
    remote: Remote,
    imm: Option<u32>,
    /// When the peer stopped answering this request: it fails a transport timeout later.
    unanswered_since: Option<Instant>,
}

impl SimFabric {
    /// A fabric with one device `sim0` (port 1, 100 Gb/s InfiniBand).
    pub fn new() -> Arc<Self> {
        Self::with_devices(vec![Self::device("sim0", "InfiniBand", Vec::new())])
    }

    /// A device port 1 of 100 Gb/s with the link layer `InfiniBand` or `Ethernet` (RoCE),
    /// GID table `gids` (on InfiniBand entry 0 is added if missing, as every port has
    /// one) and a ConnectX's limits (4 194 303 completion queue entries, 32 768 work
    /// requests per queue).
    pub fn device(name: &str, link_layer: &'static str, mut gids: Vec<GidEntry>) -> DeviceInfo {
        if link_layer == "InfiniBand" && !gids.iter().any(|g| g.index == 0) {
            let link_local = std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
            gids.insert(0, GidEntry::of_address(0, link_local.into(), None));
        }
        DeviceInfo {
            name: name.into(),
            port: 1,
            gbps: 100.0,
            link_layer,
            gids,
            max_cqe: 4_194_303,
            max_qp_wr: 32_768,
        }
    }

    /// A fabric whose hosts each have `devices`.
    pub fn with_devices(devices: Vec<DeviceInfo>) -> Arc<Self> {
        let inner = Arc::new(Inner {
            devices,
            world: Mutex::new(World::default()),
            changed: Condvar::new(),
        });
        let wire_inner = inner.clone();
        let wire = std::thread::Builder::new()
            .name("ferroccl-simwire".into())
            .spawn(move || wire_inner.run_wire())
            .expect("start the simulated fabric's wire thread");
        Arc::new(SimFabric {
            inner,
            wire: Mutex::new(Some(wire)),
        })
    }

    /// Injects `fault` into every device rank `owner` opened.
    pub fn inject(&self, owner: usize, fault: Fault) {
        let mut w = self.inner.lock();
        let ids: Vec<u64> = w
            .nics
            .iter()
            .filter(|(_, n)| n.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            match fault {
                Fault::QpsToError => {
                    let qpns: Vec<u32> = w
                        .qps
                        .iter()
                        .filter(|(_, q)| q.nic == id)
                        .map(|(&n, _)| n)
                        .collect();
                    for qpn in qpns {
                        w.fail_qp(qpn);
                    }
                }
                Fault::LoseCompletion => w.nics.get_mut(&id).expect("nic").lose_completions += 1,
                Fault::RefuseNextWrite => w.nics.get_mut(&id).expect("nic").refuse_writes += 1,
                Fault::Unplug => w.nics.get_mut(&id).expect("nic").unplugged = true,
                Fault::RefuseRegistrations => {
                    w.nics.get_mut(&id).expect("nic").refuse_registrations = true;
                }
            }
        }
        drop(w);
        self.inner.changed.notify_all();
    }

    /// Queue pairs not destroyed, on every device (those of closed devices included).
    pub fn live_qps(&self) -> usize {
        let w = self.inner.lock();
        w.qps.len() + w.leaked_qps
    }

    /// Registrations not ended, on every device (those of closed devices included).
    pub fn live_regions(&self) -> usize {
        let w = self.inner.lock();
        w.nics.values().map(|n| n.regions.len()).sum::<usize>() + w.leaked_regions
    }

    /// Devices opened and not yet closed.
    pub fn open_devices(&self) -> usize {
        self.inner.lock().nics.len()
    }

    /// The opened devices' owners and ports (`name:port`), by owner.
    pub fn opened_by_owner(&self) -> Vec<(usize, String)> {
        let mut opened: Vec<(usize, String)> = self
            .inner
            .lock()
            .nics
            .values()
            .map(|n| (n.owner, n.port.clone()))
            .collect();
        opened.sort();
        opened
    }
}

impl Drop for SimFabric {
    fn drop(&mut self) {
        self.inner.lock().stop = true;
        self.inner.changed.notify_all();
        if let Some(t) = crate::lock(&self.wire).take() {
            let _ = t.join();
        }
    }
}

impl Provider for SimFabric {
    fn devices(&self) -> io::Result<Vec<DeviceInfo>> {
        Ok(self.inner.devices.clone())
    }

    fn open(
        &self,
        device: &DeviceInfo,
        owner: usize,
        cq_entries: usize,
        gid: GidEntry,
    ) -> io::Result<Arc<dyn Nic>> {
        if !self.inner.devices.contains(device) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no simulated device {}:{}", device.name, device.port),
            ));
        }
        // As ibv_create_cq and ibv_query_gid refuse them.
        if cq_entries > device.max_cqe {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        if device.ethernet() && !device.gids.contains(&gid) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("GID {gid} is not in the table of {}", device.name),
            ));
        }
        let mut w = self.inner.lock();
        let id = w.next_nic;
        w.next_nic += 1;
        w.nics.insert(
            id,
            NicRec {
                owner,
                port: format!("{}:{}", device.name, device.port),
                cq_capacity: cq_entries.max(1),
                ..NicRec::default()
            },
        );
        Ok(Arc::new(SimNic {
            inner: self.inner.clone(),
            id,
            device: device.clone(),
            gid,
        }))
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, World> {
        crate::lock(&self.world)
    }

    /// The wire: runs every queue pair's requests in order until the fabric stops.
    fn run_wire(&self) {
        let mut w = self.lock();
        loop {
            if w.stop {
                return;
            }
            let (moved, next_due) = w.run_requests();
            if moved {
                self.changed.notify_all();
                continue;
            }
            let nap = next_due.map_or(Duration::from_millis(50), |t| {
                t.saturating_duration_since(Instant::now())
                    .max(Duration::from_micros(50))
            });
            w = self
                .changed
                .wait_timeout(w, nap)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl World {
    fn region_of(&self, nic: u64, pred: impl Fn(&Region, bool) -> bool) -> Option<Region> {
        self.nics
            .get(&nic)?
            .regions
            .iter()
            .find(|(r, w)| pred(r, *w))
            .map(|(r, _)| *r)
    }

    /// Queues a completion; past the queue's capacity the queue overruns, which breaks
    /// the device context, as on hardware (`IBV_EVENT_CQ_ERR`).
    fn complete(&mut self, nic: u64, c: Completion) {
        let Some(n) = self.nics.get_mut(&nic) else {
            return;
        };
        if n.cq.len() < n.cq_capacity {
            n.cq.push_back(c);
            return;
        }
        n.overrun = true;
        for q in self.qps.values_mut().filter(|q| q.nic == nic) {
            q.state = QpState::Error;
            q.sends.clear();
            q.recvs.clear();
        }
    }

    /// Moves `qpn` to the error state: flushes its outstanding requests and receives.
    fn fail_qp(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.state = QpState::Error;
        let nic = q.nic;
        let sends: Vec<u64> = q.sends.drain(..).map(|wr| wr.wr_id).collect();
        let recvs: Vec<u64> = q.recvs.drain(..).collect();
        for (wr_id, kind) in sends
            .into_iter()
            .map(|id| (id, WcKind::Write))
            .chain(recvs.into_iter().map(|id| (id, WcKind::Recv)))
        {
            self.complete(
                nic,
                Completion {
                    wr_id,
                    qpn,
                    status: WcStatus::Flushed,
                    kind,
                    imm: None,
                },
            );
        }
    }

    /// Fails the request at the head of `qpn` with `status` and moves the queue pair to
    /// the error state (which flushes the rest).
    fn fail_head(&mut self, qpn: u32, status: WcStatus) {
        let q = self.qps.get_mut(&qpn).expect("queue pair");
        let wr = q.sends.pop_front().expect("a request");
        let nic = q.nic;
        self.complete(
            nic,
            Completion {
                wr_id: wr.wr_id,
                qpn,
                status,
                kind: WcKind::Write,
                imm: None,
            },
        );
        self.fail_qp(qpn);
    }

    /// Completes the head write of queue pair `qpn` (request `wr_id`), and the receive
    /// `recv` (its id and immediate data) it consumed on the peer's queue pair `rqpn` of
    /// device `rnic`, unless that device is set to lose completions.
    fn complete_write(
        &mut self,
        qpn: u32,
        wr_id: u64,
        (rqpn, rnic): (u32, u64),
        recv: Option<(u64, Option<u32>)>,
    ) {
        let q = self.qps.get_mut(&qpn).expect("queue pair");
        q.sends.pop_front();
        let nic = q.nic;
        self.complete(
            nic,
            Completion {
                wr_id,
                qpn,
                status: WcStatus::Success,
                kind: WcKind::Write,
                imm: None,
            },
        );
        let Some((recv_id, imm)) = recv else { return };
        let rn = self.nics.get_mut(&rnic).expect("nic");
        if rn.lose_completions > 0 {
            rn.lose_completions -= 1;
            return;
        }
        self.complete(
            rnic,
            Completion {
                wr_id: recv_id,
                qpn: rqpn,
                status: WcStatus::Success,
                kind: WcKind::Recv,
                imm,
            },
        );
    }

    /// Runs the head request of every queue pair that can run. Returns whether any ran
    /// (or failed), and when the next timeout falls due.
    fn run_requests(&mut self) -> (bool, Option<Instant>) {
        let mut moved = false;
        let mut next_due: Option<Instant> = None;
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| !q.sends.is_empty())
            .map(|(&n, _)| n)
            .collect();
        for qpn in qpns {
            while let Some(q) = self.qps.get(&qpn) {
                let Some(wr) = q.sends.front() else { break };
                let (nic, options, remote_qpn) = (q.nic, q.options, q.remote);
                let local_unplugged = self.nics.get(&nic).is_none_or(|n| n.unplugged);
                // The peer answers if its queue pair exists, can receive, and its device
                // is plugged in.
                let peer = remote_qpn.and_then(|r| {
                    let rq = self.qps.get(&r)?;
                    let rn = self.nics.get(&rq.nic)?;
                    (matches!(rq.state, QpState::ReadyToReceive | QpState::ReadyToSend)
                        && !rn.unplugged
                        && !local_unplugged)
                        .then_some((r, rq.nic))
                });
                let Some((rqpn, rnic)) = peer else {
                    let since = wr.unanswered_since.unwrap_or_else(Instant::now);
                    let due = since + options.transport_timeout();
                    if Instant::now() >= due {
                        self.fail_head(qpn, WcStatus::RetryExceeded);
                        moved = true;
                    } else {
                        let q = self.qps.get_mut(&qpn).expect("queue pair");
                        q.sends.front_mut().expect("request").unanswered_since = Some(since);
                        next_due = Some(next_due.map_or(due, |d| d.min(due)));
                    }
                    break;
                };
                let (local, remote, imm, wr_id) = (wr.local, wr.remote, wr.imm, wr.wr_id);
                if local.len > 0
                    && self
                        .region_of(nic, |r, _| {
                            r.lkey == local.lkey && r.covers(local.addr, local.len as usize)
                        })
                        .is_none()
                {
                    self.fail_head(qpn, WcStatus::LocalProtection);
                    moved = true;
                    break;
                }
                let refused = self.nics.get(&rnic).is_some_and(|n| n.refuse_writes > 0);
                let target = self.region_of(rnic, |r, remote_write| {
                    remote_write
                        && r.rkey == remote.rkey
                        && r.covers(remote.addr, local.len as usize)
                });
                if refused || target.is_none() {
                    if refused {
                        self.nics.get_mut(&rnic).expect("nic").refuse_writes -= 1;
                    }
                    self.fail_head(qpn, WcStatus::RemoteAccess);
                    moved = true;
                    break;
                }
                let recv = if imm.is_some() {
                    let rq = self.qps.get_mut(&rqpn).expect("queue pair");
                    match rq.recvs.pop_front() {
                        Some(r) => Some(r),
                        // No receive posted: retried until one is.
                        None => break,
                    }
                } else {
                    None
                };
                if local.len > 0 {
                    // SAFETY: both ranges lie in registered memory (checked above), which
                    // their owners keep allocated until they deregister it, and
                    // deregistering takes the world's lock that this thread holds. The
                    // FIFO protocol keeps either side from touching these bytes until the
                    // completions below say the write is done.
                    unsafe {
                        std::ptr::copy(
                            local.addr as *const u8,
                            remote.addr as *mut u8,
                            local.len as usize,
                        )
                    };
                }
                self.complete_write(qpn, wr_id, (rqpn, rnic), recv.map(|id| (id, imm)));
                moved = true;
            }
        }
        (moved, next_due)
    }
}

/// One rank's opened simulated device.
struct SimNic {
    inner: Arc<Inner>,
    id: u64,
    device: DeviceInfo,
    gid: GidEntry,
}

impl SimNic {
    fn qp(w: &mut World, nic: u64, qpn: u32) -> io::Result<&mut QpRec> {
        w.qps
            .get_mut(&qpn)
            .filter(|q| q.nic == nic)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no queue pair {qpn}")))
    }
}

impl Nic for SimNic {
    fn device(&self) -> &DeviceInfo {
        &self.device
    }

    fn gid(&self) -> GidEntry {
        self.gid
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, remote_write: bool) -> io::Result<Region> {
        if addr.is_null() || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cannot register {len} bytes at {addr:p}"),
            ));
        }
        let mut w = self.inner.lock();
        if w.nics.get(&self.id).is_some_and(|n| n.refuse_registrations) {
            return Err(registration_error(io::Error::from_raw_os_error(
                libc::ENOMEM,
            )));
        }
        w.next_key += 1;
        let region = Region {
            addr: addr as u64,
            len,
            lkey: w.next_key,
            rkey: w.next_key | 0x8000_0000,
        };
        w.nics
            .get_mut(&self.id)
            .expect("open device")
            .regions
            .push((region, remote_write));
        Ok(region)
    }

    fn deregister(&self, region: &Region) -> io::Result<()> {
        let mut w = self.inner.lock();
        let regions = &mut w.nics.get_mut(&self.id).expect("open device").regions;
        let at = regions
            .iter()
            .position(|(r, _)| r == region)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("region {region:?} is not registered"),
                )
            })?;
        regions.remove(at);
        Ok(())
    }

    fn create_qp(&self, options: &QpOptions) -> io::Result<Endpoint> {
        let mut w = self.inner.lock();
        w.next_qpn += 1;
        let qpn = w.next_qpn;
        w.qps.insert(
            qpn,
            QpRec {
                nic: self.id,
                state: QpState::Init,
                options: *options,
                remote: None,
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
            },
        );
        Ok(Endpoint {
            qpn,
            lid: self.id as u16,
            gid: self.gid.gid,
            psn: 0,
            mtu: 5,
            ethernet: self.device.ethernet(),
        })
    }

    fn connect(&self, qpn: u32, remote: &Endpoint) -> io::Result<()> {
        let mut w = self.inner.lock();
        let q = Self::qp(&mut w, self.id, qpn)?;
        if q.state != QpState::Init {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("queue pair {qpn} is {:?}, not Init", q.state),
            ));
        }
        q.remote = Some(remote.qpn);
        q.state = QpState::ReadyToSend;
        Ok(())
    }

    unsafe fn post_write(
        &self,
        qpn: u32,
        wr_id: u64,
        local: Local,
        remote: Remote,
        imm: Option<u32>,
    ) -> io::Result<()> {
        let mut w = self.inner.lock();
        let q = Self::qp(&mut w, self.id, qpn)?;
        match q.state {
            QpState::ReadyToSend => {
                if q.sends.len() >= q.options.max_send as usize {
                    return Err(io::Error::new(
                        io::ErrorKind::OutOfMemory,
                        format!("send queue of queue pair {qpn} is full"),
                    ));
                }
                q.sends.push_back(Wr {
                    wr_id,
                    local,
                    remote,
                    imm,
                    unanswered_since: None,
                });
            }
            QpState::Error => w.complete(
                self.id,
                Completion {
                    wr_id,
                    qpn,
                    status: WcStatus::Flushed,
                    kind: WcKind::Write,
                    imm: None,
                },
            ),
            s => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("queue pair {qpn} is {s:?}, not ready to send"),
                ));
            }
        }
        drop(w);
        self.inner.changed.notify_all();
        Ok(())
    }

    fn post_recv(&self, qpn: u32, wr_id: u64) -> io::Result<()> {
        let mut w = self.inner.lock();
        let q = Self::qp(&mut w, self.id, qpn)?;
        if q.state == QpState::Error {
            w.complete(
                self.id,
                Completion {
                    wr_id,
                    qpn,
                    status: WcStatus::Flushed,
                    kind: WcKind::Recv,
                    imm: None,
                },
            );
        } else {
            if q.recvs.len() >= q.options.max_recv as usize {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!("receive queue of queue pair {qpn} is full"),
                ));
            }
            q.recvs.push_back(wr_id);
        }
        drop(w);
        self.inner.changed.notify_all();
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<()> {
        let mut w = self.inner.lock();
        let n = w.nics.get_mut(&self.id).expect("open device");
        if n.overrun {
            return Err(io::Error::other("the completion queue overran"));
        }
        let cq = &mut n.cq;
        let n = max.min(cq.len());
        out.extend(cq.drain(..n));
        Ok(())
    }

    fn wait(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut w = self.inner.lock();
        loop {
            let n = w.nics.get_mut(&self.id).expect("open device");
            if !n.cq.is_empty() || n.interrupted || w.stop {
                w.nics.get_mut(&self.id).expect("open device").interrupted = false;
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            w = self
                .inner
                .changed
                .wait_timeout(w, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn interrupt(&self) {
        self.inner
            .lock()
            .nics
            .get_mut(&self.id)
            .expect("open device")
            .interrupted = true;
        self.inner.changed.notify_all();
    }

    fn qp_state(&self, qpn: u32) -> QpState {
        let w = self.inner.lock();
        w.qps
            .get(&qpn)
            .filter(|q| q.nic == self.id)
            .map_or(QpState::Gone, |q| q.state)
    }

    fn destroy_qp(&self, qpn: u32) {
        let mut w = self.inner.lock();
        if w.qps.get(&qpn).is_some_and(|q| q.nic == self.id) {
            w.qps.remove(&qpn);
        }
    }
}

impl Drop for SimNic {
    fn drop(&mut self) {
        let mut w = self.inner.lock();
        let id = self.id;
        let qps = w.qps.len();
        w.qps.retain(|_, q| q.nic != id);
        w.leaked_qps += qps - w.qps.len();
        if let Some(n) = w.nics.remove(&id) {
            w.leaked_regions += n.regions.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPTIONS: QpOptions = QpOptions {
        max_send: 8,
        max_recv: 8,
        timeout: 10,
        retry_cnt: 0,
        traffic_class: 0,
        service_level: 0,
    };

    /// Two devices of one fabric with one connected queue pair each.
    fn pair(fabric: &SimFabric, cq: usize) -> (Arc<dyn Nic>, u32, Arc<dyn Nic>, u32) {
        let dev = fabric.devices().unwrap()[0].clone();
        let gid = dev.gids[0];
        let (a, b) = (
            fabric.open(&dev, 0, cq, gid).unwrap(),
            fabric.open(&dev, 1, cq, gid).unwrap(),
        );
        let (ea, eb) = (
            a.create_qp(&OPTIONS).unwrap(),
            b.create_qp(&OPTIONS).unwrap(),
        );
        a.connect(ea.qpn, &eb).unwrap();
        b.connect(eb.qpn, &ea).unwrap();
        (a, ea.qpn, b, eb.qpn)
    }

    fn next(nic: &dyn Nic) -> Completion {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut out = Vec::new();
            nic.poll(&mut out, 1).unwrap();
            if let Some(c) = out.pop() {
                return c;
            }
            assert!(Instant::now() < deadline, "no completion");
            nic.wait(Duration::from_millis(50));
        }
    }

    #[test]
    fn writes_land_without_the_peer_and_complete_in_order() {
        let fabric = SimFabric::new();
        let (a, qa, b, qb) = pair(&fabric, 64);
        let mut src = vec![7u8; 64];
        let mut dst = vec![0u8; 64];
        // SAFETY: both buffers outlive their registrations (ended below).
        let (ra, rb) = unsafe {
            (
                a.register(src.as_mut_ptr(), 64, false).unwrap(),
                b.register(dst.as_mut_ptr(), 64, true).unwrap(),
            )
        };
        let local = |off: u64, len: u32| Local {
            addr: ra.addr + off,
            len,
            lkey: ra.lkey,
        };
        let remote = |off: u64| Remote {
            addr: rb.addr + off,
            rkey: rb.rkey,
        };
        // SAFETY: registered memory, unchanged until the completions below.
        unsafe {
            a.post_write(qa, 1, local(0, 32), remote(0), None).unwrap();
            a.post_write(qa, 2, local(32, 32), remote(32), Some(99))
                .unwrap();
        }
        assert_eq!(next(a.as_ref()).wr_id, 1);
        // The write with immediate data waits for a receive (RNR), then lands.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(dst[32], 0, "no receive posted yet");
        b.post_recv(qb, 5).unwrap();
        assert_eq!(next(a.as_ref()).wr_id, 2);
        let c = next(b.as_ref());
        assert_eq!((c.wr_id, c.kind, c.imm), (5, WcKind::Recv, Some(99)));
        assert_eq!(dst, vec![7u8; 64]);
        a.deregister(&ra).unwrap();
        b.deregister(&rb).unwrap();
    }

    #[test]
    fn bad_keys_errors_and_overruns_behave_as_on_hardware() {
        let fabric = SimFabric::new();
        let (a, qa, b, qb) = pair(&fabric, 64);
        let mut buf = vec![0u8; 64];
        // SAFETY: outlives the registration (ended below).
        let r = unsafe { a.register(buf.as_mut_ptr(), 64, true).unwrap() };
        let local = Local {
            addr: r.addr,
            len: 8,
            lkey: r.lkey,
        };
        // A write to memory the peer never registered: remote access error, and the
        // queue pair goes to the error state (later requests are flushed).
        let nowhere = Remote {
            addr: 4096,
            rkey: 1,
        };
        // SAFETY: registered memory.
        unsafe {
            a.post_write(qa, 1, local, nowhere, None).unwrap();
            a.post_write(qa, 2, local, nowhere, None).unwrap();
        }
        assert_eq!(next(a.as_ref()).status, WcStatus::RemoteAccess);
        assert_eq!(next(a.as_ref()).status, WcStatus::Flushed);
        assert_eq!(a.qp_state(qa), QpState::Error);
        // The peer's queue pair no longer answers: its request fails after the
        // transport timeout (4.096 µs × 2^10, one try ≈ 4 ms).
        let start = Instant::now();
        // SAFETY: a write of no bytes.
        unsafe {
            b.post_write(
                qb,
                3,
                Local {
                    addr: 0,
                    len: 0,
                    lkey: 0,
                },
                Remote {
                    addr: r.addr,
                    rkey: r.rkey,
                },
                None,
            )
            .unwrap();
        }
        assert_eq!(next(b.as_ref()).status, WcStatus::RetryExceeded);
        assert!(start.elapsed() >= OPTIONS.transport_timeout());
        a.deregister(&r).unwrap();
        a.destroy_qp(qa);
        b.destroy_qp(qb);
        drop((a, b));
        // A completion queue of 1 entry overruns at the second completion.
        let (a, qa, b, qb) = pair(&fabric, 1);
        b.post_recv(qb, 1).unwrap();
        // SAFETY: writes of no bytes.
        unsafe {
            let to = Remote { addr: 0, rkey: 0 };
            let none = Local {
                addr: 0,
                len: 0,
                lkey: 0,
            };
            a.post_write(qa, 1, none, to, None).unwrap();
            a.post_write(qa, 2, none, to, None).unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        let mut out = Vec::new();
        assert!(a.poll(&mut out, 8).is_err());
        assert_eq!(a.qp_state(qa), QpState::Error);
        a.destroy_qp(qa);
        b.destroy_qp(qb);
        drop((a, b));
        assert_eq!((fabric.live_qps(), fabric.live_regions()), (0, 0));
    }
}
