//! `ferrorun`: start the ranks of a job on this node, like `torchrun`.
//!
//! ```text
//! ferrorun --nproc-per-node 4 -- ./my_program args…
//! ferrorun --nproc-per-node 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 \
//!          --master-port 29500 -- ./my_program
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

use std::process::ExitCode;
use std::time::Duration;

use ferroccl::launch::{self, CpuBind, LocalJob};

const USAGE: &str = "\
usage: ferrorun [OPTIONS] [--] PROGRAM [ARGS...]

Starts the local ranks of a job, like torchrun.

options:
  --nproc-per-node N   ranks to start on this node (default 1)
  --nnodes M           number of nodes in the job (default 1)
  --node-rank K        this node's index in 0..M (default 0)
  --master-addr A      host of node 0, where the store runs (default 127.0.0.1)
  --master-port P      port of the store (default: a free port with one node, else 29500)
  --grace-period S     seconds between SIGTERM and SIGKILL when stopping ranks (default 5)
  --no-prefix          do not prefix output lines with [rankN]:
  --bind auto|core|none  bind each rank to a CPU of its own: auto (default, or
                       FERROCCL_CPU_BIND) when there are enough CPUs, core always,
                       none never
  -h, --help           print this help
";

/// Reads the command line into the job to launch (`None`: print the help).
fn parse_args(mut argv: impl Iterator<Item = String>) -> Result<Option<LocalJob>, String> {
    let mut args = LocalJob::single_node("ferrorun", Vec::new(), 1);
    args.bind = CpuBind::from_env().map_err(|e| e.to_string())?;
    fn value<T: std::str::FromStr>(
        flag: &str,
        inline: Option<String>,
        argv: &mut impl Iterator<Item = String>,
    ) -> Result<T, String> {
        let text = inline
            .or_else(|| argv.next())
            .ok_or_else(|| format!("{flag} needs a value"))?;
        text.parse()
            .map_err(|_| format!("{flag}: {text:?} is not a valid value"))
    }
    while let Some(arg) = argv.next() {
        if arg == "--" {
            args.program.extend(argv);
            break;
        }
        if !arg.starts_with('-') {
            args.program.push(arg);
            args.program.extend(argv);
            break;
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        match flag.replace('_', "-").as_str() {
            "--nproc-per-node" => args.nproc_per_node = value(&flag, inline, &mut argv)?,
            "--nnodes" => args.nnodes = value(&flag, inline, &mut argv)?,
            "--node-rank" => args.node_rank = value(&flag, inline, &mut argv)?,
            "--master-addr" => args.master_addr = value(&flag, inline, &mut argv)?,
            "--master-port" => args.master_port = Some(value(&flag, inline, &mut argv)?),
            "--grace-period" => {
                let secs: f64 = value(&flag, inline, &mut argv)?;
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(format!("{flag}: {secs} is not a number of seconds"));
                }
                args.grace = Duration::from_secs_f64(secs);
            }
            "--no-prefix" => args.prefix = false,
            "--bind" => {
                let text: String = value(&flag, inline, &mut argv)?;
                args.bind = CpuBind::parse(&text).map_err(|e| format!("{flag}: {e}"))?;
            }
            "-h" | "--help" => return Ok(None),
            _ => return Err(format!("unknown option {arg:?}")),
        }
    }
    if args.program.is_empty() {
        return Err("no program to run".into());
    }
    if args.nproc_per_node == 0 {
        return Err("--nproc-per-node must be at least 1".into());
    }
    if args.nnodes == 0 {
        return Err("--nnodes must be at least 1".into());
    }
    if args.node_rank >= args.nnodes {
        return Err(format!(
            "--node-rank {} is not below --nnodes {}",
            args.node_rank, args.nnodes
        ));
    }
    Ok(Some(args))
}

fn main() -> ExitCode {
    let job = match parse_args(std::env::args().skip(1)) {
        Ok(Some(job)) => job,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("ferrorun: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
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

    fn parse(words: &[&str]) -> Result<Option<LocalJob>, String> {
        parse_args(words.iter().map(|s| s.to_string()))
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
        .unwrap()
        .unwrap();
        assert_eq!((a.nproc_per_node, a.nnodes, a.node_rank), (4, 2, 1));
        assert_eq!(a.master_port, Some(9));
        assert_eq!(a.program, ["prog", "-x"]);
        let a = parse(&["--", "--weird-program"]).unwrap().unwrap();
        assert_eq!(a.program, ["--weird-program"]);
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        assert!(
            parse(&["--nproc-per-node", "x", "p"])
                .unwrap_err()
                .contains("\"x\"")
        );
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
        assert!(parse(&["-h"]).unwrap().is_none());
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
