//! The typed API: collectives over slices of [`Element`] types, point-to-point calls,
//! groups and asynchronous calls.

use super::*;

impl Communicator {
    /// `recv = op(send of every rank)` (`ncclAllReduce`).
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        same_len("all_reduce", "send", send.len(), "recv", recv.len())?;
        self.typed(Collective::AllReduce, send.len(), op, send, recv)
    }

    /// In-place all-reduce: `buf = op(buf of every rank)`.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.typed_in_place(Collective::AllReduce, buf.len(), op, buf)
    }

    /// The root's `send` is copied into every rank's `recv` (`ncclBroadcast`); `send` is
    /// only read on the root (other ranks may pass an empty slice).
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        if self.rank == root {
            same_len("broadcast", "send", send.len(), "recv", recv.len())?;
        }
        let c = Collective::Broadcast { root };
        self.typed(c, recv.len(), ReduceOp::Sum, send, recv)
    }

    /// In-place broadcast (`ncclBcast`): the root's `buf` overwrites everyone's.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        self.typed_in_place(
            Collective::Broadcast { root },
            buf.len(),
            ReduceOp::Sum,
            buf,
        )
    }

    /// The root's `recv = op(send of every rank)` (`ncclReduce`); `recv` is only written on
    /// the root (other ranks may pass an empty slice).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        if self.rank == root {
            same_len("reduce", "send", send.len(), "recv", recv.len())?;
        }
        self.typed(Collective::Reduce { root }, send.len(), op, send, recv)
    }

    /// In-place reduce: the root's `buf` becomes the reduction.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        self.typed_in_place(Collective::Reduce { root }, buf.len(), op, buf)
    }

    /// `recv` = every rank's `send`, concatenated by rank (`ncclAllGather`);
    /// `recv.len() == size() * send.len()`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.times_size("all_gather", "recv", recv.len(), "send", send.len())?;
        self.typed(Collective::AllGather, send.len(), ReduceOp::Sum, send, recv)
    }

    /// In-place all-gather: rank `r` puts its part at `buf[r * n .. (r + 1) * n]`
    /// (`n = buf.len() / size()`), and every part ends up everywhere.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let count = self.block_of("all_gather", buf.len())?;
        self.typed_in_place(Collective::AllGather, count, ReduceOp::Sum, buf)
    }

    /// `recv` = block `rank()` of the reduction of every rank's `send`
    /// (`ncclReduceScatter`); `send.len() == size() * recv.len()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.times_size("reduce_scatter", "send", send.len(), "recv", recv.len())?;
        self.typed(Collective::ReduceScatter, recv.len(), op, send, recv)
    }

    /// In-place reduce-scatter: the result lands in `buf[r * n .. (r + 1) * n]` on rank
    /// `r` (`n = buf.len() / size()`).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let count = self.block_of("reduce_scatter", buf.len())?;
        self.typed_in_place(Collective::ReduceScatter, count, op, buf)
    }

    /// Block `j` of this rank's `send` goes to rank `j`; block `i` of `recv` comes from
    /// rank `i` (`ncclAlltoAll`). Both have `size()` equal blocks.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        same_len("all_to_all", "send", send.len(), "recv", recv.len())?;
        let count = self.block_of("all_to_all", send.len())?;
        self.typed(Collective::AllToAll, count, ReduceOp::Sum, send, recv)
    }

    /// The root's `recv` = every rank's `send`, concatenated by rank (`ncclGather`).
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.check_root("gather", root)?;
        if self.rank == root {
            self.times_size("gather", "recv", recv.len(), "send", send.len())?;
        }
        self.typed(
            Collective::Gather { root },
            send.len(),
            ReduceOp::Sum,
            send,
            recv,
        )
    }

    /// Block `r` of the root's `send` goes to rank `r`'s `recv` (`ncclScatter`).
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.check_root("scatter", root)?;
        if self.rank == root {
            self.times_size("scatter", "send", send.len(), "recv", recv.len())?;
        }
        self.typed(
            Collective::Scatter { root },
            recv.len(),
            ReduceOp::Sum,
            send,
            recv,
        )
    }

    /// Sends `buf` to `peer`, which must post a matching [`Communicator::recv`]
    /// (`ncclSend`).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        self.typed(
            Collective::Send { peer },
            buf.len(),
            ReduceOp::Sum,
            buf,
            &mut [],
        )
    }

    /// Receives into `buf` from `peer` (`ncclRecv`).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer("recv", peer)?;
        self.typed(
            Collective::Recv { peer },
            buf.len(),
            ReduceOp::Sum,
            &[],
            buf,
        )
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.all_reduce_in_place(&mut [0u8], ReduceOp::Sum)
    }

    /// Starts a group: the operations added to it run together when it ends
    /// (`ncclGroupStart` … `ncclGroupEnd`), so a send and a receive between two ranks in
    /// one group cannot wait on each other.
    pub fn group(&self) -> Group<'_, '_> {
        Group {
            comm: self,
            ops: Vec::new(),
            _buffers: PhantomData,
        }
    }

    /// Runs `call` on this communicator's progress thread, after every call issued
    /// before it (blocking or not) and before every call issued after it; returns at once.
    /// The progress thread starts on first use. This is what `ProcessGroup`-style
    /// asynchronous APIs build on.
    pub fn submit<R: Send + 'static>(
        self: &Arc<Self>,
        call: impl FnOnce(&Communicator) -> Result<R> + Send + 'static,
    ) -> Result<Pending<R>> {
        let thread = match self.progress.get() {
            Some(t) => t,
            None => {
                let t = ProgressThread::start(format!("ferroccl-progress-r{}", self.rank))?;
                // Another thread may have won the race; its thread is used, ours dropped.
                let _ = self.progress.set(t);
                self.progress.get().expect("set above")
            }
        };
        let (pending, complete) = pending();
        let ticket = self.turns.ticket();
        let comm = Arc::clone(self);
        let queued = thread.submit(Box::new(move || {
            let result = comm.turns.run_in_turn(ticket, || call(&comm));
            complete(result);
        }));
        if let Err(e) = queued {
            // The ticket was taken: use it up, or every later call would wait for it.
            self.turns.run_in_turn(ticket, || ());
            return Err(e);
        }
        Ok(pending)
    }

    /// Asynchronous in-place all-reduce of an owned buffer, handed back when done.
    pub fn all_reduce_async<T: Element>(
        self: &Arc<Self>,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Pending<Vec<T>>> {
        self.submit(move |comm| comm.all_reduce_in_place(&mut buf, op).map(|()| buf))
    }

    pub(super) fn typed<T: Element>(
        &self,
        collective: Collective,
        count: usize,
        op: ReduceOp,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        let (in_len, out_len) = collective.buffer_lens(count, self.rank, self.nranks);
        check_len(collective, "send", send.len(), in_len)?;
        check_len(collective, "recv", recv.len(), out_len)?;
        let raw = RawCall {
            collective,
            count,
            dtype: T::DTYPE,
            op,
            input: send.as_ptr() as *const u8,
            output: recv.as_mut_ptr() as *mut u8,
        };
        // SAFETY: the slices have the lengths the plan uses (checked above), are
        // borrowed for the whole call, and do not overlap (Rust borrows).
        unsafe { self.run(&[raw]) }
    }

    pub(super) fn typed_in_place<T: Element>(
        &self,
        collective: Collective,
        count: usize,
        op: ReduceOp,
        buf: &mut [T],
    ) -> Result<()> {
        let (in_len, out_len) = collective.buffer_lens(count, self.rank, self.nranks);
        let base = buf.as_mut_ptr();
        let elem = std::mem::size_of::<T>();
        let (input, output) = match (
            collective.input_in_output(count, self.rank),
            collective.output_in_input(count, self.rank),
        ) {
            (_, Some(at)) => {
                check_len(collective, "buf", buf.len(), in_len)?;
                // SAFETY: `at + out_len <= in_len == buf.len()` by the collective's layout.
                (base as *const u8, unsafe { base.add(at) } as *mut u8)
            }
            (Some(at), _) => {
                check_len(collective, "buf", buf.len(), out_len.max(in_len + at))?;
                // SAFETY: `at + in_len <= buf.len()` as checked.
                (unsafe { base.add(at) } as *const u8, base as *mut u8)
            }
            (None, None) => {
                // The call has no output on this rank (a reduce's non-root): the buffer
                // is only read.
                check_len(collective, "buf", buf.len(), in_len.max(out_len))?;
                (base as *const u8, base as *mut u8)
            }
        };
        debug_assert_eq!(elem, T::DTYPE.size());
        let raw = RawCall {
            collective,
            count,
            dtype: T::DTYPE,
            op,
            input,
            output,
        };
        // SAFETY: input and output lie in `buf` as NCCL's in-place layout prescribes,
        // with the lengths checked above; `buf` is borrowed mutably for the call.
        unsafe { self.run(&[raw]) }
    }
}
