//! Step tables for people who study collectives: the plans the engine runs, executed in
//! the simulator ([`crate::plan::sim`]) on values that remember where they came from,
//! round by round.
//!
//! Every element is a [`Tracked`] value: a number and the set of ranks whose inputs it
//! contains. Rank `r`'s element `c` starts as `(r + 1) · 10 + c`, so a table reads like
//! the textbook one: with 4 ranks, after the first reduce-scatter round rank 1 holds
//! 10 + 20 = 30 in chunk a; after three rounds every rank owns one chunk summed over all
//! four ranks (100, 104, 108, 112); after the all-gather rounds every rank holds all of
//! them. What a rank "holds" includes partial sums that only travel in messages (a
//! ring's reduce-scatter writes nothing to the output until its last step), which the
//! simulator reports per step.
//!
//! The same runs count the bytes each rank sends while values are partial (the reduce
//! phase) and once they are final (the gather phase): `(n−1)/n` of the buffer each for
//! a ring all-reduce, `2(n−1)/n` in all.

pub mod html;
pub mod predict;
pub mod timeline;

use crate::error::{Error, Result};
use crate::plan::sim::{Arith, Buffers, SimEvent, simulate_observed};
use crate::plan::{self, Algorithm, Buf, Collective, PlanOptions, Region, Step};

/// The `--name value` options of a `ferroccl-viz` command.
#[derive(Clone, Debug, Default)]
pub struct Options(Vec<(String, String)>);

impl Options {
    /// Reads `args` as `--name value` pairs, accepting only the names in `allowed`.
    pub fn parse(args: &[String], allowed: &[&str]) -> std::result::Result<Self, String> {
        let mut out = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let name = a
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {a:?}"))?;
            if !allowed.contains(&name) {
                return Err(format!("unknown option --{name}"));
            }
            let value = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
            out.push((name.to_string(), value.clone()));
        }
        Ok(Options(out))
    }

    /// The value given last for `name`, if any.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A value and the ranks whose inputs it sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Tracked {
    /// The value.
    pub value: i64,
    /// Bit `r` set: rank `r`'s input is part of it.
    pub ranks: u64,
}

impl Tracked {
    /// How many ranks' inputs it holds.
    pub fn contributions(&self) -> u32 {
        self.ranks.count_ones()
    }
}

/// Rank `r`'s starting value for element `c` (`(r + 1) · 10 + c`).
pub fn initial_value(rank: usize, element: usize) -> i64 {
    (rank as i64 + 1) * 10 + element as i64
}

/// One message of a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Sending rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// The elements (chunks) it carries, as positions of the table.
    pub chunks: Vec<usize>,
    /// Whether its values are partial (reduce phase) rather than final.
    pub partial: bool,
}

/// The state after one round.
#[derive(Clone, Debug, PartialEq)]
pub struct Round {
    /// 0 is the starting state; round `k` is when the messages of the `k`-th hop arrive.
    pub index: usize,
    /// The messages that arrived in this round.
    pub transfers: Vec<Transfer>,
    /// `[rank][chunk]`: what the rank holds, if anything yet.
    pub held: Vec<Vec<Option<Tracked>>>,
    /// `[rank][chunk]`: whether that changed in this round.
    pub changed: Vec<Vec<bool>>,
}

/// A collective's rounds on small integer data.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTable {
    /// What ran.
    pub collective: Collective,
    /// The algorithm (ring or tree; the other collectives have one).
    pub algorithm: Algorithm,
    /// Ranks.
    pub nranks: usize,
    /// Chunks (table columns): one element each.
    pub chunks: usize,
    /// Round 0 (start) to the end.
    pub rounds: Vec<Round>,
    /// For tree algorithms, the parents in the trees the plan used (`[tree][rank]`):
    /// both trees of the double binary tree for all-reduce, the first re-rooted at the
    /// root for broadcast and reduce.
    pub tree_parents: Vec<Vec<Option<usize>>>,
    /// How the starting values were chosen, for headings.
    pub values: String,
}

/// The collectives a table can show, by their command-line names.
pub fn collective_named(name: &str, root: usize) -> Result<Collective> {
    Ok(match name {
        "all_reduce" | "all-reduce" | "allreduce" => Collective::AllReduce,
        "reduce_scatter" | "reduce-scatter" => Collective::ReduceScatter,
        "all_gather" | "all-gather" | "allgather" => Collective::AllGather,
        "broadcast" => Collective::Broadcast { root },
        "reduce" => Collective::Reduce { root },
        other => {
            return Err(Error::invalid(format!(
                "no step table for {other:?} (all_reduce, reduce_scatter, all_gather, \
                 broadcast, reduce)"
            )));
        }
    })
}

/// Where a region's elements sit among the table's positions: the larger of the two
/// buffers, with the smaller one at NCCL's in-place offset.
fn positions(c: Collective, count: usize, rank: usize, r: &Region) -> std::ops::Range<usize> {
    let shift = match r.buf {
        Buf::Input => c.input_in_output(count, rank).unwrap_or(0),
        Buf::Output | Buf::Scratch => c.output_in_input(count, rank).unwrap_or(0),
    };
    r.offset + shift..r.offset + shift + r.len
}

/// Bytes one rank sent, by phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseBytes {
    /// Sent while values were partial (reduce-scatter, or up a tree).
    pub reduce: usize,
    /// Sent once values were final (all-gather, broadcast, or down a tree).
    pub gather: usize,
}

/// What a simulation run collects.
struct Recorder {
    bytes: Vec<PhaseBytes>,
    /// Sent in the current simulator round.
    in_flight: Vec<Transfer>,
    /// Sent in the previous one: they arrive in the current one.
    arriving: Vec<Transfer>,
    /// Output regions written in the current round.
    wrote: Vec<(usize, Region)>,
    /// Partial sums a rank computed and sent on without storing them.
    message_held: Vec<(usize, std::ops::Range<usize>, Vec<Tracked>)>,
    held: Vec<Vec<Option<Tracked>>>,
    rounds: Vec<Round>,
}

/// The region a step stores into, if any.
fn written_region(step: &Step) -> Option<Region> {
    match *step {
        Step::Recv { dst, .. }
        | Step::CopySend { dst, .. }
        | Step::RecvReduceCopy { dst, .. }
        | Step::RecvReduceCopySend { dst, .. }
        | Step::RecvCopySend { dst, .. }
        | Step::Copy { dst, .. }
        | Step::Reduce { dst, .. } => Some(dst),
        Step::Send { .. } | Step::RecvReduceSend { .. } => None,
    }
}

/// Runs the real plan of `collective` on `nranks` ranks (one host each) with
/// `count` elements per rank in the simulator on tracked values. Returns the rounds
/// (when `keep_rounds`) and the bytes each rank sent by phase, for elements of
/// `elem_bytes`.
fn run(
    collective: Collective,
    algorithm: Algorithm,
    nranks: usize,
    count: usize,
    elem_bytes: usize,
    keep_rounds: bool,
    values: &dyn Fn(usize, usize) -> i64,
) -> Result<(StepTable, Vec<PhaseBytes>)> {
    if !(1..=64).contains(&nranks) {
        return Err(Error::invalid(format!(
            "{nranks} ranks: tables are for 1 to 64 ranks"
        )));
    }
    let hosts: Vec<usize> = (0..nranks).collect();
    // Trees run two channels, one per tree of the double binary tree, as NCCL does.
    let channels = if algorithm == Algorithm::Tree { 2 } else { 1 };
    let options = PlanOptions::for_hosts(&hosts, channels, count.max(1)).with_algorithm(algorithm);
    let plans = (0..nranks)
        .map(|r| plan::plan(collective, count, r, nranks, &options))
        .collect::<Result<Vec<_>>>()?;
    let width = (0..nranks)
        .map(|r| {
            let (i, o) = collective.buffer_lens(count, r, nranks);
            i.max(o)
        })
        .max()
        .unwrap_or(0);
    let mut bufs: Vec<Vec<Buffers<Tracked>>> = (0..nranks)
        .map(|r| {
            let (i, o) = collective.buffer_lens(count, r, nranks);
            let shift = collective.input_in_output(count, r).unwrap_or(0);
            let input: Vec<Tracked> = (0..i)
                .map(|e| Tracked {
                    value: values(r, e + shift),
                    ranks: 1 << r,
                })
                .collect();
            vec![Buffers::separate(input, o, Tracked::default())]
        })
        .collect();
    let arith = [if collective.is_reducing() {
        Arith::reduce(|a: &Tracked, b: &Tracked| Tracked {
            value: a.value + b.value,
            ranks: a.ranks | b.ranks,
        })
    } else {
        Arith::copy()
    }];
    // What each rank holds: its input at the start.
    let held: Vec<Vec<Option<Tracked>>> = (0..nranks)
        .map(|r| {
            let mut row = vec![None; width];
            for (e, v) in bufs[r][0].input().iter().enumerate() {
                let shift = collective.input_in_output(count, r).unwrap_or(0);
                row[e + shift] = Some(*v);
            }
            row
        })
        .collect();
    let full: u64 = if nranks == 64 {
        u64::MAX
    } else {
        (1u64 << nranks) - 1
    };
    let rounds = vec![Round {
        index: 0,
        transfers: Vec::new(),
        held: held.clone(),
        changed: vec![vec![false; width]; nranks],
    }];
    let rec = std::cell::RefCell::new(Recorder {
        bytes: vec![PhaseBytes::default(); nranks],
        in_flight: Vec::new(),
        arriving: Vec::new(),
        wrote: Vec::new(),
        message_held: Vec::new(),
        held,
        rounds,
    });
    let on_step = |e: &SimEvent, msg: Option<&[Tracked]>| {
        let mut rec = rec.borrow_mut();
        let (rank, step) = (e.rank, e.step);
        if let Some(d) = written_region(&step) {
            rec.wrote.push((rank, d));
        }
        let (Some(to), Some(msg)) = (step.send_to(), msg) else {
            return;
        };
        let partial = collective.is_reducing() && msg.iter().any(|v| v.ranks != full);
        let b = msg.len() * elem_bytes;
        if partial {
            rec.bytes[rank].reduce += b;
        } else {
            rec.bytes[rank].gather += b;
        }
        if !keep_rounds {
            return;
        }
        let region = match step {
            Step::Send { src, .. }
            | Step::CopySend { src, .. }
            | Step::RecvReduceSend { src, .. }
            | Step::RecvReduceCopySend { src, .. } => src,
            Step::RecvCopySend { dst, .. } => dst,
            _ => return,
        };
        let at = positions(collective, count, rank, &region);
        if matches!(step, Step::RecvReduceSend { .. }) {
            rec.message_held.push((rank, at.clone(), msg.to_vec()));
        }
        rec.in_flight.push(Transfer {
            from: rank,
            to,
            chunks: at.collect(),
            partial,
        });
    };
    let after_round = |_: usize, bufs: &[Vec<Buffers<Tracked>>]| {
        let mut rec = rec.borrow_mut();
        let rec = &mut *rec;
        if keep_rounds {
            let before = rec.held.clone();
            for (rank, at, values) in rec.message_held.drain(..) {
                for (p, v) in at.zip(values) {
                    rec.held[rank][p] = Some(v);
                }
            }
            for (rank, d) in rec.wrote.drain(..) {
                // The direct algorithms gather contributions into per-rank scratch slots
                // before folding them: what a rank holds changes when the fold lands in
                // the output.
                if d.buf == Buf::Scratch && algorithm.folds_in_rank_order() {
                    continue;
                }
                let at = positions(collective, count, rank, &d);
                // Output, or the scratch memory a tree reduce keeps partial sums in.
                let values = bufs[rank][0].read(&d).unwrap_or_default();
                for (p, v) in at.zip(values) {
                    rec.held[rank][p] = Some(v);
                }
            }
            let changed = (0..nranks)
                .map(|r| (0..width).map(|p| rec.held[r][p] != before[r][p]).collect())
                .collect();
            let index = rec.rounds.len();
            let transfers = std::mem::take(&mut rec.arriving);
            rec.rounds.push(Round {
                index,
                transfers,
                held: rec.held.clone(),
                changed,
            });
        }
        rec.arriving = std::mem::take(&mut rec.in_flight);
    };
    simulate_observed(&plans, &mut bufs, &arith, on_step, after_round)?;
    let Recorder {
        bytes, mut rounds, ..
    } = rec.into_inner();
    // The simulator's first round only sends (nothing changes): it is the start, and
    // its messages are the transfers of the next round.
    if rounds.len() > 1 && rounds[1].changed.iter().flatten().all(|c| !c) {
        rounds.remove(1);
        for (i, r) in rounds.iter_mut().enumerate() {
            r.index = i;
        }
    }
    // The trees the plan used: all-reduce both of the double binary tree, broadcast and
    // reduce the first one re-rooted at their root.
    let tree_parents = match (algorithm, collective.root()) {
        (Algorithm::Tree, None) => (0..2)
            .map(|t| plan::tree::RankTree::new(&hosts, t).parent)
            .collect(),
        (Algorithm::Tree, Some(root)) => {
            vec![plan::tree::RankTree::rooted_at(&hosts, root).parent]
        }
        _ => Vec::new(),
    };
    Ok((
        StepTable {
            collective,
            algorithm,
            nranks,
            chunks: width,
            rounds,
            tree_parents,
            values: "rank r starts with (r+1)*10 + chunk index".into(),
        },
        bytes,
    ))
}

/// The step table of `collective` on `nranks` ranks, one element per chunk (so a ring
/// all-reduce shows `nranks` chunks), starting from [`initial_value`].
pub fn step_table(
    collective: Collective,
    algorithm: Algorithm,
    nranks: usize,
) -> Result<StepTable> {
    step_table_with(collective, algorithm, nranks, &initial_value)
}

/// Like [`step_table`], rank `r` starting with `values(r, chunk)`.
pub fn step_table_with(
    collective: Collective,
    algorithm: Algorithm,
    nranks: usize,
    values: &dyn Fn(usize, usize) -> i64,
) -> Result<StepTable> {
    let count = match collective {
        Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. } => nranks,
        _ => 1,
    };
    run(collective, algorithm, nranks, count, 1, true, values).map(|(t, _)| t)
}

/// Like [`step_table`], with small values drawn from `seed` (1 to 99).
pub fn step_table_seeded(
    collective: Collective,
    algorithm: Algorithm,
    nranks: usize,
    seed: u64,
) -> Result<StepTable> {
    let mut t = step_table_with(collective, algorithm, nranks, &|r, c| {
        let mut x = seed ^ ((r as u64) << 32) ^ c as u64;
        x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^= x >> 29;
        1 + (x % 99) as i64
    })?;
    t.values = format!("values from seed {seed}");
    Ok(t)
}

/// Bytes each rank sends, by phase, for `collective` over `count` elements of
/// `elem_bytes` per rank (the real plan, simulated).
pub fn phase_bytes(
    collective: Collective,
    algorithm: Algorithm,
    nranks: usize,
    count: usize,
    elem_bytes: usize,
) -> Result<Vec<PhaseBytes>> {
    run(
        collective,
        algorithm,
        nranks,
        count,
        elem_bytes,
        false,
        &initial_value,
    )
    .map(|(_, b)| b)
}

/// Spreadsheet-style name of chunk `i` (a, b, …, z, aa, ab, …).
pub fn chunk_name(i: usize) -> String {
    let mut s = String::new();
    let mut n = i + 1;
    while n > 0 {
        n -= 1;
        s.insert(0, (b'a' + (n % 26) as u8) as char);
        n /= 26;
    }
    s
}

impl StepTable {
    /// The algorithm as shown: the plan's, where it applies to the collective; the ring
    /// stands for the one plan of the others.
    pub fn algorithm_label(&self) -> &'static str {
        if self.algorithm.applies_to(self.collective) {
            self.algorithm.name()
        } else {
            "ring"
        }
    }

    /// The phase a round belongs to, for headings (a round without messages, where
    /// ranks only combine what they hold, belongs to the phase before it).
    pub fn phase_of(&self, round: &Round) -> &'static str {
        if round.index == 0 {
            return "start";
        }
        if round.transfers.is_empty() {
            return self.phase_of(&self.rounds[round.index - 1]);
        }
        let partial = round.transfers.iter().any(|t| t.partial);
        let tree = self.algorithm == Algorithm::Tree;
        let doubling = self.algorithm == Algorithm::Doubling;
        match self.collective {
            Collective::AllReduce if tree && partial => "reduce up the trees",
            Collective::AllReduce if tree => "broadcast down the trees",
            Collective::AllReduce if doubling && partial => "exchange partial sums",
            Collective::AllReduce if doubling => "hand results back",
            Collective::AllReduce if partial => "reduce-scatter",
            Collective::AllReduce => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::Reduce { .. } if tree => "reduce up the tree",
            Collective::Reduce { .. } => "reduce",
            Collective::AllGather => "all-gather",
            Collective::Broadcast { .. } if tree => "broadcast down the tree",
            _ => "broadcast",
        }
    }

    /// The table as text: one block per round with every rank's chunks (`*` marks what
    /// changed, `·` what a rank does not hold), the transfers, and the byte count summary.
    pub fn render_text(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} on {} ranks ({}); {}; [k] = inputs of k ranks",
            self.collective,
            self.nranks,
            self.algorithm_label(),
            self.values
        );
        if !self.tree_parents.is_empty() {
            for (t, parents) in self.tree_parents.iter().enumerate() {
                let _ = writeln!(out, "tree {t}: parent of each rank {parents:?}");
            }
        }
        let width = 11;
        for round in &self.rounds {
            let _ = writeln!(out, "\nround {} — {}", round.index, self.phase_of(round));
            for t in &round.transfers {
                let names: Vec<String> = t.chunks.iter().map(|&c| chunk_name(c)).collect();
                let _ = writeln!(
                    out,
                    "  rank {} -> rank {}: chunk {} ({})",
                    t.from,
                    t.to,
                    names.join(","),
                    if t.partial { "partial" } else { "final" }
                );
            }
            let _ = write!(out, "  {:>7}", "");
            for c in 0..self.chunks {
                let _ = write!(out, "{:>width$}", chunk_name(c));
            }
            let _ = writeln!(out);
            for (r, row) in round.held.iter().enumerate() {
                let _ = write!(out, "  rank {r:<2}");
                for (c, cell) in row.iter().enumerate() {
                    let text = match cell {
                        Some(v) => format!(
                            "{}{}[{}]",
                            if round.changed[r][c] { "*" } else { "" },
                            v.value,
                            v.contributions()
                        ),
                        None => "·".into(),
                    };
                    let _ = write!(out, "{text:>width$}");
                }
                let _ = writeln!(out);
            }
        }
        out
    }
}

/// What each rank sends in each phase of `collective` on `nranks` ranks, as text, next
/// to the textbook fractions of the buffer size `S` (the real plan, simulated with
/// `S` = `nranks` × 1024 four-byte elements).
pub fn bytes_summary(
    collective: Collective,
    algorithm: Algorithm,
    nranks: usize,
) -> Result<String> {
    use std::fmt::Write;
    let count = match collective {
        Collective::AllGather | Collective::ReduceScatter => 1024,
        _ => nranks * 1024,
    };
    let bytes = phase_bytes(collective, algorithm, nranks, count, 4)?;
    let s = match collective {
        Collective::AllGather | Collective::ReduceScatter => count * nranks * 4,
        _ => count * 4,
    } as f64;
    let n = nranks as f64;
    let (first, second) = match (collective, algorithm) {
        (Collective::AllReduce, Algorithm::Tree) => ("up the trees", "down the trees"),
        (Collective::AllReduce, Algorithm::Doubling) => ("partial sums", "results"),
        (Collective::AllReduce, _) => ("reduce-scatter", "all-gather"),
        _ => ("partial", "final"),
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nbytes sent per rank, as fractions of the buffer S = {} B:",
        s as usize
    );
    for (r, b) in bytes.iter().enumerate() {
        let _ = writeln!(
            out,
            "  rank {r:<2} {first} {:.4} S, {second} {:.4} S, total {:.4} S",
            b.reduce as f64 / s,
            b.gather as f64 / s,
            (b.reduce + b.gather) as f64 / s
        );
    }
    if algorithm == Algorithm::Ring && collective == Collective::AllReduce {
        let _ = writeln!(
            out,
            "  ring: (n-1)/n = {:.4} S in each phase, 2(n-1)/n = {:.4} S in all",
            (n - 1.0) / n,
            2.0 * (n - 1.0) / n
        );
    }
    Ok(out)
}
