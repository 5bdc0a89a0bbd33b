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
//! that overlaps it, and the call does not return.

use super::{LaneState, OpBuffers, SliceSlots, addr, move_slice, no_connection, op_of};
use crate::error::{CallInfo, Error, Result};
use crate::plan::{Buf, Region, Step};
use crate::reduce::copy::copy_maybe_overlapping;
use crate::transport::single_copy::{DESCRIPTOR_BYTES, Descriptor, NEEDS_PRE};
use crate::transport::{Connections, PeerState};

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
}

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
                if !unsafe { receive(step, channel, from, ops, &op, conns, call)? } {
                    return Ok((false, false));
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
    let (region, flags) = published(step, &op);
    // SAFETY: in bounds by contract.
    let start = unsafe { addr(ops, &region, 0) } as usize;
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

/// The receiving part of a step: reads the region `from` published, whole; returns
/// `false` when its descriptor has not arrived.
///
/// # Safety
/// Regions in bounds.
unsafe fn receive(
    step: &Step,
    channel: usize,
    from: usize,
    ops: &[OpBuffers],
    op: &OpBuffers,
    conns: &mut Connections,
    call: &CallInfo,
) -> Result<bool> {
    let len = step.len();
    let elem = op.kernel.dtype().size();
    let bytes = len * elem;
    let descriptor = {
        let (_, recv) = conns.ends(channel, op.protocol, None, Some(from));
        let recv = recv.ok_or_else(|| no_connection(step, channel))?;
        let Some((slot, got)) = recv.try_peek() else {
            return Ok(false);
        };
        // SAFETY: the peeked slot holds `got` bytes.
        unsafe { Descriptor::read(slot, got) }
    };
    let Some(d) = descriptor.filter(|d| d.bytes == bytes as u64) else {
        return Err(Error::invalid(format!(
            "engine: single-copy step `{step}` expected a region of {bytes} bytes from rank \
             {from} but got {descriptor:?} (ranks called different operations or counts?)"
        )));
    };
    let Some((memory, stage, stage_bytes)) = conns.single_copy_parts() else {
        return Err(Error::invalid(
            "engine: a single-copy call on connections without single copy",
        ));
    };
    let pre = d.flags & NEEDS_PRE != 0;
    // From a thread of this process, or from a window this rank mapped, a contribution
    // that needs no pre-operation is worked on straight from its region, in pieces as
    // the slice code expects (a copy then streams into a large output as the FIFO path
    // does); otherwise a copy is read whole into its destination, and a reduction's
    // pieces are read into the staging buffer first (and pre-processed there).
    let direct = memory.direct(from, d.addr, bytes).filter(|_| !pre);
    let read = match *step {
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
    // A peer leaves a failed call only after closing its bell (`Communicator::fail_after`),
    // and only then may its owner free the region: if the bell is still open after the
    // read, what was read is what the peer published. If it is closed, or the read
    // failed, the call fails, naming whom the peer blames (or the peer).
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    let left = matches!(conns.peer_state(from, false), PeerState::Closed(_));
    if left || read.is_err() {
        let why = read.err().unwrap_or_else(|| {
            format!("rank {from} left the call while this rank read its buffer")
        });
        let failure = conns.peer_failure(&[from], true).unwrap_or((from, why));
        return Err(call.peer_failed(conns.rank(), failure));
    }
    let (_, recv) = conns.ends(channel, op.protocol, None, Some(from));
    recv.ok_or_else(|| no_connection(step, channel))?.release();
    conns.ring_recv(channel, from);
    Ok(true)
}
