//! Schedules: what every rank does, step by step, for one collective.
//!
//! A [`Plan`] is pure data, made without I/O, threads or `unsafe`. It lists, for one
//! rank, the [`Step`]s it performs, grouped into [`Lane`]s: steps within a lane happen in
//! order, lanes progress independently (a ring channel is a lane; each peer of an
//! all-to-all is a lane). Steps use NCCL's vocabulary of device primitives (`send`,
//! `recv`, `recvReduceSend`, `recvReduceCopySend`, `recvCopySend`, …) and name the
//! element ranges they read and write ([`Region`]): of the caller's two buffers, or of
//! scratch memory the call provides where partial results belong in neither.
//!
//! The same plan is consumed by the engine (real transports, real kernels), by the
//! simulator in [`sim`] (in-memory vectors; what the tests use) and by the visualizer, so
//! what is drawn and checked is what runs.
//!
//! # Invariants every plan keeps
//! - Each message is one step's region, sent by one step and received by one step of the
//!   peer, in the same order on each (channel, sender, receiver) FIFO, with equal lengths.
//! - In a reducing collective, a region of the input buffer read by a step is the rank's
//!   own contribution (the engine applies the op's pre-operation, e.g. the pre-multiplier,
//!   to it); a region of the output buffer holds a partial or final result and gets no
//!   pre-operation. `RecvReduceCopySend`, `Copy` and `RecvReduceCopy { post: true }`
//!   produce final values (the engine applies the post-operation, e.g. the division of
//!   `avg`, there); `RecvReduceCopy { post: false }` stores a partial sum that later steps
//!   of the same rank add to (trees).
//! - A lane never sends more than [`PlanOptions::chunk_elems`] elements in one step. With
//!   chunks no larger than half a FIFO a ring cannot deadlock: the sender can always get
//!   one chunk ahead of its receiver.
//! - Steps with no elements are left out (on both ends alike).
//!
//! This file holds the plan's types and [`plan`], which picks a builder; the builders
//! are one file per algorithm family, as NCCL keeps one per collective and Gloo one per
//! algorithm: `ring.rs`, `tree_plans.rs` (over the trees of [`tree`]), `direct.rs`
//! (one-shot, two-shot, all-to-all, gather, scatter) and `doubling.rs` (recursive
//! doubling).

mod direct;
mod doubling;
mod protocol;
mod ring;
pub mod sim;
pub mod tree;
mod tree_plans;
pub use doubling::doubling_rank;
pub use protocol::Protocol;

use std::fmt;

use crate::error::{Error, Result};

/// Which buffer a region lies in: one of the caller's two, or the call's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The send buffer (the rank's contribution).
    Input,
    /// The receive buffer (the result).
    Output,
    /// Memory the call provides for partial results that belong in neither of the
    /// caller's buffers (a non-root rank's partial sums in a tree reduce, where only
    /// the root has a receive buffer); [`Plan::scratch_elems`] says how much.
    Scratch,
}

/// A range of elements of one buffer of one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// Which operation of the plan the buffer belongs to (always 0 unless plans were
    /// fused with [`Plan::fuse`]).
    pub op: usize,
    /// The buffer.
    pub buf: Buf,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl Region {
    /// Elements `offset..offset + len` of the input buffer.
    pub const fn input(offset: usize, len: usize) -> Self {
        Region {
            op: 0,
            buf: Buf::Input,
            offset,
            len,
        }
    }

    /// Elements `offset..offset + len` of the output buffer.
    pub const fn output(offset: usize, len: usize) -> Self {
        Region {
            op: 0,
            buf: Buf::Output,
            offset,
            len,
        }
    }

    /// Elements `offset..offset + len` of the call's scratch buffer.
    pub const fn scratch(offset: usize, len: usize) -> Self {
        Region {
            op: 0,
            buf: Buf::Scratch,
            offset,
            len,
        }
    }

    /// One past the last element.
    pub const fn end(&self) -> usize {
        self.offset + self.len
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.buf {
            Buf::Input => "in",
            Buf::Output => "out",
            Buf::Scratch => "tmp",
        };
        if self.op > 0 {
            write!(f, "{name}#{}[{}..{}]", self.op, self.offset, self.end())
        } else {
            write!(f, "{name}[{}..{}]", self.offset, self.end())
        }
    }
}

/// One primitive step, in NCCL's vocabulary. Peers are ranks of the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send `src` to `to`.
    Send {
        /// Receiving rank.
        to: usize,
        /// What to send.
        src: Region,
    },
    /// Receive a message from `from` into `dst`.
    Recv {
        /// Sending rank.
        from: usize,
        /// Where it lands.
        dst: Region,
    },
    /// Copy `src` to `dst` and send it to `to` (NCCL's `directCopySend`); the copy is
    /// skipped when the two are the same memory (in-place).
    CopySend {
        /// Receiving rank.
        to: usize,
        /// What to copy and send.
        src: Region,
        /// Local copy destination.
        dst: Region,
    },
    /// Receive `x` from `from` and send `x ⊕ src` to `to` (`recvReduceSend`).
    RecvReduceSend {
        /// Sending rank.
        from: usize,
        /// Receiving rank.
        to: usize,
        /// Local operand.
        src: Region,
    },
    /// Receive `x` from `from` and store `x ⊕ src` in `dst` (`recvReduceCopy`), or
    /// `src ⊕ x` with `local_first` (the direct algorithms' rank-order fold, where `src`
    /// is the partial result of the lower ranks and `x` the next rank's contribution).
    /// With `post` the result is final and gets the op's post-operation (avg's
    /// division); without, it is a partial sum that later steps add to (trees, folds).
    RecvReduceCopy {
        /// Sending rank.
        from: usize,
        /// Local operand.
        src: Region,
        /// Result.
        dst: Region,
        /// Whether the result is final.
        post: bool,
        /// Whether the local operand comes first (`src ⊕ x`).
        local_first: bool,
    },
    /// Receive `x`, store `x ⊕ src` in `dst` and send it to `to` (`recvReduceCopySend`).
    RecvReduceCopySend {
        /// Sending rank.
        from: usize,
        /// Receiving rank.
        to: usize,
        /// Local operand.
        src: Region,
        /// Result.
        dst: Region,
    },
    /// Receive `x` from `from`, store it in `dst` and forward it to `to` (`recvCopySend`).
    RecvCopySend {
        /// Sending rank.
        from: usize,
        /// Receiving rank.
        to: usize,
        /// Where it lands.
        dst: Region,
    },
    /// Copy `src` to `dst` locally (skipped when they are the same memory).
    Copy {
        /// Source.
        src: Region,
        /// Destination.
        dst: Region,
    },
    /// Store `a ⊕ b` in `dst`, locally: the fold of the direct algorithms, which combine
    /// the contributions they gathered in rank order (`a` the partial result of the lower
    /// ranks, `b` the next rank's contribution), so that every rank, whatever it
    /// received first, computes the same bits. With `post` the result is final (the
    /// op's post-operation applies).
    Reduce {
        /// First operand (the partial result so far).
        a: Region,
        /// Second operand (the next contribution).
        b: Region,
        /// Result (may be `a` or `b`).
        dst: Region,
        /// Whether the result is final.
        post: bool,
    },
}

impl Step {
    /// Number of elements the step moves.
    pub fn len(&self) -> usize {
        match *self {
            Step::Send { src, .. }
            | Step::CopySend { src, .. }
            | Step::RecvReduceSend { src, .. }
            | Step::RecvReduceCopy { src, .. }
            | Step::RecvReduceCopySend { src, .. }
            | Step::Copy { src, .. } => src.len,
            Step::Recv { dst, .. } | Step::RecvCopySend { dst, .. } | Step::Reduce { dst, .. } => {
                dst.len
            }
        }
    }

    /// Whether the step moves no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rank this step receives from, if any.
    pub fn recv_from(&self) -> Option<usize> {
        match *self {
            Step::Recv { from, .. }
            | Step::RecvReduceSend { from, .. }
            | Step::RecvReduceCopy { from, .. }
            | Step::RecvReduceCopySend { from, .. }
            | Step::RecvCopySend { from, .. } => Some(from),
            Step::Send { .. } | Step::CopySend { .. } | Step::Copy { .. } | Step::Reduce { .. } => {
                None
            }
        }
    }

    /// The rank this step sends to, if any.
    pub fn send_to(&self) -> Option<usize> {
        match *self {
            Step::Send { to, .. }
            | Step::CopySend { to, .. }
            | Step::RecvReduceSend { to, .. }
            | Step::RecvReduceCopySend { to, .. }
            | Step::RecvCopySend { to, .. } => Some(to),
            Step::Recv { .. }
            | Step::RecvReduceCopy { .. }
            | Step::Copy { .. }
            | Step::Reduce { .. } => None,
        }
    }

    /// The step's local regions (what it reads, then what it writes).
    pub fn regions(&self) -> impl Iterator<Item = Region> {
        let mut step = *self;
        let [a, b, c] = step.regions_mut().map(|r| r.copied());
        [a, b, c].into_iter().flatten()
    }

    fn regions_mut(&mut self) -> [Option<&mut Region>; 3] {
        match self {
            Step::Send { src, .. } | Step::RecvReduceSend { src, .. } => [Some(src), None, None],
            Step::Recv { dst, .. } | Step::RecvCopySend { dst, .. } => [Some(dst), None, None],
            Step::CopySend { src, dst, .. }
            | Step::RecvReduceCopy { src, dst, .. }
            | Step::RecvReduceCopySend { src, dst, .. }
            | Step::Copy { src, dst } => [Some(src), Some(dst), None],
            Step::Reduce { a, b, dst, .. } => [Some(a), Some(b), Some(dst)],
        }
    }

    /// The same step on other regions: each of its regions replaced by `f` of it (a
    /// step on elements `skip..skip + n` of every region, say).
    pub fn map_regions(&self, f: impl Fn(Region) -> Region) -> Step {
        let mut step = *self;
        for r in step.regions_mut().into_iter().flatten() {
            *r = f(*r);
        }
        step
    }

    /// Adds `shift` to the operation index of every region of the step.
    fn shift_ops(&mut self, shift: usize) {
        for r in self.regions_mut().into_iter().flatten() {
            r.op += shift;
        }
    }

    /// NCCL's name for the primitive.
    pub fn name(&self) -> &'static str {
        match self {
            Step::Send { .. } => "send",
            Step::Recv { .. } => "recv",
            Step::CopySend { .. } => "copySend",
            Step::RecvReduceSend { .. } => "recvReduceSend",
            Step::RecvReduceCopy { .. } => "recvReduceCopy",
            Step::RecvReduceCopySend { .. } => "recvReduceCopySend",
            Step::RecvCopySend { .. } => "recvCopySend",
            Step::Copy { .. } => "copy",
            Step::Reduce { .. } => "reduce",
        }
    }

    /// Whether the step is local (no peer: a copy or a fold).
    pub fn is_local(&self) -> bool {
        matches!(self, Step::Copy { .. } | Step::Reduce { .. })
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Step::Send { to, src } => write!(f, "send {src} -> {to}"),
            Step::Recv { from, dst } => write!(f, "recv {from} -> {dst}"),
            Step::CopySend { to, src, dst } => write!(f, "copySend {src} -> {dst}, -> {to}"),
            Step::RecvReduceSend { from, to, src } => {
                write!(f, "recvReduceSend {from} + {src} -> {to}")
            }
            Step::RecvReduceCopy {
                from,
                src,
                dst,
                post,
                local_first,
            } => {
                let done = if post { " (final)" } else { "" };
                if local_first {
                    write!(f, "recvReduceCopy {src} + {from} -> {dst}{done}")
                } else {
                    write!(f, "recvReduceCopy {from} + {src} -> {dst}{done}")
                }
            }
            Step::RecvReduceCopySend { from, to, src, dst } => {
                write!(f, "recvReduceCopySend {from} + {src} -> {dst}, -> {to}")
            }
            Step::RecvCopySend { from, to, dst } => {
                write!(f, "recvCopySend {from} -> {dst}, -> {to}")
            }
            Step::Copy { src, dst } => write!(f, "copy {src} -> {dst}"),
            Step::Reduce { a, b, dst, post } => {
                let done = if post { " (final)" } else { "" };
                write!(f, "reduce {a} + {b} -> {dst}{done}")
            }
        }
    }
}

/// Steps that run in order, on one channel's connections.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Lane {
    /// The channel whose FIFOs the lane's sends and receives use.
    pub channel: usize,
    /// The steps, in order.
    pub steps: Vec<Step>,
}

/// A collective call, as the plan needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of all inputs.
    AllReduce,
    /// The root's input is copied to every rank's output.
    Broadcast {
        /// Source rank.
        root: usize,
    },
    /// The root ends with the reduction of all inputs.
    Reduce {
        /// Destination rank.
        root: usize,
    },
    /// Every rank ends with every rank's input, concatenated by rank.
    AllGather,
    /// Rank `r` ends with block `r` of the reduction of all inputs.
    ReduceScatter,
    /// Block `j` of rank `i`'s input becomes block `i` of rank `j`'s output.
    AllToAll,
    /// The root ends with every rank's input, concatenated by rank.
    Gather {
        /// Destination rank.
        root: usize,
    },
    /// Block `r` of the root's input becomes rank `r`'s output.
    Scatter {
        /// Source rank.
        root: usize,
    },
    /// Point-to-point send of the input to `peer`.
    Send {
        /// Receiving rank.
        peer: usize,
    },
    /// Point-to-point receive into the output from `peer`.
    Recv {
        /// Sending rank.
        peer: usize,
    },
}

impl Collective {
    /// Every collective (not send or receive) with every root of `nranks` ranks.
    pub fn every(nranks: usize) -> Vec<Collective> {
        let mut all = vec![
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
        ];
        for root in 0..nranks {
            all.extend([
                Collective::Broadcast { root },
                Collective::Reduce { root },
                Collective::Gather { root },
                Collective::Scatter { root },
            ]);
        }
        all
    }

    /// The operation's name as NCCL spells it in function names (`all_reduce`, …).
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
        }
    }

    /// Whether the collective combines inputs with a reduction operation.
    pub fn is_reducing(&self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::Reduce { .. } | Collective::ReduceScatter
        )
    }

    /// The root or peer, if the collective has one.
    pub fn root(&self) -> Option<usize> {
        match *self {
            Collective::Broadcast { root }
            | Collective::Reduce { root }
            | Collective::Gather { root }
            | Collective::Scatter { root } => Some(root),
            Collective::Send { peer } | Collective::Recv { peer } => Some(peer),
            _ => None,
        }
    }

    /// Elements of the input and output buffers that rank `rank` of `nranks` uses for a
    /// call with `count` (NCCL's count argument: per-rank elements; the receive count for
    /// reduce-scatter, the send count for all-gather and gather, per-peer for all-to-all).
    pub fn buffer_lens(&self, count: usize, rank: usize, nranks: usize) -> (usize, usize) {
        let all = count * nranks;
        match *self {
            Collective::AllReduce => (count, count),
            Collective::Broadcast { root } => (if rank == root { count } else { 0 }, count),
            Collective::Reduce { root } => (count, if rank == root { count } else { 0 }),
            Collective::AllGather => (count, all),
            Collective::ReduceScatter => (all, count),
            Collective::AllToAll => (all, all),
            Collective::Gather { root } => (count, if rank == root { all } else { 0 }),
            Collective::Scatter { root } => (if rank == root { all } else { 0 }, count),
            Collective::Send { .. } => (count, 0),
            Collective::Recv { .. } => (0, count),
        }
    }

    /// Where the input sits in the output when the call is in place, as NCCL defines it
    /// (e.g. all-gather: `sendbuff == recvbuff + rank * count`). `None` when the input is
    /// not part of the output for this rank; for reduce-scatter the output sits in the
    /// input instead, at [`Collective::output_in_input`].
    pub fn input_in_output(&self, count: usize, rank: usize) -> Option<usize> {
        match *self {
            Collective::AllReduce => Some(0),
            Collective::Broadcast { .. } | Collective::Reduce { .. } => Some(0),
            Collective::AllGather => Some(rank * count),
            Collective::Gather { root } if rank == root => Some(root * count),
            _ => None,
        }
    }

    /// For calls whose output lies inside the input when in place (reduce-scatter:
    /// `recvbuff == sendbuff + rank * count`; scatter at the root), the offset.
    pub fn output_in_input(&self, count: usize, rank: usize) -> Option<usize> {
        match *self {
            Collective::ReduceScatter => Some(rank * count),
            Collective::Scatter { root } if rank == root => Some(root * count),
            _ => None,
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.root() {
            Some(r) if matches!(self, Collective::Send { .. } | Collective::Recv { .. }) => {
                write!(f, "{}(peer {r})", self.name())
            }
            Some(r) => write!(f, "{}(root {r})", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

/// How to shape a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Most elements one step of a ring or pipeline moves (its chunk).
    pub chunk_elems: usize,
    /// One ring per channel: the ranks in ring order. All must be permutations of
    /// `0..nranks`.
    pub rings: Vec<Vec<usize>>,
    /// The algorithm, for the collectives it applies to ([`Algorithm::applies_to`];
    /// the others use their one plan).
    pub algorithm: Algorithm,
    /// The host of each rank (any labels; equal labels share a host), for trees: hosts
    /// form a double binary tree, ranks of a host a chain. Empty: one host per rank.
    pub hosts: Vec<usize>,
}

/// How a collective moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Reduce-scatter then all-gather around a ring: 2(n−1) steps, each rank sends
    /// 2(n−1)/n of the buffer — bandwidth-optimal. The other collectives pipeline along
    /// the same ring.
    #[default]
    Ring,
    /// Reduce up a tree, broadcast down it (double binary tree across hosts, a chain
    /// inside each): about 2 log₂(hosts) + chain steps, each rank sends the buffer about
    /// twice — latency-friendly across many hosts. (All-reduce, broadcast, reduce.)
    Tree,
    /// Direct, one hand-off: every rank sends its contribution straight to every rank
    /// that needs it, and each receiver folds what it gathered in rank order
    /// (all-reduce, reduce, reduce-scatter) or stores it (broadcast, all-gather). A
    /// rank sends n−1 messages instead of one and reduces the whole buffer: for small
    /// messages, where hand-offs cost more than bytes.
    OneShot,
    /// All-reduce as a direct reduce-scatter then a direct all-gather: two hand-offs
    /// whatever the number of ranks, and the ring's bytes (each rank sends 2(n−1)/n of
    /// the buffer); each block is folded in rank order by the rank that owns it. For the
    /// middle sizes.
    TwoShot,
    /// All-reduce by recursive doubling: in ⌈log₂ n⌉ rounds each rank swaps its partial
    /// result with one peer and combines the two (ranks beyond a power of two first hand
    /// theirs to a neighbour). A rank waits on one peer at a time and sends the buffer
    /// log₂ n times: for small messages when ranks outnumber cores.
    Doubling,
}

impl Algorithm {
    /// Every algorithm ferroccl has.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::Doubling,
    ];

    /// NCCL's name (`ring`, `tree`), or ferroccl's (`oneshot`, `twoshot`, `doubling`).
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
            Algorithm::Doubling => "doubling",
        }
    }

    /// The algorithm called `name` (any case; `one-shot` and `one_shot` too;
    /// `recursive-doubling` for `doubling`), if any.
    pub fn named(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "ring" => Some(Algorithm::Ring),
            "tree" => Some(Algorithm::Tree),
            "oneshot" => Some(Algorithm::OneShot),
            "twoshot" => Some(Algorithm::TwoShot),
            "doubling" | "recursivedoubling" => Some(Algorithm::Doubling),
            _ => None,
        }
    }

    /// Whether the algorithm combines every element's contributions in rank order
    /// `0, 1, …, n−1` (so its results are the same bits as a serial left fold, whatever
    /// the channels, chunks and protocol): the direct ones do; the ring starts each
    /// block's sum at a different rank and the tree adds subtrees.
    pub fn folds_in_rank_order(&self) -> bool {
        matches!(self, Algorithm::OneShot | Algorithm::TwoShot)
    }

    /// Whether `collective` has a plan with this algorithm (every collective has the
    /// ring, which stands for its one algorithm where it has no choice).
    pub fn applies_to(&self, collective: Collective) -> bool {
        match self {
            Algorithm::Ring => true,
            Algorithm::Tree => matches!(
                collective,
                Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. }
            ),
            Algorithm::OneShot => matches!(
                collective,
                Collective::AllReduce
                    | Collective::Broadcast { .. }
                    | Collective::Reduce { .. }
                    | Collective::AllGather
                    | Collective::ReduceScatter
            ),
            Algorithm::TwoShot | Algorithm::Doubling => collective == Collective::AllReduce,
        }
    }
}

/// `channels` rings (at least one) through the ranks in `order`: even channels go that
/// way, odd ones the other way round, so that two channels use different connections.
fn alternating_rings(order: Vec<usize>, channels: usize) -> Vec<Vec<usize>> {
    (0..channels.max(1))
        .map(|c| {
            let mut ring = order.clone();
            if c % 2 == 1 {
                ring.reverse();
            }
            ring
        })
        .collect()
}

impl PlanOptions {
    /// `channels` rings over `nranks` ranks: even channels go `0, 1, …, n−1`, odd
    /// channels the other way round, so that two channels use different connections.
    pub fn with_channels(nranks: usize, channels: usize, chunk_elems: usize) -> Self {
        Self::ring_options((0..nranks).collect(), channels, chunk_elems, Vec::new())
    }

    /// `channels` rings over ranks on hosts `hosts[rank]`: each ring visits the ranks of
    /// one host together, so it crosses every host boundary once (ranks that launchers
    /// numbered round-robin across hosts included); odd channels go the other way round.
    pub fn for_hosts(hosts: &[usize], channels: usize, chunk_elems: usize) -> Self {
        let mut order: Vec<usize> = (0..hosts.len()).collect();
        // Hosts in order of their first rank, ranks in order within a host.
        let first = |h: usize| hosts.iter().position(|&x| x == h).unwrap_or(0);
        order.sort_by_key(|&r| (first(hosts[r]), r));
        Self::ring_options(order, channels, chunk_elems, hosts.to_vec())
    }

    /// Ring options over `channels` rings through `order` (alternating directions).
    fn ring_options(
        order: Vec<usize>,
        channels: usize,
        chunk_elems: usize,
        hosts: Vec<usize>,
    ) -> Self {
        PlanOptions {
            chunk_elems: chunk_elems.max(1),
            rings: alternating_rings(order, channels),
            algorithm: Algorithm::Ring,
            hosts,
        }
    }

    /// The same options with `algorithm` for all-reduce.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    fn validate(&self, nranks: usize) -> Result<()> {
        if self.chunk_elems == 0 {
            return Err(Error::invalid("plan: chunk of 0 elements"));
        }
        if self.rings.is_empty() {
            return Err(Error::invalid("plan: no channels (rings)"));
        }
        for (c, ring) in self.rings.iter().enumerate() {
            let mut seen = vec![false; nranks];
            let ok = ring.len() == nranks
                && ring
                    .iter()
                    .all(|&r| r < nranks && !std::mem::replace(&mut seen[r], true));
            if !ok {
                return Err(Error::invalid(format!(
                    "plan: ring of channel {c} ({ring:?}) is not a permutation of 0..{nranks}"
                )));
            }
        }
        Ok(())
    }
}

/// The channel of point-to-point operations: their FIFOs are separate from the
/// collectives' so that sends and receives, which ranks may issue in any order relative
/// to collectives, never interleave with collective traffic.
pub const P2P_CHANNEL: usize = usize::MAX;

/// One operation of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedOp {
    /// The call.
    pub collective: Collective,
    /// Its count argument.
    pub count: usize,
}

/// What one rank does for one collective, or for several fused into one group call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub nranks: usize,
    /// The operations; [`Region::op`] indexes this list.
    pub ops: Vec<PlannedOp>,
    /// The lanes, progressed concurrently.
    pub lanes: Vec<Lane>,
}

impl Plan {
    /// Elements of scratch memory operation `op` needs (0 for most plans).
    pub fn scratch_elems(&self, op: usize) -> usize {
        self.steps()
            .flat_map(|s| s.regions())
            .filter(|r| r.op == op && r.buf == Buf::Scratch)
            .map(|r| r.end())
            .max()
            .unwrap_or(0)
    }

    /// Every step, lane by lane.
    pub fn steps(&self) -> impl Iterator<Item = &Step> {
        self.lanes.iter().flat_map(|l| l.steps.iter())
    }

    /// Elements this rank sends in total.
    pub fn elems_sent(&self) -> usize {
        self.steps()
            .filter(|s| s.send_to().is_some())
            .map(Step::len)
            .sum()
    }

    /// Fuses the plans of one group call (same rank, same communicator) into one plan
    /// whose lanes all progress together, as NCCL runs the operations between
    /// `ncclGroupStart` and `ncclGroupEnd`.
    ///
    /// Lanes that share a connection end (a channel and a peer, in one direction) are
    /// joined in call order, so messages on every FIFO keep the order in which the
    /// operations were issued (which is how NCCL matches sends with receives); all other
    /// lanes stay independent, so a send and a receive between two ranks issued in the
    /// same group can never wait on each other.
    pub fn fuse(plans: Vec<Plan>) -> Result<Plan> {
        let Some(first) = plans.first() else {
            return Err(Error::invalid("fuse: no plans"));
        };
        let (rank, nranks) = (first.rank, first.nranks);
        let mut ops = Vec::new();
        // Each fused lane with the connection ends it uses.
        let mut fused: Vec<(Vec<LaneEnd>, Lane)> = Vec::new();
        for plan in plans {
            if (plan.rank, plan.nranks) != (rank, nranks) {
                return Err(Error::invalid(format!(
                    "fuse: plan of rank {} of {} mixed with rank {rank} of {nranks}",
                    plan.rank, plan.nranks
                )));
            }
            let shift = ops.len();
            ops.extend(plan.ops);
            for mut lane in plan.lanes {
                for step in &mut lane.steps {
                    step.shift_ops(shift);
                }
                let ends = lane_ends(&lane);
                let hits: Vec<usize> = (0..fused.len())
                    .filter(|&i| fused[i].0.iter().any(|e| ends.contains(e)))
                    .collect();
                match hits.split_first() {
                    None => fused.push((ends, lane)),
                    Some((&keep, rest)) => {
                        // Join every lane this one touches, oldest first, then append it.
                        for &i in rest.iter().rev() {
                            let (e, l) = fused.remove(i);
                            fused[keep].0.extend(e);
                            fused[keep].1.steps.extend(l.steps);
                        }
                        fused[keep].0.extend(ends);
                        fused[keep].1.steps.extend(lane.steps);
                    }
                }
            }
        }
        Ok(Plan {
            rank,
            nranks,
            ops,
            lanes: fused.into_iter().map(|(_, l)| l).collect(),
        })
    }
}

/// A connection end: (channel, sends?, peer).
type LaneEnd = (usize, bool, usize);

/// The connection ends a lane uses.
fn lane_ends(lane: &Lane) -> Vec<LaneEnd> {
    let mut ends = Vec::new();
    for step in &lane.steps {
        if let Some(to) = step.send_to() {
            ends.push((lane.channel, true, to));
        }
        if let Some(from) = step.recv_from() {
            ends.push((lane.channel, false, from));
        }
    }
    ends.sort_unstable();
    ends.dedup();
    ends
}

/// Element range `i` of `parts` near-equal parts of `len` (the first `len % parts` parts
/// are one longer): returns `(offset, len)`.
pub fn split_even(len: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = len / parts;
    let extra = len % parts;
    let offset = i * base + i.min(extra);
    (offset, base + usize::from(i < extra))
}

/// Makes rank `rank`'s plan for `collective` over `count` elements.
///
/// Ring algorithms for all-reduce (reduce-scatter then all-gather), reduce-scatter,
/// all-gather, and pipelined chains along the ring for broadcast and reduce; direct
/// exchanges for all-to-all, gather, scatter and point-to-point.
pub fn plan(
    collective: Collective,
    count: usize,
    rank: usize,
    nranks: usize,
    options: &PlanOptions,
) -> Result<Plan> {
    if nranks == 0 {
        return Err(Error::invalid("plan: 0 ranks"));
    }
    if rank >= nranks {
        return Err(Error::invalid(format!(
            "plan: rank {rank} is not below the number of ranks {nranks}"
        )));
    }
    if let Some(root) = collective.root()
        && root >= nranks
    {
        return Err(Error::invalid(format!(
            "{}: root/peer {root} is not below the number of ranks {nranks}",
            collective.name()
        )));
    }
    options.validate(nranks)?;
    let own_hosts: Vec<usize>;
    let hosts = if options.hosts.is_empty() {
        own_hosts = (0..nranks).collect();
        &own_hosts
    } else if options.hosts.len() == nranks {
        &options.hosts
    } else {
        return Err(Error::invalid(format!(
            "plan: {} host labels for {nranks} ranks",
            options.hosts.len()
        )));
    };
    let b = Builder {
        rank,
        nranks,
        count,
        chunk: options.chunk_elems,
        rings: &options.rings,
        hosts,
    };
    let mut lanes = match collective {
        Collective::AllReduce => match options.algorithm {
            Algorithm::Ring => b.ring_all_reduce(),
            Algorithm::Tree => b.tree_all_reduce(),
            Algorithm::OneShot => b.one_shot_all_reduce(),
            Algorithm::TwoShot => b.two_shot_all_reduce(),
            Algorithm::Doubling => b.doubling_all_reduce(),
        },
        Collective::ReduceScatter => match options.algorithm {
            Algorithm::OneShot => b.one_shot_reduce_scatter(),
            _ => b.ring_reduce_scatter(),
        },
        Collective::AllGather => match options.algorithm {
            Algorithm::OneShot => b.one_shot_all_gather(),
            _ => b.ring_all_gather(),
        },
        Collective::Broadcast { root } => match options.algorithm {
            Algorithm::Tree => b.tree_broadcast(root),
            Algorithm::OneShot => b.one_shot_broadcast(root),
            _ => b.ring_broadcast(root),
        },
        Collective::Reduce { root } => match options.algorithm {
            Algorithm::Tree => b.tree_reduce(root),
            Algorithm::OneShot => b.one_shot_reduce(root),
            _ => b.ring_reduce(root),
        },
        Collective::AllToAll => b.direct_all_to_all(),
        Collective::Gather { root } => b.direct_rooted(root, true),
        Collective::Scatter { root } => b.direct_rooted(root, false),
        Collective::Send { peer } => vec![lane(
            P2P_CHANNEL,
            vec![Step::Send {
                to: peer,
                src: Region::input(0, count),
            }],
        )],
        Collective::Recv { peer } => vec![lane(
            P2P_CHANNEL,
            vec![Step::Recv {
                from: peer,
                dst: Region::output(0, count),
            }],
        )],
    };
    for l in &mut lanes {
        l.steps.retain(|s| !s.is_empty());
    }
    lanes.retain(|l| !l.steps.is_empty());
    Ok(Plan {
        rank,
        nranks,
        ops: vec![PlannedOp { collective, count }],
        lanes,
    })
}

fn lane(channel: usize, steps: Vec<Step>) -> Lane {
    Lane { channel, steps }
}

/// A lane of channel 0 with a single step.
fn one(step: Step) -> Lane {
    lane(0, vec![step])
}

/// One iteration of a ring or two-shot channel: `len` elements from `base`, split into
/// one piece per rank.
struct Iteration {
    base: usize,
    len: usize,
    nranks: usize,
}

impl Iteration {
    /// Piece `q`: `(offset, len)`.
    fn piece(&self, q: usize) -> (usize, usize) {
        let (off, l) = split_even(self.len, self.nranks, q);
        (self.base + off, l)
    }
}

/// Shared inputs of the plan builders.
struct Builder<'a> {
    rank: usize,
    nranks: usize,
    count: usize,
    chunk: usize,
    rings: &'a [Vec<usize>],
    hosts: &'a [usize],
}

/// A ring seen from one rank: its position and neighbours.
struct RingView<'a> {
    ring: &'a [usize],
    pos: usize,
}

impl RingView<'_> {
    fn n(&self) -> usize {
        self.ring.len()
    }
    fn next(&self) -> usize {
        self.ring[(self.pos + 1) % self.n()]
    }
    fn prev(&self) -> usize {
        self.ring[(self.pos + self.n() - 1) % self.n()]
    }
    /// Where `rank` sits on this ring.
    fn position_of(&self, rank: usize) -> usize {
        self.ring
            .iter()
            .position(|&r| r == rank)
            .expect("every rank is on every ring")
    }
    /// The rank `back` positions before this one (wrapping).
    fn before(&self, back: usize) -> usize {
        let n = self.n();
        self.ring[(self.pos + n - back % n) % n]
    }

    /// Step `q` of a chain of reductions along the ring: the first sends its
    /// contribution `src` on, the middle ones add theirs and pass the sum on, the last
    /// completes it into `dst`. A ring of one rank copies `src` to `dst`.
    fn chain_reduce_step(&self, q: usize, src: Region, dst: Region) -> Step {
        match q {
            _ if self.n() == 1 => Step::Copy { src, dst },
            0 => Step::Send {
                to: self.next(),
                src,
            },
            q if q < self.n() - 1 => Step::RecvReduceSend {
                from: self.prev(),
                to: self.next(),
                src,
            },
            _ => Step::RecvReduceCopy {
                from: self.prev(),
                src,
                dst,
                post: true,
                local_first: false,
            },
        }
    }
}

impl Builder<'_> {
    pub(super) fn channels(&self) -> usize {
        self.rings.len()
    }

    pub(super) fn view(&self, channel: usize) -> RingView<'_> {
        let ring = &self.rings[channel];
        let pos = ring
            .iter()
            .position(|&r| r == self.rank)
            .expect("validated rings contain every rank");
        RingView { ring, pos }
    }

    /// The iterations of `nranks × chunk` elements that a channel walks over its share
    /// `lo..lo + len` (ring and two-shot all-reduce).
    pub(super) fn iterations(&self, lo: usize, len: usize) -> impl Iterator<Item = Iteration> {
        let (nranks, per_iter) = (self.nranks, self.nranks * self.chunk);
        (lo..lo + len).step_by(per_iter).map(move |base| Iteration {
            base,
            len: per_iter.min(lo + len - base),
            nranks,
        })
    }

    /// The chunks of this channel's share of one block: `(offset within block, len)`.
    pub(super) fn block_chunks(&self, channel: usize) -> Vec<(usize, usize)> {
        let (lo, len) = split_even(self.count, self.channels(), channel);
        (0..len.div_ceil(self.chunk))
            .map(|i| {
                let off = i * self.chunk;
                (lo + off, self.chunk.min(len - off))
            })
            .collect()
    }

    /// One lane per channel, built chunk by chunk over the channel's share of a block:
    /// `chunk_steps(channel, ring view, offset, len, steps)` appends one chunk's steps.
    pub(super) fn lanes_by_chunk(
        &self,
        mut chunk_steps: impl FnMut(usize, &RingView<'_>, usize, usize, &mut Vec<Step>),
    ) -> Vec<Lane> {
        (0..self.channels())
            .map(|c| {
                let v = self.view(c);
                let mut steps = Vec::new();
                for (off, l) in self.block_chunks(c) {
                    chunk_steps(c, &v, off, l, &mut steps);
                }
                lane(c, steps)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
