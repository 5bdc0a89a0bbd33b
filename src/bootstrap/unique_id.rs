//! [`UniqueId`]: the 128 bytes one rank creates and every rank is given, as with
//! `ncclGetUniqueId`.
//!
//! It names a TCP store server (started in the creating process) and carries a random
//! nonce that namespaces the job's keys on that server, so several communicators can be
//! created from one process without seeing each other's keys.
//!
//! Layout (all other bytes zero, so an all-zero id is recognisably invalid):
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `b"FCID"` |
//! | 4 | layout version (1) |
//! | 5 | address family: 4 or 6 |
//! | 6..8 | port, big-endian |
//! | 8..24 | IP address (IPv4 in the first 4 bytes) |
//! | 24..40 | nonce |

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

use rand::RngCore;

use super::netif::{IfaceFilter, usable_addrs};
use crate::error::{Error, Result};
use crate::store::{ServerOptions, TcpStoreServer};

/// Size of a unique id in bytes (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

const MAGIC: &[u8; 4] = b"FCID";
const VERSION: u8 = 1;

/// Identifies one job's rendezvous: a store server address and a nonce.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

/// Servers started by [`UniqueId::new`] in this process, by nonce. They run until
/// [`UniqueId::stop_server`] or process exit: ranks in other processes depend on them and
/// this process cannot know when the last of those is done.
fn hosted() -> &'static Mutex<HashMap<[u8; 16], Arc<TcpStoreServer>>> {
    static HOSTED: OnceLock<Mutex<HashMap<[u8; 16], Arc<TcpStoreServer>>>> = OnceLock::new();
    HOSTED.get_or_init(Default::default)
}

impl UniqueId {
    /// Starts a store server in this process and returns an id naming it.
    ///
    /// The server listens on the first address of the interfaces chosen by
    /// `FERROCCL_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` (any non-loopback interface when
    /// unset, loopback when there is none), on a free port.
    pub fn new() -> Result<Self> {
        let ip = usable_addrs(IfaceFilter::from_env().as_ref())?[0];
        Self::hosted_on(ip)
    }

    /// Like [`UniqueId::new`], with the server on a given local address (e.g. loopback for
    /// single-host jobs and tests).
    pub fn hosted_on(ip: IpAddr) -> Result<Self> {
        let server = TcpStoreServer::bind((ip, 0), ServerOptions::from_env()?)?;
        let mut nonce = [0u8; 16];
        rand::rng().fill_bytes(&mut nonce);
        let id = Self::for_server(server.local_addr(), nonce);
        hosted()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(nonce, Arc::new(server));
        tracing::info!("unique id: store server on {}", id.store_addr());
        Ok(id)
    }

    /// An id naming an existing store server at `addr`, with the given key namespace.
    pub fn for_server(addr: SocketAddr, nonce: [u8; 16]) -> Self {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[6..8].copy_from_slice(&addr.port().to_be_bytes());
        match addr.ip() {
            IpAddr::V4(v4) => {
                b[5] = 4;
                b[8..12].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[5] = 6;
                b[8..24].copy_from_slice(&v6.octets());
            }
        }
        b[24..40].copy_from_slice(&nonce);
        UniqueId(b)
    }

    /// Reads an id from its 128 bytes, checking that they are one.
    pub fn from_bytes(bytes: &[u8; UNIQUE_ID_BYTES]) -> Result<Self> {
        let id = UniqueId(*bytes);
        if &bytes[0..4] != MAGIC {
            return Err(Error::invalid(
                "unique id: bad magic (not made by UniqueId::new / ncclGetUniqueId, or \
                 corrupted in transit)",
            ));
        }
        if bytes[4] != VERSION {
            return Err(Error::invalid(format!(
                "unique id: layout version {} (this ferroccl reads version {VERSION})",
                bytes[4]
            )));
        }
        if !matches!(bytes[5], 4 | 6) {
            return Err(Error::invalid(format!(
                "unique id: address family byte {} is neither 4 nor 6",
                bytes[5]
            )));
        }
        Ok(id)
    }

    /// The 128 bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// Address of the store server this id names.
    pub fn store_addr(&self) -> SocketAddr {
        let b = &self.0;
        let port = u16::from_be_bytes([b[6], b[7]]);
        let ip = if b[5] == 4 {
            IpAddr::V4(Ipv4Addr::new(b[8], b[9], b[10], b[11]))
        } else {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[8..24]);
            IpAddr::V6(Ipv6Addr::from(o))
        };
        SocketAddr::new(ip, port)
    }

    /// The nonce that namespaces this job's keys.
    pub fn nonce(&self) -> [u8; 16] {
        let mut n = [0u8; 16];
        n.copy_from_slice(&self.0[24..40]);
        n
    }

    /// The key prefix this job uses on the store (`ferroccl/<nonce in hex>`).
    pub fn key_prefix(&self) -> String {
        format!("ferroccl/{}", hex(&self.nonce()))
    }

    /// Whether the store server this id names runs in this process (and so dies with
    /// it).
    pub fn hosted_here(&self) -> bool {
        hosted()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&self.nonce())
    }

    /// Stops the store server this process started for this id; returns whether there
    /// was one. Ranks still using it get connection errors.
    pub fn stop_server(&self) -> bool {
        hosted()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.nonce())
            .is_some()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("store", &self.store_addr())
            .field("nonce", &hex(&self.nonce()))
            .finish()
    }
}

/// The id as hex text, trailing zero bytes left out (for passing in an environment
/// variable or on a command line; [`FromStr`] reads it back).
impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let used = self.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        f.write_str(&hex(&self.0[..used]))
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if !s.len().is_multiple_of(2) || s.len() > 2 * UNIQUE_ID_BYTES {
            return Err(Error::invalid(format!(
                "unique id text has {} hex digits; expected an even number up to {}",
                s.len(),
                2 * UNIQUE_ID_BYTES
            )));
        }
        let mut b = [0u8; UNIQUE_ID_BYTES];
        for (i, pair) in s.as_bytes().chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).unwrap_or("??");
            b[i] = u8::from_str_radix(text, 16).map_err(|_| {
                Error::invalid(format!("unique id text: {text:?} at {} is not hex", 2 * i))
            })?;
        }
        UniqueId::from_bytes(&b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_text_round_trip() {
        let addr: SocketAddr = "[fd00::7]:4242".parse().unwrap();
        let id = UniqueId::for_server(addr, [9; 16]);
        assert_eq!(id.store_addr(), addr);
        assert_eq!(id.nonce(), [9; 16]);
        assert_eq!(UniqueId::from_bytes(id.as_bytes()).unwrap(), id);
        assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
        let v4 = UniqueId::for_server("10.1.2.3:80".parse().unwrap(), [1; 16]);
        assert_eq!(v4.store_addr().to_string(), "10.1.2.3:80");
    }

    #[test]
    fn garbage_is_rejected_with_a_reason() {
        let err = UniqueId::from_bytes(&[0; UNIQUE_ID_BYTES]).unwrap_err();
        assert!(err.to_string().contains("magic"), "{err}");
        assert!("abc".parse::<UniqueId>().is_err());
        assert!(
            "zz".parse::<UniqueId>()
                .unwrap_err()
                .to_string()
                .contains("zz")
        );
    }

    #[test]
    fn new_starts_a_reachable_server() {
        let id = UniqueId::hosted_on(Ipv4Addr::LOCALHOST.into()).unwrap();
        assert!(std::net::TcpStream::connect(id.store_addr()).is_ok());
        assert!(id.stop_server());
        assert!(!id.stop_server());
    }
}
