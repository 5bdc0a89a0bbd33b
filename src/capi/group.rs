//! `ncclGroupStart` / `ncclGroupEnd`.
//!
//! Each thread has its own group state (as in NCCL). Inside a group, inits and calls are
//! queued; when the outermost group ends, the queued inits run (all at once, so one
//! thread can create several ranks of a communicator), then each communicator's calls
//! run as one fused plan (so sends and receives between two ranks cannot wait on each
//! other). Calls on several communicators (one thread driving several ranks) run in
//! parallel threads, one per communicator, and the group ends when all have finished.
//! A call that fails its checks inside a group fails the whole group: `ncclGroupEnd`
//! runs nothing and returns that error. Calls on device memory of one communicator are
//! enqueued as one launch on their stream (they must name the same stream, and a group
//! may not mix them with host-memory calls of the same communicator).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Arc;

use super::handle::CommHandle;
use super::{Failure, SUCCESS};
use crate::comm::{Communicator, RawCall};

/// A queued initialisation.
pub type Init = Box<dyn FnOnce() -> crate::Result<Communicator> + Send>;

#[derive(Default)]
struct GroupState {
    depth: usize,
    inits: Vec<(Arc<CommHandle>, Init)>,
    calls: Vec<(Arc<CommHandle>, RawCall, Option<DeviceCall>)>,
    failed: Option<Failure>,
}

thread_local! {
    static GROUP: RefCell<GroupState> = RefCell::new(GroupState::default());
}

/// Whether this thread is inside a group.
pub fn in_group() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Opens a (possibly nested) group.
pub fn start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Queues an initialisation for the end of the group.
pub fn queue_init(handle: Arc<CommHandle>, init: Init) {
    GROUP.with(|g| g.borrow_mut().inits.push((handle, init)));
}

/// A CUDA stream handle, as an address.
pub type Stream = usize;

/// What a call on device memory carries besides its buffers: its stream, and the CUDA
/// context it was issued in (made current where the group runs it).
pub type DeviceCall = (Stream, crate::cuda::Context);

/// Queues a call if this thread is inside a group; returns whether it did. `device`:
/// `Some` for a call on device memory.
pub fn queue_call(handle: &Arc<CommHandle>, call: RawCall, device: Option<DeviceCall>) -> bool {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return false;
        }
        g.calls.push((handle.clone(), call, device));
        true
    })
}

/// Records a failed call inside a group: the group will fail with it.
pub fn fail(failure: &Failure) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.failed.is_none() {
            g.failed = Some(failure.clone());
        }
    });
}

/// Calls of one communicator (with their streams, for device calls), moved to the
/// thread that runs them.
struct CommCalls(Arc<CommHandle>, Vec<RawCall>, Vec<Option<DeviceCall>>);

// SAFETY: the raw buffers in the calls belong to the application, which keeps them valid
// until ncclGroupEnd returns; `end` joins every thread before returning.
unsafe impl Send for CommCalls {}

impl CommCalls {
    fn run(self) -> Result<(), Failure> {
        let comm = self.0.communicator()?;
        let streams: Vec<DeviceCall> = self.2.iter().flatten().copied().collect();
        if streams.is_empty() {
            // SAFETY: the application's buffers, valid until ncclGroupEnd returns (NCCL's
            // contract for grouped calls); they were checked when queued.
            return unsafe { comm.group_raw(&self.1) }.map_err(|e| Failure::from_error(&e));
        }
        if streams.len() != self.1.len() || streams.iter().any(|&s| s != streams[0]) {
            return Err(Failure::new(
                super::INVALID_USAGE,
                "a group's calls on one communicator run as one launch: they must all be \
                 on device memory and name the same stream (in one CUDA context)",
            ));
        }
        let (stream, ctx) = streams[0];
        // This thread runs the group for the caller's thread: in the caller's context.
        let _current = ctx.push().map_err(|e| Failure::from_error(&e))?;
        // SAFETY: the application's device buffers, valid until the stream passes the
        // group (NCCL's contract); the stream is the application's.
        unsafe { comm.enqueue_device(&self.1, stream as *mut std::ffi::c_void) }
            .map_err(|e| Failure::from_error(&e))
    }
}

/// Runs an initialisation, turning a panic into an error so that its handle never
/// stays "initialising".
pub fn run_init(init: Init) -> crate::Result<Communicator> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(init)).unwrap_or_else(|_| {
        Err(crate::Error::invalid(
            "internal error: the communicator's initialisation panicked",
        ))
    })
}

/// Closes a group; the outermost runs what was queued.
pub fn end() -> Result<c_int, Failure> {
    let state = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Failure::new(
                super::INVALID_USAGE,
                "ncclGroupEnd without a matching ncclGroupStart",
            ));
        }
        g.depth -= 1;
        Ok((g.depth == 0).then(|| std::mem::take(&mut *g)))
    })?;
    let Some(state) = state else {
        return Ok(SUCCESS);
    };
    if let Some(failed) = state.failed {
        for (handle, _) in &state.inits {
            handle.finish_init(Err(crate::Error::invalid(format!(
                "the group it was created in failed: {}",
                failed.message
            ))));
        }
        return Err(failed);
    }
    let mut first_error: Option<Failure> = None;
    // Inits: all at once, since they wait for each other when they are ranks of one
    // communicator.
    std::thread::scope(|s| {
        let running: Vec<_> = state
            .inits
            .into_iter()
            .map(|(handle, init)| {
                s.spawn(move || {
                    let outcome = run_init(init);
                    let failure = outcome.as_ref().err().map(Failure::from_error);
                    handle.finish_init(outcome);
                    failure
                })
            })
            .collect();
        for r in running {
            if let Ok(Some(f)) = r.join() {
                first_error.get_or_insert(f);
            }
        }
    });
    // Calls, in order per communicator.
    let mut order: Vec<*const CommHandle> = Vec::new();
    let mut by_comm: HashMap<*const CommHandle, CommCalls> = HashMap::new();
    for (handle, call, device) in state.calls {
        let key = Arc::as_ptr(&handle);
        let calls = by_comm.entry(key).or_insert_with(|| {
            order.push(key);
            CommCalls(handle, Vec::new(), Vec::new())
        });
        calls.1.push(call);
        calls.2.push(device);
    }
    let mut jobs: Vec<CommCalls> = order.iter().filter_map(|k| by_comm.remove(k)).collect();
    let results: Vec<Result<(), Failure>> = if jobs.len() == 1 {
        vec![jobs.pop().expect("one job").run()]
    } else {
        std::thread::scope(|s| {
            let running: Vec<_> = jobs.into_iter().map(|j| s.spawn(move || j.run())).collect();
            running
                .into_iter()
                .map(|r| {
                    r.join().unwrap_or_else(|_| {
                        Err(Failure::new(
                            super::INTERNAL_ERROR,
                            "a group thread panicked",
                        ))
                    })
                })
                .collect()
        })
    };
    for r in results {
        if let Err(e) = r {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(SUCCESS),
    }
}
