//! A [`Plan`] laid out for the device executor (`kernels/executor.cu`).
//!
//! The executor reads flat arrays of `#[repr(C)]` structures, mirrored field for field in
//! `kernels/ferroccl.cuh` (the kernel tests check the sizes against the C++ compiler's):
//! one [`FcclLane`] per lane (one thread block each), its [`FcclStep`]s, one [`FcclFifo`]
//! per FIFO end the plan uses, and one [`FcclOp`] per operation. [`lay_out`] turns a plan
//! into the lanes and steps and lists the FIFO ends in the order the steps index them;
//! whoever runs the work (a GPU launch, or the host build of the kernels in the tests)
//! supplies the memory behind each FIFO end and each operation's buffers.

use std::collections::HashMap;
use std::ffi::c_void;

use crate::error::{Error, Result};
use crate::plan::Protocol;
use crate::plan::{Buf, Plan, Region, Step};
use crate::reduce::Kernel;

/// `FcclRegion`: elements `offset .. offset + len` of buffer `buf` of operation `op`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FcclRegion {
    /// First element.
    pub offset: u64,
    /// Number of elements.
    pub len: u64,
    /// The operation whose buffer it is.
    pub op: u32,
    /// `FCCL_BUF_INPUT` 0, `FCCL_BUF_OUTPUT` 1, `FCCL_BUF_SCRATCH` 2.
    pub buf: u32,
}

/// `FcclStep`: one step, with the FIFO ends it sends and receives on (-1: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FcclStep {
    /// `FCCL_SEND` 0 … `FCCL_COPY` 7, `FCCL_REDUCE` 8 in [`Step`]'s order, and
    /// `FCCL_RECV_REDUCE_COPY_LOCAL_FIRST` 9 (a `RecvReduceCopy` with `local_first`).
    pub kind: u32,
    /// 1 when a `RecvReduceCopy` or `Reduce` produces a final value (post-operation
    /// applies).
    pub post: u32,
    /// Index into the FIFO ends, or -1.
    pub send_fifo: i32,
    /// Index into the FIFO ends, or -1.
    pub recv_fifo: i32,
    /// Source region (unused by `Recv` and `RecvCopySend`); a `Reduce`'s first operand.
    pub src: FcclRegion,
    /// Destination region (unused by `Send` and `RecvReduceSend`).
    pub dst: FcclRegion,
    /// A `Reduce`'s second operand (unused by the other steps).
    pub b: FcclRegion,
}

/// `FcclLane`: steps `first .. first + count`, run by one thread block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FcclLane {
    /// First step.
    pub first: u32,
    /// Number of steps.
    pub count: u32,
}

/// `FcclFifo`: this rank's end of one FIFO, in memory the executor reaches (see
/// `kernels/ferroccl.cuh` for who writes what).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FcclFifo {
    /// Slots published (the sender writes it).
    pub head: *mut u64,
    /// Slots consumed (the receiver writes it).
    pub tail: *mut u64,
    /// Byte count of each slot (Simple).
    pub sizes: *mut u32,
    /// `slots × slot_bytes` bytes of slots, zeroed before first use.
    pub data: *mut u8,
    /// One slot's payload of private staging (LL), for this end only.
    pub stage: *mut u8,
    /// Number of slots, a power of two.
    pub slots: u32,
    /// Bytes per slot, a multiple of 64.
    pub slot_bytes: u32,
    /// `FCCL_SIMPLE` 0 or `FCCL_LL` 1.
    pub protocol: u32,
    /// Padding (0).
    pub pad: u32,
}

// SAFETY: the pointers are addresses where the executor runs (device memory for a GPU);
// the host never dereferences them through this value, so moving it between threads is
// moving numbers.
unsafe impl Send for FcclFifo {}

/// `FcclOp`: one operation's buffers and arithmetic.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FcclOp {
    /// Send buffer.
    pub input: *mut c_void,
    /// Receive buffer.
    pub output: *mut c_void,
    /// Scratch memory, [`Plan::scratch_elems`] elements (or null).
    pub scratch: *mut c_void,
    /// Pre-mul-sum's scalar as the element type's bits ([`Kernel::scalar_bits`]).
    pub scalar: u64,
    /// NCCL's data type number.
    pub dtype: u32,
    /// [`Kernel::device_op`].
    pub redop: u32,
    /// Number of ranks (avg's divisor).
    pub nranks: u32,
    /// 1 for a reducing collective (pre- and post-operations apply).
    pub reducing: u32,
}

impl FcclOp {
    /// The operation of `kernel` over the given buffers.
    pub fn new(
        kernel: &Kernel,
        reducing: bool,
        input: *const c_void,
        output: *mut c_void,
        scratch: *mut c_void,
    ) -> Self {
        FcclOp {
            input: input as *mut c_void,
            output,
            scratch,
            scalar: kernel.scalar_bits(),
            dtype: kernel.dtype() as u32,
            redop: kernel.device_op(),
            nranks: kernel.nranks() as u32,
            reducing: u32::from(reducing),
        }
    }
}

/// `FcclWork`: everything one rank's launch reads. Block `b` runs lane `b`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FcclWork {
    /// `nlanes` lanes.
    pub lanes: *const FcclLane,
    /// The steps the lanes index.
    pub steps: *const FcclStep,
    /// The FIFO ends the steps index.
    pub fifos: *const FcclFifo,
    /// The operations the regions index.
    pub ops: *const FcclOp,
    /// One status word per lane, written by the executor (`FCCL_STATUS_*`).
    pub status: *mut u32,
    /// Non-zero: the executor stops waiting and reports `FCCL_STATUS_ABORTED`.
    pub abort: *const u32,
    /// Number of lanes (thread blocks).
    pub nlanes: u32,
    /// Padding (0).
    pub pad: u32,
}

// SAFETY (all five): plain `#[repr(C)]` data whose pointers are device addresses (or
// null), copied to the device or passed as a kernel argument by value.
unsafe impl cudarc::driver::DeviceRepr for FcclLane {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for FcclStep {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for FcclFifo {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for FcclOp {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for FcclWork {}

/// A lane's outcome as the executor reports it.
pub fn status_name(status: u32) -> &'static str {
    match status {
        0 => "ok",
        1 => "aborted while waiting on a peer",
        2 => "a peer sent a slice of another size (ranks called different operations?)",
        3 => "the plan names an unknown data type or a FIFO too small for one element",
        _ => "unknown status",
    }
}

/// One FIFO end a plan uses: the channel, the peer, the direction, the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FifoEnd {
    /// The channel (see [`crate::plan::Lane::channel`]).
    pub channel: usize,
    /// The rank at the other end.
    pub peer: usize,
    /// Whether this rank sends on it.
    pub sends: bool,
    /// How its slots are published.
    pub protocol: Protocol,
}

/// A plan as the executor reads it, less the memory.
#[derive(Clone, Debug, Default)]
pub struct LaidOut {
    /// One per lane of the plan, in order.
    pub lanes: Vec<FcclLane>,
    /// The steps of all lanes.
    pub steps: Vec<FcclStep>,
    /// The FIFO ends, in the order `FcclStep::send_fifo` / `recv_fifo` index them.
    pub fifos: Vec<FifoEnd>,
}

/// Lays `plan` out for the executor; `protocols[op]` is how operation `op` moves its
/// slices (as the host engine's `OpBuffers::protocol`).
pub fn lay_out(plan: &Plan, protocols: &[Protocol]) -> Result<LaidOut> {
    if protocols.len() != plan.ops.len() {
        return Err(Error::invalid(format!(
            "device work: {} protocols for a plan of {} operations",
            protocols.len(),
            plan.ops.len()
        )));
    }
    let mut out = LaidOut::default();
    let mut index: HashMap<FifoEnd, i32> = HashMap::new();
    let mut end = |channel: usize, peer: Option<usize>, sends: bool, protocol: Protocol| {
        peer.map_or(-1, |peer| {
            let key = FifoEnd {
                channel,
                peer,
                sends,
                protocol,
            };
            *index.entry(key).or_insert_with(|| {
                out.fifos.push(key);
                out.fifos.len() as i32 - 1
            })
        })
    };
    for lane in &plan.lanes {
        out.lanes.push(FcclLane {
            first: out.steps.len() as u32,
            count: lane.steps.len() as u32,
        });
        for step in &lane.steps {
            let mut b = None;
            let (kind, src, dst, post) = match *step {
                Step::Send { src, .. } => (0, Some(src), None, false),
                Step::Recv { dst, .. } => (1, None, Some(dst), false),
                Step::CopySend { src, dst, .. } => (2, Some(src), Some(dst), false),
                Step::RecvReduceSend { src, .. } => (3, Some(src), None, false),
                Step::RecvReduceCopy {
                    src,
                    dst,
                    post,
                    local_first,
                    ..
                } => (if local_first { 9 } else { 4 }, Some(src), Some(dst), post),
                Step::RecvReduceCopySend { src, dst, .. } => (5, Some(src), Some(dst), false),
                Step::RecvCopySend { dst, .. } => (6, None, Some(dst), false),
                Step::Copy { src, dst } => (7, Some(src), Some(dst), false),
                Step::Reduce {
                    a,
                    b: second,
                    dst,
                    post,
                } => {
                    b = Some(second);
                    (8, Some(a), Some(dst), post)
                }
            };
            let op = src.or(dst).map_or(0, |r| r.op);
            let protocol = protocols[op];
            out.steps.push(FcclStep {
                kind,
                post: u32::from(post),
                send_fifo: end(lane.channel, step.send_to(), true, protocol),
                recv_fifo: end(lane.channel, step.recv_from(), false, protocol),
                src: src.map(region).unwrap_or_default(),
                dst: dst.map(region).unwrap_or_default(),
                b: b.map(region).unwrap_or_default(),
            });
        }
    }
    Ok(out)
}

fn region(r: Region) -> FcclRegion {
    FcclRegion {
        offset: r.offset as u64,
        len: r.len as u64,
        op: r.op as u32,
        buf: match r.buf {
            Buf::Input => 0,
            Buf::Output => 1,
            Buf::Scratch => 2,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Collective, PlanOptions, plan};

    #[test]
    fn every_fifo_end_is_listed_once_and_steps_keep_their_order() {
        let options = PlanOptions::with_channels(4, 2, 8);
        let p = plan(Collective::AllReduce, 100, 1, 4, &options).unwrap();
        let laid = lay_out(&p, &[Protocol::LL]).unwrap();
        assert_eq!(laid.lanes.len(), p.lanes.len());
        assert_eq!(laid.steps.len(), p.steps().count());
        // A ring rank talks to its two neighbours on each of two channels, both ways.
        assert_eq!(laid.fifos.len(), 4);
        for (step, dev) in p.steps().zip(&laid.steps) {
            assert_eq!(dev.send_fifo >= 0, step.send_to().is_some());
            assert_eq!(dev.recv_fifo >= 0, step.recv_from().is_some());
            if let Some(to) = step.send_to() {
                let e = laid.fifos[dev.send_fifo as usize];
                assert!(e.sends && e.peer == to && e.protocol == Protocol::LL);
            }
        }
        assert!(lay_out(&p, &[]).is_err());
    }
}
