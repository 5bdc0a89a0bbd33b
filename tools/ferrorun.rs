//! `ferrorun`: start the ranks of a job on this node, like `torchrun`.
//!
//! ```text
//! ferrorun --nproc-per-node 4 -- ./my_program args…
//! ferrorun --nproc-per-node 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 \
//!          --master-port 29500 -- ./my_program
//! ferrorun --completions bash > /etc/bash_completion.d/ferrorun
//! ```
//!
//! Each rank gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//! Node 0's ferrorun runs the store server itself (on a free port when there is one node
//! and no `--master-port`) and sets `TORCHELASTIC_USE_AGENT_STORE=True`, so rank 0
//! connects to it like everyone else. Every output line of a rank is prefixed with
//! `[rankN]: `. SIGINT, SIGTERM and SIGHUP are forwarded to every rank. When a rank fails,
//! the others are stopped (SIGTERM, then SIGKILL after the grace period) and ferrorun
//! exits non-zero, naming the rank and its exit status or signal.
//!
//! The options are read only up to the program's name: everything from there on (or
//! after `--`) is the program's command line, untouched. Like torchrun, every option
//! may be spelt with underscores too (`--nproc_per_node`).

#[path = "cli_support.rs"]
mod cli_support;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use clap_complete::Shell;
use ferroccl::launch::{self, CpuBind, LocalJob};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ferrorun",
    version,
    about = "Starts the local ranks of a job, like torchrun.",
    override_usage = "ferrorun [OPTIONS] [--] PROGRAM [ARGS]...\n       \
                      ferrorun --completions <SHELL>",
    after_help = "Everything from PROGRAM on (or after `--`) is passed to the program \
                  untouched. Each option may also be spelt with underscores \
                  (--nproc_per_node), as torchrun allows."
)]
struct Cli {
    /// Ranks to start on this node.
    #[arg(long, alias = "nproc_per_node", value_name = "N", default_value_t = 1,
          value_parser = at_least_one)]
    nproc_per_node: usize,

    /// Number of nodes in the job.
    #[arg(long, value_name = "M", default_value_t = 1,
          value_parser = at_least_one)]
    nnodes: usize,

    /// This node's index in 0..M.
    #[arg(long, alias = "node_rank", value_name = "K", default_value_t = 0)]
    node_rank: usize,

    /// Host of node 0, where the store runs.
    #[arg(
        long,
        alias = "master_addr",
        value_name = "ADDR",
        default_value = "127.0.0.1"
    )]
    master_addr: String,

    /// Port of the store [default: a free port with one node, else 29500].
    #[arg(long, alias = "master_port", value_name = "PORT")]
    master_port: Option<u16>,

    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, alias = "grace_period", value_name = "SECONDS", default_value = "5",
          allow_negative_numbers = true, value_parser = seconds)]
    grace_period: Duration,

    /// Do not prefix output lines with `[rankN]: `.
    #[arg(long, alias = "no_prefix")]
    no_prefix: bool,

    /// Bind each rank to a CPU: auto a CPU each, or blocks of consecutive ranks when
    /// ranks outnumber CPUs; core a CPU each or an error; none never [default:
    /// FERROCCL_CPU_BIND, else auto].
    #[arg(long, value_name = "MODE")]
    bind: Option<Bind>,

    /// Print the completion script for SHELL on stdout and exit.
    #[arg(long, value_name = "SHELL")]
    completions: Option<Shell>,

    /// The program to start as every rank, and its arguments.
    #[arg(value_name = "PROGRAM", trailing_var_arg = true, num_args = 1..)]
    program: Vec<String>,
}

/// `--bind`'s values (those of [`CpuBind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Bind {
    /// Bind local rank i to the i-th CPU; n ranks on c < n CPUs: rank i to CPU i*c/n.
    Auto,
    /// Bind local rank i to the i-th CPU (an error when ranks outnumber CPUs).
    Core,
    /// Never bind.
    None,
}

impl From<Bind> for CpuBind {
    fn from(b: Bind) -> Self {
        match b {
            Bind::Auto => CpuBind::Auto,
            Bind::Core => CpuBind::Core,
            Bind::None => CpuBind::None,
        }
    }
}

/// Reads `--nproc-per-node` and `--nnodes`: a whole number, at least 1.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads `--grace-period`: a finite, non-negative number of seconds.
fn seconds(text: &str) -> Result<Duration, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err("not a number of seconds".into()),
    }
}

/// What the command line asks for.
#[derive(Debug)]
enum Action {
    /// Launch this job.
    Run(LocalJob),
    /// Print the completion script for this shell.
    Completions(Shell),
}

/// Reads the command line (without ferrorun's own name) into what to do. Help, the
/// version and every mistake come back as clap's error, ready to print.
fn parse_args<T: Into<OsString>>(argv: impl IntoIterator<Item = T>) -> Result<Action, clap::Error> {
    let argv = argv.into_iter().map(Into::into);
    let cli = Cli::try_parse_from(std::iter::once(OsString::from("ferrorun")).chain(argv))?;
    if let Some(shell) = cli.completions {
        return Ok(Action::Completions(shell));
    }
    let error = |kind, message: String| Cli::command().error(kind, message);
    let mut job = LocalJob::single_node("ferrorun", cli.program, cli.nproc_per_node);
    if job.program.is_empty() {
        return Err(error(
            ErrorKind::MissingRequiredArgument,
            "no program to run".into(),
        ));
    }
    if cli.node_rank >= cli.nnodes {
        return Err(error(
            ErrorKind::ValueValidation,
            format!(
                "--node-rank {} is not below --nnodes {}",
                cli.node_rank, cli.nnodes
            ),
        ));
    }
    // FERROCCL_CPU_BIND is read (and a bad value refused) even when --bind overrides it.
    job.bind = CpuBind::from_env().map_err(|e| error(ErrorKind::InvalidValue, e.to_string()))?;
    if let Some(bind) = cli.bind {
        job.bind = bind.into();
    }
    job.nnodes = cli.nnodes;
    job.node_rank = cli.node_rank;
    job.master_addr = cli.master_addr;
    job.master_port = cli.master_port;
    job.grace = cli.grace_period;
    job.prefix = !cli.no_prefix;
    Ok(Action::Run(job))
}

fn main() -> ExitCode {
    let job = match parse_args(std::env::args_os().skip(1)) {
        Ok(Action::Run(job)) => job,
        Ok(Action::Completions(shell)) => return cli_support::print_completions::<Cli>(shell),
        // Help and the version on stdout with status 0; mistakes on stderr with 2.
        Err(e) => e.exit(),
    };
    match launch::run(&job) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("ferrorun: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl::launch::{describe, exit_code};
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    /// The job, or the error's text.
    fn parse(words: &[&str]) -> Result<LocalJob, String> {
        match parse_args(words.iter().copied()) {
            Ok(Action::Run(job)) => Ok(job),
            Ok(Action::Completions(shell)) => Err(format!("completions for {shell}")),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn flags_in_both_spellings() {
        let a = parse(&[
            "--nproc_per_node=4",
            "--nnodes",
            "2",
            "--node-rank=1",
            "--master-port",
            "9",
            "prog",
            "-x",
        ])
        .unwrap();
        assert_eq!((a.nproc_per_node, a.nnodes, a.node_rank), (4, 2, 1));
        assert_eq!(a.master_port, Some(9));
        assert_eq!(a.program, ["prog", "-x"]);
        let a = parse(&["--", "--weird-program"]).unwrap();
        assert_eq!(a.program, ["--weird-program"]);
        let a = parse(&[
            "--master_addr",
            "10.0.0.1",
            "--grace_period",
            "0.5",
            "--no_prefix",
            "p",
        ])
        .unwrap();
        assert_eq!(a.master_addr, "10.0.0.1");
        assert_eq!(a.grace, Duration::from_millis(500));
        assert!(!a.prefix);
        let a = parse(&["--bind", "none", "p"]).unwrap();
        assert_eq!(a.bind, CpuBind::None);
    }

    #[test]
    fn everything_from_the_program_on_is_the_programs() {
        // ferrorun's own flags, `--`, --help and --completions after the program's name
        // all belong to the program.
        let a = parse(&[
            "--nproc-per-node",
            "2",
            "prog",
            "--nproc-per-node",
            "3",
            "--",
            "-h",
            "--completions",
            "bash",
        ])
        .unwrap();
        assert_eq!(a.nproc_per_node, 2);
        assert_eq!(
            a.program,
            [
                "prog",
                "--nproc-per-node",
                "3",
                "--",
                "-h",
                "--completions",
                "bash"
            ]
        );
        let a = parse(&["--", "prog", "--", "x"]).unwrap();
        assert_eq!(a.program, ["prog", "--", "x"]);
        assert_eq!(
            parse(&["--completions", "bash"]).unwrap_err(),
            "completions for bash"
        );
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        let err = parse(&["--nproc-per-node", "x", "p"]).unwrap_err();
        assert!(
            err.contains("'x'") && err.contains("--nproc-per-node"),
            "{err}"
        );
        let err = parse(&["--nproc-per-node", "0", "p"]).unwrap_err();
        assert!(
            err.contains("'0'") && err.contains("--nproc-per-node"),
            "{err}"
        );
        let err = parse(&["--grace-period", "-1", "p"]).unwrap_err();
        assert!(
            err.contains("--grace-period") && err.contains("seconds"),
            "{err}"
        );
        let err = parse(&["--bind", "socket", "p"]).unwrap_err();
        assert!(err.contains("--bind") && err.contains("core"), "{err}");
        assert!(
            parse(&["--node-rank", "2", "--nnodes", "2", "p"])
                .unwrap_err()
                .contains("--node-rank 2")
        );
        assert!(
            parse(&["--nproc-per-node", "2"])
                .unwrap_err()
                .contains("no program")
        );
        assert!(parse(&["--bogus", "p"]).unwrap_err().contains("--bogus"));
        let err = parse(&["--nproc-per-nod", "2", "p"]).unwrap_err();
        assert!(
            err.contains("--nproc-per-nod'") && err.contains("--nproc-per-node"),
            "{err}"
        );
        let help = parse_args(["-h"]).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
        assert!(!help.use_stderr());
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn exit_codes_and_descriptions() {
        let exited = ExitStatus::from_raw(3 << 8);
        assert_eq!(exit_code(exited), 3);
        assert_eq!(describe(exited), "exited with status 3");
        let killed = ExitStatus::from_raw(libc::SIGSEGV);
        assert_eq!(exit_code(killed), 128 + 11);
        assert!(describe(killed).contains("SIGSEGV"));
    }
}
