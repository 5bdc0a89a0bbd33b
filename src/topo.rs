//! What the machine and the job look like: which ranks share a host, and on this host
//! its NUMA nodes, CPUs and network interfaces (from sysfs). Rings and trees are built
//! from the host grouping ([`host_labels`]); the rest is for people and tools:
//! `FERROCCL_TOPO_DUMP_FILE` writes it as JSON when a communicator is made, and
//! `ferroccl-topo` prints it with the rings and trees a job would use.
//!
//! GPUs and NVLink are not detected yet (no CUDA path exists to use them).

use std::path::Path;

use crate::bootstrap::PeerInfo;
use crate::error::{Error, Result};

/// Host labels for ranks: ranks with the same [`PeerInfo::host_id`] get the same label,
/// hosts numbered in order of their first rank.
pub fn host_labels(peers: &[PeerInfo]) -> Vec<usize> {
    let mut ids: Vec<&str> = Vec::new();
    peers
        .iter()
        .map(|p| match ids.iter().position(|h| *h == p.host_id) {
            Some(i) => i,
            None => {
                ids.push(&p.host_id);
                ids.len() - 1
            }
        })
        .collect()
}

/// One NUMA node of this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    /// Its number.
    pub id: usize,
    /// Its CPUs.
    pub cpus: Vec<usize>,
}

/// One network interface of this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nic {
    /// Interface name.
    pub name: String,
    /// Link speed in Mbit/s, when the driver reports one.
    pub speed_mbps: Option<u64>,
    /// Whether it is an InfiniBand/RoCE device (listed in `/sys/class/infiniband`).
    pub rdma: bool,
    /// PCI address, for devices on a PCI bus.
    pub pci: Option<String>,
}

/// This host, as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostTopology {
    /// Host name.
    pub hostname: String,
    /// NUMA nodes (one node with every CPU when the kernel has no NUMA).
    pub numa: Vec<NumaNode>,
    /// Network interfaces that are up, loopback excluded.
    pub nics: Vec<Nic>,
}

/// Parses a sysfs CPU list (`0-3,8,10-11`).
pub fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

fn read(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

impl HostTopology {
    /// Reads this host's topology from `/sys`.
    pub fn detect() -> Self {
        let mut numa: Vec<NumaNode> = std::fs::read_dir("/sys/devices/system/node")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let id = name.strip_prefix("node")?.parse().ok()?;
                let cpus = parse_cpu_list(&read(e.path().join("cpulist"))?);
                Some(NumaNode { id, cpus })
            })
            .collect();
        numa.sort_by_key(|n| n.id);
        if numa.is_empty() {
            let cpus = read("/sys/devices/system/cpu/online")
                .map(|t| parse_cpu_list(&t))
                .unwrap_or_default();
            numa.push(NumaNode { id: 0, cpus });
        }
        let rdma: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                // The netdev behind an RDMA device, when it has one.
                let dir = e.path().join("device").join("net");
                std::fs::read_dir(dir)
                    .ok()?
                    .flatten()
                    .next()
                    .and_then(|n| n.file_name().into_string().ok())
            })
            .collect();
        let mut nics: Vec<Nic> = std::fs::read_dir("/sys/class/net")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let dir = e.path();
                if name == "lo" || read(dir.join("operstate")).as_deref() == Some("down") {
                    return None;
                }
                let speed_mbps = read(dir.join("speed"))
                    .and_then(|s| s.parse::<i64>().ok())
                    .filter(|&s| s > 0)
                    .map(|s| s as u64);
                let pci = std::fs::read_link(dir.join("device"))
                    .ok()
                    .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
                    .filter(|f| f.contains(':'));
                Some(Nic {
                    rdma: rdma.contains(&name),
                    name,
                    speed_mbps,
                    pci,
                })
            })
            .collect();
        nics.sort_by(|a, b| a.name.cmp(&b.name));
        HostTopology {
            hostname: crate::bootstrap::hostname(),
            numa,
            nics,
        }
    }

    /// As JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "hostname": self.hostname,
            "numa": self.numa.iter().map(|n| serde_json::json!({"id": n.id, "cpus": n.cpus})).collect::<Vec<_>>(),
            "nics": self.nics.iter().map(|n| serde_json::json!({
                "name": n.name, "speed_mbps": n.speed_mbps, "rdma": n.rdma, "pci": n.pci,
            })).collect::<Vec<_>>(),
        })
    }
}

/// A job's topology: its ranks grouped by host, this host's details, and the rings and
/// trees built from them.
pub fn job_json(peers: &[PeerInfo], rings: &[Vec<usize>]) -> serde_json::Value {
    let hosts = host_labels(peers);
    let trees: Vec<serde_json::Value> = (0..2)
        .map(|which| {
            let t = crate::plan::tree::RankTree::new(&hosts, which);
            serde_json::json!({ "parent": t.parent, "children": t.children })
        })
        .collect();
    serde_json::json!({
        "ranks": peers.iter().map(|p| serde_json::json!({
            "rank": p.rank, "host": hosts[p.rank], "hostname": p.hostname, "pid": p.pid,
            "addrs": p.addrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "this_host": HostTopology::detect().to_json(),
        "rings": rings,
        "trees": trees,
    })
}

/// Writes [`job_json`] to `FERROCCL_TOPO_DUMP_FILE` if it is set (rank 0 writes the
/// file; other ranks write `FILE.rankN`).
pub fn dump_from_env(rank: usize, peers: &[PeerInfo], rings: &[Vec<usize>]) -> Result<()> {
    let Ok(path) = std::env::var("FERROCCL_TOPO_DUMP_FILE") else {
        return Ok(());
    };
    let path = if rank == 0 {
        path
    } else {
        format!("{path}.rank{rank}")
    };
    let text = serde_json::to_string_pretty(&job_json(peers, rings))
        .map_err(|e| Error::invalid(format!("topology JSON: {e}")))?;
    std::fs::write(&path, text).map_err(|e| Error::io(format!("write {path}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_and_this_host() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        let t = HostTopology::detect();
        let cpus: usize = t.numa.iter().map(|n| n.cpus.len()).sum();
        assert_eq!(cpus, std::thread::available_parallelism().unwrap().get());
        assert!(t.nics.iter().all(|n| n.name != "lo"));
    }

    #[test]
    fn hosts_are_labelled_in_order_of_first_rank() {
        let peer = |rank, host: &str| PeerInfo {
            rank,
            world_size: 4,
            hostname: host.into(),
            host_id: host.into(),
            pid: 1,
            addrs: vec![],
        };
        let peers = [peer(0, "b"), peer(1, "a"), peer(2, "b"), peer(3, "a")];
        assert_eq!(host_labels(&peers), [0, 1, 0, 1]);
        // Round-robin ranks: the rings still visit each host once.
        let rings = crate::plan::PlanOptions::for_hosts(&host_labels(&peers), 2, 1).rings;
        assert_eq!(rings, [vec![0, 2, 1, 3], vec![3, 1, 2, 0]]);
    }
}
