//! The fault-injection matrix: one row per fault and where it strikes. Each row starts
//! real rank processes, makes one of them fail, and checks what the README's "Failure
//! model" promises: every surviving rank returns an error naming the culprit within the
//! deadline, never wrong data; its communicator is destroyed promptly (no thread
//! stuck); no process is left behind and nothing is left in `/dev/shm`.
//!
//! Rows (`cargo test --test faults -- NAME` runs those whose name contains NAME):
//! - `kill_at_<step>_<algorithm>_<protocol>_<mode>`: rank 2 of 4 SIGKILLs itself as it
//!   starts a plan step of that kind (send, recv, reduce, copy; see `src/fault.rs`) in
//!   its 4th call, for the ring, the tree (a host per rank, over TCP) and one-shot, LL
//!   and Simple, and the two-shot with single copy (the survivors read the victim's
//!   buffers as it dies), in blocking calls, asynchronous calls and groups;
//! - `stop_at_<step>_<algorithm>`: rank 2 SIGSTOPs itself instead: the survivors' deadline
//!   fires and names it; after SIGCONT it fails too (never returns data);
//! - `store_server_killed_*`: the process hosting the bootstrap store dies while ranks
//!   rendezvous (they fail, naming the store) or while they run collectives (they carry
//!   on: the store is not on the data path);
//! - `shm_full_at_init`: `/dev/shm` is a 1 MiB tmpfs (in a mount namespace of the test's
//!   own) when the communicator is created; `file_store_on_a_full_filesystem`;
//! - `desync_*`: a rank calls a different collective or count, with and without
//!   `FERROCCL_DESYNC_DEBUG`;
//! - `c_abi_*`: the same failures through the C ABI: `ncclCommGetAsyncError` after a
//!   peer's death, `ncclCommAbort` from another thread.
//!
//! The cut link (veth in network namespaces) is in `tests/netns.rs`.

mod common;
mod ranks;

use std::io::{BufRead, BufReader};
use std::process::{Child, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use common::shm_left_by;
use ferroccl::bootstrap::UniqueId;
use ferroccl::comm::CommConfig;
use ferroccl::{Communicator, ReduceOp};
use ranks::{Ended, PlainTest, TestFn, rank_command, run_tests, wait_all};

/// Exit code of a rank that saw the failure as an error.
const SAW_FAILURE: i32 = 3;
/// Exit code of a rank that got wrong data.
const WRONG_DATA: i32 = 5;
/// Exit code of a rank whose loop ended without any failure.
const NO_FAILURE: i32 = 0;
const NRANKS: usize = 4;
const VICTIM: usize = 2;
/// The call (sequence number) in which the fault strikes: after three good ones.
const FAULT_CALL: u64 = 3;
/// How long a survivor may take to report a killed rank, from its death.
const KILL_NOTICED_WITHIN: Duration = Duration::from_secs(10);
/// How long destroying a failed communicator may take.
const DROP_WITHIN: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug)]
enum Algo {
    Ring,
    Tree,
    OneShot,
    TwoShot,
    Doubling,
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    Simple,
    LL,
    SingleCopy,
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Blocking,
    Async,
    Group,
}

fn main() -> ExitCode {
    if let Ok(role) = std::env::var("FERROCCL_TEST_ROLE") {
        return ExitCode::from(child(&role));
    }
    // Every rank of every row, in this process or a child, talks over loopback only.
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("FERROCCL_SOCKET_IFNAME", "=lo") };
    let mut tests: Vec<(String, TestFn)> = Vec::new();
    for algo in [
        Algo::Ring,
        Algo::Tree,
        Algo::OneShot,
        Algo::TwoShot,
        Algo::Doubling,
    ] {
        for step in steps_of(algo) {
            // Single copy on the two-shot (the all-reduce that carries it on 4 ranks):
            // peers read the victim's buffers as it dies.
            let protos: &[Proto] = match algo {
                Algo::TwoShot => &[Proto::SingleCopy],
                _ => &[Proto::Simple, Proto::LL],
            };
            for &proto in protos {
                for mode in [Mode::Blocking, Mode::Async, Mode::Group] {
                    tests.push((
                        format!(
                            "kill_at_{step}_{}_{}_{}",
                            algo.name(),
                            proto.name().to_lowercase(),
                            mode.name()
                        ),
                        Box::new(move || kill_row(step, algo, proto, mode)),
                    ));
                }
            }
        }
    }
    for algo in [Algo::Ring, Algo::OneShot] {
        for step in steps_of(algo) {
            tests.push((
                format!("stop_at_{step}_{}", algo.name()),
                Box::new(move || stop_row(step, algo)),
            ));
        }
    }
    let others: [(&str, PlainTest); 12] = [
        (
            "store_server_killed_during_bootstrap",
            store_server_killed_during_bootstrap,
        ),
        (
            "store_server_killed_during_a_run",
            store_server_killed_during_a_run,
        ),
        ("shm_full_at_init", shm_full_at_init),
        ("shm_full_at_first_use", shm_full_at_first_use),
        (
            "file_store_on_a_full_filesystem",
            file_store_on_a_full_filesystem,
        ),
        ("desync_of_count_without_desync_debug", || {
            desync(Desync::Count)
        }),
        ("desync_of_collective_without_desync_debug", || {
            desync(Desync::Collective)
        }),
        ("desync_with_desync_debug", desync_with_debug),
        ("c_abi_async_error_names_a_dead_peer", c_abi_async_error),
        (
            "c_abi_abort_from_another_thread",
            c_abi_abort_from_another_thread,
        ),
        ("shrink_past_a_killed_rank", || shrink_row("shrink-sweep")),
        ("c_abi_shrink_past_a_killed_rank", || {
            shrink_row("capi-shrink")
        }),
    ];
    tests.extend(
        others
            .into_iter()
            .map(|(name, f)| (name.to_string(), Box::new(f) as TestFn)),
    );
    run_tests(tests)
}

impl Algo {
    /// Its name in `FERROCCL_ALGO` and in row names.
    fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::OneShot => "one_shot",
            Algo::TwoShot => "two_shot",
            Algo::Doubling => "doubling",
        }
    }
}

impl Algo {
    /// Its name in the planner's log lines.
    fn planned_name(self) -> &'static str {
        match self {
            Algo::OneShot => "oneshot",
            Algo::TwoShot => "twoshot",
            other => other.name(),
        }
    }
}

impl Proto {
    /// Its name in `FERROCCL_PROTO`.
    fn name(self) -> &'static str {
        match self {
            Proto::Simple => "Simple",
            Proto::LL => "LL",
            Proto::SingleCopy => "SingleCopy",
        }
    }
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Blocking => "blocking",
            Mode::Async => "async",
            Mode::Group => "group",
        }
    }
}

/// The kinds of step rank 2's all-reduce plan has under `algo` (4 ranks). One-shot
/// sends its input to every peer, receives theirs into scratch memory and reduces
/// locally, and two-shot sends blocks, folds its own and receives the others' results:
/// neither copies without reducing. Recursive doubling on 4 ranks only sends and folds
/// what it receives. (A row whose step never comes fails: the victim must die by the
/// fault.)
fn steps_of(algo: Algo) -> Vec<&'static str> {
    match algo {
        Algo::Ring | Algo::Tree => vec!["send", "recv", "reduce", "copy"],
        Algo::OneShot | Algo::TwoShot => vec!["send", "recv", "reduce"],
        Algo::Doubling => vec!["send", "reduce"],
    }
}

/// Elements per all-reduce: many slots' worth (16 KiB slots), or with LL many LL slots.
const COUNT: usize = 24_577;

fn spawn_ranks(algo: Algo, proto: Proto, mode: Mode, fault: &str, timeout: Duration) -> Vec<Child> {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    (0..NRANKS)
        .map(|rank| {
            let mut cmd = rank_command("collective-loop");
            for var in [
                "FERROCCL_TRANSPORT",
                "FERROCCL_HOSTID",
                "NCCL_ALGO",
                "NCCL_PROTO",
                "NCCL_NCHANNELS",
                "FERROCCL_NCHANNELS",
                "FERROCCL_FAULT_INJECT",
            ] {
                cmd.env_remove(var);
            }
            // INFO logs name the algorithm and protocol of each call, checked below.
            cmd.env("FERROCCL_SOCKET_IFNAME", "=lo")
                .env("FERROCCL_DEBUG", "INFO")
                .env("FERROCCL_TEST_ID", id.to_string())
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", NRANKS.to_string())
                .env("FERROCCL_TEST_MODE", mode.name())
                .env("FERROCCL_TEST_TIMEOUT_MS", timeout.as_millis().to_string())
                .env("FERROCCL_ALGO", algo.name())
                .env("FERROCCL_PROTO", proto.name());
            if let Algo::Tree = algo {
                // A host per rank: a real double binary tree (inside one host the tree
                // is a chain), over TCP.
                cmd.env("FERROCCL_HOSTID", format!("host{rank}"))
                    .env("FERROCCL_NCHANNELS", "2");
            }
            if rank == VICTIM {
                cmd.env("FERROCCL_FAULT_INJECT", fault);
            }
            cmd.spawn().unwrap()
        })
        .collect()
}

/// What every row checks of the survivors: they failed naming rank `culprit` and the
/// call, got no wrong data, and destroyed their communicators promptly.
fn check_survivors(ended: &[Ended], culprit: usize, skip: usize) -> Result<(), String> {
    for (rank, e) in ended.iter().enumerate() {
        if rank == skip {
            continue;
        }
        if e.code != Some(SAW_FAILURE) {
            return Err(format!(
                "rank {rank} exited {:?} (signal {:?}), want {SAW_FAILURE}:\n{}",
                e.code, e.signal, e.stderr
            ));
        }
        let named = [
            format!("rank {culprit} died"),
            format!("rank {culprit} failed"),
            format!("rank {culprit} is unreachable"),
            format!("waits lead to rank {culprit}"),
            format!("waiting on ranks [{culprit}"),
        ];
        if !named.iter().any(|m| e.stderr.contains(m.as_str())) {
            return Err(format!(
                "rank {rank} did not name rank {culprit}:\n{}",
                e.stderr
            ));
        }
        if !(e.stderr.contains("all_reduce #") || e.stderr.contains("group #")) {
            return Err(format!("rank {rank} did not name the call:\n{}", e.stderr));
        }
        let dropped = e
            .stderr
            .lines()
            .find_map(|l| l.strip_prefix("dropped in ms: "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("rank {rank} did not report its destroy:\n{}", e.stderr))?;
        if Duration::from_millis(dropped) > DROP_WITHIN {
            return Err(format!(
                "rank {rank} took {dropped} ms to destroy its communicator"
            ));
        }
    }
    Ok(())
}

fn no_shm_left(children_pids: &[u32], since: SystemTime) -> Result<(), String> {
    let left = shm_left_by(children_pids, since);
    if left.is_empty() {
        Ok(())
    } else {
        Err(format!("left in /dev/shm: {left:?}"))
    }
}

fn kill_row(step: &str, algo: Algo, proto: Proto, mode: Mode) -> Result<(), String> {
    let fault = format!("kill:{step}:{FAULT_CALL}");
    let since = SystemTime::now();
    let children = spawn_ranks(algo, proto, mode, &fault, Duration::from_secs(60));
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let ended = wait_all(children, Duration::from_secs(120))?;
    let victim = &ended[VICTIM];
    if victim.signal != Some(libc::SIGKILL) {
        return Err(format!(
            "rank {VICTIM} was not killed by the fault (exit {:?}): its plan has no `{step}` \
             step?\n{}",
            victim.code, victim.stderr
        ));
    }
    check_survivors(&ended, VICTIM, VICTIM)?;
    // The calls ran as the row says (groups are fused plans, logged apart).
    if !matches!(mode, Mode::Group) {
        let uses = format!(
            "all_reduce of {} B uses {}/{}",
            COUNT * 4,
            algo.planned_name(),
            proto.name()
        );
        if let Some((rank, _)) = ended
            .iter()
            .enumerate()
            .find(|(_, e)| !e.stderr.contains(&uses))
        {
            return Err(format!(
                "rank {rank} did not log {uses:?}:\n{}",
                ended[rank].stderr
            ));
        }
    }
    let slowest = ended
        .iter()
        .map(|e| e.at.saturating_duration_since(victim.at))
        .max()
        .unwrap();
    if slowest > KILL_NOTICED_WITHIN {
        return Err(format!("survivors took {slowest:?} after the kill to fail"));
    }
    no_shm_left(&pids, since)?;
    println!(
        "  {fault}: every survivor failed within {slowest:.1?}, e.g. {:?}",
        first_error(&ended[0])
    );
    Ok(())
}

fn first_error(e: &Ended) -> &str {
    e.stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or("")
}

fn stop_row(step: &str, algo: Algo) -> Result<(), String> {
    let fault = format!("stop:{step}:{FAULT_CALL}");
    let timeout = Duration::from_secs(2);
    let since = SystemTime::now();
    let mut children = spawn_ranks(algo, Proto::Simple, Mode::Blocking, &fault, timeout);
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let victim = children.remove(VICTIM);
    let stopped_at = Instant::now();
    let survivors = wait_all(children, Duration::from_secs(60));
    // Resume the stalled rank whatever happened, so it never outlives the test.
    let resume = |pid: u32| unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let _ = resume(pids[VICTIM]);
    let victim = wait_all(vec![victim], Duration::from_secs(30))?.remove(0);
    let mut ended = survivors?;
    let took = stopped_at.elapsed();
    ended.insert(VICTIM, victim);
    check_survivors(&ended, VICTIM, VICTIM)?;
    // Resumed, the stalled rank finds its peers gone: an error, never data.
    let v = &ended[VICTIM];
    if v.code != Some(SAW_FAILURE) {
        return Err(format!(
            "the resumed rank exited {:?} (signal {:?}), want {SAW_FAILURE}:\n{}",
            v.code, v.signal, v.stderr
        ));
    }
    if took > timeout + KILL_NOTICED_WITHIN {
        return Err(format!(
            "survivors took {took:?} with a {timeout:?} deadline"
        ));
    }
    no_shm_left(&pids, since)?;
    println!(
        "  {fault}: survivors failed at the {timeout:?} deadline naming rank {VICTIM}, e.g. \
         {:?}; resumed, it said {:?}",
        first_error(&ended[0]),
        first_error(v)
    );
    Ok(())
}

// ----- rank processes -----------------------------------------------------------------

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"))
}

/// A rank process: its role's exit code.
fn child(role: &str) -> u8 {
    ferroccl::trace::init_from_env();
    match role {
        "collective-loop" => collective_loop(),
        "store-host" => store_host(),
        "init-only" => init_only(),
        "shm-full-host" => shm_full_host(),
        "file-store-full" => file_store_full(),
        "capi-loop" => capi_loop(),
        "shrink-sweep" => shrink_sweep(),
        "capi-shrink" => capi_shrink(),
        other => {
            eprintln!("unknown role {other}");
            2
        }
    }
}

fn init_from_test_env(timeout: Duration) -> Result<Communicator, ferroccl::Error> {
    let id: UniqueId = var("FERROCCL_TEST_ID").parse().unwrap();
    let rank: usize = var("FERROCCL_TEST_RANK").parse().unwrap();
    let n: usize = var("FERROCCL_TEST_NRANKS").parse().unwrap();
    let config = CommConfig {
        timeout,
        slot_bytes: 16 << 10,
        chunk_bytes: 4 * (16 << 10),
        ..CommConfig::from_env()?
    };
    Communicator::init_rank_with(&id, n, rank, config)
}

/// Up to `FERROCCL_TEST_CALLS` (default 1000) all-reduces in the test's mode, each
/// checked; the first error ends it.
fn collective_loop() -> u8 {
    let timeout = Duration::from_millis(var("FERROCCL_TEST_TIMEOUT_MS").parse().unwrap());
    let comm = match init_from_test_env(timeout) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("error: init: {e}");
            return 1;
        }
    };
    let (rank, n) = (comm.rank(), comm.size());
    let input: Vec<f32> = (0..COUNT)
        .map(|i| ((rank + 1) * (i % 7 + 1)) as f32)
        .collect();
    let want = |i: usize| (n * (n + 1) / 2 * (i % 7 + 1)) as f32;
    let mode = var("FERROCCL_TEST_MODE");
    let calls: usize = std::env::var("FERROCCL_TEST_CALLS")
        .map(|v| v.parse().unwrap())
        .unwrap_or(1000);
    for call in 0..calls {
        let result: Result<Vec<Vec<f32>>, ferroccl::Error> = match mode.as_str() {
            "blocking" => {
                let mut out = vec![0.0f32; COUNT];
                comm.all_reduce(&input, &mut out, ReduceOp::Sum)
                    .map(|()| vec![out])
            }
            "async" => comm
                .all_reduce_async(input.clone(), ReduceOp::Sum)
                .and_then(|p| p.wait())
                .map(|out| vec![out]),
            "group" => {
                let (mut a, mut b) = (vec![0.0f32; COUNT], vec![0.0f32; COUNT]);
                let mut g = comm.group();
                let r = g
                    .all_reduce(&input, &mut a, ReduceOp::Sum)
                    .and_then(|g| g.all_reduce(&input, &mut b, ReduceOp::Sum))
                    .map(|_| ());
                r.and_then(|()| g.end()).map(|()| vec![a, b])
            }
            other => panic!("mode {other}"),
        };
        match result {
            Ok(outs) => {
                for out in outs {
                    if let Some(i) = (0..COUNT).find(|&i| out[i] != want(i)) {
                        eprintln!(
                            "WRONG DATA in call {call} at {i}: {} != {}",
                            out[i],
                            want(i)
                        );
                        return WRONG_DATA as u8;
                    }
                }
                if call == 0 {
                    println!("running");
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                let t = Instant::now();
                drop(comm);
                eprintln!("dropped in ms: {}", t.elapsed().as_millis());
                return SAW_FAILURE as u8;
            }
        }
    }
    println!("completed");
    NO_FAILURE as u8
}

/// The first line a child prints.
fn read_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .ok();
    line
}

/// Hosts a bootstrap store (a `UniqueId`) until killed; prints the id.
fn store_host() -> u8 {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    println!("{id}");
    std::thread::sleep(Duration::from_secs(600));
    0
}

/// Creates the communicator and destroys it.
fn init_only() -> u8 {
    let t = Instant::now();
    match init_from_test_env(Duration::from_secs(60)) {
        Ok(c) if std::env::var_os("FERROCCL_TEST_FIRST_CALL").is_some() => {
            // One call, whose FIFOs beyond the rings' are made on first use.
            let mut v = vec![1.0f32; 1000];
            match c.all_reduce_in_place(&mut v, ReduceOp::Sum) {
                Ok(()) => {
                    println!("first call done");
                    0
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    SAW_FAILURE as u8
                }
            }
        }
        Ok(c) => {
            drop(c);
            println!("initialised");
            0
        }
        Err(e) => {
            eprintln!("error: init: {e}");
            eprintln!("failed after ms: {}", t.elapsed().as_millis());
            SAW_FAILURE as u8
        }
    }
}

/// Starts a store host and returns it with its id.
fn start_store_host() -> Result<(Child, String), String> {
    let mut host = rank_command("store-host").spawn().unwrap();
    let id = read_line(&mut host).trim().to_string();
    if id.is_empty() {
        let _ = host.kill();
        return Err("the store host printed no id".into());
    }
    Ok((host, id))
}

fn store_server_killed_during_bootstrap() -> Result<(), String> {
    let (mut host, id) = start_store_host()?;
    // Three of four ranks: they wait in the rendezvous for the fourth.
    let children: Vec<Child> = (0..NRANKS - 1)
        .map(|rank| {
            rank_command("init-only")
                .env("FERROCCL_TEST_ID", &id)
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", NRANKS.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    host.kill().unwrap();
    host.wait().unwrap();
    let killed_at = Instant::now();
    let ended = wait_all(children, Duration::from_secs(60))?;
    for (rank, e) in ended.iter().enumerate() {
        let named = e.stderr.contains("store");
        if e.code != Some(SAW_FAILURE) || !named {
            return Err(format!(
                "rank {rank} exited {:?} without naming the store:\n{}",
                e.code, e.stderr
            ));
        }
        let took = e.at.saturating_duration_since(killed_at);
        if took > KILL_NOTICED_WITHIN {
            return Err(format!("rank {rank} took {took:?} to notice"));
        }
    }
    println!("  e.g. {:?}", first_error(&ended[0]));
    Ok(())
}

fn store_server_killed_during_a_run() -> Result<(), String> {
    let (mut host, id) = start_store_host()?;
    let mut children: Vec<Child> = (0..NRANKS)
        .map(|rank| {
            rank_command("collective-loop")
                .env("FERROCCL_TEST_ID", &id)
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", NRANKS.to_string())
                .env("FERROCCL_TEST_MODE", "blocking")
                .env("FERROCCL_TEST_TIMEOUT_MS", "30000")
                .env("FERROCCL_TEST_CALLS", "1500")
                .env_remove("FERROCCL_FAULT_INJECT")
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, c) in children.iter_mut().enumerate() {
        let line = read_line(c);
        if !line.starts_with("running") {
            let _ = host.kill();
            return Err(format!("rank {rank} did not start: {line:?}"));
        }
    }
    host.kill().unwrap();
    host.wait().unwrap();
    // The store is not on the data path: every call after its death still completes
    // with the right data, and the communicators are destroyed cleanly.
    let ended = wait_all(children, Duration::from_secs(120))?;
    for (rank, e) in ended.iter().enumerate() {
        if e.code != Some(NO_FAILURE) || !e.stdout.contains("completed") {
            return Err(format!(
                "rank {rank} exited {:?} after the store died:\n{}",
                e.code, e.stderr
            ));
        }
    }
    Ok(())
}

/// Whether this process may make mount namespaces (root, with `unshare(1)`); if not,
/// says so loudly.
fn can_mount(row: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let unshare = std::process::Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !(root && unshare) {
        println!(
            "SKIPPED {row}: needs root and `unshare --mount` to mount a small tmpfs (root: \
             {root}, unshare works: {unshare})"
        );
    }
    root && unshare
}

/// Runs this binary with `role` in a new mount namespace (so its mounts are its own).
fn in_mount_namespace(role: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--"])
        .arg(std::env::current_exe().unwrap())
        .env("FERROCCL_TEST_ROLE", role)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

fn mount_tmpfs(dir: &str, size: &str) -> Result<(), String> {
    let status = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size}"),
            "ferroccl-test",
            dir,
        ])
        .status()
        .map_err(|e| format!("mount: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("mount tmpfs on {dir} failed ({status})"))
    }
}

fn shm_full_at_init() -> Result<(), String> {
    shm_full("shm_full_at_init", "256k", false)
}

/// 640 KiB holds the rings' FIFOs of 4 ranks on a crowded host (2 slots of 128 KiB
/// each, and LL ones) but not the one-shot's others; the ranks must fail at the call.
fn shm_full_at_first_use() -> Result<(), String> {
    shm_full("shm_full_at_first_use", "640k", true)
}

/// `/dev/shm` of `size` in a mount namespace; four ranks initialise (and with
/// `first_call`, make a one-shot all-reduce, whose FIFOs are made on first use).
fn shm_full(row: &str, size: &str, first_call: bool) -> Result<(), String> {
    if !can_mount(row) {
        return Ok(());
    }
    let mut cmd = in_mount_namespace("shm-full-host");
    cmd.env("FERROCCL_TEST_SHM_SIZE", size);
    if first_call {
        cmd.env("FERROCCL_TEST_FIRST_CALL", "1")
            .env("FERROCCL_ALGO", "one_shot");
    } else {
        cmd.env_remove("FERROCCL_TEST_FIRST_CALL")
            .env_remove("FERROCCL_ALGO");
    }
    let child = cmd.spawn().unwrap();
    let e = wait_all(vec![child], Duration::from_secs(120))?.remove(0);
    if e.code != Some(0) {
        return Err(format!("{}\n{}", e.stdout, e.stderr));
    }
    print!("{}", e.stdout);
    Ok(())
}

/// In its own mount namespace: a small `/dev/shm` (`FERROCCL_TEST_SHM_SIZE`), and four
/// ranks that connect through it. Every rank must fail promptly: those that ran out of
/// room naming `/dev/shm`, the others naming a rank that failed.
fn shm_full_host() -> u8 {
    if let Err(e) = mount_tmpfs("/dev/shm", &var("FERROCCL_TEST_SHM_SIZE")) {
        eprintln!("{e}");
        return 1;
    }
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    let start = Instant::now();
    let since = SystemTime::now();
    let children: Vec<Child> = (0..NRANKS)
        .map(|rank| {
            rank_command("init-only")
                .env("FERROCCL_TEST_ID", id.to_string())
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", NRANKS.to_string())
                .env_remove("FERROCCL_TRANSPORT")
                .env_remove("FERROCCL_HOSTID")
                .spawn()
                .unwrap()
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let ended = match wait_all(children, Duration::from_secs(90)) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    let took = start.elapsed();
    let mut ok = true;
    for (rank, e) in ended.iter().enumerate() {
        if e.code != Some(SAW_FAILURE)
            || !(e.stderr.contains("/dev/shm") || e.stderr.contains("failed: rank "))
        {
            eprintln!("rank {rank} exited {:?}:\n{}", e.code, e.stderr);
            ok = false;
        }
    }
    if !ended.iter().any(|e| e.stderr.contains("is /dev/shm full?")) {
        eprintln!("no rank said /dev/shm is full");
        ok = false;
    }
    if std::env::var_os("FERROCCL_TEST_FIRST_CALL").is_some()
        && let Some(e) = ended.iter().find(|e| e.stderr.contains("error: init:"))
    {
        eprintln!(
            "a rank failed at initialisation, not at the first call:\n{}",
            e.stderr
        );
        ok = false;
    }
    if took > KILL_NOTICED_WITHIN {
        eprintln!("the ranks took {took:?} to fail");
        ok = false;
    }
    let left = shm_left_by(&pids, since);
    if !left.is_empty() {
        eprintln!("left in /dev/shm: {left:?}");
        ok = false;
    }
    println!(
        "  every rank failed within {took:.1?}, e.g. {:?}",
        first_error(&ended[0])
    );
    if ok { 0 } else { 1 }
}

fn file_store_on_a_full_filesystem() -> Result<(), String> {
    if !can_mount("file_store_on_a_full_filesystem") {
        return Ok(());
    }
    let child = in_mount_namespace("file-store-full").spawn().unwrap();
    let e = wait_all(vec![child], Duration::from_secs(60))?.remove(0);
    if e.code != Some(0) {
        return Err(format!("{}\n{}", e.stdout, e.stderr));
    }
    print!("{}", e.stdout);
    Ok(())
}

/// In its own mount namespace: a FileStore on a 64 KiB tmpfs that fills up. A write
/// that does not fit is an error naming the file; the store stays readable and
/// consistent, and works again once there is room.
fn file_store_full() -> u8 {
    use ferroccl::store::{FileStore, Store};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    if let Err(e) = mount_tmpfs(&d, "64k") {
        eprintln!("{e}");
        return 1;
    }
    let run = || -> Result<(), String> {
        let store = FileStore::open(dir.path().join("store")).map_err(|e| e.to_string())?;
        store.set("before", b"kept").map_err(|e| e.to_string())?;
        // Fill the filesystem.
        let filler = dir.path().join("filler");
        let mut f = std::fs::File::create(&filler).map_err(|e| e.to_string())?;
        let block = vec![7u8; 4096];
        while std::io::Write::write_all(&mut f, &block).is_ok() {}
        drop(f);
        let big = vec![1u8; 20_000];
        let err = match store.set("big", &big) {
            Ok(()) => return Err("a write to a full filesystem succeeded".into()),
            Err(e) => e.to_string(),
        };
        if !err.contains("store") || !err.to_lowercase().contains("space") {
            return Err(format!("the error does not say what happened: {err}"));
        }
        // Still readable and consistent.
        let kept = store.get("before").map_err(|e| e.to_string())?;
        if kept != b"kept" || store.check(&["big"]).map_err(|e| e.to_string())? {
            return Err(format!("state changed by the failed write: {kept:?}"));
        }
        // Room again: it works, and a second handle replays the same state.
        std::fs::remove_file(&filler).map_err(|e| e.to_string())?;
        store.set("big", &big).map_err(|e| e.to_string())?;
        let again = FileStore::open(dir.path().join("store")).map_err(|e| e.to_string())?;
        if again.get("big").map_err(|e| e.to_string())? != big
            || again.get("before").map_err(|e| e.to_string())? != b"kept"
        {
            return Err("a fresh handle reads different values".into());
        }
        println!("  a write to the full filesystem failed with: {err:?}");
        Ok(())
    };
    let result = run();
    let _ = std::process::Command::new("umount").arg(&d).status();
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

#[derive(Clone, Copy)]
enum Desync {
    /// Rank 2 all-reduces one element more than the others.
    Count,
    /// Rank 2 broadcasts where the others all-reduce.
    Collective,
}

/// Without the desync check: four ranks (threads), rank 2 out of step. Every rank must
/// get an error, and no rank data: the slice sizes disagree, or the deadline fires.
fn desync(kind: Desync) -> Result<(), String> {
    let config = CommConfig {
        timeout: Duration::from_secs(3),
        slot_bytes: 16 << 10,
        chunk_bytes: 4 * (16 << 10),
        ..CommConfig::default()
    };
    let comms = Communicator::init_all_with(NRANKS, config).map_err(|e| e.to_string())?;
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let count = if c.rank() == VICTIM {
                        match kind {
                            Desync::Count => COUNT + 1,
                            Desync::Collective => COUNT,
                        }
                    } else {
                        COUNT
                    };
                    let input = vec![1.0f32; count];
                    let mut out = vec![0.0f32; count];
                    let r = match kind {
                        Desync::Collective if c.rank() == VICTIM => {
                            c.broadcast(&input, &mut out, 0)
                        }
                        _ => c.all_reduce(&input, &mut out, ReduceOp::Sum),
                    };
                    r.map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok(()) => return Err(format!("rank {rank} returned data from a desynced call")),
            Err(e) if !e.contains("rank ") => {
                return Err(format!("rank {rank}'s error names no rank: {e}"));
            }
            Err(_) => {}
        }
    }
    println!("  e.g. rank 0: {:?}", results[0].as_ref().unwrap_err());
    Ok(())
}

/// With `FERROCCL_DESYNC_DEBUG`'s check on (a process group): every rank names the
/// desync, both calls and who made them, before any data moves.
fn desync_with_debug() -> Result<(), String> {
    use ferroccl::pg::{PgOptions, ProcessGroup};
    let options = PgOptions {
        desync_debug: true,
        timeout: Duration::from_secs(30),
        ..PgOptions::default()
    };
    let pgs: Vec<ProcessGroup> = Communicator::init_all(NRANKS)
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|c| ProcessGroup::from_communicator(c, "default", options.clone()).unwrap())
        .collect();
    let results: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = pgs
            .iter()
            .map(|pg| {
                s.spawn(move || {
                    let count = if pg.rank() == VICTIM { 9 } else { 8 };
                    match pg.all_reduce(vec![1i32; count], ReduceOp::Sum) {
                        Ok(w) => match w.wait() {
                            Ok(_) => "no error".to_string(),
                            Err(e) => e.to_string(),
                        },
                        Err(e) => e.to_string(),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, e) in results.iter().enumerate() {
        if !(e.contains("desync at #0")
            && e.contains("ranks [0, 1, 3] called all_reduce(count 8, int32, sum)")
            && e.contains("ranks [2] called all_reduce(count 9, int32, sum)"))
        {
            return Err(format!("rank {rank}: {e}"));
        }
    }
    println!("  e.g. rank 0: {:?}", results[0]);
    Ok(())
}

/// `ncclCommInitRank` from the test environment's unique id, rank and rank count, as a
/// C-ABI rank starts; `None` (after saying why) if it failed.
fn capi_init_from_env() -> Option<*mut std::ffi::c_void> {
    use ferroccl::bootstrap::UNIQUE_ID_BYTES;
    use ferroccl::capi::*;
    let id: UniqueId = var("FERROCCL_TEST_ID").parse().unwrap();
    let rank: i32 = var("FERROCCL_TEST_RANK").parse().unwrap();
    let n: i32 = var("FERROCCL_TEST_NRANKS").parse().unwrap();
    let mut raw = NcclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    for (d, s) in raw.internal.iter_mut().zip(id.as_bytes()) {
        *d = *s as std::ffi::c_char;
    }
    let mut comm = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and id, as NCCL documents.
    let r = unsafe { ncclCommInitRank(&mut comm, n, raw, rank) };
    if r != SUCCESS {
        eprintln!("error: ncclCommInitRank returned {r}");
        return None;
    }
    Some(comm)
}

/// A rank driving the C ABI: `ncclCommInitRank`, then all-reduces until one fails; then
/// `ncclCommGetAsyncError` and `ncclGetLastError`, then `ncclCommDestroy`.
fn capi_loop() -> u8 {
    use ferroccl::capi::*;
    use std::ffi::{CStr, c_void};
    let Some(comm) = capi_init_from_env() else {
        return 1;
    };
    let mut buf = vec![1.0f32; COUNT];
    for call in 0..1000 {
        let p = buf.as_mut_ptr() as *mut c_void;
        // SAFETY: in place on a live buffer of COUNT floats; float32 = 7, sum = 0.
        let r = unsafe { ncclAllReduce(p, p, COUNT, 7, 0, comm, std::ptr::null_mut()) };
        if r != SUCCESS {
            let mut async_error = -1;
            // SAFETY: a live communicator and a valid out-pointer.
            let q = unsafe { ncclCommGetAsyncError(comm, &mut async_error) };
            // SAFETY: returns a NUL-terminated string owned by the library.
            let last = unsafe { CStr::from_ptr(ncclGetLastError(comm)) }
                .to_string_lossy()
                .into_owned();
            eprintln!(
                "error: ncclAllReduce #{call} returned {r}; async error {async_error} ({q}); last error: {last}"
            );
            let t = Instant::now();
            // SAFETY: a live communicator, destroyed once.
            let d = unsafe { ncclCommDestroy(comm) };
            eprintln!("dropped in ms: {}", t.elapsed().as_millis());
            return if r == REMOTE_ERROR
                && async_error == REMOTE_ERROR
                && q == SUCCESS
                && d == SUCCESS
            {
                SAW_FAILURE as u8
            } else {
                eprintln!(
                    "want ncclRemoteError ({REMOTE_ERROR}) from the call and GetAsyncError, and a clean destroy ({d})"
                );
                1
            };
        }
        buf.iter_mut().for_each(|x| *x = 1.0);
        if call == 0 {
            println!("running");
        }
    }
    0
}

fn c_abi_async_error() -> Result<(), String> {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    let since = SystemTime::now();
    let children: Vec<Child> = (0..NRANKS)
        .map(|rank| {
            let mut cmd = rank_command("capi-loop");
            cmd.env("FERROCCL_TEST_ID", id.to_string())
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", NRANKS.to_string())
                .env_remove("FERROCCL_FAULT_INJECT");
            if rank == VICTIM {
                cmd.env("FERROCCL_FAULT_INJECT", format!("kill:any:{FAULT_CALL}"));
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let ended = wait_all(children, Duration::from_secs(120))?;
    if ended[VICTIM].signal != Some(libc::SIGKILL) {
        return Err(format!(
            "rank {VICTIM} was not killed:\n{}",
            ended[VICTIM].stderr
        ));
    }
    check_survivors(&ended, VICTIM, VICTIM)?;
    no_shm_left(&pids, since)?;
    println!("  e.g. {:?}", first_error(&ended[0]));
    Ok(())
}

/// `ncclCommAbort` from a second thread while the first waits in `ncclAllReduce` for
/// ranks that never call: the call returns an error at once, naming the abort.
fn c_abi_abort_from_another_thread() -> Result<(), String> {
    use ferroccl::capi::*;
    use std::ffi::{CStr, c_void};
    let mut comms: Vec<*mut c_void> = vec![std::ptr::null_mut(); 2];
    // SAFETY: room for 2 handles; NULL device list (devices 0..n).
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) };
    if r != SUCCESS {
        return Err(format!("ncclCommInitAll returned {r}"));
    }
    let (c0, c1) = (comms[0] as usize, comms[1] as usize);
    let waiter = std::thread::spawn(move || {
        let mut x = vec![1.0f32; 1000];
        let p = x.as_mut_ptr() as *mut c_void;
        let t = Instant::now();
        // SAFETY: a live communicator and buffer; rank 1 never calls, so this waits
        // until the abort.
        let r = unsafe { ncclAllReduce(p, p, 1000, 7, 0, c0 as *mut c_void, std::ptr::null_mut()) };
        // SAFETY: NULL asks for the last error of this thread.
        let last = unsafe { CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }
            .to_string_lossy()
            .into_owned();
        (r, t.elapsed(), last)
    });
    std::thread::sleep(Duration::from_millis(300));
    let aborted_at = Instant::now();
    // SAFETY: a live communicator, aborted once, from another thread than its call.
    let a = unsafe { ncclCommAbort(c0 as *mut c_void) };
    let (r, _, last) = waiter.join().unwrap();
    let returned_after = aborted_at.elapsed();
    // SAFETY: the other live communicator, destroyed once.
    let d = unsafe { ncclCommDestroy(c1 as *mut c_void) };
    if a != SUCCESS || d != SUCCESS {
        return Err(format!("ncclCommAbort {a}, ncclCommDestroy {d}"));
    }
    if r == SUCCESS || !last.contains("abort") {
        return Err(format!("the waiting call returned {r}: {last}"));
    }
    if returned_after > Duration::from_secs(2) {
        return Err(format!(
            "the waiting call returned {returned_after:?} after the abort"
        ));
    }
    // The handle is gone: a later call is a clear error, not a crash.
    let mut n = 0;
    // SAFETY: the handle is stale; the registry refuses it by address.
    let r = unsafe { ncclCommCount(c0 as *mut c_void, &mut n) };
    if r != INVALID_ARGUMENT {
        return Err(format!("ncclCommCount on an aborted handle returned {r}"));
    }
    println!("  the waiting call returned {r} {returned_after:.1?} after the abort: {last:?}");
    Ok(())
}

/// Counts of the sweep before and after the shrink: 0, 1, primes, not divisible by 3 or
/// 4, many slots.
const SWEEP: [usize; 6] = [0, 1, 7, 1023, 4099, 65_537];

/// One all-reduce of each sweep count on `comm`, checked; the first error is returned.
fn sweep(comm: &Communicator) -> Result<(), ferroccl::Error> {
    let (rank, n) = (comm.rank(), comm.size());
    for count in SWEEP {
        let input: Vec<i32> = (0..count)
            .map(|i| ((rank + 1) * (i % 7 + 1)) as i32)
            .collect();
        let mut out = vec![0i32; count];
        comm.all_reduce(&input, &mut out, ReduceOp::Sum)?;
        if let Some(i) = (0..count).find(|&i| out[i] != (n * (n + 1) / 2 * (i % 7 + 1)) as i32) {
            eprintln!(
                "WRONG DATA: {count} elements on {n} ranks, at {i}: {}",
                out[i]
            );
            std::process::exit(WRONG_DATA);
        }
    }
    Ok(())
}

/// Sweeps until a call fails (rank 2 kills itself), then shrinks past the rank the error
/// blames and runs the whole sweep on the survivors.
fn shrink_sweep() -> u8 {
    let comm = match init_from_test_env(Duration::from_secs(60)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: init: {e}");
            return 1;
        }
    };
    let err = loop {
        if let Err(e) = sweep(&comm) {
            break e;
        }
    };
    eprintln!("error: {err}");
    let Some(dead) = err.blamed_rank() else {
        eprintln!("the error blames no rank");
        return 1;
    };
    let t = Instant::now();
    let small = match comm.shrink(&[dead]) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("shrink: {e}");
            return 1;
        }
    };
    drop(comm);
    if let Err(e) = sweep(&small).and_then(|()| sweep(&small)) {
        eprintln!("after the shrink: {e}");
        return 1;
    }
    println!(
        "rank {} of {} finished the sweep after shrinking past rank {dead} in {:.1?}",
        small.rank(),
        small.size(),
        t.elapsed()
    );
    0
}

/// The same through the C ABI: `ncclCommShrink(…, NCCL_SHRINK_ABORT)` after
/// `ncclAllReduce` failed, then the sweep on the new communicator.
fn capi_shrink() -> u8 {
    use ferroccl::capi::*;
    use std::ffi::{c_int, c_void};
    let Some(comm) = capi_init_from_env() else {
        return 1;
    };
    // C-ABI sweep: returns the first failing result.
    let sweep = |comm: *mut c_void, n: usize, rank: usize| -> c_int {
        for count in SWEEP {
            let mut buf: Vec<i32> = (0..count)
                .map(|i| ((rank + 1) * (i % 7 + 1)) as i32)
                .collect();
            let p = buf.as_mut_ptr() as *mut c_void;
            // SAFETY: in place on a live buffer of `count` int32s (ncclInt32 = 2, sum = 0).
            let r = unsafe { ncclAllReduce(p, p, count, 2, 0, comm, std::ptr::null_mut()) };
            if r != SUCCESS {
                return r;
            }
            if (0..count).any(|i| buf[i] != (n * (n + 1) / 2 * (i % 7 + 1)) as i32) {
                eprintln!("WRONG DATA: {count} elements on {n} ranks");
                std::process::exit(WRONG_DATA);
            }
        }
        SUCCESS
    };
    let (mut rank, mut n) = (-1, -1);
    // SAFETY: a live communicator and valid out-pointers.
    unsafe {
        ncclCommUserRank(comm, &mut rank);
        ncclCommCount(comm, &mut n);
    }
    let failed = loop {
        let r = sweep(comm, n as usize, rank as usize);
        if r != SUCCESS {
            break r;
        }
    };
    eprintln!("error: ncclAllReduce returned {failed}");
    let mut exclude = [VICTIM as c_int];
    let mut small: *mut c_void = std::ptr::null_mut();
    // SAFETY: live communicator, a list of one rank, a valid out-pointer, NULL config.
    let r = unsafe {
        ncclCommShrink(
            comm,
            exclude.as_mut_ptr(),
            1,
            &mut small,
            std::ptr::null_mut(),
            SHRINK_ABORT,
        )
    };
    if r != SUCCESS {
        eprintln!("ncclCommShrink returned {r}");
        return 1;
    }
    let (mut new_rank, mut new_n) = (-1, -1);
    // SAFETY: a live communicator and valid out-pointers.
    unsafe {
        ncclCommUserRank(small, &mut new_rank);
        ncclCommCount(small, &mut new_n);
    }
    let r = sweep(small, new_n as usize, new_rank as usize);
    // SAFETY: two live communicators, each destroyed once.
    let d = unsafe { ncclCommDestroy(comm) + ncclCommDestroy(small) };
    if r != SUCCESS || d != SUCCESS {
        eprintln!("after the shrink: sweep {r}, destroy {d}");
        return 1;
    }
    println!("rank {new_rank} of {new_n} finished the sweep through ncclCommShrink");
    0
}

/// Kills rank 2 of 4 during a sweep; the three survivors shrink and finish it.
fn shrink_row(role: &str) -> Result<(), String> {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    let since = SystemTime::now();
    let children: Vec<Child> = (0..NRANKS)
        .map(|rank| {
            let mut cmd = rank_command(role);
            cmd.env("FERROCCL_TEST_ID", id.to_string())
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", NRANKS.to_string())
                .env_remove("FERROCCL_FAULT_INJECT");
            if rank == VICTIM {
                cmd.env(
                    "FERROCCL_FAULT_INJECT",
                    format!("kill:any:{}", 2 * SWEEP.len() + 3),
                );
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let ended = wait_all(children, Duration::from_secs(120))?;
    if ended[VICTIM].signal != Some(libc::SIGKILL) {
        return Err(format!(
            "rank {VICTIM} was not killed:\n{}",
            ended[VICTIM].stderr
        ));
    }
    let mut new_ranks = Vec::new();
    for (rank, e) in ended.iter().enumerate() {
        if rank == VICTIM {
            continue;
        }
        if e.code != Some(0) || !e.stdout.contains("of 3 finished the sweep") {
            return Err(format!(
                "rank {rank} exited {:?}:\n{}\n{}",
                e.code, e.stdout, e.stderr
            ));
        }
        new_ranks.push(
            e.stdout
                .split("rank ")
                .nth(1)
                .and_then(|t| t.split(' ').next())
                .unwrap_or("?")
                .to_string(),
        );
    }
    // Ranks keep their order: 0, 1, 3 become 0, 1, 2.
    if new_ranks != ["0", "1", "2"] {
        return Err(format!("new ranks {new_ranks:?}, want [0, 1, 2]"));
    }
    no_shm_left(&pids, since)?;
    println!("  {}", ended[0].stdout.trim());
    Ok(())
}
