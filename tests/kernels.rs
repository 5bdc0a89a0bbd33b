//! The CUDA kernels (`kernels/*.cu`), checked without a GPU:
//!
//! - **compiled for real GPUs**: NVRTC (fetched from PyPI by `tools/fetch-nvidia-lib nvrtc`; it
//!   needs no GPU) compiles every source to a cubin for sm_80 and sm_90 with ptxas's
//!   report, and the test holds every entry point to zero spills and a register budget;
//! - **run on the CPU**: the same sources compiled as host C++ through
//!   `kernels/host/shim.h` (thread blocks as host threads), so their logic runs here:
//!   the reduction kernels against the host kernels of `ferroccl::reduce`, and the device
//!   executor, with N simulated GPUs sharing FIFOs, against the host engine, bit for bit
//!   over the collective grid.

// Some of the shared helpers are used here.
#[allow(unused_imports)]
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ferroccl::comm::{CommConfig, Communicator};
use ferroccl::cuda::nvrtc;
use ferroccl::cuda::work::{self, FcclFifo, FcclOp, FcclWork, FifoEnd};
use ferroccl::engine::device as launch;
use ferroccl::plan::{Algorithm, Collective};
use ferroccl::reduce::Kernel;
use ferroccl::transport::Protocol;
use ferroccl::{DataType, ReduceOp};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Most registers per thread an entry point may use. The element-wise kernels: 64, so
/// that 1024-thread blocks fit an SM's 64 Ki registers. The executor (one block per
/// channel, 256 threads; every step kind of every dtype in one kernel, as a group may
/// fuse operations of several dtypes): 96, so that two channels' blocks share an SM.
fn register_budget(entry: &str) -> u32 {
    if entry == "ferroccl_execute" { 96 } else { 64 }
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_with_no_spills_within_the_register_budget() {
    common::nvrtc_from_pypi();
    let compiler = nvrtc::compiler().expect("NVRTC loads from the wheel");
    println!("NVRTC {}.{}", compiler.version.0, compiler.version.1);
    // Through the run's cubin cache (named by the source, header, options and NVRTC
    // version, so a hit is this source's image and ptxas report): the simulated-GPU
    // tests compile for sm_90 too, and ptxas takes about a minute per executor image
    // here. What is not cached compiles on as many threads as there are images.
    let cache = common::cubin_cache();
    let builds: Vec<((u32, u32), nvrtc::KernelSource)> = [(8, 0), (9, 0)]
        .into_iter()
        .flat_map(|arch| nvrtc::KERNELS.into_iter().map(move |source| (arch, source)))
        .collect();
    let cubins: Vec<nvrtc::Cubin> = std::thread::scope(|s| {
        let running: Vec<_> = builds
            .iter()
            .map(|(arch, source)| {
                let cache = &cache;
                s.spawn(move || nvrtc::cubin_cached_in(Some(cache), source, *arch))
            })
            .collect();
        running
            .into_iter()
            .map(|r| r.join().unwrap().unwrap_or_else(|e| panic!("{e}")))
            .collect()
    });
    for ((arch, source), cubin) in builds.iter().zip(&cubins) {
        assert!(
            cubin.image.starts_with(b"\x7fELF"),
            "{}: a cubin is an ELF image",
            source.name
        );
        let reports = cubin.entries();
        let mut names: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
        names.sort_unstable();
        let mut expected = source.entries.to_vec();
        expected.sort_unstable();
        assert_eq!(
            names, expected,
            "{} sm_{}{}:\n{}",
            source.name, arch.0, arch.1, cubin.log
        );
        for r in &reports {
            println!(
                "sm_{}{} {:<18} {:>3} registers, {} B spill stores, {} B spill loads",
                arch.0, arch.1, r.name, r.registers, r.spill_stores, r.spill_loads
            );
            assert_eq!(r.spill_stores, 0, "{r:?}\n{}", cubin.log);
            assert_eq!(r.spill_loads, 0, "{r:?}\n{}", cubin.log);
            assert!(
                r.registers > 0 && r.registers <= register_budget(&r.name),
                "{r:?}: over the budget of {}",
                register_budget(&r.name)
            );
        }
    }
    // Kept in memory: the second request is the same image.
    let a = nvrtc::cubin(&nvrtc::EXECUTOR, (9, 0)).unwrap();
    let b = nvrtc::cubin(&nvrtc::EXECUTOR, (9, 0)).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
}

/// A source NVRTC rejects: the error names the source and the architecture and carries
/// NVRTC's log (the line and what is wrong), never a panic.
#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_nvrtcs_log() {
    common::nvrtc_from_pypi();
    let broken = nvrtc::KernelSource {
        name: "broken.cu",
        text: "extern \"C\" __global__ void f() { this_is_not_declared = 1; }\n",
        entries: &["f"],
    };
    let err = nvrtc::compile(&broken, (9, 0)).unwrap_err().to_string();
    assert!(
        err.contains("broken.cu for sm_90")
            && err.contains("nvrtcCompileProgram failed")
            && err.contains("this_is_not_declared"),
        "{err}"
    );
}

/// The cubin cache on disk: concurrent callers on an empty cache get one image (the
/// others wait for the first one's file); a cache that cannot be used (its directory
/// under a file, its lock or its log path taken by a directory) or no cache at all
/// costs a compile, never an error.
#[test]
fn the_disk_cache_is_shared_by_concurrent_callers_and_a_broken_one_only_costs_a_compile() {
    common::nvrtc_from_pypi();
    let version = nvrtc::compiler()
        .expect("NVRTC loads from the wheel")
        .version;
    let (source, arch) = (nvrtc::REDUCE, (9, 0));
    let name = nvrtc::cache_name(&source, arch, version);
    let dir = tempfile::tempdir().unwrap();

    let shared = dir.path().join("shared");
    let images: Vec<Vec<u8>> = std::thread::scope(|s| {
        let running: Vec<_> = (0..2)
            .map(|_| s.spawn(|| nvrtc::cubin_cached_in(Some(&shared), &source, arch).unwrap()))
            .collect();
        running
            .into_iter()
            .map(|r| r.join().unwrap().image)
            .collect()
    });
    assert!(images[0].starts_with(b"\x7fELF"));
    assert_eq!(
        images[0], images[1],
        "both callers get the one cached image"
    );
    assert_eq!(std::fs::read(shared.join(&name)).unwrap(), images[0]);

    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let lock_taken = dir.path().join("lock-taken");
    std::fs::create_dir_all(lock_taken.join(&name).with_extension("lock")).unwrap();
    let log_taken = dir.path().join("log-taken");
    std::fs::create_dir_all(log_taken.join(&name).with_extension("log")).unwrap();
    for unusable in [
        Some(file.join("cache")),
        Some(lock_taken),
        Some(log_taken.clone()),
        None,
    ] {
        let cubin = nvrtc::cubin_cached_in(unusable.as_deref(), &source, arch)
            .unwrap_or_else(|e| panic!("{unusable:?}: {e}"));
        assert_eq!(
            cubin.image, images[0],
            "{unusable:?}: the same image, compiled"
        );
    }
    assert!(
        !log_taken.join(&name).exists(),
        "an image whose log could not be written is not cached"
    );
}

// ----- the host build of the kernels ------------------------------------------------

/// `kernels/host/entry.cpp` built as a shared library, once per test process.
fn host_kernels() -> &'static libloading::Library {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "libferroccl_kernels_host_{}.so",
            std::process::id()
        ));
        common::build_host_cxx(&root().join("kernels/host/entry.cpp"), &out, &[]);
        // SAFETY: our own library; its initialisers are the C++ runtime's.
        let lib = unsafe { libloading::Library::new(&out) }.expect("load the host kernels");
        let _ = std::fs::remove_file(&out);
        lib
    })
}

type ExecuteFn = unsafe extern "C" fn(*const FcclWork, u32);
type ReduceFn = unsafe extern "C" fn(u32, u32, *mut u8, *const u8, *const u8, u64, u32, u32, u64);
type PreFn = unsafe extern "C" fn(u32, u32, *mut u8, *const u8, u64, u32, u32, u64);
type PostFn = unsafe extern "C" fn(u32, u32, *mut u8, u64, u32, u32, u32);

fn symbol<T: Copy>(name: &str) -> T {
    // SAFETY: each name is looked up with the C signature entry.cpp gives it.
    unsafe { *host_kernels().get::<T>(name.as_bytes()).expect(name) }
}

#[test]
fn the_executor_structures_have_the_same_layout_in_rust_and_cpp() {
    let abi: unsafe extern "C" fn(*mut u64) = symbol("ferroccl_host_abi");
    let mut sizes = [0u64; 6];
    // SAFETY: writes six sizes.
    unsafe { abi(sizes.as_mut_ptr()) };
    let rust = [
        size_of::<work::FcclRegion>(),
        size_of::<work::FcclStep>(),
        size_of::<work::FcclLane>(),
        size_of::<FcclFifo>(),
        size_of::<FcclOp>(),
        size_of::<FcclWork>(),
    ]
    .map(|s| s as u64);
    assert_eq!(sizes, rust);
}

/// Memory aligned to 16 bytes (so the kernels' vector path runs), zeroed.
struct Aligned(Vec<u128>);

impl Aligned {
    fn new(bytes: usize) -> Self {
        Aligned(vec![0; bytes.div_ceil(16).max(1)])
    }
    fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the vector's memory, as bytes.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.0.len() * 16) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the vector's memory, as bytes.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u8, self.0.len() * 16) }
    }
}

#[test]
fn element_wise_kernels_equal_the_host_kernels_bit_for_bit() {
    let reduce: ReduceFn = symbol("ferroccl_host_reduce");
    let pre: PreFn = symbol("ferroccl_host_pre");
    let post: PostFn = symbol("ferroccl_host_post");
    let mut cases = 0;
    for dtype in DataType::ALL {
        let e = dtype.size();
        for op in common::ops() {
            for nranks in [1usize, 3, 200] {
                let k = Kernel::new(dtype, op, nranks).unwrap();
                for n in [0usize, 1, 7, 16, 33, 1000] {
                    // Offsets that leave the three buffers aligned alike, and not.
                    for (sa, sb, sd) in [(0, 0, 0), (1, 1, 1), (0, 1, 2)] {
                        let mut a = Aligned::new((n + 4) * e);
                        let mut b = Aligned::new((n + 4) * e);
                        for i in 0..n {
                            common::element_bytes(
                                dtype,
                                (i * 2) as u64,
                                &mut a.bytes_mut()[(sa + i) * e..][..e],
                            );
                            common::element_bytes(
                                dtype,
                                (i * 2 + 1) as u64,
                                &mut b.bytes_mut()[(sb + i) * e..][..e],
                            );
                        }
                        let (mut want, mut got) =
                            (Aligned::new((n + 4) * e), Aligned::new((n + 4) * e));
                        // SAFETY: every buffer holds n + 4 elements from its offset on.
                        unsafe {
                            let (pa, pb) = (a.ptr().add(sa * e), b.ptr().add(sb * e));
                            k.reduce(want.ptr().add(sd * e), pa, pb, n);
                            reduce(
                                2,
                                3,
                                got.ptr().add(sd * e),
                                pa,
                                pb,
                                n as u64,
                                dtype as u32,
                                k.device_op(),
                                k.scalar_bits(),
                            );
                        }
                        assert_eq!(
                            want.bytes(),
                            got.bytes(),
                            "reduce {dtype} {op} n={n} offsets {sa},{sb},{sd}"
                        );
                        // SAFETY: as above.
                        unsafe {
                            let pb = b.ptr().add(sb * e);
                            k.pre(want.ptr().add(sd * e), pb, n);
                            pre(
                                2,
                                3,
                                got.ptr().add(sd * e),
                                pb,
                                n as u64,
                                dtype as u32,
                                k.device_op(),
                                k.scalar_bits(),
                            );
                            k.post(want.ptr().add(sd * e), n);
                            post(
                                2,
                                3,
                                got.ptr().add(sd * e),
                                n as u64,
                                dtype as u32,
                                k.device_op(),
                                nranks as u32,
                            );
                        }
                        assert_eq!(
                            want.bytes(),
                            got.bytes(),
                            "pre+post {dtype} {op} nranks={nranks} n={n}"
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("{cases} cases of reduce, pre and post agree bit for bit");
}

// ----- the device executor against the host engine ----------------------------------

/// Slots of every simulated FIFO, and bytes per slot by protocol: small, so that every
/// step is cut into many slices (a Simple slot carries 32 eight-byte elements).
const SLOTS: u32 = 8;
const SIMPLE_SLOT_BYTES: u32 = 256;
const LL_SLOT_BYTES: u32 = 1024;
/// The plans' chunk: at most half of the smallest FIFO (8 × 256 B), as the host's rule
/// that keeps rings from deadlocking asks.
const CHUNK_BYTES: usize = 1024;

/// One FIFO between two simulated GPUs, in memory both reach.
struct SimFifo {
    head: Box<u64>,
    tail: Box<u64>,
    sizes: Vec<u32>,
    data: Aligned,
}

/// Raw pointers handed to the rank threads.
struct Shared<T>(T);
// SAFETY: the pointed-to memory outlives the threads (they are scoped) and the executor
// synchronises its accesses to the FIFOs itself.
unsafe impl<T> Send for Shared<T> {}

/// One grid point.
#[derive(Clone, Copy, Debug)]
struct Case {
    collective: Collective,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    in_place: bool,
    protocol: Protocol,
}

/// A rank's buffers for one case: `mem` holds the input and output (separately, or one
/// inside the other when in place).
struct RankBuffers {
    input: Aligned,
    output: Aligned,
    /// In place: the output lies at `output_at` elements into the input, or the input at
    /// `input_at` into the output.
    input_at: Option<usize>,
    output_at: Option<usize>,
}

impl RankBuffers {
    fn new(case: &Case, rank: usize, nranks: usize) -> Self {
        let e = case.dtype.size();
        let (in_len, out_len) = case.collective.buffer_lens(case.count, rank, nranks);
        // In place where the call defines it and the rank has both buffers.
        let input_at = case
            .in_place
            .then(|| case.collective.input_in_output(case.count, rank))
            .flatten()
            .filter(|at| at + in_len <= out_len);
        let output_at = case
            .in_place
            .then(|| case.collective.output_in_input(case.count, rank))
            .flatten()
            .filter(|at| at + out_len <= in_len);
        let mut input = Aligned::new(in_len * e);
        let mut output = Aligned::new(out_len * e);
        output.bytes_mut().fill(0xA5);
        let seed = |i: usize| (rank * 1_000_003 + i) as u64;
        if let Some(at) = input_at {
            for i in 0..in_len {
                common::element_bytes(
                    case.dtype,
                    seed(i),
                    &mut output.bytes_mut()[(at + i) * e..][..e],
                );
            }
        } else {
            for i in 0..in_len {
                common::element_bytes(case.dtype, seed(i), &mut input.bytes_mut()[i * e..][..e]);
            }
        }
        RankBuffers {
            input,
            output,
            input_at,
            output_at,
        }
    }

    /// The input and output pointers of the call.
    fn pointers(&mut self, e: usize) -> (*mut u8, *mut u8) {
        let (i, o) = (self.input.ptr(), self.output.ptr());
        match (self.input_at, self.output_at) {
            // SAFETY (both arms): the offset is inside the buffer (buffer_lens).
            (Some(at), _) => (unsafe { o.add(at * e) }, o),
            (_, Some(at)) => (i, unsafe { i.add(at * e) }),
            _ => (i, o),
        }
    }

    /// What the call wrote: the output, or the whole buffer when in place.
    fn result(&self) -> &[u8] {
        if self.output_at.is_some() {
            self.input.bytes()
        } else {
            self.output.bytes()
        }
    }
}

fn config(channels: usize, algorithm: Algorithm) -> CommConfig {
    CommConfig {
        timeout: std::time::Duration::from_secs(60),
        channels,
        slot_bytes: 4096,
        chunk_bytes: CHUNK_BYTES,
        algorithms: vec![algorithm],
        protocols: vec![Protocol::Simple],
        ..CommConfig::default()
    }
}

/// Runs `case` on the host engine and on the executor (one simulated GPU per rank) and
/// checks every rank's result is the same, bit for bit. Returns the lanes run.
fn check(comms: &[Communicator], case: Case) -> usize {
    let n = comms.len();
    let e = case.dtype.size();
    let reducing = case.collective.is_reducing();
    // The host engine.
    let mut host: Vec<RankBuffers> = (0..n).map(|r| RankBuffers::new(&case, r, n)).collect();
    std::thread::scope(|s| {
        for (comm, b) in comms.iter().zip(host.iter_mut()) {
            let (i, o) = b.pointers(e);
            let (i, o) = (Shared(i), Shared(o));
            s.spawn(move || {
                let (i, o) = (i, o);
                // SAFETY: the buffers hold what the call reads and writes.
                unsafe {
                    comm.collective_raw(case.collective, case.count, case.dtype, case.op, i.0, o.0)
                }
                .unwrap_or_else(|err| panic!("{case:?}: host engine: {err}"));
            });
        }
    });
    // The executor, on the plans the engine ran.
    let mut device: Vec<RankBuffers> = (0..n).map(|r| RankBuffers::new(&case, r, n)).collect();
    let slot_bytes = match case.protocol {
        Protocol::Simple => SIMPLE_SLOT_BYTES,
        Protocol::LL => LL_SLOT_BYTES,
        Protocol::SingleCopy => unreachable!("device calls have no single copy"),
    };
    let mut fifos: HashMap<(usize, usize, usize), SimFifo> = HashMap::new();
    let mut per_rank = Vec::new();
    for (r, comm) in comms.iter().enumerate() {
        let plan = comm
            .plan_for(case.collective, case.count, case.dtype)
            .unwrap();
        let laid = work::lay_out(&plan, &[case.protocol]).unwrap();
        let mut scratch = Aligned::new(plan.scratch_elems(0) * e);
        let kernel = Kernel::new(
            case.dtype,
            if reducing { case.op } else { ReduceOp::Sum },
            n,
        )
        .unwrap();
        let (i, o) = device[r].pointers(e);
        let ops = vec![FcclOp::new(
            &kernel,
            reducing,
            i as *const _,
            o as *mut _,
            scratch.ptr() as *mut _,
        )];
        let mut stages: Vec<Aligned> = Vec::new();
        let mut ends: Vec<FcclFifo> = Vec::new();
        for end in &laid.fifos {
            let FifoEnd {
                channel,
                peer,
                sends,
                ..
            } = *end;
            let key = if sends {
                (channel, r, peer)
            } else {
                (channel, peer, r)
            };
            let f = fifos.entry(key).or_insert_with(|| SimFifo {
                head: Box::new(0),
                tail: Box::new(0),
                sizes: vec![0; SLOTS as usize],
                data: Aligned::new((SLOTS * slot_bytes) as usize),
            });
            stages.push(Aligned::new(slot_bytes as usize));
            ends.push(FcclFifo {
                head: &mut *f.head,
                tail: &mut *f.tail,
                sizes: f.sizes.as_mut_ptr(),
                data: f.data.ptr(),
                stage: stages.last_mut().unwrap().ptr(),
                slots: SLOTS,
                slot_bytes,
                protocol: match case.protocol {
                    Protocol::LL => 1,
                    _ => 0,
                },
                pad: 0,
            });
        }
        let status = vec![u32::MAX; laid.lanes.len()];
        // Packed into one block, as the launcher copies it to a GPU.
        let packed = launch::pack(&laid, &ends, &ops);
        let mut block = Aligned::new(packed.bytes.len());
        block.bytes_mut()[..packed.bytes.len()].copy_from_slice(&packed.bytes);
        per_rank.push((laid, (packed, block), ends, stages, scratch, status));
    }
    let execute: ExecuteFn = symbol("ferroccl_host_execute");
    let abort = std::sync::atomic::AtomicU32::new(0);
    let finished = std::sync::atomic::AtomicUsize::new(0);
    let mut lanes = 0;
    std::thread::scope(|s| {
        for (laid, (packed, block), _, _, _, status) in per_rank.iter_mut() {
            lanes += laid.lanes.len();
            let w = Shared(packed.work(
                block.ptr() as u64,
                status.as_mut_ptr() as u64,
                abort.as_ptr() as u64,
            ));
            let finished = &finished;
            s.spawn(move || {
                let w = w;
                // SAFETY: the work's arrays and buffers live until the scope ends.
                unsafe { execute(&w.0, 3) };
                finished.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        // A hang is a failure, not a stuck test: give up after a minute.
        let start = std::time::Instant::now();
        while finished.load(std::sync::atomic::Ordering::SeqCst) < n {
            if start.elapsed() > std::time::Duration::from_secs(60) {
                abort.store(1, std::sync::atomic::Ordering::SeqCst);
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    for (r, (_, _, _, _, _, status)) in per_rank.iter().enumerate() {
        for (lane, &st) in status.iter().enumerate() {
            assert_eq!(
                st,
                0,
                "{case:?}: rank {r} lane {lane}: {}",
                work::status_name(st)
            );
        }
    }
    for r in 0..n {
        assert!(
            host[r].result() == device[r].result(),
            "{case:?} on {n} ranks: rank {r}'s result differs from the host engine's"
        );
    }
    lanes
}

#[test]
fn the_executor_on_simulated_gpus_equals_the_host_engine_bit_for_bit() {
    const COUNTS: [usize; 7] = [0, 1, 2, 7, 13, 97, 1031];
    let mut rot = 0usize;
    let (mut cases, mut lanes) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for n in [1usize, 2, 3, 4, 5, 8] {
        // The two-shot is the ring's schedule on two ranks.
        let mut algorithms = vec![Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot];
        if n > 2 {
            algorithms.extend([Algorithm::TwoShot, Algorithm::Doubling]);
        }
        for algorithm in algorithms {
            for channels in [1, 2] {
                let comms = Communicator::init_all_with(n, config(channels, algorithm)).unwrap();
                for collective in Collective::every(n) {
                    // A deterministic pseudo-random pick of the other dimensions.
                    rot += 1;
                    let h = (rot as u64)
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        .rotate_left(29)
                        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    let pick = |shift: u32, n: usize| (h >> shift) as usize % n;
                    let case = Case {
                        collective,
                        count: COUNTS[pick(20, COUNTS.len())],
                        dtype: DataType::ALL[pick(0, 12)],
                        op: common::ops()[pick(8, 6)],
                        in_place: pick(16, 2) == 1,
                        protocol: Protocol::ALL[pick(17, 2)],
                    };
                    seen.insert((
                        case.dtype as u32,
                        case.op.name(),
                        case.protocol.name(),
                        case.in_place,
                    ));
                    lanes += check(&comms, case);
                    cases += 1;
                }
                // Every dtype × op on the all-reduce, both protocols, in and out of place.
                if (n == 3 && algorithm != Algorithm::Tree)
                    || (n == 4 && channels == 2 && algorithm == Algorithm::Ring)
                {
                    for (i, dtype) in DataType::ALL.into_iter().enumerate() {
                        for (j, op) in common::ops().into_iter().enumerate() {
                            // The device protocols (single copy is for host memory).
                            for protocol in [Protocol::Simple, Protocol::LL] {
                                let case = Case {
                                    collective: Collective::AllReduce,
                                    count: 97 + i + j,
                                    dtype,
                                    op,
                                    in_place: (i + j) % 2 == 0,
                                    protocol,
                                };
                                lanes += check(&comms, case);
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    println!("{cases} cases ({lanes} lanes) equal the host engine bit for bit");
    println!(
        "{} of the 288 dtype × op × protocol × in-place combinations",
        seen.len()
    );
    assert!(
        seen.len() > 150,
        "the picks cover dtypes × ops × protocols × in-place"
    );
}
