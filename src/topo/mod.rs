//! What the machine and the job look like: which ranks share a host, and on this host
//! its NUMA nodes, CPUs, network interfaces, GPUs and the PCI tree joining them (from
//! sysfs, and NVML for GPUs and NVLink when an NVIDIA driver is installed). Rings and
//! trees are built from the host grouping ([`host_labels`]); the rest is for people and
//! tools: `FERROCCL_TOPO_DUMP_FILE` writes it as JSON when a communicator is made, and
//! `ferroccl-topo` prints it with the rings and trees a job would use.

pub mod nvml;
pub mod pci;

use std::path::Path;

use pci::{PciDevice, PciDistance};

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
    /// The root complex and bridges above it, for devices on a PCI bus.
    pub pci_path: Vec<String>,
}

/// One GPU of this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// PCI address.
    pub pci: String,
    /// Product name (from NVML; empty when only sysfs saw it).
    pub name: String,
    /// NUMA node it is attached to.
    pub numa_node: Option<usize>,
    /// The root complex and bridges above it.
    pub pci_path: Vec<String>,
    /// For each active NVLink, the PCI address at its far end (a GPU or an NVSwitch).
    pub nvlinks: Vec<String>,
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
    /// GPUs (NVIDIA ones through NVML when it loads, otherwise as sysfs lists them).
    pub gpus: Vec<Gpu>,
    /// Why NVML gave nothing, when it did not (no library, no driver).
    pub nvml_note: Option<String>,
}

/// Pins the calling thread to `cpu` (threads it starts afterwards inherit that).
pub fn pin_thread_to(cpu: usize) -> Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(Error::invalid(format!("CPU {cpu} is past CPU_SETSIZE")));
    }
    // SAFETY: `cpu` is below CPU_SETSIZE (checked), inside the set.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: sched_setaffinity reads `set`, which lives for the call, for its size.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(Error::io(
            format!("pin a thread to CPU {cpu}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The CPUs this process may run on, in order.
pub fn available_cpus() -> Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity writes at most `size_of::<cpu_set_t>()` bytes into `set`,
    // which lives for the call.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(Error::io(
            "read this process's CPUs",
            std::io::Error::last_os_error(),
        ));
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE, inside the set.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// The CPU (an index among `cpus`) of local rank `rank` of `ranks` placed in blocks:
/// `⌊rank·cpus/max(ranks, cpus)⌋`, one CPU each, or blocks of consecutive ranks where
/// they outnumber the CPUs (Slurm's block distribution). `ferrorun` and the perf tools
/// bind ranks so (`launch::CpuBind::Auto`), and the cost model prices ranks that share a
/// CPU by it.
pub fn cpu_in_blocks(rank: usize, ranks: usize, cpus: usize) -> usize {
    rank * cpus / ranks.max(cpus).max(1)
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
                // The PCI function the interface belongs to: the device itself, or
                // the nearest PCI device above it (a virtio NIC hangs below one).
                let pci = std::fs::canonicalize(dir.join("device"))
                    .ok()
                    .and_then(|p| {
                        p.to_string_lossy()
                            .split('/')
                            .rfind(|c| pci::is_pci_addr(c))
                            .map(str::to_string)
                    });
                let pci_path = pci
                    .as_deref()
                    .and_then(pci::device)
                    .map(|d| d.path)
                    .unwrap_or_default();
                Some(Nic {
                    rdma: rdma.contains(&name),
                    name,
                    speed_mbps,
                    pci,
                    pci_path,
                })
            })
            .collect();
        nics.sort_by(|a, b| a.name.cmp(&b.name));
        let (gpus, nvml_note) = detect_gpus();
        HostTopology {
            hostname: crate::bootstrap::hostname(),
            numa,
            nics,
            gpus,
            nvml_note,
        }
    }

    /// How far apart each pair of GPUs and NICs is on the PCI tree (rows and columns:
    /// the GPUs, then the NICs; `None` where either is not on PCI), as `nvidia-smi topo
    /// -m` shows it. Two GPUs joined by NVLink are `"NV<links>"`.
    pub fn distance_matrix(&self) -> (Vec<String>, Vec<Vec<String>>) {
        let mut names: Vec<String> = Vec::new();
        let mut paths: Vec<Option<&[String]>> = Vec::new();
        for (i, g) in self.gpus.iter().enumerate() {
            names.push(format!("GPU{i}"));
            paths.push(Some(&g.pci_path));
        }
        for n in &self.nics {
            names.push(n.name.clone());
            paths.push(n.pci.as_ref().map(|_| n.pci_path.as_slice()));
        }
        let cell = |a: usize, b: usize| -> String {
            if a == b {
                return "X".into();
            }
            if let (Some(ga), Some(gb)) = (self.gpus.get(a), self.gpus.get(b)) {
                let links = ga.nvlinks.iter().filter(|p| **p == gb.pci).count();
                if links > 0 {
                    return format!("NV{links}");
                }
            }
            match (paths[a], paths[b]) {
                (Some(pa), Some(pb)) => pci::distance(pa, pb).name().into(),
                _ => "-".into(),
            }
        };
        let rows = (0..names.len())
            .map(|a| (0..names.len()).map(|b| cell(a, b)).collect())
            .collect();
        (names, rows)
    }

    /// As JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let (names, rows) = self.distance_matrix();
        serde_json::json!({
            "hostname": self.hostname,
            "numa": self.numa.iter().map(|n| serde_json::json!({"id": n.id, "cpus": n.cpus})).collect::<Vec<_>>(),
            "nics": self.nics.iter().map(|n| serde_json::json!({
                "name": n.name, "speed_mbps": n.speed_mbps, "rdma": n.rdma, "pci": n.pci,
                "pci_path": n.pci_path,
            })).collect::<Vec<_>>(),
            "gpus": self.gpus.iter().map(|g| serde_json::json!({
                "pci": g.pci, "name": g.name, "numa_node": g.numa_node,
                "pci_path": g.pci_path, "nvlinks": g.nvlinks,
            })).collect::<Vec<_>>(),
            "nvml": self.nvml_note.as_deref().unwrap_or("loaded"),
            "distances": { "devices": names, "matrix": rows },
        })
    }
}

/// GPUs from NVML when it loads, else NVIDIA display/3D devices from sysfs.
fn detect_gpus() -> (Vec<Gpu>, Option<String>) {
    let from_sysfs = |addr: &str| pci::device(addr);
    match nvml::gpus() {
        Ok(list) => {
            let gpus = list
                .into_iter()
                .map(|g| {
                    let dev: Option<PciDevice> = from_sysfs(&g.bus_id);
                    Gpu {
                        numa_node: dev.as_ref().and_then(|d| d.numa_node),
                        pci_path: dev.map(|d| d.path).unwrap_or_default(),
                        pci: g.bus_id,
                        name: g.name,
                        nvlinks: g.nvlinks,
                    }
                })
                .collect();
            (gpus, None)
        }
        Err(why) => {
            let gpus = pci::devices_of_class(&[0x03])
                .into_iter()
                .filter(|d| d.vendor == 0x10de)
                .map(|d| Gpu {
                    pci: d.addr,
                    name: String::new(),
                    numa_node: d.numa_node,
                    pci_path: d.path,
                    nvlinks: Vec::new(),
                })
                .collect();
            (gpus, Some(why))
        }
    }
}

/// Whether GPUDirect RDMA is possible here, i.e. whether a NIC may read and write GPU
/// memory: `Ok` names the kernel module that provides it (`nvidia_peermem`, or the older
/// `nv_peer_mem`), `Err` says why not. ferroccl only reports it: its device path does
/// not cross hosts yet, so device buffers never reach an RDMA NIC.
pub fn gpudirect_rdma() -> std::result::Result<&'static str, String> {
    gpudirect_rdma_in(std::path::Path::new("/sys/module"))
}

fn gpudirect_rdma_in(modules: &std::path::Path) -> std::result::Result<&'static str, String> {
    for module in ["nvidia_peermem", "nv_peer_mem"] {
        if modules.join(module).exists() {
            return Ok(module);
        }
    }
    Err(if modules.join("nvidia").exists() {
        "the NVIDIA driver is loaded but nvidia_peermem is not (modprobe nvidia_peermem)".into()
    } else {
        "no NVIDIA driver loaded".into()
    })
}

/// The nearest NIC to a device on the PCI tree, by [`PciDistance`].
pub fn nearest_nic<'a>(nics: &'a [Nic], device_path: &[String]) -> Option<(&'a Nic, PciDistance)> {
    nics.iter()
        .filter(|n| n.pci.is_some())
        .map(|n| (n, pci::distance(device_path, &n.pci_path)))
        .min_by_key(|(_, d)| *d)
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
    fn a_thread_pins_to_a_cpu_it_may_use_and_not_past_the_set() {
        let cpu = available_cpus().unwrap()[0];
        let pinned = std::thread::spawn(move || {
            pin_thread_to(cpu).unwrap();
            available_cpus().unwrap()
        });
        assert_eq!(pinned.join().unwrap(), [cpu]);
        let err = pin_thread_to(libc::CPU_SETSIZE as usize).unwrap_err();
        assert!(err.to_string().contains("past CPU_SETSIZE"), "{err}");
    }

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
    fn distance_matrix_shows_nvlinks_and_pci_paths() {
        let path = |s: &str| pci::bridges_of(s);
        let gpu = |addr: &str, p: &str, links: &[&str]| Gpu {
            pci: addr.into(),
            name: "GPU".into(),
            numa_node: Some(0),
            pci_path: path(p),
            nvlinks: links.iter().map(|l| l.to_string()).collect(),
        };
        let host = HostTopology {
            hostname: "h".into(),
            numa: vec![],
            nics: vec![Nic {
                name: "ib0".into(),
                speed_mbps: Some(400_000),
                rdma: true,
                pci: Some("0000:05:00.0".into()),
                pci_path: path(
                    "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:05:00.0",
                ),
            }],
            gpus: vec![
                gpu(
                    "0000:03:00.0",
                    "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0",
                    &["0000:81:00.0", "0000:81:00.0"],
                ),
                gpu(
                    "0000:81:00.0",
                    "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0",
                    &[],
                ),
            ],
            nvml_note: None,
        };
        let (names, rows) = host.distance_matrix();
        assert_eq!(names, ["GPU0", "GPU1", "ib0"]);
        assert_eq!(rows[0], ["X", "NV2", "PXB"]);
        assert_eq!(rows[1], ["SYS", "X", "SYS"]);
        let (nic, d) = nearest_nic(&host.nics, &host.gpus[0].pci_path).unwrap();
        assert_eq!((nic.name.as_str(), d), ("ib0", PciDistance::Pxb));
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

    #[test]
    fn gpudirect_rdma_is_found_by_its_kernel_module() {
        let dir = tempfile::tempdir().unwrap();
        let e = gpudirect_rdma_in(dir.path()).unwrap_err();
        assert!(e.contains("no NVIDIA driver"), "{e}");
        std::fs::create_dir(dir.path().join("nvidia")).unwrap();
        let e = gpudirect_rdma_in(dir.path()).unwrap_err();
        assert!(e.contains("modprobe nvidia_peermem"), "{e}");
        std::fs::create_dir(dir.path().join("nvidia_peermem")).unwrap();
        assert_eq!(gpudirect_rdma_in(dir.path()), Ok("nvidia_peermem"));
    }
}
