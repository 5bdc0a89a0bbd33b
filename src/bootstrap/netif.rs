//! The machine's network interfaces and their addresses (`getifaddrs`).
//!
//! Bootstrap needs two answers from here: which address to advertise in a
//! [`UniqueId`](super::UniqueId) so that other hosts can reach the store server, and which
//! addresses to publish in [`PeerInfo`](super::PeerInfo). The choice follows NCCL's
//! socket-interface rules in small: `FERROCCL_SOCKET_IFNAME` (or `NCCL_SOCKET_IFNAME`)
//! names the interfaces to use, with a `^` prefix to exclude and `=` for exact names;
//! otherwise any interface that is up and not loopback (and not `docker*`/`virbr*`),
//! falling back to loopback when that is all there is.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

/// One address of one network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddr {
    /// Interface name (`eth0`, `lo`, …).
    pub name: String,
    /// The address.
    pub addr: IpAddr,
    /// Whether the interface is a loopback interface.
    pub is_loopback: bool,
}

/// Every address of every interface that is up, IPv4 and IPv6, in the kernel's order.
pub fn interface_addrs() -> Result<Vec<InterfaceAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a pointer to a list it allocates into `head`; we pass a
    // valid pointer to our local variable.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io("getifaddrs", std::io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut cursor = head;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a non-null node of the list getifaddrs returned, which stays
        // valid until freeifaddrs below.
        let ifa = unsafe { &*cursor };
        cursor = ifa.ifa_next;
        let flags = ifa.ifa_flags;
        if ifa.ifa_addr.is_null() || flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose sa_family tells its
        // real type; we only read it as that type.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        out.push(InterfaceAddr {
            name,
            addr,
            is_loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once; no
    // reference into the list outlives this point (names were copied).
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// NCCL's list syntax (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA`): a leading `^` (exclude),
/// then a leading `=` (exact names), then comma-separated items (trimmed, empty ones
/// dropped). Returns `(exclude, exact, items)`.
pub fn parse_nccl_list(spec: &str) -> (bool, bool, Vec<&str>) {
    let mut rest = spec.trim();
    let exclude = rest.starts_with('^');
    if exclude {
        rest = &rest[1..];
    }
    let exact = rest.starts_with('=');
    if exact {
        rest = &rest[1..];
    }
    let items = rest
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    (exclude, exact, items)
}

/// An interface filter in NCCL's `NCCL_SOCKET_IFNAME` syntax: a comma-separated list of
/// name prefixes; `^` before the list excludes instead of selects; `=` before the list
/// makes the names exact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfaceFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfaceFilter {
    /// Parses a filter (`"eth,ib"`, `"^docker,lo"`, `"=eth0"`, `"^=lo"`).
    pub fn parse(spec: &str) -> Self {
        let (exclude, exact, names) = parse_nccl_list(spec);
        IfaceFilter {
            exclude,
            exact,
            names: names.into_iter().map(str::to_string).collect(),
        }
    }

    /// The filter named by `FERROCCL_SOCKET_IFNAME`, else `NCCL_SOCKET_IFNAME`, if set.
    pub fn from_env() -> Option<Self> {
        ["FERROCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .map(|s| Self::parse(&s))
    }

    /// Whether interface `name` passes the filter.
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                n == name
            } else {
                name.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }
}

/// The addresses this process should use and advertise, best first.
///
/// With an interface filter, exactly the addresses of matching interfaces (an error
/// naming the filter if there are none). Without one, non-loopback addresses of
/// interfaces other than `docker*`/`virbr*`, IPv4 first; if there are none, loopback.
pub fn usable_addrs(filter: Option<&IfaceFilter>) -> Result<Vec<IpAddr>> {
    let all = interface_addrs()?;
    let mut picked: Vec<&InterfaceAddr> = match filter {
        Some(f) => all.iter().filter(|a| f.matches(&a.name)).collect(),
        None => all
            .iter()
            .filter(|a| {
                !a.is_loopback && !a.name.starts_with("docker") && !a.name.starts_with("virbr")
            })
            .collect(),
    };
    // Link-local IPv6 addresses need a scope id to be reachable; skip them.
    picked.retain(|a| !matches!(a.addr, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80));
    if picked.is_empty() {
        if let Some(f) = filter {
            return Err(Error::Env {
                var: "FERROCCL_SOCKET_IFNAME".into(),
                detail: format!(
                    "no interface that is up matches {f:?}; interfaces: {:?}",
                    all.iter().map(|a| a.name.as_str()).collect::<Vec<_>>()
                ),
            });
        }
        return Ok(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    }
    picked.sort_by_key(|a| a.addr.is_ipv6());
    Ok(picked.into_iter().map(|a| a.addr).collect())
}

/// The local address the kernel would send from to reach `dest` (`host:port`): the
/// interface on the route to it. No packet is sent (a UDP socket is only connected).
pub fn route_source(dest: &str) -> Option<IpAddr> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let target = dest.to_socket_addrs().ok()?.next()?;
    let any: IpAddr = if target.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let sock = UdpSocket::bind((any, 0)).ok()?;
    sock.connect(target).ok()?;
    sock.local_addr().ok().map(|a| a.ip())
}

/// The address to listen on for peers: the interfaces `FERROCCL_SOCKET_IFNAME` names
/// when it is set; else the one on the route to the job's store (`route_hint`), which is
/// how the other hosts reach this one too; else the first usable address.
pub fn listen_addr(route_hint: Option<&str>) -> Result<IpAddr> {
    let filter = IfaceFilter::from_env();
    if filter.is_none()
        && let Some(ip) = route_hint.and_then(route_source)
    {
        return Ok(ip);
    }
    Ok(usable_addrs(filter.as_ref())?[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_follow_nccl_socket_ifname() {
        let f = IfaceFilter::parse("eth,ib");
        assert!(f.matches("eth0") && f.matches("ib1") && !f.matches("lo"));
        let f = IfaceFilter::parse("^docker,lo");
        assert!(f.matches("eth0") && !f.matches("docker0") && !f.matches("lo"));
        let f = IfaceFilter::parse("=eth0");
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f = IfaceFilter::parse("^=lo");
        assert!(!f.matches("lo") && f.matches("lo2"));
    }

    #[test]
    fn the_route_to_loopback_starts_at_loopback() {
        assert_eq!(
            route_source("127.0.0.1:9"),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(route_source("no.such.host.invalid:1"), None);
    }

    #[test]
    fn loopback_is_listed_and_a_usable_address_exists() {
        let all = interface_addrs().unwrap();
        assert!(all.iter().any(|a| a.is_loopback), "{all:?}");
        assert!(!usable_addrs(None).unwrap().is_empty());
        let lo = usable_addrs(Some(&IfaceFilter::parse("=lo"))).unwrap();
        assert!(lo.iter().all(|a| a.is_loopback()), "{lo:?}");
        let none = usable_addrs(Some(&IfaceFilter::parse("=no-such-if0")));
        assert!(none.unwrap_err().to_string().contains("no-such-if0"));
    }
}
