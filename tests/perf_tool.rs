//! The nccl-tests-compatible tools, run as a user runs them: output format, bus-bandwidth
//! factors, result checking (including a deliberately corrupted result), bad flags, and
//! every collective × dtype × op on 2 and 3 ranks.

use std::process::{Command, Output};

// The simulated CUDA driver's helpers.
#[allow(unused_imports)]
mod common;

fn tool(name: &str) -> String {
    match name {
        "all_reduce_perf" => env!("CARGO_BIN_EXE_all_reduce_perf"),
        "all_gather_perf" => env!("CARGO_BIN_EXE_all_gather_perf"),
        "broadcast_perf" => env!("CARGO_BIN_EXE_broadcast_perf"),
        "reduce_perf" => env!("CARGO_BIN_EXE_reduce_perf"),
        "reduce_scatter_perf" => env!("CARGO_BIN_EXE_reduce_scatter_perf"),
        "alltoall_perf" => env!("CARGO_BIN_EXE_alltoall_perf"),
        "sendrecv_perf" => env!("CARGO_BIN_EXE_sendrecv_perf"),
        "gather_perf" => env!("CARGO_BIN_EXE_gather_perf"),
        "scatter_perf" => env!("CARGO_BIN_EXE_scatter_perf"),
        other => panic!("no tool {other}"),
    }
    .to_string()
}

const TOOLS: [(&str, bool); 9] = [
    ("all_reduce_perf", true),
    ("all_gather_perf", false),
    ("broadcast_perf", false),
    ("reduce_perf", true),
    ("reduce_scatter_perf", true),
    ("alltoall_perf", false),
    ("sendrecv_perf", false),
    ("gather_perf", false),
    ("scatter_perf", false),
];

fn run(name: &str, args: &str) -> Output {
    Command::new(tool(name))
        .args(args.split_whitespace())
        .arg("--no-progress")
        .env_remove("RANK")
        .output()
        .unwrap()
}

/// Runs tool `name` with `args` on the simulated CUDA driver with `gpus` GPUs and more
/// environment `envs`; a run that outlives [`DEVICE_RUN_LIMIT`] is killed (with the rank
/// processes it started) and fails the test, so a hang cannot stall the test run.
fn on_simulated_gpus(name: &str, args: &str, gpus: usize, envs: &[(&str, &str)]) -> Output {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new(tool(name))
        .args(args.split_whitespace())
        .arg("--no-progress")
        .env_remove("RANK")
        .envs(common::simulated_gpu_env(gpus))
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    // Read both pipes while waiting, so that a chatty run cannot block on a full pipe.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                std::io::Read::read_to_end(&mut p, &mut bytes).ok();
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEVICE_RUN_LIMIT {
            // SAFETY: signals the process group this test started.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            child.wait().unwrap();
            panic!(
                "{name} {args} {envs:?} hung ({DEVICE_RUN_LIMIT:?}):\n{}\n{}",
                text(&stdout.join().unwrap()),
                text(&stderr.join().unwrap())
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// How long one device run may take before the test calls it a hang.
const DEVICE_RUN_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The data rows of a table (lines that do not start with '#').
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

/// Runs tool `name` with `args`, which must succeed with no wrong element in any row
/// (in and out of place); returns its output and its rows.
fn checked_rows(name: &str, args: &str) -> (String, Vec<Vec<String>>) {
    let out = run(name, args);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{name} {args}: {stdout}{}",
        text(&out.stderr)
    );
    let rows = rows(&stdout);
    assert!(
        rows.iter().all(|r| r[8] == "0" && r[12] == "0"),
        "{name} {args}: {stdout}"
    );
    (stdout, rows)
}

#[test]
fn output_has_nccl_tests_columns_and_footer() {
    let out = run("all_reduce_perf", "-t 2 -b 8 -e 1K -f 4 -n 3 -w 1");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let heading = stdout
        .lines()
        .find(|l| l.contains("size") && l.contains("redop"))
        .expect("column headings");
    let names: Vec<&str> = heading.trim_start_matches('#').split_whitespace().collect();
    assert_eq!(
        names,
        [
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "algorithm"
        ]
    );
    assert!(stdout.contains("out-of-place") && stdout.contains("in-place"));
    assert!(stdout.contains("#  Rank  0 Group  0 Pid") && stdout.contains("#  Rank  1"));
    let rows = rows(&stdout);
    // Sizes 8, 32, 128, 512.
    assert_eq!(rows.len(), 4, "{stdout}");
    for (row, size) in rows.iter().zip([8usize, 32, 128, 512]) {
        assert_eq!(row.len(), 14, "{row:?}");
        assert_eq!(row[0], size.to_string());
        assert_eq!(row[1], (size / 4).to_string());
        assert_eq!(&row[2..5], ["float", "sum", "-1"]);
        assert_eq!(row[8], "0");
        assert_eq!(row[12], "0");
        for v in [&row[5], &row[6], &row[7], &row[9], &row[10], &row[11]] {
            assert!(v.parse::<f64>().unwrap() >= 0.0, "{v}");
        }
    }
    let footer: Vec<&str> = stdout.lines().rev().take(3).collect();
    assert!(
        footer[2].starts_with("# Out of bounds values : 0 OK"),
        "{footer:?}"
    );
    assert!(
        footer[1].starts_with("# Avg bus bandwidth    : "),
        "{footer:?}"
    );
}

/// `-R 2`: buffers in windows. Between processes a large all-reduce then reads peers'
/// windows in place (single copy), and without windows keeps the FIFOs; results are
/// checked either way.
#[test]
fn windows_move_large_calls_between_processes_to_single_copy() {
    for (flag, want) in [("-R 2", "/SingleCopy/"), ("-R 0", "/Simple/")] {
        let (stdout, rows) = checked_rows(
            "all_reduce_perf",
            &format!("-np 2 {flag} -b 8 -e 8M -f 1024 -n 2 -w 1"),
        );
        // 8 B, 8 KiB, 8 MiB.
        assert_eq!(rows.len(), 3, "{stdout}");
        assert!(rows[2][13].contains(want), "{flag}: {stdout}");
    }
    let out = run("all_reduce_perf", "-t 2 -R 3");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("-R 3: 0 (plain)"),
        "{}",
        text(&out.stderr)
    );
}

/// Ranks that outnumber the CPUs stream results of 2 MiB (8 ranks on 2 CPUs) or 4 MiB
/// (3 ranks) out of place, below the 8 MiB of ranks with a CPU each
/// (`engine::streaming_from`): checked results, in and out of place, every op on one
/// integer and one float type. On a host with a CPU per rank the same calls keep plain
/// stores and are checked alike.
#[test]
fn crowded_ranks_stream_middle_sized_results_correctly() {
    for (ranks, size) in [(8, "2M"), (3, "4M")] {
        for dtype in ["int32", "half"] {
            let (stdout, rows) = checked_rows(
                "all_reduce_perf",
                &format!("-np {ranks} -b {size} -e {size} -n 2 -w 1 -o all -d {dtype}"),
            );
            // One row per op.
            assert_eq!(rows.len(), 6, "{ranks} ranks, {dtype}: {stdout}");
        }
    }
}

/// `FERROCCL_LL_SLOTS` sizes the LL FIFOs between processes of this host (the log
/// names the count), the calls through them stay right, and a count that is not a power
/// of two, or more than an LL FIFO's records leave room for, is refused by name.
#[test]
fn ll_slots_come_from_the_environment() {
    let with = |slots: &str| {
        Command::new(tool("all_reduce_perf"))
            .args("-np 2 -b 8 -e 64K -f 8 -n 2 -w 1 --no-progress".split_whitespace())
            .env_remove("RANK")
            .envs([
                ("FERROCCL_LL_SLOTS", slots),
                ("FERROCCL_PROTO", "LL"),
                ("FERROCCL_DEBUG", "INFO"),
            ])
            .output()
            .unwrap()
    };
    let out = with("16");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 5, "{stdout}");
    assert!(rows.iter().all(|r| r[8] == "0" && r[12] == "0"), "{stdout}");
    assert!(stderr.contains("LL FIFOs of 16 x 4096 B"), "{stderr}");
    for (slots, says) in [("24", "FIFO slots 24"), ("64", "FIFO slots 64")] {
        let out = with(slots);
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(!out.status.success(), "{all}");
        assert!(all.contains(says) && all.contains("2..=32 for LL"), "{all}");
    }
}

#[test]
fn bus_bandwidth_factors_per_collective() {
    let dir = tempfile::tempdir().unwrap();
    let n = 3.0;
    for (name, _) in TOOLS {
        let json = dir.path().join(format!("{name}.json"));
        let out = run(
            name,
            &format!("-t 3 -b 1M -e 1M -n 3 -w 1 -J {}", json.display()),
        );
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let want = match name {
            "all_reduce_perf" => 2.0 * (n - 1.0) / n,
            "broadcast_perf" | "reduce_perf" | "sendrecv_perf" => 1.0,
            _ => (n - 1.0) / n,
        };
        assert_eq!(doc["nranks"], 3);
        for r in doc["results"].as_array().unwrap() {
            let m = &r["out_of_place"];
            let (algbw, busbw, time) = (
                m["algbw_gbs"].as_f64().unwrap(),
                m["busbw_gbs"].as_f64().unwrap(),
                m["time_us"].as_f64().unwrap(),
            );
            assert!(
                (busbw / algbw - want).abs() < 1e-9,
                "{name}: {busbw} / {algbw}"
            );
            let size = r["size"].as_f64().unwrap();
            assert!(
                (algbw - size / time / 1e3).abs() < 1e-6 * algbw,
                "{name}: algbw"
            );
            assert_eq!(m["wrong"], 0);
        }
    }
}

#[test]
fn a_corrupted_result_is_counted_and_fails_the_run() {
    let out = Command::new(tool("all_reduce_perf"))
        .args([
            "-t",
            "2",
            "-b",
            "1K",
            "-e",
            "4K",
            "-f",
            "4",
            "-n",
            "2",
            "--no-progress",
        ])
        .env("FERROCCL_PERF_CORRUPT", "1")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for row in rows(&stdout) {
        assert_eq!((row[8].as_str(), row[12].as_str()), ("1", "1"), "{row:?}");
    }
    assert!(
        stdout.contains("# Out of bounds values : 4 FAILED"),
        "{stdout}"
    );
    // Without the hook the same run is clean.
    let clean = run("all_reduce_perf", "-t 2 -b 1K -e 4K -f 4 -n 2");
    assert!(clean.status.success());
    assert!(text(&clean.stdout).contains("# Out of bounds values : 0 OK"));
}

#[test]
fn bad_flags_give_a_usage_error() {
    for (args, needle) in [
        ("-b 1M -e 1K", "-b 1048576 is larger than -e 1024"),
        ("-d complex64", "complex64"),
        ("-o median", "median"),
        ("--frobnicate 1", "--frobnicate"),
        ("-t 0", "-t 0"),
    ] {
        let out = run("all_reduce_perf", args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args}: {stderr}");
        assert!(stderr.contains(needle), "{args}: {stderr}");
        assert!(
            stderr.contains("usage: all_reduce_perf"),
            "{args}: {stderr}"
        );
    }
    let out = run("reduce_perf", "-t 2 -r 5 -b 8 -e 8");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("-r 5"), "{}", text(&out.stderr));
}

#[test]
fn device_memory_without_a_driver_is_a_clear_error() {
    if ferroccl::cuda::device_count() > 0 {
        eprintln!(
            "\n*** SKIPPED device_memory_without_a_driver_is_a_clear_error: this machine has a GPU ***\n"
        );
        return;
    }
    for args in [
        "--memory cuda -t 2 -b 8 -e 8",
        "--backend both -t 2 -b 8 -e 8",
    ] {
        let out = run("all_reduce_perf", args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args}: {stderr}");
        assert!(stderr.contains("CUDA"), "{args}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args}: {stderr}");
    }
}

/// `--memory cuda` on the simulated CUDA driver (`tests/simcuda`): rank processes (`-np`)
/// and rank threads (`-t`), ranks on GPUs of their own and several ranks on one GPU (with
/// CUDA IPC between processes); every row checked (`#wrong` 0) by the tool itself.
#[test]
fn device_memory_sweeps_on_the_simulated_driver() {
    let cases = [
        ("all_reduce_perf", "-np 2", 2),
        ("all_reduce_perf", "-np 2", 2),
        ("all_reduce_perf", "-np 4", 1),
        ("all_reduce_perf", "-t 3", 2),
        ("reduce_scatter_perf", "-np 2", 1),
        ("all_gather_perf", "-np 3", 3),
        ("broadcast_perf", "-np 2", 2),
        ("reduce_perf", "-t 2", 2),
    ];
    // Two GPUs without P2P (FIFOs staged through page-locked host memory), processes.
    let no_p2p = [("FERROCCL_SIM_P2P", "none")];
    for (i, (name, ranks, gpus)) in cases.into_iter().enumerate() {
        let args = format!("--memory cuda {ranks} -b 8 -e 256K -f 8 -n 2 -w 1 -d int32 -c 1");
        let extra: &[(&str, &str)] = if i == 0 { &no_p2p } else { &[] };
        let out = on_simulated_gpus(name, &args, gpus, extra);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        let what = format!("{name} {args} on {gpus} simulated GPU(s) {extra:?}");
        assert!(out.status.success(), "{what}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("device cuda:0 (SIMULATED driver)"),
            "{what}: the header names the simulated driver:\n{stdout}"
        );
        let table = rows(&stdout);
        assert_eq!(table.len(), 6, "{what}: 8 B .. 256 KiB by 8:\n{stdout}");
        for row in &table {
            // Columns: size count type redop root | time algbw busbw #wrong | in place.
            assert_eq!(row[8], "0", "{what}: out of place wrong:\n{stdout}");
            assert_eq!(row[12], "0", "{what}: in place wrong:\n{stdout}");
        }
        assert!(
            stdout.contains("Out of bounds values : 0 OK"),
            "{what}:\n{stdout}"
        );
    }
}

/// `--backend both` with ferroccl's own C library (the cdylib, `libnccl.so.2`) standing
/// in for NVIDIA's NCCL, which cannot run on the simulated driver: the NCCL backend's
/// plumbing (loading by path, the unique id through the host communicator, every call
/// through the C ABI on a stream) runs, both tables are checked, and the side-by-side
/// table is printed.
#[test]
fn the_nccl_backend_runs_with_ferroccls_own_libnccl_standing_in() {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let lib = [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libferroccl.so"))
        .find(|p| p.exists())
        .expect("libferroccl.so next to the test");
    for name in [
        "all_reduce_perf",
        "reduce_scatter_perf",
        "all_gather_perf",
        "broadcast_perf",
        "reduce_perf",
        "sendrecv_perf",
    ] {
        let out = on_simulated_gpus(
            name,
            "--memory cuda -np 2 -b 8 -e 64K -f 8 -n 2 -w 1 --backend both",
            2,
            &[("FERROCCL_NCCL_LIB", lib.to_str().expect("a UTF-8 path"))],
        );
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{name}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("Library: NCCL") && stdout.contains("Side by side"),
            "{name}:\n{stdout}"
        );
        let table: Vec<_> = rows(&stdout).into_iter().filter(|r| r.len() > 12).collect();
        assert_eq!(
            table.len(),
            10,
            "{name}: 5 sizes for each library:\n{stdout}"
        );
        for row in &table {
            // In place: none for send/receive.
            assert!(
                row[8] == "0" && (row[12] == "0" || row[12] == "N/A"),
                "{name}:\n{stdout}"
            );
        }
        // The algorithm column: ferroccl's plan, then NCCL's own choice, which it keeps
        // to itself (not ferroccl's plan under NCCL's name).
        let algorithms: Vec<&str> = table.iter().map(|r| r[r.len() - 1].as_str()).collect();
        assert!(
            algorithms[..5].iter().all(|a| *a != "(nccl)")
                && algorithms[5..].iter().all(|a| *a == "(nccl)"),
            "{name}: {algorithms:?}\n{stdout}"
        );
    }
}

/// What a device sweep says when the machine cannot run it, on simulated machines: a
/// driver older than NVRTC (both versions named), a GPU in prohibited compute mode, and
/// an NVRTC that is not where `FERROCCL_NVRTC` says. Each is an error naming the cause,
/// never a panic or a hang.
#[test]
fn device_sweeps_name_what_the_machine_lacks() {
    let cache = tempfile::tempdir().unwrap();
    // (the simulated machine's settings, what the error must say)
    type Case = (
        &'static [(&'static str, &'static str)],
        &'static [&'static str],
    );
    let cases: [Case; 4] = [
        (
            &[("FERROCCL_SIM_DRIVER_VERSION", "12080")],
            &["NVRTC 13.", "CUDA 12.8", "update the NVIDIA driver"],
        ),
        (
            &[("FERROCCL_SIM_COMPUTE_MODE", "prohibited")],
            &["Prohibited compute mode"],
        ),
        (
            &[("FERROCCL_NVRTC", "/nonexistent/nvrtc/lib")],
            &["FERROCCL_NVRTC=/nonexistent/nvrtc/lib"],
        ),
        (
            &[("FERROCCL_NVRTC", "")],
            &[
                "NVRTC (libnvrtc.so.13) could not be loaded",
                "nvidia-cuda-nvrtc",
            ],
        ),
    ];
    for (envs, want) in cases {
        let mut envs = envs.to_vec();
        let cache_dir = cache.path().display().to_string();
        envs.push(("FERROCCL_CACHE_DIR", &cache_dir));
        let out = on_simulated_gpus("all_reduce_perf", "--memory cuda -t 1 -b 8 -e 8", 1, &envs);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{envs:?}: {stderr}");
        for w in want {
            assert!(stderr.contains(w), "{envs:?}: no {w:?} in:\n{stderr}");
        }
        assert!(!stderr.contains("panicked"), "{envs:?}: {stderr}");
    }
}

/// The channels of device calls come from the GPUs (the ranks bind their GPU before
/// they join, as nccl-tests does): the link between them (PCIe P2P, NVLink, none: staged
/// through host memory, one GPU shared) is named in the header, a GPU with few SMs gets
/// fewer channels, and `FERROCCL_NCHANNELS` overrides it all; every row is checked.
#[test]
fn device_channels_come_from_the_gpus_and_their_link() {
    // (ranks, GPUs, the simulated machine, the header's channels, the rows' channels)
    type Case = (
        &'static str,
        usize,
        &'static [(&'static str, &'static str)],
        &'static str,
        &'static str,
    );
    let cases: [Case; 6] = [
        ("-np 2", 2, &[], "channels 2 (PCIe P2P)", "/2ch"),
        (
            "-np 2",
            2,
            &[("FERROCCL_SIM_LINK", "nvlink")],
            "channels 2 (NVLink x1)",
            "/2ch",
        ),
        (
            "-t 2",
            2,
            &[("FERROCCL_SIM_P2P", "none")],
            "channels 2 (staged through host memory)",
            "/2ch",
        ),
        ("-np 2", 1, &[], "channels 2 (one GPU)", "/2ch"),
        (
            "-np 2",
            2,
            &[("FERROCCL_SIM_SMS", "8")],
            "channels 1 (PCIe P2P)",
            "/1ch",
        ),
        (
            "-np 2",
            2,
            &[("FERROCCL_NCHANNELS", "3")],
            "channels 3 (PCIe P2P)",
            "/3ch",
        ),
    ];
    for (ranks, gpus, envs, header, per_row) in cases {
        let args = format!("--memory cuda {ranks} -b 8 -e 256K -f 32 -n 1 -w 1 -d int32");
        let out = on_simulated_gpus("all_reduce_perf", &args, gpus, envs);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        let what = format!("{args} on {gpus} GPU(s) {envs:?}");
        assert!(out.status.success(), "{what}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains(header),
            "{what}: no {header:?} in\n{stdout}"
        );
        let table = rows(&stdout);
        assert_eq!(table.len(), 4, "{what}: 8 B .. 256 KiB by 32:\n{stdout}");
        for row in &table {
            assert!(
                row[8] == "0" && row[12] == "0",
                "{what}: wrong results:\n{stdout}"
            );
            assert!(row[13].ends_with(per_row), "{what}: {row:?}");
        }
    }
}

/// A driver without an entry point of ferroccl's device path (older than ferroccl
/// needs): the error names the missing call before any device work starts.
#[test]
fn a_driver_missing_a_device_path_call_is_named() {
    let lib = common::simulated_driver_without(&["cuIpcGetMemHandle"]);
    let lib = lib.to_str().expect("a UTF-8 path");
    let out = on_simulated_gpus(
        "all_reduce_perf",
        "--memory cuda -t 1 -b 8 -e 8",
        1,
        &[("FERROCCL_CUDA_DRIVER", lib)],
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("has no cuIpcGetMemHandle") && stderr.contains("too old"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The device-call fault matrix: each driver call of the device path fails in turn (the
/// simulated driver's `FERROCCL_SIM_FAIL`), on the machine shapes that make it: rank
/// processes on GPUs of their own (CUDA IPC), rank threads on two GPUs (peer access), and
/// two GPUs without P2P (page-locked host memory registered with the driver). Every run
/// fails within the limit with an error naming the call, never a panic or a hang.
#[test]
fn every_failing_driver_call_is_named_and_nothing_hangs() {
    let processes = "--memory cuda -np 2 -b 8 -e 64K -f 64 -n 1 -w 1";
    let threads = "--memory cuda -t 2 -b 8 -e 64K -f 64 -n 1 -w 1";
    // (the call that fails, the tool's arguments, the simulated machine's settings)
    type Case = (
        &'static str,
        &'static str,
        &'static [(&'static str, &'static str)],
    );
    let cases: &[Case] = &[
        ("cuDeviceGetAttribute", processes, &[]),
        ("cuDevicePrimaryCtxRetain", processes, &[]),
        ("cuCtxPushCurrent_v2", processes, &[]),
        ("cuStreamCreate", processes, &[]),
        ("cuStreamGetCtx", processes, &[]),
        ("cuStreamIsCapturing", processes, &[]),
        ("cuMemAlloc_v2", processes, &[]),
        ("cuMemsetD8Async", processes, &[]),
        ("cuMemHostAlloc", processes, &[]),
        ("cuMemHostGetDevicePointer_v2", processes, &[]),
        ("cuMemcpyHtoDAsync_v2", processes, &[]),
        ("cuIpcGetMemHandle", processes, &[]),
        ("cuIpcOpenMemHandle_v2", processes, &[]),
        ("cuModuleLoadData", processes, &[]),
        ("cuModuleGetFunction", processes, &[]),
        ("cuFuncLoad", processes, &[]),
        ("cuLaunchKernel", processes, &[]),
        ("cuEventCreate", processes, &[]),
        ("cuEventRecord", processes, &[]),
        ("cuEventQuery", processes, &[]),
        ("cuDeviceCanAccessPeer", threads, &[]),
        ("cuCtxEnablePeerAccess", threads, &[]),
        (
            "cuMemHostRegister_v2",
            processes,
            &[("FERROCCL_SIM_P2P", "none")],
        ),
    ];
    for (call, args, extra) in cases {
        let mut envs = extra.to_vec();
        envs.push(("FERROCCL_SIM_FAIL", call));
        envs.push(("FERROCCL_TIMEOUT", "30"));
        let (started, since) = (std::time::Instant::now(), std::time::SystemTime::now());
        let out = on_simulated_gpus("all_reduce_perf", args, 2, &envs);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        eprintln!("{call}: {:.1} s", started.elapsed().as_secs_f64());
        assert!(
            !out.status.success(),
            "{call} failing, {args}: succeeded:\n{stdout}"
        );
        assert!(
            stderr.contains(call.trim_end_matches("_v2")) && stderr.contains("CUDA_ERROR_UNKNOWN"),
            "{call} failing, {args}: the error does not name it:\n{stdout}\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{call}, {args}:\n{stderr}");
        // What a failing rank made (FIFOs staged through host memory, here when
        // registering them fails) goes with it; the header names the rank processes.
        let pids = header_pids(&stdout);
        let left = common::shm_left_by(&pids, since);
        assert!(
            left.is_empty(),
            "{call}, {args}: left in /dev/shm: {left:?}"
        );
        eprintln!("{call}: ranks {pids:?}, nothing left in /dev/shm");
    }
}

/// The process ids the header's `#  Rank  0 Group  0 Pid 1234 on …` lines name.
fn header_pids(stdout: &str) -> Vec<u32> {
    stdout
        .lines()
        .filter(|l| l.starts_with("#  Rank"))
        .filter_map(|l| {
            l.split_once(" Pid ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Two rank processes on one GPU in exclusive-process compute mode: the second cannot
/// have a context, and the error says why and what to do.
#[test]
fn one_gpu_in_exclusive_process_mode_refuses_a_second_process_clearly() {
    let out = on_simulated_gpus(
        "all_reduce_perf",
        "--memory cuda -np 2 -b 8 -e 8",
        1,
        &[("FERROCCL_SIM_COMPUTE_MODE", "exclusive-process")],
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("ExclusiveProcess compute mode")
            && stderr.contains("one rank process per GPU"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn every_collective_dtype_and_op_on_two_and_three_ranks() {
    for ranks in [2, 3] {
        for (name, reduces) in TOOLS {
            let ops = if reduces { "-o all" } else { "" };
            let out = run(
                name,
                &format!("-t {ranks} -d all {ops} -r -1 -b 8 -e 4K -f 8 -n 2 -w 1"),
            );
            let stdout = text(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("# Out of bounds values : 0 OK"),
                "{name} on {ranks} ranks:\n{stdout}\n{}",
                text(&out.stderr)
            );
            let rows = rows(&stdout);
            let roots = if name.starts_with("broadcast")
                || name.starts_with("reduce_perf")
                || name.starts_with("gather")
                || name.starts_with("scatter")
            {
                ranks
            } else {
                1
            };
            // Sizes 8, 64, 512 and 4096.
            let want = 12 * if reduces { 6 } else { 1 } * roots * 4;
            assert_eq!(rows.len(), want, "{name} on {ranks} ranks");
            let types: std::collections::BTreeSet<&str> =
                rows.iter().map(|r| r[2].as_str()).collect();
            assert_eq!(types.len(), 12, "{types:?}");
        }
    }
}

#[test]
fn processes_csv_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let (csv, svg) = (dir.path().join("r.csv"), dir.path().join("r.svg"));
    let out = run(
        "all_reduce_perf",
        &format!(
            "-np 2 -b 8 -e 64K -f 8 -n 5 --csv {} --plot {}",
            csv.display(),
            svg.display()
        ),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("nRanks 2"));
    // Only rank 0 prints the table.
    assert_eq!(stdout.matches("# Avg bus bandwidth").count(), 1);
    let csv = std::fs::read_to_string(csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(lines[0].starts_with("size,count,type,redop,root,oop_time_us"));
    assert_eq!(lines.len(), 1 + 5, "sizes 8 B to 32 KiB");
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("bus bandwidth"),
        "{}",
        &svg[..200.min(svg.len())]
    );
}
