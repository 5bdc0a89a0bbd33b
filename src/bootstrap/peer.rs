//! [`PeerInfo`]: what every rank tells every other rank at bootstrap, and how a host is
//! identified.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};
use crate::store::wire::{Cursor, Writer};

/// Longest hostname or host id accepted from a peer.
const MAX_NAME: usize = 4096;
/// Most addresses accepted from a peer.
const MAX_ADDRS: usize = 256;

/// One rank's facts, gathered by every rank at bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank these facts are about.
    pub rank: usize,
    /// The world size that rank was started with (checked to agree across ranks).
    pub world_size: usize,
    /// The host's name (`/proc/sys/kernel/hostname`).
    pub hostname: String,
    /// What makes two ranks "on the same host": see [`host_id`].
    pub host_id: String,
    /// Process id.
    pub pid: u32,
    /// The addresses the rank can be reached at, best first.
    pub addrs: Vec<IpAddr>,
}

impl PeerInfo {
    /// The facts about the calling process as `rank` of `world_size`.
    pub fn local(rank: usize, world_size: usize, addrs: Vec<IpAddr>) -> Self {
        PeerInfo {
            rank,
            world_size,
            hostname: hostname(),
            host_id: host_id(),
            pid: std::process::id(),
            addrs,
        }
    }

    /// A 64-bit hash of [`PeerInfo::host_id`] (FNV-1a), cheap to compare.
    pub fn host_hash(&self) -> u64 {
        host_hash_of(&self.host_id)
    }

    /// Encodes the facts for the store.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.rank as u64)
            .u64(self.world_size as u64)
            .bytes(self.hostname.as_bytes())
            .bytes(self.host_id.as_bytes())
            .u32(self.pid)
            .u64(self.addrs.len() as u64);
        for addr in &self.addrs {
            match addr {
                IpAddr::V4(v4) => w.u8(4).bytes(&v4.octets()),
                IpAddr::V6(v6) => w.u8(6).bytes(&v6.octets()),
            };
        }
        w.into_vec()
    }

    /// Decodes what rank `from` published.
    pub fn decode(from: usize, bytes: &[u8]) -> Result<Self> {
        let bad = |detail: String| Error::BootstrapData { rank: from, detail };
        let mut c = Cursor::new(bytes);
        let mut parse = || -> std::result::Result<PeerInfo, String> {
            let e = |e| format!("{e:?}");
            let rank = c.u64().map_err(e)? as usize;
            let world_size = c.u64().map_err(e)? as usize;
            let text = |c: &mut Cursor<'_>, what: &str| {
                let b = c.bytes(MAX_NAME, what).map_err(e)?;
                String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
            };
            let hostname = text(&mut c, "hostname")?;
            let host_id = text(&mut c, "host id")?;
            let pid = c.u32().map_err(e)?;
            let n = c.count(MAX_ADDRS, "address").map_err(e)?;
            let mut addrs = Vec::with_capacity(n);
            for _ in 0..n {
                let family = c.u8().map_err(e)?;
                let octets = c.bytes(16, "address").map_err(e)?;
                addrs.push(match (family, octets.len()) {
                    (4, 4) => IpAddr::V4(Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3])),
                    (6, 16) => {
                        let mut o = [0u8; 16];
                        o.copy_from_slice(octets);
                        IpAddr::V6(Ipv6Addr::from(o))
                    }
                    _ => {
                        return Err(format!(
                            "address family {family} with {} bytes",
                            octets.len()
                        ));
                    }
                });
            }
            if !c.is_empty() {
                return Err("trailing bytes".into());
            }
            Ok(PeerInfo {
                rank,
                world_size,
                hostname,
                host_id,
                pid,
                addrs,
            })
        };
        let info = parse().map_err(bad)?;
        if info.rank != from {
            return Err(bad(format!("it says it is rank {}", info.rank)));
        }
        Ok(info)
    }
}

/// This host's name, or `"unknown"` if it cannot be read.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The running kernel's boot id (`/proc/sys/kernel/random/boot_id`; empty if unknown):
/// processes with the same one share this machine's CPUs, whatever `FERROCCL_HOSTID`
/// says.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A 64-bit hash (FNV-1a) of a host identity as [`host_id`] gives it.
pub fn host_hash_of(host_id: &str) -> u64 {
    host_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What identifies this host: `FERROCCL_HOSTID` if set (to split one machine into
/// several "hosts", e.g. one per network namespace in tests, or to merge), else the
/// hostname and the kernel's boot id (`/proc/sys/kernel/random/boot_id`), so that two
/// containers with the same hostname on different machines are still told apart.
pub fn host_id() -> String {
    if let Ok(id) = std::env::var("FERROCCL_HOSTID")
        && !id.is_empty()
    {
        return id;
    }
    format!("{}:{}", hostname(), boot_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips_and_checks_the_rank() {
        let info = PeerInfo {
            rank: 3,
            world_size: 8,
            hostname: "h".into(),
            host_id: "h:boot".into(),
            pid: 77,
            addrs: vec!["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        };
        let bytes = info.encode();
        assert_eq!(PeerInfo::decode(3, &bytes).unwrap(), info);
        let err = PeerInfo::decode(4, &bytes).unwrap_err().to_string();
        assert!(err.contains("rank 4") && err.contains("rank 3"), "{err}");
        let err = PeerInfo::decode(3, &bytes[..bytes.len() - 1]).unwrap_err();
        assert!(matches!(err, Error::BootstrapData { rank: 3, .. }));
    }

    #[test]
    fn local_host_id_has_hostname_and_boot_id() {
        let me = PeerInfo::local(0, 1, vec![]);
        assert_eq!(me.pid, std::process::id());
        if std::env::var_os("FERROCCL_HOSTID").is_none() {
            assert!(me.host_id.starts_with(&me.hostname));
            assert!(me.host_id.len() > me.hostname.len() + 30, "{}", me.host_id);
        }
    }
}
