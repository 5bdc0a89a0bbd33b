//! `ferroccl-viz`: see how collectives move data, from the plans the engine runs.
//!
//! ```text
//! ferroccl-viz ring --ranks 4                    # ring all-reduce, round by round
//! ferroccl-viz ring --ranks 4 --collective reduce_scatter
//! ferroccl-viz tree --ranks 8                    # double binary tree all-reduce
//! ferroccl-viz oneshot --ranks 4                 # one-shot all-reduce (also: twoshot)
//! ferroccl-viz doubling --ranks 8                # recursive-doubling all-reduce
//! ferroccl-viz all-gather --ranks 4 --algorithm oneshot
//! ferroccl-viz all-gather --ranks 4              # also: reduce-scatter, broadcast, reduce
//! ferroccl-viz ring --ranks 4 --html ring.html   # the same as an animated page
//! ferroccl-viz ring --ranks 4 --values 7         # random small values (seed 7)
//! ferroccl-viz simulate --topology topologies/this-machine.json --size 1G [--plot f.svg]
//! ferroccl-viz trace DIR [--svg timeline.svg] [--chrome trace.json]
//! ferroccl-viz --completions bash                # the shell's completion script
//! ```

#[path = "cli_support.rs"]
mod cli_support;

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use clap_complete::Shell;
use ferroccl::plan::{Algorithm, Collective};
use ferroccl::viz::{self, html};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-viz",
    version,
    about = "Shows how collectives move data, from the plans the engine runs."
)]
struct Cli {
    /// What to show.
    #[command(subcommand)]
    command: Option<Command>,

    /// Print the completion script for SHELL on stdout and exit.
    #[arg(long, value_name = "SHELL", exclusive = true)]
    completions: Option<Shell>,
}

/// `ferroccl-viz`'s subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// The ring all-reduce's step table, round by round.
    Ring(TableArgs),
    /// The double binary tree all-reduce's step table.
    Tree(TableArgs),
    /// The one-shot all-reduce's step table.
    #[command(name = "oneshot", alias = "one-shot")]
    OneShot(TableArgs),
    /// The two-shot all-reduce's step table.
    #[command(name = "twoshot", alias = "two-shot")]
    TwoShot(TableArgs),
    /// The recursive-doubling all-reduce's step table.
    #[command(name = "doubling", alias = "recursive-doubling")]
    Doubling(TableArgs),
    /// The reduce-scatter's step table (the ring unless --algorithm says otherwise).
    ReduceScatter(TableArgs),
    /// The all-gather's step table (the ring unless --algorithm says otherwise).
    AllGather(TableArgs),
    /// The broadcast's step table (the ring unless --algorithm says otherwise).
    Broadcast(TableArgs),
    /// The reduce's step table (the ring unless --algorithm says otherwise).
    Reduce(TableArgs),
    /// Predict all-reduce times on a machine described by a topology file.
    Simulate(SimulateArgs),
    /// Draw a per-rank timeline and a Chrome trace from FERROCCL_TRACE output.
    Trace(TraceArgs),
}

/// The options of the step-table subcommands.
#[derive(Debug, Args)]
struct TableArgs {
    /// Ranks in the job.
    #[arg(long, value_name = "N", default_value_t = 4)]
    ranks: usize,

    /// The collective to show [default: the subcommand's: all_reduce for ring, tree,
    /// oneshot, twoshot and doubling].
    #[arg(long, value_name = "NAME")]
    collective: Option<CollectiveName>,

    /// The algorithm to show it with [default: the subcommand's].
    #[arg(long, value_name = "NAME", ignore_case = true)]
    algorithm: Option<AlgorithmName>,

    /// The root rank of broadcast and reduce.
    #[arg(long, value_name = "R", default_value_t = 0)]
    root: usize,

    /// Start from random small values, from this seed (by default rank r's element c is
    /// (r + 1) * 10 + c).
    #[arg(long, value_name = "SEED")]
    values: Option<u64>,

    /// Also write the table as an animated page to FILE.
    #[arg(long, value_name = "FILE")]
    html: Option<String>,
}

/// `--collective`'s values (those of [`viz::collective_named`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CollectiveName {
    /// All-reduce.
    #[value(name = "all_reduce", aliases = ["all-reduce", "allreduce"])]
    AllReduce,
    /// Reduce-scatter.
    #[value(name = "reduce_scatter", alias = "reduce-scatter")]
    ReduceScatter,
    /// All-gather.
    #[value(name = "all_gather", aliases = ["all-gather", "allgather"])]
    AllGather,
    /// Broadcast from --root.
    Broadcast,
    /// Reduce to --root.
    Reduce,
}

/// `--algorithm`'s values (those of [`Algorithm::named`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AlgorithmName {
    /// The ring.
    Ring,
    /// The double binary tree.
    Tree,
    /// One-shot: every rank reads every input.
    #[value(name = "oneshot", aliases = ["one-shot", "one_shot"])]
    OneShot,
    /// Two-shot: a reduce-scatter and an all-gather, each in one step.
    #[value(name = "twoshot", aliases = ["two-shot", "two_shot"])]
    TwoShot,
    /// Recursive doubling: log₂ n rounds, each rank swapping its partial with one peer.
    #[value(name = "doubling", aliases = ["recursive-doubling", "recursive_doubling"])]
    Doubling,
}

impl From<AlgorithmName> for Algorithm {
    fn from(a: AlgorithmName) -> Self {
        match a {
            AlgorithmName::Ring => Algorithm::Ring,
            AlgorithmName::Tree => Algorithm::Tree,
            AlgorithmName::OneShot => Algorithm::OneShot,
            AlgorithmName::TwoShot => Algorithm::TwoShot,
            AlgorithmName::Doubling => Algorithm::Doubling,
        }
    }
}

/// `simulate`'s options.
#[derive(Debug, Args)]
struct SimulateArgs {
    /// The machine: a topology file (see topologies/).
    #[arg(long, value_name = "FILE.json")]
    topology: String,

    /// The largest size to simulate (K, M, G suffixes, powers of 1024).
    #[arg(long, value_name = "BYTES", default_value = "1G",
          value_parser = |s: &str| ferroccl::perf::args::parse_size(s))]
    size: usize,

    /// Also draw bus bandwidth against size to FILE.svg.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<String>,
}

/// `trace`'s options.
#[derive(Debug, Args)]
struct TraceArgs {
    /// A directory of FERROCCL_TRACE files, or one file.
    #[arg(value_name = "DIR")]
    path: String,

    /// Where to write the timeline [default: timeline.svg beside the trace].
    #[arg(long, value_name = "FILE")]
    svg: Option<String>,

    /// Where to write the Chrome trace [default: trace.json beside the trace].
    #[arg(long, value_name = "FILE")]
    chrome: Option<String>,
}

fn main() -> ExitCode {
    // Like other Unix filters, end quietly when the reader of our output goes away
    // (`ferroccl-viz ring | head`) instead of panicking on a broken pipe.
    // SAFETY: restoring the default action of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // Help and the version on stdout with status 0; mistakes on stderr with 2.
    let cli = Cli::try_parse().unwrap_or_else(|e| e.exit());
    let result = match (cli.completions, cli.command) {
        (Some(shell), _) => return cli_support::print_completions::<Cli>(shell),
        (None, Some(command)) => run(command),
        (None, None) => Cli::command()
            .error(ErrorKind::MissingSubcommand, "no command")
            .exit(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl-viz: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(command: Command) -> Result<(), String> {
    use CollectiveName as C;
    // Each step-table subcommand's collective and algorithm, unless its options say
    // otherwise.
    let (default, algorithm, args) = match command {
        Command::Ring(a) => (C::AllReduce, Algorithm::Ring, a),
        Command::Tree(a) => (C::AllReduce, Algorithm::Tree, a),
        Command::OneShot(a) => (C::AllReduce, Algorithm::OneShot, a),
        Command::TwoShot(a) => (C::AllReduce, Algorithm::TwoShot, a),
        Command::Doubling(a) => (C::AllReduce, Algorithm::Doubling, a),
        Command::ReduceScatter(a) => (C::ReduceScatter, Algorithm::Ring, a),
        Command::AllGather(a) => (C::AllGather, Algorithm::Ring, a),
        Command::Broadcast(a) => (C::Broadcast, Algorithm::Ring, a),
        Command::Reduce(a) => (C::Reduce, Algorithm::Ring, a),
        // The library's commands read `--name value` pairs: hand them what clap checked.
        Command::Simulate(a) => {
            let mut words = vec![
                "--topology".to_string(),
                a.topology,
                "--size".into(),
                a.size.to_string(),
            ];
            words.extend(a.plot.into_iter().flat_map(|p| ["--plot".to_string(), p]));
            return ferroccl::viz::predict::command(&words);
        }
        Command::Trace(a) => {
            let words: Vec<String> = [("--svg", a.svg), ("--chrome", a.chrome)]
                .into_iter()
                .filter_map(|(flag, v)| v.map(|v| [flag.to_string(), v]))
                .flatten()
                .collect();
            return ferroccl::viz::timeline::command(&a.path, &words);
        }
    };
    let collective = args.collective.unwrap_or(default);
    let algorithm = args.algorithm.map_or(algorithm, Algorithm::from);
    table_command(collective, algorithm, args)
}

/// Prints the step table (and bytes per rank) of `collective` with `algorithm`.
fn table_command(
    collective: CollectiveName,
    algorithm: Algorithm,
    args: TableArgs,
) -> Result<(), String> {
    let (ranks, root) = (args.ranks, args.root);
    if root >= ranks {
        return Err(format!("--root {root} is not one of the {ranks} ranks"));
    }
    let name = collective
        .to_possible_value()
        .expect("every collective has a name");
    let collective = viz::collective_named(name.get_name(), root).map_err(|e| e.to_string())?;
    if !algorithm.applies_to(collective) {
        return Err(format!(
            "{} has no {} plan",
            collective.name(),
            algorithm.name()
        ));
    }
    let table = match args.values {
        None => viz::step_table(collective, algorithm, ranks),
        Some(seed) => viz::step_table_seeded(collective, algorithm, ranks, seed),
    }
    .map_err(|e| e.to_string())?;
    print!("{}", table.render_text());
    if collective.is_reducing() || matches!(collective, Collective::AllGather) {
        print!(
            "{}",
            viz::bytes_summary(collective, algorithm, ranks).map_err(|e| e.to_string())?
        );
    }
    if let Some(path) = &args.html {
        std::fs::write(path, html::page(&table)).map_err(|e| format!("write {path}: {e}"))?;
        println!("\nwrote {path}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_name_offered_is_one_the_library_takes() {
        for c in CollectiveName::value_variants() {
            let v = c.to_possible_value().unwrap();
            for name in v.get_name_and_aliases() {
                assert!(viz::collective_named(name, 0).is_ok(), "{name}");
            }
        }
        for a in AlgorithmName::value_variants() {
            let v = a.to_possible_value().unwrap();
            for name in v.get_name_and_aliases() {
                assert_eq!(Algorithm::named(name), Some(Algorithm::from(*a)), "{name}");
            }
        }
    }
}
