//! Communicator settings and their environment variables.

use std::time::Duration;

use crate::bootstrap::BootstrapOptions;
use crate::env::{env_first, env_number, env_switch};
use crate::error::{Error, Result};
use crate::plan::Algorithm;
use crate::transport::fifo::{Geometry, Protocol};
use crate::transport::{NetChoice, SlotStores, Striping, TransportChoice};

/// Settings of a [`Communicator`](super::Communicator).
///
/// [`CommConfig::from_env`] reads the `FERROCCL_*` variables (NCCL's names in
/// parentheses are honoured too where they mean the same thing):
///
/// | variable | field | default |
/// | --- | --- | --- |
/// | `FERROCCL_TIMEOUT` | `timeout` (seconds) | 600 |
/// | `FERROCCL_NCHANNELS` (`NCCL_NCHANNELS`) | `channels`, and `device_channels` | 1; device calls: from the device ([`crate::cuda::tuning`]) |
/// | `FERROCCL_SLOTS` | `slots` per FIFO, `dedicated_slots` and `crowded_slots` | 8; 16 between ranks of a host that each have a core; 2 between ranks of a host that outnumber its cores |
/// | `FERROCCL_SLOT_SIZE` | `slot_bytes` | 128 KiB |
/// | `FERROCCL_CHUNK_SIZE` | `chunk_bytes` | half of a FIFO of `slots` (of `crowded_slots` where some host's ranks outnumber its cores) |
/// | `FERROCCL_TRANSPORT` (`auto`, `shm`, `tcp`) | `transport` | auto |
/// | `FERROCCL_SLOT_STORES` (`auto`, `plain`, `streaming`) | `slot_stores` | auto |
/// | `FERROCCL_SLOT_EXCHANGE` (`1`/`0`) | `slot_exchange` | on |
/// | `FERROCCL_ALGO` (`NCCL_ALGO`): `ring`, `tree`, `oneshot`, `twoshot`, lists, `^` to exclude | `algorithms` | all; [`crate::tune`] chooses per call |
/// | `FERROCCL_DETERMINISTIC` (`1`/`0`) | `deterministic` | off |
/// | `FERROCCL_PROTO` (`NCCL_PROTO`): `LL`, `Simple`, lists, `^` to exclude | `protocols` | all; [`crate::tune`] chooses per call |
/// | `FERROCCL_LL_SLOT_SIZE` | `ll_payload_bytes` (data bytes per LL slot) | 4 KiB |
/// | `FERROCCL_LL_SLOTS` | `ll_slots` and `dedicated_ll_slots` | 8; 32 between ranks of a host that each have a core |
/// | `FERROCCL_LINK_TIMEOUT` | `link_timeout` (seconds) | 30 |
/// | `FERROCCL_SOCKET_NTHREADS` (`NCCL_SOCKET_NTHREADS`) | `striping.threads` per TCP link | 1 |
/// | `FERROCCL_NSOCKS_PERTHREAD` (`NCCL_NSOCKS_PERTHREAD`) | `striping.sockets_per_thread` | 1 |
/// | `FERROCCL_BOOTSTRAP_TIMEOUT` | `bootstrap.timeout` | 300 |
/// | `FERROCCL_NET` (`NCCL_NET`): `IB`, `Socket` | `net` | RDMA where both ranks have a device, else TCP |
/// | `NCCL_IB_HCA`, `NCCL_IB_GID_INDEX`, `NCCL_IB_TIMEOUT`, `NCCL_IB_RETRY_CNT`, `NCCL_IB_QPS_PER_CONNECTION` | `rdma` (feature `rdma`) | see `RdmaConfig` |
#[derive(Clone, Debug)]
pub struct CommConfig {
    /// Deadline of every collective: past it the call fails with
    /// [`Error::Timeout`](crate::Error::Timeout) naming the ranks it waited on.
    pub timeout: Duration,
    /// Number of parallel rings.
    pub channels: usize,
    /// Number of parallel rings (thread blocks per rank) of calls on device memory;
    /// `None`: from the device, the SMs and the link between the GPUs
    /// ([`crate::cuda::tuning`]). `FERROCCL_NCHANNELS` sets it with `channels`.
    pub device_channels: Option<usize>,
    /// Slots per FIFO.
    pub slots: usize,
    /// Slots per Simple FIFO between ranks of one host where every rank there has a core
    /// of its own (those FIFOs rotate short messages through their memory, and a walk
    /// longer than a core's L2 cache finds the lines the reader has dropped; see
    /// [`crate::transport::fifo`]). Ring steps stay `chunk_bytes` whatever it is.
    pub dedicated_slots: usize,
    /// Slots per Simple FIFO between ranks of one host whose ranks outnumber its cores:
    /// the ranks that take turns on a core walk all their FIFOs through that core's
    /// caches, so these FIFOs are short, and where some host has them a Simple ring
    /// step moves at most half of one ([`CommConfig::chunk_bytes_for`]). Measured on
    /// 2 cores with 2 MiB of L2 each (2026-11-29, all-reduce, busbw, three rounds
    /// interleaved): 8 ranks, 512 KiB–32 MiB, 8 slots of 128 KiB (1 MiB a FIFO, steps
    /// of 512 KiB) 1.03–1.44 GB/s, 2 slots (256 KiB, steps of 128 KiB) 1.59–2.06; 3 and
    /// 4 ranks at 8–32 KiB 5–15 % slower (docs/src/transports.md, "FIFOs between ranks
    /// that outnumber the cores").
    pub crowded_slots: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Bytes one step of a ring moves (at most half a FIFO, so rings cannot deadlock).
    pub chunk_bytes: usize,
    /// Which transport to use between ranks of one host (TCP is always used across
    /// hosts).
    pub transport: TransportChoice,
    /// How slots towards peers of this host are written: plain stores, non-temporal
    /// ones, or (auto) towards peers whose cache measures far, whichever of the two the
    /// calls time faster ([`crate::tune::stores`], which with auto also decides whether
    /// results of 8 MiB or more are streamed).
    pub slot_stores: SlotStores,
    /// Whether the two FIFOs of a protocol between two ranks of one host exchange slots:
    /// a rank writes what it sends into the memory it has just drained of what its peer
    /// sent it, which its cache holds, instead of into memory the peer's cache holds
    /// (see [`crate::transport::fifo`], "Slots that change direction"). Simple FIFOs
    /// always, LL FIFOs where every rank of the host has a core.
    pub slot_exchange: bool,
    /// The algorithms the cost model may choose from (one to force it), for the
    /// collectives each applies to ([`Algorithm::applies_to`]).
    pub algorithms: Vec<Algorithm>,
    /// Reductions combine every element's contributions in rank order `0, 1, …, n−1`,
    /// so results are the same bits whatever the algorithm, protocol, chunk size or
    /// channel count (and from run to run): reducing collectives then use only the
    /// algorithms that fold in rank order ([`Algorithm::folds_in_rank_order`]), the
    /// one-shot when none of those allowed applies.
    pub deterministic: bool,
    /// The protocols the cost model may choose from (one to force it). LL FIFOs exist
    /// only when LL is allowed.
    pub protocols: Vec<Protocol>,
    /// Slots per LL FIFO: between ranks of one host whose ranks outnumber its cores, and
    /// on devices.
    pub ll_slots: usize,
    /// Slots per LL FIFO between ranks of one host where every rank there has a core of
    /// its own. A slot carries a message at its start, so a FIFO of few slots writes the
    /// same lines again soon after the reader took them into its L1 cache, and each
    /// costs the writer an invalidation of the reader's copy; a longer walk comes back
    /// to lines the reader has dropped. Measured on 2 cores (2 MiB of L2 and 48 KiB of
    /// L1 each, 2026-11-30; all-reduce of 2 ranks, one-shot LL, two rounds): 2 KiB,
    /// 1.09–1.11 µs with 8 slots, 1.05–1.07 with 16, 0.87–0.93 with 32 to 256 (a walk of
    /// 64 KiB and more); 8 B–512 B and the Simple sizes above unchanged. Ranks that take
    /// turns on a core share its caches, and there 32 slots measured no faster (4 and 8
    /// ranks) or slower (3 ranks, 8 B: 1.35–1.36 → 1.44–1.65 µs), so those keep
    /// `ll_slots`.
    pub dedicated_ll_slots: usize,
    /// Data bytes per LL slot (a multiple of 64, at most `slot_bytes`: over TCP, LL
    /// slices travel in the Simple FIFOs; the slot in memory is twice that plus 64 B).
    pub ll_payload_bytes: usize,
    /// How long a TCP peer may stay silent before its connection counts as broken
    /// (so a cut link is reported as such well before the collective's deadline).
    pub link_timeout: Duration,
    /// Sockets and helper threads per TCP link (their product at most 64, as NCCL).
    pub striping: Striping,
    /// Rendezvous settings.
    pub bootstrap: BootstrapOptions,
    /// Which network carries traffic between hosts.
    pub net: NetChoice,
    /// RDMA settings (`NCCL_IB_*`).
    #[cfg(feature = "rdma")]
    pub rdma: crate::transport::rdma::RdmaConfig,
}

impl Default for CommConfig {
    fn default() -> Self {
        let slots = 8;
        let slot_bytes = 128 * 1024;
        CommConfig {
            timeout: Duration::from_secs(600),
            channels: 1,
            device_channels: None,
            slots,
            dedicated_slots: 16,
            crowded_slots: 2,
            slot_bytes,
            chunk_bytes: half_fifo(slots, slot_bytes),
            transport: TransportChoice::Auto,
            slot_stores: SlotStores::Auto,
            slot_exchange: true,
            algorithms: Algorithm::ALL.to_vec(),
            deterministic: false,
            protocols: Protocol::ALL.to_vec(),
            ll_slots: 8,
            dedicated_ll_slots: 32,
            ll_payload_bytes: 4096,
            link_timeout: Duration::from_secs(30),
            striping: Striping::default(),
            bootstrap: BootstrapOptions::default(),
            net: NetChoice::Auto,
            #[cfg(feature = "rdma")]
            rdma: crate::transport::rdma::RdmaConfig::default(),
        }
    }
}

impl CommConfig {
    /// Defaults with the environment variables applied, then checked.
    pub fn from_env() -> Result<Self> {
        let mut c = CommConfig {
            bootstrap: BootstrapOptions::from_env()?,
            ..CommConfig::default()
        };
        if let Some(v) = env_number(&["FERROCCL_TIMEOUT"])? {
            c.timeout = Duration::from_secs_f64(v);
        }
        if let Some(v) = env_number(&["FERROCCL_LINK_TIMEOUT"])? {
            c.link_timeout = Duration::from_secs_f64(v);
        }
        if let Some(v) = env_number(&["FERROCCL_SOCKET_NTHREADS", "NCCL_SOCKET_NTHREADS"])? {
            c.striping.threads = v as usize;
        }
        if let Some(v) = env_number(&["FERROCCL_NSOCKS_PERTHREAD", "NCCL_NSOCKS_PERTHREAD"])? {
            c.striping.sockets_per_thread = v as usize;
        }
        if let Some(v) = env_number(&["FERROCCL_NCHANNELS", "NCCL_NCHANNELS"])? {
            c.channels = v as usize;
            c.device_channels = Some(v as usize);
        }
        if let Some(v) = env_number(&["FERROCCL_SLOTS"])? {
            c.slots = v as usize;
            c.dedicated_slots = v as usize;
            c.crowded_slots = v as usize;
        }
        if let Some(v) = env_number(&["FERROCCL_SLOT_SIZE"])? {
            c.slot_bytes = v as usize;
        }
        c.chunk_bytes = match env_number(&["FERROCCL_CHUNK_SIZE"])? {
            Some(v) => v as usize,
            None => half_fifo(c.slots, c.slot_bytes),
        };
        if let Some(v) = env_number(&["FERROCCL_LL_SLOT_SIZE"])? {
            c.ll_payload_bytes = v as usize;
        }
        if let Some(v) = env_number(&["FERROCCL_LL_SLOTS"])? {
            c.ll_slots = v as usize;
            c.dedicated_ll_slots = v as usize;
        }
        if let Some((var, text)) = env_first(&["FERROCCL_NET", "NCCL_NET"]) {
            c.net = NetChoice::parse(&text).map_err(|detail| Error::Env {
                var: var.into(),
                detail,
            })?;
        }
        #[cfg(feature = "rdma")]
        {
            c.rdma = crate::transport::rdma::RdmaConfig::from_env()?;
        }
        if let Some((var, list)) = env_first(&["FERROCCL_ALGO", "NCCL_ALGO"]) {
            c.algorithms = parse_algorithms(var, &list)?;
        }
        if let Some(on) = env_switch("FERROCCL_DETERMINISTIC")? {
            c.deterministic = on;
        }
        if let Some(on) = env_switch("FERROCCL_SLOT_EXCHANGE")? {
            c.slot_exchange = on;
        }
        if let Some((var, list)) = env_first(&["FERROCCL_PROTO", "NCCL_PROTO"]) {
            c.protocols = parse_protocols(var, &list)?;
        }
        if let Ok(t) = std::env::var("FERROCCL_TRANSPORT") {
            c.transport = match t.trim() {
                "shm" => TransportChoice::Shm,
                "tcp" | "net" | "socket" => TransportChoice::Tcp,
                "" | "auto" => TransportChoice::Auto,
                other => {
                    return Err(Error::Env {
                        var: "FERROCCL_TRANSPORT".into(),
                        detail: format!("{other:?} is not one of auto, shm, tcp"),
                    });
                }
            };
        }
        if let Some((var, text)) = env_first(&["FERROCCL_SLOT_STORES"]) {
            c.slot_stores = SlotStores::parse(&text).map_err(|detail| Error::Env {
                var: var.into(),
                detail,
            })?;
        }
        c.validate()?;
        Ok(c)
    }

    /// The shape of the Simple FIFOs.
    pub fn geometry(&self) -> Geometry {
        Geometry {
            slots: self.slots,
            slot_bytes: self.slot_bytes,
            protocol: Protocol::Simple,
        }
    }

    /// The shape of the Simple FIFOs between ranks of one host that each have a core.
    pub fn dedicated_geometry(&self) -> Geometry {
        Geometry {
            slots: self.dedicated_slots,
            ..self.geometry()
        }
    }

    /// The shape of the Simple FIFOs between ranks of one host that outnumber its cores.
    pub fn crowded_geometry(&self) -> Geometry {
        Geometry {
            slots: self.crowded_slots,
            ..self.geometry()
        }
    }

    /// The shape of the LL FIFOs, if LL is allowed (between ranks of a host whose ranks
    /// outnumber its cores, and on devices).
    pub fn ll_geometry(&self) -> Option<Geometry> {
        self.protocols
            .contains(&Protocol::LL)
            .then(|| Geometry::ll(self.ll_slots, self.ll_payload_bytes))
    }

    /// The shape of the LL FIFOs between ranks of one host that each have a core, if LL
    /// is allowed.
    pub fn dedicated_ll_geometry(&self) -> Option<Geometry> {
        self.ll_geometry().map(|g| Geometry {
            slots: self.dedicated_ll_slots,
            ..g
        })
    }

    /// Bytes one step of a ring moves with `protocol`: `chunk_bytes`, for Simple at
    /// most half of a FIFO of `crowded_slots` when `crowded` (some host of the job has
    /// more ranks than cores, and such FIFOs between them), for LL at most half of any
    /// FIFO its slices go through (LL FIFOs inside a host, Simple ones over TCP), and
    /// for single copy four times `chunk_bytes` (a message takes one slot whatever its
    /// size, so only the pipeline's depth limits it: 2 ranks, 32 MiB, measured best at
    /// 2 MiB).
    pub fn chunk_bytes_for(&self, protocol: Protocol, crowded: bool) -> usize {
        match protocol {
            Protocol::Simple if crowded => self
                .chunk_bytes
                .min(half_fifo(self.crowded_slots, self.slot_bytes)),
            Protocol::Simple => self.chunk_bytes,
            Protocol::SingleCopy => self.chunk_bytes.saturating_mul(4),
            Protocol::LL => self.chunk_bytes.min(half_fifo(
                self.ll_slots.min(self.slots),
                self.ll_payload_bytes,
            )),
        }
    }

    /// The settings every rank of a communicator must share (they decide plans and
    /// FIFOs), as `name=value` lines, for comparing across ranks at initialisation.
    pub fn shared_settings(&self) -> String {
        let names = |v: Vec<&str>| v.join(",");
        [
            (
                "FERROCCL_ALGO",
                names(self.algorithms.iter().map(|a| a.name()).collect()),
            ),
            (
                "FERROCCL_PROTO",
                names(self.protocols.iter().map(|p| p.name()).collect()),
            ),
            (
                "FERROCCL_DETERMINISTIC",
                u8::from(self.deterministic).to_string(),
            ),
            ("FERROCCL_TRANSPORT", format!("{:?}", self.transport)),
            (
                "FERROCCL_SLOT_EXCHANGE",
                u8::from(self.slot_exchange).to_string(),
            ),
            ("FERROCCL_NCHANNELS", self.channels.to_string()),
            (
                "device_channels",
                self.device_channels
                    .map_or_else(|| "auto".to_string(), |c| c.to_string()),
            ),
            ("FERROCCL_SLOTS", self.slots.to_string()),
            ("dedicated_slots", self.dedicated_slots.to_string()),
            ("crowded_slots", self.crowded_slots.to_string()),
            ("FERROCCL_SLOT_SIZE", self.slot_bytes.to_string()),
            ("FERROCCL_CHUNK_SIZE", self.chunk_bytes.to_string()),
            ("FERROCCL_LL_SLOTS", self.ll_slots.to_string()),
            ("dedicated_ll_slots", self.dedicated_ll_slots.to_string()),
            ("FERROCCL_LL_SLOT_SIZE", self.ll_payload_bytes.to_string()),
        ]
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// The first setting where two [`CommConfig::shared_settings`] texts differ, as
    /// `NAME: ours vs theirs`; `None` when they agree.
    pub fn settings_differ(ours: &str, theirs: &str) -> Option<String> {
        if ours == theirs {
            return None;
        }
        let (a, b): (Vec<&str>, Vec<&str>) = (ours.lines().collect(), theirs.lines().collect());
        for i in 0..a.len().max(b.len()) {
            let (x, y) = (
                a.get(i).copied().unwrap_or(""),
                b.get(i).copied().unwrap_or(""),
            );
            if x != y {
                let name = x.split_once('=').map_or(x, |(n, _)| n);
                let value = |t: &str| t.split_once('=').map_or(t, |(_, v)| v).to_string();
                return Some(format!("{name}: {} vs {}", value(x), value(y)));
            }
        }
        None
    }

    /// Checks that the settings make sense together.
    pub fn validate(&self) -> Result<()> {
        self.geometry().validate()?;
        self.dedicated_geometry().validate()?;
        self.crowded_geometry().validate()?;
        #[cfg(feature = "rdma")]
        self.rdma.validate()?;
        if let (Some(ll), Some(dedicated)) = (self.ll_geometry(), self.dedicated_ll_geometry()) {
            ll.validate()?;
            dedicated.validate()?;
            if self.ll_payload_bytes < 64
                || !self.ll_payload_bytes.is_multiple_of(64)
                || self.ll_payload_bytes > self.slot_bytes
            {
                return Err(Error::invalid(format!(
                    "LL slot size {} is not a multiple of 64 bytes between 64 B and the \
                     slot size {} (LL slices also travel in Simple slots, over TCP)",
                    self.ll_payload_bytes, self.slot_bytes
                )));
            }
        }
        if self.protocols.is_empty() || self.algorithms.is_empty() {
            return Err(Error::invalid(
                "no protocol or no algorithm allowed: allow at least one of each",
            ));
        }
        self.striping.validate()?;
        for channels in [Some(self.channels), self.device_channels]
            .into_iter()
            .flatten()
        {
            if channels == 0 || channels > 64 {
                return Err(Error::invalid(format!("{channels} channels: use 1 to 64")));
            }
        }
        let slots = self.slots.min(self.dedicated_slots);
        let max_chunk = half_fifo(slots, self.slot_bytes);
        if self.chunk_bytes < 8 || self.chunk_bytes > max_chunk {
            return Err(Error::invalid(format!(
                "chunk of {} bytes: must be between 8 bytes and half a FIFO ({max_chunk} \
                 bytes = {slots} slots of {} bytes / 2), or rings could deadlock",
                self.chunk_bytes, self.slot_bytes
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid("timeout of 0"));
        }
        Ok(())
    }
}

/// Half a FIFO of `slots` slots of `bytes`: the most one ring step may move, so that every
/// rank's first send fits in its FIFO and rings cannot deadlock.
fn half_fifo(slots: usize, bytes: usize) -> usize {
    slots / 2 * bytes
}

/// What a word of an NCCL list names.
enum Word<T> {
    /// One of ferroccl's choices.
    Ours(T),
    /// One of NCCL's that ferroccl does not have: accepted and ignored.
    NcclOnly,
    /// Nothing known.
    Unknown,
}

/// Reads a list in NCCL's syntax (`a`, `a,b`, `^a` to exclude; case does not matter)
/// into the members of `all` it allows, in `all`'s order. `kind` and `have` name the
/// choices in errors.
fn parse_list<T: Copy + PartialEq>(
    var: &str,
    list: &str,
    all: &[T],
    (kind, have): (&str, &str),
    word: impl Fn(&str) -> Word<T>,
) -> Result<Vec<T>> {
    let (exclude, body) = match list.trim().strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, list.trim()),
    };
    let mut named = Vec::new();
    for w in body.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        match word(&w.to_ascii_lowercase()) {
            Word::Ours(t) => named.push(t),
            Word::NcclOnly => {}
            Word::Unknown => {
                return Err(Error::Env {
                    var: var.into(),
                    detail: format!("unknown {kind} {w:?} (ferroccl has {have})"),
                });
            }
        }
    }
    let allowed: Vec<T> = all
        .iter()
        .copied()
        .filter(|a| named.contains(a) != exclude)
        .collect();
    if allowed.is_empty() {
        return Err(Error::Env {
            var: var.into(),
            detail: format!("{list:?} leaves no {kind} (ferroccl has {have})"),
        });
    }
    Ok(allowed)
}

/// Reads an algorithm list in NCCL's syntax (`ring`, `tree`, `ring,tree`, `^tree`;
/// ferroccl also has `oneshot` and `twoshot`): the algorithms the cost model may choose from. NCCL's
/// algorithms that ferroccl does not have (`collnet*`, `nvls*`, `pat`) are accepted and
/// ignored, so an `NCCL_ALGO` meant for NCCL still works; anything else is an error
/// naming it.
pub fn parse_algorithms(var: &str, list: &str) -> Result<Vec<Algorithm>> {
    let names = ("algorithm", "ring, tree, oneshot, twoshot and doubling");
    parse_list(
        var,
        list,
        &Algorithm::ALL,
        names,
        |w| match Algorithm::named(w) {
            Some(a) => Word::Ours(a),
            None if w.starts_with("collnet") || w.starts_with("nvls") || w == "pat" => {
                Word::NcclOnly
            }
            None => Word::Unknown,
        },
    )
}

/// Reads a protocol list in NCCL's syntax (`LL`, `Simple`, `LL,Simple`, `^LL`), with
/// ferroccl's `SingleCopy` (also `single-copy`): the protocols the cost model may
/// choose from. NCCL's `LL128` (which ferroccl does not have) is accepted and ignored;
/// anything else is an error naming it.
pub fn parse_protocols(var: &str, list: &str) -> Result<Vec<Protocol>> {
    let names = ("protocol", "LL, Simple and SingleCopy");
    parse_list(var, list, &Protocol::ALL, names, |w| match w {
        "ll" => Word::Ours(Protocol::LL),
        "simple" => Word::Ours(Protocol::Simple),
        "singlecopy" | "single-copy" | "single_copy" => Word::Ours(Protocol::SingleCopy),
        "ll128" => Word::NcclOnly,
        _ => Word::Unknown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_lists_follow_nccl_syntax() {
        use Algorithm::*;
        assert_eq!(parse_algorithms("X", "tree").unwrap(), [Tree]);
        assert_eq!(parse_algorithms("X", "Ring,Tree").unwrap(), [Ring, Tree]);
        assert_eq!(
            parse_algorithms("X", "^ring").unwrap(),
            [Tree, OneShot, TwoShot, Doubling]
        );
        assert_eq!(parse_algorithms("X", "TwoShot").unwrap(), [TwoShot]);
        assert_eq!(
            parse_algorithms("X", "recursive_doubling,ring").unwrap(),
            [Ring, Doubling]
        );
        assert_eq!(parse_algorithms("X", "nvls,tree").unwrap(), [Tree]);
        assert_eq!(parse_algorithms("X", "^nvls").unwrap(), Algorithm::ALL);
        let err = parse_algorithms("X", "^ring,tree,oneshot,twoshot,doubling")
            .unwrap_err()
            .to_string();
        assert!(err.contains("leaves no algorithm"), "{err}");
        let err = parse_algorithms("X", "butterfly").unwrap_err().to_string();
        assert!(err.contains("butterfly"), "{err}");
    }

    #[test]
    fn protocol_lists_follow_nccl_syntax() {
        use Protocol::*;
        assert_eq!(parse_protocols("X", "LL").unwrap(), [LL]);
        assert_eq!(parse_protocols("X", "simple").unwrap(), [Simple]);
        assert_eq!(parse_protocols("X", "LL128,LL").unwrap(), [LL]);
        assert_eq!(parse_protocols("X", "^LL128").unwrap(), Protocol::ALL);
        assert_eq!(parse_protocols("X", "^ll").unwrap(), [Simple, SingleCopy]);
        assert_eq!(parse_protocols("X", "^SingleCopy").unwrap(), [Simple, LL]);
        assert_eq!(parse_protocols("X", "single-copy").unwrap(), [SingleCopy]);
        let err = parse_protocols("NCCL_PROTO", "^LL,Simple,SingleCopy")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("NCCL_PROTO") && err.contains("leaves no protocol"),
            "{err}"
        );
        let err = parse_protocols("X", "LL256").unwrap_err().to_string();
        assert!(err.contains("unknown protocol \"LL256\""), "{err}");
    }

    #[test]
    fn differing_settings_are_named() {
        let a = CommConfig::default();
        assert_eq!(
            CommConfig::settings_differ(&a.shared_settings(), &a.shared_settings()),
            None
        );
        let b = CommConfig {
            protocols: vec![Protocol::Simple],
            ..a.clone()
        };
        let diff = CommConfig::settings_differ(&a.shared_settings(), &b.shared_settings());
        assert_eq!(
            diff.as_deref(),
            Some("FERROCCL_PROTO: Simple,LL,SingleCopy vs Simple")
        );
    }

    #[test]
    fn dedicated_fifos_are_deeper_and_leave_ring_steps_alone() {
        let c = CommConfig::default();
        assert_eq!((c.slots, c.dedicated_slots), (8, 16));
        assert_eq!(c.dedicated_geometry().slots, 16);
        assert_eq!(c.dedicated_geometry().slot_bytes, c.geometry().slot_bytes);
        // Ring steps are half of the 8-slot FIFO, so every rank cuts a call alike
        // whatever its host gave its FIFOs.
        assert_eq!(c.chunk_bytes, 4 * c.slot_bytes);
        let odd = CommConfig {
            dedicated_slots: 12,
            ..c.clone()
        };
        let err = odd.validate().unwrap_err().to_string();
        assert!(err.contains("FIFO slots 12"), "{err}");
        // A chunk must fit half of the shallower FIFO too.
        let shallow = CommConfig {
            dedicated_slots: 4,
            ..c
        };
        let err = shallow.validate().unwrap_err().to_string();
        assert!(err.contains("4 slots of 131072 bytes"), "{err}");
    }

    #[test]
    fn crowded_fifos_are_short_and_so_are_ring_steps_where_a_host_has_them() {
        let c = CommConfig::default();
        assert_eq!(c.crowded_slots, 2);
        assert_eq!(
            c.crowded_geometry(),
            Geometry {
                slots: 2,
                ..c.geometry()
            }
        );
        // A Simple ring step is half of a crowded FIFO only where some host is crowded;
        // LL and single copy keep theirs.
        assert_eq!(c.chunk_bytes_for(Protocol::Simple, false), 4 * c.slot_bytes);
        assert_eq!(c.chunk_bytes_for(Protocol::Simple, true), c.slot_bytes);
        for p in [Protocol::LL, Protocol::SingleCopy] {
            assert_eq!(c.chunk_bytes_for(p, true), c.chunk_bytes_for(p, false));
        }
        // A smaller chunk than that stays.
        let small = CommConfig {
            chunk_bytes: 8 << 10,
            ..c.clone()
        };
        assert_eq!(small.chunk_bytes_for(Protocol::Simple, true), 8 << 10);
        // Every rank compares the setting, and a FIFO of one slot is refused.
        assert!(c.shared_settings().contains("crowded_slots=2"));
        let one = CommConfig {
            crowded_slots: 1,
            ..c
        };
        let err = one.validate().unwrap_err().to_string();
        assert!(err.contains("FIFO slots 1"), "{err}");
    }

    #[test]
    fn ll_is_checked_and_bounds_its_chunks() {
        let c = CommConfig::default();
        let ll = c.ll_geometry().expect("LL allowed by default");
        assert_eq!(ll.payload(), c.ll_payload_bytes);
        assert_eq!(
            c.chunk_bytes_for(Protocol::LL, false),
            c.ll_slots / 2 * c.ll_payload_bytes
        );
        assert_eq!(c.chunk_bytes_for(Protocol::Simple, false), c.chunk_bytes);
        let simple_only = CommConfig {
            protocols: vec![Protocol::Simple],
            ..c.clone()
        };
        assert_eq!(simple_only.ll_geometry(), None);
        assert_eq!(simple_only.dedicated_ll_geometry(), None);
        // Between ranks that each have a core: more slots of the same payload.
        let dedicated = c.dedicated_ll_geometry().expect("LL allowed by default");
        assert_eq!(
            (dedicated.slots, dedicated.payload(), dedicated.protocol),
            (c.dedicated_ll_slots, ll.payload(), Protocol::LL)
        );
        assert!(c.dedicated_ll_slots > c.ll_slots);
        let odd_slots = CommConfig {
            dedicated_ll_slots: 24,
            ..c.clone()
        };
        let err = odd_slots.validate().unwrap_err().to_string();
        assert!(err.contains("FIFO slots 24"), "{err}");
        let odd = CommConfig {
            ll_payload_bytes: 100,
            ..c
        };
        assert!(
            odd.validate()
                .unwrap_err()
                .to_string()
                .contains("LL slot size 100")
        );
        // Over TCP LL slices go into Simple slots: they must fit, and the LL chunk must
        // fit in half of those FIFOs too.
        let small_slots = CommConfig {
            slot_bytes: 1024,
            chunk_bytes: 2048,
            ..CommConfig::default()
        };
        let err = small_slots.validate().unwrap_err().to_string();
        assert!(
            err.contains("LL slot size 4096") && err.contains("1024"),
            "{err}"
        );
        let few_slots = CommConfig {
            slots: 2,
            chunk_bytes: 128 << 10,
            ..CommConfig::default()
        };
        few_slots.validate().unwrap();
        assert_eq!(few_slots.chunk_bytes_for(Protocol::LL, false), 4096);
    }
}
