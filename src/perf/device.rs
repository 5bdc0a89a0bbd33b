//! The perf tools on CUDA device memory (`--memory cuda`), with ferroccl's device path or
//! NVIDIA's NCCL (`--backend nccl|both`), so that one run can put the two side by side.
//!
//! Rank `r` uses GPU `r % GPUs` and a stream of its own; a timed loop enqueues its calls
//! and then waits for the stream, as nccl-tests does. NCCL is loaded by path from
//! `FERROCCL_NCCL_LIB` (for example the `nvidia-nccl-cu13` wheel's `libnccl.so.2`, which
//! `tools/fetch-nvidia-lib nccl` fetches); its unique id travels through ferroccl's own
//! host communicator. NCCL takes one rank per GPU (it refuses two: "Duplicate GPU
//! detected"); ferroccl allows several.
//!
//! Nothing here has run on a GPU yet (see the README, "GPUs"); without a driver every
//! entry is an error that says so.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt::Write as _;

use super::report::{Measure, Row};
use super::{Buffers, Call, PerfArgs, Test};
use crate::comm::{Communicator, RawCall};
use crate::cuda::{self, DeviceBuffer, Stream};
use crate::error::{Error, Result};
use crate::plan::Collective;
use crate::types::{Element, ReduceOp};

/// Which library a device sweep runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// ferroccl's device path.
    Ferroccl,
    /// NVIDIA's NCCL.
    Nccl,
}

impl Library {
    fn name(&self) -> &'static str {
        match self {
            Library::Ferroccl => "ferroccl",
            Library::Nccl => "NCCL",
        }
    }
}

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);

type StreamHandle = *mut c_void;
type Comm = *mut c_void;

/// `ncclAllReduce`, `ncclBroadcast` and `ncclReduceScatter`: buffers, count, data type,
/// then one int (the op, or the root), the communicator and the stream.
type CountTypeAndInt = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    StreamHandle,
) -> c_int;

/// The NCCL functions the sweeps call, from NVIDIA's library loaded by path.
struct NcclApi {
    version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
    destroy: unsafe extern "C" fn(Comm) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_reduce: CountTypeAndInt,
    broadcast: CountTypeAndInt,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        StreamHandle,
    ) -> c_int,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, StreamHandle) -> c_int,
    reduce_scatter: CountTypeAndInt,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, StreamHandle) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, StreamHandle) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    _lib: libloading::Library,
}

impl NcclApi {
    fn open() -> Result<Self> {
        let path = std::env::var_os("FERROCCL_NCCL_LIB").ok_or_else(|| {
            Error::invalid(
                "--backend nccl: set FERROCCL_NCCL_LIB to NVIDIA's libnccl.so.2 (e.g. what \
                 `tools/fetch-nvidia-lib nccl` prints, plus /libnccl.so.2)",
            )
        })?;
        // SAFETY: NVIDIA's NCCL; loading runs its initialisers, which have no
        // preconditions.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| Error::Cuda {
            what: format!("FERROCCL_NCCL_LIB={}: {e}", path.to_string_lossy()),
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: each symbol is typed with nccl.h's signature of that name.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| Error::Cuda {
                    what: format!("{}: no {}: {e}", path.to_string_lossy(), $name),
                })?
            };
        }
        Ok(NcclApi {
            version: sym!("ncclGetVersion"),
            get_unique_id: sym!("ncclGetUniqueId"),
            init_rank: sym!("ncclCommInitRank"),
            destroy: sym!("ncclCommDestroy"),
            error_string: sym!("ncclGetErrorString"),
            all_reduce: sym!("ncclAllReduce"),
            broadcast: sym!("ncclBroadcast"),
            reduce: sym!("ncclReduce"),
            all_gather: sym!("ncclAllGather"),
            reduce_scatter: sym!("ncclReduceScatter"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            _lib: lib,
        })
    }

    /// An NCCL result as ferroccl's error.
    fn check(&self, rc: c_int, call: &str) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: returns a static NUL-terminated string for any code.
        let text = unsafe { CStr::from_ptr((self.error_string)(rc)) };
        Err(Error::Cuda {
            what: format!("NCCL {call} failed: {} ({rc})", text.to_string_lossy()),
        })
    }
}

/// An NCCL communicator of the same ranks as a ferroccl one.
struct Nccl {
    api: NcclApi,
    comm: Comm,
    version: c_int,
}

// SAFETY: an NCCL communicator is used by one rank's thread at a time (the sweep's).
unsafe impl Send for Nccl {}
// SAFETY: as above.
unsafe impl Sync for Nccl {}

impl Nccl {
    fn new(comm: &Communicator) -> Result<Self> {
        let api = NcclApi::open()?;
        let mut id = UniqueId([0; 128]);
        if comm.rank() == 0 {
            // SAFETY: writes one ncclUniqueId.
            api.check(unsafe { (api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        }
        let mut bytes: Vec<u8> = id.0.iter().map(|&c| c as u8).collect();
        comm.broadcast_in_place(&mut bytes, 0)?;
        for (d, s) in id.0.iter_mut().zip(&bytes) {
            *d = *s as c_char;
        }
        let mut handle: Comm = std::ptr::null_mut();
        let mut version: c_int = 0;
        // SAFETY: writes one handle / one int; the id came from rank 0's NCCL.
        unsafe {
            api.check((api.version)(&mut version), "ncclGetVersion")?;
            api.check(
                (api.init_rank)(&mut handle, comm.size() as c_int, id, comm.rank() as c_int),
                "ncclCommInitRank",
            )?;
        }
        Ok(Nccl {
            api,
            comm: handle,
            version,
        })
    }

    /// Enqueues one call of the sweep on `stream`.
    ///
    /// # Safety
    /// The device buffers hold what the call reads and writes.
    unsafe fn call<T: Element>(
        &self,
        call: &Call,
        rank: usize,
        n: usize,
        input: u64,
        output: u64,
        stream: *mut c_void,
    ) -> Result<()> {
        let a = &self.api;
        let dt = T::DTYPE as c_int;
        let op = match call.op.unwrap_or(ReduceOp::Sum).to_nccl() {
            Some(op) => op,
            None => return Err(Error::invalid("--backend nccl: -o mulsum is not compared")),
        };
        let (i, o, count) = (input as *const c_void, output as *mut c_void, call.count);
        // SAFETY: forwarded from the caller; arguments as nccl.h defines them.
        let rc = unsafe {
            match call.c {
                Collective::AllReduce => (a.all_reduce)(i, o, count, dt, op, self.comm, stream),
                Collective::Broadcast { root } => {
                    (a.broadcast)(i, o, count, dt, root as c_int, self.comm, stream)
                }
                Collective::Reduce { root } => {
                    (a.reduce)(i, o, count, dt, op, root as c_int, self.comm, stream)
                }
                Collective::AllGather => (a.all_gather)(i, o, count, dt, self.comm, stream),
                Collective::ReduceScatter => {
                    (a.reduce_scatter)(i, o, count, dt, op, self.comm, stream)
                }
                Collective::Send { .. } => {
                    a.check((a.group_start)(), "ncclGroupStart")?;
                    let next = ((rank + 1) % n) as c_int;
                    let prev = ((rank + n - 1) % n) as c_int;
                    let queued = a
                        .check((a.send)(i, count, dt, next, self.comm, stream), "ncclSend")
                        .and_then(|()| {
                            a.check((a.recv)(o, count, dt, prev, self.comm, stream), "ncclRecv")
                        });
                    // The group is closed whatever happened inside it.
                    let end = (a.group_end)();
                    queued?;
                    end
                }
                other => {
                    return Err(Error::invalid(format!(
                        "--backend nccl: {} is not compared (NCCL's all-to-all, gather and \
                         scatter arrived in 2.28)",
                        other.name()
                    )));
                }
            }
        };
        a.check(rc, call.c.name())
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: a communicator of this NCCL, destroyed once.
        unsafe { (self.api.destroy)(self.comm) };
    }
}

/// Makes GPU `rank % GPUs` current on this thread (each rank's GPU, round robin) and
/// returns it. The tools call it before a rank joins its communicator too, as nccl-tests
/// calls `cudaSetDevice` before `ncclCommInitRank`, so that the device calls' tuning
/// knows the GPUs.
pub fn bind_rank_gpu(rank: usize) -> Result<usize> {
    cuda::driver()?;
    let gpus = cuda::device_count();
    if gpus == 0 {
        return Err(Error::Cuda {
            what: "--memory cuda: the driver sees no GPU".into(),
        });
    }
    let device = rank % gpus;
    cuda::bind_device(device)?;
    Ok(device)
}

/// One rank's device side for the sweeps: its GPU, its stream, NCCL when asked for.
pub struct DeviceRank<'a> {
    comm: &'a Communicator,
    device: usize,
    stream: Stream,
    nccl: Option<Nccl>,
    libraries: Vec<Library>,
    /// The device memory of every size's buffers, grown only between sizes (see
    /// [`DeviceRank::memory_of`]).
    memory: std::cell::RefCell<Option<DeviceBuffer>>,
}

impl<'a> DeviceRank<'a> {
    /// Binds this rank to GPU `rank % GPUs` and prepares the libraries `args` asks for.
    pub fn new(comm: &'a Communicator, args: &PerfArgs) -> Result<Self> {
        let device = bind_rank_gpu(comm.rank())?;
        let libraries = match args.backend {
            super::args::Backend::Ferroccl => vec![Library::Ferroccl],
            super::args::Backend::Nccl => vec![Library::Nccl],
            super::args::Backend::Both => vec![Library::Ferroccl, Library::Nccl],
        };
        let nccl = if libraries.contains(&Library::Nccl) {
            Some(Nccl::new(comm)?)
        } else {
            None
        };
        Ok(DeviceRank {
            comm,
            device,
            stream: Stream::new()?,
            nccl,
            libraries,
            memory: std::cell::RefCell::new(None),
        })
    }

    /// The device address of at least `bytes` of this rank's memory. Collective: every
    /// rank calls it once per size and mode, after its previous calls have finished.
    ///
    /// Memory is never freed while a call of any rank may run, as nccl-tests allocates
    /// once: `cuMemFree` waits for the whole device, and ranks that are threads of one
    /// process share its driver, so a free in one rank blocks the others' launches while
    /// a peer's kernel already waits for them (3 and 4 ranks on one H100 hung there).
    /// When a size needs more, every rank agrees on the largest need, frees and
    /// allocates, and waits for the others before anyone launches again.
    fn memory_of(&self, bytes: usize) -> Result<u64> {
        let mut need = [bytes.max(1) as u64];
        self.comm.all_reduce_in_place(&mut need, ReduceOp::Max)?;
        let need = need[0] as usize;
        let mut memory = self.memory.borrow_mut();
        if memory.as_ref().is_none_or(|m| m.len() < need) {
            *memory = None;
            *memory = Some(DeviceBuffer::zeroed(need)?);
            self.comm.barrier()?;
        }
        Ok(memory.as_ref().expect("allocated above").ptr())
    }

    /// The libraries to sweep, in order.
    pub fn backends(&self) -> Vec<Library> {
        self.libraries.clone()
    }

    /// The header line naming the library and device.
    pub fn describe(&self, library: Library) -> String {
        let version = match (&self.nccl, library) {
            (Some(n), Library::Nccl) => format!(" {}", n.version),
            _ => String::new(),
        };
        format!(
            "# Library: {}{version} on CUDA device memory (rank 0 on GPU {}, one stream per rank)",
            library.name(),
            self.device
        )
    }

    /// Checks (with `-c 1`) and times one mode of one size on device memory.
    pub(super) fn run_mode<T: Element + Default>(
        &self,
        library: Library,
        call: &Call,
        in_place: bool,
        args: &PerfArgs,
    ) -> Result<Measure> {
        let comm = self.comm;
        let (rank, n) = (comm.rank(), comm.size());
        let elem = std::mem::size_of::<T>();
        let mut bufs = Buffers::<T>::new(call.c, call.count, rank, n, in_place);
        let bytes = bufs.mem.len() * elem;
        let mem = self.memory_of(bytes)?;
        let (input, output) = (
            mem + (bufs.input_at * elem) as u64,
            mem + (bufs.output_at * elem) as u64,
        );
        let stream = self.stream.handle();
        let run = || -> Result<()> {
            match library {
                Library::Nccl => {
                    let nccl = self.nccl.as_ref().expect("opened for --backend nccl");
                    // SAFETY: the device buffer holds both regions (Buffers::new).
                    unsafe { nccl.call::<T>(call, rank, n, input, output, stream) }
                }
                Library::Ferroccl => {
                    let raw = |collective, input: u64, output: u64| RawCall {
                        collective,
                        count: call.count,
                        dtype: T::DTYPE,
                        op: call.op.unwrap_or(ReduceOp::Sum),
                        input: input as *const u8,
                        output: output as *mut u8,
                    };
                    let calls = if call.test == Test::SendRecv {
                        vec![
                            raw(
                                Collective::Send {
                                    peer: (rank + 1) % n,
                                },
                                input,
                                0,
                            ),
                            raw(
                                Collective::Recv {
                                    peer: (rank + n - 1) % n,
                                },
                                0,
                                output,
                            ),
                        ]
                    } else {
                        vec![raw(call.c, input, output)]
                    };
                    // SAFETY: the device memory holds both regions and is freed only
                    // after every rank's calls have finished (`memory_of`).
                    unsafe { comm.enqueue_device(&calls, stream) }
                }
            }
        };
        let finish = || -> Result<()> {
            self.stream.synchronize()?;
            comm.synchronize_device()
        };
        let mut wrong = None;
        if args.check {
            bufs.fill_input(&call.input::<T>(rank, n, bufs.in_len));
            // In the stream's order (a plain cuMemcpyHtoD would run on the legacy
            // stream, which this non-blocking one does not wait for), then waited for.
            // SAFETY: both hold `bytes`; the host vector outlives the wait below.
            unsafe {
                cuda::copy_to_device_async(mem, bufs.mem.as_ptr() as *const u8, bytes, stream)?
            };
            self.stream.synchronize()?;
            run()?;
            finish()?;
            // SAFETY: both hold `bytes`.
            unsafe { cuda::copy_from_device(bufs.mem.as_mut_ptr() as *mut u8, mem, bytes)? };
            wrong = Some(call.count_wrong(comm, &mut bufs)?);
        }
        let measured = call.time(comm, args, run, finish);
        // The buffer is in use until the stream has passed every call.
        finish()?;
        Ok(Measure { wrong, ..measured? })
    }
}

/// Each library's speed per size, out of place, and ferroccl's share of NCCL's: the time
/// of a call below 4 KiB, the algorithm bandwidth above. (Not the bus bandwidth: it is
/// zero for one rank, whose all-reduce moves nothing between ranks, and for more ranks
/// its ratio is the algorithm bandwidth's.)
pub fn comparison(sweeps: &[(Library, Vec<Row>)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "#\n# Side by side (out of place): algbw GB/s, and time us below 4 KiB\n#{:>12} {:>10} {:>12} {:>12} {:>8}",
        "size", "type", "ferroccl", "NCCL", "ratio"
    );
    let find = |lib: Library| sweeps.iter().find(|(l, _)| *l == lib).map(|(_, r)| r);
    let (Some(ours), Some(theirs)) = (find(Library::Ferroccl), find(Library::Nccl)) else {
        return s;
    };
    for (a, b) in ours.iter().zip(theirs) {
        let small = a.size < 4096;
        let (x, y) = if small {
            (a.out_of_place.time_us, b.out_of_place.time_us)
        } else {
            (a.out_of_place.algbw, b.out_of_place.algbw)
        };
        // Larger is better for bandwidth, smaller for time.
        let ratio = match (small, x > 0.0 && y > 0.0) {
            (_, false) => f64::NAN,
            (true, true) => y / x,
            (false, true) => x / y,
        };
        let _ = writeln!(
            s,
            " {:>12} {:>10} {:>12.2} {:>12.2} {:>7.2}x",
            a.size,
            a.dtype.name(),
            x,
            y,
            ratio
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataType;

    fn row(size: usize, time_us: f64, ranks: usize) -> Row {
        let algbw = size as f64 / time_us / 1e3;
        let measure = Measure {
            time_us,
            algbw,
            busbw: algbw * 2.0 * (ranks - 1) as f64 / ranks as f64,
            wrong: Some(0),
        };
        Row {
            size,
            count: size / 4,
            dtype: DataType::Float32,
            op: None,
            root: None,
            out_of_place: measure,
            in_place: Some(measure),
            algorithm: String::new(),
            rank: 0,
        }
    }

    /// The ratios column of `comparison` for ferroccl's and NCCL's times of the same sizes.
    fn ratios(sizes: &[usize], ours: &[f64], theirs: &[f64], ranks: usize) -> Vec<f64> {
        let rows = |times: &[f64]| {
            sizes
                .iter()
                .zip(times)
                .map(|(&size, &t)| row(size, t, ranks))
                .collect()
        };
        let table = comparison(&[
            (Library::Ferroccl, rows(ours)),
            (Library::Nccl, rows(theirs)),
        ]);
        table
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| {
                let last = l.split_whitespace().last().expect("a ratio");
                last.trim_end_matches('x').parse().expect("a number")
            })
            .collect()
    }

    #[test]
    fn one_rank_and_several_compare_alike_at_every_size() {
        // One rank: its bus bandwidth is zero, and the ratio must still be NCCL's time
        // over ferroccl's (an H200 run printed NaN for every size from 4 KiB).
        let sizes = [8, 2048, 8192, 1 << 20, 512 << 20];
        let ours = [10.0, 12.0, 20.0, 40.0, 27_000.0];
        let theirs = [5.0, 6.0, 5.0, 10.0, 270.0];
        for ranks in [1, 2, 8] {
            let got = ratios(&sizes, &ours, &theirs, ranks);
            assert_eq!(got.len(), sizes.len(), "{ranks} ranks");
            for ((g, o), t) in got.iter().zip(ours).zip(theirs) {
                assert!(
                    (g - t / o).abs() < 0.006,
                    "{ranks} ranks: {g} against {}",
                    t / o
                );
            }
        }
    }
}
