//! Defaults for calls on device memory: how many channels (thread blocks of the executor
//! per rank, each with its own ring) they use, and what the cost model assumes of the
//! link between the GPUs, both from the device when `FERROCCL_NCHANNELS` does not say.
//!
//! One executor block (256 threads) moves on the order of [`BLOCK_GBPS`] through its
//! FIFOs; one channel is therefore far from what NVLink carries (an H100 has 18 links of
//! about 20.6 GB/s each way, NCCL's `SM90_NVLINK_BW`), while two already fill a PCIe
//! link. NCCL reaches the same conclusion by search: it looks for as many rings as the
//! links hold at a per-channel speed from a table (`sm90SpeedArrayIntra`, 60 down to
//! 3 GB/s), and ends with 16 to 32 channels on NVLink machines and 2 on PCIe ones (its
//! minimum). ferroccl computes the count directly:
//!
//! `channels = ⌈link GB/s ÷ BLOCK_GBPS⌉`, at least 2 and at most 32 (2 for ranks that
//! share one GPU, whose blocks compete for its SMs), and at most an eighth of the GPU's
//! SMs divided among the ranks that share the GPU (the rest of the GPU stays the
//! application's).
//!
//! The link is the worst between any two ranks' GPUs of a host: two ranks on one GPU,
//! NVLink (peer access with native atomics, which PCIe P2P lacks; its link count from
//! NVML where NVML is there, else counted as one), PCIe peer access, or no P2P (FIFOs
//! staged through page-locked host memory). Every rank of the communicator then takes the
//! smallest count any rank proposes, so that all run the same rings.
//!
//! [`BLOCK_GBPS`] and the latencies below are estimates from the kernel's design and
//! NCCL's tuning table, not measurements: no GPU has run ferroccl yet. A lent machine
//! checks them with `all_reduce_perf --memory cuda` and `FERROCCL_NCHANNELS`.

use crate::tune::{CostModel, LinkCost};

/// GB/s one executor block is assumed to move.
pub const BLOCK_GBPS: f64 = 20.0;

/// Most channels a device call uses by default.
pub const MAX_CHANNELS: usize = 32;

/// What connects the GPUs of a communicator's ranks on one host (the worst pair's link).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuLink {
    /// No P2P: FIFOs staged through page-locked host memory (two PCIe crossings).
    HostStaged,
    /// Peer access over PCIe.
    Pcie,
    /// Peer access over NVLink, with this many links (1 when NVML cannot say).
    NvLink {
        /// Active links between the two GPUs (through NVSwitch: the GPU's links).
        links: usize,
    },
    /// Every rank of the host on one GPU (or a single rank): the FIFOs are in its memory.
    SameGpu,
}

impl GpuLink {
    /// Bandwidth one way, GB/s: NVLink 20.6 per link (NCCL's `SM90_NVLINK_BW`), PCIe
    /// 24 (Gen4 x16 as NCCL's topology counts it), staged 12 (each byte crosses PCIe
    /// twice), one GPU's own memory 200 (far more than the blocks move).
    pub fn gbps(self) -> f64 {
        match self {
            GpuLink::HostStaged => 12.0,
            GpuLink::Pcie => 24.0,
            GpuLink::NvLink { links } => 20.6 * links.max(1) as f64,
            GpuLink::SameGpu => 200.0,
        }
    }

    /// Per-hop latency with Simple and with LL, µs: of the order NCCL's tuning table
    /// (`hwLat`, ring) gives, NVLink about 0.6 (LL) and 3.4 (Simple), PCI 1.0 and 5.7;
    /// staged through host memory, each hand-off is a PCIe round trip more.
    fn alpha_us(self) -> (f64, f64) {
        match self {
            GpuLink::HostStaged => (8.0, 2.0),
            GpuLink::Pcie => (5.7, 1.0),
            GpuLink::NvLink { .. } | GpuLink::SameGpu => (3.4, 0.6),
        }
    }

    /// Short name for logs and tables.
    pub fn name(self) -> String {
        match self {
            GpuLink::HostStaged => "staged through host memory".into(),
            GpuLink::Pcie => "PCIe P2P".into(),
            GpuLink::NvLink { links } => format!("NVLink x{links}"),
            GpuLink::SameGpu => "one GPU".into(),
        }
    }

    /// The worse of two links (the one that paces a ring through both).
    pub fn worse(self, other: GpuLink) -> GpuLink {
        if other.gbps() < self.gbps() {
            other
        } else {
            self
        }
    }

    /// A number for exchanging it between ranks ([`GpuLink::from_code`] reads it).
    pub fn code(self) -> u64 {
        match self {
            GpuLink::HostStaged => 0,
            GpuLink::Pcie => 1,
            GpuLink::SameGpu => 2,
            GpuLink::NvLink { links } => 3 + links as u64,
        }
    }

    /// The link [`GpuLink::code`] gave `code` (`None` for a number it never gives).
    pub fn from_code(code: u64) -> Option<GpuLink> {
        Some(match code {
            0 => GpuLink::HostStaged,
            1 => GpuLink::Pcie,
            2 => GpuLink::SameGpu,
            c if c <= 3 + 64 => GpuLink::NvLink {
                links: (c - 3) as usize,
            },
            _ => return None,
        })
    }
}

/// The default channel count of device calls over `link` on GPUs of `sms` SMs shared by
/// at most `ranks_per_gpu` ranks (see the module's description).
pub fn default_channels(link: GpuLink, sms: usize, ranks_per_gpu: usize) -> usize {
    let sm_share = (sms / 8 / ranks_per_gpu.max(1)).max(1);
    let wanted = match link {
        // Ranks on one GPU share its SMs (and, without MPS, take turns on it): more
        // blocks would only compete.
        GpuLink::SameGpu => 2,
        _ => ((link.gbps() / BLOCK_GBPS).ceil() as usize).clamp(2, MAX_CHANNELS),
    };
    wanted.min(sm_share)
}

/// The cost model of device calls over `link` with `channels` channels: inside a host,
/// the link's latency and the smaller of its bandwidth and what the blocks move; LL a
/// third of that (it carries 8 bytes of data per 16-byte line, and its flags are polled
/// line by line: NCCL's tuning model gives LL a third of Simple's bandwidth inside a
/// node); between hosts, `net` as for host calls.
pub fn cost_model(link: GpuLink, channels: usize, net: LinkCost) -> CostModel {
    let gbps = link.gbps().min(channels as f64 * BLOCK_GBPS);
    let (simple_us, ll_us) = link.alpha_us();
    CostModel {
        local: LinkCost::new(simple_us, gbps),
        local_ll: LinkCost::new(ll_us, gbps / 3.0),
        // Device calls never read a peer's buffer from the host (their planner offers
        // no single copy); the entries only keep the model whole.
        local_single: LinkCost::new(simple_us, gbps),
        local_in_place: LinkCost::new(simple_us, gbps),
        net,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_follow_the_link_and_leave_most_of_the_gpu() {
        // H100 SXM: 18 NVLinks, 132 SMs, one rank per GPU: 371 GB/s needs 19 blocks.
        assert_eq!(default_channels(GpuLink::NvLink { links: 18 }, 132, 1), 16);
        assert_eq!(default_channels(GpuLink::NvLink { links: 18 }, 1024, 1), 19);
        // PCIe and staged links: NCCL's minimum of 2.
        assert_eq!(default_channels(GpuLink::Pcie, 132, 1), 2);
        assert_eq!(default_channels(GpuLink::HostStaged, 132, 1), 2);
        // A small GPU, or one shared by 4 ranks: an eighth of its SMs each.
        assert_eq!(default_channels(GpuLink::NvLink { links: 4 }, 24, 1), 3);
        assert_eq!(default_channels(GpuLink::SameGpu, 132, 4), 2);
        assert_eq!(default_channels(GpuLink::SameGpu, 16, 4), 1);
        // Never above 32.
        assert_eq!(default_channels(GpuLink::NvLink { links: 64 }, 4096, 1), 32);
    }

    #[test]
    fn links_round_trip_through_their_codes_and_the_worse_paces() {
        for link in [
            GpuLink::HostStaged,
            GpuLink::Pcie,
            GpuLink::SameGpu,
            GpuLink::NvLink { links: 1 },
            GpuLink::NvLink { links: 18 },
        ] {
            assert_eq!(GpuLink::from_code(link.code()), Some(link));
        }
        assert_eq!(GpuLink::from_code(1000), None);
        let nvlink = GpuLink::NvLink { links: 4 };
        assert_eq!(nvlink.worse(GpuLink::Pcie), GpuLink::Pcie);
        assert_eq!(GpuLink::HostStaged.worse(nvlink), GpuLink::HostStaged);
    }

    #[test]
    fn the_cost_model_is_capped_by_the_blocks_and_ll_is_slower_per_byte() {
        let net = LinkCost::new(30.0, 1.6);
        let m = cost_model(GpuLink::NvLink { links: 18 }, 2, net);
        assert_eq!(m.local.beta, 40e9);
        assert!((m.local_ll.beta - 40e9 / 3.0).abs() < 1.0);
        assert!(m.local_ll.alpha < m.local.alpha);
        assert_eq!(m.net, net);
        let m = cost_model(GpuLink::Pcie, 16, net);
        assert_eq!(m.local.beta, 24e9);
    }
}
