//! Windows on a communicator (`ncclCommWindowRegister`): buffers in [`SharedMemory`]
//! that every rank of another process on the host maps once, so that single-copy calls
//! read them in place ([`crate::transport::window`]).
//!
//! Registration is collective, so every rank knows at every call how many windows are
//! live, and plans host calls with the same cost model: while any is, ranks of other
//! processes are priced as threads (a read in place, [`CostModel::local_in_place`]),
//! so large calls take single copy. Whether a call's buffers lie in windows is each
//! rank's own business: a region outside them is read with `process_vm_readv`, slower
//! but correct, as NCCL's symmetric kernels expect their users to pass window memory.
//!
//! [`SharedMemory`]: crate::transport::window::SharedMemory
//! [`CostModel::local_in_place`]: crate::tune::CostModel::local_in_place

use super::Communicator;
use crate::error::{Error, Result};
use crate::transport::window::{self, PeerWindow, Published, Window};

impl Communicator {
    /// Registers `len` bytes at `addr` as a window (`ncclCommWindowRegister`):
    /// collective, in call order, like the collectives. The bytes must lie in one
    /// [`SharedMemory`](crate::transport::window::SharedMemory) allocation (from it, or
    /// from `ncclMemAlloc` without a CUDA context); sizes may differ across ranks. Fails
    /// on every rank, naming the rank, when any rank's bytes are not such memory or a
    /// rank could not map a peer's.
    ///
    /// # Safety
    /// Until [`Communicator::deregister_window`], calls may pass these bytes to peers
    /// that read them; the window keeps the allocation mapped, but its owner must not
    /// hand the bytes to other uses while calls run (as with any call's buffers).
    pub unsafe fn register_window(&self, addr: *mut u8, len: usize) -> Result<Window> {
        self.turns
            .run_blocking(|| self.register_window_in_turn(Ok((addr as usize, len))))
    }

    /// Takes this rank's part in a window registration it cannot make, because of `why`
    /// (say, a binding could not lend the buffer it was given): collective, in call order,
    /// like [`Communicator::register_window`], so the other ranks do not wait for it, and
    /// every rank fails naming this rank and `why`.
    pub fn refuse_window(&self, why: &str) -> Error {
        match self
            .turns
            .run_blocking(|| self.register_window_in_turn(Err(why)))
        {
            Err(e) => e,
            Ok(_) => unreachable!("a refused registration fails on every rank"),
        }
    }

    /// A registration of the bytes `target` gives, or one this rank refuses for its
    /// reason; either way every rank takes part.
    fn register_window_in_turn(
        &self,
        target: std::result::Result<(usize, usize), &str>,
    ) -> Result<Window> {
        let found = target.ok().and_then(|(addr, len)| window::find(addr, len));
        let mine = found.as_ref().map_or_else(Vec::new, |(_, p)| p.to_bytes());
        let all = self.boot.all_gather(&mine)?;
        let mut st = self.lock();
        let id = st.windows_made;
        st.windows_made += 1;
        let mut mapped = Vec::new();
        let mut verdict = String::new();
        if let Err(why) = target {
            verdict = why.to_string();
        } else if let (Ok((addr, len)), None) = (target, &found) {
            verdict = format!(
                "the window's {len} bytes at {addr:#x} are not in one allocation of shared \
                 memory (ncclMemAlloc on the host, or ferroccl's SharedMemory)"
            );
        } else if let Ok(memory) = st.conns.peer_memory() {
            for (peer, bytes) in all.iter().enumerate() {
                if peer == self.rank || !memory.in_other_process(peer) {
                    continue;
                }
                // A peer without a window has its own verdict, sent below.
                let Some(published) = Published::from_bytes(bytes) else {
                    continue;
                };
                match PeerWindow::map(id, peer, &published) {
                    Ok(w) => mapped.push((peer, w)),
                    Err(why) => {
                        verdict = why;
                        break;
                    }
                }
            }
        }
        // Every rank decides alike: the first failure, on every rank.
        let verdicts = self.boot.all_gather(verdict.as_bytes())?;
        if let Some((r, why)) = verdicts.iter().enumerate().find(|(_, v)| !v.is_empty()) {
            return Err(Error::invalid(format!(
                "registering a window: rank {r}: {}",
                String::from_utf8_lossy(why)
            )));
        }
        if let Some(memory) = st.conns.peer_memory_mut() {
            memory.add_window(mapped);
        }
        let (allocation, _) = found.expect("a window was found above, or the call failed");
        let (addr, len) = target.expect("a refusal failed the call above");
        let window = Window::new(id, allocation);
        st.windows.insert(window.token, id);
        // Plans made without windows may not be the plans with them.
        st.host_plans.clear();
        tracing::info!(
            "rank {}: window {id} of {len} bytes at {addr:#x} registered",
            self.rank
        );
        Ok(window)
    }

    /// Ends a window made by [`Communicator::register_window`]
    /// (`ncclCommWindowDeregister`): collective, in call order. Peers unmap it; its
    /// memory is freed once its [`SharedMemory`](crate::transport::window::SharedMemory)
    /// is dropped too.
    pub fn deregister_window(&self, window: Window) -> Result<()> {
        self.turns.run_blocking(|| {
            let mut st = self.lock();
            let Some(id) = st.windows.remove(&window.token) else {
                return Err(Error::invalid(format!(
                    "{window:?} is not a live window of this communicator"
                )));
            };
            if let Some(memory) = st.conns.peer_memory_mut() {
                memory.remove_window(id);
            }
            st.host_plans.clear();
            Ok(())
        })
    }
}
