//! `ferroccl-rendezvous`: check that the ranks of a job can find each other.
//!
//! Every rank joins the bootstrap rendezvous, gathers every rank's peer info and passes a
//! barrier; each prints one line about itself and rank 0 prints the whole peer table.
//! It is the first thing to run on a new cluster or launcher set-up:
//!
//! ```text
//! ferrorun --nproc-per-node 8 -- ferroccl-rendezvous          # env:// (also srun, mpirun)
//! ferroccl-rendezvous --unique-id HEX --rank R --nranks N     # a UniqueId made elsewhere
//! ferroccl-rendezvous --new-unique-id                         # host a store, print its id, wait
//! ```
//!
//! Exits 1 with the bootstrap error (which names any missing ranks) if the rendezvous
//! fails. `FERROCCL_BOOTSTRAP_TIMEOUT` sets how long to wait, in seconds.

use std::process::ExitCode;

use ferroccl::bootstrap::{Bootstrap, BootstrapOptions, UniqueId};

const USAGE: &str = "\
usage: ferroccl-rendezvous                                  (env://: under ferrorun, torchrun, srun, mpirun)
       ferroccl-rendezvous --unique-id HEX --rank R --nranks N
       ferroccl-rendezvous --new-unique-id [--serve-seconds S]
";

fn main() -> ExitCode {
    ferroccl::trace::init_from_env();
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl-rendezvous: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(argv: Vec<String>) -> Result<(), String> {
    let options = BootstrapOptions::from_env().map_err(|e| e.to_string())?;
    let flag = |name: &str| -> Option<&str> {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .map(String::as_str)
    };
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        print!("{USAGE}");
        return Ok(());
    }
    if argv.iter().any(|a| a == "--new-unique-id") {
        let id = UniqueId::new().map_err(|e| e.to_string())?;
        println!("{id}");
        let secs: u64 = flag("--serve-seconds")
            .unwrap_or("3600")
            .parse()
            .map_err(|_| "--serve-seconds needs a whole number of seconds")?;
        std::thread::sleep(std::time::Duration::from_secs(secs));
        return Ok(());
    }
    let boot = if let Some(hex) = flag("--unique-id") {
        let id: UniqueId = hex.parse().map_err(|e| format!("--unique-id: {e}"))?;
        let number = |name: &str| -> Result<usize, String> {
            flag(name)
                .ok_or(format!("{name} is required with --unique-id"))?
                .parse()
                .map_err(|_| format!("{name} needs a non-negative integer"))
        };
        Bootstrap::from_unique_id(&id, number("--rank")?, number("--nranks")?, &options)
    } else if argv.is_empty() {
        Bootstrap::from_env(&options).map(|(boot, _env)| boot)
    } else {
        return Err(format!("unexpected arguments {argv:?}\n{USAGE}"));
    }
    .map_err(|e| e.to_string())?;

    let me = &boot.peers()[boot.rank()];
    println!(
        "rank {} of {}: host {} pid {} local rank {} of {}, {} hosts in the job",
        boot.rank(),
        boot.world_size(),
        me.hostname,
        me.pid,
        boot.local_rank(),
        boot.local_ranks().len(),
        boot.host_count()
    );
    boot.barrier().map_err(|e| e.to_string())?;
    if boot.rank() == 0 {
        println!(
            "{:>6}  {:<20} {:>8}  {:<16}  addresses",
            "rank", "host", "pid", "host hash"
        );
        for p in boot.peers() {
            let addrs: Vec<String> = p.addrs.iter().map(ToString::to_string).collect();
            println!(
                "{:>6}  {:<20} {:>8}  {:016x}  {}",
                p.rank,
                p.hostname,
                p.pid,
                p.host_hash(),
                addrs.join(",")
            );
        }
    }
    // Nobody leaves (and, on rank 0, stops the store) before everyone has printed.
    boot.barrier().map_err(|e| e.to_string())
}
