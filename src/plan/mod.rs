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

mod protocol;
pub use protocol::Protocol;
pub mod sim;
pub mod tree;

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
}

impl Algorithm {
    /// Every algorithm ferroccl has.
    pub const ALL: [Algorithm; 4] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::OneShot,
        Algorithm::TwoShot,
    ];

    /// NCCL's name (`ring`, `tree`), or ferroccl's (`oneshot`, `twoshot`).
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
        }
    }

    /// The algorithm called `name` (any case; `one-shot` and `one_shot` too), if any.
    pub fn named(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "ring" => Some(Algorithm::Ring),
            "tree" => Some(Algorithm::Tree),
            "oneshot" => Some(Algorithm::OneShot),
            "twoshot" => Some(Algorithm::TwoShot),
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
            Algorithm::TwoShot => collective == Collective::AllReduce,
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

/// One chunk's way down a tree, for the rank with `parent` and `kids`: the root takes
/// it from `root_src` (copying it into `out` when that is elsewhere) and sends it to its
/// children; every other rank receives it into `out` from its parent and forwards it to
/// its first child, then sends it from `out` to the others.
fn tree_down(parent: Option<usize>, kids: &[usize], root_src: Region, out: Region) -> Vec<Step> {
    let Some((&first, rest)) = kids.split_first() else {
        return vec![match parent {
            Some(p) => Step::Recv { from: p, dst: out },
            None => Step::Copy {
                src: root_src,
                dst: out,
            },
        }];
    };
    let mut steps = vec![match parent {
        Some(p) => Step::RecvCopySend {
            from: p,
            to: first,
            dst: out,
        },
        None if root_src == out => Step::Send {
            to: first,
            src: out,
        },
        None => Step::CopySend {
            to: first,
            src: root_src,
            dst: out,
        },
    }];
    steps.extend(rest.iter().map(|&k| Step::Send { to: k, src: out }));
    steps
}

/// One chunk's way up a tree, for the rank with `parent` and `kids`: a leaf sends its
/// contribution `inp` to its parent; an inner rank adds each child's partial sum to its
/// contribution, accumulating in `acc`, and sends the last sum to its parent instead; the
/// root completes the sum in `acc` (with the post-operation).
fn tree_up(parent: Option<usize>, kids: &[usize], inp: Region, acc: Region) -> Vec<Step> {
    if kids.is_empty() {
        return match parent {
            Some(p) => vec![Step::Send { to: p, src: inp }],
            // A single rank: its contribution is the result.
            None => vec![Step::Copy { src: inp, dst: acc }],
        };
    }
    kids.iter()
        .enumerate()
        .map(|(k, &kid)| {
            // The first child's partial meets this rank's contribution; later ones meet
            // the partial sum accumulated so far.
            let src = if k == 0 { inp } else { acc };
            let last = k + 1 == kids.len();
            match parent {
                Some(p) if last => Step::RecvReduceSend {
                    from: kid,
                    to: p,
                    src,
                },
                _ => Step::RecvReduceCopy {
                    from: kid,
                    src,
                    dst: acc,
                    post: last,
                    local_first: false,
                },
            }
        })
        .collect()
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

/// Where one channel's fold keeps its partial results: a scratch slot of its own,
/// reused for every range the lane folds.
struct FoldSlots {
    base: usize,
}

impl FoldSlots {
    /// The slot of channel `channel`, for ranges of at most `longest` elements.
    fn new(channel: usize, longest: usize) -> Self {
        FoldSlots {
            base: channel * longest,
        }
    }

    /// The slot's first `len` elements.
    fn acc(&self, len: usize) -> Region {
        Region::scratch(self.base, len)
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
    fn channels(&self) -> usize {
        self.rings.len()
    }

    fn view(&self, channel: usize) -> RingView<'_> {
        let ring = &self.rings[channel];
        let pos = ring
            .iter()
            .position(|&r| r == self.rank)
            .expect("validated rings contain every rank");
        RingView { ring, pos }
    }

    /// Ring all-reduce. Each channel takes a contiguous share of the buffer and walks it
    /// in iterations of `nranks × chunk` elements; an iteration is split into one piece per
    /// rank. At step `s` the rank at ring position `p` handles the piece owned by the rank
    /// `s` positions behind it: sends it (s = 0), adds its own contribution and forwards it
    /// (0 < s < n−1), completes it (s = n−1: the sum is final, stored and forwarded),
    /// then passes final pieces on (n−1 < s < 2n−2) and stores the last one (s = 2n−2).
    fn ring_all_reduce(&self) -> Vec<Lane> {
        let n = self.nranks;
        (0..self.channels())
            .map(|c| {
                let (lo, len) = split_even(self.count, self.channels(), c);
                let mut steps = Vec::new();
                if n == 1 {
                    steps.push(Step::Copy {
                        src: Region::input(lo, len),
                        dst: Region::output(lo, len),
                    });
                    return lane(c, steps);
                }
                let v = self.view(c);
                let (prev, next) = (v.prev(), v.next());
                for it in self.iterations(lo, len) {
                    for s in 0..=2 * (n - 1) {
                        // The piece owned by the ring position s steps back.
                        let (off, l) = it.piece(v.position_of(v.before(s)));
                        let (src, dst) = (Region::input(off, l), Region::output(off, l));
                        steps.push(match s {
                            0 => Step::Send { to: next, src },
                            s if s < n - 1 => Step::RecvReduceSend {
                                from: prev,
                                to: next,
                                src,
                            },
                            s if s == n - 1 => Step::RecvReduceCopySend {
                                from: prev,
                                to: next,
                                src,
                                dst,
                            },
                            s if s < 2 * (n - 1) => Step::RecvCopySend {
                                from: prev,
                                to: next,
                                dst,
                            },
                            _ => Step::Recv { from: prev, dst },
                        });
                    }
                }
                lane(c, steps)
            })
            .collect()
    }

    /// Tree all-reduce: each channel takes a share of the buffer and one of the two
    /// trees (even channels the first, odd the second). Chunk by chunk, every rank adds
    /// its children's partial sums to its own contribution and passes the result up; the
    /// root completes it and the final chunk travels back down. Reducing up and
    /// forwarding down are separate lanes (they use opposite directions of each
    /// connection), so a chunk goes up while an earlier one comes down; on the root they
    /// share one lane, since what it sends down is what it just completed.
    fn tree_all_reduce(&self) -> Vec<Lane> {
        let me = self.rank;
        let mut lanes = Vec::new();
        for c in 0..self.channels() {
            let (lo, len) = split_even(self.count, self.channels(), c);
            if self.nranks == 1 {
                lanes.push(lane(
                    c,
                    vec![Step::Copy {
                        src: Region::input(lo, len),
                        dst: Region::output(lo, len),
                    }],
                ));
                continue;
            }
            let t = tree::RankTree::new(self.hosts, c % 2);
            let (parent, kids) = (t.parent[me], &t.children[me]);
            let (mut up, mut down, mut root_lane) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..len.div_ceil(self.chunk) {
                let (off, l) = (lo + i * self.chunk, self.chunk.min(len - i * self.chunk));
                let (inp, out) = (Region::input(off, l), Region::output(off, l));
                let up_steps = tree_up(parent, kids, inp, out);
                // The root sends what it just completed in its output buffer.
                let down_steps = tree_down(parent, kids, out, out);
                if parent.is_none() {
                    root_lane.extend(up_steps);
                    root_lane.extend(down_steps);
                } else {
                    up.extend(up_steps);
                    down.extend(down_steps);
                }
            }
            for steps in [root_lane, up, down] {
                if !steps.is_empty() {
                    lanes.push(lane(c, steps));
                }
            }
        }
        lanes
    }

    /// One-shot all-reduce: chunk by chunk, every rank sends its contribution to every
    /// peer, then receives theirs and folds all n in rank order into its output. The next
    /// chunk goes out before the previous one is received, so one chunk is in flight each
    /// way; a chunk is sent before the same chunk of the output is written (in place,
    /// that is the input).
    fn one_shot_all_reduce(&self) -> Vec<Lane> {
        let me = self.rank;
        (0..self.channels())
            .map(|c| {
                let chunks = self.block_chunks(c);
                let slots = self.chunk_slots(c);
                let send = |(off, l): (usize, usize), steps: &mut Vec<Step>| {
                    steps.extend(self.peers().map(|to| Step::Send {
                        to,
                        src: Region::input(off, l),
                    }));
                };
                let mut steps = Vec::new();
                for (i, &(off, l)) in chunks.iter().enumerate() {
                    if i == 0 {
                        send((off, l), &mut steps);
                    }
                    if let Some(&next) = chunks.get(i + 1) {
                        send(next, &mut steps);
                    }
                    let own = Region::input(off, l);
                    self.fold(&slots, me, own, Region::output(off, l), &mut steps);
                }
                lane(c, steps)
            })
            .collect()
    }

    /// Two-shot all-reduce: like the ring, each channel walks its share in iterations of
    /// `nranks × chunk` elements split into one piece per rank; in each, every rank sends
    /// piece `p` to rank `p`, folds the n contributions to its own piece in rank order,
    /// sends the result to every peer and receives theirs.
    fn two_shot_all_reduce(&self) -> Vec<Lane> {
        let (me, n) = (self.rank, self.nranks);
        (0..self.channels())
            .map(|c| {
                let (lo, len) = split_even(self.count, self.channels(), c);
                let per_iter = n * self.chunk;
                // Pieces are longest in channel 0's first iteration.
                let share = split_even(self.count, self.channels(), 0).1;
                let slots = FoldSlots::new(c, split_even(per_iter.min(share), n, 0).1);
                let mut steps = Vec::new();
                for it in self.iterations(lo, len) {
                    for to in self.peers() {
                        let (off, l) = it.piece(to);
                        steps.push(Step::Send {
                            to,
                            src: Region::input(off, l),
                        });
                    }
                    let (off, l) = it.piece(me);
                    let mine = Region::output(off, l);
                    self.fold(&slots, me, Region::input(off, l), mine, &mut steps);
                    steps.extend(self.peers().map(|to| Step::Send { to, src: mine }));
                    for from in self.peers() {
                        let (off, l) = it.piece(from);
                        steps.push(Step::Recv {
                            from,
                            dst: Region::output(off, l),
                        });
                    }
                }
                lane(c, steps)
            })
            .collect()
    }

    /// One-shot reduce-scatter: chunk by chunk of a block, every rank sends the chunk of
    /// block `p` to rank `p` and folds the n contributions to its own block in rank order.
    fn one_shot_reduce_scatter(&self) -> Vec<Lane> {
        let (me, count) = (self.rank, self.count);
        self.lanes_by_chunk(|c, _, off, l, steps| {
            let slots = &self.chunk_slots(c);
            steps.extend(self.peers().map(|to| Step::Send {
                to,
                src: Region::input(to * count + off, l),
            }));
            let own = Region::input(me * count + off, l);
            self.fold(slots, me, own, Region::output(off, l), steps);
        })
    }

    /// One-shot reduce: every rank sends each chunk to the root, which folds the n
    /// contributions in rank order.
    fn one_shot_reduce(&self, root: usize) -> Vec<Lane> {
        let me = self.rank;
        self.lanes_by_chunk(|c, _, off, l, steps| {
            let slots = &self.chunk_slots(c);
            let own = Region::input(off, l);
            if me == root {
                self.fold(slots, me, own, Region::output(off, l), steps);
            } else {
                steps.push(Step::Send { to: root, src: own });
            }
        })
    }

    /// One-shot broadcast: the root sends each chunk to every peer.
    fn one_shot_broadcast(&self, root: usize) -> Vec<Lane> {
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let dst = Region::output(off, l);
            if self.rank == root {
                let src = Region::input(off, l);
                steps.extend(self.peers().map(|to| Step::Send { to, src }));
                steps.push(Step::Copy { src, dst });
            } else {
                steps.push(Step::Recv { from: root, dst });
            }
        })
    }

    /// One-shot all-gather: every rank sends each chunk of its block to every peer and
    /// receives theirs into place.
    fn one_shot_all_gather(&self) -> Vec<Lane> {
        let (me, count) = (self.rank, self.count);
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let src = Region::input(off, l);
            steps.extend(self.peers().map(|to| Step::Send { to, src }));
            steps.push(Step::Copy {
                src,
                dst: Region::output(me * count + off, l),
            });
            steps.extend(self.peers().map(|from| Step::Recv {
                from,
                dst: Region::output(from * count + off, l),
            }));
        })
    }

    /// The iterations of `nranks × chunk` elements that a channel walks over its share
    /// `lo..lo + len` (ring and two-shot all-reduce).
    fn iterations(&self, lo: usize, len: usize) -> impl Iterator<Item = Iteration> {
        let (nranks, per_iter) = (self.nranks, self.nranks * self.chunk);
        (lo..lo + len).step_by(per_iter).map(move |base| Iteration {
            base,
            len: per_iter.min(lo + len - base),
            nranks,
        })
    }

    /// Fold slots of channel `c` for its chunks (channel 0's first chunk is the longest
    /// of any channel, so the channels' slots never overlap).
    fn chunk_slots(&self, c: usize) -> FoldSlots {
        let longest = self.chunk.min(split_even(self.count, self.channels(), 0).1);
        FoldSlots::new(c, longest)
    }

    /// The other ranks, in rank order starting after this one (so that ranks do not all
    /// send to rank 0 first).
    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (1..self.nranks).map(move |k| (self.rank + k) % self.nranks)
    }

    /// The rank-order fold of one range: combines every rank's contribution to it,
    /// `x₀ ⊕ x₁ ⊕ … ⊕ xₙ₋₁` left to right, `own` standing for this rank's, and stores the
    /// result in `dst`. Each received contribution is folded straight from the FIFO into
    /// the partial result (kept in the lane's scratch slot, so that `dst` may be `own`,
    /// in place: it is written by the last step only); only x₀ is copied there first
    /// when it is neither this rank's nor followed by it.
    fn fold(&self, slots: &FoldSlots, me: usize, own: Region, dst: Region, steps: &mut Vec<Step>) {
        let n = self.nranks;
        if n == 1 {
            steps.push(Step::Copy { src: own, dst });
            return;
        }
        let acc = slots.acc(own.len);
        // The result of combining up to rank j: the destination at the end.
        let into = |j: usize| if j == n - 1 { dst } else { acc };
        let first = match me {
            0 => 1,
            // x₀ arrives first and this rank's own comes next: one step.
            1 => {
                steps.push(Step::RecvReduceCopy {
                    from: 0,
                    src: own,
                    dst: into(1),
                    post: n == 2,
                    local_first: false,
                });
                2
            }
            _ => {
                steps.push(Step::Recv { from: 0, dst: acc });
                1
            }
        };
        for j in first..n {
            // The partial so far: this rank's contribution alone when it is x₀.
            let partial = if j == 1 && me == 0 { own } else { acc };
            let (post, dst) = (j == n - 1, into(j));
            steps.push(if j == me {
                Step::Reduce {
                    a: partial,
                    b: own,
                    dst,
                    post,
                }
            } else {
                Step::RecvReduceCopy {
                    from: j,
                    src: partial,
                    dst,
                    post,
                    local_first: true,
                }
            });
        }
    }

    /// Tree broadcast: the root's data flows down tree 0 re-rooted at the root, chunk by
    /// chunk, each rank forwarding to its children as it receives.
    fn tree_broadcast(&self, root: usize) -> Vec<Lane> {
        let t = tree::RankTree::rooted_at(self.hosts, root);
        let (parent, kids) = (t.parent[self.rank], &t.children[self.rank]);
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let (inp, out) = (Region::input(off, l), Region::output(off, l));
            steps.extend(tree_down(parent, kids, inp, out));
        })
    }

    /// Tree reduce: the contributions flow up tree 0 re-rooted at the root, chunk by
    /// chunk, each rank adding its children's partial sums to its own contribution. A
    /// rank with several children accumulates in the call's scratch memory (only the
    /// root has a receive buffer).
    fn tree_reduce(&self, root: usize) -> Vec<Lane> {
        let t = tree::RankTree::rooted_at(self.hosts, root);
        let (parent, kids) = (t.parent[self.rank], &t.children[self.rank]);
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let acc = if parent.is_none() {
                Region::output(off, l)
            } else {
                Region::scratch(off, l)
            };
            steps.extend(tree_up(parent, kids, Region::input(off, l), acc));
        })
    }

    /// The chunks of this channel's share of one block: `(offset within block, len)`.
    fn block_chunks(&self, channel: usize) -> Vec<(usize, usize)> {
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
    fn lanes_by_chunk(
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

    /// Ring reduce-scatter: like the first half of all-reduce over blocks, arranged so
    /// that rank `r` completes block `r`.
    fn ring_reduce_scatter(&self) -> Vec<Lane> {
        let (n, count) = (self.nranks, self.count);
        self.lanes_by_chunk(|_, v, off, l, steps| {
            for s in 0..n {
                // At step s handle the block of the rank s+1 positions back, so that the
                // last step (s = n−1) completes this rank's own block.
                let block = v.before(s + 1);
                let src = Region::input(block * count + off, l);
                steps.push(v.chain_reduce_step(s, src, Region::output(off, l)));
            }
        })
    }

    /// Ring all-gather: each rank copies its block into place and sends it; every
    /// block then travels n−1 hops.
    fn ring_all_gather(&self) -> Vec<Lane> {
        let (n, count) = (self.nranks, self.count);
        self.lanes_by_chunk(|_, v, off, l, steps| {
            let own = Region::output(self.rank * count + off, l);
            if n == 1 {
                steps.push(Step::Copy {
                    src: Region::input(off, l),
                    dst: own,
                });
                return;
            }
            steps.push(Step::CopySend {
                to: v.next(),
                src: Region::input(off, l),
                dst: own,
            });
            for s in 1..n {
                let dst = Region::output(v.before(s) * count + off, l);
                steps.push(if s < n - 1 {
                    Step::RecvCopySend {
                        from: v.prev(),
                        to: v.next(),
                        dst,
                    }
                } else {
                    Step::Recv {
                        from: v.prev(),
                        dst,
                    }
                });
            }
        })
    }

    /// Broadcast pipelined along the ring, starting at the root.
    fn ring_broadcast(&self, root: usize) -> Vec<Lane> {
        let n = self.nranks;
        self.lanes_by_chunk(|_, v, off, l, steps| {
            // Distance from the root along the ring.
            let q = (v.pos + n - v.position_of(root)) % n;
            let dst = Region::output(off, l);
            steps.push(match q {
                _ if n == 1 => Step::Copy {
                    src: Region::input(off, l),
                    dst,
                },
                0 => Step::CopySend {
                    to: v.next(),
                    src: Region::input(off, l),
                    dst,
                },
                q if q < n - 1 => Step::RecvCopySend {
                    from: v.prev(),
                    to: v.next(),
                    dst,
                },
                _ => Step::Recv {
                    from: v.prev(),
                    dst,
                },
            });
        })
    }

    /// Reduce pipelined along the ring, ending at the root.
    fn ring_reduce(&self, root: usize) -> Vec<Lane> {
        let n = self.nranks;
        self.lanes_by_chunk(|_, v, off, l, steps| {
            // Position in the chain that starts right after the root and ends at it.
            let q = (v.pos + n - v.position_of(root) + n - 1) % n;
            steps.push(v.chain_reduce_step(q, Region::input(off, l), Region::output(off, l)));
        })
    }

    /// All-to-all as direct exchanges: one lane per peer and direction, all in flight
    /// together, so no ordering between peers can deadlock.
    fn direct_all_to_all(&self) -> Vec<Lane> {
        let (me, n, count) = (self.rank, self.nranks, self.count);
        let mut lanes = vec![one(Step::Copy {
            src: Region::input(me * count, count),
            dst: Region::output(me * count, count),
        })];
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            lanes.push(one(Step::Send {
                to,
                src: Region::input(to * count, count),
            }));
            lanes.push(one(Step::Recv {
                from,
                dst: Region::output(from * count, count),
            }));
        }
        lanes
    }

    /// Gather (`to_root`: every rank's block goes to the root) or scatter (every block
    /// comes from the root), as direct exchanges with one lane per peer.
    fn direct_rooted(&self, root: usize, to_root: bool) -> Vec<Lane> {
        let (me, count) = (self.rank, self.count);
        // On the root, block `r` of all blocks; on every rank, its own block.
        let block = |r: usize| {
            if to_root {
                Region::output(r * count, count)
            } else {
                Region::input(r * count, count)
            }
        };
        let own = if to_root {
            Region::input(0, count)
        } else {
            Region::output(0, count)
        };
        // Moves `region` between this rank and `peer`, in the collective's direction.
        let exchange = |peer: usize, region: Region, towards_peer: bool| {
            if towards_peer {
                Step::Send {
                    to: peer,
                    src: region,
                }
            } else {
                Step::Recv {
                    from: peer,
                    dst: region,
                }
            }
        };
        if me != root {
            return vec![one(exchange(root, own, to_root))];
        }
        let (src, dst) = if to_root {
            (own, block(me))
        } else {
            (block(me), own)
        };
        let mut lanes = vec![one(Step::Copy { src, dst })];
        lanes.extend(
            (0..self.nranks)
                .filter(|&r| r != me)
                .map(|peer| one(exchange(peer, block(peer), !to_root))),
        );
        lanes
    }
}

#[cfg(test)]
mod tests;
