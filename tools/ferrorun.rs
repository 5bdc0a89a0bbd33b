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

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferroccl::store::{ServerOptions, TcpStoreServer};

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
  -h, --help           print this help
";

/// What the command line asked for.
#[derive(Debug)]
struct Args {
    nproc_per_node: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: Option<u16>,
    grace: Duration,
    prefix: bool,
    program: Vec<String>,
}

fn parse_args(mut argv: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut args = Args {
        nproc_per_node: 1,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        grace: Duration::from_secs(5),
        prefix: true,
        program: Vec::new(),
    };
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
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("ferrorun: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("ferrorun: {e}");
            ExitCode::from(1)
        }
    }
}

/// One started rank.
struct Rank {
    rank: usize,
    child: Child,
    /// Set once the child has been reaped.
    status: Option<ExitStatus>,
}

fn run(args: &Args) -> Result<u8, String> {
    // Node 0 hosts the store; it lives as long as this function.
    let (_server, master_port) = if args.node_rank == 0 {
        let port = args
            .master_port
            .unwrap_or(if args.nnodes == 1 { 0 } else { 29500 });
        let server = TcpStoreServer::bind(("0.0.0.0", port), ServerOptions::default())
            .map_err(|e| format!("cannot run the store server on port {port}: {e}"))?;
        let port = server.local_addr().port();
        (Some(server), port)
    } else {
        let port = args
            .master_port
            .ok_or("--master-port is required on nodes other than node 0")?;
        (None, port)
    };

    let signal = Arc::new(AtomicUsize::new(0));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        signal_hook::flag::register_usize(sig, signal.clone(), sig as usize)
            .map_err(|e| format!("cannot install a handler for signal {sig}: {e}"))?;
    }

    let world = args.nnodes * args.nproc_per_node;
    let (line_done_tx, line_done_rx) = mpsc::channel::<()>();
    let mut ranks: Vec<Rank> = Vec::with_capacity(args.nproc_per_node);
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&args.program[0]);
        cmd.args(&args.program[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("GROUP_WORLD_SIZE", args.nnodes.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .stdin(Stdio::null())
            // Each rank leads its own process group: a terminal's Ctrl-C reaches only
            // ferrorun, which forwards it once, and stopping a rank stops its children.
            .process_group(0);
        if std::env::var_os("OMP_NUM_THREADS").is_none() && args.nproc_per_node > 1 {
            cmd.env("OMP_NUM_THREADS", "1");
        }
        if args.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut ranks, args.grace);
                return Err(format!(
                    "cannot start {:?} for rank {rank}: {e}",
                    args.program[0]
                ));
            }
        };
        if args.prefix {
            let tag = format!("[rank{rank}]: ");
            if let Some(out) = child.stdout.take() {
                forward_lines(out, tag.clone(), false, line_done_tx.clone());
            }
            if let Some(err) = child.stderr.take() {
                forward_lines(err, tag, true, line_done_tx.clone());
            }
        }
        ranks.push(Rank {
            rank,
            child,
            status: None,
        });
    }
    drop(line_done_tx);

    let outcome = supervise(&mut ranks, &signal, args.grace);
    // Let the line forwarders flush what the ranks wrote last (bounded: a grandchild that
    // kept a pipe open must not keep ferrorun alive).
    let deadline = Instant::now() + Duration::from_secs(2);
    while line_done_rx
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .is_ok()
    {}

    match outcome {
        Outcome::AllSucceeded => Ok(0),
        Outcome::RankFailed { rank, pid, status } => {
            eprintln!(
                "ferrorun: failed: rank {rank} (pid {pid}) {}; the other ranks were stopped",
                describe(status)
            );
            Ok(exit_code(status))
        }
        Outcome::Signalled(sig) => {
            eprintln!("ferrorun: stopped by {}", signal_name(sig as i32));
            Ok(128u8.saturating_add(sig as u8))
        }
    }
}

enum Outcome {
    AllSucceeded,
    RankFailed {
        rank: usize,
        pid: u32,
        status: ExitStatus,
    },
    Signalled(usize),
}

/// Waits for every rank; on the first failure or signal, stops the rest.
fn supervise(ranks: &mut [Rank], signal: &AtomicUsize, grace: Duration) -> Outcome {
    let mut first_failure: Option<Outcome> = None;
    let mut stopping_since: Option<Instant> = None;
    let mut killed = false;
    loop {
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                signal_group(&r.child, sig as i32);
            }
            first_failure.get_or_insert(Outcome::Signalled(sig));
            stopping_since.get_or_insert_with(Instant::now);
        }
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    r.status = Some(status);
                    if !status.success() && first_failure.is_none() {
                        first_failure = Some(Outcome::RankFailed {
                            rank: r.rank,
                            pid: r.child.id(),
                            status,
                        });
                    }
                }
                Ok(None) => {}
                Err(e) => eprintln!("ferrorun: cannot wait for rank {}: {e}", r.rank),
            }
        }
        let running: Vec<usize> = ranks
            .iter()
            .filter(|r| r.status.is_none())
            .map(|r| r.rank)
            .collect();
        if running.is_empty() {
            return first_failure.unwrap_or(Outcome::AllSucceeded);
        }
        if let Some(Outcome::RankFailed { rank, pid, status }) = &first_failure
            && stopping_since.is_none()
        {
            eprintln!(
                "ferrorun: rank {rank} (pid {pid}) {}; stopping ranks {running:?}",
                describe(*status)
            );
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                signal_group(&r.child, libc::SIGTERM);
            }
            stopping_since = Some(Instant::now());
        }
        if let Some(since) = stopping_since
            && !killed
            && since.elapsed() >= grace
        {
            eprintln!(
                "ferrorun: ranks {running:?} still running after the grace period; killing them"
            );
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                signal_group(&r.child, libc::SIGKILL);
            }
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `sig` to the process group the child leads (it was started with its own).
fn signal_group(child: &Child, sig: i32) {
    let pgid = child.id() as libc::pid_t;
    // SAFETY: kill(2) with a negative pid signals a process group; the child is not yet
    // reaped (callers only signal ranks without a status), so its group id is still ours.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Stops ranks already started when a later one cannot be.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    let never = AtomicUsize::new(libc::SIGTERM as usize);
    supervise(ranks, &never, grace);
}

/// Copies lines from a rank's pipe to ours, each prefixed with `tag`.
fn forward_lines(
    pipe: impl Read + Send + 'static,
    tag: String,
    stderr: bool,
    done: mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut out: Box<dyn Write> = if stderr {
                        Box::new(std::io::stderr().lock())
                    } else {
                        Box::new(std::io::stdout().lock())
                    };
                    let _ = out.write_all(tag.as_bytes());
                    let _ = out.write_all(&line);
                    let _ = out.flush();
                }
            }
        }
        let _ = done.send(());
    });
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!(
            "was killed by signal {sig} ({}){}",
            signal_name(sig),
            if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            }
        ),
        _ => format!("ended with {status}"),
    }
}

/// ferrorun's exit code for a failed rank: its own code, or 128 + the signal.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1),
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        _ => 1,
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(words: &[&str]) -> Result<Option<Args>, String> {
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
