//! The command lines of `ferrorun` and the `ferroccl-*` tools, run as the built binaries:
//! `--help`, misspelt flags named with a suggestion, bad numbers named with their flag,
//! `--completions SHELL`, and typical invocations working as before.

use std::process::{Command, Output, Stdio};

// The simulated CUDA driver's helpers.
#[allow(unused_imports)]
mod common;

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
const RENDEZVOUS: &str = env!("CARGO_BIN_EXE_ferroccl-rendezvous");
const TUNE: &str = env!("CARGO_BIN_EXE_ferroccl-tune");
const TOPO: &str = env!("CARGO_BIN_EXE_ferroccl-topo");
const VIZ: &str = env!("CARGO_BIN_EXE_ferroccl-viz");
const LIMITS: &str = env!("CARGO_BIN_EXE_ferroccl-limits");

/// Every tool, by the name its completions and messages use.
const TOOLS: [(&str, &str); 5] = [
    ("ferrorun", FERRORUN),
    ("ferroccl-rendezvous", RENDEZVOUS),
    ("ferroccl-tune", TUNE),
    ("ferroccl-topo", TOPO),
    ("ferroccl-viz", VIZ),
];

/// Runs `exe` with `args` (no colours, no inherited CPU binding or tuning settings).
fn run(exe: &str, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .env_remove("FERROCCL_CPU_BIND")
        .env_remove("FERROCCL_TUNE_LOCAL")
        .env_remove("FERROCCL_TUNE_LOCAL_LL")
        .env_remove("FERROCCL_TUNE_LOCAL_SINGLE")
        .env_remove("FERROCCL_TUNE_LOCAL_IN_PLACE")
        .env_remove("FERROCCL_TUNE_NET")
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn help_exits_zero_and_lists_the_flags() {
    for (exe, args, flags) in [
        (
            FERRORUN,
            &["--help"][..],
            &[
                "--nproc-per-node",
                "--nnodes",
                "--node-rank",
                "--master-addr",
                "--master-port",
                "--grace-period",
                "--no-prefix",
                "--bind",
                "--completions",
                "PROGRAM",
            ][..],
        ),
        (FERRORUN, &["-h"], &["--nproc-per-node", "--bind"]),
        (
            RENDEZVOUS,
            &["--help"],
            &[
                "--unique-id",
                "--rank",
                "--nranks",
                "--new-unique-id",
                "--serve-seconds",
                "--completions",
            ],
        ),
        (TUNE, &["--help"], &["measure", "predict", "--completions"]),
        (
            TUNE,
            &["predict", "--help"],
            &["--ranks", "--hosts", "--net", "--local", "--local-ll"],
        ),
        (
            TOPO,
            &["--help"],
            &[
                "--json",
                "--hosts",
                "--ranks-per-host",
                "--channels",
                "--completions",
            ],
        ),
        (
            VIZ,
            &["--help"],
            &[
                "ring",
                "tree",
                "oneshot",
                "twoshot",
                "reduce-scatter",
                "all-gather",
                "broadcast",
                "reduce",
                "simulate",
                "trace",
                "--completions",
            ],
        ),
        (
            VIZ,
            &["ring", "--help"],
            &[
                "--ranks",
                "--collective",
                "--algorithm",
                "--root",
                "--values",
                "--html",
            ],
        ),
        (
            VIZ,
            &["simulate", "--help"],
            &["--topology", "--size", "--plot"],
        ),
        (VIZ, &["trace", "--help"], &["DIR", "--svg", "--chrome"]),
    ] {
        let out = run(exe, args);
        let text = stdout(&out);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{exe} {args:?}: {}",
            stderr(&out)
        );
        for flag in flags {
            assert!(text.contains(flag), "{exe} {args:?} lacks {flag}:\n{text}");
        }
    }
}

#[test]
fn a_misspelt_flag_is_named_and_the_right_one_suggested() {
    // (tool, its usage-error status, arguments, the misspelling, the suggestion)
    for (exe, code, args, wrong, right) in [
        (
            FERRORUN,
            2,
            &["--nproc-per-nod", "2", "true"][..],
            "--nproc-per-nod",
            "--nproc-per-node",
        ),
        (
            FERRORUN,
            2,
            &["--master-adr", "h", "true"],
            "--master-adr",
            "--master-addr",
        ),
        // ferroccl-rendezvous fails with 1 for every error, as it always has.
        (
            RENDEZVOUS,
            1,
            &["--new-unique-idd"],
            "--new-unique-idd",
            "--new-unique-id",
        ),
        (TUNE, 2, &["predict", "--rank", "4"], "--rank", "--ranks"),
        (TUNE, 2, &["predcit"], "predcit", "predict"),
        (TOPO, 2, &["--jsn"], "--jsn", "--json"),
        (VIZ, 2, &["ring", "--rank", "4"], "--rank", "--ranks"),
        (VIZ, 2, &["all-gaher"], "all-gaher", "all-gather"),
    ] {
        let out = run(exe, args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "{exe} {args:?}: {err}");
        assert!(
            err.contains(&format!("'{wrong}'")),
            "{exe} {args:?} does not name {wrong}: {err}"
        );
        assert!(
            err.contains("similar") && err.contains(&format!("'{right}'")),
            "{exe} {args:?} does not suggest {right}: {err}"
        );
        assert!(
            stdout(&out).is_empty(),
            "{exe} {args:?} printed {}",
            stdout(&out)
        );
    }
}

#[test]
fn a_bad_value_is_an_error_naming_its_flag() {
    for (exe, code, args, flag) in [
        (
            FERRORUN,
            2,
            &["--nproc-per-node", "x", "true"][..],
            "--nproc-per-node",
        ),
        (
            FERRORUN,
            2,
            &["--nproc-per-node", "0", "true"],
            "--nproc-per-node",
        ),
        (
            FERRORUN,
            2,
            &["--master-port", "70000", "true"],
            "--master-port",
        ),
        (
            FERRORUN,
            2,
            &["--grace-period", "-1", "true"],
            "--grace-period",
        ),
        (FERRORUN, 2, &["--bind", "socket", "true"], "--bind"),
        (
            FERRORUN,
            2,
            &["--node-rank", "2", "--nnodes", "2", "true"],
            "--node-rank 2",
        ),
        (
            RENDEZVOUS,
            1,
            &["--unique-id", "zz", "--rank", "0", "--nranks", "1"],
            "--unique-id",
        ),
        (
            RENDEZVOUS,
            1,
            &["--new-unique-id", "--serve-seconds", "soon"],
            "--serve-seconds",
        ),
        (
            RENDEZVOUS,
            1,
            &["--rank", "0", "--nranks", "1"],
            "--unique-id",
        ),
        (TUNE, 2, &["predict", "--ranks", "x"], "--ranks"),
        (
            TUNE,
            2,
            &["predict", "--ranks", "4", "--net", "30"],
            "--net",
        ),
        (TUNE, 2, &["predict"], "--ranks"),
        (TOPO, 2, &["--hosts", "0"], "--hosts"),
        (
            TOPO,
            2,
            &["--hosts", "2", "--channels", "many"],
            "--channels",
        ),
        (VIZ, 2, &["ring", "--ranks", "x"], "--ranks"),
        (VIZ, 2, &["ring", "--algorithm", "star"], "--algorithm"),
        (VIZ, 2, &["ring", "--values", "-"], "--values"),
        (
            VIZ,
            2,
            &["broadcast", "--ranks", "4", "--root", "4"],
            "--root 4",
        ),
        (
            VIZ,
            2,
            &["simulate", "--topology", "t.json", "--size", "12Q"],
            "--size",
        ),
    ] {
        let out = run(exe, args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "{exe} {args:?}: {err}");
        assert!(
            err.contains(flag),
            "{exe} {args:?} does not name {flag}: {err}"
        );
    }
    // No subcommand, no program.
    let out = run(FERRORUN, &["--nproc-per-node", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no program to run"),
        "{}",
        stderr(&out)
    );
    let out = run(TUNE, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("`measure` or `predict`"),
        "{}",
        stderr(&out)
    );
    let out = run(VIZ, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no command"), "{}", stderr(&out));
}

#[test]
fn completions_print_a_script_for_each_shell() {
    for (name, exe) in TOOLS {
        for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
            let out = run(exe, &["--completions", shell]);
            let script = stdout(&out);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{name} {shell}: {}",
                stderr(&out)
            );
            assert!(script.contains(name), "{name} {shell}:\n{script}");
        }
        let script = stdout(&run(exe, &["--completions", "bash"]));
        assert!(script.contains("complete "), "{name}:\n{script}");
        let out = run(exe, &["--completions", "tcsh"]);
        assert!(!out.status.success(), "{name}");
        assert!(
            stderr(&out).contains("--completions"),
            "{name}: {}",
            stderr(&out)
        );
    }
    // The subcommands' flags are completed too.
    let script = stdout(&run(VIZ, &["--completions", "bash"]));
    assert!(script.contains("--topology") && script.contains("--algorithm"));
    let script = stdout(&run(TUNE, &["--completions", "fish"]));
    assert!(script.contains("local-ll"));
}

#[test]
fn ferrorun_reads_its_own_flags_only_before_the_program() {
    // After the program's name, --completions, --help and ferrorun's flags are the
    // program's, with or without `--`.
    for args in [
        &[
            "--nproc-per-node",
            "1",
            "--no-prefix",
            "echo",
            "--completions",
            "bash",
        ][..],
        &[
            "--nproc-per-node",
            "1",
            "--no-prefix",
            "--",
            "echo",
            "--completions",
            "bash",
        ],
    ] {
        let out = run(FERRORUN, args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), "--completions bash\n", "{args:?}");
    }
    let out = run(
        FERRORUN,
        &[
            "--nproc-per-node",
            "1",
            "echo",
            "-h",
            "--nproc-per-node",
            "3",
            "--",
            "x",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "[rank0]: -h --nproc-per-node 3 -- x\n");
}

#[test]
fn typical_command_lines_work_as_before() {
    // ferrorun: torchrun's spellings, both of them, and the program's exit status.
    let out = run(
        FERRORUN,
        &[
            "--nproc_per_node=2",
            "--master-addr",
            "127.0.0.1",
            "--grace-period",
            "1",
            "--bind",
            "none",
            "--",
            "sh",
            "-c",
            "echo $RANK/$WORLD_SIZE",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let mut lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    lines.sort();
    assert_eq!(lines, ["[rank0]: 0/2", "[rank1]: 1/2"]);
    let out = run(FERRORUN, &["--nproc-per-node", "1", "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("rank 0") && err.contains("exited with status 7"),
        "{err}"
    );

    // ferroccl-rendezvous: a UniqueId, served for no time at all.
    let out = run(RENDEZVOUS, &["--new-unique-id", "--serve-seconds", "0"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = stdout(&out);
    assert!(
        id.trim().len() > 16 && id.trim().chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );

    // ferroccl-tune predict.
    let out = run(
        TUNE,
        &[
            "predict",
            "--ranks",
            "4",
            "--hosts",
            "2",
            "--net",
            "30,1.25",
            "--local",
            "1,10",
            "--local-ll",
            "0.8,3",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with("# all-reduce on 4 ranks, 2 hosts; local 1.00 us 10.00 GB/s (LL 0.80 us 3.00 GB/s, single copy 2.30 us 4.90 GB/s), net 30.00 us 1.25 GB/s"),
        "{text}"
    );
    assert!(text.contains("# protocol:"), "{text}");
    // Ranks that share CPUs: recursive doubling takes the middle sizes, then the
    // two-shot (4 ranks, two to a CPU) or the ring (3 ranks, where the pair that hands
    // its input over shares a CPU; 8 ranks, four to a CPU).
    for (ranks, then) in [
        ("4", " bytes, twoshot below "),
        ("3", " bytes, then ring"),
        ("8", " bytes, then ring"),
    ] {
        let out = run(TUNE, &["predict", "--ranks", ranks, "--cpus", "2"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        assert!(
            text.contains(&format!("{ranks} ranks, 1 hosts (2 CPUs a host)")),
            "{text}"
        );
        assert!(
            text.contains("# all algorithms: oneshot below ")
                && text.contains(" bytes, doubling below ")
                && text.contains(then),
            "{text}"
        );
    }

    // ferroccl-topo, as text and as JSON.
    let out = run(
        TOPO,
        &["--hosts", "2", "--ranks-per-host", "2", "--channels", "1"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("job: 2 hosts x 2 ranks"), "{text}");
    assert!(
        text.contains("ring 0:") && !text.contains("ring 1:"),
        "{text}"
    );
    let out = run(TOPO, &["--json", "--hosts", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["job"]["hosts"], serde_json::json!([0, 1]));

    // ferroccl-viz: step tables, simulate and trace.
    let out = run(VIZ, &["ring", "--ranks", "4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("all_reduce on 4 ranks (ring)"),
        "{}",
        stdout(&out)
    );
    let out = run(
        VIZ,
        &[
            "all-gather",
            "--ranks",
            "3",
            "--algorithm",
            "oneshot",
            "--values",
            "7",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("all_gather on 3 ranks (oneshot); values from seed 7"));
    let out = run(
        VIZ,
        &[
            "broadcast",
            "--ranks",
            "4",
            "--root",
            "2",
            "--collective",
            "reduce",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("reduce"), "{}", stdout(&out));
    let out = run(VIZ, &["reduce-scatter", "--algorithm", "tree"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("has no tree plan"),
        "{}",
        stderr(&out)
    );

    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("ring.html");
    let out = run(
        VIZ,
        &["ring", "--ranks", "2", "--html", page.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::read_to_string(&page).unwrap().contains("<html"));

    let topology = concat!(env!("CARGO_MANIFEST_DIR"), "/topologies/this-machine.json");
    let plot = dir.path().join("plot.svg");
    let out = run(
        VIZ,
        &[
            "simulate",
            "--topology",
            topology,
            "--size",
            "64K",
            "--plot",
            plot.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("# predicted all_reduce"), "{text}");
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("65536 ")),
        "{text}"
    );
    assert!(plot.exists());
    let out = run(VIZ, &["simulate", "--topology", topology, "--size", "8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("at least 16 bytes"),
        "{}",
        stderr(&out)
    );

    let out = run(VIZ, &["trace", dir.path().join("none").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).starts_with("ferroccl-viz: "),
        "{}",
        stderr(&out)
    );
}

/// `ferroccl-tune measure` on two rank processes of one host.
#[test]
fn tune_measure_prints_a_setting_for_each_link_it_timed_windows_included() {
    // Two rank processes of one host: Simple, LL, single copy through the kernel, and
    // single copy read in place from windows; no network link.
    let mut cmd = Command::new(FERRORUN);
    cmd.args(["--nproc-per-node", "2", "--", TUNE, "measure"])
        .env("FERROCCL_DEBUG", "INFO");
    for var in [
        "FERROCCL_CPU_BIND",
        "FERROCCL_PROTO",
        "FERROCCL_ALGO",
        "FERROCCL_TUNE_LOCAL",
        "FERROCCL_TUNE_LOCAL_LL",
        "FERROCCL_TUNE_LOCAL_SINGLE",
        "FERROCCL_TUNE_LOCAL_IN_PLACE",
        "FERROCCL_TUNE_NET",
    ] {
        cmd.env_remove(var);
    }
    let out = cmd.output().unwrap();
    let (text, log) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}{log}");
    for how in ["Simple", "LL", "SingleCopy", "SingleCopy, in a window"] {
        assert!(
            text.contains(&format!("rank 0 <-> rank 1 (local, {how}): latency ")),
            "{how}: {text}"
        );
    }
    // Each setting printed once, in a form the cost model reads back.
    for var in [
        "FERROCCL_TUNE_LOCAL",
        "FERROCCL_TUNE_LOCAL_LL",
        "FERROCCL_TUNE_LOCAL_SINGLE",
        "FERROCCL_TUNE_LOCAL_IN_PLACE",
    ] {
        let lines: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split_once(&format!("{var}=")).map(|(_, v)| v))
            .collect();
        assert_eq!(lines.len(), 1, "{var}: {text}");
        let cost = ferroccl::tune::LinkCost::parse(var, lines[0]).unwrap();
        assert!(cost.alpha > 0.0 && cost.beta > 0.0, "{var}: {cost:?}");
    }
    assert!(!text.contains("FERROCCL_TUNE_NET"), "{text}");
    // The window ping-pongs ran on registered windows, one per rank.
    for rank in 0..2 {
        assert!(
            log.contains(&format!("rank {rank}: window 0 of 16777216 bytes at ")),
            "{log}"
        );
    }
}

#[test]
fn tune_predict_prices_single_copy_in_place_when_asked() {
    let out = run(
        TUNE,
        &[
            "predict",
            "--ranks",
            "2",
            "--local-in-place",
            "2,40",
            "--in-place",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("single copy 2.00 us 40.00 GB/s in place)"),
        "{text}"
    );
    // Read in place at 40 GB/s, single copy wins the large calls (through the kernel at
    // the default 4.9 GB/s it never does).
    let last = text.lines().rfind(|l| !l.starts_with('#')).unwrap();
    assert!(last.ends_with("SingleCopy"), "{text}");
    let plain = stdout(&run(TUNE, &["predict", "--ranks", "2"]));
    let last = plain.lines().rfind(|l| !l.starts_with('#')).unwrap();
    assert!(!last.ends_with("SingleCopy"), "{plain}");
}

/// `ferroccl-topo` says which CUDA driver it sees: the simulated one by name when
/// `FERROCCL_CUDA_DRIVER` selects it, and a library that cannot be loaded as an error
/// naming the variable (never a panic).
#[test]
fn topo_names_the_cuda_driver_it_sees() {
    let simulated = Command::new(TOPO)
        .envs(common::simulated_gpu_env(2))
        .output()
        .unwrap();
    let text = stdout(&simulated);
    assert!(simulated.status.success(), "{}", stderr(&simulated));
    assert!(
        text.contains("CUDA driver: SIMULATED") && text.contains("2 simulated device(s)"),
        "{text}"
    );
    let missing = Command::new(TOPO)
        .env("FERROCCL_CUDA_DRIVER", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    let text = stdout(&missing);
    assert!(missing.status.success(), "{}", stderr(&missing));
    assert!(
        text.contains("CUDA driver: none") && text.contains("FERROCCL_CUDA_DRIVER=/nonexistent"),
        "{text}"
    );
    // A driver without an entry point ferroccl needs (too old), and a library ferroccl
    // cannot tell from a real driver where the variable names only the simulated one.
    for (hidden, want) in [
        (
            "cuPointerGetAttribute",
            "has no cuPointerGetAttribute: it is too old",
        ),
        (
            "ferroccl_simcuda_describe",
            "is not ferroccl's simulated driver",
        ),
    ] {
        let out = Command::new(TOPO)
            .envs(common::simulated_gpu_env(1))
            .env(
                "FERROCCL_CUDA_DRIVER",
                common::simulated_driver_without(&[hidden]),
            )
            .output()
            .unwrap();
        let text = stdout(&out);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            text.contains("CUDA driver: none") && text.contains(want),
            "without {hidden}: {text}"
        );
    }
    // No driver at all (where this machine has none).
    // SAFETY: probing for NVIDIA's driver by its soname; its initialisers have no
    // preconditions.
    if unsafe { libloading::Library::new("libcuda.so.1") }.is_err() {
        let none = Command::new(TOPO)
            .env_remove("FERROCCL_CUDA_DRIVER")
            .output()
            .unwrap();
        let text = stdout(&none);
        assert!(
            text.contains("CUDA driver: none")
                && text.contains("no CUDA driver: libcuda.so.1 could not be loaded"),
            "{text}"
        );
    }
}

/// `ferroccl-limits` measures and prints the floor and one bound per rank count, as text
/// and as JSON; a reader that stops early ends it quietly (status 1, nothing on
/// stderr), not with a panic on the broken pipe.
#[test]
fn limits_prints_the_floor_and_the_bounds_and_stops_quietly_on_a_closed_pipe() {
    let quick = [
        "--rounds",
        "2000",
        "--copy-bytes",
        "1048576",
        "--reps",
        "1",
        "--ranks",
        "2,4",
    ];
    let out = run(LIMITS, &quick);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("cache line, one way between CPUs of ranks 0 and 1: "),
        "{text}"
    );
    for (line, n) in lines[1..].iter().zip([2, 4]) {
        assert!(
            line.starts_with(&format!("{n} ranks: ")) && line.ends_with(" GB/s busbw"),
            "{text}"
        );
    }
    let json = run(LIMITS, &[&quick[..], &["--json"]].concat());
    assert!(json.status.success(), "{}", stderr(&json));
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(doc["one_way_us"].as_f64().unwrap() > 0.0, "{doc}");
    let ranks: Vec<u64> = doc["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ranks"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, [2, 4], "{doc}");
    // The bound takes the better of copies and reductions: (3n-1)*S bytes at that
    // read+write bandwidth, as busbw (factor 2(n-1)/n): rw/5 on 2 ranks, 1.5*rw/11 on 4.
    for (row, factor) in doc["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .zip([0.2, 1.5 / 11.0])
    {
        let gbs = |key: &str| row[key].as_f64().unwrap();
        let (copy, reduce) = (gbs("copy_read_write_gbs"), gbs("reduce_read_write_gbs"));
        assert!(copy > 0.0 && reduce > 0.0, "{row}");
        assert_eq!(gbs("read_write_gbs"), copy.max(reduce), "{row}");
        let bound = gbs("all_reduce_bound_busbw_gbs");
        assert!(
            (bound - factor * copy.max(reduce)).abs() < 1e-9 * bound,
            "{row}"
        );
    }

    let mut child = Command::new(LIMITS)
        .args(quick)
        .env_remove("FERROCCL_CPU_BIND")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let closed = child.wait_with_output().unwrap();
    assert_eq!(closed.status.code(), Some(1), "{}", stderr(&closed));
    assert!(closed.stderr.is_empty(), "{}", stderr(&closed));
}
