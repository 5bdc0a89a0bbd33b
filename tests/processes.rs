//! Ranks as processes: the collective grid of `tests/collectives.rs` over `/dev/shm`,
//! over TCP, and on two "hosts" (distinct `FERROCCL_HOSTID`s: shared memory inside a host,
//! TCP between them); and what happens when one rank is killed mid all-reduce, on one
//! host and across hosts.
//!
//! This test binary is its own rank program: the parent (run by `cargo test`) starts
//! copies of itself with `FERROCCL_TEST_ROLE` set, so it has no libtest harness (see
//! `tests/ranks`).

mod common;
mod ranks;

use std::io::{BufRead, BufReader};
use std::process::{Child, ExitCode};
use std::time::{Duration, Instant, SystemTime};

use common::{collectives, ops, run_and_check_in, shm_left_by};
use ferroccl::bootstrap::UniqueId;
use ferroccl::comm::CommConfig;
use ferroccl::plan::Collective;
use ferroccl::transport::window::SharedMemory;
use ferroccl::{Communicator, DataType, ReduceOp};
use ranks::{PlainTest, TestFn, rank_command, run_tests, wait_all};

const COUNTS: [usize; 6] = [0, 1, 2, 7, 1023, 65_537];
/// Bytes of the window that holds every buffer of a rank with `Net::ShmWindows` (the
/// grid's largest calls, and the loop's two buffers of 16 MiB each).
const ARENA_BYTES: usize = 32 << 20;
/// Elements of the windows grid's large all-reduces: 6 MiB of `f32` per buffer, past
/// where three ranks on two cores stream their results.
const LARGE_IN_WINDOWS: usize = 1_572_869;
/// Exit code of a surviving rank that reported the failure of a peer.
const SAW_FAILURE: i32 = 3;

fn main() -> ExitCode {
    if let Ok(role) = std::env::var("FERROCCL_TEST_ROLE") {
        return ExitCode::from(child(&role));
    }
    let tests: [(&str, PlainTest); 16] = [
        ("grid_on_four_processes", || grid_on_processes(4, Net::Shm)),
        ("grid_on_three_processes_with_single_copy_forced", || {
            grid_on_processes(3, Net::ShmSingleCopy)
        }),
        ("grid_on_three_processes_reading_windows_in_place", || {
            grid_on_processes(3, Net::ShmWindows)
        }),
        (
            "grid_on_two_processes_with_single_copy_refused_by_the_kernel",
            || grid_on_processes(2, Net::ShmSingleCopyRefused),
        ),
        ("grid_on_four_processes_with_ll_forced", || {
            grid_on_processes(4, Net::ShmLL)
        }),
        ("grid_on_seven_processes", || grid_on_processes(7, Net::Shm)),
        ("grid_on_two_processes_keeping_their_slots", || {
            grid_on_processes(2, Net::ShmSlotsKept)
        }),
        ("grid_on_three_processes_over_tcp", || {
            grid_on_processes(3, Net::Tcp)
        }),
        ("grid_on_three_processes_over_striped_tcp", || {
            grid_on_processes(3, Net::TcpStriped)
        }),
        ("grid_on_two_hosts_of_two_processes", || {
            grid_on_processes(4, Net::TwoHosts)
        }),
        ("grid_on_two_hosts_with_ll_forced", || {
            grid_on_processes(4, Net::TwoHostsLL)
        }),
        ("grid_on_five_hosts_with_trees", || {
            grid_on_processes(5, Net::HostPerRankTree)
        }),
        ("killed_rank_is_named_by_every_survivor", || {
            killed_rank_is_named(Net::Shm)
        }),
        ("killed_rank_across_hosts_is_named", || {
            killed_rank_is_named(Net::TwoHosts)
        }),
        ("killed_rank_is_named_while_its_buffer_is_read", || {
            killed_rank_is_named(Net::ShmSingleCopy)
        }),
        ("killed_rank_is_named_while_its_window_is_read", || {
            killed_rank_is_named(Net::ShmWindows)
        }),
    ];
    run_tests(
        tests
            .into_iter()
            .map(|(name, f)| (name.to_string(), Box::new(f) as TestFn))
            .collect(),
    )
}

/// The settings of a child rank: small slots, so counts span many of them, over what
/// the parent set in the environment (transport, algorithm, channels, sockets).
fn config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(60),
        slot_bytes: 16 << 10,
        chunk_bytes: 4 * (16 << 10),
        ..CommConfig::from_env().expect("the FERROCCL_* variables the test set")
    }
}

/// How the ranks reach each other.
#[derive(Clone, Copy, PartialEq)]
enum Net {
    /// One host: shared memory.
    Shm,
    /// As `Shm`, with the FIFOs' slots kept where they are (`FERROCCL_SLOT_EXCHANGE=0`).
    ShmSlotsKept,
    /// As `Shm`, every call with the LL protocol (`FERROCCL_PROTO=LL`).
    ShmLL,
    /// One host, TCP forced between every pair.
    Tcp,
    /// As `Tcp`, each link striped over 2 helper threads × 2 sockets.
    TcpStriped,
    /// Two hosts (by `FERROCCL_HOSTID`), half the ranks on each: shared memory inside,
    /// TCP across.
    TwoHosts,
    /// As `TwoHosts`, every call with LL: LL FIFOs inside a host, LL-sized slices
    /// through the Simple FIFOs over TCP.
    TwoHostsLL,
    /// One host per rank, all-reduce on the double binary tree (`FERROCCL_ALGO=tree`).
    HostPerRankTree,
    /// One host, every call that can with single copy (`FERROCCL_PROTO=SingleCopy`):
    /// ranks read each other's buffers with `process_vm_readv`.
    ShmSingleCopy,
    /// As `ShmSingleCopy`, with every buffer in a window each rank registered: once
    /// the window is registered the kernel refuses every rank's `process_vm_readv`, so
    /// every read goes through the mapped windows.
    ShmWindows,
    /// As `ShmSingleCopy`, but the kernel refuses rank 1's cross-memory reads (a
    /// seccomp filter, as a container's profile would): every rank falls back to the
    /// FIFOs, and says why.
    ShmSingleCopyRefused,
}

/// Starts `n` copies of this binary as ranks of one communicator.
fn spawn_ranks(role: &str, n: usize, net: Net) -> Vec<Child> {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    (0..n)
        .map(|rank| {
            let mut cmd = rank_command(role);
            for var in [
                "FERROCCL_TRANSPORT",
                "FERROCCL_HOSTID",
                "FERROCCL_ALGO",
                "NCCL_ALGO",
                "FERROCCL_PROTO",
                "NCCL_PROTO",
                "FERROCCL_NCHANNELS",
                "NCCL_NCHANNELS",
                "FERROCCL_SOCKET_NTHREADS",
                "FERROCCL_NSOCKS_PERTHREAD",
                "FERROCCL_SLOT_EXCHANGE",
            ] {
                cmd.env_remove(var);
            }
            cmd.env("FERROCCL_SOCKET_IFNAME", "=lo");
            if matches!(net, Net::ShmLL | Net::TwoHostsLL) {
                cmd.env("FERROCCL_PROTO", "LL")
                    .env("FERROCCL_DEBUG", "INFO");
            }
            if matches!(
                net,
                Net::ShmSingleCopy | Net::ShmSingleCopyRefused | Net::ShmWindows
            ) {
                cmd.env("FERROCCL_PROTO", "SingleCopy")
                    .env("FERROCCL_DEBUG", "INFO");
            }
            if net == Net::ShmWindows {
                cmd.env("FERROCCL_TEST_WINDOWS", "1");
                // Killed mid-loop: the two-shot, whose owners write into peers' windows.
                if role == "loop" {
                    cmd.env("FERROCCL_ALGO", "twoshot");
                }
            }
            if role == "grid"
                && let Some(dir) = trace_dir(net)
            {
                cmd.env("FERROCCL_TRACE", dir);
            }
            if net == Net::ShmSlotsKept {
                cmd.env("FERROCCL_SLOT_EXCHANGE", "0")
                    .env("FERROCCL_DEBUG", "INFO");
            }
            if net == Net::ShmSingleCopyRefused && rank == 1 {
                cmd.env("FERROCCL_TEST_REFUSE_CMA", "1");
            }
            match net {
                Net::Shm
                | Net::ShmSlotsKept
                | Net::ShmLL
                | Net::ShmSingleCopy
                | Net::ShmSingleCopyRefused
                | Net::ShmWindows => {}
                Net::TwoHosts | Net::TwoHostsLL => {
                    cmd.env("FERROCCL_HOSTID", format!("host{}", rank * 2 / n));
                }
                Net::Tcp => {
                    cmd.env("FERROCCL_TRANSPORT", "tcp");
                }
                Net::TcpStriped => {
                    cmd.env("FERROCCL_TRANSPORT", "tcp")
                        .env("FERROCCL_DEBUG", "INFO")
                        .env("FERROCCL_SOCKET_NTHREADS", "2")
                        .env("FERROCCL_NSOCKS_PERTHREAD", "2");
                }
                Net::HostPerRankTree => {
                    cmd.env("FERROCCL_HOSTID", format!("host{rank}"))
                        .env("FERROCCL_ALGO", "tree")
                        .env("FERROCCL_NCHANNELS", "2");
                }
            }
            cmd.env("FERROCCL_TEST_ID", id.to_string())
                .env("FERROCCL_TEST_RANK", rank.to_string())
                .env("FERROCCL_TEST_NRANKS", n.to_string())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn grid_on_processes(n: usize, net: Net) -> Result<(), String> {
    let role = if matches!(net, Net::Shm | Net::ShmSingleCopy | Net::ShmWindows) {
        "grid"
    } else {
        "small-grid"
    };
    if let Some(dir) = trace_dir(net) {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let outs = wait_all(spawn_ranks(role, n, net), Duration::from_secs(300))?;
    // The two-shot's write-back: in windows, owners wrote their pieces into every peer's
    // output (receives the sender wrote itself); with buffers outside windows a process
    // cannot write its peers' memory, and every rank read its pieces itself.
    if let Some(dir) = trace_dir(net) {
        let written = written_by_sender(&dir)?;
        let _ = std::fs::remove_dir_all(&dir);
        match net {
            Net::ShmWindows if written.len() != n => {
                return Err(format!(
                    "ranks {written:?} of {n} got pieces written by their owners"
                ));
            }
            Net::ShmSingleCopy if !written.is_empty() => {
                return Err(format!(
                    "ranks {written:?} got pieces written by peers outside windows"
                ));
            }
            _ => {}
        }
    }
    for (rank, e) in outs.iter().enumerate() {
        let (code, out, err) = (e.code, &e.stdout, &e.stderr);
        if code != Some(0) || !out.contains("checks passed") {
            return Err(format!("rank {rank} exited {code:?}:\n{out}\n{err}"));
        }
        // The transport log line shows the links really are striped TCP.
        let striped = format!("{} links of 2 threads x 2 sockets", 2 * (n - 1));
        if net == Net::TcpStriped && !(err.contains("via TCP") && err.contains(&striped)) {
            return Err(format!("rank {rank} did not log {striped:?}:\n{err}"));
        }
        // LL forced: the LL FIFOs exist, and every call (all-reduce of 65 537 elements
        // too) ran with LL.
        if matches!(net, Net::ShmLL | Net::TwoHostsLL) {
            // 8 slots where the ranks outnumber the cores, 32 where each has one.
            let fifos = ["LL FIFOs of 8 x 4096 B", "LL FIFOs of 32 x 4096 B"];
            if !fifos.iter().any(|f| err.contains(f)) {
                return Err(format!("rank {rank} did not log {fifos:?}:\n{err}"));
            }
            let wanted = ["all_reduce of 262148 B uses ", "all_gather of 4 B uses "];
            if let Some(w) = wanted.iter().find(|w| !err.contains(*w)) {
                return Err(format!("rank {rank} did not log {w:?}:\n{err}"));
            }
            if err.contains("/Simple") {
                return Err(format!("rank {rank} used Simple with LL forced:\n{err}"));
            }
        }
        // Single copy forced: probed and used (the two-shot all-reduce, the direct
        // all-gather); refused: off for every rank, with rank 1's reason, and every
        // call on the FIFOs.
        let (wanted, unwanted): (&[&str], &str) = match net {
            Net::ShmSingleCopy => (
                &[
                    "single copy available",
                    "all_reduce of 262148 B uses twoshot/SingleCopy",
                    "all_gather of 4 B uses oneshot/SingleCopy",
                ],
                "single copy off",
            ),
            Net::ShmWindows => (
                &[
                    "single copy available",
                    "window 0 of 33554432 bytes",
                    "all_reduce of 262148 B uses twoshot/SingleCopy",
                    "all_reduce of 6291476 B uses twoshot/SingleCopy",
                    "all_gather of 4 B uses oneshot/SingleCopy",
                ],
                "single copy off",
            ),
            Net::ShmSingleCopyRefused => (
                &[
                    "single copy off: rank 1: the kernel refuses reading rank 0's memory",
                    "Operation not permitted",
                    "all_reduce of 262148 B uses ring/Simple",
                    // By default the FIFOs of two processes exchange slots.
                    "exchange slots (a rank sends in the memory it has just drained)",
                ],
                "/SingleCopy",
            ),
            // The variable reached the configuration: no FIFO exchanges slots (the
            // grid's results were checked all the same).
            Net::ShmSlotsKept => (
                &["slot exchange off (FERROCCL_SLOT_EXCHANGE=0"],
                "exchange slots",
            ),
            _ => (&[], ""),
        };
        if let Some(w) = wanted.iter().find(|w| !err.contains(*w)) {
            return Err(format!("rank {rank} did not log {w:?}:\n{err}"));
        }
        if !unwanted.is_empty() && err.contains(unwanted) {
            return Err(format!("rank {rank} logged {unwanted:?}:\n{err}"));
        }
    }
    Ok(())
}

/// Where the ranks of a grid on `net` write their traces (`FERROCCL_TRACE`): with single
/// copy, to see whose receives their senders wrote.
fn trace_dir(net: Net) -> Option<std::path::PathBuf> {
    let name = match net {
        Net::ShmWindows => "windows",
        Net::ShmSingleCopy => "single-copy",
        _ => return None,
    };
    let dir = format!("ferroccl-test-trace-{}-{name}", std::process::id());
    Some(std::env::temp_dir().join(dir))
}

/// The ranks whose trace in `dir` has a step its sender wrote (`"by_sender":true`).
fn written_by_sender(dir: &std::path::Path) -> Result<Vec<usize>, String> {
    let mut ranks = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
        let rank = |l: &str| -> Option<usize> {
            let at = l.find("\"rank\":")? + 7;
            l[at..].split(',').next()?.parse().ok()
        };
        if let Some(r) = text
            .lines()
            .filter(|l| l.contains("\"by_sender\":true"))
            .find_map(rank)
        {
            ranks.push(r);
        }
    }
    ranks.sort_unstable();
    Ok(ranks)
}

/// Makes the kernel refuse this process's `process_vm_readv` calls with `EPERM`: a
/// seccomp filter, as a container's profile (or Yama, from the other side) would.
fn refuse_cross_memory_reads() {
    // BPF: load the system call's number; process_vm_readv -> ERRNO(EPERM), else allow.
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let filter = [
        libc::sock_filter {
            code: LD_W_ABS,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: JEQ_K,
            jt: 0,
            jf: 1,
            k: libc::SYS_process_vm_readv as u32,
        },
        libc::sock_filter {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: RET_ALLOW,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: prctl with these arguments reads `prog` (and its filter), which live for
    // the calls; the filter only makes one system call fail.
    let ok = unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog) == 0
    };
    assert!(ok, "seccomp: {}", std::io::Error::last_os_error());
}

fn killed_rank_is_named(net: Net) -> Result<(), String> {
    let n = 4;
    let victim = 2;
    let since = SystemTime::now();
    let mut children = spawn_ranks("loop", n, net);
    // Wait until every rank has completed an all-reduce, so all are mid-loop.
    for (rank, child) in children.iter_mut().enumerate() {
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        if !line.starts_with("running") {
            return Err(format!("rank {rank} did not start: {line:?}"));
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    children[victim].kill().map_err(|e| e.to_string())?;
    let killed_at = Instant::now();
    let outs = wait_all(children, Duration::from_secs(60))?;
    let took = killed_at.elapsed();
    for (rank, e) in outs.iter().enumerate() {
        if rank == victim {
            continue;
        }
        let err = &e.stderr;
        if e.code != Some(SAW_FAILURE) {
            return Err(format!(
                "rank {rank} exited {:?}, want {SAW_FAILURE}:\n{err}",
                e.code
            ));
        }
        let named = ["rank 2 died", "rank 2 failed", "rank 2 is unreachable"]
            .iter()
            .any(|m| err.contains(m));
        if !named || !err.contains("all_reduce #") {
            return Err(format!(
                "rank {rank} did not name rank 2 and the call:\n{err}"
            ));
        }
    }
    // Detected by liveness, well before the 60 s collective timeout.
    if took > Duration::from_secs(10) {
        return Err(format!("survivors took {took:?} to give up"));
    }
    let left = shm_left_by(&pids, since);
    if !left.is_empty() {
        return Err(format!("left in /dev/shm: {left:?}"));
    }
    println!(
        "  survivors reported rank {victim}'s death {took:.2?} after the kill, e.g. {:?}",
        outs[0].stderr.trim()
    );
    Ok(())
}

/// A rank process.
fn child(role: &str) -> u8 {
    ferroccl::trace::init_from_env();
    let var = |k: &str| std::env::var(k).unwrap();
    let id: UniqueId = var("FERROCCL_TEST_ID").parse().unwrap();
    let rank: usize = var("FERROCCL_TEST_RANK").parse().unwrap();
    let n: usize = var("FERROCCL_TEST_NRANKS").parse().unwrap();
    if std::env::var_os("FERROCCL_TEST_REFUSE_CMA").is_some() {
        refuse_cross_memory_reads();
    }
    let comm = match Communicator::init_rank_with(&id, n, rank, config()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("init: {e}");
            return 1;
        }
    };
    // Every buffer in one window; past its registration, no cross-memory reads.
    let mut arena = std::env::var_os("FERROCCL_TEST_WINDOWS").map(|_| {
        let arena = SharedMemory::new(ARENA_BYTES).unwrap();
        // SAFETY: the arena lives until the process exits, and only this
        // communicator's calls read it.
        let window = unsafe { comm.register_window(arena.as_ptr(), arena.len()) }.unwrap();
        std::mem::forget(window);
        refuse_cross_memory_reads();
        arena
    });
    match role {
        "grid" | "small-grid" => {
            // Over TCP every call costs a round of proxy hand-offs: the small grid keeps
            // every collective and root but fewer dtypes, ops and counts.
            let small = role == "small-grid";
            let dtypes: &[DataType] = if small {
                &[
                    DataType::Int8,
                    DataType::Float16,
                    DataType::Float32,
                    DataType::Float8E5M2,
                ]
            } else {
                &DataType::ALL
            };
            let counts: &[usize] = if small { &[0, 1, 7, 65_537] } else { &COUNTS };
            let mut checks = 0;
            for c in collectives(n) {
                for &dtype in dtypes {
                    let op_list: Vec<ReduceOp> = if !c.is_reducing() {
                        vec![ReduceOp::Sum]
                    } else if small {
                        vec![ReduceOp::Sum, ReduceOp::Min, ReduceOp::Avg]
                    } else {
                        ops().to_vec()
                    };
                    for op in op_list {
                        for &count in counts {
                            for in_place in [false, true] {
                                if in_place && c == Collective::AllToAll {
                                    continue;
                                }
                                let r = ferroccl::with_element_type!(dtype, T => run_and_check_in::<T>(&comm, c, op, count, in_place, arena.as_mut()));
                                if let Err(e) = r {
                                    eprintln!("{e}");
                                    return 1;
                                }
                                checks += 1;
                            }
                        }
                    }
                }
            }
            // In windows, calls whose results stream past the caches: the two-shot's
            // owners stream each piece to their output and to both peers' at once.
            if arena.is_some() {
                for (dtype, op) in [
                    (DataType::Float32, ReduceOp::Avg),
                    (DataType::Bfloat16, ReduceOp::Sum),
                ] {
                    for in_place in [false, true] {
                        let c = Collective::AllReduce;
                        let r = ferroccl::with_element_type!(dtype, T => run_and_check_in::<T>(&comm, c, op, LARGE_IN_WINDOWS, in_place, arena.as_mut()));
                        if let Err(e) = r {
                            eprintln!("{e}");
                            return 1;
                        }
                        checks += 1;
                    }
                }
            }
            println!("{checks} checks passed");
            0
        }
        "loop" => {
            const LEN: usize = 4 << 20;
            let mut heap = vec![0.0f32; 2 * LEN];
            let both: &mut [f32] = match arena.as_mut() {
                // SAFETY: the arena holds 2 * LEN floats (ARENA_BYTES), page-aligned.
                Some(a) => unsafe {
                    std::slice::from_raw_parts_mut(a.as_ptr().cast::<f32>(), 2 * LEN)
                },
                None => &mut heap,
            };
            let (send, recv) = both.split_at_mut(LEN);
            send.fill(1.0);
            let mut announced = false;
            loop {
                if let Err(e) = comm.all_reduce(send, recv, ReduceOp::Sum) {
                    eprintln!("{e}");
                    return SAW_FAILURE as u8;
                }
                if !announced {
                    println!("running");
                    announced = true;
                }
            }
        }
        other => {
            eprintln!("unknown role {other}");
            2
        }
    }
}
