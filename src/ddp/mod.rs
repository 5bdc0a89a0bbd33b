//! Data-parallel training, framework-neutral: every rank holds the same model, trains on
//! its own shard of each batch, and gradients are averaged across ranks so every rank
//! takes the same step.
//!
//! A model exposes its parameters and gradients as flat `f32` slices
//! ([`Parameters`]). The [`Reducer`] assigns them to buckets in reverse registration
//! order (the order backward produces gradients), the first bucket small (1 MiB) and the
//! rest large (25 MiB), as PyTorch's DDP does. The backward pass calls
//! [`Reducer::mark_ready`] as each gradient is done; a bucket whose gradients are all in
//! starts its all-reduce at once, on the group's progress thread, while backward goes
//! on. [`Reducer::finish`] waits for the buckets, divides by the world size and writes
//! the averages back. Parameters are broadcast from rank 0 at the start; `no_sync`
//! accumulates gradients locally; an optional bf16 hook halves the bytes sent.
//! [`DistributedSampler`] splits a data set into disjoint per-rank shards.

pub mod mlp;
mod sampler;

pub use sampler::DistributedSampler;

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::pg::{ProcessGroup, Work};
use crate::types::ReduceOp;

/// A model's parameters and their gradients, as flat slices in registration order.
pub trait Parameters {
    /// Number of parameter tensors.
    fn count(&self) -> usize;
    /// Parameter `i`.
    fn param(&mut self, i: usize) -> &mut [f32];
    /// Gradient of parameter `i` (same length).
    fn grad(&mut self, i: usize) -> &mut [f32];
}

/// How gradients travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// As `f32`.
    None,
    /// Rounded to bfloat16 for the all-reduce (PyTorch's `bf16_compress_hook`).
    Bf16,
}

/// Reducer settings.
#[derive(Clone, Debug)]
pub struct ReducerOptions {
    /// Bytes of the first bucket (the last layers' gradients; PyTorch: 1 MiB).
    pub first_bucket_bytes: usize,
    /// Bytes of the other buckets (PyTorch: 25 MiB).
    pub bucket_bytes: usize,
    /// Start a bucket's all-reduce as soon as it is full (true), or only in
    /// [`Reducer::finish`] (false: no overlap, for comparison).
    pub overlap: bool,
    /// Gradient compression.
    pub compression: Compression,
}

impl Default for ReducerOptions {
    fn default() -> Self {
        ReducerOptions {
            first_bucket_bytes: 1 << 20,
            bucket_bytes: 25 << 20,
            overlap: true,
            compression: Compression::None,
        }
    }
}

/// A bucket's all-reduce in flight.
enum InFlight {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<half::bf16>>),
}

struct Bucket {
    /// Parameters in it, with their offsets.
    params: Vec<(usize, usize)>,
    data: Vec<f32>,
    missing: usize,
    flight: Option<InFlight>,
}

/// Where one parameter's gradient goes.
#[derive(Clone, Copy)]
struct Slot {
    bucket: usize,
    offset: usize,
    len: usize,
}

/// Time spent in a step's communication, as the training loop sees it.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTimes {
    /// Time [`Reducer::finish`] waited for all-reduces (communication not hidden by
    /// backward).
    pub exposed_comm: Duration,
}

/// Buckets gradients and all-reduces them, overlapped with backward.
///
/// # Example
///
/// Two ranks with a one-tensor model: each hands its gradient to the reducer when
/// backward has it final, and `finish` writes the average over the ranks into the
/// model's gradient.
///
/// ```
/// use ferroccl::ddp::{Parameters, Reducer, ReducerOptions};
/// use ferroccl::pg::{PgOptions, ProcessGroup};
/// use ferroccl::Communicator;
///
/// struct Model {
///     weight: Vec<f32>,
///     grad: Vec<f32>,
/// }
///
/// impl Parameters for Model {
///     fn count(&self) -> usize {
///         1
///     }
///     fn param(&mut self, _: usize) -> &mut [f32] {
///         &mut self.weight
///     }
///     fn grad(&mut self, _: usize) -> &mut [f32] {
///         &mut self.grad
///     }
/// }
///
/// let comms = Communicator::init_all(2)?;
/// std::thread::scope(|s| {
///     for comm in comms {
///         s.spawn(move || {
///             let rank = comm.rank() as f32;
///             let pg = ProcessGroup::from_communicator(comm, "default", PgOptions::default())
///                 .unwrap();
///             let mut model = Model { weight: vec![0.0; 3], grad: vec![rank; 3] };
///             let mut reducer = Reducer::new(&pg, &[3], ReducerOptions::default()).unwrap();
///             reducer.mark_ready(0, &model.grad.clone()).unwrap();
///             reducer.finish(&mut model).unwrap();
///             assert_eq!(model.grad, vec![0.5; 3]); // (0 + 1) / 2
///         });
///     }
/// });
/// # Ok::<(), ferroccl::Error>(())
/// ```
pub struct Reducer<'g> {
    pg: &'g ProcessGroup,
    options: ReducerOptions,
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
    ready: Vec<bool>,
    no_sync: bool,
    /// The next bucket to launch: buckets start in index order on every rank, whatever
    /// order backward fills them in, so all ranks issue the same all-reduces in the
    /// same order.
    next_launch: usize,
    /// Set after an error: the buckets' state is unknown, so the reducer refuses work.
    poisoned: Option<String>,
}

impl<'g> Reducer<'g> {
    /// Buckets parameters of the given lengths (registration order) for `pg`.
    pub fn new(pg: &'g ProcessGroup, lengths: &[usize], options: ReducerOptions) -> Result<Self> {
        if options.first_bucket_bytes < 4 || options.bucket_bytes < 4 {
            return Err(Error::invalid("bucket sizes must hold at least one f32"));
        }
        let mut slots = vec![
            Slot {
                bucket: 0,
                offset: 0,
                len: 0
            };
            lengths.len()
        ];
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut cap = options.first_bucket_bytes / 4;
        // Reverse registration order: the order backward produces gradients in.
        for i in (0..lengths.len()).rev() {
            let len = lengths[i];
            let start_new = match buckets.last() {
                None => true,
                Some(b) => !b.data.is_empty() && b.data.len() + len > cap,
            };
            if start_new {
                if !buckets.is_empty() {
                    cap = options.bucket_bytes / 4;
                }
                buckets.push(Bucket {
                    params: Vec::new(),
                    data: Vec::new(),
                    missing: 0,
                    flight: None,
                });
            }
            let b = buckets.len() - 1;
            let bucket = &mut buckets[b];
            slots[i] = Slot {
                bucket: b,
                offset: bucket.data.len(),
                len,
            };
            bucket.params.push((i, bucket.data.len()));
            bucket.data.resize(bucket.data.len() + len, 0.0);
        }
        for b in &mut buckets {
            b.missing = b.params.len();
        }
        Ok(Reducer {
            pg,
            options,
            slots,
            buckets,
            ready: vec![false; lengths.len()],
            no_sync: false,
            next_launch: 0,
            poisoned: None,
        })
    }

    /// The buckets: for each, the parameters it holds (in the order they arrive).
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        self.buckets
            .iter()
            .map(|b| b.params.iter().map(|&(p, _)| p).collect())
            .collect()
    }

    /// Makes every rank's parameters rank 0's (call once, before training).
    pub fn broadcast_parameters(&self, model: &mut impl Parameters) -> Result<()> {
        let works = (0..model.count())
            .map(|i| self.pg.broadcast(model.param(i).to_vec(), 0))
            .collect::<Result<Vec<_>>>()?;
        for (i, w) in works.into_iter().enumerate() {
            model.param(i).copy_from_slice(&w.wait()?);
        }
        Ok(())
    }

    /// While on, gradients are not synchronised: backward accumulates into the model's
    /// gradients, and the step after `no_sync(false)` averages the accumulated sums.
    pub fn no_sync(&mut self, on: bool) {
        self.no_sync = on;
    }

    /// Buckets whose all-reduce is running now (for tests and tuning: with overlap,
    /// full buckets are in flight before [`Reducer::finish`]).
    pub fn buckets_in_flight(&self) -> usize {
        self.buckets.iter().filter(|b| b.flight.is_some()).count()
    }

    fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => Err(Error::invalid(format!(
                "the reducer is unusable after an earlier error ({why}); make a new one"
            ))),
            None => Ok(()),
        }
    }

    /// Records `e` as poisoning the reducer, and returns it.
    fn poison(&mut self, e: Error) -> Error {
        self.poisoned.get_or_insert_with(|| e.to_string());
        e
    }

    /// Gradient `param` is final for this step (call from backward, last layer first).
    pub fn mark_ready(&mut self, param: usize, grad: &[f32]) -> Result<()> {
        if self.no_sync {
            return Ok(());
        }
        self.check_usable()?;
        let slot = *self
            .slots
            .get(param)
            .ok_or_else(|| Error::invalid(format!("mark_ready: no parameter {param}")))?;
        if grad.len() != slot.len {
            return Err(Error::invalid(format!(
                "mark_ready: parameter {param} has {} elements, the gradient {}",
                slot.len,
                grad.len()
            )));
        }
        if std::mem::replace(&mut self.ready[param], true) {
            return Err(Error::invalid(format!(
                "mark_ready: parameter {param} marked twice in one step"
            )));
        }
        let bucket = &mut self.buckets[slot.bucket];
        bucket.data[slot.offset..slot.offset + slot.len].copy_from_slice(grad);
        bucket.missing -= 1;
        if self.options.overlap {
            self.launch_ready()?;
        }
        Ok(())
    }

    /// Launches, in index order, every bucket that is complete and not yet launched.
    fn launch_ready(&mut self) -> Result<()> {
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].missing == 0 {
            let b = self.next_launch;
            self.next_launch += 1;
            if let Err(e) = self.launch(b) {
                return Err(self.poison(e));
            }
        }
        Ok(())
    }

    fn launch(&mut self, b: usize) -> Result<()> {
        let bucket = &mut self.buckets[b];
        let data = std::mem::take(&mut bucket.data);
        bucket.flight = Some(match self.options.compression {
            Compression::None => InFlight::F32(self.pg.all_reduce(data, ReduceOp::Sum)?),
            Compression::Bf16 => {
                let packed: Vec<half::bf16> =
                    data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                // The f32 buffer is kept for the unpacked result.
                bucket.data = data;
                InFlight::Bf16(self.pg.all_reduce(packed, ReduceOp::Sum)?)
            }
        });
        Ok(())
    }

    /// Ends the step: waits for every bucket, divides by the world size and writes the
    /// averaged gradients into the model. With `no_sync` on, does nothing.
    pub fn finish(&mut self, model: &mut impl Parameters) -> Result<StepTimes> {
        if self.no_sync {
            return Ok(StepTimes::default());
        }
        self.check_usable()?;
        if let Some(p) = self.ready.iter().position(|r| !r) {
            let unready: Vec<usize> = (p..self.ready.len()).filter(|&i| !self.ready[i]).collect();
            let e = Error::invalid(format!(
                "finish: parameters {unready:?} were never marked ready in this step (every \
                 gradient must reach the reducer, or ranks would wait for each other)"
            ));
            return Err(self.poison(e));
        }
        self.launch_ready()?;
        match self.wait_all(model) {
            Ok(t) => Ok(t),
            Err(e) => Err(self.poison(e)),
        }
    }

    fn wait_all(&mut self, model: &mut impl Parameters) -> Result<StepTimes> {
        let start = Instant::now();
        let scale = 1.0 / self.pg.size() as f32;
        for bucket in &mut self.buckets {
            match bucket.flight.take() {
                Some(InFlight::F32(w)) => bucket.data = w.wait()?,
                Some(InFlight::Bf16(w)) => {
                    for (d, x) in bucket.data.iter_mut().zip(w.wait()?) {
                        *d = x.to_f32();
                    }
                }
                None => return Err(Error::invalid("finish: a bucket was never launched")),
            }
            for x in &mut bucket.data {
                *x *= scale;
            }
            for &(p, offset) in &bucket.params {
                let len = self.slots[p].len;
                model
                    .grad(p)
                    .copy_from_slice(&bucket.data[offset..offset + len]);
            }
            bucket.missing = bucket.params.len();
        }
        self.ready.iter_mut().for_each(|r| *r = false);
        self.next_launch = 0;
        Ok(StepTimes {
            exposed_comm: start.elapsed(),
        })
    }
}
