//! Python buffers turned into ferroccl's raw calls, with every length, type, root and
//! peer checked before anything runs. One builder serves both the NCCL-shaped
//! `Communicator` and the torch backend's `ProcessGroup`.
//!
//! A [`Batch`] is what one Python call (or one coalescing window) issues: the raw calls
//! to run together, the Python objects whose memory they use, and the copies to make
//! before and after them when torch hands lists of tensors that are not one buffer
//! (an all-gather into a list, a scatter from one).

use ferroccl::comm::RawCall;
use ferroccl::plan::Collective;
use ferroccl::{DataType, ReduceOp, Scalar};
use pyo3::prelude::*;

use crate::buffers::{Elements, Lent};
use crate::errors::IntoPy;

/// A reduction as Python names it (`"sum"`, `"SUM"`, `"product"`, …), with the factor
/// of a pre-multiplied sum.
pub fn parse_op(name: &str, factor: Option<f64>) -> PyResult<ReduceOp> {
    let op = match name.to_ascii_lowercase().as_str() {
        "sum" => ReduceOp::Sum,
        "prod" | "product" => ReduceOp::Prod,
        "max" => ReduceOp::Max,
        "min" => ReduceOp::Min,
        "avg" | "mean" => ReduceOp::Avg,
        "premul_sum" | "mulsum" => {
            ReduceOp::PreMulSum(Scalar::Float(factor.ok_or_else(|| {
                crate::errors::value_error("PREMUL_SUM needs a factor".into())
            })?))
        }
        "band" | "bor" | "bxor" => {
            return Err(crate::errors::value_error(format!(
                "{} is not supported: NCCL, and so ferroccl, has no bitwise reductions \
                 (SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM are)",
                name.to_ascii_uppercase()
            )));
        }
        other => {
            return Err(crate::errors::value_error(format!(
                "unknown reduction {other:?} (expected sum, product, max, min, avg or \
                 premul_sum)"
            )));
        }
    };
    Ok(op)
}

/// A block copy made around a batch's calls (raw pointers into memory the batch keeps).
#[derive(Clone, Copy)]
struct Copy {
    from: *const u8,
    to: *mut u8,
    bytes: usize,
}

/// What one Python call issues; see the module documentation.
#[derive(Default)]
pub struct Batch {
    /// The raw calls, run together as one group.
    pub calls: Vec<RawCall>,
    /// The Python objects whose memory the calls and copies use.
    pub keep: Vec<Py<PyAny>>,
    /// Staging memory owned by the batch (8-byte aligned).
    scratch: Vec<Vec<u64>>,
    /// Copies into staging memory, made right before the calls.
    before: Vec<Copy>,
    /// Copies out of staging memory, made once the calls succeeded.
    after: Vec<Copy>,
    /// Where the memory of the calls is: `Some(None)` host memory, `Some(Some(d))` CUDA
    /// device `d` (`None`: no memory yet).
    place: Option<Option<usize>>,
    /// Set when the calls mix places (host and device, or two devices).
    mixed: bool,
    /// The stream `__cuda_array_interface__` memory names (the first one's), for
    /// memory that is not a torch tensor's.
    pub stream: Option<usize>,
}

// SAFETY: the raw pointers in a batch point into memory the batch itself keeps alive
// (`keep`, `scratch`); whoever runs it is the only user of that memory until it has run
// (the contract of `ProcessGroup::issue_raw`, which the binding's callers keep by
// handing over tensors for the duration of the call, as torch's backends require).
unsafe impl Send for Batch {}
// SAFETY: a shared batch is only read (its pointers, to make its copies); the memory
// behind them is used by the one thread that runs the batch.
unsafe impl Sync for Batch {}

impl Batch {
    /// Appends another batch (a coalescing window collects several).
    pub fn extend(&mut self, other: Batch) {
        if let Some(p) = other.place {
            self.note_place(p);
        }
        self.mixed |= other.mixed;
        self.stream = self.stream.or(other.stream);
        self.calls.extend(other.calls);
        self.keep.extend(other.keep);
        self.scratch.extend(other.scratch);
        self.before.extend(other.before);
        self.after.extend(other.after);
    }

    /// The raw calls (through `&self`, so a closure holding the batch by reference may
    /// cross threads: the batch is `Sync`).
    pub fn raw_calls(&self) -> &[RawCall] {
        &self.calls
    }

    /// Whether the batch has copies to make around its calls.
    pub fn has_copies(&self) -> bool {
        !self.before.is_empty() || !self.after.is_empty()
    }

    /// Makes the copies due before the calls.
    pub fn copy_before(&self) {
        run_copies(&self.before);
    }

    /// Makes the copies due after the calls.
    pub fn copy_after(&self) {
        run_copies(&self.after);
    }

    fn hold(&mut self, lent: &Lent) {
        self.note_place(lent.device);
        self.stream = self.stream.or(lent.stream);
        self.keep.push(lent.keep.clone().unbind());
    }

    fn note_place(&mut self, place: Option<usize>) {
        match self.place {
            None => self.place = Some(place),
            Some(p) if p != place => self.mixed = true,
            Some(_) => {}
        }
    }

    /// The CUDA device the calls' memory is on (`None`: host memory), or an error naming
    /// what cannot be: memory of several places in one call, or CUDA memory the batch
    /// would have to stage through host copies (lists of tensors that are not one
    /// buffer).
    pub fn device(&self, op: &str) -> PyResult<Option<usize>> {
        if self.mixed {
            return Err(crate::errors::value_error(format!(
                "{op}: tensors on different devices (or CPU and CUDA) in one call"
            )));
        }
        let device = self.place.flatten();
        if device.is_some() && self.has_copies() {
            return Err(crate::errors::value_error(format!(
                "{op}: on CUDA tensors ferroccl needs each side as one buffer (a list of \
                 separate tensors would be staged through host memory); use the \
                 *_into_tensor / *_tensor forms"
            )));
        }
        Ok(device)
    }

    /// Staging memory of `bytes`, owned by the batch.
    fn staging(&mut self, bytes: usize) -> *mut u8 {
        let mut v = vec![0u64; bytes.div_ceil(8)];
        let p = v.as_mut_ptr() as *mut u8;
        self.scratch.push(v);
        p
    }
}

fn run_copies(copies: &[Copy]) {
    for c in copies {
        if c.bytes > 0 {
            // SAFETY: both ends lie in memory the batch keeps alive, were sized for
            // `bytes` when the copy was planned, and are distinct allocations (staging
            // memory is never a user's buffer).
            unsafe { std::ptr::copy_nonoverlapping(c.from, c.to, c.bytes) };
        }
    }
}

/// The root's side of a gather or scatter.
pub enum AtRoot<'a, 'py> {
    /// One buffer of `nranks` blocks (`None` on ranks that pass none).
    Flat(Option<&'a Lent<'py>>),
    /// One tensor per rank, anywhere.
    PerRank(&'a [Lent<'py>]),
}

/// How the lengths of a call's input and output relate.
#[derive(Clone, Copy)]
enum Blocks {
    /// They are equal (all-reduce).
    Equal,
    /// The output is one block of the input's length per rank (all-gather).
    OfOutput,
    /// The input is one block of the output's length per rank (reduce-scatter).
    OfInput,
}

/// Builds batches for one communicator of `nranks` ranks, where this is `rank`.
pub struct Builder {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub nranks: usize,
}

impl Builder {
    fn check_rank(&self, call: &str, what: &str, r: i64) -> PyResult<usize> {
        usize::try_from(r)
            .ok()
            .filter(|&r| r < self.nranks)
            .ok_or_else(|| {
                crate::errors::value_error(format!(
                    "{call}: {what} {r} is not a rank of this group (0..{})",
                    self.nranks
                ))
            })
    }

    fn same_elements(call: &str, a: &Lent, b: &Lent) -> PyResult<()> {
        if a.elements != b.elements {
            return Err(crate::errors::value_error(format!(
                "{call}: input holds {} and output {}; they must be of one type",
                a.elements.name(),
                b.elements.name()
            )));
        }
        Ok(())
    }

    fn writable(call: &str, what: &str, l: &Lent) -> PyResult<()> {
        if !l.writable {
            return Err(crate::errors::value_error(format!(
                "{call}: {what} is read-only"
            )));
        }
        Ok(())
    }

    /// Appends a call of `collective` on `len` elements (as `call` names it) reading
    /// `input` and writing `output`.
    fn push(
        batch: &mut Batch,
        call: &str,
        collective: Collective,
        (elements, len): (Elements, usize),
        op: Option<ReduceOp>,
        (input, output): (*const u8, *mut u8),
    ) -> PyResult<()> {
        let (dtype, op, per) = elements.for_call(call, op).py_err()?;
        batch.calls.push(RawCall {
            collective,
            count: len * per,
            dtype,
            op,
            input,
            output,
        });
        Ok(())
    }

    /// All-reduce of `input` into `output` (the same object for in place).
    pub fn all_reduce(
        &self,
        batch: &mut Batch,
        input: &Lent,
        output: &Lent,
        op: ReduceOp,
    ) -> PyResult<()> {
        let call = ("all_reduce", Collective::AllReduce);
        self.pair(batch, call, (input, output), Some(op), Blocks::Equal)
    }

    /// A call of `collective` reading all of `input` and writing all of `output`, of
    /// one element type, their lengths related as `blocks` says.
    fn pair(
        &self,
        batch: &mut Batch,
        (call, collective): (&str, Collective),
        (input, output): (&Lent, &Lent),
        op: Option<ReduceOp>,
        blocks: Blocks,
    ) -> PyResult<()> {
        Self::same_elements(call, input, output)?;
        Self::writable(call, "output", output)?;
        let (i, o, n) = (input.len(), output.len(), self.nranks);
        let count = match blocks {
            Blocks::Equal => lengths(call, "input", i, "output", o, 1).map(|()| i),
            Blocks::OfOutput => lengths(call, "output", o, "input", i, n).map(|()| i),
            Blocks::OfInput => lengths(call, "input", i, "output", o, n).map(|()| o),
        }?;
        batch.hold(input);
        batch.hold(output);
        let what = (input.elements, count);
        Self::push(batch, call, collective, what, op, (input.ptr, output.ptr))
    }

    /// Broadcast of the root's `input` into every rank's `output`.
    pub fn broadcast(
        &self,
        batch: &mut Batch,
        input: &Lent,
        output: &Lent,
        root: i64,
    ) -> PyResult<()> {
        let call = "broadcast";
        let root = self.check_rank(call, "root", root)?;
        Self::same_elements(call, input, output)?;
        Self::writable(call, "output", output)?;
        if self.rank == root {
            lengths(call, "input", input.len(), "output", output.len(), 1)?;
        }
        batch.hold(input);
        batch.hold(output);
        let c = Collective::Broadcast { root };
        Self::push(
            batch,
            call,
            c,
            (output.elements, output.len()),
            None,
            (input.ptr, output.ptr),
        )
    }

    /// Reduction of every rank's `input` into the root's `output`.
    pub fn reduce(
        &self,
        batch: &mut Batch,
        input: &Lent,
        output: &Lent,
        root: i64,
        op: ReduceOp,
    ) -> PyResult<()> {
        let call = "reduce";
        let root = self.check_rank(call, "root", root)?;
        Self::same_elements(call, input, output)?;
        if self.rank == root {
            Self::writable(call, "output", output)?;
            lengths(call, "input", input.len(), "output", output.len(), 1)?;
        }
        batch.hold(input);
        batch.hold(output);
        let c = Collective::Reduce { root };
        let (e, n) = (input.elements, input.len());
        Self::push(batch, call, c, (e, n), Some(op), (input.ptr, output.ptr))
    }

    /// Every rank's `input`, concatenated by rank, into `output` (one buffer).
    pub fn all_gather(&self, batch: &mut Batch, input: &Lent, output: &Lent) -> PyResult<()> {
        let call = ("all_gather", Collective::AllGather);
        self.pair(batch, call, (input, output), None, Blocks::OfOutput)
    }

    /// Every rank's `input` into `outputs[r]` (one tensor per rank, anywhere): gathered
    /// into staging memory, then copied out.
    pub fn all_gather_list(
        &self,
        batch: &mut Batch,
        input: &Lent,
        outputs: &[Lent],
    ) -> PyResult<()> {
        let call = "all_gather";
        self.one_per_rank(call, "output", outputs.len())?;
        for o in outputs {
            Self::same_elements(call, input, o)?;
            Self::writable(call, "output", o)?;
            lengths(call, "each output", o.len(), "input", input.len(), 1)?;
            batch.hold(o);
        }
        batch.hold(input);
        let staged = batch.staging(input.bytes * self.nranks);
        for (r, o) in outputs.iter().enumerate() {
            batch.after.push(Copy {
                // SAFETY: block r of the staging memory of nranks × input.bytes.
                from: unsafe { staged.add(r * input.bytes) },
                to: o.ptr,
                bytes: input.bytes,
            });
        }
        let (e, n) = (input.elements, input.len());
        Self::push(
            batch,
            call,
            Collective::AllGather,
            (e, n),
            None,
            (input.ptr, staged),
        )
    }

    /// Block `rank` of the reduction of every rank's `input` (one buffer) into `output`.
    pub fn reduce_scatter(
        &self,
        batch: &mut Batch,
        input: &Lent,
        output: &Lent,
        op: ReduceOp,
    ) -> PyResult<()> {
        let call = ("reduce_scatter", Collective::ReduceScatter);
        self.pair(batch, call, (input, output), Some(op), Blocks::OfInput)
    }

    /// Reduce-scatter from one tensor per rank (anywhere): copied into staging memory
    /// first.
    pub fn reduce_scatter_list(
        &self,
        batch: &mut Batch,
        inputs: &[Lent],
        output: &Lent,
        op: ReduceOp,
    ) -> PyResult<()> {
        let call = "reduce_scatter";
        self.one_per_rank(call, "input", inputs.len())?;
        Self::writable(call, "output", output)?;
        for i in inputs {
            Self::same_elements(call, i, output)?;
            lengths(call, "each input", i.len(), "output", output.len(), 1)?;
            batch.hold(i);
        }
        batch.hold(output);
        let staged = batch.staging(output.bytes * self.nranks);
        for (r, i) in inputs.iter().enumerate() {
            batch.before.push(Copy {
                from: i.ptr,
                // SAFETY: block r of the staging memory of nranks × output.bytes.
                to: unsafe { staged.add(r * output.bytes) },
                bytes: output.bytes,
            });
        }
        let (e, n) = (output.elements, output.len());
        let c = Collective::ReduceScatter;
        Self::push(batch, call, c, (e, n), Some(op), (staged, output.ptr))
    }

    /// Block `j` of `input` to rank `j`, block `i` of `output` from rank `i`: equal
    /// blocks, or the given split sizes (elements per peer, as sends and receives).
    pub fn all_to_all(
        &self,
        batch: &mut Batch,
        input: &Lent,
        output: &Lent,
        input_splits: Option<&[usize]>,
        output_splits: Option<&[usize]>,
    ) -> PyResult<()> {
        let call = "all_to_all";
        Self::same_elements(call, input, output)?;
        Self::writable(call, "output", output)?;
        batch.hold(input);
        batch.hold(output);
        let e = input.elements;
        if input_splits.is_none() && output_splits.is_none() {
            lengths(call, "input", input.len(), "output", output.len(), 1)?;
            if !input.len().is_multiple_of(self.nranks) {
                return Err(crate::errors::value_error(format!(
                    "{call}: {} elements do not split into {} equal blocks",
                    input.len(),
                    self.nranks
                )));
            }
            let n = input.len() / self.nranks;
            let c = Collective::AllToAll;
            return Self::push(batch, call, c, (e, n), None, (input.ptr, output.ptr));
        }
        let even = |len: usize, what: &str| -> PyResult<Vec<usize>> {
            if !len.is_multiple_of(self.nranks) {
                return Err(crate::errors::value_error(format!(
                    "{call}: the {what} of {len} elements does not split into {} equal \
                     blocks (give its split sizes)",
                    self.nranks
                )));
            }
            Ok(vec![len / self.nranks; self.nranks])
        };
        let ins = match input_splits {
            Some(s) => s.to_vec(),
            None => even(input.len(), "input")?,
        };
        let outs = match output_splits {
            Some(s) => s.to_vec(),
            None => even(output.len(), "output")?,
        };
        self.one_per_rank(call, "input split size", ins.len())?;
        self.one_per_rank(call, "output split size", outs.len())?;
        for (what, splits, len) in [
            ("input", &ins, input.len()),
            ("output", &outs, output.len()),
        ] {
            let total: usize = splits.iter().sum();
            if total != len {
                return Err(crate::errors::value_error(format!(
                    "{call}: the {what} split sizes {splits:?} add up to {total} elements, \
                     but the {what} has {len}"
                )));
            }
        }
        let size = e.size();
        let (mut at_in, mut at_out) = (0usize, 0usize);
        for peer in 0..self.nranks {
            // SAFETY (both adds): offsets stay within the buffers, whose lengths the
            // split sizes were checked to add up to.
            let from = unsafe { input.ptr.add(at_in * size) };
            let to = unsafe { output.ptr.add(at_out * size) };
            if peer == self.rank {
                lengths(
                    call,
                    "the block this rank keeps",
                    outs[peer],
                    "the block it sends itself",
                    ins[peer],
                    1,
                )?;
                batch.after.push(Copy {
                    from,
                    to,
                    bytes: ins[peer] * size,
                });
            } else {
                let (send, recv) = (Collective::Send { peer }, Collective::Recv { peer });
                if ins[peer] > 0 {
                    Self::push(
                        batch,
                        call,
                        send,
                        (e, ins[peer]),
                        None,
                        (from, std::ptr::null_mut()),
                    )?;
                }
                if outs[peer] > 0 {
                    Self::push(
                        batch,
                        call,
                        recv,
                        (e, outs[peer]),
                        None,
                        (std::ptr::null(), to),
                    )?;
                }
            }
            at_in += ins[peer];
            at_out += outs[peer];
        }
        Ok(())
    }

    /// `inputs[j]` to rank `j`, `outputs[i]` from rank `i` (tensors anywhere).
    pub fn all_to_all_list(
        &self,
        batch: &mut Batch,
        inputs: &[Lent],
        outputs: &[Lent],
    ) -> PyResult<()> {
        let call = "all_to_all";
        self.one_per_rank(call, "input", inputs.len())?;
        self.one_per_rank(call, "output", outputs.len())?;
        for (peer, (i, o)) in inputs.iter().zip(outputs).enumerate() {
            Self::same_elements(call, i, o)?;
            Self::writable(call, "output", o)?;
            batch.hold(i);
            batch.hold(o);
            if peer == self.rank {
                lengths(
                    call,
                    "the output from itself",
                    o.len(),
                    "its input to itself",
                    i.len(),
                    1,
                )?;
                batch.after.push(Copy {
                    from: i.ptr,
                    to: o.ptr,
                    bytes: i.bytes,
                });
                continue;
            }
            let e = i.elements;
            if i.len() > 0 {
                let c = Collective::Send { peer };
                Self::push(
                    batch,
                    call,
                    c,
                    (e, i.len()),
                    None,
                    (i.ptr, std::ptr::null_mut()),
                )?;
            }
            if o.len() > 0 {
                let c = Collective::Recv { peer };
                Self::push(
                    batch,
                    call,
                    c,
                    (e, o.len()),
                    None,
                    (std::ptr::null(), o.ptr),
                )?;
            }
        }
        Ok(())
    }

    /// Every rank's `input` into the root's `outputs` (only the root passes them).
    pub fn gather(
        &self,
        batch: &mut Batch,
        input: &Lent,
        outputs: AtRoot,
        root: i64,
    ) -> PyResult<()> {
        let call = "gather";
        let root = self.check_rank(call, "root", root)?;
        batch.hold(input);
        let mut out = std::ptr::null_mut();
        if self.rank == root {
            out = self.root_buffer(batch, call, input, outputs, true)?;
        }
        let c = Collective::Gather { root };
        let (e, n) = (input.elements, input.len());
        Self::push(batch, call, c, (e, n), None, (input.ptr, out))
    }

    /// Block `r` of the root's `inputs` (only the root passes them) into rank `r`'s
    /// `output`.
    pub fn scatter(
        &self,
        batch: &mut Batch,
        inputs: AtRoot,
        output: &Lent,
        root: i64,
    ) -> PyResult<()> {
        let call = "scatter";
        let root = self.check_rank(call, "root", root)?;
        Self::writable(call, "output", output)?;
        batch.hold(output);
        let mut from = std::ptr::null();
        if self.rank == root {
            from = self.root_buffer(batch, call, output, inputs, false)?;
        }
        let c = Collective::Scatter { root };
        let (e, n) = (output.elements, output.len());
        Self::push(batch, call, c, (e, n), None, (from, output.ptr))
    }

    /// The root's buffer of `nranks` blocks like `block` for a gather (`gathering`: it
    /// is written) or a scatter (it is read): the one given, or staging memory copied
    /// out to (gather) or in from (scatter) one tensor per rank.
    fn root_buffer(
        &self,
        batch: &mut Batch,
        call: &str,
        block: &Lent,
        given: AtRoot,
        gathering: bool,
    ) -> PyResult<*mut u8> {
        let what = if gathering { "output" } else { "input" };
        let check = |l: &Lent, whose: &str, times: usize| -> PyResult<()> {
            if gathering {
                Self::same_elements(call, block, l)?;
                Self::writable(call, what, l)?;
            } else {
                Self::same_elements(call, l, block)?;
            }
            let other = if gathering { "input" } else { "output" };
            lengths(call, whose, l.len(), other, block.len(), times)
        };
        match given {
            AtRoot::Flat(None) => Err(crate::errors::value_error(format!(
                "{call}: the root needs an {what}"
            ))),
            AtRoot::Flat(Some(l)) => {
                check(l, what, self.nranks)?;
                batch.hold(l);
                Ok(l.ptr)
            }
            AtRoot::PerRank(list) => {
                self.one_per_rank(call, what, list.len())?;
                let staged = batch.staging(block.bytes * self.nranks);
                for (r, l) in list.iter().enumerate() {
                    check(l, &format!("each {what}"), 1)?;
                    batch.hold(l);
                    // SAFETY: block r of the staging memory of nranks × block.bytes.
                    let at = unsafe { staged.add(r * block.bytes) };
                    let (copies, from, to) = if gathering {
                        (&mut batch.after, at as *const u8, l.ptr)
                    } else {
                        (&mut batch.before, l.ptr as *const u8, at)
                    };
                    copies.push(Copy {
                        from,
                        to,
                        bytes: block.bytes,
                    });
                }
                Ok(staged)
            }
        }
    }

    /// A send of `buf` to `peer`.
    pub fn send(&self, batch: &mut Batch, buf: &Lent, peer: i64) -> PyResult<()> {
        let peer = self.check_rank("send", "peer", peer)?;
        if peer == self.rank {
            return Err(crate::errors::value_error(format!(
                "send: rank {peer} cannot send to itself"
            )));
        }
        batch.hold(buf);
        let c = Collective::Send { peer };
        let (e, n) = (buf.elements, buf.len());
        Self::push(
            batch,
            "send",
            c,
            (e, n),
            None,
            (buf.ptr, std::ptr::null_mut()),
        )
    }

    /// A receive into `buf` from `peer`.
    pub fn recv(&self, batch: &mut Batch, buf: &Lent, peer: i64) -> PyResult<()> {
        let peer = self.check_rank("recv", "peer", peer)?;
        if peer == self.rank {
            return Err(crate::errors::value_error(format!(
                "recv: rank {peer} cannot receive from itself"
            )));
        }
        Self::writable("recv", "buffer", buf)?;
        batch.hold(buf);
        let c = Collective::Recv { peer };
        let (e, n) = (buf.elements, buf.len());
        Self::push(batch, "recv", c, (e, n), None, (std::ptr::null(), buf.ptr))
    }

    /// A barrier: an all-reduce of one byte of staging memory.
    pub fn barrier(&self, batch: &mut Batch) -> PyResult<()> {
        let p = batch.staging(1);
        batch.calls.push(RawCall {
            collective: Collective::AllReduce,
            count: 1,
            dtype: DataType::Uint8,
            op: ReduceOp::Sum,
            input: p,
            output: p,
        });
        Ok(())
    }

    fn one_per_rank(&self, call: &str, what: &str, have: usize) -> PyResult<()> {
        if have != self.nranks {
            return Err(crate::errors::value_error(format!(
                "{call}: {have} {what}s given, one per rank ({}) needed",
                self.nranks
            )));
        }
        Ok(())
    }
}

/// Checks `big == small × times` (elements), naming both.
fn lengths(
    call: &str,
    big: &str,
    big_len: usize,
    small: &str,
    small_len: usize,
    times: usize,
) -> PyResult<()> {
    if big_len != small_len * times {
        let need = if times == 1 {
            format!("{small_len} ({small}'s)")
        } else {
            format!(
                "{} ({small}'s {small_len} x {times} ranks)",
                small_len * times
            )
        };
        return Err(crate::errors::value_error(format!(
            "{call}: {big} has {big_len} elements but must have {need}"
        )));
    }
    Ok(())
}

/// The name a batch of sends and receives (or a coalescing window) goes by in the
/// flight recorder and the desync check: `send`, `recv` or `send_recv` when it only
/// pairs ranks, else `single`.
pub fn batch_name(calls: &[RawCall], single: &'static str) -> &'static str {
    let p2p = |c: &RawCall| {
        matches!(
            c.collective,
            Collective::Send { .. } | Collective::Recv { .. }
        )
    };
    if !calls.is_empty() && calls.iter().all(p2p) {
        match (
            calls
                .iter()
                .all(|c| matches!(c.collective, Collective::Send { .. })),
            calls
                .iter()
                .all(|c| matches!(c.collective, Collective::Recv { .. })),
        ) {
            (true, _) => "send",
            (_, true) => "recv",
            _ => "send_recv",
        }
    } else {
        single
    }
}
