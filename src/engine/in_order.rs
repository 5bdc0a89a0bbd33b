//! Small calls: a plan of one lane whose every step fits one LL slot runs its steps in
//! order, each whole, waiting at the step that cannot go.
//!
//! That is what the sweep does with such a plan too, but the sweep's generality costs
//! more than a small call's hand-off: it keeps a state per lane, cuts every step into
//! slices, and returns to the top of the plan after every wait. An 8-byte all-reduce on
//! 2 ranks is a send and a receive-and-fold; here it is two passes of a loop.

use super::waiting::{Look, Waiting};
use super::{
    FAR_SLOT_STREAMING_FROM, OpBuffers, local_step, move_slice, no_connection, op_of, peek_slice,
    step_blocked_on, wrong_slice,
};
use crate::error::{CallInfo, Result};
use crate::plan::{Lane, Plan, Step};
use crate::transport::fifo::RecvEnd;
use crate::transport::{Connections, Protocol};

use super::SliceSlots;

/// The lane of `plan`, if it can run in order: one lane, LL only, every step one slice
/// of at most `slice_bytes`.
pub(super) fn lane_in_order<'p>(
    plan: &'p Plan,
    ops: &[OpBuffers],
    slice_bytes: usize,
) -> Option<&'p Lane> {
    let [lane] = plan.lanes.as_slice() else {
        return None;
    };
    let fits = |step: &Step| {
        let op = &ops[op_of(step)];
        step.is_local()
            || (op.protocol == Protocol::LL && step.len() * op.kernel.dtype().size() <= slice_bytes)
    };
    lane.steps.iter().all(fits).then_some(lane)
}

/// Runs `lane`'s steps in order (see the module documentation).
///
/// # Safety
/// As [`super::execute`], for the plan `lane` belongs to; every step fits one slice
/// ([`lane_in_order`]).
pub(super) unsafe fn run_in_order(
    lane: &Lane,
    ops: &[OpBuffers],
    conns: &mut Connections,
    call: &CallInfo,
    waiting: &mut Waiting,
) -> Result<()> {
    let channel = lane.channel;
    for step in &lane.steps {
        #[cfg(feature = "fault-injection")]
        crate::fault::strike(step);
        if step.is_local() {
            // SAFETY: regions inside their buffers by contract.
            unsafe { local_step(ops, step) };
            continue;
        }
        if step.is_empty() {
            continue;
        }
        let mut this = OneStep {
            step,
            channel,
            op: &ops[op_of(step)],
        };
        // SAFETY: forwarded from this function's contract.
        while !unsafe { this.try_move(ops, conns)? } {
            waiting.idle(conns, call, &mut this)?;
        }
        waiting.progressed();
    }
    Ok(())
}

/// A step waiting to move its one slice.
struct OneStep<'a> {
    step: &'a Step,
    channel: usize,
    op: &'a OpBuffers,
}

impl OneStep<'_> {
    fn bytes(&self) -> usize {
        self.step.len() * self.op.kernel.dtype().size()
    }

    /// Moves the step's slice if its FIFOs are ready; returns whether it did.
    ///
    /// # Safety
    /// As [`run_in_order`].
    unsafe fn try_move(&mut self, ops: &[OpBuffers], conns: &mut Connections) -> Result<bool> {
        let (step, channel) = (self.step, self.channel);
        let (to, from) = (step.send_to(), step.recv_from());
        if let Some(p) = from {
            conns.read_in_line(channel, p);
        }
        if let Some(p) = to {
            conns.poll_for_room(channel, p);
        }
        let bytes = self.bytes();
        // As the sweep does: a slice long enough goes past the caches towards a far peer
        // (asked only then: a small call's look costs what it did).
        let far = bytes >= FAR_SLOT_STREAMING_FROM
            && to.is_some_and(|p| {
                conns.streams_slots_to(p, self.op.protocol, self.op.may_stream_slots)
            });
        // Ranks that outnumber cores yield at once instead (see `Waiting::idle`).
        let close_looks = if conns.oversubscribed() {
            0
        } else {
            CLOSE_LOOKS
        };
        let (send, recv) = conns.ends(channel, self.op.protocol, to, from);
        if to.is_some() != send.is_some() || from.is_some() != recv.is_some() {
            return Err(no_connection(step, channel));
        }
        let (mut send, mut recv) = (send, recv);
        let inbound = match recv.as_deref_mut() {
            Some(r) => match peek_close(r, bytes, close_looks) {
                Some((p, got)) if got == bytes => Some(p),
                Some((_, got)) => return Err(wrong_slice(step, bytes, got)),
                None => return Ok(false),
            },
            None => None,
        };
        let outbound = match send.as_deref_mut() {
            Some(s) => match s.try_reserve(bytes) {
                Some(p) => Some(p),
                None => return Ok(false),
            },
            None => None,
        };
        let slots = SliceSlots {
            inbound,
            outbound,
            far,
            also: &[],
        };
        // SAFETY: the slots are this side's between peek/reserve and release/commit and
        // hold `bytes` (one slice); regions are in bounds by contract.
        unsafe { move_slice(step, ops, self.op, 0, step.len(), slots) };
        if let Some(r) = recv {
            r.release();
        }
        if let Some(s) = send {
            s.commit(bytes);
        }
        if let Some(p) = to {
            conns.ring_send(channel, p);
        }
        if let Some(p) = from {
            conns.ring_recv(channel, p);
        }
        Ok(true)
    }
}

/// Looks a few more times at the FIFO from the peer when the first look finds it empty,
/// before [`OneStep::try_move`] gives up. A small call waits about one hand-off for its
/// reply, and these looks cost one load each, where a whole look (the links, the ends,
/// then the FIFO) costs tens of nanoseconds; the sooner the reply is seen, the sooner
/// the next call goes out (2 ranks, 8-byte all-reduce, near CPUs: 0.160 -> 0.144 µs,
/// medians of 6 interleaved runs, with floors of 0.045-0.050).
const CLOSE_LOOKS: u32 = 32;

/// [`peek_slice`], looked at up to `looks` more times while it finds nothing.
fn peek_close(r: &mut RecvEnd, bytes: usize, looks: u32) -> Option<(*const u8, usize)> {
    peek_slice(r, bytes).or_else(|| {
        (0..looks).find_map(|_| {
            std::hint::spin_loop();
            peek_slice(r, bytes)
        })
    })
}

impl Look for OneStep<'_> {
    fn blocked_on(&mut self, conns: &mut Connections) -> Vec<usize> {
        let mut peers = Vec::new();
        step_blocked_on(self.step, self.channel, self.op.protocol, conns, &mut peers);
        peers
    }

    fn look(&mut self, conns: &mut Connections) -> Result<bool> {
        // Whether the step can move now (the caller moves it).
        Ok(self.blocked_on(conns).is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Algorithm, Collective, PlanOptions, plan};
    use crate::reduce::Kernel;
    use crate::{DataType, ReduceOp};

    fn ops(protocol: Protocol) -> [OpBuffers; 1] {
        let kernel = Kernel::new(DataType::Float32, ReduceOp::Sum, 2).unwrap();
        [OpBuffers {
            input: std::ptr::null(),
            output: std::ptr::null_mut(),
            scratch: std::ptr::null_mut(),
            protocol,
            kernel,
            plain: kernel,
            reducing: true,
            streaming: false,
            may_stream_slots: true,
            write_back: false,
        }]
    }

    fn all_reduce(algorithm: Algorithm, count: usize, channels: usize) -> Plan {
        let options = PlanOptions::for_hosts(&[0, 0], channels, 1 << 20).with_algorithm(algorithm);
        plan(Collective::AllReduce, count, 1, 2, &options).unwrap()
    }

    /// Small LL plans of one lane run in order; plans of several lanes, Simple or
    /// single-copy ones, and steps larger than a slice are swept.
    #[test]
    fn only_one_lane_of_one_slice_steps_runs_in_order() {
        let one_shot = all_reduce(Algorithm::OneShot, 2, 1);
        assert!(lane_in_order(&one_shot, &ops(Protocol::LL), 56).is_some());
        // The ring's steps are one slice each too.
        assert!(
            lane_in_order(&all_reduce(Algorithm::Ring, 2, 1), &ops(Protocol::LL), 56).is_some()
        );
        assert!(lane_in_order(&one_shot, &ops(Protocol::Simple), 56).is_none());
        assert!(lane_in_order(&one_shot, &ops(Protocol::SingleCopy), 56).is_none());
        // 15 floats: 60 bytes, past a 56-byte slice.
        let larger = all_reduce(Algorithm::OneShot, 15, 1);
        assert!(lane_in_order(&larger, &ops(Protocol::LL), 56).is_none());
        assert!(lane_in_order(&larger, &ops(Protocol::LL), 64).is_some());
        let two_lanes = all_reduce(Algorithm::OneShot, 64, 2);
        assert_eq!(two_lanes.lanes.len(), 2);
        assert!(lane_in_order(&two_lanes, &ops(Protocol::LL), 1 << 20).is_none());
    }
}
