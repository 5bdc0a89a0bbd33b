//! The steps of single-copy calls: messages by reference
//! ([`crate::transport::single_copy`]).
//!
//! A step that receives takes the peer's [`Descriptor`] from the Simple FIFO, reads the
//! region it names (straight into the destination for a copy, in cache-sized pieces
//! through the staging buffer for a reduction, which then runs the same slice code as
//! the FIFO path), and releases the slot: that release is the peer's signal that it
//! may write the region again. A step that sends publishes a descriptor of the region
//! it sends (its source, or the destination it has just written) and records it in
//! [`PostedRegions`]: until the peer releases it, no step of this rank writes memory
//! that overlaps it, and the call does not return. A call that fails returns once no
//! thread of this process may still read what it published
//! ([`PostedRegions::wait_out_readers`]).
//!
//! In a two-shot all-reduce ([`OpBuffers::write_back`]) the descriptor of an input's
//! piece also names where the sender's result for it goes; the piece's owner, when it
//! can write there, notes it in the lane's [`WriteBack`], stores its fold's result
//! there too, and then publishes its result to that peer flagged [`WRITTEN`]: the
//! peer's receive reads nothing and releases the slot. The peer cannot leave the call
//! before that receive, so the owner's writes into its output end inside the call; a
//! failed owner leaves the receive waiting until the failure is named, as any
//! receive's.

use std::time::{Duration, Instant};

use super::{
    LaneState, OpBuffers, SliceSlots, addr, move_slice, no_connection, op_of, reduce_piece, shifted,
};
use crate::error::{CallInfo, Error, Result};
use crate::plan::{Buf, Region, Step};
use crate::reduce::copy::copy_maybe_overlapping;
use crate::reduce::stream::MAX_STREAMED;
use crate::transport::bell::Closed;
use crate::transport::single_copy::{DESCRIPTOR_BYTES, Descriptor, NEEDS_PRE, PeerMemory, WRITTEN};
use crate::transport::{Connections, PeerState};

/// Most peers' outputs one fold writes besides its own (the reduction streams to at
/// most [`MAX_STREAMED`] destinations); a peer beyond them reads its piece itself.
const MAX_WRITE_BACK: usize = MAX_STREAMED - 1;

/// What a lane's write-back holds: the peers' outputs the fold in progress stores its
/// result in too, and the peers whose outputs hold the last folded piece until its
/// descriptor tells them so.
#[derive(Clone, Copy)]
pub(super) struct WriteBack {
    /// Where each target peer's output for the piece begins, and the peer.
    outputs: [*mut u8; MAX_WRITE_BACK],
    peers: [usize; MAX_WRITE_BACK],
    len: usize,
    /// The peers written (bit `r` for rank `r`), not yet told.
    written: u128,
}

impl Default for WriteBack {
    fn default() -> Self {
        WriteBack {
            outputs: [std::ptr::null_mut(); MAX_WRITE_BACK],
            peers: [0; MAX_WRITE_BACK],
            len: 0,
            written: 0,
        }
    }
}

impl WriteBack {
    /// Adds `peer`'s output for the piece (`back`, `bytes` long, from its descriptor)
    /// to the fold in progress when this rank can write there; a peer it cannot reach,
    /// or past the capacity, reads its piece itself.
    fn target(&mut self, memory: &PeerMemory, peer: usize, back: u64, bytes: usize) {
        if back == 0 || self.len == MAX_WRITE_BACK || peer >= u128::BITS as usize {
            return;
        }
        if let Some(output) = memory.writable(peer, back, bytes) {
            self.outputs[self.len] = output;
            self.peers[self.len] = peer;
            self.len += 1;
        }
    }

    /// The outputs the fold in progress writes besides its own.
    pub(super) fn outputs(&self) -> &[*mut u8] {
        &self.outputs[..self.len]
    }

    /// The fold's last step is done: its targets hold the piece.
    pub(super) fn fold_done(&mut self) {
        for &peer in &self.peers[..self.len] {
            self.written |= 1 << peer;
        }
        self.len = 0;
    }

    /// Whether `peer`'s output holds the piece this rank is about to publish to it
    /// (forgotten once asked).
    fn take_written(&mut self, peer: usize) -> bool {
        let bit = 1u128.checked_shl(peer as u32).unwrap_or(0);
        let was = self.written & bit != 0;
        self.written &= !bit;
        was
    }
}

/// A region this rank published to a peer, which the peer may still be reading.
#[derive(Clone, Copy, Debug)]
struct Posted {
    channel: usize,
    peer: usize,
    /// The FIFO's `head` just after the descriptor: the peer is done once its `tail`
    /// reaches it.
    position: u32,
    /// The region's addresses, `start..end`.
    start: usize,
    end: usize,
}

/// The regions a call published that peers have not released yet (and the call, which
/// errors name).
#[derive(Debug)]
pub(super) struct PostedRegions<'a> {
    list: Vec<Posted>,
    call: &'a CallInfo,
}

impl<'a> PostedRegions<'a> {
    /// None yet, for `call`.
    pub(super) fn new(call: &'a CallInfo) -> Self {
        PostedRegions {
            list: Vec::new(),
            call,
        }
    }

    /// Forgets the regions their readers have released; returns whether none is left.
    pub(super) fn prune(&mut self, conns: &mut Connections) -> bool {
        if !self.list.is_empty() {
            self.list.retain(|p| {
                let (send, _) =
                    conns.ends(p.channel, crate::plan::Protocol::Simple, Some(p.peer), None);
                // Wrapping distance: still ahead of the reader's tail.
                send.is_some_and(|s| (s.consumed().wrapping_sub(p.position) as i32) < 0)
            });
        }
        self.list.is_empty()
    }

    /// Whether writing `region` would touch memory a peer may still be reading.
    ///
    /// # Safety
    /// `region` must lie inside its buffer in `ops`.
    pub(super) unsafe fn blocks(
        &mut self,
        conns: &mut Connections,
        ops: &[OpBuffers],
        region: &Region,
    ) -> bool {
        if self.list.is_empty() || region.len == 0 {
            return false;
        }
        // SAFETY: forwarded from this function's contract.
        let start = unsafe { addr(ops, region, 0) } as usize;
        let end = start + region.len * ops[region.op].kernel.dtype().size();
        let overlaps = |l: &[Posted]| l.iter().any(|p| p.start < end && start < p.end);
        overlaps(&self.list) && {
            self.prune(conns);
            overlaps(&self.list)
        }
    }

    /// Whether no published region is outstanding (as last pruned).
    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The peers still reading this rank's regions.
    pub(super) fn readers(&self) -> impl Iterator<Item = usize> + '_ {
        self.list.iter().map(|p| p.peer)
    }

    /// After the call failed (and this rank stopped reading its peers' regions): when a
    /// thread of this process may still read a region the call published, tells the
    /// peers this rank left (closes its bell with `why`), then waits until every such
    /// region is released or its reader stopped reading (`Bell::reading`: its own call
    /// ended, or failed), at most the call's timeout, so that the caller may free its
    /// buffers once the call returns. A reader that had not begun sees the closed bell
    /// before it reads (`peer_still_in_call`). Readers in other processes read through
    /// their own mappings of windows, or through the kernel, which refuses unmapped
    /// memory; what they read after the close they discard.
    pub(super) fn wait_out_readers(&mut self, conns: &mut Connections, why: Closed) {
        let seq = self.call.seq;
        self.prune(conns);
        let Some((memory, _, _)) = conns.single_copy_parts() else {
            return;
        };
        self.list.retain(|p| !memory.in_other_process(p.peer));
        if self.list.is_empty() {
            return;
        }
        conns.close(why);
        let deadline = Instant::now() + self.call.timeout;
        loop {
            self.prune(conns);
            self.list.retain(|p| conns.peer_reading(p.peer, seq));
            if self.list.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    "rank {}: {} #{seq} failed; ranks {:?} of this process still read \
                     its buffers at the deadline",
                    conns.rank(),
                    self.call.op,
                    self.readers().collect::<Vec<_>>()
                );
                return;
            }
            std::thread::sleep(READER_POLL);
        }
    }
}

/// How often a rank that failed a call looks whether its readers are done
/// ([`PostedRegions::wait_out_readers`]).
const READER_POLL: Duration = Duration::from_micros(50);

/// The region a step writes (its destination), if any: a copy onto itself (in place)
/// writes nothing, unless it applies a reducing op's pre-operation.
///
/// # Safety
/// Regions in bounds.
pub(super) unsafe fn written(step: &Step, ops: &[OpBuffers]) -> Option<Region> {
    match *step {
        Step::CopySend { src, dst, .. } | Step::Copy { src, dst } => {
            let op = &ops[dst.op];
            // SAFETY: in bounds by contract.
            let same = unsafe { std::ptr::eq(addr(ops, &src, 0), addr(ops, &dst, 0)) };
            (!same || (op.reducing && src.buf == Buf::Input && op.kernel.has_pre())).then_some(dst)
        }
        Step::Recv { dst, .. }
        | Step::RecvCopySend { dst, .. }
        | Step::RecvReduceCopy { dst, .. }
        | Step::RecvReduceCopySend { dst, .. }
        | Step::Reduce { dst, .. } => Some(dst),
        Step::Send { .. } | Step::RecvReduceSend { .. } => None,
    }
}

/// Advances a non-local step of a single-copy operation: its receiving or local part,
/// then its sending part. Returns whether it moved, and whether it is finished.
///
/// # Safety
/// As [`super::execute`].
pub(super) unsafe fn advance_step(
    step: &Step,
    channel: usize,
    st: &mut LaneState,
    ops: &[OpBuffers],
    conns: &mut Connections,
    posted: &mut PostedRegions,
) -> Result<(bool, bool)> {
    let op = ops[op_of(step)];
    let call = posted.call;
    let mut moved = false;
    if st.done == 0 {
        // SAFETY: regions in bounds by contract.
        if let Some(w) = unsafe { written(step, ops) }
            && unsafe { posted.blocks(conns, ops, &w) }
        {
            return Ok((false, false));
        }
        match step.recv_from() {
            // SAFETY: forwarded.
            Some(from) => {
                let wb = &mut st.write_back;
                match unsafe { receive(step, channel, from, ops, &op, conns, call, wb)? } {
                    Received::NotYet => return Ok((false, false)),
                    Received::Read => {}
                    Received::Written => st.by_sender = true,
                }
                if matches!(step, Step::RecvReduceCopy { post: true, .. }) {
                    wb.fold_done();
                }
            }
            // SAFETY: forwarded.
            None => unsafe { local_part(step, ops, &op) },
        }
        st.done = 1;
        moved = true;
    }
    let Some(to) = step.send_to() else {
        return Ok((moved, true));
    };
    let (region, mut flags) = published(step, &op);
    // SAFETY: in bounds by contract.
    let start = unsafe { addr(ops, &region, 0) } as usize;
    // A piece of the input goes to its owner with where its result goes here; the
    // owner's result comes back flagged when the owner wrote it here itself.
    let back = match (op.write_back, region.buf) {
        // SAFETY: an all-reduce's output has the input's layout, in bounds by contract.
        (true, Buf::Input) => unsafe {
            addr(
                ops,
                &Region {
                    buf: Buf::Output,
                    ..region
                },
                0,
            )
        },
        (true, Buf::Output) if st.write_back.take_written(to) => {
            flags |= WRITTEN;
            std::ptr::null_mut()
        }
        _ => std::ptr::null_mut(),
    };
    let bytes = region.len * op.kernel.dtype().size();
    let (send, _) = conns.ends(channel, op.protocol, Some(to), None);
    let send = send.ok_or_else(|| no_connection(step, channel))?;
    let Some(slot) = send.try_reserve(DESCRIPTOR_BYTES) else {
        return Ok((moved, false));
    };
    let descriptor = Descriptor {
        addr: start as u64,
        bytes: bytes as u64,
        flags,
        back: back as u64,
    };
    // SAFETY: a reserved Simple slot holds far more than DESCRIPTOR_BYTES.
    unsafe { descriptor.write(slot) };
    send.commit(DESCRIPTOR_BYTES);
    let position = send.published();
    conns.ring_send(channel, to);
    posted.list.push(Posted {
        channel,
        peer: to,
        position,
        start,
        end: start + bytes,
    });
    Ok((true, true))
}

/// What a step publishes, and whether its reader must apply the op's pre-operation: a
/// sent input is published as it is (the reader pre-processes it, as the FIFO path's
/// sender would), and so is a copy-send's source unless the copy pre-processed it;
/// everything else is a destination this rank has just written.
fn published(step: &Step, op: &OpBuffers) -> (Region, u64) {
    match *step {
        Step::Send { src, .. } => {
            let pre = op.reducing && src.buf == Buf::Input && op.kernel.has_pre();
            (src, if pre { NEEDS_PRE } else { 0 })
        }
        Step::CopySend { src, .. } if !(op.reducing && src.buf == Buf::Input) => (src, 0),
        Step::CopySend { dst, .. }
        | Step::RecvReduceCopySend { dst, .. }
        | Step::RecvCopySend { dst, .. } => (dst, 0),
        _ => unreachable!("only steps that send publish"),
    }
}

/// The local part of a step that sends without receiving: a copy-send's copy (with the
/// pre-operation of a reducing op's input, which it then publishes processed).
///
/// # Safety
/// Regions in bounds.
unsafe fn local_part(step: &Step, ops: &[OpBuffers], op: &OpBuffers) {
    if let Step::CopySend { src, dst, .. } = *step {
        // SAFETY: in bounds by contract; `pre` and `copy` allow the same memory.
        unsafe {
            let (s, d) = (addr(ops, &src, 0) as *const u8, addr(ops, &dst, 0));
            if op.reducing && src.buf == Buf::Input {
                op.kernel.pre(d, s, src.len);
            } else if !std::ptr::eq(s, d) {
                copy_maybe_overlapping(d, s, src.len * op.kernel.dtype().size());
            }
        }
    }
}

/// What the receiving part of a step found.
enum Received {
    /// The descriptor has not arrived.
    NotYet,
    /// The region it names, read.
    Read,
    /// The sender's word that it wrote the destination itself ([`WRITTEN`]).
    Written,
}

/// The receiving part of a step: reads the region `from` published, whole (or nothing,
/// when `from` has written it here already: [`WRITTEN`]). A descriptor that names where
/// `from`'s result goes adds that output to `write_back` when this rank can write there.
///
/// # Safety
/// Regions in bounds.
#[allow(clippy::too_many_arguments)]
unsafe fn receive(
    step: &Step,
    channel: usize,
    from: usize,
    ops: &[OpBuffers],
    op: &OpBuffers,
    conns: &mut Connections,
    call: &CallInfo,
    write_back: &mut WriteBack,
) -> Result<Received> {
    let len = step.len();
    let elem = op.kernel.dtype().size();
    let bytes = len * elem;
    let Some(d) = peek_descriptor(step, channel, from, op, conns)? else {
        return Ok(Received::NotYet);
    };
    peer_still_in_call(from, conns, call)?;
    let (memory, stage, stage_bytes) = single_copy_parts(conns)?;
    let pre = d.flags & NEEDS_PRE != 0;
    let written = d.flags & WRITTEN != 0;
    if written && !(op.write_back && matches!(step, Step::Recv { .. })) {
        return Err(Error::invalid(format!(
            "engine: single-copy step `{step}` got a result rank {from} wrote into this \
             rank's output, which this call does not expect (ranks chose different \
             algorithms?)"
        )));
    }
    if op.write_back {
        write_back.target(memory, from, d.back, bytes);
    }
    // The fold's last step stores its result in the peers' outputs too.
    let also = match step {
        Step::RecvReduceCopy { post: true, .. } => write_back.outputs(),
        _ => &[],
    };
    // From a thread of this process, or from a window this rank mapped, a contribution
    // that needs no pre-operation is worked on straight from its region, in pieces as
    // the slice code expects (a copy then streams into a large output as the FIFO path
    // does); otherwise a copy is read whole into its destination, and a reduction's
    // pieces are read into the staging buffer first (and pre-processed there).
    let direct = memory.direct(from, d.addr, bytes).filter(|_| !pre);
    let read = match *step {
        _ if written => Ok(()),
        Step::Recv { dst, .. } | Step::RecvCopySend { dst, .. } if direct.is_none() => {
            // SAFETY (block): `dst` is `bytes` writable bytes by contract; the peer keeps
            // its region until this rank releases the descriptor (or fails: below).
            unsafe {
                let out = addr(ops, &dst, 0);
                memory.read(from, d.addr, out, bytes).inspect(|()| {
                    if pre {
                        op.kernel.pre(out, out, len);
                    }
                })
            }
        }
        Step::Recv { .. }
        | Step::RecvCopySend { .. }
        | Step::RecvReduceCopy { .. }
        | Step::RecvReduceCopySend { .. } => {
            let per_piece = (stage_bytes / elem).max(1);
            let mut done = 0;
            let mut read = Ok(());
            while done < len && read.is_ok() {
                let n = per_piece.min(len - done);
                let at = d.addr + (done * elem) as u64;
                let inbound = match direct {
                    // SAFETY: inside the peer's region of `bytes` bytes, which it keeps
                    // unwritten until this rank releases the descriptor.
                    Some(region) => Ok(unsafe { region.add(done * elem) }),
                    // SAFETY: the staging buffer holds `stage_bytes` ≥ n·elem bytes and
                    // overlaps no user buffer.
                    None => unsafe { memory.read(from, at, stage, n * elem) }.map(|()| {
                        if pre {
                            // SAFETY: the n elements just read; `pre` works in place.
                            unsafe { op.kernel.pre(stage, stage, n) };
                        }
                        stage as *const u8
                    }),
                };
                read = inbound.map(|inbound| {
                    // SAFETY: `inbound` holds the piece's n elements; regions in bounds
                    // by contract.
                    unsafe {
                        move_slice(
                            step,
                            ops,
                            op,
                            done,
                            n,
                            SliceSlots {
                                inbound: Some(inbound),
                                outbound: None,
                                far: false,
                                also,
                            },
                        )
                    }
                });
                done += n;
            }
            read
        }
        _ => {
            return Err(Error::invalid(format!(
                "engine: single copy cannot carry step `{step}` (it sends what it never \
                 stores); the cost model should not have chosen it"
            )));
        }
    };
    settle(step, channel, from, op, conns, call, read)?;
    Ok(if written {
        Received::Written
    } else {
        Received::Read
    })
}

/// The descriptor `step` expects from `from`, if it has arrived (left in its slot).
fn peek_descriptor(
    step: &Step,
    channel: usize,
    from: usize,
    op: &OpBuffers,
    conns: &mut Connections,
) -> Result<Option<Descriptor>> {
    let bytes = step.len() * op.kernel.dtype().size();
    let (_, recv) = conns.ends(channel, op.protocol, None, Some(from));
    let recv = recv.ok_or_else(|| no_connection(step, channel))?;
    let Some((slot, got)) = recv.try_peek() else {
        return Ok(None);
    };
    // SAFETY: the peeked slot holds `got` bytes.
    let descriptor = unsafe { Descriptor::read(slot, got) };
    match descriptor.filter(|d| d.bytes == bytes as u64) {
        Some(d) => Ok(Some(d)),
        None => Err(Error::invalid(format!(
            "engine: single-copy step `{step}` expected a region of {bytes} bytes from rank \
             {from} but got {descriptor:?} (ranks called different operations or counts?)"
        ))),
    }
}

/// How this rank reaches its peers' memory, and its staging buffer and its length.
fn single_copy_parts(conns: &mut Connections) -> Result<(&PeerMemory, *mut u8, usize)> {
    conns.single_copy_parts().ok_or_else(|| {
        Error::invalid("engine: a single-copy call on connections without single copy")
    })
}

/// Ends the receiving part of `step` from `from` after reading what its descriptor
/// names (`read`): the call fails if the read did or the peer left meanwhile, else the
/// descriptor's slot is released (the peer's "done").
fn settle(
    step: &Step,
    channel: usize,
    from: usize,
    op: &OpBuffers,
    conns: &mut Connections,
    call: &CallInfo,
    read: std::result::Result<(), String>,
) -> Result<()> {
    // A peer leaves a failed call only after closing its bell, and only then may its
    // owner free the region: if the bell is still open after the read, what was read is
    // what the peer published.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    peer_stayed(from, conns, call, read)?;
    let (_, recv) = conns.ends(channel, op.protocol, None, Some(from));
    recv.ok_or_else(|| no_connection(step, channel))?.release();
    conns.ring_recv(channel, from);
    Ok(())
}

/// Fails the call, naming whom `from` blames (or `from`), when `from` has closed its
/// bell (it left the call: a failure) or `read`, a read of its memory, failed.
fn peer_stayed(
    from: usize,
    conns: &Connections,
    call: &CallInfo,
    read: std::result::Result<(), String>,
) -> Result<()> {
    let left = matches!(conns.peer_state(from, false), PeerState::Closed(_));
    if left || read.is_err() {
        let why = read.err().unwrap_or_else(|| {
            format!("rank {from} left the call while this rank read its buffer")
        });
        let failure = conns.peer_failure(&[from], true).unwrap_or((from, why));
        return Err(call.peer_failed(conns.rank(), failure));
    }
    Ok(())
}

/// Before reading a region `from` published: when `from` is a thread of this process,
/// fails the call if it has left it. A thread that fails a call returns, and its caller
/// may free the region, only after closing its bell and waiting out the peers that said
/// they read ([`PostedRegions::wait_out_readers`]); this rank said so when its call began
/// (`Bell::start_reading`), so an open bell now keeps the region alive until this rank
/// releases it. Another process's region needs no look: a window stays mapped here, and
/// the kernel refuses `process_vm_readv` of unmapped memory.
fn peer_still_in_call(from: usize, conns: &mut Connections, call: &CallInfo) -> Result<()> {
    let (memory, _, _) = single_copy_parts(conns)?;
    match memory.in_other_process(from) {
        true => Ok(()),
        false => peer_stayed(from, conns, call, Ok(())),
    }
}

/// Bytes of the slices a whole fold runs in ([`advance_fold`]): the partial result of a
/// slice stays in the L1 cache from one contribution to the next.
const FOLD_SLICE_BYTES: usize = 32 * 1024;

/// The fold that starts at `steps[at]`, if one does: the index of its last step. A fold
/// (the two-shot's, [`crate::plan`]'s `Builder::fold`) is a receive into scratch or a
/// first reduction, then reductions of one length, the last one final (`post`).
pub(super) fn fold_run(steps: &[Step], at: usize) -> Option<usize> {
    let len = steps.get(at)?.len();
    for (k, step) in steps[at..].iter().enumerate() {
        let post = match *step {
            Step::Recv { dst, .. } if k == 0 && dst.buf == Buf::Scratch => false,
            Step::RecvReduceCopy { post, .. } | Step::Reduce { post, .. } => post,
            _ => return None,
        };
        if step.len() != len || k >= MAX_STREAMED {
            return None;
        }
        if post {
            return (k > 0).then_some(at + k);
        }
    }
    None
}

/// Runs a whole fold of a two-shot all-reduce (`run`: its steps, from [`fold_run`]) at
/// once, slice by slice through all its steps, when every contribution can be read in
/// place (a thread of this process or a window): each slice's partial result stays in
/// the cache from one contribution to the next, and the final one goes to this rank's
/// output and to the peers' outputs it can write. Step by step, each step would pass
/// over the whole piece and its partial result once more. The steps' results are the
/// same: each reads and writes the same elements of its regions as the step before.
///
/// Returns `None` when some contribution must be read another way (the steps then run
/// one by one), `Some(false)` while a contribution has not been published, and
/// `Some(true)` when the fold is done.
///
/// # Safety
/// As [`super::execute`].
pub(super) unsafe fn advance_fold(
    run: &[Step],
    channel: usize,
    st: &mut LaneState,
    ops: &[OpBuffers],
    conns: &mut Connections,
    posted: &mut PostedRegions,
) -> Result<Option<bool>> {
    let op = ops[op_of(&run[0])];
    let elem = op.kernel.dtype().size();
    let len = run[0].len();
    // Each step's contribution, read in place, and where its sender's result goes.
    let mut inbound = [std::ptr::null::<u8>(); MAX_STREAMED];
    let mut back = [0u64; MAX_STREAMED];
    for (k, step) in run.iter().enumerate() {
        // SAFETY: regions in bounds by contract.
        if let Some(w) = unsafe { written(step, ops) }
            && unsafe { posted.blocks(conns, ops, &w) }
        {
            return Ok(Some(false));
        }
        let Some(from) = step.recv_from() else {
            continue;
        };
        let Some(d) = peek_descriptor(step, channel, from, &op, conns)? else {
            return Ok(Some(false));
        };
        let (memory, _, _) = single_copy_parts(conns)?;
        match memory.direct(from, d.addr, len * elem) {
            Some(region) if d.flags == 0 => (inbound[k], back[k]) = (region, d.back),
            _ => return Ok(None),
        }
    }
    for from in run.iter().filter_map(Step::recv_from) {
        peer_still_in_call(from, conns, posted.call)?;
    }
    let (memory, _, _) = single_copy_parts(conns)?;
    for (k, step) in run.iter().enumerate() {
        if let Some(from) = step.recv_from() {
            st.write_back.target(memory, from, back[k], len * elem);
        }
    }
    // The partial results of a slice live in a tile of their own, the start of the
    // staging buffer, which contributions read in place never use (the steps' scratch
    // region, as long as the piece, would be walked through and written back). A fold's
    // first step writes each slice of it before a later step reads it.
    let (_, tile, tile_bytes) = single_copy_parts(conns)?;
    let mut local = ops.to_vec();
    local[op_of(&run[0])].scratch = tile;
    let per_slice = (FOLD_SLICE_BYTES.min(tile_bytes) / elem).max(1);
    let last = run.len() - 1;
    let mut done = 0;
    while done < len {
        let n = per_slice.min(len - done);
        for (k, step) in run.iter().enumerate() {
            // The step on this slice: its scratch in the tile, the rest where it is.
            let slice = step.map_regions(|r| match r.buf {
                Buf::Scratch => Region {
                    offset: 0,
                    len: n,
                    ..r
                },
                _ => Region {
                    offset: r.offset + done,
                    len: n,
                    ..r
                },
            });
            // The last step stores the result in the peers' outputs too.
            let targets = if k == last {
                st.write_back.outputs()
            } else {
                &[]
            };
            let also = &shifted(targets, done * elem)[..targets.len()];
            // SAFETY (block): the slice lies inside every step's regions (one length),
            // its scratch in the tile (`per_slice` elements, which overlaps no user
            // buffer); `inbound[k]` is the peer's
            // region of `len` elements, which it keeps until this rank releases its
            // descriptor; `also` are peers' outputs for the slice.
            unsafe {
                match step.is_local() {
                    true => reduce_piece(&local, &slice, also, 0, n),
                    false => {
                        let slots = SliceSlots {
                            inbound: Some(inbound[k].add(done * elem)),
                            outbound: None,
                            far: false,
                            also,
                        };
                        move_slice(&slice, &local, &local[op_of(step)], 0, n, slots);
                    }
                }
            }
        }
        done += n;
    }
    for step in run {
        if let Some(from) = step.recv_from() {
            settle(step, channel, from, &op, conns, posted.call, Ok(()))?;
        }
    }
    st.write_back.fold_done();
    Ok(Some(true))
}
