//! Shared memory segments: a file in `/dev/shm` mapped by several processes, or a block
//! of this process's memory shared by threads. Both are looked up by name, so the code
//! that sets up connections is the same for processes and for threads.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};

/// Where a segment's memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    /// A file under `/dev/shm`, mapped with `mmap` (ranks in different processes).
    Shm,
    /// Memory of this process, found through a process-wide table (ranks as threads).
    InProcess,
}

/// A mapped shared segment. The memory stays valid as long as the value lives.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    _backing: Backing,
}

// SAFETY: a Segment is a pointer to memory that is shared on purpose; every access to it
// goes through atomics or through the FIFO protocol, which hands each slot to one side
// at a time.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only exposes the base pointer and length.
unsafe impl Sync for Segment {}

enum Backing {
    Mapped(#[allow(dead_code)] memmap2::MmapMut),
    Heap(#[allow(dead_code)] Arc<HeapBlock>),
}

/// Page-aligned, zeroed process memory.
struct HeapBlock {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the block is plain memory shared between threads through the FIFO protocol.
unsafe impl Send for HeapBlock {}
// SAFETY: as above.
unsafe impl Sync for HeapBlock {}

impl HeapBlock {
    fn new(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::invalid(format!("segment of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::io(
                format!("allocate a segment of {len} bytes"),
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            )
        })?;
        Ok(HeapBlock { ptr, layout })
    }
}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// How the `/dev/shm` names of a job's bells and host FIFOs begin: with the pid of the
/// job's rank 0 (a random number per job follows it).
pub fn job_shm_prefix(rank0_pid: u32) -> String {
    format!("ferroccl-{rank0_pid}-")
}

/// How the `/dev/shm` names of the device FIFOs that process `pid` stages through host
/// memory begin (see [`cuda_ipc::staged_name`](super::cuda_ipc::staged_name)).
pub fn staged_shm_prefix(pid: u32) -> String {
    format!("ferroccl-cudafifo-{pid}-")
}

/// The entries of `/dev/shm` that the processes `pids` made: names that start with one
/// of their pids as [`job_shm_prefix`] or [`staged_shm_prefix`] put it.
pub fn shm_entries_of(pids: &[u32]) -> Vec<std::fs::DirEntry> {
    let prefixes: Vec<String> = pids
        .iter()
        .flat_map(|&p| [job_shm_prefix(p), staged_shm_prefix(p)])
        .collect();
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.filter_map(std::result::Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|name| prefixes.iter().any(|p| name.starts_with(p.as_str())))
        })
        .collect()
}

/// Removes what the processes `pids` left in `/dev/shm` and returns the names, for a
/// launcher once all of them are gone: a rank stopped by a signal between making its
/// segments and removing their names (they go once its peers have mapped them) cannot
/// remove them itself.
pub fn remove_shm_left_by(pids: &[u32]) -> Vec<String> {
    shm_entries_of(pids)
        .into_iter()
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Segments created in this process for threads, by name, until unlinked.
fn registry() -> &'static Mutex<HashMap<String, Arc<HeapBlock>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Arc<HeapBlock>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn shm_path(name: &str) -> PathBuf {
    PathBuf::from("/dev/shm").join(name)
}

/// Opens the shared-memory file at `path` to read and write; `create`: a new one (it
/// must not exist).
fn open_shm(path: &std::path::Path, create: bool) -> Result<std::fs::File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .open(path)
        .map_err(|e| {
            let what = if create { "create" } else { "open" };
            Error::io(format!("{what} {}", path.display()), e)
        })
}

impl Segment {
    /// Creates a zero-filled segment of `len` bytes called `name` (which must not exist).
    pub fn create(kind: SegmentKind, name: &str, len: usize) -> Result<Self> {
        match kind {
            SegmentKind::Shm => {
                let path = shm_path(name);
                let file = open_shm(&path, true)?;
                // Allocate every page now, as NCCL does: a sparse file on a full tmpfs
                // would only fail when a page is first touched, with SIGBUS mid-call.
                // SAFETY: a valid open descriptor; offset and length checked by the
                // kernel.
                let err = unsafe {
                    libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, len as _)
                };
                if err != 0 {
                    let _ = std::fs::remove_file(&path);
                    return Err(Error::io(
                        format!(
                            "allocate {len} bytes for {} (is /dev/shm full? see `df -h \
                             /dev/shm`; in a container, raise its size, e.g. docker \
                             --shm-size)",
                            path.display()
                        ),
                        std::io::Error::from_raw_os_error(err),
                    ));
                }
                Self::map(file, name, len)
            }
            SegmentKind::InProcess => {
                let block = Arc::new(HeapBlock::new(len)?);
                let mut table = crate::lock(registry());
                if table.contains_key(name) {
                    return Err(Error::invalid(format!("segment {name} exists already")));
                }
                table.insert(name.to_string(), block.clone());
                Ok(Segment {
                    ptr: block.ptr,
                    len,
                    _backing: Backing::Heap(block),
                })
            }
        }
    }

    /// Opens the segment `name` made by another rank, checking it has `len` bytes.
    pub fn open(kind: SegmentKind, name: &str, len: usize) -> Result<Self> {
        match kind {
            SegmentKind::Shm => {
                let path = shm_path(name);
                let file = open_shm(&path, false)?;
                let actual = file
                    .metadata()
                    .map_err(|e| Error::io(format!("stat {}", path.display()), e))?
                    .len();
                if actual != len as u64 {
                    return Err(Error::invalid(format!(
                        "{} has {actual} bytes, expected {len} (ranks configured differently?)",
                        path.display()
                    )));
                }
                Self::map(file, name, len)
            }
            SegmentKind::InProcess => {
                let table = crate::lock(registry());
                let block = table.get(name).cloned().ok_or_else(|| {
                    Error::invalid(format!("no in-process segment called {name}"))
                })?;
                if block.layout.size() != len.max(1) {
                    return Err(Error::invalid(format!(
                        "in-process segment {name} has {} bytes, expected {len}",
                        block.layout.size()
                    )));
                }
                Ok(Segment {
                    ptr: block.ptr,
                    len,
                    _backing: Backing::Heap(block),
                })
            }
        }
    }

    fn map(file: std::fs::File, name: &str, len: usize) -> Result<Self> {
        // The page tables are filled now (`MAP_POPULATE`), in one system call, rather
        // than by a fault at each page's first touch in a call: 2 ranks, 4 KiB
        // all-reduce, first 100 calls 7.7 -> 1.4 µs each (about 900 faults fewer).
        // SAFETY: the file is a private /dev/shm object of this job, sized above; other
        // ranks map it too, which is the point: all access goes through atomics and the
        // FIFO protocol, never through Rust references that assume exclusivity.
        let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file) }
            .map_err(|e| Error::io(format!("mmap /dev/shm/{name}"), e))?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or_else(|| Error::invalid("empty mapping"))?;
        Ok(Segment {
            ptr,
            len,
            _backing: Backing::Mapped(map),
        })
    }

    /// Removes the name, so no one else can open the segment; mappings stay valid.
    /// Removing a name that is already gone is not an error.
    pub fn unlink(kind: SegmentKind, name: &str) {
        match kind {
            SegmentKind::Shm => {
                let _ = std::fs::remove_file(shm_path(name));
            }
            SegmentKind::InProcess => {
                registry()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(name);
            }
        }
    }

    /// First byte of the segment (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kinds_share_memory_by_name() {
        for kind in [SegmentKind::Shm, SegmentKind::InProcess] {
            let name = format!("ferroccl-test-seg-{}-{kind:?}", std::process::id());
            let a = Segment::create(kind, &name, 8192).unwrap();
            let b = Segment::open(kind, &name, 8192).unwrap();
            assert!(Segment::open(kind, &name, 4096).is_err(), "size is checked");
            Segment::unlink(kind, &name);
            assert!(Segment::open(kind, &name, 8192).is_err(), "name is gone");
            // SAFETY: both segments are 8192 bytes of the same memory; one writer.
            unsafe {
                *a.as_ptr().add(100) = 42;
                assert_eq!(*b.as_ptr().add(100), 42);
            }
            assert_eq!(a.as_ptr() as usize % 4096, 0);
        }
    }
}
