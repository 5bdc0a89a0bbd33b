//! The perf tools' command line: nccl-tests' flags with nccl-tests' meanings, plus a few
//! of ferroccl's own.

// Parsed by hand, not with clap as ferrorun and the ferroccl-* tools are: command lines
// written for nccl-tests must work unchanged, and `-np N` (a single-dash flag of two
// letters, spelt like mpirun's) cannot be a clap flag: clap's short flags are one
// character, so it would read `-np 4` as `-n` with the value `p`, then a stray `4`.
// (The getopt value forms used here, `-b 8`, `-b8`, `--minbytes=8`, `-r -1`, clap could
// take; `-np` is what rules it out.)

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

/// The usage text (the tool's name is put in front).
pub const USAGE: &str = "\
[OPTIONS]

nccl-tests flags (same meanings):
  -b, --minbytes SIZE       smallest size (K/M/G suffixes, powers of 1024)   [32M]
  -e, --maxbytes SIZE       largest size                                     [32M]
  -i, --stepbytes SIZE      add this much between sizes (when -f is 1)       [1M]
  -f, --stepfactor F        multiply sizes by F (F > 1)                      [1]
  -n, --iters N|auto        timed iterations per size ('auto': about 1 GiB of
                            traffic per size, 20..10000, as the baselines)   [20]
  -w, --warmup_iters N      untimed iterations first                         [5]
  -c, --check 0|1           check every result against a serial reference    [1]
  -o, --op OP|all           sum, prod, max, min, avg, mulsum                 [sum]
  -d, --datatype T|all      int8 uint8 int32 uint32 int64 uint64 half float
                            double bfloat16 f8e4m3 f8e5m2                    [float]
  -r, --root R|-1           root of rooted collectives; -1 = every root      [0]
  -a, --average 0|1|2|3     time across ranks: 0 rank 0, 1 mean, 2 min, 3 max [1]
  -N, --run_cycles N        run the whole sweep N times                      [1]
  -T, --timeout SECONDS     fail a collective that takes longer              [600]
  -J, --output_file FILE    write the results as JSON
  -m, --agg_iters 1         (only 1: no aggregation)
  -g, --ngpus 1             (one device per rank: only 1)
  -R, --local_register 0|1|2
                            host buffers: 0 plain, 1 registered (changes nothing:
                            shared memory and TCP need no registration), 2 in
                            windows (ncclMemAlloc + ncclCommWindowRegister: peers
                            in other processes read them in place)           [0]
  -z, -y, -C, -G            accepted for compatibility; no effect

ferroccl's own:
  -np N                     start N local ranks as processes over /dev/shm
  -t, --nthreads N          run N ranks as threads of this process
                            (neither: one rank, or the ranks of ferrorun/torchrun/
                            srun/mpirun when RANK etc. are set)
  --memory host|cuda        where the buffers are: host memory, or CUDA device
                            memory (rank r on GPU r % GPUs, calls on a stream)  [host]
  --backend ferroccl|nccl|both
                            run the sweep on ferroccl, on NVIDIA's NCCL (device
                            memory; the library FERROCCL_NCCL_LIB names, e.g. the
                            nvidia-nccl-cu13 wheel's libnccl.so.2), or on both one
                            after the other with a comparison at the end  [ferroccl]
  --csv FILE                write the results as CSV
  --plot FILE.svg           draw bus bandwidth and latency against size
  --no-progress             no progress line on stderr
  -h, --help                this help
";

/// Which ranks to time across (`-a`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Average {
    /// Rank 0's time.
    Rank0,
    /// The mean over ranks.
    Mean,
    /// The fastest rank.
    Min,
    /// The slowest rank.
    Max,
}

/// Timed iterations per size (`-n`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Iters {
    /// A fixed number.
    Fixed(usize),
    /// About 1 GiB of traffic per size, clamped to 20..=10000, with warm-up of a fifth
    /// (at least 5) — the convention of the OpenMPI and Gloo baselines.
    Auto,
}

/// Where the buffers of a sweep are (`--memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory: calls complete when they return.
    Host,
    /// CUDA device memory: calls are enqueued on a stream.
    Cuda,
}

/// Which library runs the collectives (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// ferroccl.
    Ferroccl,
    /// NVIDIA's NCCL, loaded by path (device memory only).
    Nccl,
    /// ferroccl, then NCCL, then a table of both.
    Both,
}

/// A parsed command line.
#[derive(Clone, Debug)]
pub struct PerfArgs {
    /// Smallest size in bytes.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Additive step (used when `step_factor` is 1).
    pub step_bytes: usize,
    /// Multiplicative step.
    pub step_factor: usize,
    /// Timed iterations.
    pub iters: Iters,
    /// Warm-up iterations.
    pub warmup: usize,
    /// Check results.
    pub check: bool,
    /// Reduction ops to run (reducing collectives only).
    pub ops: Vec<ReduceOp>,
    /// Data types to run.
    pub dtypes: Vec<DataType>,
    /// Root (`None`: every root).
    pub root: Option<usize>,
    /// Time across ranks.
    pub average: Average,
    /// Sweep repetitions.
    pub cycles: usize,
    /// Collective timeout in seconds.
    pub timeout_secs: f64,
    /// JSON output.
    pub json: Option<PathBuf>,
    /// CSV output.
    pub csv: Option<PathBuf>,
    /// SVG plot.
    pub plot: Option<PathBuf>,
    /// Local processes to start.
    pub processes: Option<usize>,
    /// Ranks as threads.
    pub threads: Option<usize>,
    /// Progress line on stderr (when it is a terminal).
    pub progress: bool,
    /// Where the buffers are.
    pub memory: Memory,
    /// Which library runs the collectives.
    pub backend: Backend,
    /// `-R 2`: host buffers in windows of shared memory.
    pub windows: bool,
}

impl Default for PerfArgs {
    fn default() -> Self {
        PerfArgs {
            min_bytes: 32 << 20,
            max_bytes: 32 << 20,
            step_bytes: 1 << 20,
            step_factor: 1,
            iters: Iters::Fixed(20),
            warmup: 5,
            check: true,
            ops: vec![ReduceOp::Sum],
            dtypes: vec![DataType::Float32],
            root: Some(0),
            average: Average::Mean,
            cycles: 1,
            timeout_secs: 600.0,
            json: None,
            csv: None,
            plot: None,
            processes: None,
            threads: None,
            progress: true,
            memory: Memory::Host,
            backend: Backend::Ferroccl,
            windows: false,
        }
    }
}

/// Parses a size with an optional K, M or G suffix (powers of 1024), as nccl-tests does;
/// `B`, `KB`/`KiB`, `MB`/`MiB` and `GB`/`GiB` are read the same way.
pub fn parse_size(text: &str) -> Result<usize> {
    let t = text.trim();
    let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let mult: Option<usize> = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => Some(1),
        "K" | "KB" | "KIB" => Some(1 << 10),
        "M" | "MB" | "MIB" => Some(1 << 20),
        "G" | "GB" | "GIB" => Some(1 << 30),
        _ => None,
    };
    digits
        .parse::<usize>()
        .ok()
        .zip(mult)
        .and_then(|(v, m)| v.checked_mul(m))
        .ok_or_else(|| Error::invalid(format!("{text:?} is not a size (e.g. 8, 64K, 128M, 1G)")))
}

fn parse_op(text: &str) -> Result<Vec<ReduceOp>> {
    let all = super::check::ops();
    let text = text.to_ascii_lowercase();
    if text == "all" {
        return Ok(all.to_vec());
    }
    let name = if text == "premulsum" {
        "mulsum"
    } else {
        text.as_str()
    };
    all.into_iter()
        .find(|op| op.name() == name)
        .map(|op| vec![op])
        .ok_or_else(|| {
            Error::invalid(format!(
                "-o {text:?}: not one of sum, prod, max, min, avg, mulsum, all"
            ))
        })
}

fn parse_dtype(text: &str) -> Result<Vec<DataType>> {
    if text.eq_ignore_ascii_case("all") {
        return Ok(DataType::ALL.to_vec());
    }
    text.parse::<DataType>()
        .map(|d| vec![d])
        .map_err(|e| Error::invalid(format!("-d: {e}")))
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T> {
    text.trim()
        .parse()
        .map_err(|_| Error::invalid(format!("{flag} {text:?}: not a valid number")))
}

/// Parses the command line (without the program name). `Ok(None)` asks for the help.
pub fn parse(argv: &[String]) -> Result<Option<PerfArgs>> {
    let mut a = PerfArgs::default();
    let mut factor_given = false;
    let mut memory_given = false;
    let mut i = 0;
    while i < argv.len() {
        let arg = &argv[i];
        i += 1;
        let (flag, inline) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((f, v)) => (format!("--{f}"), Some(v.to_string())),
                None => (arg.clone(), None),
            }
        } else if arg == "-np" {
            (arg.clone(), None)
        } else if let Some(c) = arg.strip_prefix('-').and_then(|rest| rest.chars().next())
            && arg.len() > 1 + c.len_utf8()
            && !c.is_numeric()
        {
            // getopt style: "-b8" is "-b 8" (split after the flag's character, whatever
            // its length in UTF-8).
            let at = 1 + c.len_utf8();
            (arg[..at].to_string(), Some(arg[at..].to_string()))
        } else {
            (arg.clone(), None)
        };
        let mut value = || -> Result<String> {
            if let Some(v) = inline.clone() {
                return Ok(v);
            }
            let v = argv
                .get(i)
                .cloned()
                .ok_or_else(|| Error::invalid(format!("{flag} needs a value")))?;
            i += 1;
            Ok(v)
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "-b" | "--minbytes" => a.min_bytes = parse_size(&value()?)?,
            "-e" | "--maxbytes" => a.max_bytes = parse_size(&value()?)?,
            "-i" | "--stepbytes" => a.step_bytes = parse_size(&value()?)?,
            "-f" | "--stepfactor" => {
                a.step_factor = number(&flag, &value()?)?;
                factor_given = true;
            }
            "-n" | "--iters" => {
                let v = value()?;
                a.iters = if v.eq_ignore_ascii_case("auto") {
                    Iters::Auto
                } else {
                    Iters::Fixed(number(&flag, &v)?)
                };
            }
            "-w" | "--warmup_iters" => a.warmup = number(&flag, &value()?)?,
            "-c" | "--check" => a.check = number::<u32>(&flag, &value()?)? != 0,
            "-o" | "--op" => a.ops = parse_op(&value()?)?,
            "-d" | "--datatype" => a.dtypes = parse_dtype(&value()?)?,
            "-r" | "--root" => {
                let r: i64 = number(&flag, &value()?)?;
                a.root = match r {
                    -1 => None,
                    r if r >= 0 => Some(r as usize),
                    _ => return Err(Error::invalid(format!("-r {r}: a rank, or -1 for all"))),
                };
            }
            "-a" | "--average" => {
                a.average = match number::<u32>(&flag, &value()?)? {
                    0 => Average::Rank0,
                    1 => Average::Mean,
                    2 => Average::Min,
                    3 => Average::Max,
                    v => return Err(Error::invalid(format!("-a {v}: use 0, 1, 2 or 3"))),
                }
            }
            "-N" | "--run_cycles" => a.cycles = number(&flag, &value()?)?,
            "-T" | "--timeout" => a.timeout_secs = number(&flag, &value()?)?,
            "-J" | "--output_file" => a.json = Some(PathBuf::from(value()?)),
            "--csv" => a.csv = Some(PathBuf::from(value()?)),
            "--plot" => a.plot = Some(PathBuf::from(value()?)),
            "--no-progress" => a.progress = false,
            "--memory" => {
                memory_given = true;
                a.memory = match value()?.to_ascii_lowercase().as_str() {
                    "host" => Memory::Host,
                    "cuda" | "device" => Memory::Cuda,
                    v => return Err(Error::invalid(format!("--memory {v:?}: host or cuda"))),
                }
            }
            "--backend" => {
                a.backend = match value()?.to_ascii_lowercase().as_str() {
                    "ferroccl" => Backend::Ferroccl,
                    "nccl" => Backend::Nccl,
                    "both" => Backend::Both,
                    v => {
                        return Err(Error::invalid(format!(
                            "--backend {v:?}: ferroccl, nccl or both"
                        )));
                    }
                }
            }
            "-np" => a.processes = Some(number(&flag, &value()?)?),
            "-t" | "--nthreads" => a.threads = Some(number(&flag, &value()?)?),
            "-m" | "--agg_iters" => {
                if number::<usize>(&flag, &value()?)? != 1 {
                    return Err(Error::Unsupported {
                        what: "-m: aggregating several operations per iteration".into(),
                    });
                }
            }
            "-g" | "--ngpus" => {
                if number::<usize>(&flag, &value()?)? != 1 {
                    return Err(Error::invalid(
                        "-g: ranks run on host memory here; use -np or -t for more ranks",
                    ));
                }
            }
            "-z" | "--blocking" | "-y" | "--stream_null" | "-C" | "--report_cputime" | "-G"
            | "--cudagraph" => {
                number::<i64>(&flag, &value()?)?;
            }
            "-R" | "--local_register" => match number::<u8>(&flag, &value()?)? {
                0 | 1 => a.windows = false,
                2 => a.windows = true,
                other => {
                    return Err(Error::invalid(format!(
                        "{flag} {other}: 0 (plain), 1 (registered) or 2 (windows)"
                    )));
                }
            },
            other => return Err(Error::invalid(format!("unknown option {other:?}"))),
        }
    }
    if !factor_given {
        a.step_factor = 1;
    }
    if a.backend != Backend::Ferroccl {
        if memory_given && a.memory == Memory::Host {
            return Err(Error::invalid(
                "--backend nccl/both runs on device memory: drop --memory host",
            ));
        }
        a.memory = Memory::Cuda;
    }
    a.validate()?;
    Ok(Some(a))
}

impl PerfArgs {
    fn validate(&self) -> Result<()> {
        if self.min_bytes > self.max_bytes {
            return Err(Error::invalid(format!(
                "-b {} is larger than -e {}",
                self.min_bytes, self.max_bytes
            )));
        }
        if self.step_factor == 0 || (self.step_factor == 1 && self.step_bytes == 0) {
            return Err(Error::invalid(
                "-f must be at least 1, and -i positive when -f is 1",
            ));
        }
        if self.iters == Iters::Fixed(0) {
            return Err(Error::invalid("-n 0: at least one timed iteration"));
        }
        if self.cycles == 0 {
            return Err(Error::invalid("-N 0: at least one cycle"));
        }
        if !(self.timeout_secs.is_finite() && self.timeout_secs > 0.0) {
            return Err(Error::invalid("-T: a positive number of seconds"));
        }
        for (flag, n) in [("-np", self.processes), ("-t", self.threads)] {
            if n == Some(0) {
                return Err(Error::invalid(format!("{flag} 0: at least one rank")));
            }
        }
        if self.processes.is_some() && self.threads.is_some() {
            return Err(Error::invalid("-np and -t cannot be combined"));
        }
        Ok(())
    }

    /// The sizes of the sweep, in bytes.
    pub fn sizes(&self) -> Vec<usize> {
        let mut sizes = Vec::new();
        let mut s = self.min_bytes;
        loop {
            sizes.push(s);
            let next = if self.step_factor > 1 {
                s.saturating_mul(self.step_factor)
            } else {
                s.saturating_add(self.step_bytes)
            };
            if next > self.max_bytes || next == s {
                break;
            }
            s = next;
        }
        sizes
    }

    /// `(timed, warm-up)` iterations for a size of `bytes`.
    pub fn iterations(&self, bytes: usize) -> (usize, usize) {
        match self.iters {
            Iters::Fixed(n) => (n, self.warmup),
            Iters::Auto => {
                let n = ((1usize << 30) / bytes.max(1)).clamp(20, 10_000);
                (n, (n / 5).max(5))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_nccl_tests_suffixes_and_byte_units() {
        for (text, bytes) in [
            ("8", 8),
            ("64K", 64 << 10),
            ("128m", 128 << 20),
            ("1G", 1 << 30),
            ("512B", 512),
            ("4KiB", 4 << 10),
            ("2MB", 2 << 20),
            ("1GiB", 1 << 30),
        ] {
            assert_eq!(parse_size(text).unwrap(), bytes, "{text}");
        }
        for bad in ["", "K", "8X", "1.5M", "-1"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    fn p(words: &str) -> Result<Option<PerfArgs>> {
        parse(
            &words
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn nccl_tests_command_lines_parse() {
        let a = p("-b 8 -e 128M -f 4 -g 1 -o all -d bfloat16 -r -1 -a 3 -n auto -c 0 -np 4")
            .unwrap()
            .unwrap();
        assert_eq!((a.min_bytes, a.max_bytes, a.step_factor), (8, 128 << 20, 4));
        assert_eq!(a.ops.len(), 6);
        assert_eq!(a.dtypes, [DataType::Bfloat16]);
        assert_eq!((a.root, a.average, a.check), (None, Average::Max, false));
        assert_eq!(a.processes, Some(4));
        assert_eq!(a.sizes().len(), 13);
        assert_eq!(a.iterations(8), (10_000, 2000));
        let a = p("-b1K -e4K -i 1K --check=1").unwrap().unwrap();
        assert_eq!(a.sizes(), [1024, 2048, 3072, 4096]);
        assert_eq!((a.memory, a.backend), (Memory::Host, Backend::Ferroccl));
        let a = p("--backend both").unwrap().unwrap();
        assert_eq!((a.memory, a.backend), (Memory::Cuda, Backend::Both));
        let a = p("--memory=cuda").unwrap().unwrap();
        assert_eq!((a.memory, a.backend), (Memory::Cuda, Backend::Ferroccl));
    }

    #[test]
    fn bad_flags_say_what_is_wrong() {
        for (words, needle) in [
            ("-b 9 -e 8", "-b 9"),
            ("-d float128", "float128"),
            ("-o mean", "mean"),
            ("-x 1", "-x"),
            ("-n", "needs a value"),
            ("-g 8", "-g"),
            ("-b 12Q", "12Q"),
            ("-np 2 -t 2", "cannot be combined"),
            ("--memory gpu", "--memory"),
            ("--backend mpi", "--backend"),
            ("--backend nccl --memory host", "device memory"),
            // Found by tests/fuzz.rs: a flag whose character is not ASCII used to panic.
            ("-🃑x", "-🃑"),
            ("-é", "-é"),
        ] {
            let err = p(words).unwrap_err().to_string();
            assert!(err.contains(needle), "{words}: {err}");
        }
        assert!(p("-h").unwrap().is_none());
    }
}
