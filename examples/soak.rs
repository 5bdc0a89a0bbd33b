//! The soak run: ranks as processes doing mixed collectives of mixed sizes for a long
//! time, with sub-communicators split, aborted at random and made again, while the
//! parent samples every rank's resident memory and open file descriptors and the
//! host's `/dev/shm` use. Nothing may grow.
//!
//! ```text
//! cargo run --release --example soak -- [RANKS [SECONDS [SEED]]]   # default 8 3600 1
//! ```
//!
//! Every rank runs the same schedule, drawn from the seed epoch by epoch: on the world
//! communicator, a few collectives of every kind (all-reduce, broadcast, all-gather,
//! reduce-scatter, all-to-all, a send/recv ring) of 1 B to 4 MiB, each result checked;
//! then a split into two or three groups that run more of them, where with probability
//! 1/3 one member aborts its sub-communicator mid-way: the others' calls fail blaming
//! it (a member still in an earlier call may hear of the abort first), or complete with
//! checked data if they needed nothing from that rank. Sub-communicators are dropped at
//! the end of every epoch.
//!
//! Every 10 s each rank prints a sample line; the parent prints, per minute, the
//! largest RSS and fd count over the ranks and `/dev/shm` use, then the first and last
//! minutes side by side. The exit code is non-zero if a check failed or a rank died.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferroccl::bootstrap::UniqueId;
use ferroccl::{Communicator, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn main() {
    if let Ok(rank) = std::env::var("SOAK_RANK") {
        rank_main(rank.parse().expect("SOAK_RANK"));
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: u64, what: &str| -> u64 {
        args.get(i).map_or(default, |a| {
            a.parse()
                .unwrap_or_else(|_| panic!("{what} {a:?}: want a whole number"))
        })
    };
    let ranks = arg(0, 8, "RANKS") as usize;
    let seconds = arg(1, 3600, "SECONDS");
    let seed = arg(2, 1, "SEED");
    std::process::exit(parent(ranks, seconds, seed));
}

/// One rank's sample.
#[derive(Clone, Copy, Default)]
struct Sample {
    rss_kib: u64,
    fds: u64,
    epochs: u64,
    calls: u64,
    aborts: u64,
}

fn parent(ranks: usize, seconds: u64, seed: u64) -> i32 {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).expect("store");
    let (tx, rx) = mpsc::channel::<(usize, Sample)>();
    let mut children = Vec::new();
    for rank in 0..ranks {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("SOAK_RANK", rank.to_string())
            .env("SOAK_RANKS", ranks.to_string())
            .env("SOAK_SECONDS", seconds.to_string())
            .env("SOAK_SEED", seed.to_string())
            .env("SOAK_ID", id.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a rank");
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let v: Vec<u64> = line
                    .strip_prefix("sample ")
                    .map(|l| l.split(' ').filter_map(|x| x.parse().ok()).collect())
                    .unwrap_or_default();
                if let [rss_kib, fds, epochs, calls, aborts] = v[..] {
                    let s = Sample {
                        rss_kib,
                        fds,
                        epochs,
                        calls,
                        aborts,
                    };
                    let _ = tx.send((rank, s));
                } else {
                    println!("rank {rank}: {line}");
                }
            }
        });
        children.push(child);
    }
    drop(tx);
    let start = Instant::now();
    let mut latest = vec![Sample::default(); ranks];
    // Per minute: (max RSS MiB, max fds, /dev/shm MiB used, epochs, calls, aborts).
    let mut minutes: Vec<(f64, u64, f64, u64, u64, u64)> = Vec::new();
    println!("minute  max RSS (MiB)  max fds  /dev/shm used (MiB)  epochs  calls  aborts");
    let mut next_minute = Duration::from_secs(60);
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok((rank, s)) => latest[rank] = s,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if start.elapsed() >= next_minute {
            next_minute += Duration::from_secs(60);
            let row = (
                latest.iter().map(|s| s.rss_kib).max().unwrap_or(0) as f64 / 1024.0,
                latest.iter().map(|s| s.fds).max().unwrap_or(0),
                shm_used_bytes() as f64 / (1 << 20) as f64,
                latest.iter().map(|s| s.epochs).min().unwrap_or(0),
                latest.iter().map(|s| s.calls).sum(),
                latest.iter().map(|s| s.aborts).sum(),
            );
            println!(
                "{:>6}  {:>13.1}  {:>7}  {:>19.1}  {:>6}  {:>5}  {:>6}",
                minutes.len() + 1,
                row.0,
                row.1,
                row.2,
                row.3,
                row.4,
                row.5
            );
            minutes.push(row);
        }
    }
    let mut failed = 0;
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait().expect("wait");
        if !status.success() {
            println!("rank {rank} ended with {status}");
            failed += 1;
        }
    }
    if let (Some(first), Some(last)) = (minutes.get(1), minutes.last()) {
        // Minute 2, after every rank's first allocations, against the last.
        println!(
            "minute 2 -> {}: max RSS {:.1} -> {:.1} MiB, max fds {} -> {}, /dev/shm {:.1} -> {:.1} MiB",
            minutes.len(),
            first.0,
            last.0,
            first.1,
            last.1,
            first.2,
            last.2
        );
    }
    println!(
        "after the ranks exited: /dev/shm used {:.1} MiB",
        shm_used_bytes() as f64 / (1 << 20) as f64
    );
    if failed == 0 { 0 } else { 1 }
}

/// Bytes in use on the `/dev/shm` filesystem.
fn shm_used_bytes() -> u64 {
    let path = std::ffi::CString::new("/dev/shm").unwrap();
    // SAFETY: a valid C string and an out-struct the call fills.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    (st.f_blocks - st.f_bfree) * st.f_frsize
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn fd_count() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// A failed check: the rank prints it and exits non-zero.
fn fail(what: String) -> ! {
    eprintln!("soak: {what}");
    std::process::exit(1)
}

fn rank_main(rank: usize) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k}"));
    let n: usize = var("SOAK_RANKS").parse().unwrap();
    let seconds: u64 = var("SOAK_SECONDS").parse().unwrap();
    let seed: u64 = var("SOAK_SEED").parse().unwrap();
    let id: UniqueId = var("SOAK_ID").parse().unwrap();
    let world = Communicator::init_rank(&id, n, rank).unwrap_or_else(|e| fail(format!("{e}")));
    let start = Instant::now();
    let mut last_sample = Instant::now() - Duration::from_secs(60);
    let mut s = Sample::default();
    let mut epoch = 0u64;
    loop {
        if last_sample.elapsed() >= Duration::from_secs(10) {
            last_sample = Instant::now();
            s.rss_kib = rss_kib();
            s.fds = fd_count();
            println!(
                "sample {} {} {} {} {}",
                s.rss_kib, s.fds, s.epochs, s.calls, s.aborts
            );
        }
        // Every rank decides to stop at the same epoch: rank 0 says whether time is up.
        let mut go = [u8::from(
            rank != 0 || start.elapsed() < Duration::from_secs(seconds),
        )];
        world
            .broadcast_in_place(&mut go, 0)
            .unwrap_or_else(|e| fail(format!("{e}")));
        if go[0] == 0 {
            break;
        }
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(epoch));
        for _ in 0..rng.random_range(2..6) {
            mixed_call(&world, &mut rng).unwrap_or_else(|e| fail(format!("world: {e}")));
            s.calls += 1;
        }
        // A split into 2 or 3 groups by a shuffled assignment.
        let groups = rng.random_range(2..=3usize).min(n);
        let colors: Vec<u32> = (0..n).map(|_| rng.random_range(0..groups as u32)).collect();
        let sub = world
            .split(Some(colors[rank]), 0)
            .unwrap_or_else(|e| fail(format!("split: {e}")))
            .expect("a color");
        // In each group, with probability 1/3, one member aborts before call `at`.
        let members: Vec<usize> = (0..n).filter(|&r| colors[r] == colors[rank]).collect();
        let calls = rng.random_range(1..5);
        let mut abort_plan: Vec<Option<(usize, usize)>> = Vec::new();
        for g in 0..groups as u32 {
            let in_g: Vec<usize> = (0..n).filter(|&r| colors[r] == g).collect();
            let plan = (!in_g.is_empty() && rng.random_range(0..3) == 0).then(|| {
                (
                    in_g[rng.random_range(0..in_g.len())],
                    rng.random_range(0..calls),
                )
            });
            abort_plan.push(plan);
        }
        let mine = abort_plan[colors[rank] as usize].filter(|_| members.len() > 1);
        if std::env::var_os("SOAK_DEBUG").is_some() {
            eprintln!(
                "rank {rank} epoch {epoch}: members {members:?} calls {calls} abort {mine:?}"
            );
        }
        // The calls draw from a generator of the group's own, so groups stay in step.
        let mut group_rng = StdRng::seed_from_u64(rng.random::<u64>() ^ u64::from(colors[rank]));
        for call in 0..calls {
            match mine {
                Some((who, at)) if at == call && who == rank => {
                    sub.abort();
                    s.aborts += 1;
                    break;
                }
                Some((who, at)) if at == call => {
                    // The others' call fails blaming the aborted rank, or completes
                    // (data checked) if it needed nothing from it. The group is done
                    // for this epoch.
                    if let Err(e) = mixed_call(&sub, &mut group_rng)
                        && e.blamed_rank() != members.iter().position(|&m| m == who)
                    {
                        fail(format!(
                            "after rank {who} aborted, an error blaming another: {e}"
                        ));
                    }
                    break;
                }
                _ => match mixed_call(&sub, &mut group_rng) {
                    Ok(()) => s.calls += 1,
                    // A member still in an earlier call may learn of the abort first:
                    // an abort ends the communicator for all, and its news spreads.
                    // Its call then fails blaming the aborting rank, never another.
                    Err(e)
                        if mine.is_some_and(|(who, _)| {
                            e.blamed_rank() == members.iter().position(|&m| m == who)
                        }) =>
                    {
                        break;
                    }
                    Err(e) => fail(format!("sub-communicator: {e}")),
                },
            }
        }
        drop(sub);
        epoch += 1;
        s.epochs = epoch;
    }
    drop(world);
}

/// One collective drawn from `rng` (kind, size, dtype), its result checked.
fn mixed_call(comm: &Communicator, rng: &mut StdRng) -> ferroccl::Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    // 1 B to 4 MiB, log-uniform, in 4-byte elements (at least one).
    let bytes = 1usize << rng.random_range(0..=22);
    let count = (bytes / 4).max(1);
    let kind = rng.random_range(0..6);
    let value = |r: usize, i: usize| ((r + 1) * (i % 5 + 1)) as i32;
    match kind {
        0 => {
            let input: Vec<i32> = (0..count).map(|i| value(rank, i)).collect();
            let mut out = vec![0; count];
            comm.all_reduce(&input, &mut out, ReduceOp::Sum)?;
            check(&out, |i| (0..n).map(|r| value(r, i)).sum(), "all_reduce");
        }
        1 => {
            let root = rng.random_range(0..n);
            let mut buf: Vec<i32> = (0..count).map(|i| value(rank, i)).collect();
            comm.broadcast_in_place(&mut buf, root)?;
            check(&buf, |i| value(root, i), "broadcast");
        }
        2 => {
            let input: Vec<i32> = (0..count).map(|i| value(rank, i)).collect();
            let mut out = vec![0; count * n];
            comm.all_gather(&input, &mut out)?;
            check(&out, |j| value(j / count, j % count), "all_gather");
        }
        3 => {
            let input: Vec<i32> = (0..count * n).map(|i| value(rank, i)).collect();
            let mut out = vec![0; count];
            comm.reduce_scatter(&input, &mut out, ReduceOp::Max)?;
            check(&out, |i| value(n - 1, rank * count + i), "reduce_scatter");
        }
        4 => {
            let per = count.div_ceil(n);
            let input: Vec<i32> = (0..per * n).map(|i| value(rank, i)).collect();
            let mut out = vec![0; per * n];
            comm.all_to_all(&input, &mut out)?;
            check(&out, |j| value(j / per, rank * per + j % per), "all_to_all");
        }
        _ => {
            // A ring of sends and receives in one group.
            let input: Vec<i32> = (0..count).map(|i| value(rank, i)).collect();
            let mut out = vec![0; count];
            let mut g = comm.group();
            g.send(&input, (rank + 1) % n)?;
            g.recv(&mut out, (rank + n - 1) % n)?;
            g.end()?;
            check(&out, |i| value((rank + n - 1) % n, i), "send/recv ring");
        }
    }
    Ok(())
}

fn check(out: &[i32], want: impl Fn(usize) -> i32, what: &str) {
    if let Some(i) = (0..out.len()).find(|&i| out[i] != want(i)) {
        fail(format!(
            "{what} of {} elements: element {i} is {}, want {}",
            out.len(),
            out[i],
            want(i)
        ));
    }
}
