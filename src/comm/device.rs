//! Calls on device memory: enqueued on the caller's CUDA stream by the engine's device
//! side, with their own plans (the device planner, [`super::device_tuning`]).

use super::*;

impl Communicator {
    /// Enqueues operations on device memory on `stream` and returns at once, as NCCL
    /// does (see [`crate::engine::device`]): the operations are complete when the stream
    /// reaches them. Several operations run as one fused plan and one launch, as a group.
    /// Failures of earlier device calls are reported here (or by
    /// [`synchronize_device`](Self::synchronize_device)).
    ///
    /// # Safety
    /// As [`Communicator::collective_raw`], with device buffers that stay valid and
    /// untouched until the stream has passed the call; `stream` is a CUDA stream of the
    /// current context (or NULL).
    pub unsafe fn enqueue_device(
        &self,
        calls: &[RawCall],
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        for call in calls {
            self.check_root_or_peer(call.collective)?;
        }
        if calls.is_empty() {
            return Ok(());
        }
        // SAFETY: forwarded from this function's contract.
        self.turns
            .run_blocking(|| unsafe { self.enqueue_in_turn(calls, stream) })
    }

    /// [`Communicator::enqueue_device`], once it is this call's turn.
    ///
    /// # Safety
    /// As [`Communicator::enqueue_device`].
    pub(super) unsafe fn enqueue_in_turn(
        &self,
        raws: &[RawCall],
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        let mut st = self.lock();
        if let Some(why) = self.failure() {
            return Err(Error::Aborted {
                rank: self.rank,
                reason: why,
            });
        }
        let st = &mut *st;
        let fused;
        let (plan, choices) = match raws {
            [raw] => {
                let cached = self.single_plan(&self.device_planner, &mut st.device_plans, raw)?;
                (&cached.plan, vec![cached.choice])
            }
            _ => {
                let (plan, choices) = self.fused_plan(&self.device_planner, raws)?;
                fused = plan;
                (&fused, choices)
            }
        };
        let mut ops = Vec::with_capacity(raws.len());
        for (raw, choice) in raws.iter().zip(&choices) {
            let (reducing, op) = raw.reduction();
            ops.push(crate::engine::device::DeviceOp {
                kernel: Kernel::new(raw.dtype, op, self.nranks)?,
                reducing,
                input: raw.input as u64,
                output: raw.output as u64,
                protocol: choice.protocol,
            });
        }
        // The call's context: its stream's (or, for NULL, the thread's current one).
        // SAFETY: the caller's stream.
        let ctx = unsafe { crate::cuda::Context::of_stream(stream)? };
        if st.device.is_none() {
            let launcher = self.device_launcher(ctx)?;
            let _ = self.device_abort.set(launcher.abort_word());
            st.device = Some(launcher);
        }
        let device = st.device.as_ref().expect("made above");
        if device.context() != ctx {
            return Err(Error::invalid(format!(
                "rank {}: device calls of one communicator must stay on one CUDA context \
                 (device {} here, device {} before)",
                self.rank,
                ctx.device()?,
                device.context().device()?
            )));
        }
        let seq = st.seq;
        st.seq += 1;
        let name = match raws {
            [raw] => raw.collective.name(),
            _ => "group",
        };
        let store = self.boot.store().clone();
        let device = st.device.as_mut().expect("made above");
        // SAFETY: forwarded from this function's contract.
        let result =
            unsafe { device.enqueue(plan, &ops, stream, &*store, self.config.timeout, name, seq) };
        // A call refused before it launched (a capturing stream, a stream shared by two
        // ranks) leaves the communicator as it was; any other failure may have left FIFOs
        // half used.
        if let Err(e) = &result
            && !matches!(e, Error::InvalidArgument { .. })
        {
            self.set_failure(e.to_string());
        }
        result
    }

    /// The device side of this rank, made by its first call on device memory (in
    /// context `ctx`): a launcher with a watchdog that fails the communicator when a call
    /// outlives the timeout or a peer process of this host exits.
    pub(super) fn device_launcher(
        &self,
        ctx: crate::cuda::Context,
    ) -> Result<crate::engine::device::Launcher> {
        let ll = crate::transport::fifo::Geometry::ll(
            self.config.ll_slots,
            self.config.ll_payload_bytes,
        );
        // Equal for this communicator's ranks (a hash of the members), so that two of
        // them on one stream are told apart from two communicators' ranks.
        let comm_key = self
            .boot
            .peers()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, p| {
                (h ^ p.host_hash() ^ u64::from(p.pid) ^ (p.rank as u64) << 32)
                    .wrapping_mul(0x0100_0000_01b3)
            });
        // The device watchdog's verdict reaches ncclCommGetAsyncError and the next
        // call without waiting for the state lock.
        let failure = self.failure.clone();
        let on_timeout = move |why: String| failure.set(why);
        // Peers in other processes of this host: the watchdog notices their exit.
        let me = &self.boot.peers()[self.rank];
        let peers = self
            .boot
            .peers()
            .iter()
            .filter(|p| p.host_id == me.host_id && p.pid != me.pid)
            .map(|p| (p.rank, crate::transport::liveness::Liveness::watch(p.pid)))
            .collect();
        crate::engine::device::Launcher::new(
            self.rank,
            comm_key,
            Box::new(on_timeout),
            peers,
            ctx,
            self.config.geometry(),
            ll,
            self.config.timeout,
        )
    }

    /// Looks at the device calls that have finished, without waiting for any (nor for
    /// a call in progress on another thread): a failed one becomes the communicator's
    /// failure, as [`failure`](Self::failure) then reports (`ncclCommGetAsyncError`).
    pub fn poll_device(&self) {
        let Ok(mut st) = self.state.try_lock() else {
            return;
        };
        if let Some(d) = st.device.as_mut()
            && let Err(e) = d.poll()
        {
            drop(st);
            self.set_failure(e.to_string());
        }
    }

    /// Waits until every call on device memory issued so far has finished (at most the
    /// communicator's timeout, after which the device is told to stop waiting and the
    /// call fails with a timeout); the first failure among them is the error.
    pub fn synchronize_device(&self) -> Result<()> {
        let deadline = Instant::now() + self.config.timeout;
        let mut st = self.lock();
        let result = match st.device.as_mut() {
            Some(d) => d.wait_all(deadline),
            None => Ok(()),
        };
        if let Err(e) = &result {
            // The FIFOs' counters are not to be trusted after a failed device call.
            self.set_failure(e.to_string());
        }
        result
    }

    /// [`choice_for`](Self::choice_for) of a call on device memory (the device's cost
    /// model, [`device_tuning`](Self::device_tuning)).
    pub fn device_choice_for(&self, collective: Collective, bytes: usize) -> Choice {
        self.choice_with(&self.device_planner, collective, bytes)
    }

    /// The ordinal of the GPU whose context was current when this rank joined (as
    /// `ncclCommCuDevice` reports it); `None` for a rank that joined without one.
    pub fn cuda_device(&self) -> Option<usize> {
        self.gpu.as_ref().map(|g| g.ordinal)
    }

    /// How calls on device memory are planned: their channels, the link between the
    /// GPUs and the cost model, agreed by every rank at initialisation.
    pub fn device_tuning(&self) -> device_tuning::DeviceTuning {
        self.device_tuning
    }
}
