//! How calls on device memory are planned: their channel count and cost model, agreed
//! by every rank at initialisation from the GPUs current on the ranks' threads (see
//! [`crate::cuda::tuning`] for the rule).
//!
//! Each rank says which GPU it has (its UUID, SM count and PCI bus id) in the
//! initialisation's all-gather. The ranks of a host then all compute the same link (the
//! worst between any two of their GPUs) and channel count from that list; with several
//! hosts, one more all-gather takes the smallest count and the worst link of all hosts.
//! If any rank had no GPU current at initialisation (its communicator was made before
//! its context), nothing is known of the GPUs: device calls then use 2 channels (NCCL's
//! minimum) and a PCIe cost model, the same on every rank.

use crate::bootstrap::Bootstrap;
use crate::cuda::GpuIdentity;
use crate::cuda::tuning::{self, GpuLink};
use crate::error::{Error, Result};
use crate::tune::{CostModel, LinkCost};

/// Channels of device calls when nothing is known of the GPUs.
const UNKNOWN_GPU_CHANNELS: usize = 2;

/// How calls on device memory are planned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceTuning {
    /// Channels (thread blocks per rank, each with its ring).
    pub channels: usize,
    /// The link that paces device calls (the worst of every host's), when every rank had
    /// a GPU current at initialisation.
    pub link: Option<GpuLink>,
    /// The cost model device calls choose their algorithm and protocol with.
    pub model: CostModel,
}

/// This rank's line in the initialisation's all-gather: its GPU, or `gpu=none`.
pub fn describe(gpu: Option<&GpuIdentity>) -> String {
    match gpu {
        None => "gpu=none".into(),
        Some(g) => format!("gpu={},{},{}", uuid_text(&g.uuid), g.sms, g.bus_id),
    }
}

/// A UUID as the lines carry it: 32 hexadecimal digits.
fn uuid_text(uuid: &[u8; 16]) -> String {
    uuid.iter().map(|b| format!("{b:02x}")).collect()
}

/// A GPU as another rank described it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Described {
    uuid: String,
    sms: usize,
    bus_id: String,
}

fn parse(rank: usize, line: &str) -> Result<Option<Described>> {
    let bad = || Error::invalid(format!("rank {rank}'s GPU line {line:?} is malformed"));
    let value = line.strip_prefix("gpu=").ok_or_else(bad)?;
    if value == "none" {
        return Ok(None);
    }
    let mut parts = value.splitn(3, ',');
    let (Some(uuid), Some(sms), Some(bus_id)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    Ok(Some(Described {
        uuid: uuid.to_string(),
        sms: sms.parse().map_err(|_| bad())?,
        bus_id: bus_id.to_string(),
    }))
}

/// Agrees on the tuning of device calls. `lines`: every rank's [`describe`] line, from
/// the initialisation's all-gather; `hosts[rank]`: each rank's host; `set_channels`:
/// the channel count the configuration forces; `net`: the link between hosts.
/// Collective: every rank of `boot` calls it with the same `lines` and `hosts`.
pub fn agree(
    boot: &Bootstrap,
    lines: &[String],
    hosts: &[usize],
    set_channels: Option<usize>,
    net: LinkCost,
) -> Result<DeviceTuning> {
    let gpus: Vec<Option<Described>> = lines
        .iter()
        .enumerate()
        .map(|(r, l)| parse(r, l))
        .collect::<Result<_>>()?;
    let Some(gpus) = gpus.into_iter().collect::<Option<Vec<Described>>>() else {
        let channels = set_channels.unwrap_or(UNKNOWN_GPU_CHANNELS);
        return Ok(DeviceTuning {
            channels,
            link: None,
            model: tuning::cost_model(GpuLink::Pcie, channels, net),
        });
    };
    let here = hosts[boot.rank()];
    let mine: Vec<&Described> = gpus
        .iter()
        .zip(hosts)
        .filter(|(_, h)| **h == here)
        .map(|(g, _)| g)
        .collect();
    let (mut link, mut channels) = host_proposal(&mine);
    let host_count = hosts.iter().max().map_or(1, |m| m + 1);
    if host_count > 1 {
        let text = format!("{channels},{}", link.code());
        for (r, theirs) in boot.all_gather(text.as_bytes())?.iter().enumerate() {
            let theirs = String::from_utf8_lossy(theirs);
            let bad = || Error::invalid(format!("rank {r}'s device proposal {theirs:?}"));
            let (c, l) = theirs.split_once(',').ok_or_else(bad)?;
            let c: usize = c.parse().map_err(|_| bad())?;
            let l = l
                .parse()
                .ok()
                .and_then(GpuLink::from_code)
                .ok_or_else(bad)?;
            channels = channels.min(c);
            link = link.worse(l);
        }
    }
    let channels = set_channels.unwrap_or(channels);
    tracing::info!(
        "rank {}: device calls use {channels} channels ({} between the GPUs)",
        boot.rank(),
        link.name()
    );
    Ok(DeviceTuning {
        channels,
        link: Some(link),
        model: tuning::cost_model(link, channels, net),
    })
}

/// The link and channel count of one host's ranks, from their GPUs: every rank of the
/// host computes the same.
fn host_proposal(gpus: &[&Described]) -> (GpuLink, usize) {
    let mut distinct: Vec<&Described> = Vec::new();
    for g in gpus {
        if !distinct.iter().any(|d| d.uuid == g.uuid) {
            distinct.push(g);
        }
    }
    let ranks_per_gpu = distinct
        .iter()
        .map(|d| gpus.iter().filter(|g| g.uuid == d.uuid).count())
        .max()
        .unwrap_or(1);
    let sms = gpus.iter().map(|g| g.sms).min().unwrap_or(1);
    let link = if distinct.len() <= 1 {
        GpuLink::SameGpu
    } else {
        let ordinals = visible_gpus();
        let ordinal = |d: &Described| ordinals.iter().find(|(u, _)| *u == d.uuid).map(|x| x.1);
        let mut worst: Option<GpuLink> = None;
        for (i, a) in distinct.iter().enumerate() {
            for b in &distinct[i + 1..] {
                let link = match (ordinal(a), ordinal(b)) {
                    (Some(x), Some(y)) => link_between(x, y, &a.bus_id, &b.bus_id),
                    // A GPU this process cannot see: no P2P with it from here.
                    _ => GpuLink::HostStaged,
                };
                worst = Some(worst.map_or(link, |w| w.worse(link)));
            }
        }
        worst.unwrap_or(GpuLink::SameGpu)
    };
    (link, tuning::default_channels(link, sms, ranks_per_gpu))
}

/// The GPUs this process sees: their UUIDs (as [`describe`] writes them) and ordinals.
fn visible_gpus() -> Vec<(String, usize)> {
    (0..crate::cuda::device_count())
        .filter_map(|o| crate::cuda::gpu_identity(o).ok())
        .map(|g| (uuid_text(&g.uuid), g.ordinal))
        .collect()
}

/// The link between GPUs `a` and `b` of this process (bus ids for NVML's view).
fn link_between(a: usize, b: usize, a_bus: &str, b_bus: &str) -> GpuLink {
    if !crate::cuda::can_access_peer(a, b).unwrap_or(false) {
        return GpuLink::HostStaged;
    }
    if crate::cuda::native_atomics(a, b).unwrap_or(false) {
        GpuLink::NvLink {
            links: nvlinks(a_bus, b_bus).max(1),
        }
    } else {
        GpuLink::Pcie
    }
}

/// Active NVLinks from the GPU at `a_bus` that reach the GPU at `b_bus`, directly or
/// through a switch (a far end that is no GPU); 0 when NVML cannot say.
fn nvlinks(a_bus: &str, b_bus: &str) -> usize {
    let Ok(gpus) = crate::topo::nvml::gpus() else {
        return 0;
    };
    let Some(a) = gpus.iter().find(|g| g.bus_id == a_bus) else {
        return 0;
    };
    a.nvlinks
        .iter()
        .filter(|far| *far == b_bus || !gpus.iter().any(|g| &g.bus_id == *far))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(uuid: u8, sms: usize) -> GpuIdentity {
        GpuIdentity {
            uuid: [uuid; 16],
            ordinal: 0,
            sms,
            bus_id: format!("0000:{uuid:02x}:00.0"),
        }
    }

    #[test]
    fn lines_round_trip_and_bad_ones_are_named() {
        let g = gpu(7, 132);
        let line = describe(Some(&g));
        assert_eq!(
            parse(3, &line).unwrap(),
            Some(Described {
                uuid: "07".repeat(16),
                sms: 132,
                bus_id: "0000:07:00.0".into()
            })
        );
        assert_eq!(parse(0, "gpu=none").unwrap(), None);
        let err = parse(2, "gpu=abc").unwrap_err().to_string();
        assert!(err.contains("rank 2"), "{err}");
        assert!(parse(1, "cpu=1").is_err());
    }

    #[test]
    fn ranks_on_one_gpu_share_it() {
        let a = parse(0, &describe(Some(&gpu(1, 132)))).unwrap().unwrap();
        let (link, channels) = host_proposal(&[&a, &a, &a]);
        assert_eq!(link, GpuLink::SameGpu);
        assert_eq!(channels, 2);
        // A small GPU shared by three ranks: an eighth of 16 SMs, split three ways.
        let small = parse(0, &describe(Some(&gpu(1, 16)))).unwrap().unwrap();
        assert_eq!(host_proposal(&[&small, &small, &small]).1, 1);
    }
}
