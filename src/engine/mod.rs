//! Runs plans: moves data through the FIFOs and reduces it with the host kernels.
//!
//! [`execute`] runs one rank's [`Plan`] to completion in the calling thread (a blocking
//! call on host memory needs no hand-off to another thread). All lanes progress
//! together: the engine sweeps over them, advancing each as far as its FIFOs allow, one
//! slot-sized slice at a time; a step that receives reads the peer's slot in place
//! (reducing straight from it into the destination or into the next peer's slot) and
//! hands it back at once. A small plan (one lane, LL, every step one slice) skips the
//! sweep and runs its steps in order (`engine/in_order.rs`).
//!
//! When a sweep moves nothing the rank waits (`engine/waiting.rs`), in three stages so
//! that eight ranks on two cores still run at full speed: a short spin (a reply from a
//! rank on another core takes well under a microsecond), then a few `sched_yield`s (let
//! a rank that shares this core run), then sleep on the rank's
//! [bell](crate::transport::bell) until a peer rings it. Each sleep is bounded, so the deadline is honoured and dead peers are
//! noticed: before sleeping the engine looks at the peers it waits on — a peer that
//! closed its communicator, or whose process is gone, ends the call with
//! [`Error::PeerFailed`] naming the rank that failed first.
//!
//! Asynchronous calls run on a per-communicator progress thread ([`progress`]), in the
//! same issue order as blocking ones. Calls on device memory run the same plans on the
//! GPU ([`device`]).

pub mod device;
mod in_order;
pub mod progress;
mod single_copy;
mod waiting;

use crate::error::{CallInfo, Error, Result};
use crate::plan::{Buf, Plan, Region, Step};
use crate::reduce::Kernel;
use crate::reduce::copy::{copy, copy_maybe_overlapping};
use crate::reduce::stream::{MAX_STREAMED, stream_copy, stream_copy_keeping};
use crate::transport::bell::Closed;
use crate::transport::fifo::RecvEnd;
use crate::transport::lazy::FifoNeed;
use crate::transport::{Connections, Protocol};
use single_copy::PostedRegions;
use waiting::Waiting;

/// One operation's buffers and arithmetic, as the engine needs them.
#[derive(Clone, Copy, Debug)]
pub struct OpBuffers {
    /// Start of the input buffer (may be null when the plan never reads it).
    pub input: *const u8,
    /// Start of the output buffer (may be null when the plan never writes it).
    pub output: *mut u8,
    /// Start of the call's scratch memory, [`Plan::scratch_elems`] elements (null when
    /// the plan needs none).
    pub scratch: *mut u8,
    /// How this operation's slices cross the FIFOs. Every rank chooses it from the
    /// operation alone (a send and its matching receive choose alike), so both ends of
    /// every FIFO agree even when ranks group different operations together.
    pub protocol: Protocol,
    /// Element type and reduction.
    pub kernel: Kernel,
    /// The same reduction without its pre-operation, for operands that are partial
    /// results rather than this rank's contribution (equal to `kernel` except for
    /// pre-mul-sum).
    pub plain: Kernel,
    /// Whether the operation reduces (pre/post operations and reductions apply).
    pub reducing: bool,
    /// Whether results written to the output buffer go past the caches
    /// ([`crate::reduce::stream`]): for outputs of at least [`STREAMING_FROM`] bytes,
    /// which the caches could not keep anyway, when the trial of the call's size chose
    /// non-temporal stores ([`crate::tune::stores`]).
    pub streaming: bool,
    /// Whether slots towards a far peer may be written past the caches
    /// ([`Connections::streams_slots_to`]): the trial of the call's size chose
    /// non-temporal stores ([`crate::tune::stores`]), at every size. For large calls
    /// no fixed answer held: far, with plain slot stores, 8–128 MiB ran at 7.3 GB/s
    /// against 3.2 with non-temporal ones on one host (2 ranks, 2026-11-25), and at
    /// 1.8–2.1 against 5.8–9.9 on another (2026-11-28, afternoon).
    pub may_stream_slots: bool,
    /// Whether the operation is a two-shot all-reduce with single copy: its folds run
    /// whole where they can, and owners write each folded piece into the peers' outputs
    /// that lie in windows they mapped ([`crate::transport::single_copy`]).
    pub write_back: bool,
}

/// Output size (bytes per rank) from which the engine writes results with streaming
/// stores. Measured on the project's 2-core VM (32 MiB of L3; 2 ranks, ring all-reduce,
/// out of place, busbw GB/s plain → streaming): 2 MiB 15.6 → 6.5 (the buffers fit in
/// the cache, which streaming bypasses), 4 MiB 8.0 → 6.5, 8 MiB 4.4 → 6.7, 32 MiB
/// 4.0 → 5.6–7.0, 128 MiB 4.5 → 7.3. On a host of 2026-11-28 plain stores were faster
/// with the vCPUs far apart (8 MiB 15.3–18.2 against 9.0–9.1, 128 MiB 9.3–9.9 against
/// 7.9–8.4) and slower with them near, so the calls' own times choose
/// ([`crate::tune::stores`]); this is where that choice begins.
pub const STREAMING_FROM: usize = 8 << 20;

/// Output size (bytes per rank) from which a rank that shares its CPU with
/// `ranks_per_cpu − 1` others writes its results with streaming stores: where the
/// outputs of all the ranks a CPU runs reach [`STREAMING_FROM`] together, since they
/// pass through the same caches (and its results below [`STREAMING_FROM`] stream
/// whatever the store trial of their size chose for slots: that trial does not try
/// results there). Measured on a 2-core VM (Intel, 4 MiB of L2 per core, 2026-11-30;
/// all-reduce out of place, ring, medians of interleaved pairs, plain → streamed): 8
/// ranks at 2 MiB 2,437 → 2,196 µs (5 of 5 pairs faster) and at 4 MiB 7,070 → 5,100 (4
/// of 4), where in place took about 2,200 and 4,500; 4 ranks at 4 MiB 2,158 → 2,015 (4 of
/// 4); 3 ranks at 4 MiB 1,956 → 1,838 (3 of 3). Below the threshold no gain: 8 ranks at
/// 1 MiB 1,161 → 1,184, 512 KiB 571 → 561; 4 ranks at 2 MiB 1,054 → 1,017 (within the
/// pairs' spread).
pub fn streaming_from(ranks_per_cpu: usize) -> usize {
    STREAMING_FROM / ranks_per_cpu.max(1)
}

/// Slices of at least this many bytes bound for a far peer's slot
/// ([`Connections::streams_slots_to`]) are written with non-temporal stores (when the
/// trial of the call's size chose them, [`crate::tune::stores`]): below it, a slice is
/// a few lines, which plain stores hand over sooner. Measured, two threads on the two
/// vCPUs far apart, a message ping-ponged one way (2026-11-28): 512 B 0.29 µs plain
/// against 0.51 non-temporal, 2 KiB 1.21 against 0.78, 8 KiB 3.33 against 1.68; near,
/// 2 KiB 0.19 against 0.67. All-reduce, far: at 1 KiB plain stores were as fast or
/// faster (2 ranks 0.64–0.69 µs against 0.86–0.89; 4 ranks 5.0–6.5 against 6.1–9.2), at
/// 2 KiB non-temporal ones faster on 2 ranks (0.86–1.24 against 1.33–1.45).
pub const FAR_SLOT_STREAMING_FROM: usize = 2048;

/// The oldest slot of `r`, expected to hold a slice of `bytes`: one long enough to have
/// been streamed is also timed for the verdict on the sender's cache
/// ([`RecvEnd::try_peek_judging`]).
fn peek_slice(r: &mut RecvEnd, bytes: usize) -> Option<(*const u8, usize)> {
    match bytes >= FAR_SLOT_STREAMING_FROM {
        true => r.try_peek_judging(),
        false => r.try_peek(),
    }
}

#[derive(Clone, Copy, Default)]
struct LaneState {
    step: usize,
    /// Elements of the current step already done.
    done: usize,
    /// When tracing: when this rank reached the current step (µs since the epoch; 0 not
    /// yet).
    reached_us: u64,
    /// The peers' outputs the lane's fold in progress writes too, and which peers it has
    /// written (single copy's write-back).
    write_back: single_copy::WriteBack,
    /// Whether the current step's sender wrote its destination itself (for its trace).
    by_sender: bool,
}

/// What a traced step record names besides the step itself.
#[derive(Clone, Copy)]
struct StepTrace {
    rank: usize,
    seq: u64,
    lane: usize,
}

impl StepTrace {
    /// Notes that `st` is at a step (the first time it looks at it).
    fn reach(st: &mut LaneState) {
        if st.reached_us == 0 {
            st.reached_us = crate::trace::now_us();
        }
    }

    /// Writes the record of the step `st` just finished.
    fn finish(&self, channel: usize, step: &Step, elem: usize, st: &mut LaneState) {
        tracing::trace!(
            target: crate::trace::TRACE_TARGET,
            rank = self.rank,
            seq = self.seq,
            lane = self.lane,
            channel,
            index = st.step,
            step = step.name(),
            from = step.recv_from().map_or(-1, |p| p as i64),
            to = step.send_to().map_or(-1, |p| p as i64),
            bytes = step.len() * elem,
            by_sender = st.by_sender,
            start_us = st.reached_us,
            end_us = crate::trace::now_us(),
        );
        st.reached_us = 0;
        st.by_sender = false;
    }
}

/// How [`execute`] runs a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Every lane progresses together: the engine sweeps over them, a slice at a time.
    Sweep,
    /// A plan of one lane whose every step is one LL slice runs its steps in order,
    /// each whole (small calls: see `engine/in_order.rs`).
    InOrder,
}

impl Schedule {
    /// How `plan` runs with `ops` on `conns`: the same for every call of the plan on
    /// buffers of the same element size, so a caller that repeats one call may keep it.
    pub fn of(plan: &Plan, ops: &[OpBuffers], conns: &Connections) -> Schedule {
        match in_order::lane_in_order(plan, ops, conns.slice_bytes(Protocol::LL)) {
            Some(_) => Schedule::InOrder,
            None => Schedule::Sweep,
        }
    }
}

/// Runs `plan` on this rank until every lane is done, or fails, as `schedule` says
/// ([`Schedule::of`] that plan and element size). Steps are traced only when the
/// lanes are swept.
///
/// # Safety
/// Every region of the plan must lie inside the buffer it names in `ops` (input regions
/// readable, output regions writable), those buffers must stay valid and unused by
/// anything else for the whole call, and input and output may overlap only as the plan's
/// collective allows for in-place calls.
pub unsafe fn execute(
    schedule: Schedule,
    plan: &Plan,
    ops: &[OpBuffers],
    conns: &mut Connections,
    call: &CallInfo,
) -> Result<()> {
    #[cfg(feature = "fault-injection")]
    crate::fault::arm(call.seq)?;
    let mut waiting = Waiting::default();
    let in_order = schedule == Schedule::InOrder && !crate::trace::tracing_steps();
    // SAFETY: forwarded from this function's contract.
    let result = unsafe {
        match &plan.lanes[..] {
            [lane] if in_order => in_order::run_in_order(lane, ops, conns, call, &mut waiting),
            _ => run_lanes(plan, ops, conns, call, &mut waiting),
        }
    };
    waiting.finish(conns, result.is_ok());
    // Rebuilt rather than moved (see `Communicator::run_in_turn`).
    match result {
        Ok(()) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Makes the FIFOs `plan` needs that this rank's connections lack (see
/// [`crate::transport::lazy`]); every rank of the plan calls it for the same call.
pub fn connect_for(
    plan: &Plan,
    ops: &[OpBuffers],
    conns: &mut Connections,
    call: &CallInfo,
) -> Result<()> {
    let needs: Vec<FifoNeed> = plan
        .lanes
        .iter()
        .flat_map(|lane| {
            lane.steps.iter().filter(|s| !s.is_local()).map(|s| {
                (
                    ops[op_of(s)].protocol.fifo(),
                    lane.channel,
                    s.send_to(),
                    s.recv_from(),
                )
            })
        })
        .collect();
    let rank = conns.rank();
    conns.connect(&needs, call).map_err(|e| match e {
        Error::Io { context, source } => Error::io(
            format!(
                "rank {rank}: {} #{}: making FIFOs: {context}",
                call.op, call.seq
            ),
            source,
        ),
        other => other,
    })
}

/// [`execute`]'s work.
///
/// # Safety
/// As for [`execute`].
unsafe fn run_lanes(
    plan: &Plan,
    ops: &[OpBuffers],
    conns: &mut Connections,
    call: &CallInfo,
    waiting: &mut Waiting,
) -> Result<()> {
    // Lane states on the stack for plans of up to 16 lanes (a small call allocates
    // nothing).
    let mut inline = [LaneState::default(); 16];
    let mut heap = Vec::new();
    let lanes: &mut [LaneState] = if plan.lanes.len() <= inline.len() {
        &mut inline[..plan.lanes.len()]
    } else {
        heap.resize(plan.lanes.len(), LaneState::default());
        &mut heap
    };
    let tracing = crate::trace::tracing_steps();
    let rank = conns.rank();
    let trace = move |lane: usize| {
        tracing.then_some(StepTrace {
            rank,
            seq: call.seq,
            lane,
        })
    };
    let mut run = Sweeps {
        plan,
        lanes,
        ops,
        // Regions published by single-copy steps that peers may still be reading.
        posted: PostedRegions::new(call),
        trace,
    };
    // A single-copy call reads regions its peers publish, which a peer that fails the
    // call waits out before returning (`PostedRegions::wait_out_readers`).
    let reads_peers = ops.iter().any(|op| op.protocol == Protocol::SingleCopy);
    if reads_peers {
        conns.bell().start_reading(call.seq);
    }
    // SAFETY: forwarded from this function's contract.
    let result = unsafe { run.run_to_the_end(conns, call, waiting) };
    if reads_peers {
        conns.bell().stop_reading();
        if let Err(e) = &result {
            run.posted.wait_out_readers(conns, closed_after(e));
        }
    }
    result
}

/// How a rank that failed a call with `e` closes its communicator, telling its peers
/// which rank failed first, as far as it knows: the one it saw fail, the stalled one its
/// wait led to, or the one it timed out waiting for (itself, `ByOwner`, otherwise).
pub(crate) fn closed_after(e: &Error) -> Closed {
    match e {
        Error::PeerFailed { failed_rank, .. } => Closed::PeerFailed(*failed_rank),
        Error::Timeout {
            stalled: Some(s), ..
        } => Closed::PeerFailed(*s),
        Error::Timeout { waiting_on, .. } if !waiting_on.is_empty() => {
            Closed::PeerFailed(waiting_on[0])
        }
        _ => Closed::ByOwner,
    }
}

/// A plan's lanes and how far each has come, swept together.
struct Sweeps<'a, T: Fn(usize) -> Option<StepTrace>> {
    plan: &'a Plan,
    lanes: &'a mut [LaneState],
    ops: &'a [OpBuffers],
    posted: PostedRegions<'a>,
    trace: T,
}

impl<T: Fn(usize) -> Option<StepTrace>> Sweeps<'_, T> {
    /// Advances every lane as far as its FIFOs allow; returns whether any moved.
    ///
    /// # Safety
    /// As [`execute`], for the plan and buffers it was made with.
    unsafe fn sweep(&mut self, conns: &mut Connections) -> Result<bool> {
        // SAFETY: forwarded.
        unsafe {
            sweep(
                self.plan,
                self.lanes,
                self.ops,
                conns,
                &mut self.posted,
                &self.trace,
            )
        }
    }

    /// Sweeps and waits until every lane is done and every region it published
    /// released, or the call fails.
    ///
    /// # Safety
    /// As [`execute`], for the plan and buffers it was made with.
    unsafe fn run_to_the_end(
        &mut self,
        conns: &mut Connections,
        call: &CallInfo,
        waiting: &mut Waiting,
    ) -> Result<()> {
        loop {
            // SAFETY: forwarded from this function's contract.
            let progressed = unsafe { self.sweep(conns)? };
            if self.done() && self.posted.prune(conns) {
                return Ok(());
            }
            if progressed {
                waiting.progressed();
                continue;
            }
            waiting.idle(conns, call, self)?;
        }
    }

    /// Whether every lane finished its steps.
    fn done(&self) -> bool {
        (self.plan.lanes.iter())
            .zip(self.lanes.iter())
            .all(|(lane, st)| st.step == lane.steps.len())
    }
}

impl<T: Fn(usize) -> Option<StepTrace>> waiting::Look for Sweeps<'_, T> {
    fn blocked_on(&mut self, conns: &mut Connections) -> Vec<usize> {
        let mut peers = blocked_peers(self.plan, self.lanes, self.ops, conns);
        peers.extend(self.posted.readers());
        peers
    }

    fn look(&mut self, conns: &mut Connections) -> Result<bool> {
        // SAFETY: `Sweeps` is only made by `run_lanes`, whose contract covers its plan
        // and buffers for the whole call.
        unsafe { self.sweep(conns) }
    }
}

/// The operation a step's regions belong to.
fn op_of(step: &Step) -> usize {
    match *step {
        Step::Recv { dst, .. } | Step::RecvCopySend { dst, .. } => dst.op,
        Step::Send { src, .. }
        | Step::CopySend { src, .. }
        | Step::RecvReduceSend { src, .. }
        | Step::RecvReduceCopy { src, .. }
        | Step::RecvReduceCopySend { src, .. }
        | Step::Copy { src, .. } => src.op,
        Step::Reduce { dst, .. } => dst.op,
    }
}

/// The peers the unfinished lanes are waiting on: for each lane's current step, the
/// peer it receives from when nothing from it is ready, and the peer it sends to when
/// there is no room towards it. A step blocked on one side does not wait on the other:
/// a peer that sent all it had to and then left (its call done, its communicator
/// destroyed) is no failure while this rank waits for room towards a third.
fn blocked_peers(
    plan: &Plan,
    lanes: &[LaneState],
    ops: &[OpBuffers],
    conns: &mut Connections,
) -> Vec<usize> {
    let mut peers = Vec::new();
    for (lane, st) in plan.lanes.iter().zip(lanes) {
        let Some(step) = lane.steps.get(st.step) else {
            continue;
        };
        // A fold that runs whole waits on each of its steps' peers.
        let run = match ops[op_of(step)].write_back && st.done == 0 {
            true => single_copy::fold_run(&lane.steps, st.step).unwrap_or(st.step),
            false => st.step,
        };
        for step in lane.steps[st.step..=run].iter().filter(|s| !s.is_local()) {
            step_blocked_on(
                step,
                lane.channel,
                ops[op_of(step)].protocol,
                conns,
                &mut peers,
            );
        }
    }
    peers.sort_unstable();
    peers.dedup();
    peers
}

/// Adds to `peers` those `step` waits on: the peer it receives from when nothing from it
/// is ready, the peer it sends to when there is no room towards it.
fn step_blocked_on(
    step: &Step,
    channel: usize,
    protocol: Protocol,
    conns: &mut Connections,
    peers: &mut Vec<usize>,
) {
    let (to, from) = (step.send_to(), step.recv_from());
    let (send, recv) = conns.ends(channel, protocol, to, from);
    if let (Some(p), Some(r)) = (from, recv)
        && r.try_peek().is_none()
    {
        peers.push(p);
    }
    if let (Some(p), Some(s)) = (to, send)
        && !s.has_room()
    {
        peers.push(p);
    }
}

/// The error of a step whose FIFOs this rank lacks.
#[cold]
fn no_connection(step: &Step, channel: usize) -> Error {
    Error::invalid(format!(
        "engine: no connection for step `{step}` on channel {channel} (plan and transport \
         configuration disagree)"
    ))
}

/// The error of a step that received `got` bytes from its peer where it expected `bytes`.
#[cold]
fn wrong_slice(step: &Step, bytes: usize, got: usize) -> Error {
    Error::invalid(format!(
        "engine: step `{step}` expected a slice of {bytes} bytes from rank {} but got {got} \
         (ranks called different operations or counts?)",
        step.recv_from().unwrap_or(usize::MAX)
    ))
}

/// Address of element `skip` of `region`.
///
/// # Safety
/// The region must lie inside its buffer (see [`execute`]).
unsafe fn addr(ops: &[OpBuffers], region: &Region, skip: usize) -> *mut u8 {
    let op = &ops[region.op];
    let base = match region.buf {
        Buf::Input => op.input as *mut u8,
        Buf::Output => op.output,
        Buf::Scratch => op.scratch,
    };
    let elem = op.kernel.dtype().size();
    // SAFETY: within the buffer by the caller's contract.
    unsafe { base.add((region.offset + skip) * elem) }
}

/// Advances every lane as far as its FIFOs allow; returns whether any moved.
///
/// # Safety
/// As [`execute`].
unsafe fn sweep(
    plan: &Plan,
    lanes: &mut [LaneState],
    ops: &[OpBuffers],
    conns: &mut Connections,
    posted: &mut PostedRegions,
    trace: &impl Fn(usize) -> Option<StepTrace>,
) -> Result<bool> {
    let mut progressed = false;
    for (li, lane) in plan.lanes.iter().enumerate() {
        // SAFETY: forwarded from this function's contract.
        progressed |= unsafe {
            advance(
                &lane.steps,
                lane.channel,
                &mut lanes[li],
                ops,
                conns,
                posted,
                trace(li),
            )?
        };
    }
    Ok(progressed)
}

/// Advances one lane as far as its FIFOs allow; returns whether it moved.
///
/// # Safety
/// As [`execute`].
unsafe fn advance(
    steps: &[Step],
    channel: usize,
    st: &mut LaneState,
    ops: &[OpBuffers],
    conns: &mut Connections,
    posted: &mut PostedRegions,
    trace: Option<StepTrace>,
) -> Result<bool> {
    let mut moved = false;
    while let Some(step) = steps.get(st.step) {
        let len = step.len();
        #[cfg(feature = "fault-injection")]
        if st.done == 0 {
            crate::fault::strike(step);
        }
        if trace.is_some() {
            StepTrace::reach(st);
        }
        // A two-shot fold whose contributions are all in reach runs whole, slice by slice
        // (traced, each of its steps is recorded with the fold's times).
        if ops[op_of(step)].write_back
            && st.done == 0
            && let Some(last) = single_copy::fold_run(steps, st.step)
        {
            let run = &steps[st.step..=last];
            // SAFETY: forwarded from this function's contract.
            match unsafe { single_copy::advance_fold(run, channel, st, ops, conns, posted)? } {
                Some(true) => {
                    if let Some(t) = trace {
                        let (first, reached) = (st.step, st.reached_us);
                        for (index, step) in steps.iter().enumerate().take(last + 1).skip(first) {
                            (st.step, st.reached_us) = (index, reached);
                            t.finish(channel, step, ops[op_of(step)].kernel.dtype().size(), st);
                        }
                    }
                    st.step = last + 1;
                    moved = true;
                    continue;
                }
                Some(false) => return Ok(moved),
                None => {}
            }
        }
        if ops[op_of(step)].protocol == Protocol::SingleCopy && !step.is_local() {
            // SAFETY: forwarded from this function's contract.
            let (m, finished) =
                unsafe { single_copy::advance_step(step, channel, st, ops, conns, posted)? };
            moved |= m;
            if !finished {
                return Ok(moved);
            }
            if let Some(t) = trace {
                t.finish(channel, step, ops[op_of(step)].kernel.dtype().size(), st);
            }
            st.step += 1;
            st.done = 0;
            continue;
        }
        // No step writes memory a peer may still be reading (single copy).
        // SAFETY: regions in bounds by contract.
        if st.done == 0
            && !posted.is_empty()
            && let Some(w) = unsafe { single_copy::written(step, ops) }
            && unsafe { posted.blocks(conns, ops, &w) }
        {
            return Ok(moved);
        }
        if step.is_local() {
            // A fold's last step stores its result in the peers' outputs too.
            let also = match step {
                Step::Reduce { post: true, .. } => st.write_back.outputs(),
                _ => &[],
            };
            // SAFETY: regions inside their buffers by contract; a fold's targets are
            // peers' outputs for its piece (`WriteBack`).
            let elem = unsafe {
                match also.is_empty() {
                    true => local_step(ops, step),
                    false => local_fold_to_peers(ops, step, also),
                }
            };
            if matches!(step, Step::Reduce { post: true, .. }) {
                st.write_back.fold_done();
            }
            if let Some(t) = trace {
                t.finish(channel, step, elem, st);
            }
            st.step += 1;
            moved = true;
            continue;
        }
        let (to, from) = (step.send_to(), step.recv_from());
        // Elements per slice: every region of a step belongs to the same operation.
        let op = ops[op_of(step)];
        let elem = op.kernel.dtype().size();
        let per_slice = conns.slice_bytes(op.protocol) / elem;
        if let Some(p) = from {
            conns.read_in_line(channel, p);
        }
        if let Some(p) = to {
            conns.poll_for_room(channel, p);
        }
        // Slots towards a peer whose cache is far are written past this rank's cache.
        let far = to.is_some_and(|p| {
            op.protocol != Protocol::SingleCopy
                && conns.streams_slots_to(p, op.protocol, op.may_stream_slots)
        });
        let (send, recv) = conns.ends(channel, op.protocol, to, from);
        let (mut send, mut recv) = match (
            to.is_some() == send.is_some(),
            from.is_some() == recv.is_some(),
        ) {
            (true, true) => (send, recv),
            _ => return Err(no_connection(step, channel)),
        };
        let mut rang_to = false;
        let mut rang_from = false;
        while st.done < len {
            let n = per_slice.min(len - st.done);
            let bytes = n * elem;
            let inbound = match recv.as_deref_mut() {
                Some(r) => match peek_slice(r, bytes) {
                    Some((p, got)) => {
                        if got != bytes {
                            return Err(wrong_slice(step, bytes, got));
                        }
                        Some(p)
                    }
                    None => break,
                },
                None => None,
            };
            let outbound = match send.as_deref_mut() {
                Some(s) => match s.try_reserve(bytes) {
                    Some(p) => Some(p),
                    None => break,
                },
                None => None,
            };
            let slots = SliceSlots {
                inbound,
                outbound,
                far,
                also: &[],
            };
            // SAFETY: slots are owned by this side between peek/reserve and
            // release/commit and hold `bytes`; regions are in bounds by contract.
            unsafe { move_slice(step, ops, &op, st.done, n, slots) };
            if let Some(r) = recv.as_deref_mut() {
                r.release();
                rang_from = true;
            }
            if let Some(s) = send.as_deref_mut() {
                s.commit(bytes);
                rang_to = true;
            }
            st.done += n;
            moved = true;
        }
        if rang_to && let Some(p) = to {
            conns.ring_send(channel, p);
        }
        if rang_from && let Some(p) = from {
            conns.ring_recv(channel, p);
        }
        if st.done < len {
            return Ok(moved);
        }
        if let Some(t) = trace {
            t.finish(channel, step, elem, st);
        }
        st.step += 1;
        st.done = 0;
    }
    Ok(moved)
}

/// The kernel for a local operand: the full one (with the pre-operation) for this
/// rank's contribution in the input buffer, the plain one for a partial result.
fn operand_kernel<'a>(op: &'a OpBuffers, src: &Region) -> &'a Kernel {
    if src.buf == Buf::Input {
        &op.kernel
    } else {
        &op.plain
    }
}

/// A local step, whole; returns its element size (for its trace).
///
/// - `Copy`: `dst = src`, or `dst = post(pre(src))` in a reducing operation.
/// - `Reduce`: `dst = a ⊕ b`, each operand with the pre-operation if it is this rank's
///   contribution, and the post-operation if final.
///
/// # Safety
/// Regions inside their buffers.
unsafe fn local_step(ops: &[OpBuffers], step: &Step) -> usize {
    let (src, dst) = match *step {
        Step::Copy { src, dst } => (src, dst),
        Step::Reduce { a, b, dst, post } => {
            let op = &ops[dst.op];
            let n = dst.len;
            // SAFETY (whole block): in bounds by contract; the kernels allow their
            // destination to equal an operand, and `a` is only the input when `b` is not
            // (a rank has one contribution), so writing `pre(a)` to `dst` first never
            // overwrites `b`.
            unsafe {
                let (pa, pb, d) = (addr(ops, &a, 0), addr(ops, &b, 0), addr(ops, &dst, 0));
                let pa = if a.buf == Buf::Input && op.kernel.has_pre() {
                    op.kernel.pre(d, pa, n);
                    d
                } else {
                    pa
                };
                operand_kernel(op, &b).reduce(d, pa, pb, n);
                if post {
                    op.kernel.post(d, n);
                }
            }
            return op.kernel.dtype().size();
        }
        _ => unreachable!("only copies and folds are local"),
    };
    let op = &ops[dst.op];
    let elem = op.kernel.dtype().size();
    // SAFETY: forwarded.
    let (s, d) = unsafe { (addr(ops, &src, 0) as *const u8, addr(ops, &dst, 0)) };
    let n = src.len;
    if op.reducing {
        // SAFETY: `pre` allows dst == src; regions are in bounds.
        unsafe {
            op.kernel.pre(d, s, n);
            op.kernel.post(d, n);
        }
    } else if !std::ptr::eq(s, d) {
        // SAFETY: in bounds; the copy tolerates overlap.
        unsafe { copy_maybe_overlapping(d, s, n * elem) };
    }
    elem
}

/// A local step that ends a fold whose result goes to peers' outputs too (`also`, each
/// where `dst`'s first element goes; single copy's write-back): `dst = a ⊕ b` as in
/// [`local_step`], with its post-operation, in pieces that stay in the cache until they
/// are stored at every destination. Returns its element size.
///
/// # Safety
/// Regions inside their buffers; each of `also` writable for the step's elements and
/// apart from `dst`, from the operands and from each other; at most
/// [`MAX_STREAMED`] − 1 of them.
unsafe fn local_fold_to_peers(ops: &[OpBuffers], step: &Step, also: &[*mut u8]) -> usize {
    let elem = ops[op_of(step)].kernel.dtype().size();
    let per_piece = (crate::transport::single_copy::STAGING_BYTES / elem).max(1);
    let mut done = 0;
    while done < step.len() {
        let n = per_piece.min(step.len() - done);
        // SAFETY: the pieces partition the step; forwarded.
        unsafe { reduce_piece(ops, step, also, done, n) };
        done += n;
    }
    elem
}

/// Elements `skip..skip + n` of a local fold step (`Reduce`): `dst = a ⊕ b` as in
/// [`local_step`], with its post-operation when final, stored at each of `also` (where
/// the step's first element goes) too.
///
/// # Safety
/// As [`local_fold_to_peers`]; `skip + n` within the step.
unsafe fn reduce_piece(ops: &[OpBuffers], step: &Step, also: &[*mut u8], skip: usize, n: usize) {
    let Step::Reduce { a, b, dst, post } = *step else {
        unreachable!("only a local fold reduces in pieces")
    };
    let op = &ops[dst.op];
    let elem = op.kernel.dtype().size();
    // SAFETY (block): inside the step's regions, in bounds by contract; `a` is only the
    // input when `b` is not, so writing `pre(a)` to `dst` first never overwrites `b` (as
    // in `local_step`).
    unsafe {
        let (pa, pb, d) = (
            addr(ops, &a, skip),
            addr(ops, &b, skip),
            addr(ops, &dst, skip),
        );
        let pa = if a.buf == Buf::Input && op.kernel.has_pre() {
            op.kernel.pre(d, pa, n);
            d
        } else {
            pa
        };
        let peers = shifted(also, skip * elem);
        let stream = op.streaming && dst.buf == Buf::Output;
        let kernel = operand_kernel(op, &b);
        store_result(op, kernel, stream, d, &peers[..also.len()], pa, pb, n, post);
    }
}

/// `also`'s destinations `bytes` further on (at most [`MAX_STREAMED`] − 1 of them).
fn shifted(also: &[*mut u8], bytes: usize) -> [*mut u8; MAX_STREAMED - 1] {
    let mut out = [std::ptr::null_mut(); MAX_STREAMED - 1];
    for (o, &p) in out.iter_mut().zip(also) {
        *o = p.wrapping_add(bytes);
    }
    out
}

/// `first ⊕ second` with `kernel`, then the op's post-operation when `post`, stored at
/// `d` and at each of `also` (peers' outputs): all streamed past the caches in one pass
/// when `stream`, else computed at `d` with plain stores and copied from there while it
/// is in the cache.
///
/// # Safety
/// As [`Kernel::reduce`] for `d` and each of `also` (each may equal an operand, not `d`
/// nor each other); at most [`MAX_STREAMED`] − 1 of `also`.
#[allow(clippy::too_many_arguments)]
unsafe fn store_result(
    op: &OpBuffers,
    kernel: &Kernel,
    stream: bool,
    d: *mut u8,
    also: &[*mut u8],
    first: *const u8,
    second: *const u8,
    n: usize,
    post: bool,
) {
    // SAFETY (block): the caller's contract.
    unsafe {
        if stream {
            let mut dsts = [std::ptr::null_mut(); MAX_STREAMED];
            dsts[0] = d;
            dsts[1..=also.len()].copy_from_slice(also);
            kernel.reduce_streaming(&dsts[..=also.len()], None, first, second, n, post);
            return;
        }
        kernel.reduce(d, first, second, n);
        if post {
            op.kernel.post(d, n);
        }
        for &peer in also {
            copy(peer, d, n * op.kernel.dtype().size());
        }
    }
}

/// The slots one slice moves through: the received one, the one to send, and whether
/// its slot goes past the caches ([`Connections::streams_slots_to`]).
#[derive(Clone, Copy)]
pub(crate) struct SliceSlots<'a> {
    pub(crate) inbound: Option<*const u8>,
    pub(crate) outbound: Option<*mut u8>,
    pub(crate) far: bool,
    /// Peers' outputs that a final fold's result goes to as well, each where the step's
    /// first element goes (single copy's write-back; empty otherwise).
    pub(crate) also: &'a [*mut u8],
}

/// Moves one slice of `n` elements starting `skip` elements into the step; towards a
/// far peer, a slice of [`FAR_SLOT_STREAMING_FROM`] bytes or more bound for the
/// outgoing slot goes there with non-temporal stores.
///
/// # Safety
/// `inbound` / `outbound` are slots of at least `n` elements owned by this side;
/// `inbound` is present exactly when the step receives, `outbound` when it sends (a
/// single-copy step that receives and then sends by reference passes none); regions
/// in bounds.
unsafe fn move_slice(
    step: &Step,
    ops: &[OpBuffers],
    op: &OpBuffers,
    skip: usize,
    n: usize,
    slots: SliceSlots,
) {
    let SliceSlots {
        inbound,
        outbound,
        far,
        also,
    } = slots;
    let elem = op.kernel.dtype().size();
    let bytes = n * elem;
    let stream_slot = far && bytes >= FAR_SLOT_STREAMING_FROM;
    let k = &op.kernel;
    // SAFETY (whole block): the caller guarantees the slots and regions; slots never
    // overlap user buffers, so non-overlapping copies between them are sound, and the
    // kernels allow their destination to equal an operand.
    unsafe {
        let x = inbound.unwrap_or(std::ptr::null());
        let o = outbound.unwrap_or(std::ptr::null_mut());
        // Results bound for a large output go past the caches.
        let stream = |r: &Region| op.streaming && r.buf == Buf::Output;
        let store = |d: *mut u8, s: *const u8, r: &Region| {
            if stream(r) {
                stream_copy(d, s, bytes);
            } else {
                copy(d, s, bytes);
            }
        };
        // Into the outgoing slot.
        let fill = |s: *const u8| {
            if stream_slot {
                stream_copy(o, s, bytes);
            } else {
                copy(o, s, bytes);
            }
        };
        match *step {
            Step::Send { src, .. } => {
                let s = addr(ops, &src, skip);
                if op.reducing && src.buf == Buf::Input && k.has_pre() {
                    k.pre(o, s, n);
                } else {
                    fill(s);
                }
            }
            Step::Recv { dst, .. } => store(addr(ops, &dst, skip), x, &dst),
            Step::CopySend { src, dst, .. } => {
                let (s, d) = (addr(ops, &src, skip), addr(ops, &dst, skip));
                let pre = op.reducing && src.buf == Buf::Input && k.has_pre();
                if pre {
                    k.pre(o, s, n);
                } else {
                    fill(s);
                }
                if s != d {
                    // Without a pre-operation the slot holds `s`'s bytes, and `s` is
                    // still cached where a slot written past the caches is not.
                    store(d, if pre || !stream_slot { o } else { s }, &dst);
                }
            }
            Step::RecvReduceSend { src, .. } => {
                let kernel = operand_kernel(op, &src);
                if stream_slot {
                    kernel.reduce_streaming(&[o], None, x, addr(ops, &src, skip), n, false);
                } else {
                    kernel.reduce(o, x, addr(ops, &src, skip), n);
                }
            }
            Step::RecvReduceCopy {
                src,
                dst,
                post,
                local_first,
                ..
            } => {
                let d = addr(ops, &dst, skip);
                let s = addr(ops, &src, skip);
                let (kernel, first, second) = if local_first {
                    // `s ⊕ x`: the received contribution is already pre-processed; a
                    // local contribution gets its pre-operation first (into `d`).
                    let s = if src.buf == Buf::Input && k.has_pre() {
                        k.pre(d, s, n);
                        d
                    } else {
                        s
                    };
                    (&op.plain, s as *const u8, x)
                } else {
                    (operand_kernel(op, &src), x, s as *const u8)
                };
                let peers = shifted(also, skip * elem);
                store_result(
                    op,
                    kernel,
                    stream(&dst),
                    d,
                    &peers[..also.len()],
                    first,
                    second,
                    n,
                    post,
                );
            }
            Step::RecvReduceCopySend { src, dst, .. } => {
                let d = addr(ops, &dst, skip);
                let kernel = operand_kernel(op, &src);
                if stream(&dst) {
                    // One reduction, streamed to the output; the outgoing slot (none
                    // under single copy) streamed too or written with plain stores.
                    let streamed = [d, o];
                    let (dsts, cached) = match (o.is_null(), stream_slot) {
                        (true, _) => (&streamed[..1], None),
                        (false, true) => (&streamed[..], None),
                        (false, false) => (&streamed[..1], Some(o)),
                    };
                    kernel.reduce_streaming(dsts, cached, x, addr(ops, &src, skip), n, true);
                } else {
                    kernel.reduce(d, x, addr(ops, &src, skip), n);
                    k.post(d, n);
                    // Single copy sends `dst` by reference afterwards: no slot.
                    if !o.is_null() {
                        fill(d);
                    }
                }
            }
            Step::RecvCopySend { dst, .. } => {
                let d = addr(ops, &dst, skip);
                if stream(&dst) && !o.is_null() && !stream_slot {
                    // One pass: streamed to the output, kept in the cache for the slot.
                    stream_copy_keeping(d, o, x, bytes);
                } else {
                    store(d, x, &dst);
                    if !o.is_null() {
                        fill(x);
                    }
                }
            }
            Step::Copy { .. } | Step::Reduce { .. } => unreachable!("local steps are not sliced"),
        }
    }
}
