//! Launch and rendezvous across real processes: `ferrorun`, `env://` bootstrap as
//! torchrun-style ranks, `UniqueId` rendezvous, and what happens when a rank fails or
//! never arrives.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
const RENDEZVOUS: &str = env!("CARGO_BIN_EXE_ferroccl-rendezvous");

/// A port free now for a store to listen on, chosen below Linux's ephemeral range
/// (32768-60999), as `python/tests/harness.py` chooses it: a port the kernel handed out
/// (`bind(0)`) can be handed out again, as the local end of another test's outgoing
/// connection, before the rank that hosts the store binds it ("Address already in use",
/// seen in CI). Tests of this process take consecutive ports from a start that differs
/// between processes, so two of them never race for one port.
fn free_port() -> u16 {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU16, Ordering};
    const FIRST: u16 = 20000;
    const PORTS: u16 = 12000;
    static START: OnceLock<u16> = OnceLock::new();
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let start = *START.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        ((std::process::id() ^ nanos) % u32::from(PORTS)) as u16
    });
    for _ in 0..100 {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (start + offset % PORTS) % PORTS;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + PORTS);
}

/// Runs a command to completion, failing the test if it takes longer than `limit`.
fn run_with_limit(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_with_limit(child, limit)
}

fn wait_with_limit(child: Child, limit: Duration) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY-free cleanup through the kill command: the test has failed anyway.
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("process {pid} did not finish within {limit:?}");
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Splits ferrorun's output into lines per rank, checking every line carries a prefix.
fn lines_by_rank(stdout: &str) -> BTreeMap<usize, Vec<String>> {
    let mut by_rank: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for line in stdout.lines() {
        let rest = line
            .strip_prefix("[rank")
            .unwrap_or_else(|| panic!("line without a rank prefix: {line:?}"));
        let (rank, body) = rest.split_once("]: ").expect("prefix ends in ]: ");
        by_rank
            .entry(rank.parse().unwrap())
            .or_default()
            .push(body.to_string());
    }
    by_rank
}

#[test]
fn ferrorun_sets_torchrun_variables_for_every_rank() {
    let out = run_with_limit(
        Command::new(FERRORUN).args([
            "--nproc-per-node",
            "4",
            "--",
            "sh",
            "-c",
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK \
             $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $TORCHELASTIC_USE_AGENT_STORE\"",
        ]),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let by_rank = lines_by_rank(&text(&out.stdout));
    assert_eq!(by_rank.len(), 4);
    let mut ports = Vec::new();
    for (rank, lines) in &by_rank {
        assert_eq!(lines.len(), 1, "{lines:?}");
        let f: Vec<&str> = lines[0].split(' ').collect();
        assert_eq!(
            &f[..7],
            [
                &rank.to_string(),
                "4",
                &rank.to_string(),
                "4",
                "0",
                "1",
                "127.0.0.1"
            ]
        );
        assert_eq!(f[8], "True");
        ports.push(f[7].parse::<u16>().unwrap());
    }
    assert!(ports.iter().all(|&p| p == ports[0] && p != 0), "{ports:?}");
}

/// The CPUs a rank may run on, as `/proc/self/status` lists them, for each rank.
fn allowed_cpus(bind: &str, nproc: usize) -> Result<BTreeMap<usize, String>, String> {
    let out = run_with_limit(
        Command::new(FERRORUN).args([
            "--nproc-per-node",
            &nproc.to_string(),
            "--bind",
            bind,
            "--",
            "sh",
            "-c",
            "grep Cpus_allowed_list /proc/self/status",
        ]),
        Duration::from_secs(30),
    );
    if !out.status.success() {
        return Err(text(&out.stderr));
    }
    Ok(lines_by_rank(&text(&out.stdout))
        .into_iter()
        .map(|(r, lines)| {
            (
                r,
                lines
                    .concat()
                    .split_whitespace()
                    .last()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect())
}

#[test]
fn ranks_are_bound_to_a_cpu_each_or_round_robin() {
    let cpus = std::thread::available_parallelism().unwrap().get();
    let all = allowed_cpus("none", 1).unwrap()[&0].clone();
    // As many ranks as CPUs: one CPU each, all different (auto and core).
    for bind in ["auto", "core"] {
        let got = allowed_cpus(bind, cpus).unwrap();
        let mut seen: Vec<&String> = got.values().collect();
        assert!(
            seen.iter().all(|c| c.parse::<usize>().is_ok()),
            "{bind}: {got:?}"
        );
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), cpus, "{bind}: {got:?}");
    }
    // More ranks than CPUs: auto binds blocks of consecutive ranks (rank r of n on the
    // ⌊r·c/n⌋-th CPU), core refuses, none never binds.
    let n = 2 * cpus + 1;
    let crowded = allowed_cpus("auto", n).unwrap();
    assert_eq!(crowded.len(), n);
    let own = allowed_cpus("auto", cpus).unwrap();
    for (r, c) in &crowded {
        assert_eq!(*c, own[&(r * cpus / n)], "rank {r}: {crowded:?} ({own:?})");
    }
    let err = allowed_cpus("core", cpus + 1).unwrap_err();
    assert!(
        err.contains(&format!("cannot bind {} ranks", cpus + 1)),
        "{err}"
    );
    let none = allowed_cpus("none", cpus).unwrap();
    assert!(none.values().all(|c| *c == all), "{none:?} vs {all}");
}

#[test]
fn two_nodes_of_four_form_one_world() {
    let port = free_port().to_string();
    let node = |node_rank: &str| {
        Command::new(FERRORUN)
            .args([
                "--nproc-per-node",
                "4",
                "--nnodes",
                "2",
                "--node-rank",
                node_rank,
            ])
            .args(["--master-port", &port, "--", RENDEZVOUS])
            .env("FERROCCL_BOOTSTRAP_TIMEOUT", "60")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Node 1 first: its ranks must wait for node 0's store to appear.
    let node1 = node("1");
    std::thread::sleep(Duration::from_millis(200));
    let node0 = node("0");
    let out0 = wait_with_limit(node0, Duration::from_secs(60));
    let out1 = wait_with_limit(node1, Duration::from_secs(60));
    assert!(out0.status.success(), "{}", text(&out0.stderr));
    assert!(out1.status.success(), "{}", text(&out1.stderr));
    let ranks0 = lines_by_rank(&text(&out0.stdout));
    let ranks1 = lines_by_rank(&text(&out1.stdout));
    assert_eq!(ranks0.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(ranks1.keys().copied().collect::<Vec<_>>(), [4, 5, 6, 7]);
    for (rank, lines) in ranks1 {
        assert!(
            lines[0].starts_with(&format!("rank {rank} of 8:")),
            "{lines:?}"
        );
    }
    // Rank 0's table has all eight ranks.
    let table = &ranks0[&0][2..];
    assert_eq!(table.len(), 8, "{table:?}");
}

/// A failing rank stops the rest; once all are gone, what they left in `/dev/shm` (as a
/// rank stopped mid-establishment does: names starting with its pid) is removed, and
/// nothing else.
#[test]
fn a_failing_rank_stops_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    // Not a rank's: pid 1 is init.
    let other = "/dev/shm/ferroccl-1-not-this-jobs";
    std::fs::write(other, b"").unwrap();
    let script = format!(
        "touch /dev/shm/ferroccl-$$-launch-test-b0 /dev/shm/ferroccl-cudafifo-$$-launch-test; \
         echo $$ > {dir}/$RANK.pid; \
         if [ \"$RANK\" = 2 ]; then \
           while [ $(ls {dir} | wc -l) -lt 4 ]; do sleep 0.05; done; exit 3; \
         fi; exec sleep 60",
        dir = dir.path().display()
    );
    let start = Instant::now();
    let out = run_with_limit(
        Command::new(FERRORUN).args([
            "--nproc-per-node",
            "4",
            "--grace-period",
            "5",
            "--",
            "sh",
            "-c",
            &script,
        ]),
        Duration::from_secs(30),
    );
    let stderr = text(&out.stderr);
    let kept = std::path::Path::new(other).exists();
    let _ = std::fs::remove_file(other);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("rank 2") && stderr.contains("exited with status 3"),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    for rank in 0..4 {
        let pid = std::fs::read_to_string(dir.path().join(format!("{rank}.pid"))).unwrap();
        let proc = format!("/proc/{}", pid.trim());
        assert!(
            !std::path::Path::new(&proc).exists(),
            "rank {rank} ({proc}) still alive"
        );
        for name in [
            format!("ferroccl-{}-launch-test-b0", pid.trim()),
            format!("ferroccl-cudafifo-{}-launch-test", pid.trim()),
        ] {
            assert!(
                !std::path::Path::new("/dev/shm").join(&name).exists(),
                "rank {rank} left {name}"
            );
        }
    }
    assert!(
        stderr.contains("removed 8 names the ranks left in /dev/shm"),
        "{stderr}"
    );
    assert!(
        kept,
        "the launcher removed {other}, which its ranks did not make"
    );
}

#[test]
fn a_rank_killed_by_a_signal_is_named() {
    let out = run_with_limit(
        Command::new(FERRORUN).args([
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "if [ \"$RANK\" = 1 ]; then kill -SEGV $$; fi; exec sleep 60",
        ]),
        Duration::from_secs(30),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 11), "{stderr}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("SIGSEGV"),
        "{stderr}"
    );
}

#[test]
fn sigterm_reaches_every_rank() {
    let mut child = Command::new(FERRORUN)
        .args([
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.05; done",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = Vec::new();
    let mut line = String::new();
    while seen.len() < 2 {
        line.clear();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "ferrorun ended early"
        );
        seen.push(line.trim().to_string());
    }
    assert!(seen.iter().all(|l| l.ends_with("ready")), "{seen:?}");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let out = wait_with_limit(child, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(128 + 15), "{}", text(&out.stderr));
    let by_rank = lines_by_rank(&rest);
    for rank in 0..2 {
        assert_eq!(
            by_rank.get(&rank).map(Vec::as_slice),
            Some(&["got-term".to_string()][..]),
            "{rest}"
        );
    }
}

/// Checks the output of `ferroccl-rendezvous` ranks: each reports itself once and rank
/// 0's peer table agrees with what every rank said about itself.
fn check_rendezvous_output(per_rank: &BTreeMap<usize, Vec<String>>, world: usize) {
    assert_eq!(per_rank.len(), world);
    let mut pids = BTreeMap::new();
    for (rank, lines) in per_rank {
        let first = &lines[0];
        assert!(
            first.starts_with(&format!("rank {rank} of {world}: ")),
            "{first}"
        );
        let pid: u32 = first
            .split(" pid ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        pids.insert(*rank, pid);
    }
    let table: Vec<&String> = per_rank[&0][2..].iter().collect();
    assert_eq!(table.len(), world, "{table:?}");
    for row in table {
        let cols: Vec<&str> = row.split_whitespace().collect();
        let rank: usize = cols[0].parse().unwrap();
        assert_eq!(cols[2].parse::<u32>().unwrap(), pids[&rank], "{row}");
    }
}

#[test]
fn eight_processes_rendezvous_under_ferrorun() {
    let out = run_with_limit(
        Command::new(FERRORUN).args(["--nproc-per-node", "8", "--", RENDEZVOUS]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    check_rendezvous_output(&lines_by_rank(&text(&out.stdout)), 8);
}

/// Starts `ferroccl-rendezvous` as the given ranks of `world`, with torchrun's variables
/// and rank 0 hosting the store itself.
fn spawn_env_ranks(ranks: &[usize], world: usize, timeout_secs: &str) -> Vec<(usize, Child)> {
    let port = free_port().to_string();
    ranks
        .iter()
        .map(|&rank| {
            let child = Command::new(RENDEZVOUS)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("FERROCCL_BOOTSTRAP_TIMEOUT", timeout_secs)
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (rank, child)
        })
        .collect()
}

/// Runs `ferroccl-rendezvous` as the given ranks (see [`spawn_env_ranks`]) until they
/// all exit, each within `limit`. Runs them again on another port, up to 3 times in all,
/// when rank 0 could not host the store because something else took the port between
/// [`free_port`] and its bind (EADDRINUSE), as `python/tests/harness.py` does.
fn run_env_ranks(
    ranks: &[usize],
    world: usize,
    timeout_secs: &str,
    limit: Duration,
) -> Vec<(usize, Output)> {
    let mut attempt = 1;
    loop {
        let outs: Vec<(usize, Output)> = spawn_env_ranks(ranks, world, timeout_secs)
            .into_iter()
            .map(|(rank, child)| (rank, wait_with_limit(child, limit)))
            .collect();
        let taken = outs
            .iter()
            .any(|(_, out)| text(&out.stderr).contains("Address already in use"));
        if !taken || attempt == 3 {
            return outs;
        }
        attempt += 1;
    }
}

#[test]
fn eight_processes_rendezvous_by_env_with_rank0_hosting() {
    let mut per_rank = BTreeMap::new();
    for (rank, out) in run_env_ranks(&[0, 1, 2, 3, 4, 5, 6, 7], 8, "60", Duration::from_secs(60)) {
        assert!(out.status.success(), "rank {rank}: {}", text(&out.stderr));
        per_rank.insert(
            rank,
            text(&out.stdout).lines().map(str::to_string).collect(),
        );
    }
    check_rendezvous_output(&per_rank, 8);
}

#[test]
fn a_missing_rank_is_named_by_every_other_rank() {
    let start = Instant::now();
    for (rank, out) in run_env_ranks(&[0, 1, 2, 3, 4, 6, 7], 8, "3", Duration::from_secs(30)) {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "rank {rank}: {stderr}");
        assert!(
            stderr.contains("timed out") && stderr.contains("1 of 8 ranks missing: [5]"),
            "rank {rank}: {stderr}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn unique_id_made_in_one_process_joins_four_others() {
    let mut host = Command::new(RENDEZVOUS)
        .args(["--new-unique-id", "--serve-seconds", "60"])
        .env("FERROCCL_SOCKET_IFNAME", "=lo")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut id = String::new();
    BufReader::new(host.stdout.take().unwrap())
        .read_line(&mut id)
        .unwrap();
    let id = id.trim().to_string();
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            Command::new(RENDEZVOUS)
                .args([
                    "--unique-id",
                    &id,
                    "--rank",
                    &rank.to_string(),
                    "--nranks",
                    "4",
                ])
                .env("FERROCCL_BOOTSTRAP_TIMEOUT", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut per_rank = BTreeMap::new();
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = wait_with_limit(child, Duration::from_secs(60));
        assert!(out.status.success(), "rank {rank}: {}", text(&out.stderr));
        per_rank.insert(
            rank,
            text(&out.stdout).lines().map(str::to_string).collect(),
        );
    }
    host.kill().unwrap();
    host.wait().unwrap();
    check_rendezvous_output(&per_rank, 4);
}
