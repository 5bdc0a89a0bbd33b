//! `ferroccl._ferroccl`: ferroccl's Rust core as a Python extension module.
//!
//! One file per role:
//! - `communicator.rs`: `Communicator`, the NCCL-shaped API (`ncclCommInitRank`,
//!   collectives, send/recv, groups, split, abort) on buffers Python lends: numpy
//!   arrays, anything with the buffer protocol, torch tensors, CUDA Array Interface
//!   objects. Calls block, in the caller's thread, with the GIL released.
//! - `process_group.rs`: `ProcessGroup`, the `pg` layer (flight recorder, watchdog,
//!   desync check) with torch's backend methods, each returning a `Work` (`work.rs`);
//!   `ferroccl.torch` wraps it as a `torch.distributed` backend.
//! - `window.rs`: `SharedMemory` (`ncclMemAlloc` on the host) and the `Window` that
//!   `Communicator.register_window` makes of it (`ncclCommWindowRegister`).
//! - `unique_id.rs`: `UniqueId` (`ncclUniqueId`); `store.rs`: Python stores as
//!   ferroccl's; `buffers.rs`: the memory Python lends, its dtypes; `calls.rs`: ops and
//!   the calls built from Python arguments; `errors.rs`: the exception types.
//!
//! The binding decides nothing itself beyond turning Python objects into ferroccl's
//! calls; algorithms, protocols, transports and errors are the core's.

#![warn(missing_docs)]

mod buffers;
mod calls;
mod communicator;
mod errors;
mod process_group;
mod store;
mod unique_id;
mod window;
mod work;

use pyo3::prelude::*;

use communicator::Communicator;
use process_group::ProcessGroup;
use unique_id::UniqueId;
use window::{SharedMemory, Window};
use work::Work;

/// The extension module.
#[pymodule]
fn _ferroccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<UniqueId>()?;
    m.add_class::<Communicator>()?;
    m.add_class::<ProcessGroup>()?;
    m.add_class::<Work>()?;
    m.add_class::<SharedMemory>()?;
    m.add_class::<Window>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
