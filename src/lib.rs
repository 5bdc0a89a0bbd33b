//! ferroccl: a collective communication library written from scratch in Rust.
//!
//! It does the job NCCL does for GPUs and Gloo does for CPUs: ranks find each other
//! through a [`store`] and the [`bootstrap`] rendezvous, then run collectives over their
//! own transports. See `README.md` for the status of each part and `DESIGN.md` (in the
//! project's shared folder) for the direction.
//!
//! Layers, bottom to top, one module each; a module uses only modules above it in this
//! list (`tests/layers.rs` checks it, so there are no import cycles):
//! - [`error`]: the one structured [`Error`] enum, and [`error::CallInfo`], what a call
//!   is for its errors and deadline.
//! - [`env`](mod@env): reading `FERROCCL_*` / `NCCL_*` variables.
//! - [`types`]: [`DataType`] and [`ReduceOp`] with NCCL's numbering.
//! - [`trace`]: logging through `tracing`, controlled by `FERROCCL_DEBUG`, and traces.
//! - [`store`]: the control plane ([`store::TcpStore`], PyTorch-wire-compatible, and
//!   [`store::FileStore`], [`store::PrefixStore`], [`store::HashStore`]).
//! - [`bootstrap`]: [`bootstrap::UniqueId`], `env://` initialisation, peer-info
//!   all-gather and barrier.
//! - [`plan`]: pure schedules (ring, pipelined chain, tree, direct) as step lists, the
//!   protocols their slices use, and the in-memory simulator ([`plan::sim`]) that runs
//!   them exactly.
//! - [`topo`]: which ranks share a host; this host's NUMA nodes, NICs and GPUs; JSON
//!   dumps.
//! - [`tune`]: the α-β cost model that picks the algorithm (ring, tree, one-shot,
//!   two-shot) and the protocol (LL, Simple) per call.
//! - [`reduce`]: host reduction kernels ([`reduce::Kernel`]) for every dtype × op.
//! - [`cuda`]: the one door to the GPU: the driver and NVRTC (guarded), memory, the
//!   executor's work layout, the device calls' tuning.
//! - [`transport`]: slot FIFOs between ranks, in `/dev/shm`, process memory, over TCP
//!   and RDMA, and on GPUs, with a futex doorbell per rank and peer liveness.
//! - `fault` (cargo feature `fault-injection`, for the failure-model tests): a rank that
//!   kills or stops itself at a chosen kind of plan step.
//! - [`engine`]: executes a plan over the FIFOs with the kernels, in the caller's thread,
//!   and on the GPU ([`engine::device`]).
//! - [`comm`]: the NCCL-shaped [`Communicator`].
//! - [`launch`]: starting and supervising a node's ranks (`ferrorun`, perf tools' `-np`).
//! - [`pg`] (`ProcessGroup`, `DeviceMesh`) and `capi` (the C ABI, feature `capi`).
//! - [`ddp`]: the gradient reducer and sampler of data-parallel training.
//! - [`perf`]: the nccl-tests-compatible bus-bandwidth tools (`all_reduce_perf`, …).
//! - [`viz`]: the visualizer and simulator of plans.
//!
//! # Example: an all-reduce on four ranks (threads)
//!
//! ```
//! use ferroccl::{Communicator, ReduceOp};
//!
//! let comms = Communicator::init_all(4)?;
//! std::thread::scope(|s| {
//!     for comm in &comms {
//!         s.spawn(move || {
//!             let mut v = [comm.rank() as f64; 3];
//!             comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
//!             assert_eq!(v, [6.0; 3]); // 0 + 1 + 2 + 3
//!         });
//!     }
//! });
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Example: four ranks as threads find each other
//!
//! ```
//! use std::sync::Arc;
//! use ferroccl::bootstrap::{Bootstrap, BootstrapOptions};
//! use ferroccl::store::{HashStore, Store};
//!
//! let store = HashStore::new();
//! let ranks: Vec<_> = (0..4)
//!     .map(|rank| {
//!         let store: Arc<dyn Store> = Arc::new(store.clone());
//!         std::thread::spawn(move || {
//!             let boot = Bootstrap::new(store, rank, 4, &BootstrapOptions::default())?;
//!             // Every rank contributes its rank number and receives everyone's.
//!             boot.all_gather(&[rank as u8])
//!         })
//!     })
//!     .collect();
//! for handle in ranks {
//!     assert_eq!(handle.join().unwrap()?, vec![vec![0], vec![1], vec![2], vec![3]]);
//! }
//! # Ok::<(), ferroccl::Error>(())
//! ```

#![warn(missing_docs)]

pub mod bootstrap;
#[cfg(feature = "capi")]
pub mod capi;
pub mod comm;
pub mod cuda;
pub mod ddp;
pub mod engine;
pub mod env;
pub mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod launch;
pub mod perf;
pub mod pg;
pub mod plan;
pub mod reduce;
pub mod store;
pub mod topo;
pub mod trace;
pub mod transport;
pub mod tune;
pub mod types;
pub mod viz;

pub use comm::Communicator;
pub use error::{Error, Result};
/// The `half` crate, whose `f16` and `bf16` are ferroccl's 16-bit float elements.
pub use half;
pub use types::{DataType, Element, F8E4M3, F8E5M2, ReduceOp, Scalar};

/// Locks `m`, taking the data of a poisoned mutex: the panic that poisoned it has
/// already been reported, and ferroccl's shared state stays consistent between
/// statements.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
