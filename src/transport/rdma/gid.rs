//! Which entry of a port's GID table the queue pairs use.
//!
//! On InfiniBand a port is reached by its LID and the GID matters only across subnets, so
//! entry 0 serves. On RoCE the GID *is* the address packets are routed by, and a port's
//! table holds several: for each IP address of the network device, one RoCE v1 entry
//! (layer 2 only) and one RoCE v2 entry (UDP/IP, routable), plus link-local IPv6 ones. The
//! right one is rarely at index 0 (NVIDIA's tables usually have the IPv4 RoCE v2 entry at
//! index 3), so, as NCCL does since 2.21, the default is to choose: the first entry of the
//! wanted RoCE version (`NCCL_IB_ROCE_VERSION_NUM`, 2) whose address is of the wanted
//! family (`NCCL_IB_ADDR_FAMILY`, `AF_INET`) and inside `NCCL_IB_ADDR_RANGE` when that is
//! set; link-local entries are never chosen. `NCCL_IB_GID_INDEX` names an entry instead.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

/// One filled entry of a port's GID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index in the table.
    pub index: u8,
    /// The GID (an IPv6 address; IPv4 addresses appear IPv4-mapped, `::ffff:a.b.c.d`).
    pub gid: [u8; 16],
    /// 1 or 2 for RoCE entries; `None` on InfiniBand, or where the kernel does not say
    /// (sysfs `gid_attrs/types`).
    pub roce_version: Option<u8>,
}

impl GidEntry {
    /// The entry at `index` holding `address` (an IPv4 one IPv4-mapped), the inverse of
    /// [`GidEntry::address`].
    pub fn of_address(index: u8, address: IpAddr, roce_version: Option<u8>) -> Self {
        let gid = match address {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        GidEntry {
            index,
            gid,
            roce_version,
        }
    }

    /// The entry's address: IPv4 for an IPv4-mapped GID, else IPv6.
    pub fn address(&self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.gid);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }

    /// Whether the GID is an IPv6 link-local address (`fe80::/10`), routable nowhere.
    fn link_local(&self) -> bool {
        self.gid[0] == 0xfe && self.gid[1] & 0xc0 == 0x80
    }
}

impl fmt::Display for GidEntry {
    /// `3 (10.0.0.1, RoCE v2)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}", self.index, self.address())?;
        match self.roce_version {
            Some(v) => write!(f, ", RoCE v{v})"),
            None => write!(f, ")"),
        }
    }
}

/// An address family (`NCCL_IB_ADDR_FAMILY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrFamily {
    /// `AF_INET`: IPv4 (IPv4-mapped GIDs).
    V4,
    /// `AF_INET6`: IPv6.
    V6,
}

impl AddrFamily {
    /// Reads `AF_INET` or `AF_INET6`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "AF_INET" => Ok(AddrFamily::V4),
            "AF_INET6" => Ok(AddrFamily::V6),
            other => Err(format!("{other:?} is not AF_INET or AF_INET6")),
        }
    }

    fn holds(self, ip: IpAddr) -> bool {
        matches!(
            (self, ip),
            (AddrFamily::V4, IpAddr::V4(_)) | (AddrFamily::V6, IpAddr::V6(_))
        )
    }
}

impl fmt::Display for AddrFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddrFamily::V4 => "AF_INET",
            AddrFamily::V6 => "AF_INET6",
        })
    }
}

/// An address range in CIDR form (`NCCL_IB_ADDR_RANGE`, e.g. `10.1.0.0/16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrRange {
    /// The network address.
    pub base: IpAddr,
    /// How many leading bits an address must share with `base`.
    pub prefix: u8,
}

impl AddrRange {
    /// Reads `ADDRESS/PREFIX`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (addr, prefix) = text
            .split_once('/')
            .ok_or_else(|| format!("{text:?} is not ADDRESS/PREFIX (e.g. 10.1.0.0/16)"))?;
        let base: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} in {text:?} is not an IP address"))?;
        let most = if base.is_ipv4() { 32 } else { 128 };
        let prefix = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= most)
            .ok_or_else(|| format!("{prefix:?} in {text:?} is not a prefix length 0..={most}"))?;
        Ok(AddrRange { base, prefix })
    }

    /// The family of its addresses.
    pub fn family(&self) -> AddrFamily {
        if self.base.is_ipv4() {
            AddrFamily::V4
        } else {
            AddrFamily::V6
        }
    }

    /// Whether `ip` lies in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.base, ip) {
            (IpAddr::V4(base), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(base) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(base), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(base) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for AddrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

/// How a port's GID is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidSelection {
    /// This index (`NCCL_IB_GID_INDEX`).
    Index(u8),
    /// The first entry that fits (see the [module documentation](self)).
    Auto {
        /// `NCCL_IB_ROCE_VERSION_NUM`: 1 or 2.
        roce_version: u8,
        /// `NCCL_IB_ADDR_FAMILY`.
        family: AddrFamily,
        /// `NCCL_IB_ADDR_RANGE`, if set.
        range: Option<AddrRange>,
    },
}

impl Default for GidSelection {
    /// NCCL's default: the first IPv4 RoCE v2 entry.
    fn default() -> Self {
        GidSelection::Auto {
            roce_version: 2,
            family: AddrFamily::V4,
            range: None,
        }
    }
}

impl fmt::Display for GidSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidSelection::Index(i) => write!(f, "index {i} (NCCL_IB_GID_INDEX)"),
            GidSelection::Auto {
                roce_version,
                family,
                range,
            } => {
                write!(f, "a RoCE v{roce_version} {family} entry")?;
                if let Some(r) = range {
                    write!(f, " in {r}")?;
                }
                write!(f, ", not link-local")
            }
        }
    }
}

/// The entry of `table` (a port's filled GID entries) that `selection` picks on a port
/// whose link layer is Ethernet (RoCE) or not (InfiniBand). `Err` says what was wanted and
/// what the table holds, for the user to set `NCCL_IB_GID_INDEX`.
pub fn choose_gid(
    table: &[GidEntry],
    ethernet: bool,
    selection: &GidSelection,
) -> Result<GidEntry, String> {
    let listed = || {
        if table.is_empty() {
            "the table is empty".to_string()
        } else {
            let entries: Vec<String> = table.iter().map(ToString::to_string).collect();
            format!("the table holds {}", entries.join(", "))
        }
    };
    // InfiniBand: the LID routes; a missing GID entry is only a problem across subnets.
    let blank = |index| GidEntry {
        index,
        gid: [0; 16],
        roce_version: None,
    };
    match *selection {
        GidSelection::Index(index) => match table.iter().find(|e| e.index == index) {
            Some(e) => Ok(*e),
            None if !ethernet => Ok(blank(index)),
            None => Err(format!(
                "GID index {index} (NCCL_IB_GID_INDEX) is empty; RoCE needs a GID ({})",
                listed()
            )),
        },
        GidSelection::Auto { .. } if !ethernet => Ok(table
            .iter()
            .find(|e| e.index == 0)
            .copied()
            .unwrap_or(blank(0))),
        GidSelection::Auto {
            roce_version,
            family,
            range,
        } => {
            // An entry's version unknown (sysfs unreadable) matches only when no entry's
            // is known: else a RoCE v1 entry could be taken for a v2 one.
            let versions_known = table.iter().any(|e| e.roce_version.is_some());
            table.iter().find(|e| {
                let ip = e.address();
                !e.link_local()
                    && match e.roce_version {
                        Some(v) => v == roce_version,
                        None => !versions_known,
                    }
                    && family.holds(ip)
                    && range.is_none_or(|r| r.contains(ip))
            })
        }
        .copied()
        .ok_or_else(|| {
            format!(
                "no GID is {selection} ({}); set NCCL_IB_GID_INDEX, or \
                     NCCL_IB_ROCE_VERSION_NUM / NCCL_IB_ADDR_FAMILY / NCCL_IB_ADDR_RANGE",
                listed()
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, addr: &str, roce_version: Option<u8>) -> GidEntry {
        GidEntry::of_address(index, addr.parse().unwrap(), roce_version)
    }

    /// A ConnectX port with one IPv4 and one global IPv6 address, as `show_gids` lists it.
    fn connectx() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::a288:c2ff:fe3b:506a", Some(1)),
            entry(1, "fe80::a288:c2ff:fe3b:506a", Some(2)),
            entry(2, "10.200.1.10", Some(1)),
            entry(3, "10.200.1.10", Some(2)),
            entry(4, "2010:200:0:2:a288:c2ff:fe3b:506a", Some(1)),
            entry(5, "2010:200:0:2:a288:c2ff:fe3b:506a", Some(2)),
        ]
    }

    fn auto(roce_version: u8, family: AddrFamily, range: Option<&str>) -> GidSelection {
        GidSelection::Auto {
            roce_version,
            family,
            range: range.map(|r| AddrRange::parse(r).unwrap()),
        }
    }

    #[test]
    fn the_default_picks_the_ipv4_roce_v2_entry() {
        let chosen = choose_gid(&connectx(), true, &GidSelection::default()).unwrap();
        assert_eq!(chosen.index, 3);
        assert_eq!(chosen.to_string(), "3 (10.200.1.10, RoCE v2)");
    }

    #[test]
    fn version_family_and_range_narrow_the_choice() {
        let t = connectx();
        let pick = |s| choose_gid(&t, true, &s).map(|e| e.index);
        assert_eq!(pick(auto(1, AddrFamily::V4, None)), Ok(2));
        // Link-local entries 0 and 1 are skipped.
        assert_eq!(pick(auto(2, AddrFamily::V6, None)), Ok(5));
        assert_eq!(pick(auto(1, AddrFamily::V6, None)), Ok(4));
        assert_eq!(pick(auto(2, AddrFamily::V4, Some("10.200.0.0/16"))), Ok(3));
        assert_eq!(pick(auto(2, AddrFamily::V6, Some("2010:200::/32"))), Ok(5));
        let e = pick(auto(2, AddrFamily::V4, Some("192.168.0.0/16"))).unwrap_err();
        assert!(
            e.contains("no GID is a RoCE v2 AF_INET entry in 192.168.0.0/16"),
            "{e}"
        );
        assert!(e.contains("3 (10.200.1.10, RoCE v2)"), "{e}");
        assert!(e.contains("NCCL_IB_GID_INDEX"), "{e}");
    }

    #[test]
    fn a_port_with_only_link_local_gids_has_no_automatic_choice() {
        let t = vec![entry(0, "fe80::1", Some(2))];
        let e = choose_gid(&t, true, &GidSelection::default()).unwrap_err();
        assert!(e.contains("0 (fe80::1, RoCE v2)"), "{e}");
        // Named, it is used.
        assert_eq!(
            choose_gid(&t, true, &GidSelection::Index(0)).unwrap().index,
            0
        );
    }

    #[test]
    fn an_unknown_roce_version_matches_only_when_no_version_is_known() {
        let pick = |t: &[GidEntry]| choose_gid(t, true, &GidSelection::default()).map(|e| e.index);
        assert_eq!(pick(&[entry(7, "10.0.0.5", None)]), Ok(7));
        // With versions known for some entries, an unknown one is not taken for v2.
        let t = [entry(2, "10.0.0.5", None), entry(3, "10.0.0.5", Some(2))];
        assert_eq!(pick(&t), Ok(3));
        assert!(pick(&[entry(2, "10.0.0.5", None), entry(3, "fe80::1", Some(2))]).is_err());
    }

    #[test]
    fn a_named_index_must_be_filled_on_roce_only() {
        let t = connectx();
        assert_eq!(
            choose_gid(&t, true, &GidSelection::Index(5)).unwrap().index,
            5
        );
        let e = choose_gid(&t, true, &GidSelection::Index(9)).unwrap_err();
        assert!(
            e.starts_with("GID index 9 (NCCL_IB_GID_INDEX) is empty"),
            "{e}"
        );
        // InfiniBand routes by LID: an empty entry is allowed, and auto means entry 0.
        let ib = choose_gid(&[], false, &GidSelection::Index(2)).unwrap();
        assert_eq!((ib.index, ib.gid), (2, [0; 16]));
        assert_eq!(
            choose_gid(&t, false, &GidSelection::default())
                .unwrap()
                .index,
            0
        );
        let e = choose_gid(&[], true, &GidSelection::default()).unwrap_err();
        assert!(e.contains("the table is empty"), "{e}");
    }

    #[test]
    fn address_ranges_parse_and_contain() {
        let r = AddrRange::parse("10.1.0.0/16").unwrap();
        assert!(r.contains("10.1.255.3".parse().unwrap()));
        assert!(!r.contains("10.2.0.1".parse().unwrap()));
        assert!(!r.contains("::ffff:10.1.0.1".parse().unwrap()));
        assert!(
            AddrRange::parse("0.0.0.0/0")
                .unwrap()
                .contains("8.8.8.8".parse().unwrap())
        );
        let exact = AddrRange::parse("10.0.0.1/32").unwrap();
        assert!(exact.contains("10.0.0.1".parse().unwrap()));
        assert!(!exact.contains("10.0.0.2".parse().unwrap()));
        let v6 = AddrRange::parse("fd00::/8").unwrap();
        assert_eq!(v6.family(), AddrFamily::V6);
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        for bad in [
            "10.0.0.0",
            "10.0.0.0/33",
            "fd00::/129",
            "ten/8",
            "10.0.0.0/x",
            "",
        ] {
            assert!(AddrRange::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(AddrFamily::parse("AF_INET6"), Ok(AddrFamily::V6));
        assert!(
            AddrFamily::parse("inet")
                .unwrap_err()
                .contains("AF_INET or AF_INET6")
        );
    }
}
