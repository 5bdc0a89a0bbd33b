//! The PCI tree from sysfs: where each device of interest (NICs, GPUs) hangs, and how
//! far apart two of them are, in NCCL's path vocabulary.
//!
//! `/sys/bus/pci/devices/ADDR` links to `/sys/devices/pciDDDD:BB/BRIDGE/.../ADDR`: the
//! components between the root complex and the device are the bridges (PCIe switch
//! ports, root ports) above it. Two devices under the same last bridge share a switch
//! (`PIX`); under a common bridge higher up, several switches (`PXB`); only the root
//! complex in common, a host bridge (`PHB`); different root complexes, the CPU
//! interconnect between them (`SYS`).

use std::path::Path;

/// One PCI device, with the bridges above it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciDevice {
    /// Its address (`0000:3b:00.0`).
    pub addr: String,
    /// Class code (`0x020000` Ethernet, `0x020700` InfiniBand, `0x030200` 3D controller).
    pub class: u32,
    /// Vendor id (`0x10de` NVIDIA, `0x15b3` Mellanox).
    pub vendor: u16,
    /// NUMA node the device is attached to, when the kernel knows.
    pub numa_node: Option<usize>,
    /// The root complex (`pci0000:00`), then each bridge down to the device's parent.
    pub path: Vec<String>,
}

/// How far apart two PCI devices are (NCCL's path types, nearest first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PciDistance {
    /// Behind the same bridge (one PCIe switch).
    Pix,
    /// Behind a common bridge further up (several switches).
    Pxb,
    /// Only the root complex in common.
    Phb,
    /// Different root complexes (across the CPU interconnect).
    Sys,
}

impl PciDistance {
    /// NCCL's name for it.
    pub fn name(self) -> &'static str {
        match self {
            PciDistance::Pix => "PIX",
            PciDistance::Pxb => "PXB",
            PciDistance::Phb => "PHB",
            PciDistance::Sys => "SYS",
        }
    }
}

/// Whether `s` looks like a PCI address (`DDDD:BB:DD.F`).
pub fn is_pci_addr(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// Splits a resolved sysfs device path into the root complex and the bridges above the
/// device (the device itself excluded).
pub fn bridges_of(resolved: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in resolved.split('/') {
        if part.starts_with("pci") && part.contains(':') {
            out.clear();
            out.push(part.to_string());
        } else if is_pci_addr(part) && !out.is_empty() {
            out.push(part.to_string());
        }
    }
    out.pop(); // the device itself
    out
}

/// How far apart two devices are, from their bridge paths.
pub fn distance(a: &[String], b: &[String]) -> PciDistance {
    if a.first() != b.first() || a.is_empty() {
        return PciDistance::Sys;
    }
    if a.len() > 1 && a == b {
        return PciDistance::Pix;
    }
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if common > 1 {
        PciDistance::Pxb
    } else {
        PciDistance::Phb
    }
}

fn read_hex(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    u64::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// Reads one device from `/sys/bus/pci/devices/ADDR`.
pub fn device(addr: &str) -> Option<PciDevice> {
    let dir = Path::new("/sys/bus/pci/devices").join(addr);
    let resolved = std::fs::canonicalize(&dir).ok()?;
    let numa_node = std::fs::read_to_string(dir.join("numa_node"))
        .ok()
        .and_then(|t| t.trim().parse::<i64>().ok())
        .filter(|&n| n >= 0)
        .map(|n| n as usize);
    Some(PciDevice {
        addr: addr.to_string(),
        class: read_hex(&dir.join("class"))? as u32,
        vendor: read_hex(&dir.join("vendor"))? as u16,
        numa_node,
        path: bridges_of(&resolved.to_string_lossy()),
    })
}

/// Every PCI device whose class starts with one of `class_prefixes` (the top byte:
/// `0x02` network, `0x03` display/3D).
pub fn devices_of_class(class_prefixes: &[u8]) -> Vec<PciDevice> {
    let mut out: Vec<PciDevice> = std::fs::read_dir("/sys/bus/pci/devices")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| device(&e.file_name().into_string().ok()?))
        .filter(|d| class_prefixes.contains(&((d.class >> 16) as u8)))
        .collect();
    out.sort_by(|a, b| a.addr.cmp(&b.addr));
    out
}

/// Normalises a PCI bus id as drivers print it (`00000000:3B:00.0`, `0000:3b:00.0`) to
/// sysfs's form (`0000:3b:00.0`).
pub fn normalise_bus_id(id: &str) -> String {
    let id = id.trim().trim_end_matches('\0').to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(s: &str) -> Vec<String> {
        bridges_of(s)
    }

    #[test]
    fn bridges_come_from_the_resolved_sysfs_path() {
        assert_eq!(
            path("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0"),
            ["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:08.0"]
        );
        // A virtio NIC: the device is the PCI function, the rest is below it.
        assert_eq!(
            path("/sys/devices/pci0000:00/0000:00:03.0/virtio2"),
            ["pci0000:00"]
        );
        assert!(is_pci_addr("0000:3b:00.0"));
        assert!(!is_pci_addr("pci0000:00"));
        assert!(!is_pci_addr("virtio2"));
    }

    #[test]
    fn distances_follow_nccls_path_types() {
        let gpu0 =
            path("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0");
        let gpu1 =
            path("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:04:00.0");
        let nic =
            path("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:05:00.0");
        let same_root = path("/sys/devices/pci0000:00/0000:00:02.0/0000:06:00.0");
        let other_socket = path("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0");
        assert_eq!(distance(&gpu0, &gpu1), PciDistance::Pix);
        assert_eq!(distance(&gpu0, &nic), PciDistance::Pxb);
        assert_eq!(distance(&gpu0, &same_root), PciDistance::Phb);
        assert_eq!(distance(&gpu0, &other_socket), PciDistance::Sys);
        assert!(PciDistance::Pix < PciDistance::Sys);
    }

    #[test]
    fn bus_ids_are_normalised_to_sysfs_form() {
        assert_eq!(normalise_bus_id("00000000:3B:00.0\0\0"), "0000:3b:00.0");
        assert_eq!(normalise_bus_id("0000:3b:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn this_hosts_devices_are_read() {
        // Whatever this machine has, every device found is one sysfs lists, with a
        // root complex at the top of its path.
        for d in devices_of_class(&[0x02, 0x03]) {
            assert!(is_pci_addr(&d.addr), "{d:?}");
            assert!(
                d.path.first().is_some_and(|p| p.starts_with("pci")),
                "{d:?}"
            );
        }
    }
}
