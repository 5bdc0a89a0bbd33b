//! Single copy: a receiver reads the sender's buffer itself, so a large message crosses
//! memory once instead of twice (into a FIFO slot, then out of it).
//!
//! With the [`Protocol::SingleCopy`](crate::plan::Protocol::SingleCopy) protocol a
//! message between two ranks of a host is not its bytes but a [`Descriptor`] in one
//! slot of the Simple FIFO: where the sender's region starts and how long it is. The
//! receiver reads the region in place when it can: between threads of one process, and
//! between processes when the region lies in a window the receiver mapped
//! ([`super::window`]). Otherwise it copies it with Linux cross-memory attach
//! (`process_vm_readv`), straight into its destination, or, when it reduces, in pieces
//! into a staging buffer small enough to stay in its cache, which the reduction then
//! reads. Releasing the slot is the
//! receiver's "done": the sender may not write the region, nor return from the call,
//! before the FIFO's `tail` has passed the descriptor (the engine keeps the posted
//! regions until then). This is what MPI libraries call a rendezvous with a single copy
//! (Open MPI's `vader` with CMA, MPICH's `nemesis` LMT).
//!
//! The two-shot all-reduce also writes by reference: a rank that sends its input's
//! piece to the piece's owner names in the same descriptor where its own result for
//! that piece goes ([`Descriptor::back`]), and an owner that can write there (a window
//! of another process that it mapped: [`PeerMemory::writable`]) streams the folded
//! piece into that output while it stores its own, then tells the peer with
//! [`WRITTEN`] instead of having it read the piece back: each rank reads every byte of
//! its piece once and writes every rank's copy of it once, one pass over memory fewer
//! than reading the result back.
//!
//! Whether the kernel lets ranks read each other is found at initialisation
//! (`agree`): every rank publishes its process id and the address of a known word,
//! reads every local peer's word, and all ranks share their verdicts; one refusal (Yama
//! `ptrace_scope`, a seccomp filter, ranks of different users) or one peer reached over
//! the network turns single copy off for the whole communicator, with the reason at
//! `FERROCCL_DEBUG=INFO`, and calls keep the FIFOs.

use std::sync::atomic::{AtomicU64, Ordering};

use super::routes::{Path, Routes};
use super::window::PeerWindow;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::store::wire::{Cursor, Writer};

/// The word every rank's peers read at initialisation to see whether they may.
static PROBE_WORD: AtomicU64 = AtomicU64::new(0);
/// What it holds (written before it is published).
const PROBE_MAGIC: u64 = u64::from_le_bytes(*b"FCCLREAD");

/// Bytes of the staging buffer a reduction reads a peer's region into, piece by piece:
/// small enough to stay in a core's L2 cache beside the other operands.
pub const STAGING_BYTES: usize = 256 * 1024;

/// Bytes of a [`Descriptor`] in a slot.
pub const DESCRIPTOR_BYTES: usize = 32;

/// Flag: the region is the sender's own contribution, which still needs the op's
/// pre-operation (the sender does not apply it when it only publishes its input).
pub const NEEDS_PRE: u64 = 1;

/// Flag: the sender has already written the region into the receiver's destination
/// (through [`Descriptor::back`] of the receiver's own descriptor): the receiver reads
/// nothing and releases the slot, which is its "done".
pub const WRITTEN: u64 = 2;

/// A message by reference: `bytes` bytes at `addr` in the sender's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Where the region starts, in the sender's memory.
    pub addr: u64,
    /// Its length.
    pub bytes: u64,
    /// [`NEEDS_PRE`], [`WRITTEN`] or 0.
    pub flags: u64,
    /// Where, in the sender's memory, the result made of this region goes (the sender's
    /// output at the same place, `bytes` long), for a receiver that folds it and may
    /// write there itself; 0 when the receiver may not.
    pub back: u64,
}

impl Descriptor {
    /// Writes the descriptor into a slot.
    ///
    /// # Safety
    /// `slot` must be writable for [`DESCRIPTOR_BYTES`] bytes.
    pub unsafe fn write(&self, slot: *mut u8) {
        let words = [self.addr, self.bytes, self.flags, self.back];
        // SAFETY: the caller provides DESCRIPTOR_BYTES writable bytes; unaligned
        // writes need no alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), slot, DESCRIPTOR_BYTES)
        };
    }

    /// Reads a descriptor from a slot of `len` bytes.
    ///
    /// # Safety
    /// `slot` must be readable for `len` bytes.
    pub unsafe fn read(slot: *const u8, len: usize) -> Option<Self> {
        if len != DESCRIPTOR_BYTES {
            return None;
        }
        let mut words = [0u64; 4];
        // SAFETY: `len` readable bytes, checked to be DESCRIPTOR_BYTES.
        unsafe {
            std::ptr::copy_nonoverlapping(slot, words.as_mut_ptr().cast::<u8>(), DESCRIPTOR_BYTES)
        };
        Some(Descriptor {
            addr: words[0],
            bytes: words[1],
            flags: words[2],
            back: words[3],
        })
    }
}

/// How this rank reads its peers' memory.
#[derive(Debug)]
pub struct PeerMemory {
    /// Each rank's process id (equal to this rank's: a thread of this process).
    pids: Vec<u32>,
    own_pid: u32,
    /// Each rank's windows this rank has mapped (none for threads of this process).
    windows: Vec<Vec<PeerWindow>>,
}

impl PeerMemory {
    /// Whether every rank is a thread of this process (the same on every rank).
    pub fn all_in_process(&self) -> bool {
        self.pids.iter().all(|&p| p == self.own_pid)
    }

    /// `addr` in rank `peer`'s memory as a pointer this rank may read through, when
    /// `peer` is a thread of this process (no copy needed); `None` for another process.
    pub fn in_process(&self, peer: usize, addr: u64) -> Option<*const u8> {
        (self.pids[peer] == self.own_pid).then_some(addr as *const u8)
    }

    /// `len` bytes at `addr` in rank `peer`'s memory as a pointer this rank may read
    /// through: when `peer` is a thread of this process, or when the bytes lie in one of
    /// its windows this rank has mapped; `None` when only [`PeerMemory::read`] reaches
    /// them.
    pub fn direct(&self, peer: usize, addr: u64, len: usize) -> Option<*const u8> {
        self.in_process(peer, addr)
            .or_else(|| self.windows[peer].iter().find_map(|w| w.lookup(addr, len)))
    }

    /// `len` bytes at `addr` in rank `peer`'s memory as a pointer this rank may write
    /// through: only inside a window of another process that this rank has mapped, whose
    /// pages this rank's own mapping keeps alive whatever the peer does (a peer that
    /// leaves a failed call early may free its other memory while this rank still
    /// writes, and a thread of this process has no mapping of its own: its peers read
    /// their results themselves); `None` otherwise.
    pub fn writable(&self, peer: usize, addr: u64, len: usize) -> Option<*mut u8> {
        if !self.in_other_process(peer) {
            return None;
        }
        self.windows[peer]
            .iter()
            .find_map(|w| w.lookup_mut(addr, len))
    }

    /// Whether rank `peer` is another process (whose windows this rank maps), not a
    /// thread of this one.
    pub(crate) fn in_other_process(&self, peer: usize) -> bool {
        self.pids[peer] != self.own_pid
    }

    /// Adds peers' mappings of a window: (peer, its mapped window) pairs.
    pub(crate) fn add_window(&mut self, mapped: Vec<(usize, PeerWindow)>) {
        for (peer, window) in mapped {
            self.windows[peer].push(window);
        }
    }

    /// Drops every peer's mapping of the window `id`.
    pub(crate) fn remove_window(&mut self, id: u64) {
        for list in &mut self.windows {
            list.retain(|w| w.id != id);
        }
    }

    /// Copies `len` bytes at `addr` in rank `peer`'s memory to `dst`; on failure, what
    /// happened (for [`CallInfo::peer_failed`](crate::error::CallInfo::peer_failed)).
    ///
    /// Reads through [`PeerMemory::direct`]'s pointer when there is one, else with
    /// `process_vm_readv`.
    ///
    /// # Safety
    /// `dst` must be writable for `len` bytes; when `peer` is a thread of this process,
    /// `addr` must be readable for `len` bytes and not overlap `dst` (the sender's
    /// region, which it keeps until the receiver releases the descriptor).
    pub unsafe fn read(
        &self,
        peer: usize,
        addr: u64,
        dst: *mut u8,
        len: usize,
    ) -> std::result::Result<(), String> {
        if let Some(src) = self.direct(peer, addr, len) {
            // SAFETY: `dst` by this function's contract; `src` is a thread's region (the
            // contract) or `len` bytes inside this rank's mapping of a peer's window
            // (`direct` checked the bounds), which no caller's buffer lies in.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            return Ok(());
        }
        let pid = self.pids[peer];
        let mut done = 0usize;
        while done < len {
            let local = libc::iovec {
                // SAFETY: within the `len` writable bytes at `dst`.
                iov_base: unsafe { dst.add(done) }.cast(),
                iov_len: len - done,
            };
            let remote = libc::iovec {
                iov_base: (addr as usize + done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // SAFETY: the local iovec covers memory this rank may write (contract); the
            // kernel checks the remote one against the peer's mappings and fails
            // (EFAULT) rather than touch anything else.
            let got =
                unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
            if got <= 0 {
                let err = if got == 0 {
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof)
                } else {
                    std::io::Error::last_os_error()
                };
                return Err(format!(
                    "rank {peer} failed while this rank read its buffer ({len} bytes at \
                     {addr:#x}, {done} read; process_vm_readv of pid {pid}: {err}): its \
                     process is gone, or it left the call"
                ));
            }
            done += got as usize;
        }
        Ok(())
    }
}

/// Finds, with every rank (collective), whether ranks may read each other's memory:
/// `Ok(Ok(reader))` when every pair of ranks is on one host and every rank could read
/// every peer, `Ok(Err(why))` otherwise (the first refusal, named).
pub(super) fn agree(
    boot: &Bootstrap,
    routes: &Routes,
) -> Result<std::result::Result<PeerMemory, String>> {
    let (rank, nranks) = (routes.rank, routes.nranks);
    let own_pid = std::process::id();
    PROBE_WORD.store(PROBE_MAGIC, Ordering::Release);
    let mut hello = Writer::default();
    hello.u32(own_pid).u64(PROBE_WORD.as_ptr() as u64);
    let all = boot.all_gather(hello.as_slice())?;
    let mut pids = Vec::with_capacity(nranks);
    let mut words = Vec::with_capacity(nranks);
    for (r, bytes) in all.iter().enumerate() {
        let mut c = Cursor::new(bytes);
        let (Ok(pid), Ok(word), true) = (c.u32(), c.u64(), c.is_empty()) else {
            return Err(Error::BootstrapData {
                rank: r,
                detail: format!("single-copy probe of {} bytes, not 12", bytes.len()),
            });
        };
        pids.push(pid);
        words.push(word);
    }
    let reader = PeerMemory {
        windows: pids.iter().map(|_| Vec::new()).collect(),
        pids,
        own_pid,
    };
    let verdict = (0..nranks)
        .filter(|&p| p != rank)
        .find_map(|p| probe(&reader, routes, p, words[p]).err())
        .unwrap_or_default();
    // Every rank must decide alike (the protocol is chosen per call from the same
    // facts on every rank): the verdicts go round, and the first refusal counts.
    let verdicts = boot.all_gather(verdict.as_bytes())?;
    // Past this all-gather every peer has read this rank's word.
    match verdicts.iter().enumerate().find(|(_, v)| !v.is_empty()) {
        None => Ok(Ok(reader)),
        Some((r, why)) => Ok(Err(format!("rank {r}: {}", String::from_utf8_lossy(why)))),
    }
}

/// Whether this rank may read `peer`'s memory: reads its probe word at `word`.
fn probe(
    reader: &PeerMemory,
    routes: &Routes,
    peer: usize,
    word: u64,
) -> std::result::Result<(), String> {
    match routes.to(peer) {
        Path::Shm | Path::InProcess => {}
        other => return Err(format!("rank {peer} is reached over {other:?}, not memory")),
    }
    let mut got = 0u64;
    // SAFETY: `got` is 8 writable bytes; a peer in this process published the address
    // of its static probe word, readable for the program's life.
    let read = unsafe { reader.read(peer, word, (&raw mut got).cast(), 8) };
    match read {
        Ok(()) if got == PROBE_MAGIC => Ok(()),
        Ok(()) => Err(format!(
            "reading rank {peer}'s memory gave {got:#x}, not its probe word"
        )),
        Err(reason) => Err(format!(
            "the kernel refuses reading rank {peer}'s memory (Yama ptrace_scope, a seccomp \
             filter or another user?): {reason}"
        )),
    }
}
