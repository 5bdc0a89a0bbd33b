//! `ferroccl-tune`: measure the cost model's parameters, or show its predictions.
//!
//! ```text
//! ferrorun --nproc-per-node 2 -- ferroccl-tune measure   # (or under srun/mpirun, or across hosts)
//! ferroccl-tune predict --ranks 4 --hosts 4 [--net 30,1.25] [--local 1,10] [--local-ll 0.8,3]
//!                       [--local-single 2.3,4.9] [--local-in-place 2.3,20] [--in-place]
//! ferroccl-tune --completions bash                       # the shell's completion script
//! ```
//!
//! `measure` times a ping-pong between rank 0 and each other rank, once per protocol
//! (8 bytes for the latency α; 16 MiB with Simple and single copy, 1 MiB with LL for the
//! bandwidth β; single copy only where the ranks may read each other's memory, and then
//! also from buffers in windows, read in place), sorts the peers into same-host and
//! other-host, and prints the `FERROCCL_TUNE_LOCAL`, `FERROCCL_TUNE_LOCAL_LL`,
//! `FERROCCL_TUNE_LOCAL_SINGLE`, `FERROCCL_TUNE_LOCAL_IN_PLACE` and `FERROCCL_TUNE_NET`
//! settings to use. `predict` prints
//! the model's ring and tree times with each protocol for an all-reduce from 8 B to
//! 1 GiB, its pick, and the sizes where the tree and LL stop being faster.

#[path = "cli_support.rs"]
mod cli_support;

use std::process::ExitCode;
use std::time::Instant;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};
use clap_complete::Shell;
use ferroccl::Communicator;
use ferroccl::comm::CommConfig;
use ferroccl::plan::{Algorithm, Collective};
use ferroccl::transport::Protocol;
use ferroccl::transport::window::SharedMemory;
use ferroccl::tune::{Choice, CostModel, Crowding, LinkCost, Shape};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-tune",
    version,
    about = "Measures the cost model's parameters, or shows its predictions."
)]
struct Cli {
    /// What to do.
    #[command(subcommand)]
    command: Option<Command>,

    /// Print the completion script for SHELL on stdout and exit.
    #[arg(long, value_name = "SHELL", exclusive = true)]
    completions: Option<Shell>,
}

/// `ferroccl-tune`'s subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Time ping-pongs between rank 0 and every other rank (run as every rank of a job,
    /// e.g. under ferrorun) and print the FERROCCL_TUNE_* settings to use.
    Measure,
    /// Print the model's all-reduce times, its picks and its crossovers for a job's shape
    /// (the link costs default to FERROCCL_TUNE_LOCAL, FERROCCL_TUNE_LOCAL_LL,
    /// FERROCCL_TUNE_LOCAL_SINGLE, FERROCCL_TUNE_LOCAL_IN_PLACE and FERROCCL_TUNE_NET,
    /// else to built-in values).
    Predict(PredictArgs),
}

/// `predict`'s options.
#[derive(Debug, Args)]
struct PredictArgs {
    /// Ranks in the job.
    #[arg(long, value_name = "N")]
    ranks: usize,

    /// Hosts the ranks are spread over evenly (clamped to 1..=N).
    #[arg(long, value_name = "H", default_value_t = 1)]
    hosts: usize,

    /// CPUs of each host the ranks run on [default: one per rank]; fewer than the
    /// ranks of a host prices crowded CPUs, as `nproc` of a 2-core machine under 4 ranks.
    #[arg(long, value_name = "C", value_parser = clap::value_parser!(u32).range(1..))]
    cpus: Option<u32>,

    /// The network link: latency in microseconds, bandwidth in GB/s.
    #[arg(long, value_name = "ALPHA_US,GBPS", value_parser = link)]
    net: Option<LinkCost>,

    /// The link between ranks on one host, with the Simple protocol.
    #[arg(long, value_name = "ALPHA_US,GBPS", value_parser = link)]
    local: Option<LinkCost>,

    /// The link between ranks on one host, with the LL protocol.
    #[arg(long, value_name = "ALPHA_US,GBPS", value_parser = link)]
    local_ll: Option<LinkCost>,

    /// The link between ranks on one host, with single copy.
    #[arg(long, value_name = "ALPHA_US,GBPS", value_parser = link)]
    local_single: Option<LinkCost>,

    /// The link between ranks on one host, with single copy read in place (threads of
    /// one process, or buffers in windows).
    #[arg(long, value_name = "ALPHA_US,GBPS", value_parser = link)]
    local_in_place: Option<LinkCost>,

    /// Price single copy as read in place: the ranks are threads of one process, or the
    /// buffers are in windows.
    #[arg(long, conflicts_with = "local_single")]
    in_place: bool,
}

/// Reads a link's `alpha_us,gbps`.
fn link(text: &str) -> Result<LinkCost, String> {
    LinkCost::parse("", text).map_err(|_| {
        "not ALPHA_US,GBPS (latency in microseconds, bandwidth in GB/s; positive numbers, \
         e.g. 30,1.25)"
            .to_string()
    })
}

fn main() -> ExitCode {
    ferroccl::trace::init_from_env();
    // Help and the version on stdout with status 0; mistakes on stderr with 2.
    let cli = Cli::try_parse().unwrap_or_else(|e| e.exit());
    let result = match (cli.completions, cli.command) {
        (Some(shell), _) => return cli_support::print_completions::<Cli>(shell),
        (None, Some(Command::Measure)) => measure(),
        (None, Some(Command::Predict(args))) => predict(args),
        (None, None) => Cli::command()
            .error(
                ErrorKind::MissingSubcommand,
                "expected `measure` or `predict`",
            )
            .exit(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl-tune: {e}");
            ExitCode::from(2)
        }
    }
}

fn predict(args: PredictArgs) -> Result<(), String> {
    let mut model = CostModel::from_env().map_err(|e| e.to_string())?;
    for (cost, given) in [
        (&mut model.net, args.net),
        (&mut model.local, args.local),
        (&mut model.local_ll, args.local_ll),
        (&mut model.local_single, args.local_single),
        (&mut model.local_in_place, args.local_in_place),
    ] {
        if let Some(given) = given {
            *cost = given;
        }
    }
    if args.in_place {
        model = model.reading_in_place();
    }
    let ranks = args.ranks;
    let hosts = args.hosts.clamp(1, ranks.max(1));
    let mut shape = Shape::even(ranks, hosts);
    if let Some(cpus) = args.cpus {
        shape.crowding = Crowding {
            ranks: shape.ranks_per_host,
            cpus: cpus as usize,
        };
    }
    let show = |c: LinkCost| format!("{:.2} us {:.2} GB/s", c.alpha * 1e6, c.beta / 1e9);
    let cpus = match args.cpus {
        Some(c) => format!(" ({c} CPUs a host)"),
        None => String::new(),
    };
    println!(
        "# all-reduce on {ranks} ranks, {hosts} hosts{cpus}; local {} (LL {}, single copy {}{}), net {}",
        show(model.local),
        show(model.local_ll),
        show(model.local_single),
        if args.in_place { " in place" } else { "" },
        show(model.net)
    );
    // The pairs that have a plan here (single copy: not on reducing rings of more than
    // two ranks, trees or the one-shot all-reduce; and inside one host only).
    let candidates: Vec<Choice> = Algorithm::ALL
        .into_iter()
        .flat_map(|algorithm| {
            Protocol::ALL.map(|protocol| Choice {
                algorithm,
                protocol,
            })
        })
        .filter(|&c| model.time(Collective::AllReduce, c, 1, shape).is_finite())
        .collect();
    print!("# {:>12}", "bytes");
    for c in &candidates {
        print!(" {:>16}", format!("{} (us)", c.name()));
    }
    println!("  pick");
    let mut bytes = 8usize;
    while bytes <= 1 << 30 {
        print!("  {bytes:>12}");
        for &c in &candidates {
            print!(" {:>16.1}", model.all_reduce(c, bytes, shape) * 1e6);
        }
        let pick = model.best(
            Collective::AllReduce,
            bytes,
            shape,
            &Algorithm::ALL,
            &Protocol::ALL,
        );
        println!("  {}", pick.name());
        bytes *= 4;
    }
    match model.crossover(shape, |c| c.algorithm == Algorithm::Tree) {
        Some(x) => println!("# ring or tree: tree below {x} bytes, ring from there"),
        None => println!("# ring or tree: the ring at every size"),
    }
    println!("# all algorithms: {}", algorithm_ranges(&model, shape));
    match model.crossover(shape, |c| c.protocol == Protocol::LL) {
        Some(x) => println!("# protocol: LL below {x} bytes, Simple from there"),
        None => println!("# protocol: Simple at every size"),
    }
    Ok(())
}

/// The algorithm the model picks for an all-reduce, size by size, as ranges: `oneshot
/// below 3201 bytes, twoshot below 927147, then ring` (each end found by
/// [`CostModel::crossover_among`]: where the pick leaves the algorithms seen so far).
fn algorithm_ranges(model: &CostModel, shape: Shape) -> String {
    let pick = |bytes| {
        model
            .best(
                Collective::AllReduce,
                bytes,
                shape,
                &Algorithm::ALL,
                &Protocol::ALL,
            )
            .algorithm
    };
    let mut seen = vec![pick(1)];
    let mut ranges = Vec::new();
    while let Some(end) = model
        .crossover_among(shape, &Algorithm::ALL, |c| seen.contains(&c.algorithm))
        .filter(|&end| end < 1 << 40)
    {
        ranges.push(format!("{} below {end} bytes", seen[seen.len() - 1].name()));
        seen.push(pick(end));
    }
    let last = seen[seen.len() - 1].name();
    if ranges.is_empty() {
        return format!("{last} at every size");
    }
    ranges.push(format!("then {last}"));
    ranges.join(", ")
}

/// Half a ping-pong's round trip between rank 0 and `peer` for `buf`, averaged over
/// `reps` (after a warm-up).
fn ping_pong(comm: &Communicator, peer: usize, buf: &mut [u8], reps: usize) -> Result<f64, String> {
    let rank = comm.rank();
    let mut once = |reps: usize| -> Result<f64, String> {
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
    once(reps.div_ceil(10))?;
    once(reps)
}

/// The settings `measure` prints, each the mean over the peers it was measured with.
const SETTINGS: [&str; 5] = [
    "FERROCCL_TUNE_LOCAL",
    "FERROCCL_TUNE_LOCAL_LL",
    "FERROCCL_TUNE_LOCAL_SINGLE",
    "FERROCCL_TUNE_LOCAL_IN_PLACE",
    "FERROCCL_TUNE_NET",
];

/// The setting a ping-pong with `protocol` measures, between ranks of one host or
/// not; `in_place`: single copy read in place (threads of one process, or windows).
fn setting(protocol: Protocol, local: bool, in_place: bool) -> Option<&'static str> {
    match (protocol, local) {
        (Protocol::Simple, true) => Some("FERROCCL_TUNE_LOCAL"),
        (Protocol::LL, true) => Some("FERROCCL_TUNE_LOCAL_LL"),
        (Protocol::SingleCopy, true) if in_place => Some("FERROCCL_TUNE_LOCAL_IN_PLACE"),
        (Protocol::SingleCopy, true) => Some("FERROCCL_TUNE_LOCAL_SINGLE"),
        // Over TCP both protocols use the same FIFOs: the network is measured with Simple.
        (Protocol::Simple, false) => Some("FERROCCL_TUNE_NET"),
        _ => None,
    }
}

fn measure() -> Result<(), String> {
    let err = |e: ferroccl::Error| e.to_string();
    let world = Communicator::from_env().map_err(err)?;
    let n = world.size();
    if n < 2 {
        return Err("measure needs at least two ranks".into());
    }
    let peer_info = |r: usize| &world.peers()[r];
    let local = |r: usize| peer_info(r).host_id == peer_info(0).host_id;
    let same_process = |r: usize| local(r) && peer_info(r).pid == peer_info(0).pid;
    let mut found = Found {
        rank0: world.rank() == 0,
        costs: Vec::new(),
    };
    for protocol in Protocol::ALL {
        // A communicator that uses only this protocol, so that every size is timed
        // with it.
        let config = CommConfig {
            protocols: vec![protocol],
            ..world.config().clone()
        };
        let comm = world
            .split_with(Some(0), 0, config)
            .map_err(err)?
            .ok_or("split gave no communicator")?;
        let big_bytes = match protocol {
            Protocol::Simple | Protocol::SingleCopy => 16 << 20,
            // LL is for small messages: time what it is used for.
            Protocol::LL => 1 << 20,
        };
        // Single copy only where ranks may read each other (FERROCCL_DEBUG=INFO says
        // why not); a communicator without it would time Simple under its name.
        let send = ferroccl::plan::Collective::Send { peer: 1 };
        if comm.choice_for(send, big_bytes).protocol != protocol {
            println!(
                "{}: not available to these ranks, not measured",
                protocol.name()
            );
            continue;
        }
        let mut heap = vec![0u8; big_bytes];
        for peer in 1..n {
            let cost = link_cost(&comm, peer, &mut heap)?;
            found.add(protocol, peer, (local(peer), same_process(peer)), cost, "");
        }
        // Single copy from buffers in windows: read in place between processes too.
        if protocol == Protocol::SingleCopy && (1..n).any(|r| local(r) && !same_process(r)) {
            let mut memory = SharedMemory::new(big_bytes).map_err(err)?;
            // SAFETY: the memory outlives the window (deregistered below), and this rank
            // passes it only to this communicator's ping-pongs.
            let window =
                unsafe { comm.register_window(memory.as_ptr(), big_bytes) }.map_err(err)?;
            for peer in (1..n).filter(|&r| local(r) && !same_process(r)) {
                let cost = link_cost(&comm, peer, memory.as_mut_slice())?;
                found.add(protocol, peer, (true, true), cost, ", in a window");
            }
            comm.deregister_window(window).map_err(err)?;
        }
    }
    for var in SETTINGS {
        if let Some(mean) = found.mean(var) {
            println!("{var}={}", mean.to_text());
        }
    }
    Ok(())
}

/// α from an 8-byte ping-pong between rank 0 and `peer`, β from one of `buf` (whose
/// first 8 bytes the small one uses), on every rank of `comm`.
fn link_cost(comm: &Communicator, peer: usize, buf: &mut [u8]) -> Result<LinkCost, String> {
    let latency = ping_pong(comm, peer, &mut buf[..8], 2000)?;
    let one_way = ping_pong(comm, peer, buf, 20)?;
    comm.barrier().map_err(|e| e.to_string())?;
    // One hand-off in a collective also pays for the peer's turn to run; a ping-pong's
    // half round trip is the floor of it.
    Ok(LinkCost {
        alpha: latency,
        beta: buf.len() as f64 / (one_way - latency).max(1e-9),
    })
}

/// The links rank 0 measured, each under its setting.
struct Found {
    rank0: bool,
    costs: Vec<(&'static str, LinkCost)>,
}

impl Found {
    /// Rank 0 prints a measured link and keeps it under its setting.
    fn add(
        &mut self,
        protocol: Protocol,
        peer: usize,
        (local, in_place): (bool, bool),
        cost: LinkCost,
        how: &str,
    ) {
        let Some(var) = setting(protocol, local, in_place) else {
            return;
        };
        if self.rank0 {
            println!(
                "rank 0 <-> rank {peer} ({}, {}{how}): latency {:.2} us, bandwidth {:.2} GB/s",
                if local { "local" } else { "net" },
                protocol.name(),
                cost.alpha * 1e6,
                cost.beta / 1e9
            );
            self.costs.push((var, cost));
        }
    }

    /// The mean of the costs measured for `var`, if any.
    fn mean(&self, var: &str) -> Option<LinkCost> {
        let v: Vec<LinkCost> = self
            .costs
            .iter()
            .filter(|(s, _)| *s == var)
            .map(|(_, c)| *c)
            .collect();
        let k = v.len() as f64;
        (!v.is_empty()).then(|| LinkCost {
            alpha: v.iter().map(|c| c.alpha).sum::<f64>() / k,
            beta: v.iter().map(|c| c.beta).sum::<f64>() / k,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn predict_reads_its_links() {
        let cli = Cli::try_parse_from([
            "ferroccl-tune",
            "predict",
            "--ranks",
            "8",
            "--local-ll",
            "0.8,3",
        ])
        .unwrap();
        let Some(Command::Predict(p)) = cli.command else {
            panic!("{cli:?}")
        };
        assert_eq!((p.ranks, p.hosts), (8, 1));
        assert_eq!(p.local_ll, Some(LinkCost::new(0.8, 3.0)));
        assert_eq!((p.net, p.local), (None, None));
    }
}
