//! Ranks on several "hosts": Linux network namespaces joined by veth pairs and a bridge,
//! each with its own address (and, optionally, a link shaped with `tc tbf`). The ranks
//! are the perf tools with `-c 1`, so every result is checked against the serial
//! reference. Needs root and `ip netns`; skips, saying so, where they are missing.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A set of namespaced hosts on one bridge; removed when dropped.
struct Hosts {
    tag: String,
    n: usize,
    subnet: u32,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// `n` hosts; with `rate` (e.g. "1gbit"), every host's link is shaped to it.
    fn new(n: usize, rate: Option<&str>) -> Result<Self, String> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let id = std::process::id() % 100_000;
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
        let hosts = Hosts {
            tag: format!("fc{id}{k}"),
            n,
            subnet: 100 + (id + k) % 150,
        };
        hosts.build(rate).inspect_err(|_| hosts.remove())?;
        Ok(hosts)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}h{i}", self.tag)
    }

    fn addr(&self, i: usize) -> String {
        format!("10.{}.{}.{}", 200 + i / 250, self.subnet, i % 250 + 1)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }

    /// The host side of host `i`'s link.
    fn outer(&self, i: usize) -> String {
        format!("{}o{i}", self.tag)
    }

    fn inner(&self, i: usize) -> String {
        format!("{}i{i}", self.tag)
    }

    fn build(&self, rate: Option<&str>) -> Result<(), String> {
        let br = self.bridge();
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["link", "set", &br, "up"])?;
        for i in 0..self.n {
            let (ns, outer, inner) = (self.ns(i), self.outer(i), self.inner(i));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])?;
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["link", "set", &outer, "master", &br, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/16", self.addr(i)),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            if let Some(rate) = rate {
                // Shape both directions of the link: the host side in this namespace,
                // the inner side in the host's.
                let tbf = [
                    "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms",
                ];
                for (netns, dev) in [(None, outer.as_str()), (Some(ns.as_str()), inner.as_str())] {
                    let mut cmd = match netns {
                        Some(netns) => {
                            let mut c = Command::new("ip");
                            c.args(["netns", "exec", netns, "tc"]);
                            c
                        }
                        None => Command::new("tc"),
                    };
                    let st = cmd
                        .args(["qdisc", "replace", "dev", dev])
                        .args(tbf)
                        .status()
                        .map_err(|e| format!("tc: {e}"))?;
                    if !st.success() {
                        return Err(format!("tc tbf on {dev} failed"));
                    }
                }
            }
        }
        Ok(())
    }

    fn remove(&self) {
        for i in 0..self.n {
            let _ = ip(&["netns", "del", &self.ns(i)]);
            let _ = ip(&["link", "del", &self.outer(i)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }

    /// Cuts host `i`'s link (as if its cable were pulled).
    fn cut(&self, i: usize) -> Result<(), String> {
        ip(&["link", "set", &self.outer(i), "down"])
    }

    /// Starts `program args` as rank `rank` of `world` inside host `host`.
    fn spawn(
        &self,
        host: usize,
        rank: usize,
        world: usize,
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.ns(host), program])
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", (rank % (world / self.n).max(1)).to_string())
            .env("LOCAL_WORLD_SIZE", (world / self.n).max(1).to_string())
            .env("MASTER_ADDR", self.addr(0))
            .env("MASTER_PORT", "29517")
            .env("FERROCCL_HOSTID", self.ns(host))
            // No FERROCCL_SOCKET_IFNAME: each rank must find its interface on the route to
            // MASTER_ADDR by itself.
            .env_remove("FERROCCL_SOCKET_IFNAME")
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env_remove("FERROCCL_TRANSPORT")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.remove();
    }
}

/// `n` hosts, or `None` (said loudly) where namespaces cannot be made at all; any other
/// set-up failure fails the test.
fn hosts(n: usize, rate: Option<&str>) -> Option<Hosts> {
    static PROBES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let k = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("fcprobe{}-{k}", std::process::id());
    if let Err(e) = ip(&["netns", "add", &probe]) {
        skip_notice(&format!(
            "SKIPPED: network namespaces are not available here ({e}); the multi-host \
             tests need root and iproute2"
        ));
        return None;
    }
    let _ = ip(&["netns", "del", &probe]);
    Some(Hosts::new(n, rate).unwrap_or_else(|e| panic!("setting up {n} hosts: {e}")))
}

/// Says loudly that a test is skipped. Written to the real stderr (not through
/// `eprintln!`, which the test harness captures for passing tests), so it shows in CI logs.
fn skip_notice(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

fn wait(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let deadline = Instant::now() + limit;
    children
        .into_iter()
        .map(|mut c| {
            while c.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            c.wait_with_output().unwrap()
        })
        .collect()
}

const TOOLS: [(&str, &str, bool); 9] = [
    (
        "all_reduce_perf",
        env!("CARGO_BIN_EXE_all_reduce_perf"),
        true,
    ),
    (
        "all_gather_perf",
        env!("CARGO_BIN_EXE_all_gather_perf"),
        false,
    ),
    (
        "broadcast_perf",
        env!("CARGO_BIN_EXE_broadcast_perf"),
        false,
    ),
    ("reduce_perf", env!("CARGO_BIN_EXE_reduce_perf"), true),
    (
        "reduce_scatter_perf",
        env!("CARGO_BIN_EXE_reduce_scatter_perf"),
        true,
    ),
    ("alltoall_perf", env!("CARGO_BIN_EXE_alltoall_perf"), false),
    ("sendrecv_perf", env!("CARGO_BIN_EXE_sendrecv_perf"), false),
    ("gather_perf", env!("CARGO_BIN_EXE_gather_perf"), false),
    ("scatter_perf", env!("CARGO_BIN_EXE_scatter_perf"), false),
];

/// Every tool, every op, every root, a few dtypes and sizes, `ranks_per_host` ranks on
/// each of `hosts` hosts.
fn all_collectives(nhosts: usize, ranks_per_host: usize) {
    let Some(h) = hosts(nhosts, None) else { return };
    let world = nhosts * ranks_per_host;
    let tuned: &[(&str, &str)] = &[];
    let ring: &[(&str, &str)] = &[("FERROCCL_ALGO", "ring")];
    let tree: &[(&str, &str)] = &[("FERROCCL_ALGO", "tree"), ("FERROCCL_NCHANNELS", "2")];
    for (name, exe, reduces) in TOOLS {
        // All-reduce and broadcast run with the tuner's choice, the ring forced and the
        // tree forced.
        let algos = if name == "all_reduce_perf" || name == "broadcast_perf" {
            vec![tuned, ring, tree]
        } else {
            vec![tuned]
        };
        for (env, dtype) in algos
            .into_iter()
            .flat_map(|e| ["int32", "bfloat16", "f8e5m2", "double"].map(|d| (e, d)))
        {
            let mut args = vec!["-d", dtype, "-r", "-1", "-b", "8", "-e", "256K", "-f", "32"];
            args.extend(["-n", "1", "-w", "0", "-c", "1", "-T", "60", "--no-progress"]);
            if reduces {
                args.extend(["-o", "all"]);
            }
            let children = (0..world)
                .map(|r| h.spawn(r / ranks_per_host, r, world, exe, &args, env))
                .collect();
            let outs = wait(children, Duration::from_secs(120));
            for (r, out) in outs.iter().enumerate() {
                let (stdout, stderr) = (
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr),
                );
                assert!(
                    out.status.success(),
                    "{name} -d {dtype}, rank {r} of {nhosts}x{ranks_per_host}:\n{stdout}\n{stderr}"
                );
                if r == 0 {
                    assert!(
                        stdout.contains("# Out of bounds values : 0 OK"),
                        "{name}: {stdout}"
                    );
                    assert!(stdout.contains(&format!("nRanks {world}")), "{stdout}");
                    if env == tree {
                        assert!(
                            stdout.contains("tree/") && !stdout.contains("ring/"),
                            "{stdout}"
                        );
                    }
                    if env == ring {
                        assert!(!stdout.contains("tree/"), "{stdout}");
                    }
                }
            }
        }
    }
}

#[test]
fn all_collectives_on_two_hosts_of_two_ranks() {
    all_collectives(2, 2);
}

#[test]
fn all_collectives_on_four_hosts_of_one_rank() {
    all_collectives(4, 1);
}

#[test]
fn a_cut_link_is_named_by_every_other_rank() {
    cut_link(&[("FERROCCL_ALGO", "ring")]);
}

#[test]
fn a_cut_link_under_the_tree_is_named_by_every_other_rank() {
    cut_link(&[("FERROCCL_ALGO", "tree"), ("FERROCCL_NCHANNELS", "2")]);
}

/// Host 2's link is cut during a long run of 4 MiB all-reduces (with `algo`'s settings):
/// every other rank fails naming rank 2 within the link timeout.
fn cut_link(algo: &[(&str, &str)]) {
    let Some(h) = hosts(4, None) else { return };
    let (_, exe, _) = TOOLS[0];
    // A long run of 4 MiB all-reduces; host 2's link is cut while they run.
    let args = [
        "-b",
        "4M",
        "-e",
        "4M",
        "-n",
        "100000",
        "-w",
        "0",
        "-c",
        "0",
        "-T",
        "60",
        "--no-progress",
    ];
    let mut children: Vec<Child> = (0..4)
        .map(|r| {
            // INFO logs name the algorithm of each call, checked below.
            let mut env = vec![("FERROCCL_LINK_TIMEOUT", "3"), ("FERROCCL_DEBUG", "INFO")];
            env.extend_from_slice(algo);
            h.spawn(r, r, 4, exe, &args, &env)
        })
        .collect();
    // Rank 0 prints the header once every rank is connected.
    let mut seen = String::new();
    let stdout = children[0].stdout.as_mut().unwrap();
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    while !seen.contains("(elements)") {
        let n = std::io::Read::read(stdout, &mut buf).unwrap();
        assert!(
            n > 0 && start.elapsed() < Duration::from_secs(60),
            "never started: {seen}"
        );
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let wanted = format!("uses {}/", algo[0].1);
    std::thread::sleep(Duration::from_millis(500));
    h.cut(2).unwrap();
    let cut_at = Instant::now();
    let _ = children[2].kill();
    let outs = wait(children, Duration::from_secs(60));
    let took = cut_at.elapsed();
    for (r, out) in outs.iter().enumerate() {
        if r == 2 {
            continue;
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "rank {r} did not notice");
        assert!(
            stderr.contains("rank 2") && stderr.contains("all_reduce #"),
            "rank {r}: {stderr}"
        );
    }
    // Well within the 60 s collective deadline: the 3 s link timeout noticed it.
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let rank0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(rank0.contains(&wanted), "not run with {wanted}: {rank0}");
    eprintln!("{wanted}: every survivor named rank 2 within {took:.1?} of the cut");
}
