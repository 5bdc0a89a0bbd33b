//! `ferroccl-tune`: measure the cost model's parameters, or show its predictions.
//!
//! ```text
//! ferrorun --nproc-per-node 2 -- ferroccl-tune measure   # (or under srun/mpirun, or across hosts)
//! ferroccl-tune predict --ranks 4 --hosts 4 [--net 30,1.25] [--local 1,10]
//! ```
//!
//! `measure` times a ping-pong between rank 0 and each other rank (8 bytes for the
//! latency α, 16 MiB for the bandwidth β), sorts the peers into same-host and
//! other-host, and prints the `FERROCCL_TUNE_LOCAL` / `FERROCCL_TUNE_NET` settings to
//! use. `predict` prints the model's ring and tree times for an all-reduce from 8 B to
//! 1 GiB and the size where the tree stops being faster.

use std::process::ExitCode;
use std::time::Instant;

use ferroccl::Communicator;
use ferroccl::plan::Algorithm;
use ferroccl::tune::{CostModel, LinkCost, Shape};

const USAGE: &str = "usage: ferroccl-tune measure            (as every rank of a job)\n       ferroccl-tune predict --ranks N --hosts H [--net ALPHA_US,GBPS] [--local ALPHA_US,GBPS]\n";

fn main() -> ExitCode {
    ferroccl::trace::init_from_env();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("measure") => measure(),
        Some("predict") => predict(&args[1..]),
        _ => Err(format!("expected `measure` or `predict`\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl-tune: {e}");
            ExitCode::from(2)
        }
    }
}

fn predict(args: &[String]) -> Result<(), String> {
    let mut model = CostModel::from_env().map_err(|e| e.to_string())?;
    let (mut ranks, mut hosts) = (None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--ranks" => ranks = Some(value.parse::<usize>().map_err(|_| "--ranks: a number")?),
            "--hosts" => hosts = Some(value.parse::<usize>().map_err(|_| "--hosts: a number")?),
            "--net" => model.net = LinkCost::parse("--net", value).map_err(|e| e.to_string())?,
            "--local" => {
                model.local = LinkCost::parse("--local", value).map_err(|e| e.to_string())?
            }
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    let ranks = ranks.ok_or(format!("--ranks is required\n{USAGE}"))?;
    let hosts = hosts.unwrap_or(1).clamp(1, ranks.max(1));
    let shape = Shape {
        ranks,
        hosts,
        ranks_per_host: ranks.div_ceil(hosts),
    };
    println!(
        "# all-reduce on {ranks} ranks, {hosts} hosts; local {} us {} GB/s, net {} us {} GB/s",
        model.local.alpha * 1e6,
        model.local.beta / 1e9,
        model.net.alpha * 1e6,
        model.net.beta / 1e9
    );
    println!(
        "# {:>12} {:>14} {:>14}  pick",
        "bytes", "ring (us)", "tree (us)"
    );
    let mut bytes = 8usize;
    while bytes <= 1 << 30 {
        let ring = model.all_reduce(Algorithm::Ring, bytes, shape) * 1e6;
        let tree = model.all_reduce(Algorithm::Tree, bytes, shape) * 1e6;
        println!(
            "  {bytes:>12} {ring:>14.1} {tree:>14.1}  {}",
            model.choose(bytes, shape).name()
        );
        bytes *= 4;
    }
    match model.crossover(shape) {
        Some(x) => println!("# crossover: tree below {x} bytes, ring from there"),
        None => println!("# crossover: none (ring at every size)"),
    }
    Ok(())
}

fn measure() -> Result<(), String> {
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let (rank, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Err("measure needs at least two ranks".into());
    }
    let host = |r: usize| comm.peers()[r].host_id.clone();
    let mut local: Vec<LinkCost> = Vec::new();
    let mut net: Vec<LinkCost> = Vec::new();
    for peer in 1..n {
        let mut small = [0u8; 8];
        let mut big = vec![0u8; 16 << 20];
        let time = |buf: &mut [u8], reps: usize| -> Result<f64, String> {
            let start = Instant::now();
            for _ in 0..reps {
                if rank == 0 {
                    comm.send(buf, peer).map_err(|e| e.to_string())?;
                    comm.recv(buf, peer).map_err(|e| e.to_string())?;
                } else if rank == peer {
                    comm.recv(buf, 0).map_err(|e| e.to_string())?;
                    comm.send(buf, 0).map_err(|e| e.to_string())?;
                }
            }
            Ok(start.elapsed().as_secs_f64() / reps as f64 / 2.0)
        };
        time(&mut small, 100)?;
        let latency = time(&mut small, 2000)?;
        time(&mut big, 2)?;
        let one_way = time(&mut big, 10)?;
        comm.barrier().map_err(|e| e.to_string())?;
        if rank == 0 {
            let cost = LinkCost {
                alpha: latency,
                beta: big.len() as f64 / (one_way - latency).max(1e-9),
            };
            let kind = if host(peer) == host(0) {
                "local"
            } else {
                "net"
            };
            println!(
                "rank 0 <-> rank {peer} ({kind}): latency {:.2} us, bandwidth {:.2} GB/s",
                cost.alpha * 1e6,
                cost.beta / 1e9
            );
            if kind == "local" {
                local.push(cost)
            } else {
                net.push(cost)
            }
        }
    }
    if rank == 0 {
        let mean = |v: &[LinkCost]| {
            let k = v.len() as f64;
            LinkCost {
                alpha: v.iter().map(|c| c.alpha).sum::<f64>() / k,
                beta: v.iter().map(|c| c.beta).sum::<f64>() / k,
            }
        };
        // One hand-off in a collective also pays for the peer's turn to run; a
        // ping-pong's half round trip is the floor of it.
        if !local.is_empty() {
            println!("FERROCCL_TUNE_LOCAL={}", mean(&local).to_text());
        }
        if !net.is_empty() {
            println!("FERROCCL_TUNE_NET={}", mean(&net).to_text());
        }
    }
    Ok(())
}
