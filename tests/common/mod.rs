//! Shared by the collective tests: typed calls of every collective, in place or not,
//! checked against the serial reference of `ferroccl::perf::check`.

#![allow(dead_code)]

pub use ferroccl::perf::check::{expected, input, ops};
use ferroccl::plan::Collective;
use ferroccl::transport::window::SharedMemory;
use ferroccl::{Communicator, Element, ReduceOp};

/// Runs `c` on `comm` with typed buffers (in place or not) and checks the output
/// against the reference. Returns a description of the first wrong element, if any.
pub fn run_and_check<T: Element + Default>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    run_and_check_in::<T>(comm, c, op, count, in_place, None)
}

/// [`run_and_check`] with the call's buffers in `arena` (a window of `comm`, say) when
/// one is given: the data is copied in before the call and out after it.
pub fn run_and_check_in<T: Element + Default>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    mut arena: Option<&mut SharedMemory>,
) -> Result<(), String> {
    let (n, rank) = (comm.size(), comm.rank());
    let data_op = c.is_reducing().then_some(op);
    let (in_len, out_len) = c.buffer_lens(count, rank, n);
    // Inputs: reductions use the op's data; movement collectives use raw data, laid out
    // so that rank r's element i is value(r, i).
    let mine: Vec<T> = input(data_op, n, rank, in_len.max(count * n));
    let fail = |e: ferroccl::Error| format!("{c} {op} count {count} in_place {in_place}: {e}");
    let got: Vec<T> = if in_place {
        match (
            c.input_in_output(count, rank),
            c.output_in_input(count, rank),
        ) {
            (_, Some(at)) => {
                let mut buf = mine[..in_len].to_vec();
                placed(arena.as_deref_mut(), &mut buf, &mut [], |b, _| {
                    call_in_place(comm, c, op, b)
                })
                .map_err(fail)?;
                buf[at..at + out_len].to_vec()
            }
            (Some(at), _) => {
                let mut buf = vec![T::default(); out_len.max(at + in_len)];
                buf[at..at + in_len].copy_from_slice(&mine[..in_len]);
                placed(arena.as_deref_mut(), &mut buf, &mut [], |b, _| {
                    call_in_place(comm, c, op, b)
                })
                .map_err(fail)?;
                buf[..out_len].to_vec()
            }
            (None, None) => {
                let mut buf = mine[..in_len.max(out_len)].to_vec();
                placed(arena.as_deref_mut(), &mut buf, &mut [], |b, _| {
                    call_in_place(comm, c, op, b)
                })
                .map_err(fail)?;
                buf[..out_len].to_vec()
            }
        }
    } else {
        let mut send = mine[..in_len].to_vec();
        let mut recv = vec![T::default(); out_len];
        placed(arena, &mut send, &mut recv, |s, r| call(comm, c, op, s, r)).map_err(fail)?;
        recv
    };
    if let Some(want) = expected::<T>(c, op, count, n, rank) {
        if got.len() != want.len() {
            return Err(format!(
                "{c} {op}: output of {} elements, want {}",
                got.len(),
                want.len()
            ));
        }
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            return Err(format!(
                "{c} {} {op} count {count} in_place {in_place} rank {rank}/{n}: element {i} is \
                 {:?}, want {:?}",
                T::DTYPE,
                got[i],
                want[i]
            ));
        }
    }
    Ok(())
}

/// Runs `f` on `a` and `b`, or, with an arena, on copies of them laid one after the
/// other at its start, copied back after.
fn placed<T: Element, R>(
    arena: Option<&mut SharedMemory>,
    a: &mut [T],
    b: &mut [T],
    f: impl FnOnce(&mut [T], &mut [T]) -> R,
) -> R {
    let Some(arena) = arena else {
        return f(a, b);
    };
    let b_at = std::mem::size_of_val(a).next_multiple_of(64);
    assert!(
        b_at + std::mem::size_of_val(b) <= arena.len(),
        "the arena's {} bytes are too few for this call",
        arena.len()
    );
    let base = arena.as_mut_slice().as_mut_ptr();
    // SAFETY: two disjoint ranges of the arena (checked to fit; page-aligned base and a
    // 64-byte aligned offset suit every element type), borrowed through `arena`.
    let (pa, pb) = unsafe {
        (
            std::slice::from_raw_parts_mut(base.cast::<T>(), a.len()),
            std::slice::from_raw_parts_mut(base.add(b_at).cast::<T>(), b.len()),
        )
    };
    pa.copy_from_slice(a);
    pb.copy_from_slice(b);
    let result = f(pa, pb);
    a.copy_from_slice(pa);
    b.copy_from_slice(pb);
    result
}

fn call<T: Element>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    send: &[T],
    recv: &mut [T],
) -> ferroccl::Result<()> {
    match c {
        Collective::AllReduce => comm.all_reduce(send, recv, op),
        Collective::Broadcast { root } => comm.broadcast(send, recv, root),
        Collective::Reduce { root } => comm.reduce(send, recv, op, root),
        Collective::AllGather => comm.all_gather(send, recv),
        Collective::ReduceScatter => comm.reduce_scatter(send, recv, op),
        Collective::AllToAll => comm.all_to_all(send, recv),
        Collective::Gather { root } => comm.gather(send, recv, root),
        Collective::Scatter { root } => comm.scatter(send, recv, root),
        Collective::Send { peer } => comm.send(send, peer),
        Collective::Recv { peer } => comm.recv(recv, peer),
    }
}

fn call_in_place<T: Element>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    buf: &mut [T],
) -> ferroccl::Result<()> {
    match c {
        Collective::AllReduce => comm.all_reduce_in_place(buf, op),
        Collective::Broadcast { root } => comm.broadcast_in_place(buf, root),
        Collective::Reduce { root } => comm.reduce_in_place(buf, op, root),
        Collective::AllGather => comm.all_gather_in_place(buf),
        Collective::ReduceScatter => comm.reduce_scatter_in_place(buf, op),
        Collective::Gather { .. } | Collective::Scatter { .. } => {
            // In place as NCCL defines it: the root's buffer holds both sides.
            let (n, rank) = (comm.size(), comm.rank());
            let count = match c {
                Collective::Gather { root } if rank == root => buf.len() / n,
                Collective::Scatter { root } if rank == root => buf.len() / n,
                _ => buf.len(),
            };
            let base = buf.as_mut_ptr() as *mut u8;
            let elem = std::mem::size_of::<T>();
            let (input, output) = match (
                c.input_in_output(count, rank),
                c.output_in_input(count, rank),
            ) {
                (Some(at), _) => (base.wrapping_add(at * elem) as *const u8, base),
                (_, Some(at)) => (base as *const u8, base.wrapping_add(at * elem)),
                _ => (base as *const u8, base),
            };
            // SAFETY: `buf` holds the whole in-place layout for this rank (the caller
            // sized it from `buffer_lens`), borrowed mutably for the call.
            unsafe { comm.collective_raw(c, count, T::DTYPE, ReduceOp::Sum, input, output) }
        }
        Collective::AllToAll | Collective::Send { .. } | Collective::Recv { .. } => {
            unreachable!("no in-place form")
        }
    }
}

/// One checked call: collective, dtype, op, count, in place.
pub type Call = (Collective, ferroccl::DataType, ReduceOp, usize, bool);

/// Every checked call of collective `c` over `dtypes` × ops (every op for reductions,
/// sum otherwise) × `counts` × out of place and in place (where the collective has an
/// in-place form).
pub fn calls_of(c: Collective, dtypes: &[ferroccl::DataType], counts: &[usize]) -> Vec<Call> {
    let op_list = if c.is_reducing() {
        ops().to_vec()
    } else {
        vec![ReduceOp::Sum]
    };
    let mut calls = Vec::new();
    for &dtype in dtypes {
        for &op in &op_list {
            for &count in counts {
                for in_place in [false, true] {
                    if !(in_place && c == Collective::AllToAll) {
                        calls.push((c, dtype, op, count, in_place));
                    }
                }
            }
        }
    }
    calls
}

/// Runs `calls` on every rank of `comms` (one thread each) with [`run_and_check`] and
/// returns every mismatch found.
pub fn run_calls(comms: &[Communicator], calls: &[Call]) -> Vec<String> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || {
                    calls
                        .iter()
                        .filter_map(|&(c, dtype, op, count, in_place)| {
                            ferroccl::with_element_type!(dtype, T => run_and_check::<T>(comm, c, op, count, in_place)).err()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// Runs every collective and root × `dtypes` × ops × `counts` × in and out of place on
/// `comms` and asserts every rank's output is right; `what` names the setup in the
/// failure message.
pub fn check_grid(
    comms: &[Communicator],
    dtypes: &[ferroccl::DataType],
    counts: &[usize],
    what: &str,
) {
    let calls: Vec<Call> = collectives(comms.len())
        .into_iter()
        .flat_map(|c| calls_of(c, dtypes, counts))
        .collect();
    let wrong = run_calls(comms, &calls);
    assert!(
        wrong.is_empty(),
        "{} of {} checks failed {what}, e.g.:\n{}",
        wrong.len(),
        calls.len() * comms.len(),
        wrong
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Every collective with every root of `n` ranks.
pub fn collectives(n: usize) -> Vec<Collective> {
    Collective::every(n)
}

/// Fetches one of NVIDIA's libraries from PyPI (`tools/fetch-nvidia-lib`: `nvrtc` or
/// `nccl`, neither needs a GPU to fetch) and returns its directory.
pub fn nvidia_lib(which: &str) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(root.join("tools/fetch-nvidia-lib"))
        .arg(which)
        .output()
        .expect("run tools/fetch-nvidia-lib");
    assert!(
        out.status.success(),
        "tools/fetch-nvidia-lib {which} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    root.join(String::from_utf8_lossy(&out.stdout).trim())
}

/// Points ferroccl at NVRTC from the `nvidia-cuda-nvrtc` wheel and, unless
/// `FERROCCL_CACHE_DIR` names another, at the run's cubin cache ([`cubin_cache`]);
/// returns NVRTC's directory. Call it before anything compiles.
pub fn nvrtc_from_pypi() -> std::path::PathBuf {
    let dir = nvidia_lib("nvrtc");
    // SAFETY: set before ferroccl reads them (once, on its first compilation); the
    // tests that call this set the same values.
    unsafe {
        std::env::set_var("FERROCCL_NVRTC", &dir);
        if std::env::var_os("FERROCCL_CACHE_DIR").is_none() {
            std::env::set_var("FERROCCL_CACHE_DIR", cubin_cache());
        }
    }
    dir
}

/// Element `seed` of test data for `dtype`, written to `out` (the element's bytes): any
/// bits for integers (sums and products wrap), small values for floats (whole, halves,
/// signed zeros), so that every implementation's results are exact or saturate alike.
pub fn element_bytes(dtype: ferroccl::DataType, seed: u64, out: &mut [u8]) {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    if !dtype.is_float() {
        out.copy_from_slice(&x.to_le_bytes()[..out.len()]);
        return;
    }
    const FLOATS: [f64; 10] = [-3.0, -2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0];
    let v = FLOATS[(x >> 40) as usize % FLOATS.len()];
    ferroccl::with_element_type!(dtype, T => {
        let e = T::from_f64(v);
        // SAFETY: T is a plain value type of out.len() bytes.
        out.copy_from_slice(unsafe {
            std::slice::from_raw_parts(std::ptr::from_ref(&e).cast::<u8>(), size_of::<T>())
        });
    });
}

/// ferroccl's simulated CUDA driver (`tests/simcuda/simcuda.cpp`, with the host builds of
/// `kernels/*.cu`), built with the C++ compiler once per version of its sources (under
/// `target/simcuda/`, written atomically so that concurrent test processes share it).
pub fn simulated_driver() -> std::path::PathBuf {
    simulated_driver_without(&[])
}

/// The simulated driver without the exported symbols `hidden` (a linker version script
/// makes them local): a driver too old for ferroccl (a driver-API entry point missing),
/// or, without `ferroccl_simcuda_describe`, a library ferroccl cannot tell from a real
/// driver.
pub fn simulated_driver_without(hidden: &[&str]) -> std::path::PathBuf {
    use sha2::Digest;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = [
        "tests/simcuda/simcuda.cpp",
        "kernels/host/shim.h",
        "kernels/ferroccl.cuh",
        "kernels/executor.cu",
        "kernels/reduce.cu",
    ];
    let mut hash = sha2::Sha256::new();
    for s in sources {
        hash.update(std::fs::read(root.join(s)).expect("read the simulated driver's sources"));
    }
    for h in hidden {
        hash.update(h.as_bytes());
        hash.update([0]);
    }
    let digest: String = hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = root.join("target/simcuda").join(digest);
    let lib = dir.join("libcuda.so.1");
    if lib.exists() {
        return lib;
    }
    std::fs::create_dir_all(&dir).expect("make target/simcuda");
    let tmp = dir.join(format!("libcuda.so.1.tmp{}", std::process::id()));
    let script = dir.join(format!("exports.tmp{}", std::process::id()));
    let mut flags = vec![
        "-Wno-missing-field-initializers".to_string(),
        "-fvisibility=hidden".into(),
        // cudarc asks for "libcuda.so" first: glibc gives the already-loaded library
        // whose SONAME is the name asked for.
        "-Wl,-soname,libcuda.so".into(),
    ];
    if !hidden.is_empty() {
        let locals: String = hidden.iter().map(|h| format!("{h}; ")).collect();
        std::fs::write(&script, format!("{{ global: *; local: {locals}}};\n"))
            .expect("write the export list");
        flags.push(format!("-Wl,--version-script={}", script.display()));
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    build_host_cxx(&root.join(sources[0]), &tmp, &flags);
    std::fs::remove_file(&script).ok();
    std::fs::rename(&tmp, &lib).expect("put the simulated driver in place");
    lib
}

/// Builds the C++ file `source` (a host build of `kernels/*.cu`) as the shared library
/// `out`, with warnings as errors, no floating-point contraction (bit for bit the host
/// kernels' arithmetic) and `extra` flags.
pub fn build_host_cxx(source: &std::path::Path, out: &std::path::Path, extra: &[&str]) {
    let status = std::process::Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args([
            "-std=c++20",
            "-O2",
            "-ffp-contract=off",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
            "-pthread",
        ])
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg(source)
        .status()
        .expect("run the C++ compiler (c++)");
    assert!(status.success(), "{} does not compile", source.display());
}

/// Where the tests keep NVRTC's cubins (shared by every test process of a run).
pub fn cubin_cache() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ferroccl-cache")
}

/// The environment that puts a process (and the rank processes it starts) on the
/// simulated driver with `gpus` GPUs: the driver, NVRTC from PyPI, the shared cubin
/// cache.
pub fn simulated_gpu_env(gpus: usize) -> Vec<(&'static str, std::ffi::OsString)> {
    vec![
        ("FERROCCL_CUDA_DRIVER", simulated_driver().into_os_string()),
        ("FERROCCL_SIM_GPUS", gpus.to_string().into()),
        ("FERROCCL_NVRTC", nvidia_lib("nvrtc").into_os_string()),
        ("FERROCCL_CACHE_DIR", cubin_cache().into_os_string()),
    ]
}

/// Whether this process runs on a real GPU: one is there and
/// `FERROCCL_TEST_SIMULATED_GPU` does not ask for the simulated driver. Otherwise it
/// selects the simulated driver (unless one was chosen already), with
/// `FERROCCL_SIM_GPUS` GPUs (default `default_gpus`). Call it before anything loads the
/// driver.
pub fn real_gpu_or_simulated(default_gpus: usize) -> bool {
    static REAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REAL.get_or_init(|| {
        if std::env::var_os("FERROCCL_CUDA_DRIVER").is_none()
            && std::env::var_os("FERROCCL_TEST_SIMULATED_GPU").is_none()
            // SAFETY: probing for NVIDIA's driver by its soname; its initialisers have no
            // preconditions.
            && unsafe { libloading::Library::new("libcuda.so.1") }.is_ok()
        {
            nvrtc_from_pypi();
            return true;
        }
        let gpus = std::env::var("FERROCCL_SIM_GPUS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default_gpus);
        for (name, value) in simulated_gpu_env(gpus) {
            if std::env::var_os(name).is_none() || name == "FERROCCL_SIM_GPUS" {
                // SAFETY: set before the driver or NVRTC is loaded (the caller's
                // contract), while the test's threads read no environment.
                unsafe { std::env::set_var(name, value) };
            }
        }
        false
    })
}

/// The files under `dir` (recursively) whose extension is one of `extensions`, sorted.
pub fn files_under(dir: &std::path::Path, extensions: &[&str]) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .extension()
                .is_some_and(|x| extensions.iter().any(|e| x == *e))
            {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Entries of `/dev/shm` left by the processes `pids`, started at `since` or later: host
/// segments (`ferroccl-<pid of the job's rank 0>-…`) and device FIFOs staged through
/// host memory (`ferroccl-cudafifo-<pid of their receiver>-…`). Older names were left by
/// earlier processes with the same pids (pids wrap): they are not these processes'.
pub fn shm_left_by(pids: &[u32], since: std::time::SystemTime) -> Vec<String> {
    // File times come from a clock that lags by up to a tick.
    let since = since - std::time::Duration::from_secs(1);
    ferroccl::transport::segment::shm_entries_of(pids)
        .into_iter()
        .filter(|e| {
            e.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}
