//! The CUDA kernels on a real GPU. Without a CUDA device every test here prints
//! `SKIPPED` with the reason and passes: CI machines have no GPU (`tests/kernels.rs` runs
//! the same kernels there, compiled with NVRTC and run as host C++).
//!
//! With a device (run `cargo test --test gpu -- --nocapture` on a machine with an NVIDIA
//! driver): NVRTC compiles the kernels for the device's architecture, and
//! - the element-wise kernels equal the host kernels bit for bit, every dtype × op;
//! - the device executor runs the ring all-reduce plans of 2, 3 and 4 ranks on the one
//!   GPU (one stream per rank, FIFOs in device memory, both protocols) and every rank's
//!   result equals the host engine's, bit for bit.

// Some of the shared helpers are used here.
#[allow(unused_imports)]
mod common;

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use ferroccl::comm::{CommConfig, Communicator};
use ferroccl::cuda::{self, nvrtc, work};
use ferroccl::plan::{Algorithm, Collective};
use ferroccl::reduce::Kernel;
use ferroccl::transport::Protocol;
use ferroccl::transport::cuda_ipc;
use ferroccl::transport::fifo::Geometry;
use ferroccl::{DataType, ReduceOp};

/// GPUs of the simulated driver when there is no real one (`FERROCCL_SIM_GPUS` overrides).
const SIMULATED_GPUS: usize = 4;

/// Held by a test while it uses the GPU (see [`gpu`]).
type OneAtATime = std::sync::MutexGuard<'static, ()>;

/// The first GPU and its architecture: a real one, else one of the simulated driver's
/// (`tests/simcuda`), which the driver says (and `FERROCCL_DEBUG=INFO` logs); and a guard
/// that runs the tests of this process one at a time. Tests running at once would share
/// the GPU's context, and a free in one (`cuMemFree` waits for the whole device and
/// holds up the process's launches meanwhile) would hang another whose ranks wait for
/// each other's launches: on an H100, and on the simulated driver until its timeout.
fn gpu() -> Option<(Arc<CudaContext>, (u32, u32), OneAtATime)> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let real = common::real_gpu_or_simulated(SIMULATED_GPUS);
    let driver = cuda::driver().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(real, driver.simulated.is_none(), "{driver:?}");
    if let Some(what) = &driver.simulated {
        eprintln!("(on {what})");
    }
    assert!(cuda::device_count() > 0, "the driver sees no GPU");
    let arch = cuda::compute_capability(0).expect("compute capability");
    Some((
        CudaContext::new(0).expect("CUDA context on device 0"),
        arch,
        guard,
    ))
}

/// Whether the tests run on the simulated driver.
fn simulated() -> bool {
    cuda::driver().is_ok_and(|d| d.simulated.is_some())
}

fn module(
    ctx: &Arc<CudaContext>,
    source: &nvrtc::KernelSource,
    arch: (u32, u32),
) -> Arc<cudarc::driver::CudaModule> {
    let cubin = nvrtc::cubin(source, arch).unwrap_or_else(|e| panic!("{e}"));
    ctx.load_module(Ptx::from_binary(cubin.image.clone()))
        .expect("load the cubin")
}

fn bytes_of(dtype: DataType, n: usize, salt: u64) -> Vec<u8> {
    let mut out = vec![0u8; n * dtype.size()];
    for (i, e) in out.chunks_mut(dtype.size()).enumerate() {
        common::element_bytes(dtype, salt * 1_000_003 + i as u64, e);
    }
    out
}

#[test]
fn gpu_element_wise_kernels_equal_the_host_kernels() {
    let Some((ctx, arch, _one_at_a_time)) = gpu() else {
        return;
    };
    let stream = ctx.default_stream();
    let m = module(&ctx, &nvrtc::REDUCE, arch);
    let f = m.load_function("ferroccl_reduce").unwrap();
    let n = 4099usize;
    for dtype in DataType::ALL {
        for op in common::ops() {
            let k = Kernel::new(dtype, op, 4).unwrap();
            let (a, b) = (bytes_of(dtype, n, 1), bytes_of(dtype, n, 2));
            let mut want = vec![0u8; a.len()];
            // SAFETY: three buffers of n elements.
            unsafe { k.reduce(want.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n) };
            let (da, db) = (
                stream.clone_htod(&a).unwrap(),
                stream.clone_htod(&b).unwrap(),
            );
            let mut dd = stream.alloc_zeros::<u8>(a.len()).unwrap();
            let (nn, dt, redop, scalar) = (n as u64, dtype as u32, k.device_op(), k.scalar_bits());
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&mut dd)
                .arg(&da)
                .arg(&db)
                .arg(&nn)
                .arg(&dt)
                .arg(&redop)
                .arg(&scalar);
            // SAFETY: the arguments match `ferroccl_reduce`'s signature and sizes.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (8, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .unwrap();
            let got = stream.clone_dtoh(&dd).unwrap();
            let first = got.iter().zip(&want).position(|(g, w)| g != w);
            assert!(
                got == want,
                "{dtype} {op}: first difference at byte {first:?} of {}: got {:?}, want {:?}",
                got.len(),
                first.map(|i| &got[i..(i + 8).min(got.len())]),
                first.map(|i| &want[i..(i + 8).min(want.len())]),
            );
            assert!(
                got == want,
                "{dtype} {op}: the GPU's reduction differs from the host's"
            );
        }
    }
}

/// Runs each rank's all-reduce plan with `algorithm` on its own stream of the one GPU.
fn executor_all_reduce(
    ctx: &Arc<CudaContext>,
    arch: (u32, u32),
    n: usize,
    protocol: Protocol,
    algorithm: Algorithm,
) {
    let config = CommConfig {
        channels: 2,
        slot_bytes: 4096,
        chunk_bytes: 1024,
        algorithms: vec![algorithm],
        protocols: vec![Protocol::Simple],
        ..CommConfig::default()
    };
    let comms = Communicator::init_all_with(n, config).unwrap();
    let count = 100_003usize;
    let dtype = DataType::Float32;
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            (0..count)
                .map(|i| ((i * 3 + r) % 17) as f32 - 8.0)
                .collect()
        })
        .collect();
    let want: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, x)| {
                s.spawn(move || {
                    let mut out = vec![0f32; count];
                    c.all_reduce(x, &mut out, ReduceOp::Avg).unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let m = module(ctx, &nvrtc::EXECUTOR, arch);
    let f = m.load_function("ferroccl_execute").unwrap();
    let (slots, slot_bytes) = (
        8u32,
        if protocol == Protocol::LL {
            1024u32
        } else {
            256
        },
    );
    let streams: Vec<Arc<CudaStream>> = (0..n).map(|_| ctx.new_stream().unwrap()).collect();
    let s0 = &streams[0];
    // One FIFO per (channel, sender, receiver): counters, sizes, slots; zeroed.
    let mut fifo_mem = std::collections::HashMap::new();
    let mut keep = Vec::new();
    let mut works = Vec::new();
    for (r, comm) in comms.iter().enumerate() {
        let plan = comm.plan_for(Collective::AllReduce, count, dtype).unwrap();
        let laid = work::lay_out(&plan, &[protocol]).unwrap();
        let mut ends = Vec::new();
        for e in &laid.fifos {
            let key = if e.sends {
                (e.channel, r, e.peer)
            } else {
                (e.channel, e.peer, r)
            };
            let geometry = Geometry {
                slots: slots as usize,
                slot_bytes: slot_bytes as usize,
                protocol,
            };
            let mem = fifo_mem.entry(key).or_insert_with(|| {
                s0.alloc_zeros::<u8>(cuda_ipc::allocation_bytes(&geometry))
                    .unwrap()
            });
            let stage = s0.alloc_zeros::<u8>(slot_bytes as usize).unwrap();
            // The layout of transport::cuda_ipc, on memory of this test's own.
            ends.push(cuda_ipc::fifo_at(
                mem.device_ptr(s0).0,
                &geometry,
                stage.device_ptr(s0).0,
            ));
            keep.push(stage);
        }
        let input = s0.clone_htod(&inputs[r]).unwrap();
        let output = s0.alloc_zeros::<f32>(count).unwrap();
        let kernel = Kernel::new(dtype, ReduceOp::Avg, n).unwrap();
        let op = work::FcclOp::new(
            &kernel,
            true,
            input.device_ptr(s0).0 as *const _,
            output.device_ptr(s0).0 as *mut _,
            std::ptr::null_mut(),
        );
        let lanes = s0.clone_htod(&laid.lanes).unwrap();
        let steps = s0.clone_htod(&laid.steps).unwrap();
        let fifos = s0.clone_htod(&ends).unwrap();
        let ops = s0.clone_htod(&[op]).unwrap();
        let status = s0.alloc_zeros::<u32>(laid.lanes.len()).unwrap();
        let abort = s0.alloc_zeros::<u32>(1).unwrap();
        let w = work::FcclWork {
            lanes: lanes.device_ptr(s0).0 as *const _,
            steps: steps.device_ptr(s0).0 as *const _,
            fifos: fifos.device_ptr(s0).0 as *const _,
            ops: ops.device_ptr(s0).0 as *const _,
            status: status.device_ptr(s0).0 as *mut _,
            abort: abort.device_ptr(s0).0 as *const _,
            nlanes: laid.lanes.len() as u32,
            pad: 0,
        };
        works.push((w, input, output, status, (lanes, steps, fifos, ops, abort)));
    }
    s0.synchronize().unwrap();
    for ((w, ..), stream) in works.iter().zip(&streams) {
        let mut launch = stream.launch_builder(&f);
        launch.arg(w);
        let cfg = LaunchConfig {
            grid_dim: (w.nlanes, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the work's arrays and buffers are device memory that lives until the
        // streams are synchronised below.
        unsafe { launch.launch(cfg) }.unwrap();
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    for (r, (_, _, output, status, _)) in works.iter().enumerate() {
        let st = s0.clone_dtoh(status).unwrap();
        assert!(st.iter().all(|&s| s == 0), "rank {r}: lane status {st:?}");
        let got = s0.clone_dtoh(output).unwrap();
        assert!(
            got.iter()
                .map(|x| x.to_bits())
                .eq(want[r].iter().map(|x| x.to_bits())),
            "{n} ranks, {algorithm:?}, {protocol:?}: rank {r} differs from the host engine"
        );
    }
}

/// The ring, and recursive doubling (which device calls run when `FERROCCL_ALGO` asks
/// for it; 3 ranks hand over to a neighbour first): the other algorithms run through the
/// communicator's device calls below.
#[test]
fn gpu_executor_all_reduce_of_2_to_4_ranks_on_one_gpu_equals_the_host_engine() {
    let Some((ctx, arch, _one_at_a_time)) = gpu() else {
        return;
    };
    for algorithm in [Algorithm::Ring, Algorithm::Doubling] {
        for n in 2..=4 {
            for protocol in DEVICE_PROTOCOLS {
                executor_all_reduce(&ctx, arch, n, protocol, algorithm);
            }
        }
    }
}

/// The protocols of device calls (single copy is for host memory).
const DEVICE_PROTOCOLS: [Protocol; 2] = [Protocol::Simple, Protocol::LL];

/// Elements per rank of the device-path tests (a prime).
const COUNT: usize = 65_537;

/// Rank `r`'s input of `len` int32 elements.
fn int_input(r: usize, len: usize) -> Vec<i32> {
    (0..len).map(|i| (i * 31 + r * 7) as i32 - 1000).collect()
}

/// The element-wise sum of ranks `0..n`'s inputs of `len` elements: an all-reduce's
/// result.
fn int_sum(n: usize, len: usize) -> Vec<i32> {
    let inputs: Vec<Vec<i32>> = (0..n).map(|r| int_input(r, len)).collect();
    (0..len)
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect()
}

/// How a device-path check runs its calls.
#[derive(Clone, Copy, Debug)]
struct Shape {
    protocol: Protocol,
    channels: usize,
    /// In place, as NCCL defines it per collective (the input inside the output, or the
    /// output inside the input).
    in_place: bool,
}

impl Shape {
    fn of(protocol: Protocol) -> Self {
        Shape {
            protocol,
            channels: 2,
            in_place: false,
        }
    }
}

fn device_config(protocol: Protocol) -> CommConfig {
    config_of(Shape::of(protocol))
}

/// The communicators of these tests: `shape`'s channels and protocol, and a timeout far
/// above any call's time here (a second at most) but far below the default ten minutes,
/// so that a test whose rank fails ends soon with the failure rather than waiting.
fn config_of(shape: Shape) -> CommConfig {
    CommConfig {
        channels: shape.channels,
        device_channels: Some(shape.channels),
        protocols: vec![shape.protocol],
        timeout: std::time::Duration::from_secs(120),
        ..CommConfig::default()
    }
}

/// Whether rank `rank`'s output of `collective` means anything (a reduce's or gather's
/// receive buffer is the root's only).
fn output_significant(collective: Collective, rank: usize) -> bool {
    match collective {
        Collective::Reduce { root } | Collective::Gather { root } => rank == root,
        _ => true,
    }
}

/// Every rank's result of `collective` (sum) of [`COUNT`] int32 on the host engine.
fn host_results_of(n: usize, collective: Collective, shape: Shape) -> Vec<Vec<i32>> {
    let comms = Communicator::init_all_with(n, config_of(shape)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let (in_len, out_len) = collective.buffer_lens(COUNT, c.rank(), n);
                    let x = int_input(c.rank(), in_len);
                    let mut out = vec![0i32; out_len];
                    // SAFETY: buffers of the lengths the call uses.
                    unsafe {
                        c.collective_raw(
                            collective,
                            COUNT,
                            DataType::Int32,
                            ReduceOp::Sum,
                            x.as_ptr() as *const u8,
                            out.as_mut_ptr() as *mut u8,
                        )
                    }
                    .unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank's result of the same call on device memory through
/// `Communicator::enqueue_device`, rank `r` on `contexts[r]`'s GPU with a thread and a
/// stream of its own. With `blocked`, each stream is first held by a wait on a host flag:
/// the call must return while its stream cannot have run it (NCCL's stream semantics),
/// and the result appears once the flag is released.
fn device_results(
    contexts: &[Arc<CudaContext>],
    collective: Collective,
    protocol: Protocol,
    blocked: bool,
) -> Vec<Vec<i32>> {
    device_results_of(contexts, collective, Shape::of(protocol), blocked)
}

/// A new stream for each rank, made before the ranks' threads start. cudarc's first
/// stream of a context synchronises the whole context (`CudaContext::new_stream`, with
/// its event tracking on); made in a rank's thread, that waits for a peer's kernel, or a
/// stream the peer holds until its call returns, while they wait for this rank: a hang on
/// a GPU, and on the simulated driver (CI, 2026-11-30:
/// `gpu_a_call_returns_before_its_stream_runs_it`).
fn rank_streams<'a>(
    contexts: impl IntoIterator<Item = &'a Arc<CudaContext>>,
) -> Vec<Arc<CudaStream>> {
    contexts
        .into_iter()
        .map(|c| c.new_stream().unwrap())
        .collect()
}

/// Sets a flag the stream waits on when dropped, so that a rank whose thread fails
/// before releasing its stream leaves no stream waiting forever behind it.
struct Release<'a>(&'a cuda::MappedHostBuffer);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        // SAFETY: the mapped word the stream waits on.
        unsafe { std::ptr::write_volatile(self.0.host() as *mut u32, 1) };
    }
}

/// [`device_results`] in any [`Shape`].
fn device_results_of(
    contexts: &[Arc<CudaContext>],
    collective: Collective,
    shape: Shape,
    blocked: bool,
) -> Vec<Vec<i32>> {
    let n = contexts.len();
    let comms = Communicator::init_all_with(n, config_of(shape)).unwrap();
    let streams = rank_streams(contexts);
    // No rank frees its memory until every rank's call has finished: a free waits for
    // the whole device, and blocks this process's other launches meanwhile (with NCCL
    // too), so a rank freeing while a peer has yet to launch hangs on a GPU. The ranks
    // hand their memory back here, to be freed once every thread has ended (a barrier
    // would wait forever for a rank whose thread failed).
    let ranks: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(contexts)
            .zip(streams)
            .map(|((c, ctx), stream)| {
                s.spawn(move || {
                    ctx.bind_to_thread().unwrap();
                    let rank = c.rank();
                    let (in_len, out_len) = collective.buffer_lens(COUNT, rank, n);
                    let input = int_input(rank, in_len);
                    // Where the input and the output lie: two buffers, or one (in place).
                    let inside_output = collective.input_in_output(COUNT, rank);
                    let inside_input = collective.output_in_input(COUNT, rank);
                    let (one, input_at, output_at, result_at) =
                        match (shape.in_place, inside_output, inside_input) {
                            (true, Some(at), _) => {
                                let mut init = vec![0i32; out_len.max(at + in_len).max(1)];
                                init[at..at + in_len].copy_from_slice(&input);
                                (Some(init), at, 0, 0)
                            }
                            (true, None, Some(at)) => (Some(input.clone()), 0, at, at),
                            _ => (None, 0, 0, 0),
                        };
                    let (x, out) = match one {
                        Some(init) => (None, stream.clone_htod(&init).unwrap()),
                        None => (
                            Some(stream.clone_htod(&int_input(rank, in_len.max(1))).unwrap()),
                            stream.alloc_zeros::<i32>(out_len.max(1)).unwrap(),
                        ),
                    };
                    let base_out = out.device_ptr(&stream).0;
                    let base_in = x.as_ref().map_or(base_out, |x| x.device_ptr(&stream).0);
                    let flag = cuda::MappedHostBuffer::zeroed(4).unwrap();
                    let release = Release(&flag);
                    if blocked {
                        // SAFETY: a mapped host word; the stream waits until it is 1.
                        let rc = unsafe {
                            cudarc::driver::sys::cuStreamWaitValue32_v2(
                                stream.cu_stream(),
                                flag.device(),
                                1,
                                0,
                            )
                        };
                        assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
                    }
                    let call = ferroccl::comm::RawCall {
                        collective,
                        count: COUNT,
                        dtype: DataType::Int32,
                        op: ReduceOp::Sum,
                        input: (base_in + 4 * input_at as u64) as *const u8,
                        output: (base_out + 4 * output_at as u64) as *mut u8,
                    };
                    // SAFETY: device buffers of the lengths the call uses, kept until
                    // the stream is synchronised below.
                    unsafe {
                        c.enqueue_device(&[call], stream.cu_stream() as *mut std::ffi::c_void)
                    }
                    .unwrap();
                    if blocked {
                        // The call returned with its stream held: nothing of it ran.
                        // SAFETY: a live stream.
                        let rc = unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) };
                        assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY);
                    }
                    drop(release);
                    stream.synchronize().unwrap();
                    c.synchronize_device().unwrap();
                    let v = stream.clone_dtoh(&out).unwrap();
                    (v[result_at..result_at + out_len].to_vec(), (x, out, flag))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    let mut results = Vec::with_capacity(n);
    for (rank, r) in ranks.into_iter().enumerate() {
        match r {
            Ok((v, _memory)) => results.push(v),
            Err(_) => panic!("rank {rank}'s thread failed (its message is above)"),
        }
    }
    results
}

fn check_device_collective(
    contexts: &[Arc<CudaContext>],
    collective: Collective,
    protocol: Protocol,
    blocked: bool,
) {
    check_device_shape(contexts, collective, Shape::of(protocol), blocked);
}

fn check_device_shape(
    contexts: &[Arc<CudaContext>],
    collective: Collective,
    shape: Shape,
    blocked: bool,
) {
    let n = contexts.len();
    let want = host_results_of(n, collective, shape);
    let got = device_results_of(contexts, collective, shape, blocked);
    for r in (0..n).filter(|&r| output_significant(collective, r)) {
        assert!(
            got[r] == want[r],
            "{collective} on {n} ranks, {shape:?}: rank {r} differs from the host engine"
        );
    }
}

#[test]
fn gpu_communicator_collectives_on_device_memory_equal_the_host_engine() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    for n in 2..=4 {
        let contexts = vec![ctx.clone(); n];
        for collective in Collective::every(n)
            .into_iter()
            .filter(|c| c.root().is_none_or(|r| r == n - 1))
        {
            for protocol in DEVICE_PROTOCOLS {
                check_device_collective(&contexts, collective, protocol, false);
            }
        }
    }
}

#[test]
fn gpu_a_call_returns_before_its_stream_runs_it() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    check_device_collective(
        &[ctx.clone(), ctx],
        Collective::AllReduce,
        Protocol::Simple,
        true,
    );
}

#[test]
fn gpu_every_pair_of_gpus_runs_the_collectives() {
    let Some(_one_at_a_time) = gpu() else { return };
    let devices = cuda::device_count();
    if devices < 2 {
        eprintln!("\n*** SKIPPED (one GPU here): GPU pairs need two devices ***\n");
        return;
    }
    let contexts: Vec<_> = (0..devices).map(|d| CudaContext::new(d).unwrap()).collect();
    for a in 0..devices {
        for b in a + 1..devices {
            let pair = [contexts[a].clone(), contexts[b].clone()];
            for collective in [
                Collective::AllReduce,
                Collective::AllGather,
                Collective::ReduceScatter,
            ] {
                for protocol in DEVICE_PROTOCOLS {
                    check_device_collective(&pair, collective, protocol, false);
                }
            }
        }
    }
}

#[test]
fn gpu_ferroccl_and_nvidia_nccl_agree_bit_for_bit_on_integer_data() {
    use std::ffi::{c_int, c_void};
    let Some(_one_at_a_time) = gpu() else { return };
    if simulated() {
        eprintln!(
            "\n*** SKIPPED (needs real silicon): NVIDIA's NCCL runs only on a GPU, not on the \
             simulated driver ***\n"
        );
        return;
    }
    // NCCL takes one rank per GPU (it refuses two on one: "Duplicate GPU detected").
    let n = cuda::device_count();
    let contexts: Vec<_> = (0..n).map(|d| CudaContext::new(d).unwrap()).collect();
    let lib_path = common::nvidia_lib("nccl").join("libnccl.so.2");
    // SAFETY: NVIDIA's NCCL, loaded by path; each symbol is typed with nccl.h's signature.
    let lib = unsafe { libloading::Library::new(&lib_path) }.expect("load NVIDIA's libnccl.so.2");
    type InitAll = unsafe extern "C" fn(*mut *mut c_void, c_int, *const c_int) -> c_int;
    type AllReduce = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        *mut c_void,
        *mut c_void,
    ) -> c_int;
    type NoArgs = unsafe extern "C" fn() -> c_int;
    type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
    // SAFETY: lookups with the signatures above.
    let (init_all, all_reduce, group_start, group_end, destroy) = unsafe {
        (
            *lib.get::<InitAll>(b"ncclCommInitAll").unwrap(),
            *lib.get::<AllReduce>(b"ncclAllReduce").unwrap(),
            *lib.get::<NoArgs>(b"ncclGroupStart").unwrap(),
            *lib.get::<NoArgs>(b"ncclGroupEnd").unwrap(),
            *lib.get::<Destroy>(b"ncclCommDestroy").unwrap(),
        )
    };
    let mut comms = vec![std::ptr::null_mut(); n];
    let devs: Vec<c_int> = (0..n as c_int).collect();
    // SAFETY: n handles to fill, n device ordinals.
    assert_eq!(
        unsafe { init_all(comms.as_mut_ptr(), n as c_int, devs.as_ptr()) },
        0
    );
    let streams: Vec<_> = contexts.iter().map(|c| c.new_stream().unwrap()).collect();
    let inputs: Vec<_> = (0..n)
        .map(|r| streams[r].clone_htod(&int_input(r, COUNT)).unwrap())
        .collect();
    let outputs: Vec<_> = (0..n)
        .map(|r| streams[r].alloc_zeros::<i32>(COUNT).unwrap())
        .collect();
    // SAFETY: NCCL's group of one all-reduce per device (ncclInt32 = 2, ncclSum = 0) on
    // device buffers of COUNT elements, each on its device's stream.
    unsafe {
        assert_eq!(group_start(), 0);
        for r in 0..n {
            contexts[r].bind_to_thread().unwrap();
            let rc = all_reduce(
                inputs[r].device_ptr(&streams[r]).0 as *const c_void,
                outputs[r].device_ptr(&streams[r]).0 as *mut c_void,
                COUNT,
                2,
                0,
                comms[r],
                streams[r].cu_stream() as *mut c_void,
            );
            assert_eq!(rc, 0);
        }
        assert_eq!(group_end(), 0);
    }
    let nccl: Vec<Vec<i32>> = (0..n)
        .map(|r| {
            streams[r].synchronize().unwrap();
            streams[r].clone_dtoh(&outputs[r]).unwrap()
        })
        .collect();
    for c in comms {
        // SAFETY: a communicator made above, destroyed once.
        unsafe { destroy(c) };
    }
    for protocol in DEVICE_PROTOCOLS {
        let ours = device_results(&contexts, Collective::AllReduce, protocol, false);
        assert!(
            ours == nccl,
            "{n} ranks, {protocol:?}: ferroccl's all-reduce differs from NCCL's"
        );
    }
}

/// A communicator of `n` ranks on GPU 0 of this process with a short timeout.
fn short_timeout_comms(n: usize, timeout: std::time::Duration) -> Vec<Communicator> {
    let config = CommConfig {
        timeout,
        ..device_config(Protocol::Simple)
    };
    Communicator::init_all_with(n, config).unwrap()
}

/// An all-reduce (sum) of `x`'s int32 elements into `out` on `stream`.
///
/// # Safety
/// `x` and `out` are device buffers of the same length of `stream`'s context, kept by
/// the caller until the stream has passed the call.
unsafe fn enqueue_all_reduce(
    c: &Communicator,
    x: &cudarc::driver::CudaSlice<i32>,
    out: &mut cudarc::driver::CudaSlice<i32>,
    stream: &Arc<CudaStream>,
) -> ferroccl::Result<()> {
    let call = ferroccl::comm::RawCall {
        collective: Collective::AllReduce,
        count: x.len(),
        dtype: DataType::Int32,
        op: ReduceOp::Sum,
        input: x.device_ptr(stream).0 as *const u8,
        output: out.device_ptr(stream).0 as *mut u8,
    };
    // SAFETY: forwarded from the caller.
    unsafe { c.enqueue_device(&[call], stream.cu_stream() as *mut std::ffi::c_void) }
}

/// Rank `c`'s all-reduce of [`COUNT`] int32 on `stream` (of `ctx`, made by
/// [`rank_streams`]), waited for: the outcome `synchronize_device` reports, and the output.
fn all_reduce_on_a_stream_of_its_own(
    ctx: &Arc<CudaContext>,
    stream: Arc<CudaStream>,
    c: &Communicator,
) -> (ferroccl::Result<()>, Vec<i32>) {
    ctx.bind_to_thread().unwrap();
    let x = stream.clone_htod(&int_input(c.rank(), COUNT)).unwrap();
    let mut out = stream.alloc_zeros::<i32>(COUNT).unwrap();
    // SAFETY: buffers of COUNT elements, kept until the stream is synchronised.
    if let Err(e) = unsafe { enqueue_all_reduce(c, &x, &mut out, &stream) } {
        return (Err(e), Vec::new());
    }
    stream.synchronize().unwrap();
    let outcome = c.synchronize_device();
    (outcome, stream.clone_dtoh(&out).unwrap())
}

/// One all-reduce by every rank of `comms`, each on a stream of its own on `ctx`'s GPU,
/// so that their FIFOs are connected; checked.
fn warm_up(ctx: &Arc<CudaContext>, comms: &[Communicator]) {
    let n = comms.len();
    let streams = rank_streams(vec![ctx; n]);
    std::thread::scope(|s| {
        for (c, stream) in comms.iter().zip(streams) {
            s.spawn(move || {
                let (outcome, got) = all_reduce_on_a_stream_of_its_own(ctx, stream, c);
                outcome.unwrap();
                assert_eq!(got, int_sum(n, COUNT));
            });
        }
    });
}

/// A rank whose peer never makes its call: the user's own stream synchronisation returns
/// once the communicator's timeout has passed (the watchdog tells the executor to stop
/// waiting, with nobody calling `synchronize_device`), and the next call names the
/// timeout.
#[test]
fn gpu_a_stream_held_by_a_peer_that_never_calls_is_given_back_after_the_timeout() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    let timeout = std::time::Duration::from_secs(2);
    let comms = short_timeout_comms(2, timeout);
    let stream = ctx.new_stream().unwrap();
    let x = stream.clone_htod(&int_input(0, COUNT)).unwrap();
    let mut out = stream.alloc_zeros::<i32>(COUNT).unwrap();
    warm_up(&ctx, &comms);
    let started = std::time::Instant::now();
    // SAFETY: buffers of COUNT elements, kept until the stream is synchronised.
    unsafe { enqueue_all_reduce(&comms[0], &x, &mut out, &stream) }.unwrap();
    stream.synchronize().unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= timeout && waited < timeout * 5,
        "the stream came back after {waited:?} (timeout {timeout:?})"
    );
    let err = comms[0].synchronize_device().unwrap_err();
    assert!(
        matches!(err, ferroccl::Error::Timeout { .. }) && err.to_string().contains("all_reduce"),
        "{err}"
    );
}

/// Two ranks of one communicator on one stream would wait on each other forever: the
/// second is refused with an error that says so, and the first's stream comes back after
/// the timeout.
#[test]
fn gpu_two_ranks_on_one_stream_are_refused() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    let timeout = std::time::Duration::from_secs(2);
    let comms = short_timeout_comms(2, timeout);
    warm_up(&ctx, &comms);
    let stream = ctx.new_stream().unwrap();
    let xs: Vec<_> = (0..2)
        .map(|r| stream.clone_htod(&int_input(r, COUNT)).unwrap())
        .collect();
    let mut outs: Vec<_> = (0..2)
        .map(|_| stream.alloc_zeros::<i32>(COUNT).unwrap())
        .collect();
    let (first, second) = outs.split_at_mut(1);
    // SAFETY: buffers of COUNT elements, kept until the stream is synchronised.
    unsafe { enqueue_all_reduce(&comms[0], &xs[0], &mut first[0], &stream) }.unwrap();
    // SAFETY: as above.
    let err = unsafe { enqueue_all_reduce(&comms[1], &xs[1], &mut second[0], &stream) }
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ranks 0 and 1") && err.contains("same CUDA stream"),
        "{err}"
    );
    stream.synchronize().unwrap();
    assert!(comms[0].synchronize_device().is_err());
}

/// A call on a stream being captured into a CUDA graph is refused, saying why, and the
/// communicator still works afterwards.
#[test]
fn gpu_a_capturing_stream_is_refused_clearly() {
    use cudarc::driver::sys;
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    let comms = short_timeout_comms(1, std::time::Duration::from_secs(30));
    let stream = ctx.new_stream().unwrap();
    let x = stream.clone_htod(&int_input(0, COUNT)).unwrap();
    let mut out = stream.alloc_zeros::<i32>(COUNT).unwrap();
    stream.synchronize().unwrap();
    // Raw addresses, taken before the capture (cudarc's own stream ordering would queue
    // event waits into it).
    let call = ferroccl::comm::RawCall {
        collective: Collective::AllReduce,
        count: COUNT,
        dtype: DataType::Int32,
        op: ReduceOp::Sum,
        input: x.device_ptr(&stream).0 as *const u8,
        output: out.device_ptr_mut(&stream).0 as *mut u8,
    };
    stream.synchronize().unwrap();
    let raw_stream = stream.cu_stream() as *mut std::ffi::c_void;
    // SAFETY: a live stream of the current context.
    let rc = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream.cu_stream(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: buffers of COUNT elements of this stream's context.
    let err = unsafe { comms[0].enqueue_device(&[call], raw_stream) }
        .unwrap_err()
        .to_string();
    assert!(err.contains("captured into a CUDA graph"), "{err}");
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun above; nothing was queued in it.
    let rc = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: as above, outside the capture now.
    unsafe { comms[0].enqueue_device(&[call], raw_stream) }.unwrap();
    stream.synchronize().unwrap();
    comms[0].synchronize_device().unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), int_input(0, COUNT));
}

/// A thread with no current context gets an error naming what to do, and no context is
/// made for it on GPU 0 behind its back.
#[test]
fn gpu_a_thread_without_a_context_is_told_so() {
    let Some(_one_at_a_time) = gpu() else { return };
    std::thread::spawn(|| {
        let err = cuda::DeviceBuffer::zeroed(64).unwrap_err().to_string();
        assert!(err.contains("no CUDA context is current"), "{err}");
        assert!(cuda::current_context().unwrap().is_none());
    })
    .join()
    .unwrap();
}

/// Every collective with every root on 3 ranks of one GPU (threads of this process),
/// both protocols on 1 and 2 channels, in place and not: every rank's result equals the
/// host engine's.
#[test]
fn gpu_every_collective_and_root_both_protocols_channels_and_places() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    let contexts = vec![ctx.clone(); 3];
    for collective in Collective::every(3) {
        for (protocol, channels) in [
            (Protocol::LL, 1),
            (Protocol::Simple, 1),
            (Protocol::LL, 2),
            (Protocol::Simple, 2),
        ] {
            for in_place in [false, true] {
                let shape = Shape {
                    protocol,
                    channels,
                    in_place,
                };
                check_device_shape(&contexts, collective, shape, false);
            }
        }
    }
}

/// Calls of different sizes back to back on one stream, then a call on a second stream
/// ordered after them by an event, whose input is the first calls' output: the launcher
/// orders a rank's launches whatever their streams, and the user's event orders the data.
#[test]
fn gpu_back_to_back_calls_of_different_sizes_and_streams_joined_by_events() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    let n = 2;
    let comms = Communicator::init_all_with(n, device_config(Protocol::Simple)).unwrap();
    let sizes = [1usize, 4099, COUNT, 17];
    let sum_of = |len: usize, times: i32| -> Vec<i32> {
        int_sum(n, len).iter().map(|x| x * times).collect()
    };
    let streams = rank_streams(vec![&ctx; 2 * n]);
    std::thread::scope(|s| {
        for (c, pair) in comms.iter().zip(streams.chunks(2)) {
            let ctx = &ctx;
            s.spawn(move || {
                ctx.bind_to_thread().unwrap();
                let (first, second) = (&pair[0], &pair[1]);
                let mut outs = Vec::new();
                for &len in &sizes {
                    let x = first.clone_htod(&int_input(c.rank(), len)).unwrap();
                    let mut out = first.alloc_zeros::<i32>(len).unwrap();
                    // SAFETY: buffers of `len` elements, kept until the streams finish.
                    unsafe { enqueue_all_reduce(c, &x, &mut out, first) }.unwrap();
                    outs.push((x, out));
                }
                // The second stream waits for the first (an event), then all-reduces the
                // third call's result again: every rank gets n times the sum.
                let joined = first.record_event(None).unwrap();
                second.wait(&joined).unwrap();
                let (_, ref third) = outs[2];
                let mut again = second.alloc_zeros::<i32>(COUNT).unwrap();
                // SAFETY: as above.
                unsafe { enqueue_all_reduce(c, third, &mut again, second) }.unwrap();
                second.synchronize().unwrap();
                first.synchronize().unwrap();
                c.synchronize_device().unwrap();
                for (&len, (_, out)) in sizes.iter().zip(&outs) {
                    assert_eq!(first.clone_dtoh(out).unwrap(), sum_of(len, 1), "size {len}");
                }
                assert_eq!(second.clone_dtoh(&again).unwrap(), sum_of(COUNT, n as i32));
            });
        }
    });
}

/// Every pair of GPUs, whether or not the driver gives them P2P: where it does not
/// (`FERROCCL_SIM_P2P=none`, as on many cloud VMs), the FIFOs between them are staged
/// through page-locked host memory; the results are the host engine's either way.
#[test]
fn gpu_two_gpus_with_or_without_p2p_give_the_host_engines_results() {
    let Some(_one_at_a_time) = gpu() else { return };
    if cuda::device_count() < 2 {
        eprintln!("\n*** SKIPPED (one GPU here): P2P needs two devices ***\n");
        return;
    }
    let contexts: Vec<_> = (0..2).map(|d| CudaContext::new(d).unwrap()).collect();
    let p2p = cuda::can_access_peer(0, 1).unwrap();
    eprintln!("GPUs 0 and 1: P2P {p2p}");
    for collective in [Collective::AllReduce, Collective::ReduceScatter] {
        for protocol in DEVICE_PROTOCOLS {
            check_device_collective(&contexts, collective, protocol, false);
        }
    }
}

/// Two GPUs without P2P: the FIFOs between them are staged through shared host memory,
/// whose names go from `/dev/shm` as soon as both sides have mapped them (the
/// communicators still live), and at once where registering the memory with the driver
/// fails (`FERROCCL_SIM_FAIL=cuMemHostRegister_v2`: the call fails naming it). Run by
/// [`gpu_other_simulated_machines`] on such machines.
#[test]
fn gpu_staged_fifos_leave_no_names_in_dev_shm() {
    let Some(_one_at_a_time) = gpu() else { return };
    if cuda::device_count() < 2 || cuda::can_access_peer(0, 1).unwrap() {
        eprintln!("\n*** SKIPPED (no two GPUs without P2P here): nothing is staged ***\n");
        return;
    }
    let failing = std::env::var("FERROCCL_SIM_FAIL").as_deref() == Ok("cuMemHostRegister_v2");
    let contexts: Vec<_> = (0..2).map(|d| CudaContext::new(d).unwrap()).collect();
    let comms = Communicator::init_all_with(2, config_of(Shape::of(Protocol::Simple))).unwrap();
    let streams = rank_streams(&contexts);
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&contexts)
            .zip(streams)
            .map(|((c, ctx), stream)| {
                s.spawn(move || all_reduce_on_a_stream_of_its_own(ctx, stream, c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (outcome, got)) in outcomes.iter().enumerate() {
        match outcome {
            Ok(()) => assert!(!failing && *got == int_sum(2, COUNT), "rank {rank}"),
            Err(e) => assert!(
                failing && e.to_string().contains("cuMemHostRegister"),
                "{e}"
            ),
        }
    }
    let left: Vec<_> = ferroccl::transport::segment::shm_entries_of(&[std::process::id()])
        .into_iter()
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.is_empty(),
        "left in /dev/shm while the communicators live: {left:?}"
    );
    eprintln!("staged FIFOs (registering them fails: {failing}): no names left");
    drop(comms);
}

/// Two ranks on one GPU whose kernels must run at the same time: where the GPU can hold
/// only one block at once (`FERROCCL_SIM_RESIDENT_BLOCKS=1`), the second waits for the
/// first, which waits for the second; the timeout gives both streams back with an error
/// instead of a hang. With room for both, the call succeeds.
#[test]
fn gpu_kernels_that_cannot_be_resident_together_fail_within_the_timeout() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    let one_block = std::env::var("FERROCCL_SIM_RESIDENT_BLOCKS").as_deref() == Ok("1");
    // The ring, whose kernels wait on each other at every step (the cost model's
    // pipeline-fill term now gives 2 ranks the one-shot at this size).
    let config = CommConfig {
        timeout: std::time::Duration::from_secs(3),
        algorithms: vec![ferroccl::plan::Algorithm::Ring],
        ..config_of(Shape {
            protocol: Protocol::Simple,
            channels: 1,
            in_place: false,
        })
    };
    let comms = Communicator::init_all_with(2, config).unwrap();
    let streams = rank_streams([&ctx, &ctx]);
    let started = std::time::Instant::now();
    let outcomes: Vec<ferroccl::Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(streams)
            .map(|(c, stream)| {
                let ctx = &ctx;
                s.spawn(move || all_reduce_on_a_stream_of_its_own(ctx, stream, c).0)
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if one_block {
        assert!(outcomes.iter().all(|o| o.is_err()), "{outcomes:?}");
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    } else {
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    }
}

/// A context synchronised while one of its streams waits on a flag that only a later
/// call would set: a hang on a GPU (cudarc's first stream of a context synchronises it,
/// and `gpu_a_call_returns_before_its_stream_runs_it` hung so in CI, 2026-11-30); the
/// simulated driver fails the call after `FERROCCL_SIM_SYNC_TIMEOUT_S` and names the
/// hang. Run by [`gpu_other_simulated_machines`] with a timeout of 1 s (the default 60
/// would idle the test run). Once the flag is set, the stream drains and the context
/// synchronises.
#[test]
fn gpu_a_context_synchronised_behind_a_held_stream_is_called_a_hang() {
    let Some((ctx, _, _one_at_a_time)) = gpu() else {
        return;
    };
    if !simulated() || std::env::var_os("FERROCCL_SIM_SYNC_TIMEOUT_S").is_none() {
        eprintln!(
            "run by gpu_other_simulated_machines on the simulated driver with a short \
             timeout (on a GPU this test would hang)"
        );
        return;
    }
    use cudarc::driver::sys::{CUresult, cuCtxSynchronize, cuStreamWaitValue32_v2};
    ctx.bind_to_thread().unwrap();
    let stream = rank_streams([&ctx]).remove(0);
    let flag = cuda::MappedHostBuffer::zeroed(4).unwrap();
    let release = Release(&flag);
    // SAFETY: a mapped host word; the stream waits until it is 1.
    let rc = unsafe { cuStreamWaitValue32_v2(stream.cu_stream(), flag.device(), 1, 0) };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
    let started = std::time::Instant::now();
    // SAFETY: this thread's context is `ctx`'s.
    let rc = unsafe { cuCtxSynchronize() };
    assert_eq!(rc, CUresult::CUDA_ERROR_ILLEGAL_STATE);
    let waited = started.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(900) && waited.as_secs() < 30,
        "gave up after {waited:?}"
    );
    drop(release);
    stream.synchronize().unwrap();
    // SAFETY: as above.
    let rc = unsafe { cuCtxSynchronize() };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
    println!("the context synchronised once the flag was set");
}

/// The tests above again on other simulated machines (a child process each, as the
/// driver reads its configuration once): 2 GPUs, 1 GPU, 2 GPUs without P2P (FIFOs
/// staged through host memory; then also with registering that memory failing), GPUs
/// that hold one block at a time, and waits for queued work that give up after 1 s.
#[test]
fn gpu_other_simulated_machines() {
    let Some(_one_at_a_time) = gpu() else { return };
    if !simulated() {
        return;
    }
    // (test, environment, what its output must show)
    type Run = (
        &'static str,
        &'static [(&'static str, &'static str)],
        &'static str,
    );
    let runs: [Run; 8] = [
        (
            "gpu_every_pair_of_gpus_runs_the_collectives",
            &[("FERROCCL_SIM_GPUS", "2")],
            "1 passed",
        ),
        (
            "gpu_every_pair_of_gpus_runs_the_collectives",
            &[("FERROCCL_SIM_GPUS", "1")],
            "SKIPPED (one GPU here)",
        ),
        (
            "gpu_communicator_collectives_on_device_memory_equal_the_host_engine",
            &[("FERROCCL_SIM_GPUS", "1")],
            "1 passed",
        ),
        (
            "gpu_two_gpus_with_or_without_p2p_give_the_host_engines_results",
            &[("FERROCCL_SIM_GPUS", "2"), ("FERROCCL_SIM_P2P", "none")],
            "P2P false",
        ),
        (
            "gpu_kernels_that_cannot_be_resident_together_fail_within_the_timeout",
            &[("FERROCCL_SIM_RESIDENT_BLOCKS", "1")],
            "1 passed",
        ),
        (
            "gpu_staged_fifos_leave_no_names_in_dev_shm",
            &[("FERROCCL_SIM_GPUS", "2"), ("FERROCCL_SIM_P2P", "none")],
            "(registering them fails: false): no names left",
        ),
        (
            "gpu_staged_fifos_leave_no_names_in_dev_shm",
            &[
                ("FERROCCL_SIM_GPUS", "2"),
                ("FERROCCL_SIM_P2P", "none"),
                ("FERROCCL_SIM_FAIL", "cuMemHostRegister_v2"),
            ],
            "(registering them fails: true): no names left",
        ),
        (
            "gpu_a_context_synchronised_behind_a_held_stream_is_called_a_hang",
            &[("FERROCCL_SIM_SYNC_TIMEOUT_S", "1")],
            "the context synchronised once the flag was set",
        ),
    ];
    for (test, envs, expect) in runs {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .envs(envs.iter().copied())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains(expect),
            "{test} with {envs:?}:\n{text}"
        );
        eprintln!("{test} with {envs:?}: ok");
    }
}
