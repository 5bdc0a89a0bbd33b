//! The in-memory simulator: runs every rank's [`Plan`] on vectors, exactly.
//!
//! It executes the same steps with the same rules as the engine (which region is a
//! contribution, where the post-operation applies, what is skipped when in place), in
//! lock-step rounds: in each round every lane of every rank performs its next step if
//! the message it needs was sent in an earlier round. Round by round this is the classic
//! step table of ring all-reduce; at the end every buffer holds what the engine would
//! have produced. Mismatched plans (a message of the wrong length, a receive that never
//! gets a message, a message nobody receives) are reported as errors.

use std::collections::{HashMap, VecDeque};

use super::{Buf, Plan, Region, Step};
use crate::error::{Error, Result};

/// A function of two elements (a reduction).
pub type Combine<T> = Box<dyn Fn(&T, &T) -> T>;
/// A function of one element (a pre- or post-operation).
pub type Map<T> = Box<dyn Fn(&T) -> T>;

/// How a reducing operation combines values: `combine(received, pre(own))`, then `post`
/// on final values. Non-reducing operations use none of them.
pub struct Arith<T> {
    /// Whether the operation reduces (all-reduce, reduce, reduce-scatter).
    pub reducing: bool,
    /// The reduction (sum, product, …).
    pub combine: Combine<T>,
    /// Applied to a rank's own contribution before it is combined or sent.
    pub pre: Map<T>,
    /// Applied to a final reduced value before it is stored.
    pub post: Map<T>,
}

impl<T: Clone + 'static> Arith<T> {
    /// Data movement only (broadcast, all-gather, …).
    pub fn copy() -> Self {
        Arith {
            reducing: false,
            combine: Box::new(|a, _| a.clone()),
            pre: Box::new(T::clone),
            post: Box::new(T::clone),
        }
    }

    /// A reduction with `combine` and no pre- or post-operation.
    pub fn reduce(combine: impl Fn(&T, &T) -> T + 'static) -> Self {
        Arith {
            reducing: true,
            combine: Box::new(combine),
            pre: Box::new(T::clone),
            post: Box::new(T::clone),
        }
    }
}

/// One operation's buffers on one rank: a single vector that holds the input and the
/// output at two offsets, so that in-place calls alias exactly as pointers would.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffers<T> {
    /// The memory.
    pub mem: Vec<T>,
    /// Where the input buffer starts in `mem`.
    pub input_at: usize,
    /// Where the output buffer starts in `mem`.
    pub output_at: usize,
    /// Length of the input buffer.
    pub input_len: usize,
    /// Length of the output buffer.
    pub output_len: usize,
    /// The call's scratch memory ([`Buf::Scratch`]): grows as it is written; reading
    /// an element never written is an error of the plan.
    scratch: Vec<Option<T>>,
}

impl<T: Clone> Buffers<T> {
    /// Separate input and output buffers; the output starts filled with `fill`.
    pub fn separate(input: Vec<T>, output_len: usize, fill: T) -> Self {
        let input_len = input.len();
        let mut mem = input;
        mem.extend(std::iter::repeat_n(fill, output_len));
        Buffers {
            mem,
            input_at: 0,
            output_at: input_len,
            input_len,
            output_len,
            scratch: Vec::new(),
        }
    }

    /// One buffer `mem` used as output, with the input at `input_at` inside it (e.g.
    /// `rank * count` for an in-place all-gather).
    pub fn input_inside_output(mem: Vec<T>, input_at: usize, input_len: usize) -> Self {
        let output_len = mem.len();
        Buffers {
            mem,
            input_at,
            output_at: 0,
            input_len,
            output_len,
            scratch: Vec::new(),
        }
    }

    /// One buffer `mem` used as input, with the output at `output_at` inside it (an
    /// in-place reduce-scatter or scatter).
    pub fn output_inside_input(mem: Vec<T>, output_at: usize, output_len: usize) -> Self {
        let input_len = mem.len();
        Buffers {
            mem,
            input_at: 0,
            output_at,
            input_len,
            output_len,
            scratch: Vec::new(),
        }
    }

    /// The input buffer.
    pub fn input(&self) -> &[T] {
        &self.mem[self.input_at..self.input_at + self.input_len]
    }

    /// The output buffer.
    pub fn output(&self) -> &[T] {
        &self.mem[self.output_at..self.output_at + self.output_len]
    }

    fn range(&self, r: &Region) -> Result<std::ops::Range<usize>> {
        let (base, len) = match r.buf {
            Buf::Input => (self.input_at, self.input_len),
            Buf::Output => (self.output_at, self.output_len),
            Buf::Scratch => unreachable!("scratch is handled by read and write"),
        };
        if r.end() > len {
            return Err(Error::invalid(format!(
                "simulate: region {r} is outside a buffer of {len} elements"
            )));
        }
        Ok(base + r.offset..base + r.end())
    }

    /// The values of region `r`: an error if it lies outside its buffer, or is scratch
    /// memory never written.
    pub fn read(&self, r: &Region) -> Result<Vec<T>> {
        if r.buf == Buf::Scratch {
            return self
                .scratch
                .get(r.offset..r.end())
                .and_then(|s| s.iter().cloned().collect::<Option<Vec<T>>>())
                .ok_or_else(|| {
                    Error::invalid(format!("simulate: {r} is read before it is written"))
                });
        }
        Ok(self.mem[self.range(r)?].to_vec())
    }

    fn write(&mut self, r: &Region, values: &[T]) -> Result<()> {
        if r.buf == Buf::Scratch {
            if self.scratch.len() < r.end() {
                self.scratch.resize(r.end(), None);
            }
            for (cell, v) in self.scratch[r.offset..r.end()].iter_mut().zip(values) {
                *cell = Some(v.clone());
            }
            return Ok(());
        }
        let range = self.range(r)?;
        self.mem[range].clone_from_slice(values);
        Ok(())
    }
}

/// One executed step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimEvent {
    /// The round it ran in (0-based).
    pub round: usize,
    /// The rank that ran it.
    pub rank: usize,
    /// The lane it belongs to.
    pub lane: usize,
    /// The step.
    pub step: Step,
}

/// What a simulation did.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    /// Number of rounds until every lane finished.
    pub rounds: usize,
    /// Every step, in execution order.
    pub events: Vec<SimEvent>,
}

/// Runs `plans` (one per rank, rank order) over `bufs[rank][op]` with `arith[op]`.
pub fn simulate<T: Clone>(
    plans: &[Plan],
    bufs: &mut [Vec<Buffers<T>>],
    arith: &[Arith<T>],
) -> Result<SimReport> {
    simulate_with(plans, bufs, arith, |_, _| {})
}

/// Like [`simulate`], calling `after_round(round, bufs)` after every round (for step
/// tables and animations).
pub fn simulate_with<T: Clone>(
    plans: &[Plan],
    bufs: &mut [Vec<Buffers<T>>],
    arith: &[Arith<T>],
    after_round: impl FnMut(usize, &[Vec<Buffers<T>>]),
) -> Result<SimReport> {
    simulate_observed(plans, bufs, arith, |_, _| {}, after_round)
}

/// Like [`simulate_with`], also calling `on_step(event, message)` for every step as it
/// runs, with the message it sends (if any): the values that travel, partial sums
/// included, which no buffer holds.
pub fn simulate_observed<T: Clone>(
    plans: &[Plan],
    bufs: &mut [Vec<Buffers<T>>],
    arith: &[Arith<T>],
    mut on_step: impl FnMut(&SimEvent, Option<&[T]>),
    mut after_round: impl FnMut(usize, &[Vec<Buffers<T>>]),
) -> Result<SimReport> {
    let n = plans.len();
    if bufs.len() != n {
        return Err(Error::invalid(format!(
            "simulate: {n} plans but buffers for {} ranks",
            bufs.len()
        )));
    }
    for (r, p) in plans.iter().enumerate() {
        if p.rank != r || p.nranks != n {
            return Err(Error::invalid(format!(
                "simulate: plan {r} is for rank {} of {}",
                p.rank, p.nranks
            )));
        }
        if bufs[r].len() < p.ops.len() || arith.len() < p.ops.len() {
            return Err(Error::invalid(format!(
                "simulate: rank {r} has {} operations but buffers/arithmetic for fewer",
                p.ops.len()
            )));
        }
    }
    // In-flight messages per (channel, from, to).
    let mut fifos: HashMap<(usize, usize, usize), VecDeque<Vec<T>>> = HashMap::new();
    let mut cursor: Vec<Vec<usize>> = plans.iter().map(|p| vec![0; p.lanes.len()]).collect();
    let mut report = SimReport::default();
    loop {
        let mut sent: Vec<((usize, usize, usize), Vec<T>)> = Vec::new();
        let mut progressed = false;
        let mut pending = false;
        for (rank, plan) in plans.iter().enumerate() {
            for (li, lane) in plan.lanes.iter().enumerate() {
                let Some(step) = lane.steps.get(cursor[rank][li]) else {
                    continue;
                };
                pending = true;
                let received = match step.recv_from() {
                    Some(from) => {
                        let key = (lane.channel, from, rank);
                        match fifos.get_mut(&key).and_then(VecDeque::pop_front) {
                            Some(msg) if msg.len() == step.len() => Some(msg),
                            Some(msg) => {
                                return Err(Error::invalid(format!(
                                    "simulate: rank {rank} step `{step}` expects {} elements \
                                     from rank {from} but the message has {}",
                                    step.len(),
                                    msg.len()
                                )));
                            }
                            None => continue,
                        }
                    }
                    None => None,
                };
                let out = execute(step, received, &mut bufs[rank], arith)?;
                let event = SimEvent {
                    round: report.rounds,
                    rank,
                    lane: li,
                    step: *step,
                };
                on_step(&event, out.as_deref());
                if let (Some(to), Some(msg)) = (step.send_to(), out) {
                    sent.push(((lane.channel, rank, to), msg));
                }
                report.events.push(event);
                cursor[rank][li] += 1;
                progressed = true;
            }
        }
        if !pending {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = plans
                .iter()
                .enumerate()
                .flat_map(|(rank, p)| {
                    let cursor = &cursor;
                    p.lanes.iter().enumerate().filter_map(move |(li, l)| {
                        l.steps
                            .get(cursor[rank][li])
                            .map(|s| format!("rank {rank} lane {li}: {s}"))
                    })
                })
                .collect();
            return Err(Error::invalid(format!(
                "simulate: no step can run in round {}; waiting: {stuck:?}",
                report.rounds
            )));
        }
        for (key, msg) in sent {
            fifos.entry(key).or_default().push_back(msg);
        }
        after_round(report.rounds, bufs);
        report.rounds += 1;
    }
    if let Some(((c, from, to), q)) = fifos.iter().find(|(_, q)| !q.is_empty()) {
        return Err(Error::invalid(format!(
            "simulate: {} message(s) from rank {from} to rank {to} on channel {c} were never \
             received",
            q.len()
        )));
    }
    Ok(report)
}

/// Executes one step on one rank's buffers; returns the message it sends, if any.
fn execute<T: Clone>(
    step: &Step,
    received: Option<Vec<T>>,
    bufs: &mut [Buffers<T>],
    arith: &[Arith<T>],
) -> Result<Option<Vec<T>>> {
    // The local operand: a contribution gets the pre-operation in reducing operations.
    let operand = |bufs: &[Buffers<T>], r: &Region| -> Result<Vec<T>> {
        let a = &arith[r.op];
        let v = bufs[r.op].read(r)?;
        Ok(if a.reducing && r.buf == Buf::Input {
            v.iter().map(|x| (a.pre)(x)).collect()
        } else {
            v
        })
    };
    let combine = |r: &Region, x: &[T], own: &[T]| -> Vec<T> {
        let a = &arith[r.op];
        x.iter().zip(own).map(|(x, o)| (a.combine)(x, o)).collect()
    };
    let finish = |r: &Region, v: Vec<T>| -> Vec<T> {
        let a = &arith[r.op];
        v.iter().map(|x| (a.post)(x)).collect()
    };
    let x = received.unwrap_or_default();
    Ok(match *step {
        Step::Send { src, .. } => Some(operand(bufs, &src)?),
        Step::Recv { dst, .. } => {
            bufs[dst.op].write(&dst, &x)?;
            None
        }
        Step::CopySend { src, dst, .. } => {
            let v = operand(bufs, &src)?;
            bufs[dst.op].write(&dst, &v)?;
            Some(v)
        }
        Step::RecvReduceSend { src, .. } => {
            let own = operand(bufs, &src)?;
            Some(combine(&src, &x, &own))
        }
        Step::RecvReduceCopy {
            src,
            dst,
            post,
            local_first,
            ..
        } => {
            let own = operand(bufs, &src)?;
            let v = if local_first {
                combine(&src, &own, &x)
            } else {
                combine(&src, &x, &own)
            };
            let v = if post { finish(&dst, v) } else { v };
            bufs[dst.op].write(&dst, &v)?;
            None
        }
        Step::RecvReduceCopySend { src, dst, .. } => {
            let own = operand(bufs, &src)?;
            let v = finish(&dst, combine(&src, &x, &own));
            bufs[dst.op].write(&dst, &v)?;
            Some(v)
        }
        Step::RecvCopySend { dst, .. } => {
            bufs[dst.op].write(&dst, &x)?;
            Some(x)
        }
        Step::Reduce { a, b, dst, post } => {
            let (a, b) = (operand(bufs, &a)?, operand(bufs, &b)?);
            let v = combine(&dst, &a, &b);
            let v = if post { finish(&dst, v) } else { v };
            bufs[dst.op].write(&dst, &v)?;
            None
        }
        Step::Copy { src, dst } => {
            let v = operand(bufs, &src)?;
            let v = if arith[dst.op].reducing {
                finish(&dst, v)
            } else {
                v
            };
            bufs[dst.op].write(&dst, &v)?;
            None
        }
    })
}
