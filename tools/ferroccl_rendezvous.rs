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
//! ferroccl-rendezvous --completions zsh                       # the shell's completion script
//! ```
//!
//! Exits 1 with the bootstrap error (which names any missing ranks) if the rendezvous
//! fails. `FERROCCL_BOOTSTRAP_TIMEOUT` sets how long to wait, in seconds.

#[path = "cli_support.rs"]
mod cli_support;

use std::process::ExitCode;

use clap::Parser;
use clap_complete::Shell;
use ferroccl::bootstrap::{Bootstrap, BootstrapOptions, UniqueId};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-rendezvous",
    version,
    about = "Checks that the ranks of a job can find each other.",
    long_about = "Checks that the ranks of a job can find each other: every rank joins the \
                  bootstrap rendezvous, gathers every rank's peer info and passes a barrier. \
                  With no options it joins by env:// (under ferrorun, torchrun, srun or \
                  mpirun). FERROCCL_BOOTSTRAP_TIMEOUT sets how long to wait, in seconds.",
    override_usage = "ferroccl-rendezvous                                  \
                      (env://: under ferrorun, torchrun, srun, mpirun)\n       \
                      ferroccl-rendezvous --unique-id <HEX> --rank <R> --nranks <N>\n       \
                      ferroccl-rendezvous --new-unique-id [--serve-seconds <S>]"
)]
struct Cli {
    /// Join the rendezvous of this UniqueId (as printed by --new-unique-id).
    #[arg(long, value_name = "HEX", requires_all = ["rank", "nranks"],
          value_parser = |s: &str| s.parse::<UniqueId>())]
    unique_id: Option<UniqueId>,

    /// This process's rank (with --unique-id).
    #[arg(long, value_name = "R", requires = "unique_id")]
    rank: Option<usize>,

    /// The number of ranks (with --unique-id).
    #[arg(long, value_name = "N", requires = "unique_id")]
    nranks: Option<usize>,

    /// Host a store, print its UniqueId and wait while others join it.
    #[arg(long, conflicts_with = "unique_id")]
    new_unique_id: bool,

    /// How long --new-unique-id keeps its store up, in seconds.
    #[arg(
        long,
        value_name = "S",
        default_value_t = 3600,
        requires = "new_unique_id"
    )]
    serve_seconds: u64,

    /// Print the completion script for SHELL on stdout and exit.
    #[arg(long, value_name = "SHELL", exclusive = true)]
    completions: Option<Shell>,
}

fn main() -> ExitCode {
    ferroccl::trace::init_from_env();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and the version on stdout (status 0), mistakes on stderr with status 1,
            // like every other failure of this tool.
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 1 } else { 0 });
        }
    };
    if let Some(shell) = cli.completions {
        return cli_support::print_completions::<Cli>(shell);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl-rendezvous: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    let options = BootstrapOptions::from_env().map_err(|e| e.to_string())?;
    if cli.new_unique_id {
        let id = UniqueId::new().map_err(|e| e.to_string())?;
        println!("{id}");
        std::thread::sleep(std::time::Duration::from_secs(cli.serve_seconds));
        return Ok(());
    }
    let boot = match (cli.unique_id, cli.rank, cli.nranks) {
        (Some(id), Some(rank), Some(nranks)) => {
            Bootstrap::from_unique_id(&id, rank, nranks, &options)
        }
        // clap requires --rank and --nranks with --unique-id, and only with it.
        _ => Bootstrap::from_env(&options).map(|(boot, _env)| boot),
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn unique_id_needs_rank_and_nranks_and_excludes_new_unique_id() {
        let parse = |words: &[&str]| {
            Cli::try_parse_from(std::iter::once("ferroccl-rendezvous").chain(words.iter().copied()))
        };
        let id = UniqueId::new().unwrap().to_string();
        let cli = parse(&["--nranks", "4", "--unique-id", &id, "--rank", "2"]).unwrap();
        assert_eq!((cli.rank, cli.nranks), (Some(2), Some(4)));
        assert!(cli.unique_id.is_some() && !cli.new_unique_id);
        let err = parse(&["--unique-id", &id, "--rank", "2"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--nranks"), "{err}");
        let err = parse(&[
            "--new-unique-id",
            "--unique-id",
            &id,
            "--rank",
            "0",
            "--nranks",
            "1",
        ]);
        assert!(err.unwrap_err().to_string().contains("--unique-id"));
        let cli = parse(&[]).unwrap();
        assert!(cli.unique_id.is_none() && !cli.new_unique_id && cli.serve_seconds == 3600);
    }
}
