//! `ferroccl-limits`: what this machine allows a collective on one host, measured now:
//! the cache-line hand-off between two cores (the small-message floor) and the
//! read+write bandwidth of concurrent copies and reductions (the large-message bound of
//! an all-reduce).
//!
//! ```text
//! ferroccl-limits --ranks 2          # floor, memory bandwidth, the all-reduce bound on 2 ranks
//! ferroccl-limits --ranks 2,4 --json # the same as JSON (what tools/compare reads)
//! ```
//!
//! See `ferroccl::perf::limits` for what is measured and why.

#[path = "cli_support.rs"]
mod cli_support;

use std::process::ExitCode;

use clap::Parser;
use clap_complete::Shell;
use ferroccl::perf::limits;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-limits",
    version,
    about = "Measures this machine's limits for collectives on one host: the one-way \
             cache-line latency between two cores and the memory bandwidth of concurrent \
             copies and reductions, with the all-reduce bound that follows.",
    after_help = "The bound of an out-of-place all-reduce of S bytes on n ranks: (3n-1)*S \
                  bytes through memory at the read+write bandwidth of min(n, CPUs) \
                  concurrent workers on buffers of BYTES each: the better of copies \
                  (dst = src) and reductions (dst += src, f32)."
)]
struct Cli {
    /// Rank counts to give the all-reduce bound for (comma-separated).
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_value = "2")]
    ranks: Vec<usize>,

    /// Bytes of each buffer of each concurrent worker (far larger than the caches).
    #[arg(long, value_name = "BYTES", default_value_t = 256 << 20)]
    copy_bytes: usize,

    /// Timed rounds of each pass, copy and reduction (the best counts).
    #[arg(long, value_name = "R", default_value_t = 5)]
    reps: usize,

    /// Ping-pong round trips (after a tenth as many for warm-up).
    #[arg(long, value_name = "K", default_value_t = 200_000)]
    rounds: u64,

    /// Print the results as JSON.
    #[arg(long)]
    json: bool,

    /// Print the completion script for SHELL on stdout and exit.
    #[arg(long, value_name = "SHELL", exclusive = true)]
    completions: Option<Shell>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(shell) = cli.completions {
        return cli_support::print_completions::<Cli>(shell);
    }
    match run(&cli) {
        Ok(text) => cli_support::write_stdout(text.as_bytes(), "the results"),
        Err(e) => {
            eprintln!("ferroccl-limits: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> ferroccl::Result<String> {
    if cli.ranks.iter().any(|&n| n < 1) {
        return Err(ferroccl::Error::invalid(
            "--ranks takes rank counts of 1 or more",
        ));
    }
    let cpus = ferroccl::topo::available_cpus()?.len();
    let floor_us = limits::one_way_latency(cli.rounds)?.as_secs_f64() * 1e6;
    let mut rows = Vec::new();
    // Per worker count: (copy, reduce) read+write GB/s.
    let mut measured: Vec<(usize, (f64, f64))> = Vec::new();
    for &n in &cli.ranks {
        let workers = n.min(cpus);
        let (copy, reduce) = match measured.iter().find(|m| m.0 == workers) {
            Some(&(_, both)) => both,
            None => {
                let bw = |pass| limits::memory_bandwidth(pass, workers, cli.copy_bytes, cli.reps);
                let both = (bw(limits::Pass::Copy)?, bw(limits::Pass::Reduce)?);
                measured.push((workers, both));
                both
            }
        };
        // busbw of the bound, for a buffer much larger than the caches (nccl-tests'
        // all-reduce factor 2(n-1)/n on S / t).
        let s = cli.copy_bytes;
        let t = limits::all_reduce_bound(s, n, copy.max(reduce));
        let busbw = s as f64 / t / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64;
        rows.push((n, workers, copy, reduce, busbw));
    }
    if cli.json {
        let doc = serde_json::json!({
            "cpus": cpus,
            "one_way_us": floor_us,
            "ranks": rows.iter().map(|&(n, workers, copy, reduce, bus)| serde_json::json!({
                "ranks": n, "workers": workers, "copy_read_write_gbs": copy,
                "reduce_read_write_gbs": reduce, "read_write_gbs": copy.max(reduce),
                "all_reduce_bound_busbw_gbs": bus,
            })).collect::<Vec<_>>(),
        });
        return Ok(serde_json::to_string_pretty(&doc).expect("JSON") + "\n");
    }
    let mut text = format!("cache line, one way between CPUs of ranks 0 and 1: {floor_us:.3} us\n");
    for (n, workers, copy, reduce, bus) in rows {
        text += &format!(
            "{n} ranks: {workers} concurrent copies reach {copy:.1} GB/s read+write, \
             reductions {reduce:.1}; all-reduce bound {bus:.2} GB/s busbw\n"
        );
    }
    Ok(text)
}
