//! [`Nic`] over libibverbs, loaded at run time (as NCCL does): a binary built with the
//! `rdma` feature starts on hosts without rdma-core, and finds out there that it has no
//! RDMA. Types come from `ibverbs-sys` (bindings generated from rdma-core's headers);
//! functions are resolved from `libibverbs.so.1` with `libloading`, and the data-path
//! verbs that are inline functions in `verbs.h` (`ibv_post_send`, `ibv_post_recv`,
//! `ibv_poll_cq`, `ibv_req_notify_cq`) go through the context's operation table, as the
//! header does.
//!
//! Nothing in this file has run on RDMA hardware yet (see the README); the transport
//! above it is tested over [`super::sim`].

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use ibverbs_sys as ffi;

use super::gid::GidEntry;
use super::verbs::{
    Completion, DeviceInfo, Endpoint, Local, Nic, Provider, QpOptions, QpState, Region, Remote,
    WcKind, WcStatus, registration_error,
};
use crate::lock;

/// The port every queue pair uses is the device's first active one.
type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut ffi::ibv_device;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut ffi::ibv_device);
type GetDeviceName = unsafe extern "C" fn(*mut ffi::ibv_device) -> *const c_char;
type OpenDevice = unsafe extern "C" fn(*mut ffi::ibv_device) -> *mut ffi::ibv_context;
type CloseDevice = unsafe extern "C" fn(*mut ffi::ibv_context) -> c_int;
type QueryPort = unsafe extern "C" fn(*mut ffi::ibv_context, u8, *mut ffi::ibv_port_attr) -> c_int;
type QueryDevice = unsafe extern "C" fn(*mut ffi::ibv_context, *mut ffi::ibv_device_attr) -> c_int;
type QueryGid = unsafe extern "C" fn(*mut ffi::ibv_context, u8, c_int, *mut ffi::ibv_gid) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut ffi::ibv_context) -> *mut ffi::ibv_pd;
type DeallocPd = unsafe extern "C" fn(*mut ffi::ibv_pd) -> c_int;
type RegMr = unsafe extern "C" fn(*mut ffi::ibv_pd, *mut c_void, usize, c_int) -> *mut ffi::ibv_mr;
type DeregMr = unsafe extern "C" fn(*mut ffi::ibv_mr) -> c_int;
type CreateCompChannel = unsafe extern "C" fn(*mut ffi::ibv_context) -> *mut ffi::ibv_comp_channel;
type DestroyCompChannel = unsafe extern "C" fn(*mut ffi::ibv_comp_channel) -> c_int;
type CreateCq = unsafe extern "C" fn(
    *mut ffi::ibv_context,
    c_int,
    *mut c_void,
    *mut ffi::ibv_comp_channel,
    c_int,
) -> *mut ffi::ibv_cq;
type DestroyCq = unsafe extern "C" fn(*mut ffi::ibv_cq) -> c_int;
type GetCqEvent = unsafe extern "C" fn(
    *mut ffi::ibv_comp_channel,
    *mut *mut ffi::ibv_cq,
    *mut *mut c_void,
) -> c_int;
type AckCqEvents = unsafe extern "C" fn(*mut ffi::ibv_cq, c_uint);
type CreateQp =
    unsafe extern "C" fn(*mut ffi::ibv_pd, *mut ffi::ibv_qp_init_attr) -> *mut ffi::ibv_qp;
type ModifyQp = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_qp_attr, c_int) -> c_int;
type QueryQp = unsafe extern "C" fn(
    *mut ffi::ibv_qp,
    *mut ffi::ibv_qp_attr,
    c_int,
    *mut ffi::ibv_qp_init_attr,
) -> c_int;
type DestroyQp = unsafe extern "C" fn(*mut ffi::ibv_qp) -> c_int;

/// libibverbs, loaded.
struct Lib {
    _lib: libloading::Library,
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    open_device: OpenDevice,
    close_device: CloseDevice,
    query_device: QueryDevice,
    query_port: QueryPort,
    query_gid: QueryGid,
    alloc_pd: AllocPd,
    dealloc_pd: DeallocPd,
    reg_mr: RegMr,
    dereg_mr: DeregMr,
    create_comp_channel: CreateCompChannel,
    destroy_comp_channel: DestroyCompChannel,
    create_cq: CreateCq,
    destroy_cq: DestroyCq,
    get_cq_event: GetCqEvent,
    ack_cq_events: AckCqEvents,
    create_qp: CreateQp,
    modify_qp: ModifyQp,
    query_qp: QueryQp,
    destroy_qp: DestroyQp,
}

impl Lib {
    fn load() -> Result<Self, String> {
        // SAFETY: loading libibverbs runs its initialisers, which only set up its
        // provider table.
        let lib = unsafe { libloading::Library::new("libibverbs.so.1") }
            .map_err(|e| format!("libibverbs.so.1 could not be loaded ({e}): no RDMA here"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is libibverbs' exported function of that name,
                // whose C signature the field's type repeats (from verbs.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("libibverbs.so.1 has no {}: {e}", $name))?
            };
        }
        Ok(Lib {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_device: sym!("ibv_query_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_comp_channel: sym!("ibv_create_comp_channel"),
            destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            get_cq_event: sym!("ibv_get_cq_event"),
            ack_cq_events: sym!("ibv_ack_cq_events"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            query_qp: sym!("ibv_query_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            _lib: lib,
        })
    }
}

/// The [`Provider`] of real devices.
#[derive(Clone)]
pub struct Libibverbs {
    lib: Arc<Lib>,
}

impl std::fmt::Debug for Libibverbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Libibverbs")
    }
}

impl Libibverbs {
    /// Loads `libibverbs.so.1`; `Err` says why not.
    pub fn load() -> Result<Self, String> {
        Ok(Libibverbs {
            lib: Arc::new(Lib::load()?),
        })
    }

    /// Calls `f` with every device (the list is freed afterwards).
    fn with_devices<T>(
        &self,
        f: impl FnOnce(&[*mut ffi::ibv_device]) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { (self.lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the list holds `n` device pointers until freed below.
        let devices = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let result = f(devices);
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { (self.lib.free_device_list)(list) };
        result
    }
}

/// Gb/s of one lane at `active_speed` (`ibv_port_attr`), as `ibv_devinfo` prints it.
fn lane_gbps(speed: u8, speed_ex: u32) -> f64 {
    match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        0 if speed_ex == 256 => 200.0,
        _ => 0.0,
    }
}

/// Lanes at `active_width`.
fn lanes(width: u8) -> f64 {
    match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => 0.0,
    }
}

/// The port's rate from sysfs (`/sys/class/infiniband/DEV/ports/N/rate`, e.g. `400 Gb/sec
/// (4X XDR)`), in Gb/s.
fn sysfs_rate(device: &str, port: u8) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/sys/class/infiniband/{device}/ports/{port}/rate"))
        .ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// The filled entries of `port`'s GID table (`len` entries), with each RoCE entry's
/// version from sysfs (`gid_attrs/types/N`: `IB/RoCE v1` or `RoCE v2`).
fn gid_table(
    lib: &Lib,
    ctx: *mut ffi::ibv_context,
    device: &str,
    port: u8,
    len: c_int,
    ethernet: bool,
) -> Vec<GidEntry> {
    let mut table = Vec::new();
    for index in 0..len.clamp(0, 256) {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: `ctx` is open and `gid` a valid out-pointer.
        if unsafe { (lib.query_gid)(ctx, port, index, &mut gid) } != 0 {
            continue;
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        let raw = unsafe { gid.raw };
        if raw == [0; 16] {
            continue;
        }
        let roce_version = ethernet
            .then(|| {
                std::fs::read_to_string(format!(
                    "/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}"
                ))
                .ok()
                .and_then(|text| roce_version(&text))
            })
            .flatten();
        table.push(GidEntry {
            index: index as u8,
            gid: raw,
            roce_version,
        });
    }
    table
}

/// The RoCE version sysfs gives a GID entry (`IB/RoCE v1`, `RoCE v2`).
fn roce_version(sysfs_type: &str) -> Option<u8> {
    match sysfs_type.trim() {
        "RoCE v2" => Some(2),
        "IB/RoCE v1" | "RoCE v1" => Some(1),
        _ => None,
    }
}

fn device_name(lib: &Lib, dev: *mut ffi::ibv_device) -> String {
    // SAFETY: `dev` is a device of a live list; the name is a C string it owns.
    let name = unsafe { (lib.get_device_name)(dev) };
    if name.is_null() {
        return "?".into();
    }
    // SAFETY: non-null, NUL-terminated, alive while the list is.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

impl Provider for Libibverbs {
    fn devices(&self) -> io::Result<Vec<DeviceInfo>> {
        let lib = &self.lib;
        self.with_devices(|devices| {
            let mut out = Vec::new();
            for &dev in devices {
                let name = device_name(lib, dev);
                // SAFETY: `dev` is a device of the live list.
                let ctx = unsafe { (lib.open_device)(dev) };
                if ctx.is_null() {
                    continue;
                }
                let mut limits = ffi::ibv_device_attr::default();
                // SAFETY: `ctx` is open and `limits` a valid out-pointer.
                let queried = unsafe { (lib.query_device)(ctx, &mut limits) } == 0;
                if !queried {
                    // The device stays usable; its limits count as unknown (0).
                    tracing::info!(
                        "ibv_query_device({name}) failed ({}): its queue limits are unknown",
                        io::Error::last_os_error()
                    );
                    limits = ffi::ibv_device_attr::default();
                }
                let ports = if queried { limits.phys_port_cnt } else { 8 };
                for port in 1..=ports {
                    let mut attr = ffi::ibv_port_attr::default();
                    // SAFETY: `ctx` is open and `attr` a valid out-pointer of the full
                    // struct (the exported symbol fills its compatible prefix).
                    if unsafe { (lib.query_port)(ctx, port, &mut attr) } != 0 {
                        break;
                    }
                    if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                        continue;
                    }
                    let ethernet = u32::from(attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET;
                    out.push(DeviceInfo {
                        name: name.clone(),
                        port,
                        // sysfs has every speed; the exported ibv_query_port fills only
                        // the old fields (no XDR).
                        gbps: sysfs_rate(&name, port).unwrap_or_else(|| {
                            lanes(attr.active_width)
                                * lane_gbps(attr.active_speed, attr.active_speed_ex)
                        }),
                        link_layer: if ethernet { "Ethernet" } else { "InfiniBand" },
                        gids: gid_table(lib, ctx, &name, port, attr.gid_tbl_len, ethernet),
                        max_cqe: usize::try_from(limits.max_cqe).unwrap_or(0),
                        max_qp_wr: usize::try_from(limits.max_qp_wr).unwrap_or(0),
                    });
                }
                // SAFETY: opened above, closed once.
                unsafe { (lib.close_device)(ctx) };
            }
            Ok(out)
        })
    }

    fn open(
        &self,
        device: &DeviceInfo,
        owner: usize,
        cq_entries: usize,
        gid: GidEntry,
    ) -> io::Result<Arc<dyn Nic>> {
        let lib = self.lib.clone();
        let ctx = self.with_devices(|devices| {
            let dev = devices
                .iter()
                .copied()
                .find(|&d| device_name(&lib, d) == device.name)
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("no device {}", device.name),
                    )
                })?;
            // SAFETY: `dev` is a device of the live list; the context outlives it.
            let ctx = unsafe { (lib.open_device)(dev) };
            if ctx.is_null() {
                return Err(io::Error::last_os_error());
            }
            Ok(ctx)
        })?;
        IbvNic::new(lib, ctx, device.clone(), gid, owner, cq_entries)
            .map(|n| Arc::new(n) as Arc<dyn Nic>)
    }
}

struct QpRec {
    qp: *mut ffi::ibv_qp,
    options: QpOptions,
    psn: u32,
}

/// An opened device port: protection domain, one completion queue with its channel.
struct IbvNic {
    lib: Arc<Lib>,
    device: DeviceInfo,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    channel: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
    /// An eventfd that ends a wait early.
    wake: c_int,
    lid: u16,
    /// The GID table entry every queue pair uses.
    gid: GidEntry,
    ethernet: bool,
    active_mtu: ffi::ibv_mtu,
    /// Queue pairs by number. Verbs on a queue pair run under the read lock, so that
    /// `destroy_qp` (under the write lock) never frees one in use.
    qps: RwLock<HashMap<u32, QpRec>>,
    regions: Mutex<HashMap<u32, *mut ffi::ibv_mr>>,
    /// Whether the completion queue is armed (an event will come at the next
    /// completion).
    armed: AtomicBool,
}

// SAFETY: libibverbs objects may be used from any thread; verbs on one object are
// thread-safe (rdma-core providers lock internally, unless told not to, e.g. with
// MLX5_SINGLE_THREADED=1, which ferroccl does not support: the engine and the proxy post on
// one queue pair), and the maps are behind locks.
unsafe impl Send for IbvNic {}
// SAFETY: as above.
unsafe impl Sync for IbvNic {}

impl IbvNic {
    fn new(
        lib: Arc<Lib>,
        ctx: *mut ffi::ibv_context,
        device: DeviceInfo,
        gid: GidEntry,
        owner: usize,
        cq_entries: usize,
    ) -> io::Result<Self> {
        let cq_depth = c_int::try_from(cq_entries.max(1)).unwrap_or(c_int::MAX);
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; `attr` is a valid out-pointer.
        let rc = unsafe { (lib.query_port)(ctx, device.port, &mut attr) };
        if rc != 0 {
            // SAFETY: opened by the caller, closed once on this failure path.
            unsafe { (lib.close_device)(ctx) };
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: plain resource creation on an open context; each is checked below and
        // released by `Drop` (which tolerates nulls).
        let (pd, channel) = unsafe { ((lib.alloc_pd)(ctx), (lib.create_comp_channel)(ctx)) };
        // SAFETY: as above; `channel` may be null, which the check below catches.
        let cq = unsafe {
            if channel.is_null() {
                std::ptr::null_mut()
            } else {
                (lib.create_cq)(ctx, cq_depth, std::ptr::null_mut(), channel, 0)
            }
        };
        // SAFETY: a plain system call.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if !channel.is_null() {
            // Non-blocking, so that reading an event another thread took cannot block.
            // SAFETY: the channel is live; fcntl on its fd.
            unsafe {
                let fd = (*channel).fd;
                let flags = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        // The GID was read when the devices were listed: an address that changed since
        // would be announced to peers under an index that no longer holds it.
        let mut now = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: `ctx` is open and `now` a valid out-pointer.
        let gid_rc = unsafe { (lib.query_gid)(ctx, device.port, c_int::from(gid.index), &mut now) };
        // SAFETY: every bit pattern of the union is a valid byte array.
        let changed = gid_rc != 0 || unsafe { now.raw } != gid.gid;
        let nic = IbvNic {
            lib,
            device,
            ctx,
            pd,
            channel,
            cq,
            wake,
            lid: attr.lid,
            gid,
            ethernet: u32::from(attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET,
            active_mtu: attr.active_mtu,
            qps: RwLock::new(HashMap::new()),
            regions: Mutex::new(HashMap::new()),
            armed: AtomicBool::new(false),
        };
        if changed && nic.ethernet {
            return Err(io::Error::other(format!(
                "rank {owner}: GID {gid} of {}:{} changed while the device was opened (an \
                 address changed?); try again, or set NCCL_IB_GID_INDEX",
                nic.device.name, nic.device.port
            )));
        }
        if pd.is_null() || channel.is_null() || nic.cq.is_null() || wake < 0 {
            return Err(io::Error::other(format!(
                "rank {owner}: setting up {}:{} failed (protection domain, completion \
                 channel, completion queue of {cq_depth} entries (more than the device's \
                 max_cqe? fewer channels, slots or queue pairs per connection need fewer), \
                 or eventfd)",
                nic.device.name, nic.device.port
            )));
        }
        Ok(nic)
    }

    fn ops(&self) -> &ffi::ibv_context_ops {
        // SAFETY: the context is open for as long as `self` lives.
        unsafe { &(*self.ctx).ops }
    }

    /// Asks for an event on the channel at the next completion.
    fn arm(&self) -> io::Result<()> {
        let notify = self
            .ops()
            .req_notify_cq
            .ok_or_else(|| io::Error::other("no req_notify_cq"))?;
        // SAFETY: `cq` is live.
        match unsafe { notify(self.cq, 0) } {
            0 => Ok(()),
            rc => Err(io::Error::from_raw_os_error(rc)),
        }
    }

    /// Runs `f` on queue pair `qpn`, which cannot be destroyed meanwhile.
    fn with_qp<T>(&self, qpn: u32, f: impl FnOnce(&QpRec) -> io::Result<T>) -> io::Result<T> {
        let qps = self.qps.read().unwrap_or_else(|e| e.into_inner());
        let rec = qps.get(&qpn).ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("no queue pair {qpn}"))
        })?;
        f(rec)
    }

    fn modify(
        &self,
        qp: *mut ffi::ibv_qp,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> io::Result<()> {
        // SAFETY: `qp` is live and `attr` valid for the call.
        match unsafe { (self.lib.modify_qp)(qp, attr, mask.0 as c_int) } {
            0 => Ok(()),
            rc => Err(io::Error::from_raw_os_error(rc)),
        }
    }

    /// Drains up to `max` completions into `out`.
    fn poll_into(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<usize> {
        let poll = self
            .ops()
            .poll_cq
            .ok_or_else(|| io::Error::other("no poll_cq"))?;
        // SAFETY: ibv_wc is plain data; all-zero is a valid value.
        let mut wcs: [ffi::ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let mut total = 0;
        while total < max {
            let want = (max - total).min(wcs.len());
            // SAFETY: `cq` is live and `wcs` has room for `want` entries.
            let n = unsafe { poll(self.cq, want as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(io::Error::other("ibv_poll_cq failed"));
            }
            for wc in &wcs[..n as usize] {
                let status = match wc.error() {
                    None => WcStatus::Success,
                    Some((s, _)) => match s {
                        ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
                        ffi::ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
                        ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
                        ffi::ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
                        ffi::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
                        other => WcStatus::Other(other),
                    },
                };
                out.push(Completion {
                    wr_id: wc.wr_id(),
                    qpn: wc.qp_num,
                    status,
                    // The opcode is valid on success only (the transport goes by wr_id).
                    kind: if wc.opcode() & ffi::ibv_wc_opcode::IBV_WC_RECV != 0 {
                        WcKind::Recv
                    } else {
                        WcKind::Write
                    },
                    imm: wc.imm_data().map(u32::from_be),
                });
            }
            total += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        Ok(total)
    }
}

impl IbvNic {
    /// Moves `rec` to ready-to-send, connected to `remote`.
    fn connect_qp(&self, rec: &QpRec, remote: &Endpoint) -> io::Result<()> {
        let (qp, options) = (rec.qp, rec.options);
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            // The smaller of both ports' MTUs: larger packets would not reach the peer.
            path_mtu: self.active_mtu.min(remote.mtu),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = options.service_level;
        attr.ah_attr.port_num = self.device.port;
        if self.ethernet || remote.lid == 0 {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = self.gid.index;
            attr.ah_attr.grh.hop_limit = 255;
            attr.ah_attr.grh.traffic_class = options.traffic_class;
        }
        use ffi::ibv_qp_attr_mask as m;
        self.modify(
            qp,
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: options.timeout,
            retry_cnt: options.retry_cnt,
            rnr_retry: 7,
            sq_psn: rec.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            qp,
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Posts one RDMA write (with immediate data if `imm`) on `qp`.
    ///
    /// # Safety
    /// `qp` is live; `local` stays registered and unchanged until the write completes.
    unsafe fn post_write_qp(
        &self,
        qp: *mut ffi::ibv_qp,
        wr_id: u64,
        local: Local,
        remote: Remote,
        imm: Option<u32>,
    ) -> io::Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: local.addr,
            length: local.len,
            lkey: local.lkey,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: c_int::from(local.len > 0),
            opcode: if imm.is_some() {
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
            },
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.unwrap_or(0).to_be();
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        };
        let post = self
            .ops()
            .post_send
            .ok_or_else(|| io::Error::other("no post_send"))?;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `qp` is live; `wr` and `sge` are valid for the call (the device copies
        // them); the caller keeps `local` registered until the write completes.
        match unsafe { post(qp, &mut wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(io::Error::from_raw_os_error(rc)),
        }
    }
}

impl Nic for IbvNic {
    fn device(&self) -> &DeviceInfo {
        &self.device
    }

    fn gid(&self) -> GidEntry {
        self.gid
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, remote_write: bool) -> io::Result<Region> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: the caller keeps the memory allocated until `deregister`.
        let mr = unsafe { (self.lib.reg_mr)(self.pd, addr.cast(), len, access.0 as c_int) };
        if mr.is_null() {
            return Err(registration_error(io::Error::last_os_error()));
        }
        // SAFETY: a registered region, alive until ibv_dereg_mr.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        lock(&self.regions).insert(lkey, mr);
        Ok(Region {
            addr: addr as u64,
            len,
            lkey,
            rkey,
        })
    }

    fn deregister(&self, region: &Region) -> io::Result<()> {
        let mr = lock(&self.regions).remove(&region.lkey).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{region:?} is not registered"),
            )
        })?;
        // SAFETY: `mr` was registered here and is deregistered once.
        match unsafe { (self.lib.dereg_mr)(mr) } {
            0 => Ok(()),
            rc => Err(io::Error::from_raw_os_error(rc)),
        }
    }

    fn create_qp(&self, options: &QpOptions) -> io::Result<Endpoint> {
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: self.cq,
            recv_cq: self.cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: options.max_send,
                max_recv_wr: options.max_recv,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: `pd` is live and `init` valid for the call.
        let qp = unsafe { (self.lib.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(io::Error::last_os_error());
        }
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: self.device.port,
            qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0,
            ..Default::default()
        };
        let to_init = self.modify(
            qp,
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ffi::ibv_qp_attr_mask::IBV_QP_PORT
                | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
        );
        // SAFETY: `qp` is live.
        let qpn = unsafe { (*qp).qp_num };
        if let Err(e) = to_init {
            // SAFETY: created above, destroyed once.
            unsafe { (self.lib.destroy_qp)(qp) };
            return Err(e);
        }
        let psn = rand::random::<u32>() & 0xff_ffff;
        self.qps.write().unwrap_or_else(|e| e.into_inner()).insert(
            qpn,
            QpRec {
                qp,
                options: *options,
                psn,
            },
        );
        Ok(Endpoint {
            qpn,
            lid: self.lid,
            gid: self.gid.gid,
            psn,
            mtu: self.active_mtu,
            ethernet: self.ethernet,
        })
    }

    fn connect(&self, qpn: u32, remote: &Endpoint) -> io::Result<()> {
        self.with_qp(qpn, |rec| self.connect_qp(rec, remote))
    }

    unsafe fn post_write(
        &self,
        qpn: u32,
        wr_id: u64,
        local: Local,
        remote: Remote,
        imm: Option<u32>,
    ) -> io::Result<()> {
        // SAFETY: the read lock keeps the queue pair live; the rest is forwarded from
        // this function's contract.
        self.with_qp(qpn, |rec| unsafe {
            self.post_write_qp(rec.qp, wr_id, local, remote, imm)
        })
    }

    fn post_recv(&self, qpn: u32, wr_id: u64) -> io::Result<()> {
        self.with_qp(qpn, |rec| {
            let mut wr = ffi::ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
            };
            let post = self
                .ops()
                .post_recv
                .ok_or_else(|| io::Error::other("no post_recv"))?;
            let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
            // SAFETY: the queue pair is live (the read lock is held) and `wr` valid for
            // the call; it names no memory.
            match unsafe { post(rec.qp, &mut wr, &mut bad) } {
                0 => Ok(()),
                rc => Err(io::Error::from_raw_os_error(rc)),
            }
        })
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<()> {
        self.poll_into(out, max).map(|_| ())
    }

    /// Blocks on the completion channel only once the queue is armed *and* the caller
    /// has polled it since: the first call after an event arms the queue and returns at
    /// once, so the caller's next poll catches completions that came before the arming
    /// (they raise no event). The engine's polls in line never arm.
    fn wait(&self, timeout: Duration) {
        if !self.armed.swap(true, Ordering::SeqCst) {
            if self.arm().is_err() {
                self.armed.store(false, Ordering::SeqCst);
                std::thread::sleep(timeout.min(Duration::from_millis(1)));
            }
            return;
        }
        // SAFETY: the channel is live.
        let channel_fd = unsafe { (*self.channel).fd };
        let mut fds = [
            libc::pollfd {
                fd: channel_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.as_millis().min(i32::MAX as u128) as c_int;
        // SAFETY: `fds` is valid for the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n <= 0 {
            return;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut c_void = std::ptr::null_mut();
            // SAFETY: the channel's fd is non-blocking: without an event this fails
            // (EAGAIN) instead of blocking; the out-pointers are valid.
            if unsafe { (self.lib.get_cq_event)(self.channel, &mut cq, &mut ctx) } == 0 {
                // SAFETY: the event is for our CQ; acknowledged once.
                unsafe { (self.lib.ack_cq_events)(cq, 1) };
                self.armed.store(false, Ordering::SeqCst);
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes from our eventfd into `v`.
            unsafe { libc::read(self.wake, (&mut v as *mut u64).cast(), 8) };
        }
    }

    fn interrupt(&self) {
        let one = 1u64;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake, (&one as *const u64).cast(), 8) };
    }

    fn qp_state(&self, qpn: u32) -> QpState {
        let state = self.with_qp(qpn, |rec| {
            let mut attr = ffi::ibv_qp_attr::default();
            let mut init = ffi::ibv_qp_init_attr::default();
            // SAFETY: the queue pair is live (the read lock is held); the out-pointers
            // are valid.
            let rc = unsafe {
                (self.lib.query_qp)(
                    rec.qp,
                    &mut attr,
                    ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
                    &mut init,
                )
            };
            match rc {
                0 => Ok(attr.qp_state),
                rc => Err(io::Error::from_raw_os_error(rc)),
            }
        });
        match state {
            Ok(ffi::ibv_qp_state::IBV_QPS_INIT) => QpState::Init,
            Ok(ffi::ibv_qp_state::IBV_QPS_RTR) => QpState::ReadyToReceive,
            Ok(ffi::ibv_qp_state::IBV_QPS_RTS) => QpState::ReadyToSend,
            Ok(_) => QpState::Error,
            Err(_) => QpState::Gone,
        }
    }

    fn destroy_qp(&self, qpn: u32) {
        let mut qps = self.qps.write().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = qps.remove(&qpn) {
            // SAFETY: created here, destroyed once, under the write lock: no verb is
            // using it.
            unsafe { (self.lib.destroy_qp)(r.qp) };
        }
    }
}

impl Drop for IbvNic {
    fn drop(&mut self) {
        let lib = &self.lib;
        // SAFETY: every object below was created by this value and is released once, in
        // dependency order (queue pairs and regions, the CQ, its channel, the PD, the
        // context); nulls (a failed setup) are skipped.
        unsafe {
            for (_, r) in self.qps.write().unwrap_or_else(|e| e.into_inner()).drain() {
                (lib.destroy_qp)(r.qp);
            }
            for (_, mr) in lock(&self.regions).drain() {
                (lib.dereg_mr)(mr);
            }
            if !self.cq.is_null() {
                (lib.destroy_cq)(self.cq);
            }
            if !self.channel.is_null() {
                (lib.destroy_comp_channel)(self.channel);
            }
            if !self.pd.is_null() {
                (lib.dealloc_pd)(self.pd);
            }
            if self.wake >= 0 {
                libc::close(self.wake);
            }
            (lib.close_device)(self.ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_gid_types_give_the_roce_version() {
        assert_eq!(roce_version("RoCE v2\n"), Some(2));
        assert_eq!(roce_version("IB/RoCE v1\n"), Some(1));
        assert_eq!(roce_version(""), None);
    }
}
