//! Choosing the algorithm and the protocol: an α-β cost model per link and protocol,
//! predicting each candidate's time for a call and picking the fastest.
//!
//! A step over a link costs `α + bytes / β`: `α` the latency of one hand-off (the
//! peer's turn to run, a wake-up, a network hop), `β` the bandwidth. For an all-reduce of
//! `S` bytes over `n` ranks on `h` hosts (`k` ranks per host):
//!
//! - **ring**: 2(n−1) steps of `S/n` bytes each, paced by the slowest link of the ring
//!   (the network when `h > 1`), plus the pipeline's fill (a block moves a slice of at
//!   most 128 KiB at a time): `2(n−1)·α + 2(n−1)/n · S/β + f·(2n−3)·min(S/n, 128 KiB)/β`,
//!   where `f` is 1 when every rank has a CPU and `cpus/ranks` when ranks outnumber the
//!   CPUs of their machine: then the CPUs, not the links, are what is short, and other
//!   ranks run while a pipeline fills ([`Crowding`]);
//! - **one-shot**: each rank sends its whole buffer to each of the n−1 others in one
//!   hand-off, and folds the n−1 it receives straight from the FIFOs: it reduces
//!   (n−1)·S bytes where a ring rank reduces (n−1)/n·S, `α + (n−1)·S/β +
//!   (n−1)²/n·S/β_local`;
//! - **two-shot**: a direct reduce-scatter and a direct all-gather, two hand-offs and
//!   the ring's bytes, plus the fold of what the reduce-scatter gathered (received into
//!   scratch, then reduced: one more pass over it): `2α + 2(n−1)/n·S/β +
//!   (n−1)/n·S/β_local`; over single copy the reads land in a cache-sized staging
//!   buffer and are folded from there, without that pass: `2α + 2(n−1)/n·S/β`;
//! - **tree** (double binary tree over hosts, chain inside): the data goes up and comes
//!   back down, `d = ⌈log₂ h⌉` network levels and `k−1` chain links each way, pipelined
//!   in chunks so the bandwidth term is paid about twice over the network, plus the
//!   fill down and up (slice by slice, `f` as for the ring):
//!   `2(d·α_net + (k−1)·α_local) + 2·S/β_net + f·2(d + k−1)·min(S, 128 KiB)/β`.
//!
//! Where ranks outnumber the CPUs of their machine (`q` ranks per CPU), a hand-off waits
//! for the turns of the ranks that share the CPU of the rank it waits on: each step of
//! the ring or the tree costs `q·α`; the one-shot's round, where each of a CPU's ranks
//! runs once to post and once more to fold, `(2q − 1)·α`, and its folds `(q + 1)/2`
//! times the bytes (the CPU folds for its ranks in turn); each round of the two-shot,
//! which also waits on every peer's fold, `q²·α`, and beyond two ranks to a CPU `q/2`
//! times the bytes ([`Crowding::round_bytes`]). Fitted on 2 cores with 3, 4 and 8 ranks
//! (2026-11-26 to 11-29): the one-shot's 8-byte call took 2.0, 3.0 and 8.4–11.4 µs, a
//! two-shot round 3.5 µs more than a one-shot's on 3 ranks, 6 on 4 and 17–20 on 8
//! (ranks left free), a ring step 3 µs on 4 ranks and 6–8 on 8, against α = 1 µs
//! ([`Crowding::queue`]).
//!
//! The ring wins on bandwidth, the tree on latency once there are several hosts; the
//! crossover is where the two lines meet ([`CostModel::crossover`]).
//!
//! The **protocol** (see [`Protocol`]) changes the local link's `α` and `β`: LL hands a
//! small message over in fewer cache lines but falls behind on larger ones (measured,
//! not yet explained: see [`CostModel::default`]), so it wins below some size and
//! Simple above. Across hosts the model offers only Simple unless LL is forced: over
//! TCP an LL call still uses the Simple FIFOs, but in LL-sized slices, each a hand-off
//! through the proxies (measured on loopback, 2 ranks, 512 KiB: 0.24 GB/s with LL
//! slices against 2.0 GB/s with Simple ones), which this model does not describe.
//! Collectives without a choice of algorithm (all-gather, reduce-scatter, reduce,
//! the direct ones, send/recv) still get the protocol their step count and bytes favour.
//!
//! The parameters have defaults measured on the project's 2-core machine;
//! `ferroccl-tune measure` measures them anywhere, and `FERROCCL_TUNE_LOCAL`,
//! `FERROCCL_TUNE_LOCAL_LL`, `FERROCCL_TUNE_LOCAL_SINGLE`, `FERROCCL_TUNE_LOCAL_IN_PLACE`
//! and `FERROCCL_TUNE_NET` (`alpha_us,gbps`) set them. All ranks
//! use rank 0's model (exchanged at initialisation), so they always agree.

pub mod stores;

use crate::error::{Error, Result};
use crate::plan::Protocol;
use crate::plan::{Algorithm, Collective, doubling_rank};

/// Bytes a ring hop hands on at a time (the default FIFO slot): a block goes round the
/// ring slice by slice, so the pipeline takes `2n−3` slices (or blocks, if smaller) to
/// fill. Without that term the model put the 2-rank crossover from one-shot to the ring
/// at 20 KB, where the measured one is between 128 and 512 KiB (2 processes, busbw at
/// 32 KiB: one-shot 9.9 GB/s, ring 5.5; 128 KiB: 12.6 and 7.4; 512 KiB: 13.5 and 16.5).
const RING_SLICE: f64 = 128.0 * 1024.0;

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

    /// An RDMA link of `gbps` Gb/s: the NIC's bandwidth (bytes, so ÷ 8), and α = 5 µs,
    /// a hop through the NIC plus the completion handling on both sides. The α is an
    /// estimate, not measured: no RDMA hardware has run ferroccl yet.
    pub fn rdma(gbps: f64) -> Self {
        LinkCost::new(5.0, gbps / 8.0)
    }

    /// Whether two costs agree to a part in a billion (a cost that went through its
    /// text form, [`LinkCost::to_text`], may differ from the original in the last bit).
    pub fn about(&self, other: LinkCost) -> bool {
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
        near(self.alpha, other.alpha) && near(self.beta, other.beta)
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
    /// Hosts (every rank counts as a host of its own when TCP is forced between all).
    pub hosts: usize,
    /// Most ranks on one host.
    pub ranks_per_host: usize,
    /// Ranks against CPUs on the most crowded machine.
    pub crowding: Crowding,
}

impl Shape {
    /// `ranks` spread as evenly as they go over `hosts` (at least one), each rank with
    /// a CPU of its own.
    pub fn even(ranks: usize, hosts: usize) -> Self {
        Shape {
            ranks,
            hosts,
            ranks_per_host: ranks.div_ceil(hosts.max(1)),
            crowding: Crowding::NONE,
        }
    }
}

/// How many ranks share how many CPUs on the machine where ranks are most crowded
/// (every rank computes it from the same gathered facts, so all agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crowding {
    /// Ranks on that machine.
    pub ranks: usize,
    /// CPUs those ranks may run on between them.
    pub cpus: usize,
}

impl Crowding {
    /// Every rank has a CPU of its own.
    pub const NONE: Crowding = Crowding { ranks: 1, cpus: 1 };

    /// The share of a machine's ranks that run at any moment: 1 when each has a CPU,
    /// `cpus / ranks` when they outnumber the CPUs.
    pub fn running_share(&self) -> f64 {
        1.0 / self.queue()
    }

    /// Whether the ranks outnumber the CPUs they may use.
    pub fn outnumbered(&self) -> bool {
        self.ranks > self.cpus.max(1)
    }

    /// Ranks per CPU, at least 1: how many turns a CPU's run queue takes before a rank
    /// that waits runs again.
    pub fn queue(&self) -> f64 {
        if !self.outnumbered() {
            1.0
        } else {
            self.ranks as f64 / self.cpus.max(1) as f64
        }
    }

    /// The most ranks one CPU runs, at least 1: ranks that outnumber the CPUs are
    /// bound in blocks of consecutive ranks ([`crate::topo::cpu_in_blocks`]), so some
    /// CPU takes `⌈ranks / cpus⌉` of them.
    pub fn per_cpu(&self) -> usize {
        if self.outnumbered() {
            self.ranks.div_ceil(self.cpus.max(1))
        } else {
            1
        }
    }

    /// How much dearer a CPU makes the bytes of a two-shot round or a doubling round
    /// across CPUs: 1 up to two ranks to a CPU, where one rank's copies overlap the
    /// other's wait (the link costs were fitted there), `q/2` beyond, where the copies
    /// of the CPU's `q` ranks queue. Measured on 2 cores, 8 ranks bound in blocks
    /// (2026-11-29, near, 8–128 KiB): the two-shot 0.49 µs per KiB and doubling 0.82,
    /// where the unscaled terms give 0.27 and 0.46. The ring, which moves a slice at a
    /// time while other ranks run, is not scaled.
    pub fn round_bytes(&self) -> f64 {
        (self.queue() / 2.0).max(1.0)
    }

    /// Whether local ranks `a` and `b` run on one CPU: ranks that outnumber the CPUs,
    /// bound in blocks of consecutive ranks as `ferrorun` and the perf tools bind them
    /// ([`crate::topo::cpu_in_blocks`]).
    pub fn share_cpu(&self, a: usize, b: usize) -> bool {
        use crate::topo::cpu_in_blocks;
        self.ranks > self.cpus
            && cpu_in_blocks(a, self.ranks, self.cpus) == cpu_in_blocks(b, self.ranks, self.cpus)
    }
}

/// What the model picks for a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Choice {
    /// How the data moves between ranks.
    pub algorithm: Algorithm,
    /// How each slice crosses a FIFO.
    pub protocol: Protocol,
}

impl Choice {
    /// The usual pick for large messages.
    pub const RING_SIMPLE: Choice = Choice {
        algorithm: Algorithm::Ring,
        protocol: Protocol::Simple,
    };

    /// `ring/Simple`, `tree/LL`, …
    pub fn name(&self) -> String {
        format!("{}/{}", self.algorithm.name(), self.protocol.name())
    }
}

/// The cost model: the links inside a host (per protocol) and between hosts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Between ranks of one host, Simple protocol (shared memory).
    pub local: LinkCost,
    /// Between ranks of one host, LL protocol.
    pub local_ll: LinkCost,
    /// Between ranks of one host, single copy (the receiver reads the sender's buffer:
    /// a descriptor's hand-off and a system call per piece, then one pass over memory).
    pub local_single: LinkCost,
    /// Between ranks of one host, single copy read in place: from a thread of the same
    /// process, or from a window every peer mapped (no system call, no staging).
    pub local_in_place: LinkCost,
    /// Between hosts (TCP).
    pub net: LinkCost,
}

impl Default for CostModel {
    /// Measured on a 2-core VM: shared memory hands off in about 1 µs when ranks share
    /// cores and moves ~10 GB/s; LL hands off about 0.09 µs sooner (`ferroccl-tune
    /// measure`, 2 processes: 8-byte ping-pong 0.48 µs against 0.56–0.62 µs). Since its
    /// flag moved into one header per slot (2026-11-27), LL moves what Simple does per
    /// byte in a ping-pong (`ferroccl-tune measure`: 8.7–9.2 GB/s, Simple 6.5–7.3), but
    /// in an all-reduce it falls behind from 4 KiB, with 4 KiB slots and 64 KiB ones
    /// alike (8 KiB: 1.6–1.75 µs against 1.22–1.28), and rotating LL messages through
    /// their slots as Simple's rotate gained little (8 KiB: 4.3 → 4.0 µs against
    /// Simple's 2.3, far). The reason, found 2026-11-30: the sender wrote lines the
    /// receiver's cache held; where every rank has a core the two LL FIFOs of a pair now
    /// exchange slots, and there LL leads Simple up to 16 KiB (2 ranks, 4 KiB: 0.95–1.05
    /// µs against 1.15–1.37), which [`DEDICATED_LL_GAIN`] prices on such hosts; this
    /// β stays the one for ranks that share CPUs. Fitted, 7.5 GB/s puts the
    /// 2-rank one-shot's crossover at 3 KB, where the measured one lies (2 KiB: LL 0.70
    /// µs, Simple 0.75; 4 KiB: 1.04 against 0.95; it was ~2 GB/s with a flag in every
    /// 8-byte line); single copy between processes hands off in 2.3 µs (a descriptor,
    /// then a system call) and moves 4.9 GB/s (2026-11-25: the kernel's cross-memory
    /// copy runs at 5.3 GB/s where `memcpy` runs at 9.4, so on this machine it loses to
    /// two copies through a cache-resident FIFO and the model never picks it unless
    /// told to). Read in place (threads, windows) it hands off as single copy does (a
    /// descriptor, then its release) at twice the Simple FIFO's bandwidth, one pass where
    /// the FIFO makes two (2 threads, ring, busbw, interleaved runs, 2026-11-27: 512 KiB
    /// 5.3–12.2 GB/s against Simple's 5.0–5.9, 2 MiB 10.7–16.1 against 6.2–7.8, 8 MiB
    /// 5.4–6.0 against 2.0–4.0). Loopback TCP through the proxies takes ~30 µs a step
    /// and ~1.6 GB/s.
    fn default() -> Self {
        CostModel {
            local: LinkCost::new(1.0, 10.0),
            local_ll: LinkCost::new(0.9, 7.5),
            local_single: LinkCost::new(2.3, 4.9),
            local_in_place: LinkCost::new(2.3, 20.0),
            net: LinkCost::new(30.0, 1.6),
        }
    }
}

/// How much faster LL moves bytes where every rank of the host has a CPU of its own
/// than `CostModel::local_ll` says. There the two LL FIFOs of a pair exchange slots
/// (`transport::exchanging_protocols`: a rank writes what it sends into lines it has
/// just read), where ranks that take turns on a CPU do not. Measured 2026-12-01 (Intel
/// Xeon, 2 ranks with a core each, one-shot forced, three rounds, µs): 4 KiB LL
/// 0.85–0.87 against Simple 1.09–1.12, 8 KiB 1.44–1.45 against 1.49–1.55, 16 KiB
/// 2.31–2.34 against 2.54–3.11, 32 KiB 3.96–4.00 against 3.47–3.77; the slopes from 8 to
/// 32 KiB 9.7 and 12.6 GB/s. With `local_ll` alone (7.5 GB/s) the model handed over to
/// Simple at 3 KB; 1.28 × 7.5 = 9.6 GB/s puts the 2-rank one-shot's crossover at 23 KB,
/// between the measured 16 and 32 KiB.
pub const DEDICATED_LL_GAIN: f64 = 1.28;

impl CostModel {
    /// Defaults with `FERROCCL_TUNE_LOCAL`, `FERROCCL_TUNE_LOCAL_LL`,
    /// `FERROCCL_TUNE_LOCAL_SINGLE`, `FERROCCL_TUNE_LOCAL_IN_PLACE` and
    /// `FERROCCL_TUNE_NET` applied.
    pub fn from_env() -> Result<Self> {
        let mut m = CostModel::default();
        for (var, cost) in [
            ("FERROCCL_TUNE_LOCAL", &mut m.local),
            ("FERROCCL_TUNE_LOCAL_LL", &mut m.local_ll),
            ("FERROCCL_TUNE_LOCAL_SINGLE", &mut m.local_single),
            ("FERROCCL_TUNE_LOCAL_IN_PLACE", &mut m.local_in_place),
            ("FERROCCL_TUNE_NET", &mut m.net),
        ] {
            if let Ok(t) = std::env::var(var) {
                *cost = LinkCost::parse(var, &t)?;
            }
        }
        Ok(m)
    }

    /// The wire form, for sharing rank 0's model:
    /// `local;local_ll;local_single;local_in_place;net`.
    pub fn to_text(&self) -> String {
        format!(
            "{};{};{};{};{}",
            self.local.to_text(),
            self.local_ll.to_text(),
            self.local_single.to_text(),
            self.local_in_place.to_text(),
            self.net.to_text()
        )
    }

    /// Reads [`CostModel::to_text`]'s form; `whose` names it in errors.
    pub fn parse(whose: &str, text: &str) -> Result<Self> {
        let parts: Vec<&str> = text.split(';').collect();
        let [local, local_ll, local_single, local_in_place, net] = parts[..] else {
            return Err(Error::Env {
                var: whose.into(),
                detail: format!("{text:?} is not `local;local_ll;local_single;local_in_place;net`"),
            });
        };
        Ok(CostModel {
            local: LinkCost::parse(whose, local)?,
            local_ll: LinkCost::parse(whose, local_ll)?,
            local_single: LinkCost::parse(whose, local_single)?,
            local_in_place: LinkCost::parse(whose, local_in_place)?,
            net: LinkCost::parse(whose, net)?,
        })
    }

    /// This model for ranks that read each other's buffers in place (threads of one
    /// process, or buffers in windows every peer mapped): a single copy is a pointer
    /// read, priced as `local_in_place`.
    pub fn reading_in_place(self) -> CostModel {
        CostModel {
            local_single: self.local_in_place,
            ..self
        }
    }

    /// The link inside a host with `protocol`.
    fn local(&self, protocol: Protocol) -> LinkCost {
        match protocol {
            Protocol::Simple => self.local,
            Protocol::LL => self.local_ll,
            Protocol::SingleCopy => self.local_single,
        }
    }

    /// The link inside a host with `protocol`, for ranks crowded as `crowding`: LL
    /// where every rank has a CPU of its own moves [`DEDICATED_LL_GAIN`] times the
    /// bytes per second of `local_ll`.
    fn local_for(&self, protocol: Protocol, crowding: Crowding) -> LinkCost {
        let link = self.local(protocol);
        match protocol == Protocol::LL && !crowding.outnumbered() {
            true => LinkCost {
                beta: link.beta * DEDICATED_LL_GAIN,
                ..link
            },
            false => link,
        }
    }

    /// What paces a pipeline through every rank: one host, its local link; several,
    /// the network's latency and the slower of the two bandwidths.
    fn pace(&self, shape: Shape, protocol: Protocol) -> LinkCost {
        let local = self.local_for(protocol, shape.crowding);
        if shape.hosts <= 1 {
            local
        } else if shape.ranks_per_host > 1 {
            LinkCost {
                alpha: self.net.alpha,
                beta: self.net.beta.min(local.beta),
            }
        } else {
            self.net
        }
    }

    /// One pass down (or up) the tree: ⌈log₂ hosts⌉ network levels and the host chain.
    fn tree_pass(&self, shape: Shape, protocol: Protocol) -> f64 {
        let levels = (shape.hosts.max(1) as f64).log2().ceil();
        let chain = shape.ranks_per_host.max(1) as f64 - 1.0;
        levels * self.net.alpha + chain * self.local(protocol).alpha
    }

    /// Whether recursive doubling is a candidate for the automatic choice: on one host.
    /// Across hosts it has not been measured. Where ranks have a CPU each the model never
    /// picks it (the two-shot has as many hand-offs and fewer bytes); where they share
    /// CPUs, bound in blocks, it takes the middle sizes: 3 and 4 ranks on 2 cores
    /// (2026-11-28) and 8 (2026-11-29: far, the fastest from 1 to 32 KiB, 8 KiB 24–27 µs
    /// against the two-shot's 35–41 and the one-shot's 49–57; near, within 15 % of the
    /// two-shot from 2 to 32 KiB and ahead of Intel MPI by 1.2–1.5×).
    pub fn doubling_pays(shape: Shape) -> bool {
        shape.hosts <= 1
    }

    /// Predicted seconds for an all-reduce of `bytes` with `choice`.
    pub fn all_reduce(&self, choice: Choice, bytes: usize, shape: Shape) -> f64 {
        let n = shape.ranks.max(1) as f64;
        if shape.ranks <= 1 {
            return 0.0;
        }
        let s = bytes as f64;
        let pace = self.pace(shape, choice.protocol);
        let n1 = n - 1.0;
        // While a pipeline fills, its later links wait. With a CPU per rank that is
        // time lost; when ranks outnumber CPUs, the CPUs are what is short, and other
        // ranks run meanwhile: only the running share of the fill is paid.
        let fill = shape.crowding.running_share();
        // A hand-off to a rank that shares its CPU with others waits for their turns
        // ([`Crowding::queue`], `q` ranks to a CPU): a step of a chain (ring, tree) waits
        // on one peer, `q` turns; the one-shot's round waits on every peer, and each of
        // a CPU's `q` ranks runs once to post and once more to fold, `2q − 1` turns; the
        // two-shot's rounds wait, besides, on every peer's fold, `q²` each.
        let q = shape.crowding.queue();
        let (step, one_shot_round, two_shot_round) = (q, 2.0 * q - 1.0, q * q);
        let round_bytes = shape.crowding.round_bytes();
        match choice.algorithm {
            Algorithm::OneShot => {
                // A CPU folds the n − 1 buffers of each of its ranks in turn, the k-th
                // rank's done after k of them: (q + 1)/2 folds on average.
                one_shot_round * pace.alpha
                    + (q + 1.0) / 2.0 * (n1 * s / pace.beta + n1 * n1 / n * s / self.local.beta)
            }
            Algorithm::TwoShot => {
                // Through the FIFOs the reduce-scatter's blocks land in scratch and are
                // folded in one more pass; a single-copy read lands in a cache-sized
                // staging buffer and is folded from there, as the ring's slices are.
                let fold = match choice.protocol {
                    Protocol::SingleCopy => 0.0,
                    _ => n1 / n * s / self.local.beta,
                };
                2.0 * two_shot_round * pace.alpha
                    + round_bytes * (2.0 * n1 / n * s / pace.beta + fold)
            }
            Algorithm::Doubling => {
                // log₂ p rounds on one peer each (p the largest power of two not above
                // n). A round waits on one peer, as a chain's step does, and the
                // exchange as a whole ¾ of one more; a round's fold costs half
                // of the one-shot's per byte (it reads the partner's sum from the FIFO
                // and its own from cache). Both fitted so that the model's crossovers
                // fall where the measured ones do (4 ranks on 2 cores, 8–64 KiB:
                // doubling 0.35 µs per KiB, two-shot 0.27; see the tests). Where the
                // ranks are bound in blocks, the first rounds pair ranks of one CPU (8
                // ranks on 2: the first two of three), whose partner's sum is in that
                // CPU's cache; only the rounds across CPUs queue their bytes
                // ([`Crowding::round_bytes`]). Where it is a candidate:
                // [`CostModel::doubling_pays`].
                let p = 1usize << shape.ranks.ilog2();
                let exchange = s / pace.beta + s / (2.0 * self.local.beta);
                // Rounds pair the doubling ranks by their number among the p.
                let rank = |v| doubling_rank(v, shape.ranks);
                let doubling = 0.75 * pace.alpha
                    + (0..p.ilog2())
                        .map(|k| {
                            let partner_shares_cpu = (0..p)
                                .all(|v| shape.crowding.share_cpu(rank(v), rank(v ^ (1 << k))));
                            let bytes = if partner_shares_cpu { 1.0 } else { round_bytes };
                            step * pace.alpha + bytes * exchange
                        })
                        .sum::<f64>();
                // The pairs beyond the power of two: ranks 2j + 1 hand their inputs to
                // 2j and get the result back, two hand-offs of the whole buffer and a
                // fold. Where each pair shares a CPU, a hand-off is a switch between
                // the two on warm caches: one turn, α, and the bytes at 4 times the
                // link's bandwidth, fitted to 3 ranks on 2 cores (2026-11-28 and 29;
                // see the tests): the measured slopes of doubling and the two-shot were
                // equal there, doubling's intercept lower, and the one-shot hands over
                // to it between 8 and 16 KiB (8 KiB 5.3–5.6 µs against 5.9–6.3).
                let extra = shape.ranks - p;
                let pairs_share_cpus =
                    (0..extra).all(|j| shape.crowding.share_cpu(2 * j, 2 * j + 1));
                let hand_overs = if extra == 0 {
                    0.0
                } else if pairs_share_cpus {
                    2.0 * (pace.alpha + s / (4.0 * pace.beta))
                } else {
                    2.0 * (step * pace.alpha + s / pace.beta) + s / (2.0 * self.local.beta)
                };
                doubling + hand_overs
            }
            Algorithm::Ring => {
                2.0 * n1 * step * pace.alpha
                    + 2.0 * n1 / n * s / pace.beta
                    + fill * (2.0 * n - 3.0) * (s / n).min(RING_SLICE) / pace.beta
            }
            Algorithm::Tree => {
                2.0 * step * self.tree_pass(shape, choice.protocol)
                    + 2.0 * s / pace.beta
                    + fill * 2.0 * self.tree_depth(shape) * s.min(RING_SLICE) / pace.beta
            }
        }
    }

    /// Links from a leaf of the tree to its root: ⌈log₂ hosts⌉ levels and the host chain
    /// (the pipeline's fill, slice by slice, up and down).
    fn tree_depth(&self, shape: Shape) -> f64 {
        (shape.hosts.max(1) as f64).log2().ceil() + shape.ranks_per_host.max(1) as f64 - 1.0
    }

    /// Predicted seconds for a broadcast of `bytes` with `choice`: a pipelined chain
    /// along the ring, `(n−1)·α + S/β`, down the tree, `(d·α_net + (k−1)·α_local) +
    /// 2·S/β` (an inner node sends each chunk to two children), or straight from the
    /// root, `α + (n−1)·S/β`.
    pub fn broadcast(&self, choice: Choice, bytes: usize, shape: Shape) -> f64 {
        if shape.ranks <= 1 {
            return 0.0;
        }
        let s = bytes as f64;
        let n1 = shape.ranks as f64 - 1.0;
        let pace = self.pace(shape, choice.protocol);
        match choice.algorithm {
            Algorithm::OneShot => pace.alpha + n1 * s / pace.beta,
            Algorithm::TwoShot | Algorithm::Doubling => f64::INFINITY,
            Algorithm::Ring => n1 * pace.alpha + s / pace.beta,
            Algorithm::Tree => self.tree_pass(shape, choice.protocol) + 2.0 * s / pace.beta,
        }
    }

    /// Predicted seconds for `collective` on `bytes` per rank (its count times the
    /// element size) with `choice`. All-reduce and broadcast as above; reduce as a
    /// broadcast (chain, tree, or straight to the root, which then folds n−1 buffers);
    /// all-gather and reduce-scatter `n−1` ring steps of one block, or one-shot: one
    /// hand-off and the same blocks (reduce-scatter folding them); the direct
    /// collectives and send/recv one hand-off and the blocks they move.
    pub fn time(&self, collective: Collective, choice: Choice, bytes: usize, shape: Shape) -> f64 {
        if !choice.algorithm.applies_to(collective)
            || !choice
                .protocol
                .carries(collective, choice.algorithm, shape.ranks)
            || (choice.protocol == Protocol::SingleCopy && shape.hosts > 1)
        {
            return f64::INFINITY;
        }
        let n1 = shape.ranks.saturating_sub(1) as f64;
        let s = bytes as f64;
        let pace = self.pace(shape, choice.protocol);
        let one_shot = choice.algorithm == Algorithm::OneShot;
        let fold = n1 * s / self.local.beta;
        match collective {
            Collective::AllReduce => self.all_reduce(choice, bytes, shape),
            // A reduce is a broadcast run backwards: the same chain or tree, the same
            // bytes per link.
            Collective::Broadcast { .. } => self.broadcast(choice, bytes, shape),
            Collective::Reduce { .. } if one_shot => self.broadcast(choice, bytes, shape) + fold,
            Collective::Reduce { .. } => self.broadcast(choice, bytes, shape),
            Collective::AllGather if one_shot => pace.alpha + n1 * s / pace.beta,
            Collective::ReduceScatter if one_shot => pace.alpha + n1 * s / pace.beta + fold,
            Collective::AllGather | Collective::ReduceScatter => n1 * (pace.alpha + s / pace.beta),
            Collective::AllToAll | Collective::Gather { .. } | Collective::Scatter { .. } => {
                pace.alpha + n1 * s / pace.beta
            }
            Collective::Send { .. } | Collective::Recv { .. } => pace.alpha + s / pace.beta,
        }
    }

    /// The fastest of `algorithms` × `protocols` for `collective` on `bytes` per rank;
    /// ties go to the earlier algorithm, then the earlier protocol. Across hosts LL is a
    /// candidate only when it is the only protocol allowed, and recursive doubling only
    /// where it [pays](Self::doubling_pays) or is the only algorithm allowed. When none
    /// of `algorithms` applies to the collective, the ring with the first protocol.
    pub fn best(
        &self,
        collective: Collective,
        bytes: usize,
        shape: Shape,
        algorithms: &[Algorithm],
        protocols: &[Protocol],
    ) -> Choice {
        let across_hosts = [Protocol::Simple];
        let protocols = if shape.hosts > 1 && protocols.contains(&Protocol::Simple) {
            &across_hosts[..]
        } else {
            protocols
        };
        let mut best: Option<(Choice, f64)> = None;
        let offered = |a: &&Algorithm| {
            **a != Algorithm::Doubling || algorithms.len() == 1 || Self::doubling_pays(shape)
        };
        for &algorithm in algorithms.iter().filter(offered) {
            for &protocol in protocols {
                let c = Choice {
                    algorithm,
                    protocol,
                };
                let t = self.time(collective, c, bytes, shape);
                if t.is_finite() && best.is_none_or(|(_, b)| t < b) {
                    best = Some((c, t));
                }
            }
        }
        // Nothing applies: the ring, with the first protocol that can carry it.
        let fallback = || Choice {
            algorithm: Algorithm::Ring,
            protocol: protocols
                .iter()
                .copied()
                .find(|p| {
                    p.carries(collective, Algorithm::Ring, shape.ranks)
                        && (*p != Protocol::SingleCopy || shape.hosts <= 1)
                })
                .unwrap_or_default(),
        };
        best.map_or_else(fallback, |(c, _)| c)
    }

    /// The model's pick for an all-reduce of `bytes` among ring and tree and every
    /// protocol.
    pub fn choose(&self, bytes: usize, shape: Shape) -> Choice {
        self.best(
            Collective::AllReduce,
            bytes,
            shape,
            &[Algorithm::Ring, Algorithm::Tree],
            &Protocol::ALL,
        )
    }

    /// The size from which [`CostModel::choose`]'s pick stops satisfying `below` (for
    /// example "is the tree", "is LL"), if it satisfies it for 1 byte. Each choice
    /// changes once as the size grows, so a binary search finds it.
    pub fn crossover(&self, shape: Shape, below: impl Fn(Choice) -> bool) -> Option<usize> {
        self.crossover_among(shape, &[Algorithm::Ring, Algorithm::Tree], below)
    }

    /// [`CostModel::crossover`] for the all-reduce pick among `algorithms` (and every
    /// protocol).
    pub fn crossover_among(
        &self,
        shape: Shape,
        algorithms: &[Algorithm],
        below: impl Fn(Choice) -> bool,
    ) -> Option<usize> {
        let pick = |bytes| {
            self.best(
                Collective::AllReduce,
                bytes,
                shape,
                algorithms,
                &Protocol::ALL,
            )
        };
        if !below(pick(1)) {
            return None;
        }
        let (mut lo, mut hi) = (1usize, 1usize << 40);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if below(pick(mid)) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_ranks_a_cpu_runs() {
        let per_cpu = |ranks, cpus| Crowding { ranks, cpus }.per_cpu();
        assert_eq!(Crowding::NONE.per_cpu(), 1);
        assert_eq!(per_cpu(2, 2), 1);
        assert_eq!(per_cpu(2, 16), 1);
        assert_eq!(per_cpu(3, 2), 2);
        assert_eq!(per_cpu(4, 2), 2);
        assert_eq!(per_cpu(8, 2), 4);
        assert_eq!(per_cpu(5, 1), 5);
    }

    fn shape(ranks: usize, hosts: usize) -> Shape {
        Shape::even(ranks, hosts)
    }

    /// `ranks` on one host that has `cpus` CPUs.
    fn on_cpus(ranks: usize, cpus: usize) -> Shape {
        Shape {
            crowding: Crowding { ranks, cpus },
            ..shape(ranks, 1)
        }
    }

    /// A two-shot over single copy folds what it reads from a cache-sized staging
    /// buffer, with no pass over scratch: priced so, 8 ranks on 2 CPUs reading each
    /// other's buffers in place take it from 512 KiB, where the ring was picked and
    /// measured 1.2–1.5× slower (2026-11-29, an Intel host, far, busbw out of place:
    /// windows, 8 rank processes, 512 KiB–8 MiB 2.10–2.63 against 1.53–1.76; 8 rank
    /// threads 1.93–2.46 against 1.57–1.76), while the ring keeps 128 KiB (1.73 against
    /// 1.29–1.38 for the ring, forced) and plain buffers keep the FIFOs.
    #[test]
    fn crowded_ranks_reading_in_place_take_the_two_shot_over_single_copy() {
        let in_place = CostModel::default().reading_in_place();
        let eight = on_cpus(8, 2);
        let pick = |m: &CostModel, bytes| {
            m.best(
                Collective::AllReduce,
                bytes,
                eight,
                &Algorithm::ALL,
                &Protocol::ALL,
            )
        };
        let two_shot_single = Choice {
            algorithm: Algorithm::TwoShot,
            protocol: Protocol::SingleCopy,
        };
        assert_eq!(pick(&in_place, 128 << 10), Choice::RING_SIMPLE);
        for bytes in [512 << 10, 2 << 20, 8 << 20] {
            assert_eq!(pick(&in_place, bytes), two_shot_single, "{bytes} B");
        }
        // Plain buffers between processes (single copy through the kernel) keep the ring.
        let plain = CostModel::default();
        for bytes in [512 << 10, 2 << 20, 8 << 20] {
            assert_eq!(pick(&plain, bytes), Choice::RING_SIMPLE, "{bytes} B");
        }
    }

    /// Where ranks outnumber the CPUs, the ring takes over from the two-shot at a
    /// smaller size: other ranks run while its pipeline fills, and beyond two ranks to a
    /// CPU the two-shot's whole-buffer rounds queue on it. Measured on 2 cores
    /// (2026-11-25, busbw GB/s, three runs each in the near placement): 4 ranks at 512
    /// KiB, two-shot 4.1–6.9, ring 6.9–8.7; 1 MiB 3.0–5.6 against 6.6–9.0. 8 ranks bound
    /// in blocks (2026-11-29, µs, 2–3 interleaved runs): near, 128 KiB two-shot 78–79
    /// against the ring's 105, 256 KiB 156–168 against 169–177, 512 KiB 544–592 against
    /// 235–248; far, 64 KiB 84–98 against 88–116, 128 KiB 126–155 against 120–145, 256
    /// KiB 218–292 against 175–243.
    #[test]
    fn crowded_cpus_move_the_ring_crossover_down() {
        let m = CostModel::default();
        let is_two_shot = |c: Choice| c.algorithm == Algorithm::TwoShot;
        let direct = [Algorithm::Ring, Algorithm::TwoShot];
        for (ranks, crowded) in [(4, 128 << 10..=512 << 10), (8, 64 << 10..=256 << 10)] {
            let free = m
                .crossover_among(shape(ranks, 1), &direct, is_two_shot)
                .unwrap();
            let busy = m
                .crossover_among(on_cpus(ranks, 2), &direct, is_two_shot)
                .unwrap();
            assert!(free > 512 << 10, "{ranks} ranks with a CPU each: {free}");
            assert!(crowded.contains(&busy), "{ranks} ranks on 2 CPUs: {busy}");
        }
        // Ranks with a CPU each are not crowded, however many.
        assert_eq!(Crowding { ranks: 8, cpus: 8 }.running_share(), 1.0);
        assert_eq!(Crowding { ranks: 8, cpus: 2 }.running_share(), 0.25);
        assert_eq!(Crowding { ranks: 4, cpus: 2 }.round_bytes(), 1.0);
        assert_eq!(Crowding { ranks: 8, cpus: 2 }.round_bytes(), 2.0);
    }

    /// Where ranks outnumber the CPUs, a direct round waits on the turns of every
    /// peer's CPU, so the one-shot keeps the small sizes longer and the two-shot the
    /// middle ones. Measured on 2 cores, ranks bound in blocks, µs, one-shot against
    /// two-shot: 3 ranks (2026-11-28, near) 8 KiB 5.4–5.6 vs 6.1–6.3, 32 KiB 14.2–14.7
    /// vs 12.8–13.0; 4 ranks (2026-11-28) 2 KiB 6.5 vs 8.1, 16 KiB 14.3 vs 13.6; 8
    /// ranks (2026-11-29) 512 B 9.2–11.4 vs 16.2 near, 8 KiB 22.7–23.2 vs 19.8–20.0 near
    /// and 49–57 vs 35–41 far. The one-shot's round, 8 B: 2.0–2.1 µs on 3 ranks, 3.0 on
    /// 4, 8.4 near and 11.1–11.4 far on 8, where `(2q − 1)·α` gives 2, 3 and 7. On 8
    /// ranks the model hands the one-shot to the two-shot at 9 KB, later than measured
    /// (about 5 KiB near, below 2 KiB far); with doubling offered, as it is by default,
    /// doubling takes over from 1.8 KB.
    #[test]
    fn crowded_cpus_keep_the_direct_algorithms_for_their_sizes() {
        let m = CostModel::default();
        let crowded = |ranks| on_cpus(ranks, 2);
        let direct = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Ring];
        let pick = |ranks, bytes| {
            m.best(
                Collective::AllReduce,
                bytes,
                crowded(ranks),
                &direct,
                &[Protocol::Simple],
            )
            .algorithm
        };
        for (ranks, one_shot, two_shot, ring) in [
            (3, 8 << 10, [32 << 10, 256 << 10], 1 << 20),
            (4, 2 << 10, [16 << 10, 256 << 10], 1 << 20),
            (8, 512, [16 << 10, 64 << 10], 256 << 10),
        ] {
            assert_eq!(pick(ranks, one_shot), Algorithm::OneShot, "{ranks} ranks");
            for bytes in two_shot {
                assert_eq!(pick(ranks, bytes), Algorithm::TwoShot, "{ranks} ranks");
            }
            assert_eq!(pick(ranks, ring), Algorithm::Ring, "{ranks} ranks");
        }
        assert_eq!(Crowding { ranks: 8, cpus: 2 }.queue(), 4.0);
        assert_eq!(Crowding { ranks: 2, cpus: 2 }.queue(), 1.0);
    }

    /// Recursive doubling waits on one peer per round: with two ranks to each CPU it
    /// takes the sizes between the one-shot's and the two-shot's. Measured on 2 cores,
    /// 4 ranks, 2026-11-28, one-shot / doubling / two-shot, µs: bound two to a CPU as
    /// the launchers bind them (round robin then; blocks measure the same at 1–32 KiB; 3
    /// interleaved runs), 1 KiB 4.8 / 4.8 / 7.5, 2 KiB 6.5 / 6.6
    /// / 8.1, 4 KiB 8.9 / 6.8 / 9.0, 8 KiB 11.9 / 8.2 / 11.5, 16 KiB 14.3 / 10.4 /
    /// 13.6, 32 KiB 21.7 / 16.4 / 17.9, 64 KiB 42.9 / 27.9 / 26.6; left free (medians
    /// of 7 to 18 runs), 2 KiB 5.7 / 7.2 / 8.7, 4 KiB 7.9 / 8.0 / 10.9, 8 KiB 10.5 /
    /// 9.8 / 12.5, 16 KiB 14.8 / 13.0 / 14.1, 32 KiB 23.4 / 19.6 / 18.5. 3 ranks on 2
    /// cores (bound in blocks, so the hand-over's pair shares a CPU; 2026-11-28, 3
    /// interleaved runs near, one-shot / doubling / two-shot, µs): 8 KiB 5.4–5.6 /
    /// 6.1–6.3 / 6.1–6.3, 16 KiB 8.8–8.9 / 8.0–8.1 / 8.7–9.6, 32 KiB 14.2–14.7 /
    /// 12.3–12.4 (one run 15.4) / 12.8–13.0, 64 KiB 20.9–22.1 / 19.6–20.7 / 21.2–21.4,
    /// 128 KiB 41.6–43.0 / 27.2–30.9 / 29.6–30.1; far earlier that night, 32 KiB 10.7–11.0 /
    /// 12.8–13.1 (two-shot), 128 KiB 28.9–29.7 / 31.0–31.6; 512 KiB two-shot 93–109,
    /// doubling 118–123, ring 94–99. 8 ranks on 2 cores in blocks (2026-11-29, 2–3
    /// interleaved runs, one-shot / doubling / two-shot / ring / Intel MPI, µs): far, 2
    /// KiB 23.5–26.9 / 15.9–18.9 / 22.1–22.5 / 44–57 / 20.9–26.2, 8 KiB 48.6–57.0 /
    /// 23.6–27.4 / 35.2–40.8 / 56–59 / 42.8–47.2, 32 KiB 162–207 / 46.6–47.8 / 62.1–72.8
    /// / 52–83 / 64.4–68.9, 64 KiB doubling 82–95, two-shot 84–98, ring 88–116, Intel MPI
    /// 87–91; near, 512 B 9.2–11.4 / 14.8–15.0 / 16.2 / – / 17.4–21.2, 2 KiB 12.5–14.1 /
    /// 16.3–16.5 / 16.6–16.9 / – / 20.0–21.3, 8 KiB 22.7–23.2 / 23.1 / 19.8–20.0 / – /
    /// 34.1–34.7, 32 KiB 79–121 / 36.8–37.2 / 30.8–33.2 / – / 51.1–51.7, 64 KiB doubling
    /// 67–71, two-shot 46–47, ring 86–94, Intel MPI 68–71. Near the two-shot leads from
    /// 4 to 128 KiB and far doubling: the model gives doubling the sizes between the
    /// one-shot's and the ring's, which lead Intel MPI in both placements. Wherever ranks
    /// have a CPU each doubling loses (the two-shot has its hand-offs and fewer bytes).
    #[test]
    fn recursive_doubling_for_the_middle_sizes_of_ranks_that_share_cpus() {
        let m = CostModel::default();
        let protocols = [Protocol::Simple, Protocol::LL];
        let pick = |shape, bytes| {
            m.best(
                Collective::AllReduce,
                bytes,
                shape,
                &Algorithm::ALL,
                &protocols,
            )
            .algorithm
        };
        let four = on_cpus(4, 2);
        use Algorithm::{Doubling, OneShot, Ring, TwoShot};
        let picks: [(usize, &[(usize, Algorithm)]); 3] = [
            (
                4,
                &[
                    (256, OneShot),
                    (2 << 10, OneShot),
                    (4 << 10, Doubling),
                    (16 << 10, Doubling),
                    (32 << 10, Doubling),
                    (64 << 10, TwoShot),
                ],
            ),
            (
                3,
                &[
                    (4 << 10, OneShot),
                    (16 << 10, Doubling),
                    (32 << 10, Doubling),
                    (128 << 10, Doubling),
                    (1 << 20, Ring),
                ],
            ),
            (
                8,
                &[
                    (512, OneShot),
                    (2 << 10, Doubling),
                    (8 << 10, Doubling),
                    (64 << 10, Doubling),
                    (128 << 10, Ring),
                ],
            ),
        ];
        for (ranks, sizes) in picks {
            for &(bytes, algorithm) in sizes {
                let picked = pick(on_cpus(ranks, 2), bytes);
                assert_eq!(picked, algorithm, "{ranks} ranks, {bytes} B");
            }
        }
        // The hand-over's pairs share a CPU only where the blocks put them together.
        let six = Crowding { ranks: 6, cpus: 4 };
        assert!(six.share_cpu(0, 1) && !six.share_cpu(2, 3));
        assert!(!Crowding { ranks: 3, cpus: 4 }.share_cpu(0, 1));
        for shape in [
            shape(8, 2),
            on_cpus(3, 3),
            on_cpus(6, 4),
            on_cpus(4, 4),
            on_cpus(2, 2),
            shape(4, 4),
        ] {
            for bytes in (3..24).map(|k| 1usize << k) {
                assert_ne!(
                    pick(shape, bytes),
                    Algorithm::Doubling,
                    "{shape:?}, {bytes} B"
                );
            }
        }
        // Not a broadcast, and not through shared buffers.
        let doubling = Choice {
            algorithm: Algorithm::Doubling,
            protocol: Protocol::Simple,
        };
        assert!(
            m.time(Collective::Broadcast { root: 0 }, doubling, 8 << 10, four)
                .is_infinite()
        );
        let single = Choice {
            protocol: Protocol::SingleCopy,
            ..doubling
        };
        assert!(
            m.time(Collective::AllReduce, single, 8 << 10, four)
                .is_infinite()
        );
    }

    fn is_tree(c: Choice) -> bool {
        c.algorithm == Algorithm::Tree
    }

    #[test]
    fn ring_for_bandwidth_tree_for_latency_across_hosts() {
        let m = CostModel::default();
        let one_host = shape(8, 1);
        assert_eq!(
            m.choose(8, one_host).algorithm,
            Algorithm::Ring,
            "a chain gains nothing"
        );
        assert_eq!(m.crossover(one_host, is_tree), None);
        let hosts = shape(16, 16);
        assert_eq!(m.choose(8, hosts).algorithm, Algorithm::Tree);
        assert_eq!(m.choose(1 << 30, hosts), Choice::RING_SIMPLE);
        let x = m.crossover(hosts, is_tree).unwrap();
        assert_eq!(m.choose(x - 1, hosts).algorithm, Algorithm::Tree);
        assert_eq!(m.choose(x, hosts).algorithm, Algorithm::Ring);
        // More hosts: the ring's latency grows linearly, the tree's logarithmically, so
        // the tree stays ahead for larger messages.
        assert!(m.crossover(shape(64, 64), is_tree).unwrap() > x);
    }

    #[test]
    fn ll_for_small_messages_inside_a_host_simple_for_large_and_across_hosts() {
        let m = CostModel::default();
        let is_ll = |c: Choice| c.protocol == Protocol::LL;
        for ranks in [2, 4, 8] {
            let one_host = shape(ranks, 1);
            assert_eq!(
                m.choose(8, one_host).protocol,
                Protocol::LL,
                "{ranks} ranks"
            );
            assert_eq!(m.choose(1 << 26, one_host), Choice::RING_SIMPLE);
            let x = m.crossover(one_host, is_ll).unwrap();
            assert!(m.choose(x - 1, one_host).protocol == Protocol::LL);
            assert!(m.choose(x, one_host).protocol == Protocol::Simple);
            // Where the ring's 2(n-1) hand-offs, 2(n-1)/n S bytes and (2n-3) S/n bytes of
            // pipeline fill cost the same with either protocol:
            // S = 2(n-1) n (a_Simple - a_LL) / ((4n-5) (1/b_LL - 1/b_Simple)).
            // Every rank with a CPU of its own (this shape): LL's faster bytes.
            let (simple, ll) = (m.local, m.local_for(Protocol::LL, one_host.crowding));
            assert_eq!(ll.beta, m.local_ll.beta * DEDICATED_LL_GAIN);
            let n = ranks as f64;
            let at = 2.0 * (n - 1.0) * n * (simple.alpha - ll.alpha)
                / ((4.0 * n - 5.0) * (1.0 / ll.beta - 1.0 / simple.beta));
            assert!((x as f64 - at).abs() <= at * 1e-6 + 2.0, "{x} vs {at}");
        }
        // Across hosts LL would slice the TCP traffic finely: Simple unless forced.
        for hosts in [shape(4, 4), shape(8, 2)] {
            for bytes in [8, 1 << 20] {
                assert_eq!(m.choose(bytes, hosts).protocol, Protocol::Simple);
            }
            let tree_ll = Choice {
                algorithm: Algorithm::Tree,
                protocol: Protocol::LL,
            };
            let forced = m.best(
                Collective::AllReduce,
                8,
                hosts,
                &[Algorithm::Tree],
                &[Protocol::LL],
            );
            assert_eq!(forced, tree_ll);
        }
        // Forcing a protocol is honoured whatever it costs.
        let forced = m.best(
            Collective::AllReduce,
            1 << 26,
            shape(4, 1),
            &[Algorithm::Ring],
            &[Protocol::LL],
        );
        assert_eq!(forced.protocol, Protocol::LL);
    }

    /// LL moves bytes faster where every rank has a CPU (its FIFOs exchange slots):
    /// 2 ranks with a core each take it up to 16 KiB and Simple from 32 KiB, as
    /// measured; ranks that share CPUs keep `local_ll` and hand over to Simple sooner.
    #[test]
    fn ll_reaches_further_where_every_rank_has_a_cpu() {
        let m = CostModel::default();
        let pick = |bytes, shape| m.choose(bytes, shape).protocol;
        let two = on_cpus(2, 2);
        assert_eq!(pick(16 << 10, two), Protocol::LL);
        assert_eq!(pick(32 << 10, two), Protocol::Simple);
        let is_ll = |c: Choice| c.protocol == Protocol::LL;
        let one_shot = [Algorithm::OneShot];
        let dedicated = m.crossover_among(two, &one_shot, is_ll).unwrap();
        assert!((20_000..28_000).contains(&dedicated), "{dedicated}");
        for crowded in [on_cpus(2, 1), on_cpus(4, 2)] {
            assert_eq!(m.local_for(Protocol::LL, crowded.crowding), m.local_ll);
            let x = m.crossover_among(crowded, &one_shot, is_ll).unwrap();
            assert!(x < dedicated / 2, "{crowded:?}: {x} against {dedicated}");
        }
        // Simple's and single copy's links are the same either way.
        for p in [Protocol::Simple, Protocol::SingleCopy] {
            assert_eq!(m.local_for(p, two.crowding), m.local(p));
        }
    }

    #[test]
    fn every_collective_gets_a_protocol_and_its_algorithms_compete() {
        let m = CostModel::default();
        let four = shape(4, 1);
        let all = [
            Algorithm::Ring,
            Algorithm::Tree,
            Algorithm::OneShot,
            Algorithm::TwoShot,
        ];
        let pick = |c, bytes| m.best(c, bytes, four, &all, &Protocol::ALL);
        // Small: one hand-off wins wherever the one-shot applies; the collectives with
        // one plan keep it.
        for c in [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::Reduce { root: 1 },
            Collective::Broadcast { root: 1 },
        ] {
            let small = pick(c, 8);
            assert_eq!(
                (small.algorithm, small.protocol),
                (Algorithm::OneShot, Protocol::LL)
            );
        }
        for c in [Collective::AllToAll, Collective::Send { peer: 1 }] {
            assert_eq!(pick(c, 8).algorithm, Algorithm::Ring, "{c:?}");
            assert_eq!(pick(c, 1 << 26), Choice::RING_SIMPLE, "{c:?}");
        }
        // Large: the ring's pipeline, except all-gather, whose one-shot moves the same
        // bytes with fewer hand-offs.
        for c in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Reduce { root: 1 },
            Collective::Broadcast { root: 1 },
        ] {
            assert_eq!(pick(c, 1 << 26), Choice::RING_SIMPLE, "{c:?}");
        }
        assert_eq!(
            pick(Collective::AllGather, 1 << 26).algorithm,
            Algorithm::OneShot
        );
        // All-reduce: one-shot, then two-shot, then ring as the size grows.
        let order: Vec<Algorithm> = [8usize, 1 << 10, 16 << 10, 1 << 20, 1 << 26]
            .iter()
            .map(|&b| pick(Collective::AllReduce, b).algorithm)
            .collect();
        assert_eq!(
            order,
            [
                Algorithm::OneShot,
                Algorithm::OneShot,
                Algorithm::TwoShot,
                Algorithm::Ring,
                Algorithm::Ring
            ]
        );
        // An algorithm that does not apply is never picked; with none, the ring.
        let bcast = m.best(
            Collective::Broadcast { root: 0 },
            8,
            four,
            &[Algorithm::TwoShot],
            &[Protocol::Simple],
        );
        assert_eq!(bcast.algorithm, Algorithm::Ring);
    }

    #[test]
    fn direct_algorithms_trade_hand_offs_for_bytes() {
        let m = CostModel::default();
        let simple = [Protocol::Simple];
        let ar = Collective::AllReduce;
        for ranks in [2, 3, 4, 8] {
            let s = shape(ranks, 1);
            let t = |a: Algorithm, bytes: usize| {
                m.time(
                    ar,
                    Choice {
                        algorithm: a,
                        protocol: Protocol::Simple,
                    },
                    bytes,
                    s,
                )
            };
            // One hand-off against the ring's 2(n-1) for a tiny message.
            assert!(t(Algorithm::OneShot, 8) < t(Algorithm::TwoShot, 8));
            // Two hand-offs against 2(n-1): the same for two ranks.
            if ranks > 2 {
                assert!(t(Algorithm::TwoShot, 8) < t(Algorithm::Ring, 8));
            }
            // The one-shot's bytes grow with n: it loses for large messages.
            assert!(t(Algorithm::OneShot, 1 << 26) > t(Algorithm::Ring, 1 << 26));
            let pick = m.best(ar, 8, s, &[Algorithm::Ring, Algorithm::OneShot], &simple);
            assert_eq!(pick.algorithm, Algorithm::OneShot, "{ranks} ranks");
        }
    }

    #[test]
    fn link_costs_and_models_parse() {
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
        let m = CostModel::default();
        let back = CostModel::parse("rank 0", &m.to_text()).unwrap();
        assert!(back.local.about(m.local) && back.local_ll.about(m.local_ll));
        assert!(back.local_single.about(m.local_single));
        assert!(back.local_in_place.about(m.local_in_place));
        assert!(!back.local_single.about(m.local_in_place));
        assert!(back.net.about(m.net), "{back:?}");
        let err = CostModel::parse("rank 0", "1,2;3,4")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 0")
                && err.contains("local;local_ll;local_single;local_in_place;net"),
            "{err}"
        );
    }
}
