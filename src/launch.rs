//! Starting the local ranks of a job and watching over them, as `torchrun` does: the
//! engine of `ferrorun` and of the perf tools' `-np N`.
//!
//! Each rank gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//! Node 0's launcher runs the store server itself (on a free port when there is one node
//! and no port was given) and sets `TORCHELASTIC_USE_AGENT_STORE=True`, so rank 0
//! connects to it like everyone else. Each rank leads its own process group: a
//! terminal's Ctrl-C reaches only the launcher, which forwards SIGINT, SIGTERM and SIGHUP
//! once, and stopping a rank stops its children. When a rank fails, the others are
//! stopped (SIGTERM, then SIGKILL after the grace period) and the launcher's exit code is
//! the failed rank's status (128 + signal for a signal). Once every rank of a failed or
//! stopped job is gone, the launcher removes the `/dev/shm` names they left (a rank
//! stopped between making its shared memory and removing the names cannot), and says
//! which.
//!
//! When every local rank can have a CPU of its own, each is bound to one ([`CpuBind`],
//! like `mpirun --bind-to core`), and the threads a rank starts (TCP proxies, progress
//! thread) share its CPU. That matters on machines where handing freshly written data to
//! a thread on another core is slow: on the project's 2-core VM, 2 ranks all-reducing
//! 64 MiB over loopback TCP move 2.2–3.0 GB/s bound and 1.7–2.3 GB/s unbound, because
//! a TCP send proxy on another core than its engine reads every slot from that core's
//! cache. Ranks that outnumber the CPUs are bound in blocks of consecutive ranks.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::store::{ServerOptions, TcpStoreServer};

/// What to start on this node.
#[derive(Clone, Debug)]
pub struct LocalJob {
    /// Name used in the launcher's own messages (`ferrorun`, `all_reduce_perf`).
    pub name: String,
    /// The program and its arguments.
    pub program: Vec<String>,
    /// Ranks on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Host of node 0 (where the store runs).
    pub master_addr: String,
    /// Port of the store; `None` picks a free one (one node) or 29500.
    pub master_port: Option<u16>,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// Prefix every output line of a rank with `[rankN]: `.
    pub prefix: bool,
    /// Extra environment variables for every rank.
    pub env: Vec<(String, String)>,
    /// Whether to bind each rank to a CPU.
    pub bind: CpuBind,
}

/// Whether the launcher binds each local rank to a CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CpuBind {
    /// Local rank `i` on the `i`-th CPU available to the launcher; when ranks outnumber
    /// the CPUs, in blocks of consecutive ranks (`n` ranks on `c` CPUs: rank `i` on CPU
    /// `⌊i·c/n⌋`, Slurm's block distribution). Bound, ranks that share a CPU stay with
    /// the same partners instead of following the scheduler's migrations, and ring
    /// neighbours share a CPU where they can (their FIFOs stay in its cache). 4 ranks
    /// on 2 cores, 3 interleaved runs (2026-11-28), blocks against free: 1–32 KiB 3.4–
    /// 14.6 µs against 4.9–19.0 (8 KiB 7.3–7.6 against 8.1–9.6), 2 MiB 7.4–8.6 GB/s
    /// against 6.6–8.4, 128 MiB 4.3–5.1 against 4.1–5.0; round robin (`i mod c`, as
    /// Intel MPI pins) was as fast small but lost at 2–128 MiB (128 MiB 3.4–4.4: every
    /// ring hop crossed cores). 3 and 8 ranks the same within the noise.
    #[default]
    Auto,
    /// Local rank `i` on the `i`-th available CPU (an error when ranks outnumber CPUs).
    Core,
    /// No binding.
    None,
}

impl CpuBind {
    /// Reads `auto`, `core` or `none`.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "auto" => Ok(CpuBind::Auto),
            "core" => Ok(CpuBind::Core),
            "none" => Ok(CpuBind::None),
            other => Err(Error::invalid(format!(
                "CPU binding {other:?} is not one of auto, core, none"
            ))),
        }
    }

    /// `FERROCCL_CPU_BIND`, or `auto` when unset.
    pub fn from_env() -> Result<Self> {
        match std::env::var("FERROCCL_CPU_BIND") {
            Ok(t) => Self::parse(&t).map_err(|e| Error::Env {
                var: "FERROCCL_CPU_BIND".into(),
                detail: e.to_string(),
            }),
            Err(_) => Ok(CpuBind::Auto),
        }
    }

    /// The CPU of each of `nranks` local ranks, among the CPUs this process may use;
    /// `None` for no binding.
    ///
    /// # Errors
    /// [`CpuBind::Core`] with more ranks than CPUs; the CPUs cannot be read.
    pub fn plan(self, nranks: usize) -> Result<Option<Vec<usize>>> {
        if self == CpuBind::None {
            return Ok(None);
        }
        let cpus = crate::topo::available_cpus()?;
        if nranks > cpus.len() && self == CpuBind::Core {
            return Err(Error::invalid(format!(
                "cannot bind {nranks} ranks to a CPU each: {} CPUs are available",
                cpus.len()
            )));
        }
        Ok(Some(
            (0..nranks)
                .map(|r| cpus[crate::topo::cpu_in_blocks(r, nranks, cpus.len())])
                .collect(),
        ))
    }
}

/// Makes `cmd`'s process run only on `cpu` (set in the child before it executes the
/// program, so every thread it starts inherits it).
fn bind_to_cpu(cmd: &mut Command, cpu: usize) {
    // SAFETY: an all-zero cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` came from `topo::available_cpus`, so it is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    let hook = move || {
        // SAFETY: sched_setaffinity is a plain system call (async-signal-safe), reading
        // `set`, a copy owned by this closure, for exactly its size.
        let rc =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // SAFETY: the hook runs in the forked child before exec; it allocates nothing, takes
    // no locks and makes one async-signal-safe system call.
    unsafe { cmd.pre_exec(hook) };
}

impl LocalJob {
    /// `nproc` ranks of `program` on one node, defaults otherwise.
    pub fn single_node(name: &str, program: Vec<String>, nproc: usize) -> Self {
        LocalJob {
            name: name.to_string(),
            program,
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs(5),
            prefix: true,
            env: Vec::new(),
            bind: CpuBind::Auto,
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

/// Runs `job` on this node until every rank has finished, or one failed and the rest
/// were stopped; returns the exit code the launcher should exit with.
pub fn run(job: &LocalJob) -> Result<u8> {
    let args = job;
    // Node 0 hosts the store; it lives as long as this function.
    let (_server, master_port) = if args.node_rank == 0 {
        let port = args
            .master_port
            .unwrap_or(if args.nnodes == 1 { 0 } else { 29500 });
        let server = TcpStoreServer::bind(
            crate::bootstrap::store_bind_addr(&args.master_addr, port),
            ServerOptions::from_env()?,
        )
        .map_err(|e| {
            Error::io(
                format!("{}: run the store server on port {port}", job.name),
                match e {
                    Error::Io { source, .. } => source,
                    other => std::io::Error::other(other.to_string()),
                },
            )
        })?;
        let port = server.local_addr().port();
        (Some(server), port)
    } else {
        let port = args.master_port.ok_or_else(|| {
            Error::invalid("--master-port is required on nodes other than node 0")
        })?;
        (None, port)
    };

    let signal = Arc::new(AtomicUsize::new(0));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        signal_hook::flag::register_usize(sig, signal.clone(), sig as usize)
            .map_err(|e| Error::io(format!("install a handler for signal {sig}"), e))?;
    }

    let world = args.nnodes * args.nproc_per_node;
    let cpus = args.bind.plan(args.nproc_per_node)?;
    let (line_done_tx, line_done_rx) = mpsc::channel::<()>();
    let mut ranks: Vec<Rank> = Vec::with_capacity(args.nproc_per_node);
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&args.program[0]);
        cmd.args(&args.program[1..])
            .envs(args.env.iter().map(|(k, v)| (k, v)))
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
        if let Some(cpus) = &cpus {
            bind_to_cpu(&mut cmd, cpus[local]);
        }
        if args.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut ranks, args.grace);
                return Err(Error::io(
                    format!("start {:?} for rank {rank}", args.program[0]),
                    e,
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

    let outcome = supervise(&mut ranks, &signal, args.grace, &job.name);
    // Let the line forwarders flush what the ranks wrote last (bounded: a grandchild that
    // kept a pipe open must not keep ferrorun alive).
    let deadline = Instant::now() + Duration::from_secs(2);
    while line_done_rx
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .is_ok()
    {}
    // Ranks that all succeeded removed their names themselves; and a job whose ranks
    // include another launcher's (two nodes on one host) may still use some then.
    let pids: Vec<u32> = ranks.iter().map(|r| r.child.id()).collect();
    let left = match outcome {
        Outcome::AllSucceeded => Vec::new(),
        _ => crate::transport::segment::remove_shm_left_by(&pids),
    };
    if !left.is_empty() {
        eprintln!(
            "{}: removed {} names the ranks left in /dev/shm (stopped before they could): {}",
            job.name,
            left.len(),
            left.join(", ")
        );
    }

    match outcome {
        Outcome::AllSucceeded => Ok(0),
        Outcome::RankFailed { rank, pid, status } => {
            eprintln!(
                "{}: failed: rank {rank} (pid {pid}) {}; the other ranks were stopped",
                job.name,
                describe(status)
            );
            Ok(exit_code(status))
        }
        Outcome::Signalled(sig) => {
            eprintln!("{}: stopped by {}", job.name, signal_name(sig as i32));
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
fn supervise(ranks: &mut [Rank], signal: &AtomicUsize, grace: Duration, name: &str) -> Outcome {
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
                Err(e) => eprintln!("{name}: cannot wait for rank {}: {e}", r.rank),
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
                "{name}: rank {rank} (pid {pid}) {}; stopping ranks {running:?}",
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
    supervise(ranks, &never, grace, "launcher");
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

/// Says how a rank ended: "exited with status 3", "was killed by signal 11 (SIGSEGV)".
pub fn describe(status: ExitStatus) -> String {
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
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1),
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        _ => 1,
    }
}

/// The usual name of a signal number (`SIGTERM`), or "signal N".
pub fn signal_name(sig: i32) -> String {
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
