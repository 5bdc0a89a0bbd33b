//! ferroccl: a collective communication library written from scratch in Rust.
//!
//! It does the job NCCL does for GPUs and Gloo does for CPUs: ranks find each other
//! through a [`store`] and the [`bootstrap`] rendezvous, then run collectives over their
//! own transports. See `README.md` for the status of each part and `DESIGN.md` (in the
//! project's shared folder) for the direction.
//!
//! Layers, bottom to top, one module each:
//! - [`error`]: the one structured [`Error`] enum.
//! - [`types`]: [`DataType`] and [`ReduceOp`] with NCCL's numbering.
//! - [`store`]: the control plane ([`store::TcpStore`], PyTorch-wire-compatible, and
//!   [`store::FileStore`], [`store::PrefixStore`], [`store::HashStore`]).
//! - [`bootstrap`]: [`bootstrap::UniqueId`], `env://` initialisation, peer-info
//!   all-gather and barrier.
//! - [`plan`]: pure schedules (ring, pipelined chain, direct) as step lists, and the
//!   in-memory simulator ([`plan::sim`]) that runs them exactly.
//! - [`reduce`]: host reduction kernels ([`reduce::Kernel`]) for every dtype × op.
//! - [`trace`]: logging through `tracing`, controlled by `FERROCCL_DEBUG`.
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
pub mod error;
pub mod plan;
pub mod reduce;
pub mod store;
pub mod trace;
pub mod types;

pub use error::{Error, Result};
pub use types::{DataType, Element, F8E4M3, F8E5M2, ReduceOp, Scalar};
