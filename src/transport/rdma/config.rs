//! The RDMA settings (`NCCL_IB_*`, read as NCCL reads them) and the choice of device
//! and port: which ports `NCCL_IB_HCA` allows (in natural name order), which one each
//! rank of a host takes, opening it, and naming it in logs.

use std::sync::Arc;

use super::MAX_QPS_PER_CONNECTION;
use super::gid::{AddrFamily, AddrRange, GidSelection, choose_gid};
use super::verbs::{DeviceInfo, Nic, Provider, QpOptions};
use crate::env::env_first;
use crate::error::{Error, Result};

/// RDMA settings (NCCL's variable names where they mean the same).
#[derive(Clone)]
pub struct RdmaConfig {
    /// Where the verbs come from: `None` is libibverbs; tests give a
    /// [`SimFabric`](super::sim::SimFabric).
    pub provider: Option<Arc<dyn Provider>>,
    /// Which device ports to use (`NCCL_IB_HCA`): see [`HcaFilter`].
    pub hca: Option<HcaFilter>,
    /// Which GID the queue pairs use: an index (`NCCL_IB_GID_INDEX`), or, by default,
    /// chosen by RoCE version, address family and range (see [`gid`](super::gid)).
    pub gid: GidSelection,
    /// ACK timeout exponent, 4.096 µs × 2^timeout (`NCCL_IB_TIMEOUT`, 1–31, default 20).
    pub timeout: u8,
    /// Transport retries (`NCCL_IB_RETRY_CNT`, 0–7, default 7).
    pub retry_cnt: u8,
    /// Queue pairs per link, each carrying a stripe of every slot
    /// (`NCCL_IB_QPS_PER_CONNECTION`, 1–128, default 1).
    pub qps_per_connection: usize,
    /// Traffic class of RoCE packets (`NCCL_IB_TC`, default 0).
    pub traffic_class: u8,
    /// InfiniBand service level (`NCCL_IB_SL`, 0–15, default 0).
    pub service_level: u8,
    /// Whether the ranks of a host take the allowed ports in turn (`FERROCCL_IB_SPREAD=1`)
    /// rather than all using the first. Only for fabrics where every port reaches every
    /// other (one InfiniBand subnet, routed RoCE v2): on rail-separated networks a rank's
    /// port could not reach its peer's.
    pub spread_ports: bool,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            provider: None,
            hca: None,
            gid: GidSelection::default(),
            timeout: 20,
            retry_cnt: 7,
            qps_per_connection: 1,
            traffic_class: 0,
            service_level: 0,
            spread_ports: false,
        }
    }
}

impl std::fmt::Debug for RdmaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaConfig")
            .field(
                "provider",
                &self.provider.as_ref().map_or("libibverbs", |_| "custom"),
            )
            .field("hca", &self.hca)
            .field("gid", &self.gid)
            .field("timeout", &self.timeout)
            .field("retry_cnt", &self.retry_cnt)
            .field("qps_per_connection", &self.qps_per_connection)
            .field("traffic_class", &self.traffic_class)
            .field("service_level", &self.service_level)
            .field("spread_ports", &self.spread_ports)
            .finish()
    }
}

impl PartialEq for RdmaConfig {
    fn eq(&self, other: &Self) -> bool {
        let same_provider = match (&self.provider, &other.provider) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        same_provider
            && self.hca == other.hca
            && (
                self.gid,
                self.timeout,
                self.retry_cnt,
                self.qps_per_connection,
            ) == (
                other.gid,
                other.timeout,
                other.retry_cnt,
                other.qps_per_connection,
            )
            && (self.traffic_class, self.service_level, self.spread_ports)
                == (other.traffic_class, other.service_level, other.spread_ports)
    }
}

impl Eq for RdmaConfig {}

/// Reads an integer variable in `range`, naming it in errors.
pub(super) fn env_int(name: &str, range: std::ops::RangeInclusive<u64>) -> Result<Option<u64>> {
    let Some((var, text)) = env_first(&[name]) else {
        return Ok(None);
    };
    match text.trim().parse::<u64>() {
        Ok(v) if range.contains(&v) => Ok(Some(v)),
        _ => Err(Error::Env {
            var: var.into(),
            detail: format!(
                "{text:?} is not a whole number in {}..={}",
                range.start(),
                range.end()
            ),
        }),
    }
}

/// `NCCL_IB_GID_INDEX` (a table index; -1, or unset, chooses) and what the choice
/// looks for: `NCCL_IB_ROCE_VERSION_NUM` (1 or 2), `NCCL_IB_ADDR_FAMILY` (`AF_INET` or
/// `AF_INET6`) and `NCCL_IB_ADDR_RANGE` (CIDR, of that family), as `var` reads them.
pub(super) fn gid_selection(var: impl Fn(&'static str) -> Option<String>) -> Result<GidSelection> {
    let refuse = |var: &str, detail: String| {
        Err(Error::Env {
            var: var.into(),
            detail,
        })
    };
    if let Some(text) = var("NCCL_IB_GID_INDEX") {
        match text.trim().parse::<i64>() {
            Ok(-1) => {}
            Ok(i) if (0..=255).contains(&i) => return Ok(GidSelection::Index(i as u8)),
            _ => {
                return refuse(
                    "NCCL_IB_GID_INDEX",
                    format!("{text:?} is not a GID table index 0..=255, or -1 to choose one"),
                );
            }
        }
    }
    let roce_version = match var("NCCL_IB_ROCE_VERSION_NUM") {
        None => 2,
        Some(text) => match text.trim() {
            "1" => 1,
            "2" => 2,
            _ => {
                return refuse(
                    "NCCL_IB_ROCE_VERSION_NUM",
                    format!("{text:?} is not 1 or 2"),
                );
            }
        },
    };
    let family = match var("NCCL_IB_ADDR_FAMILY") {
        None => AddrFamily::V4,
        Some(text) => match AddrFamily::parse(&text) {
            Ok(f) => f,
            Err(detail) => return refuse("NCCL_IB_ADDR_FAMILY", detail),
        },
    };
    let range = match var("NCCL_IB_ADDR_RANGE") {
        None => None,
        Some(text) => match AddrRange::parse(&text) {
            Ok(r) if r.family() == family => Some(r),
            Ok(r) => {
                return refuse(
                    "NCCL_IB_ADDR_RANGE",
                    format!(
                        "{r} is not an {family} range (NCCL_IB_ADDR_FAMILY is {family}); set \
                         NCCL_IB_ADDR_FAMILY={} for it",
                        r.family()
                    ),
                );
            }
            Err(detail) => return refuse("NCCL_IB_ADDR_RANGE", detail),
        },
    };
    Ok(GidSelection::Auto {
        roce_version,
        family,
        range,
    })
}

impl RdmaConfig {
    /// Defaults with `NCCL_IB_HCA`, `NCCL_IB_GID_INDEX` (or `NCCL_IB_ROCE_VERSION_NUM`,
    /// `NCCL_IB_ADDR_FAMILY` and `NCCL_IB_ADDR_RANGE`), `NCCL_IB_TIMEOUT`,
    /// `NCCL_IB_RETRY_CNT`, `NCCL_IB_QPS_PER_CONNECTION`, `NCCL_IB_TC` and `NCCL_IB_SL`
    /// applied, and `FERROCCL_IB_SPREAD`.
    pub fn from_env() -> Result<Self> {
        let mut c = RdmaConfig::default();
        if let Some((var, text)) = env_first(&["NCCL_IB_HCA"]) {
            c.hca = Some(HcaFilter::parse(&text).map_err(|detail| Error::Env {
                var: var.into(),
                detail,
            })?);
        }
        c.gid = gid_selection(|name| env_first(&[name]).map(|(_, text)| text))?;
        if let Some(v) = env_int("NCCL_IB_TIMEOUT", 1..=31)? {
            c.timeout = v as u8;
        }
        if let Some(v) = env_int("NCCL_IB_RETRY_CNT", 0..=7)? {
            c.retry_cnt = v as u8;
        }
        if let Some(v) = env_int(
            "NCCL_IB_QPS_PER_CONNECTION",
            1..=MAX_QPS_PER_CONNECTION as u64,
        )? {
            c.qps_per_connection = v as usize;
        }
        if let Some(v) = env_int("NCCL_IB_TC", 0..=255)? {
            c.traffic_class = v as u8;
        }
        if let Some(v) = env_int("NCCL_IB_SL", 0..=15)? {
            c.service_level = v as u8;
        }
        if let Some(v) = env_int("FERROCCL_IB_SPREAD", 0..=1)? {
            c.spread_ports = v == 1;
        }
        Ok(c)
    }

    /// Checks the values (set in code rather than read from the environment).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: u64, range: &str| {
            Err(Error::invalid(format!("RDMA {what} {v} is not in {range}")))
        };
        if !(1..=31).contains(&self.timeout) {
            return bad("timeout (NCCL_IB_TIMEOUT)", self.timeout.into(), "1..=31");
        }
        if self.retry_cnt > 7 {
            return bad(
                "retry count (NCCL_IB_RETRY_CNT)",
                self.retry_cnt.into(),
                "0..=7",
            );
        }
        if self.service_level > 15 {
            return bad(
                "service level (NCCL_IB_SL)",
                self.service_level.into(),
                "0..=15",
            );
        }
        if !(1..=MAX_QPS_PER_CONNECTION).contains(&self.qps_per_connection) {
            return bad(
                "queue pairs per connection (NCCL_IB_QPS_PER_CONNECTION)",
                self.qps_per_connection as u64,
                "1..=128",
            );
        }
        Ok(())
    }

    /// Completion queue entries for `links` links carrying FIFOs of `slots` slots: every
    /// work request their queue pairs can have outstanding.
    fn cq_entries(&self, links: usize, slots: usize) -> usize {
        let o = self.qp_options(slots);
        links * self.qps_per_connection * (o.max_send + o.max_recv) as usize
    }

    /// The settings of every queue pair of a link carrying FIFOs of `slots` slots.
    pub(super) fn qp_options(&self, slots: usize) -> QpOptions {
        // Per queue pair at most `slots` data writes and `slots` credits are in flight,
        // plus a close and a probe; as many receives are consumed.
        let depth = 2 * slots as u32 + 4;
        QpOptions {
            max_send: depth,
            max_recv: depth,
            timeout: self.timeout,
            retry_cnt: self.retry_cnt,
            traffic_class: self.traffic_class,
            service_level: self.service_level,
        }
    }
}

/// `NCCL_IB_HCA`: which device ports to use, as in NCCL. A comma-separated list of
/// `name[:port]`; names match as prefixes unless the list starts with `=` (exact), and
/// a leading `^` excludes the listed ports instead (`^=mlx5_1` excludes exactly
/// `mlx5_1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaFilter {
    /// Exclude the listed ports instead of selecting them.
    pub exclude: bool,
    /// Names match exactly instead of as prefixes.
    pub exact: bool,
    /// `(name, port)` pairs; no port means every port.
    pub entries: Vec<(String, Option<u8>)>,
}

impl HcaFilter {
    /// Parses NCCL's syntax; an error says what is wrong.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let (exclude, exact, items) = crate::bootstrap::netif::parse_nccl_list(text);
        let mut entries = Vec::new();
        for item in items {
            let (name, port) = match item.split_once(':') {
                Some((n, p)) => {
                    let port =
                        p.parse::<u8>().ok().filter(|&p| p > 0).ok_or_else(|| {
                            format!("port {p:?} of {n:?} is not a number in 1..=255")
                        })?;
                    (n, Some(port))
                }
                None => (item, None),
            };
            if name.is_empty() {
                return Err(format!("{item:?} has no device name"));
            }
            entries.push((name.to_string(), port));
        }
        if entries.is_empty() {
            return Err(format!("{text:?} lists no device"));
        }
        Ok(HcaFilter {
            exclude,
            exact,
            entries,
        })
    }

    /// Whether `device` may be used.
    pub fn allows(&self, device: &DeviceInfo) -> bool {
        let listed = self.entries.iter().any(|(name, port)| {
            let name_ok = if self.exact {
                device.name == *name
            } else {
                device.name.starts_with(name.as_str())
            };
            name_ok && port.is_none_or(|p| p == device.port)
        });
        listed != self.exclude
    }
}

/// A device name as people order them: `mlx5_2` before `mlx5_10`.
pub(super) fn natural_key(name: &str) -> (&str, u64) {
    let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
    (stem, name[stem.len()..].parse().unwrap_or(0))
}

/// The device ports `NCCL_IB_HCA` allows, in name and port order (the order in which the
/// ranks of a host take them), with their provider. `Err` says why there is none (no
/// libibverbs, no device, all excluded).
pub fn allowed_ports(
    config: &RdmaConfig,
) -> std::result::Result<(Arc<dyn Provider>, Vec<DeviceInfo>), String> {
    let provider: Arc<dyn Provider> = match &config.provider {
        Some(p) => p.clone(),
        None => Arc::new(super::ibv::Libibverbs::load()?),
    };
    let devices = provider.devices().map_err(|e| match e.raw_os_error() {
        Some(libc::ENOSYS) => {
            format!("no RDMA device: this kernel has no RDMA support (listing devices: {e})")
        }
        _ => format!("no RDMA device: listing devices failed: {e}"),
    })?;
    if devices.is_empty() {
        return Err("no RDMA device found".into());
    }
    let mut allowed: Vec<DeviceInfo> = devices
        .iter()
        .filter(|d| config.hca.as_ref().is_none_or(|f| f.allows(d)))
        .cloned()
        .collect();
    allowed.sort_by(|a, b| (natural_key(&a.name), a.port).cmp(&(natural_key(&b.name), b.port)));
    if allowed.is_empty() {
        let names: Vec<String> = devices
            .iter()
            .map(|d| format!("{}:{}", d.name, d.port))
            .collect();
        return Err(format!(
            "NCCL_IB_HCA={:?} allows none of the RDMA devices {names:?}",
            config.hca
        ));
    }
    Ok((provider, allowed))
}

/// The ports the ranks of a host use, in the order they take them: the first allowed
/// port, or with [`RdmaConfig::spread_ports`] every allowed port of the first one's link
/// layer and of the highest speed among those (not a slower management NIC).
pub fn ports_in_turn(config: &RdmaConfig, allowed: &[DeviceInfo]) -> Vec<DeviceInfo> {
    let Some(first) = allowed.first() else {
        return Vec::new();
    };
    if !config.spread_ports {
        return vec![first.clone()];
    }
    let same_kind = allowed.iter().filter(|d| d.link_layer == first.link_layer);
    let fastest = same_kind.clone().map(|d| d.gbps).fold(0.0, f64::max);
    same_kind.filter(|d| d.gbps == fastest).cloned().collect()
}

/// Opens the device port this rank will use for `links` links carrying FIFOs of `slots`
/// slots: the `local_rank mod n`th of [`ports_in_turn`] (so by default the first allowed
/// port), with the GID [`RdmaConfig::gid`] picks. `Err` says why there is none (see [`allowed_ports`];
/// also no suitable GID, queues larger than the device allows, the port would not
/// open).
pub fn open_nic(
    config: &RdmaConfig,
    owner: usize,
    local_rank: usize,
    links: usize,
    slots: usize,
) -> std::result::Result<Arc<dyn Nic>, String> {
    let (provider, allowed) = allowed_ports(config)?;
    let ports = ports_in_turn(config, &allowed);
    let device = &ports[local_rank % ports.len()];
    let port = format!("RDMA device {}:{}", device.name, device.port);
    let cq_entries = config.cq_entries(links, slots);
    // A limit of 0 is one the device did not report.
    if device.max_cqe > 0 && cq_entries > device.max_cqe {
        return Err(format!(
            "{port}: {links} link(s) x {} queue pair(s) with FIFOs of {slots} slots need a \
             completion queue of {cq_entries} entries, more than the device's max_cqe of {}; \
             fewer channels (NCCL_NCHANNELS), FIFO slots (FERROCCL_SLOTS) or queue pairs \
             per connection (NCCL_IB_QPS_PER_CONNECTION) need fewer",
            config.qps_per_connection, device.max_cqe
        ));
    }
    let options = config.qp_options(slots);
    let depth = options.max_send.max(options.max_recv) as usize;
    if device.max_qp_wr > 0 && depth > device.max_qp_wr {
        return Err(format!(
            "{port}: FIFOs of {slots} slots need queue pairs of {depth} work requests, more \
             than the device's max_qp_wr of {}; fewer FIFO slots (FERROCCL_SLOTS) need fewer",
            device.max_qp_wr
        ));
    }
    let gid = choose_gid(&device.gids, device.ethernet(), &config.gid)
        .map_err(|e| format!("{port}: {e}"))?;
    provider
        .open(device, owner, cq_entries, gid)
        .map_err(|e| format!("opening {port}: {e}"))
}

/// What a rank's log and `ferroccl-topo` say of an opened device port: its name, link
/// and speed, and on RoCE the GID its queue pairs use.
pub fn describe(nic: &dyn Nic) -> String {
    let device = nic.device();
    if device.ethernet() {
        format!("{device}, GID {}", nic.gid())
    } else {
        device.to_string()
    }
}
