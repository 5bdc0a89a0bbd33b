//! Windows: host memory that the other processes of a host map, so that a single-copy
//! receiver reads a peer's buffer in place instead of copying it out with
//! `process_vm_readv` (NCCL's `ncclMemAlloc` + `ncclCommWindowRegister`).
//!
//! [`SharedMemory`] is a `memfd` mapped by its owner, sealed against shrinking so that a
//! peer's mapping can never fault on a truncated file. It is listed in a process-wide
//! table by address. Registering a window on a communicator (collective) publishes, for
//! the allocation holding it, the owner's process id, the descriptor of its `memfd` and
//! where it lies; every rank of another process opens `/proc/<pid>/fd/<fd>` (which needs
//! ptrace *read* access, which Yama's `ptrace_scope` 1 grants, unlike the attach access of
//! `process_vm_readv`) and maps it once, readable and writable (as NCCL's symmetric
//! windows are). From then on a descriptor whose region lies in a mapped window is read
//! through the mapping ([`PeerMemory::direct`](super::single_copy::PeerMemory::direct)),
//! and the two-shot all-reduce writes a peer's result there
//! ([`PeerMemory::writable`](super::single_copy::PeerMemory::writable)); any other region
//! is still read with `process_vm_readv`, so a call on buffers outside windows is slower,
//! never wrong.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::error::{Error, Result};
use crate::store::wire::{Cursor, Writer};

/// Host memory that other processes can map: a sealed `memfd`, mapped read-write here,
/// zeroed, page-aligned. Freed (unmapped, closed) when this value and every [`Window`]
/// made of it are dropped.
pub struct SharedMemory {
    allocation: Arc<Allocation>,
}

/// The mapping and file behind a [`SharedMemory`].
pub(crate) struct Allocation {
    ptr: NonNull<u8>,
    len: usize,
    file: File,
    _map: memmap2::MmapRaw,
}

// SAFETY: the allocation is a pointer to memory shared on purpose: its owner reads and
// writes it through `SharedMemory`'s borrows, and communicators pass it to peers only for
// the span of a call that borrows it.
unsafe impl Send for Allocation {}
// SAFETY: as above; `&Allocation` exposes only the address, length and file.
unsafe impl Sync for Allocation {}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("ptr", &self.allocation.ptr)
            .field("len", &self.allocation.len)
            .finish()
    }
}

/// Live allocations of this process by base address (weak: the table does not keep
/// memory alive).
fn table() -> &'static Mutex<BTreeMap<usize, Weak<Allocation>>> {
    static TABLE: OnceLock<Mutex<BTreeMap<usize, Weak<Allocation>>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

impl SharedMemory {
    /// `bytes` zeroed bytes of shared memory (at least one page is mapped).
    pub fn new(bytes: usize) -> Result<Self> {
        let io = |what: &str| {
            Error::io(
                format!("shared memory of {bytes} bytes: {what}"),
                std::io::Error::last_os_error(),
            )
        };
        // SAFETY: a NUL-terminated name and valid flags; the kernel returns a new fd.
        let fd = unsafe {
            libc::memfd_create(
                c"ferroccl-window".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io("memfd_create"));
        }
        // SAFETY: `fd` was just returned to this process and is owned by nobody else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let len = bytes.max(1);
        file.set_len(len as u64)
            .map_err(|e| Error::io(format!("shared memory of {bytes} bytes: ftruncate"), e))?;
        // A peer's mapping faults (SIGBUS) past the end of the file: it may never shrink.
        // SAFETY: fcntl on an fd this process owns.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(io("sealing against shrinking"));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| Error::io(format!("shared memory of {bytes} bytes: mmap"), e))?;
        let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap returns a non-null address");
        let allocation = Arc::new(Allocation {
            ptr,
            len,
            file,
            _map: map,
        });
        let mut table = crate::lock(table());
        table.retain(|_, a| a.strong_count() > 0);
        table.insert(ptr.as_ptr() as usize, Arc::downgrade(&allocation));
        Ok(SharedMemory { allocation })
    }

    /// Where the memory starts.
    pub fn as_ptr(&self) -> *mut u8 {
        self.allocation.ptr.as_ptr()
    }

    /// Its length in bytes (as asked; at least 1).
    pub fn len(&self) -> usize {
        self.allocation.len
    }

    /// Whether it is empty (never: at least one byte is mapped).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memory as bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` mapped bytes, alive while `self` is; peers only read them.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// The memory as bytes, to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed exclusively through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let mut table = crate::lock(table());
        let base = self.ptr.as_ptr() as usize;
        if table.get(&base).is_some_and(|a| a.strong_count() == 0) {
            table.remove(&base);
        }
    }
}

/// What a rank publishes about the allocation its window lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Published {
    pub pid: u32,
    pub fd: i32,
    pub base: u64,
    pub len: u64,
}

impl Published {
    pub fn to_bytes(self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.pid).i32(self.fd).u64(self.base).u64(self.len);
        w.into_vec()
    }

    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let mut c = Cursor::new(b);
        let published = Published {
            pid: c.u32().ok()?,
            fd: c.i32().ok()?,
            base: c.u64().ok()?,
            len: c.u64().ok()?,
        };
        c.is_empty().then_some(published)
    }
}

/// The [`SharedMemory`] allocation of this process holding `len` bytes at `addr`, if
/// one does, and what peers need to map it.
pub(crate) fn find(addr: usize, len: usize) -> Option<(Arc<Allocation>, Published)> {
    let table = crate::lock(table());
    let (_, weak) = table.range(..=addr).next_back()?;
    let allocation = weak.upgrade()?;
    let base = allocation.ptr.as_ptr() as usize;
    (addr + len <= base + allocation.len).then(|| {
        let published = Published {
            pid: std::process::id(),
            fd: allocation.file.as_raw_fd(),
            base: base as u64,
            len: allocation.len as u64,
        };
        (allocation, published)
    })
}

/// A window registered on a communicator
/// ([`Communicator::register_window`](crate::Communicator::register_window)): keeps its
/// memory alive until it is deregistered.
pub struct Window {
    /// Unique in this process: which communicator's window this is.
    pub(crate) token: u64,
    /// The same on every rank (the communicator's count of registrations).
    pub(crate) id: u64,
    pub(crate) _memory: Arc<Allocation>,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window").field("id", &self.id).finish()
    }
}

impl Window {
    /// A window of `memory` with the communicator's number `id`.
    pub(crate) fn new(id: u64, memory: Arc<Allocation>) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let token = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Window {
            token,
            id,
            _memory: memory,
        }
    }
}

/// A peer's window, mapped into this process.
#[derive(Debug)]
pub(crate) struct PeerWindow {
    /// The communicator's number of the window.
    pub id: u64,
    /// Where the allocation lies in the peer's memory.
    pub remote_base: u64,
    pub len: usize,
    map: memmap2::MmapRaw,
}

impl PeerWindow {
    /// Maps the allocation `peer` (rank `rank`) published.
    pub fn map(id: u64, rank: usize, peer: &Published) -> std::result::Result<Self, String> {
        let path = format!("/proc/{}/fd/{}", peer.pid, peer.fd);
        let file = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                format!(
                    "opening rank {rank}'s window memory {path}: {e} (ptrace read access denied?)"
                )
            })?;
        let len = usize::try_from(peer.len).map_err(|_| format!("{} bytes", peer.len))?;
        let on_disk = file.metadata().map(|m| m.len()).unwrap_or(0);
        if on_disk < peer.len {
            return Err(format!(
                "rank {rank}'s window memory {path} holds {on_disk} bytes, not {}",
                peer.len
            ));
        }
        // A raw mapping (no references are made to its bytes): a shared mapping of a
        // memfd sealed against shrinking, so no access within `len` can fault. Its bytes
        // are read only between the peer's publishing a region and this rank's releasing
        // it, and written only where the peer named its own result (`lookup_mut`).
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| format!("mapping rank {rank}'s window memory {path}: {e}"))?;
        Ok(PeerWindow {
            id,
            remote_base: peer.base,
            len,
            map,
        })
    }

    /// `len` bytes at `addr` in the peer's memory, through this mapping, if they lie in it.
    pub fn lookup(&self, addr: u64, len: usize) -> Option<*const u8> {
        self.lookup_mut(addr, len).map(|p| p.cast_const())
    }

    /// As [`PeerWindow::lookup`], to write through.
    pub fn lookup_mut(&self, addr: u64, len: usize) -> Option<*mut u8> {
        let offset = usize::try_from(addr.checked_sub(self.remote_base)?).ok()?;
        (offset.checked_add(len)? <= self.len).then(|| self.map.as_mut_ptr().wrapping_add(offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_is_zeroed_found_by_address_and_forgotten_when_freed() {
        let mut mem = SharedMemory::new(10_000).unwrap();
        assert!(mem.as_slice().iter().all(|&b| b == 0));
        mem.as_mut_slice()[9_999] = 7;
        let base = mem.as_ptr() as usize;
        let (found, published) = find(base + 100, 9_900).expect("inside the allocation");
        assert_eq!(found.ptr.as_ptr() as usize, base);
        assert_eq!((published.base, published.len), (base as u64, 10_000));
        let bytes = published.to_bytes();
        assert_eq!(bytes.len(), 24);
        assert_eq!(Published::from_bytes(&bytes), Some(published));
        // Anything but its own length is not a publication.
        assert_eq!(Published::from_bytes(&bytes[..23]), None);
        assert_eq!(
            Published::from_bytes(&[bytes.as_slice(), &[0]].concat()),
            None
        );
        assert!(find(base + 100, 9_901).is_none(), "one byte past its end");
        drop(found);
        drop(mem);
        assert!(find(base, 1).is_none(), "freed");
    }

    #[test]
    fn a_mapping_through_proc_shares_writes_both_ways_and_bounds_lookups() {
        let mut mem = SharedMemory::new(3 * 4096 + 5).unwrap();
        let (_, published) = find(mem.as_ptr() as usize, 1).unwrap();
        let peer = PeerWindow::map(3, 1, &published).unwrap();
        mem.as_mut_slice()[4096] = 42;
        let at = peer.lookup(published.base + 4096, 4096).unwrap();
        // SAFETY: inside the mapping (lookup checked the bounds).
        assert_eq!(unsafe { *at }, 42);
        // And the owner sees what is written through it (a two-shot's write-back).
        let into = peer.lookup_mut(published.base + 8192, 1).unwrap();
        // SAFETY: inside the mapping, writable; nothing else touches the byte.
        unsafe { *into = 7 };
        assert_eq!(mem.as_slice()[8192], 7);
        assert!(peer.lookup(published.base - 1, 1).is_none());
        assert!(peer.lookup(published.base + 3 * 4096, 6).is_none());
        assert!(peer.lookup(published.base + 3 * 4096, 5).is_some());
        let wrong = Published {
            fd: 9_999,
            ..published
        };
        let err = PeerWindow::map(3, 1, &wrong).unwrap_err();
        assert!(err.contains("rank 1") && err.contains("/fd/9999"), "{err}");
        // A peer claiming more bytes than its memory holds is refused, not mapped (a
        // read past the file's end would fault).
        let longer = Published {
            len: published.len + 1,
            ..published
        };
        let err = PeerWindow::map(3, 1, &longer).unwrap_err();
        assert!(
            err.contains("rank 1's window memory") && err.contains("holds 12293 bytes, not 12294"),
            "{err}"
        );
    }

    #[test]
    fn shared_memory_the_kernel_cannot_give_is_an_error_naming_the_size() {
        let err = SharedMemory::new(usize::MAX).unwrap_err().to_string();
        assert!(
            err.contains(&format!("shared memory of {} bytes: ftruncate", usize::MAX)),
            "{err}"
        );
    }
}
