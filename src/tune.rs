//! Choosing the algorithm: an α-β cost model per transport, predicting each candidate's
//! time for a call and picking the fastest.
//!
//! A step over a link costs `α + bytes / β`: `α` the latency of one hand-off (the
//! peer's turn to run, a wake-up, a network hop), `β` the bandwidth. For an all-reduce of
//! `S` bytes over `n` ranks on `h` hosts (`k` ranks per host):
//!
//! - **ring**: 2(n−1) steps of `S/n` bytes each, paced by the slowest link of the ring
//!   (the network when `h > 1`): `2(n−1)·α + 2(n−1)/n · S/β`;
//! - **one-shot** (two ranks): each sends its whole buffer to the other, `α + S/β`,
//!   plus the extra local reduction of the half the ring would have left to the peer,
//!   `S/β_local`;
//! - **tree** (double binary tree over hosts, chain inside): the data goes up and comes
//!   back down, `d = ⌈log₂ h⌉` network levels and `k−1` chain links each way, pipelined
//!   in chunks so the bandwidth term is paid about twice over the network:
//!   `2(d·α_net + (k−1)·α_local) + 2·S/β_net`.
//!
//! The ring wins on bandwidth, the tree on latency once there are several hosts; the
//! crossover is where the two lines meet ([`CostModel::crossover`]). The parameters have
//! defaults measured on the project's 2-core machine; `ferroccl-tune` measures them
//! anywhere, and `FERROCCL_TUNE_LOCAL` / `FERROCCL_TUNE_NET` (`alpha_us,gbps`) set them.
//! All ranks use rank 0's model (exchanged at initialisation), so they always agree.

use crate::error::{Error, Result};
use crate::plan::Algorithm;

/// Latency and bandwidth of one kind of link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// Seconds per step (hand-off latency).
    pub alpha: f64,
    /// Bytes per second.
    pub beta: f64,
}

impl LinkCost {
    /// From microseconds and GB/s (10^9 bytes).
    pub fn new(alpha_us: f64, gbps: f64) -> Self {
        LinkCost {
            alpha: alpha_us * 1e-6,
            beta: gbps * 1e9,
        }
    }

    /// Parses `alpha_us,gbps` (e.g. `40,1.25`).
    pub fn parse(var: &str, text: &str) -> Result<Self> {
        let bad = || Error::Env {
            var: var.into(),
            detail: format!("{text:?} is not `alpha_us,gbps` with positive numbers"),
        };
        let (a, b) = text.split_once(',').ok_or_else(bad)?;
        let (a, b): (f64, f64) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if !(a.is_finite() && b.is_finite() && a >= 0.0 && b > 0.0) {
            return Err(bad());
        }
        Ok(LinkCost::new(a, b))
    }

    /// The wire form: `alpha_us,gbps`.
    pub fn to_text(&self) -> String {
        format!("{},{}", self.alpha * 1e6, self.beta / 1e9)
    }
}

/// The shape of a job, as the model needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Ranks.
    pub ranks: usize,
    /// Hosts.
    pub hosts: usize,
    /// Most ranks on one host.
    pub ranks_per_host: usize,
}

/// The cost model: one link cost inside a host, one between hosts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Between ranks of one host (shared memory).
    pub local: LinkCost,
    /// Between hosts (TCP).
    pub net: LinkCost,
}

impl Default for CostModel {
    /// Measured on a 2-core VM: shared memory hands off in about 1 µs when ranks share
    /// cores and moves ~10 GB/s; loopback TCP through the proxies takes ~30 µs a step
    /// and ~1.6 GB/s.
    fn default() -> Self {
        CostModel {
            local: LinkCost::new(1.0, 10.0),
            net: LinkCost::new(30.0, 1.6),
        }
    }
}

impl CostModel {
    /// Defaults with `FERROCCL_TUNE_LOCAL` / `FERROCCL_TUNE_NET` applied.
    pub fn from_env() -> Result<Self> {
        let mut m = CostModel::default();
        if let Ok(t) = std::env::var("FERROCCL_TUNE_LOCAL") {
            m.local = LinkCost::parse("FERROCCL_TUNE_LOCAL", &t)?;
        }
        if let Ok(t) = std::env::var("FERROCCL_TUNE_NET") {
            m.net = LinkCost::parse("FERROCCL_TUNE_NET", &t)?;
        }
        Ok(m)
    }

    /// The link that paces a ring: the network as soon as there are two hosts.
    fn slowest(&self, shape: Shape) -> LinkCost {
        if shape.hosts > 1 {
            self.net
        } else {
            self.local
        }
    }

    /// One pass down (or up) the tree: ⌈log₂ hosts⌉ network levels and the host chain.
    fn tree_pass(&self, shape: Shape) -> f64 {
        let levels = (shape.hosts.max(1) as f64).log2().ceil();
        let chain = shape.ranks_per_host.max(1) as f64 - 1.0;
        levels * self.net.alpha + chain * self.local.alpha
    }

    /// Predicted seconds for an all-reduce of `bytes` with `algo`.
    pub fn all_reduce(&self, algo: Algorithm, bytes: usize, shape: Shape) -> f64 {
        let n = shape.ranks.max(1) as f64;
        if shape.ranks <= 1 {
            return 0.0;
        }
        let s = bytes as f64;
        let slow = self.slowest(shape);
        match algo {
            Algorithm::OneShot if shape.ranks != 2 => f64::INFINITY,
            // One hand-off, but each rank reduces the whole buffer instead of half of it.
            Algorithm::OneShot => slow.alpha + s / slow.beta + s / self.local.beta,
            Algorithm::Ring => 2.0 * (n - 1.0) * slow.alpha + 2.0 * (n - 1.0) / n * s / slow.beta,
            Algorithm::Tree => 2.0 * self.tree_pass(shape) + 2.0 * s / slow.beta,
        }
    }

    /// Predicted seconds for a broadcast of `bytes` with `algo`: a pipelined chain along
    /// the ring, `(n−1)·α + S/β`, or down the tree, `(d·α_net + (k−1)·α_local) + 2·S/β`
    /// (an inner node sends each chunk to two children).
    pub fn broadcast(&self, algo: Algorithm, bytes: usize, shape: Shape) -> f64 {
        if shape.ranks <= 1 {
            return 0.0;
        }
        let s = bytes as f64;
        let slow = self.slowest(shape);
        match algo {
            Algorithm::OneShot => f64::INFINITY,
            Algorithm::Ring => (shape.ranks as f64 - 1.0) * slow.alpha + s / slow.beta,
            Algorithm::Tree => self.tree_pass(shape) + 2.0 * s / slow.beta,
        }
    }

    /// The fastest of `allowed` for a broadcast of `bytes` (ring if none applies).
    pub fn best_broadcast(&self, bytes: usize, shape: Shape, allowed: &[Algorithm]) -> Algorithm {
        best(allowed, |a| self.broadcast(a, bytes, shape))
    }

    /// The fastest of `allowed` for an all-reduce of `bytes` (ring if none applies).
    pub fn best_all_reduce(&self, bytes: usize, shape: Shape, allowed: &[Algorithm]) -> Algorithm {
        best(allowed, |a| self.all_reduce(a, bytes, shape))
    }

    /// The faster of ring and tree for a broadcast of `bytes`.
    pub fn choose_broadcast(&self, bytes: usize, shape: Shape) -> Algorithm {
        self.best_broadcast(bytes, shape, &[Algorithm::Ring, Algorithm::Tree])
    }

    /// The faster of ring and tree for an all-reduce of `bytes`.
    pub fn choose(&self, bytes: usize, shape: Shape) -> Algorithm {
        self.best_all_reduce(bytes, shape, &[Algorithm::Ring, Algorithm::Tree])
    }

    /// The size below which the tree is faster, if there is one.
    pub fn crossover(&self, shape: Shape) -> Option<usize> {
        if self.choose(1, shape) != Algorithm::Tree {
            return None;
        }
        let (mut lo, mut hi) = (1usize, 1usize << 40);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if self.choose(mid, shape) == Algorithm::Tree {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(hi)
    }
}

/// The algorithm of `allowed` with the smallest finite `cost`, ties to the earlier one;
/// the ring when none is finite.
fn best(allowed: &[Algorithm], cost: impl Fn(Algorithm) -> f64) -> Algorithm {
    allowed
        .iter()
        .map(|&a| (a, cost(a)))
        .filter(|(_, c)| c.is_finite())
        .fold(None, |acc: Option<(Algorithm, f64)>, (a, c)| match acc {
            Some((_, best)) if best <= c => acc,
            _ => Some((a, c)),
        })
        .map_or(Algorithm::Ring, |(a, _)| a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_for_bandwidth_tree_for_latency_across_hosts() {
        let m = CostModel::default();
        let one_host = Shape {
            ranks: 8,
            hosts: 1,
            ranks_per_host: 8,
        };
        assert_eq!(
            m.choose(8, one_host),
            Algorithm::Ring,
            "a chain gains nothing"
        );
        assert_eq!(m.crossover(one_host), None);
        let hosts = Shape {
            ranks: 16,
            hosts: 16,
            ranks_per_host: 1,
        };
        assert_eq!(m.choose(8, hosts), Algorithm::Tree);
        assert_eq!(m.choose(1 << 30, hosts), Algorithm::Ring);
        let x = m.crossover(hosts).unwrap();
        assert_eq!(m.choose(x - 1, hosts), Algorithm::Tree);
        assert_eq!(m.choose(x, hosts), Algorithm::Ring);
        // More hosts: the ring's latency grows linearly, the tree's logarithmically, so
        // the tree stays ahead for larger messages.
        let many = Shape {
            ranks: 64,
            hosts: 64,
            ranks_per_host: 1,
        };
        assert!(m.crossover(many).unwrap() > x);
    }

    #[test]
    fn one_shot_is_for_two_ranks() {
        let m = CostModel::default();
        let all = [Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot];
        let two = Shape {
            ranks: 2,
            hosts: 1,
            ranks_per_host: 2,
        };
        assert_eq!(m.best_all_reduce(8, two, &all), Algorithm::OneShot);
        let four = Shape {
            ranks: 4,
            hosts: 1,
            ranks_per_host: 4,
        };
        assert_eq!(m.best_all_reduce(8, four, &all), Algorithm::Ring);
        assert_eq!(
            m.best_all_reduce(8, four, &[Algorithm::OneShot]),
            Algorithm::Ring
        );
        assert_eq!(m.best_broadcast(8, two, &all), Algorithm::Ring);
    }

    #[test]
    fn link_costs_parse() {
        let c = LinkCost::parse("V", "40, 1.25").unwrap();
        assert!((c.alpha - 40e-6).abs() < 1e-12 && (c.beta - 1.25e9).abs() < 1.0);
        assert_eq!(LinkCost::parse("V", &c.to_text()).unwrap(), c);
        assert!(
            LinkCost::parse("V", "fast")
                .unwrap_err()
                .to_string()
                .contains("V")
        );
        assert!(LinkCost::parse("V", "1,0").is_err());
    }
}
