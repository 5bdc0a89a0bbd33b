//! Planning calls: the cost model's choice of algorithm and protocol, and the plans
//! made from it (cached for loops that repeat a few calls).

use super::*;

/// What calls are planned with: a cost model that picks each call's algorithm and
/// protocol, and the plan options (rings, chunks) they are made from. Host calls have
/// one; calls on device memory another, from the GPUs ([`super::device_tuning`]).
pub(super) struct Planner {
    /// The cost model (the same on every rank, so choices agree).
    pub(super) model: CostModel,
    /// Plan options per protocol (Simple, LL, SingleCopy: their chunks differ) and
    /// element size (1, 2, 4 and 8 bytes: the chunk is in elements).
    pub(super) plan_options: [[PlanOptions; 4]; 3],
    /// Channels (rings) of its plans.
    pub(super) channels: usize,
    /// Whether its calls may use single copy (host calls, when every rank may read
    /// every peer's memory: [`crate::transport::Connections::peer_memory`]).
    pub(super) single_copy: bool,
}

impl Planner {
    /// The planners of host calls: without windows, and while windows are registered
    /// when that differs. Single copy between threads of one process, or from a window
    /// every peer mapped, is a pointer read, priced as the model's `local_in_place`
    /// (every rank sees the same model and the same pids, so all choose alike).
    /// `crowded`: some host's ranks outnumber its cores (the same on every rank), so
    /// its FIFOs are short and so are Simple ring steps
    /// ([`CommConfig::chunk_bytes_for`]).
    pub(super) fn for_host(
        config: &CommConfig,
        hosts: &[usize],
        mut model: CostModel,
        memory: std::result::Result<&crate::transport::single_copy::PeerMemory, &str>,
        crowded: bool,
    ) -> (Planner, Option<Planner>) {
        let single_copy = memory.is_ok();
        let in_process = memory.is_ok_and(|m| m.all_in_process());
        if in_process {
            model = model.reading_in_place();
        }
        let planner = Planner::new(config, hosts, config.channels, model, single_copy, crowded);
        let windowed = (single_copy && !in_process).then(|| {
            let model = model.reading_in_place();
            Planner::new(config, hosts, config.channels, model, single_copy, crowded)
        });
        (planner, windowed)
    }

    /// `channels` rings over ranks on `hosts`, chunks from `config` (for a job with a
    /// `crowded` host when it has one), choices by `model`.
    pub(super) fn new(
        config: &CommConfig,
        hosts: &[usize],
        channels: usize,
        model: CostModel,
        single_copy: bool,
        crowded: bool,
    ) -> Self {
        let rings = PlanOptions::for_hosts(hosts, channels, 1).rings;
        Planner {
            model,
            plan_options: Protocol::ALL.map(|protocol| {
                [1usize, 2, 4, 8].map(|elem| PlanOptions {
                    chunk_elems: (config.chunk_bytes_for(protocol, crowded) / elem).max(1),
                    rings: rings.clone(),
                    algorithm: Algorithm::Ring,
                    hosts: hosts.to_vec(),
                })
            }),
            channels,
            single_copy,
        }
    }
}

impl Communicator {
    /// The plan this rank runs for `collective` of `count` elements of `dtype` (the
    /// algorithm, channels and chunking it would use now), for study and for checking
    /// traces against.
    pub fn plan_for(&self, collective: Collective, count: usize, dtype: DataType) -> Result<Plan> {
        let raw = RawCall {
            collective,
            count,
            dtype,
            op: ReduceOp::Sum,
            input: std::ptr::null(),
            output: std::ptr::null_mut(),
        };
        let windows = self.lock().windows.len();
        let planner = self.host_planner(windows);
        self.plan_with(
            planner,
            &raw,
            self.choice_with(planner, collective, count * dtype.size()),
        )
    }

    /// The plan of one operation by `planner`, found in `plans` or made and kept there,
    /// and now their current one.
    pub(super) fn single_plan<'a>(
        &self,
        planner: &Planner,
        plans: &'a mut PlanCache,
        raw: &RawCall,
    ) -> Result<&'a CachedPlan> {
        let key = (raw.collective, raw.count, raw.dtype.size());
        if !plans.find(&key) {
            let choice = self.choice_with(planner, raw.collective, raw.count * raw.dtype.size());
            let plan = self.plan_with(planner, raw, choice)?;
            tracing::info!(
                "rank {}: {} of {} B uses {} ({} channels)",
                self.rank,
                raw.collective.name(),
                raw.count * raw.dtype.size(),
                choice.name(),
                planner.channels
            );
            plans.insert(CachedPlan {
                key,
                scratch_elems: plan.scratch_elems(0),
                plan,
                choice,
                connected: false,
                schedule: None,
            });
        }
        Ok(plans.current().expect("found or planned above"))
    }

    /// The fused plan of operations issued together, and each operation's choice. Each
    /// operation gets its own algorithm and protocol, from itself alone: every rank then
    /// agrees on each, whatever else it groups with it.
    pub(super) fn fused_plan(
        &self,
        planner: &Planner,
        raws: &[RawCall],
    ) -> Result<(Plan, Vec<Choice>)> {
        let choices: Vec<Choice> = raws
            .iter()
            .map(|r| self.choice_with(planner, r.collective, r.count * r.dtype.size()))
            .collect();
        let plans = raws
            .iter()
            .zip(&choices)
            .map(|(raw, &c)| self.plan_with(planner, raw, c))
            .collect::<Result<Vec<_>>>()?;
        Ok((Plan::fuse(plans)?, choices))
    }

    pub(super) fn plan_with(
        &self,
        planner: &Planner,
        raw: &RawCall,
        choice: Choice,
    ) -> Result<Plan> {
        let protocol_index = choice.protocol.index();
        let options =
            &planner.plan_options[protocol_index][raw.dtype.size().trailing_zeros() as usize];
        if choice.algorithm == options.algorithm {
            return plan::plan(raw.collective, raw.count, self.rank, self.nranks, options);
        }
        let options = options.clone().with_algorithm(choice.algorithm);
        plan::plan(raw.collective, raw.count, self.rank, self.nranks, &options)
    }

    /// The algorithm and protocol a call of `collective` moving `bytes` per rank uses:
    /// those `FERROCCL_ALGO` / `FERROCCL_PROTO` force, or the cost model's choice among
    /// those allowed that apply to it (all-to-all, gather, scatter and send/recv have
    /// one plan, reported as ring; every collective has a choice of protocol). In
    /// deterministic mode a reduction uses only algorithms that fold in rank order.
    pub fn choice_for(&self, collective: Collective, bytes: usize) -> Choice {
        let windows = self.lock().windows.len();
        self.choice_with(self.host_planner(windows), collective, bytes)
    }

    /// The planner of host calls while `windows` windows are registered.
    pub(super) fn host_planner(&self, windows: usize) -> &Planner {
        match &self.windowed_planner {
            Some(windowed) if windows > 0 => windowed,
            _ => &self.planner,
        }
    }

    pub(super) fn choice_with(
        &self,
        planner: &Planner,
        collective: Collective,
        bytes: usize,
    ) -> Choice {
        let rank_order = self.config.deterministic && collective.is_reducing();
        let mut algorithms: Vec<Algorithm> = self
            .config
            .algorithms
            .iter()
            .copied()
            .filter(|a| a.applies_to(collective) && (!rank_order || a.folds_in_rank_order()))
            .collect();
        if algorithms.is_empty() {
            algorithms.push(if rank_order {
                Algorithm::OneShot
            } else {
                Algorithm::Ring
            });
        }
        let offered: Vec<Protocol>;
        let protocols = if planner.single_copy {
            &self.config.protocols
        } else {
            offered = (self.config.protocols.iter().copied())
                .filter(|&p| p != Protocol::SingleCopy)
                .collect();
            &offered
        };
        let choice = planner
            .model
            .best(collective, bytes, self.shape, &algorithms, protocols);
        tracing::debug!(
            "rank {}: {} of {bytes} B on {:?}: {}",
            self.rank,
            collective.name(),
            self.shape,
            choice.name()
        );
        choice
    }

    /// The cost model of host calls and the job's shape (rank 0's model).
    pub fn cost_model(&self) -> (CostModel, Shape) {
        (self.planner.model, self.shape)
    }
}

/// The single-operation plans of the last few distinct calls, the most recent first:
/// loops that repeat a few calls (a training step's loss and gradient buckets, a
/// benchmark) plan each once. With only the last plan kept, 2 ranks (threads over shared
/// memory) alternating an 8-byte and a 16-byte all-reduce took 1.03–1.07 µs a pair near
/// and 2.65 far, against 0.29–0.30 and 0.72–0.73 with plans kept (a lone 8-byte call:
/// 0.15 µs near); alternating 8 bytes and 64 KiB, 3.42–3.62 µs near and 10.5 far against
/// 2.58–2.64 and 8.3 (interleaved runs; `benches/allreduce.rs`, `alternating`).
#[derive(Default)]
pub(super) struct PlanCache {
    plans: Vec<CachedPlan>,
}

impl PlanCache {
    /// Plans kept; the least recently used goes first.
    pub(super) const KEPT: usize = 8;

    /// The plan the last [`Communicator::single_plan`] found or made.
    pub(super) fn current(&self) -> Option<&CachedPlan> {
        self.plans.first()
    }

    /// The same, to mark it connected or record its schedule.
    pub(super) fn current_mut(&mut self) -> Option<&mut CachedPlan> {
        self.plans.first_mut()
    }

    /// Makes the plan of `key` the current one; false when none is kept.
    fn find(&mut self, key: &PlanKey) -> bool {
        match self.plans.iter().position(|c| c.key == *key) {
            Some(0) => true,
            Some(i) => {
                self.plans[..=i].rotate_right(1);
                true
            }
            None => false,
        }
    }

    /// Keeps `plan` as the current one, dropping the least recently used if full.
    fn insert(&mut self, plan: CachedPlan) {
        if self.plans.len() == Self::KEPT {
            self.plans.pop();
        }
        self.plans.insert(0, plan);
    }

    /// The calls whose plans are kept, the most recent first.
    #[cfg(test)]
    pub(super) fn keys(&self) -> Vec<PlanKey> {
        self.plans.iter().map(|c| c.key).collect()
    }

    /// Drops every plan (their planner changed).
    pub(super) fn clear(&mut self) {
        self.plans.clear();
    }
}
