//! nccl-tests-compatible bus-bandwidth sweeps: the engine of the `*_perf` tools.
//!
//! Each tool (`all_reduce_perf`, `all_gather_perf`, …) runs one [`Test`] over a range
//! of sizes, data types, ops and roots, times out-of-place and in-place calls, checks
//! every result against the serial reference of [`check`] (`-c 1`), and prints the same
//! columns as nccl-tests:
//!
//! ```text
//! #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
//! ```
//!
//! `algbw = size / time`; `busbw = algbw × factor` with nccl-tests' factors
//! ([`Test::bus_factor`]): the bandwidth each rank's links would need for the algorithm
//! that moves the least data, so numbers compare across rank counts and libraries.
//! Ranks come from `-np N` (processes over `/dev/shm`, started through
//! [`crate::launch`]), `-t N` (threads), or the environment of a launcher.

pub mod args;
pub mod check;
mod device;
pub mod limits;
mod report;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use args::Memory;
pub use args::{Average, PerfArgs};
pub use report::{Measure, Row};

use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, Result};
use crate::launch::{self, LocalJob};
use crate::plan::Collective;
use crate::transport::window::{SharedMemory, Window};
use crate::types::{Element, ReduceOp};

/// Environment variable of the test hook that corrupts one output element on rank 0
/// before it is checked, to show that `-c 1` catches wrong results.
pub const CORRUPT_HOOK: &str = "FERROCCL_PERF_CORRUPT";

/// One of the nccl-tests programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Test {
    /// `all_reduce_perf`.
    AllReduce,
    /// `all_gather_perf`.
    AllGather,
    /// `broadcast_perf`.
    Broadcast,
    /// `reduce_perf`.
    Reduce,
    /// `reduce_scatter_perf`.
    ReduceScatter,
    /// `alltoall_perf`.
    AllToAll,
    /// `sendrecv_perf`: every rank sends to the next and receives from the previous.
    SendRecv,
    /// `gather_perf`.
    Gather,
    /// `scatter_perf`.
    Scatter,
}

impl Test {
    /// Every test.
    pub const ALL: [Test; 9] = [
        Test::AllReduce,
        Test::AllGather,
        Test::Broadcast,
        Test::Reduce,
        Test::ReduceScatter,
        Test::AllToAll,
        Test::SendRecv,
        Test::Gather,
        Test::Scatter,
    ];

    /// The program's name.
    pub fn program(&self) -> &'static str {
        match self {
            Test::AllReduce => "all_reduce_perf",
            Test::AllGather => "all_gather_perf",
            Test::Broadcast => "broadcast_perf",
            Test::Reduce => "reduce_perf",
            Test::ReduceScatter => "reduce_scatter_perf",
            Test::AllToAll => "alltoall_perf",
            Test::SendRecv => "sendrecv_perf",
            Test::Gather => "gather_perf",
            Test::Scatter => "scatter_perf",
        }
    }

    /// Whether the test takes a reduction op.
    pub fn reduces(&self) -> bool {
        matches!(self, Test::AllReduce | Test::Reduce | Test::ReduceScatter)
    }

    /// Whether the test has a root.
    pub fn rooted(&self) -> bool {
        matches!(
            self,
            Test::Broadcast | Test::Reduce | Test::Gather | Test::Scatter
        )
    }

    /// Whether an in-place form exists (not for all-to-all and send/receive, whose
    /// in-place forms would read data already overwritten).
    pub fn has_in_place(&self) -> bool {
        !matches!(self, Test::AllToAll | Test::SendRecv)
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks: all-reduce 2(n−1)/n;
    /// all-gather, reduce-scatter, all-to-all, gather, scatter (n−1)/n; broadcast,
    /// reduce, send/receive 1.
    pub fn bus_factor(&self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Test::AllReduce => 2.0 * (n - 1.0) / n,
            Test::AllGather
            | Test::ReduceScatter
            | Test::AllToAll
            | Test::Gather
            | Test::Scatter => (n - 1.0) / n,
            Test::Broadcast | Test::Reduce | Test::SendRecv => 1.0,
        }
    }

    /// For a requested size of `bytes`: the count argument of the call and the size it
    /// really moves (as nccl-tests, the total buffer for the block collectives, rounded
    /// down to a whole number of elements per rank).
    pub fn shape(&self, bytes: usize, elem: usize, n: usize) -> (usize, usize) {
        match self {
            Test::AllReduce | Test::Broadcast | Test::Reduce | Test::SendRecv => {
                let count = bytes / elem;
                (count, count * elem)
            }
            _ => {
                let count = bytes / (elem * n);
                (count, count * elem * n)
            }
        }
    }

    fn collective(&self, root: usize) -> Collective {
        match self {
            Test::AllReduce => Collective::AllReduce,
            Test::AllGather => Collective::AllGather,
            Test::Broadcast => Collective::Broadcast { root },
            Test::Reduce => Collective::Reduce { root },
            Test::ReduceScatter => Collective::ReduceScatter,
            Test::AllToAll => Collective::AllToAll,
            Test::Gather => Collective::Gather { root },
            Test::Scatter => Collective::Scatter { root },
            Test::SendRecv => Collective::Send { peer: 0 },
        }
    }

    /// The algorithm a call of `count` elements of `elem` bytes uses (on device memory
    /// when `device`), for the report.
    fn algorithm(&self, comm: &Communicator, count: usize, elem: usize, device: bool) -> String {
        match self {
            Test::AllToAll | Test::Gather | Test::Scatter => "direct".into(),
            Test::SendRecv => "p2p".into(),
            _ if device => {
                let choice = comm.device_choice_for(self.collective(0), count * elem);
                let channels = comm.device_tuning().channels;
                format!("{}/{channels}ch", choice.name())
            }
            _ => {
                let choice = comm.choice_for(self.collective(0), count * elem);
                format!("{}/{}ch", choice.name(), comm.config().channels)
            }
        }
    }
}

/// The `main` of a perf tool.
pub fn main(test: Test) -> ExitCode {
    crate::trace::init_from_env();
    let name = test.program();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match args::parse(&argv) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("usage: {name} {}", args::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{name}: {e}\n\nusage: {name} {}", args::USAGE);
            return ExitCode::from(2);
        }
    };
    match run(test, &args, &argv) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs the tool with parsed arguments; returns the exit code (1 if any result was
/// wrong).
pub fn run(test: Test, args: &PerfArgs, argv: &[String]) -> Result<u8> {
    let mut config = CommConfig::from_env()?;
    config.timeout = Duration::from_secs_f64(args.timeout_secs);
    if std::env::var_os("RANK").is_some()
        || std::env::var_os("SLURM_PROCID").is_some()
        || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
    {
        if args.memory == Memory::Cuda {
            device::bind_rank_gpu(crate::bootstrap::LaunchEnv::from_env()?.rank)?;
        }
        let comm = Communicator::from_env_with(config)?;
        return Ok(u8::from(run_rank(&comm, test, args)? > 0));
    }
    if let Some(np) = args.processes {
        let exe = std::env::current_exe()
            .map_err(|e| Error::io("find this program to start its ranks", e))?;
        let mut program = vec![exe.to_string_lossy().into_owned()];
        let mut rest = argv.iter();
        while let Some(a) = rest.next() {
            if a == "-np" {
                rest.next();
            } else {
                program.push(a.clone());
            }
        }
        let mut job = LocalJob::single_node(test.program(), program, np);
        job.bind = crate::launch::CpuBind::from_env()?;
        job.prefix = false;
        return launch::run(&job);
    }
    let bind = |rank: usize| match args.memory {
        Memory::Cuda => device::bind_rank_gpu(rank).map(|_| ()),
        Memory::Host => Ok(()),
    };
    let comms = Communicator::init_all_on(args.threads.unwrap_or(1), config, &bind)?;
    let wrong = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| s.spawn(move || run_rank(c, test, args)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect::<Result<Vec<u64>>>()
    })?;
    Ok(u8::from(wrong.iter().any(|&w| w > 0)))
}

/// Runs the sweep as one rank; rank 0 prints. Returns the number of wrong elements over
/// all ranks.
pub fn run_rank(comm: &Communicator, test: Test, args: &PerfArgs) -> Result<u64> {
    if args.memory == Memory::Host {
        return Ok(sweep(comm, test, args, &Target::Host)?.1);
    }
    let rank = device::DeviceRank::new(comm, args)?;
    let mut wrong = 0;
    let mut sweeps = Vec::new();
    for backend in rank.backends() {
        let (rows, w) = sweep(comm, test, args, &Target::Device(&rank, backend))?;
        wrong += w;
        sweeps.push((backend, rows));
    }
    if comm.rank() == 0 && sweeps.len() > 1 {
        print!("{}", device::comparison(&sweeps));
    }
    Ok(wrong)
}

/// Where and on what a sweep runs.
enum Target<'a> {
    /// Host memory, ferroccl.
    Host,
    /// Device memory, on this rank's GPU, with one library.
    Device(&'a device::DeviceRank<'a>, device::Library),
}

/// One sweep over the sizes, types, ops and roots: its rows and wrong elements.
fn sweep(
    comm: &Communicator,
    test: Test,
    args: &PerfArgs,
    target: &Target,
) -> Result<(Vec<Row>, u64)> {
    let (rank, n) = (comm.rank(), comm.size());
    let lead = rank == 0;
    let roots: Vec<usize> = match (test.rooted(), args.root) {
        (false, _) => vec![0],
        (true, Some(r)) if r >= n => {
            return Err(Error::invalid(format!("-r {r}: the job has ranks 0..{n}")));
        }
        (true, Some(r)) => vec![r],
        (true, None) => (0..n).collect(),
    };
    let ops: Vec<Option<ReduceOp>> = if test.reduces() {
        args.ops.iter().copied().map(Some).collect()
    } else {
        vec![None]
    };
    let sizes = args.sizes();
    let total = args.cycles * args.dtypes.len() * ops.len() * roots.len() * sizes.len();
    let progress = lead && args.progress && std::io::stderr().is_terminal();
    if lead {
        print!("{}", report::header(test, args, comm));
        if let Target::Device(d, library) = target {
            println!("{}", d.describe(*library));
        }
    }
    let mut rows = Vec::with_capacity(total);
    for _cycle in 0..args.cycles {
        for &dtype in &args.dtypes {
            for &op in &ops {
                for &root in &roots {
                    for &bytes in &sizes {
                        if progress {
                            eprint!(
                                "\r{}: {}/{total}  {bytes} B {dtype} {}   ",
                                test.program(),
                                rows.len() + 1,
                                op.map_or("", |o| o.name())
                            );
                        }
                        let row = crate::with_element_type!(dtype, T => {
                            measure::<T>(comm, test, op, root, bytes, args, target)
                        })?;
                        if lead {
                            println!("{}", report::row_line(&row));
                        }
                        rows.push(row);
                    }
                }
            }
        }
    }
    if progress {
        eprint!("\r{:60}\r", "");
    }
    let wrong: u64 = rows.iter().map(Row::wrong).sum();
    if lead {
        print!("{}", report::footer(&rows, args.check));
        report::write_outputs(test, args, comm, &rows)?;
    }
    Ok((rows, wrong))
}

/// A buffer's elements: on the heap, or in a window of shared memory (`-R 2`).
enum Elements<T> {
    Heap(Vec<T>),
    Window {
        memory: SharedMemory,
        window: Window,
        len: usize,
        _elements: std::marker::PhantomData<T>,
    },
}

impl<T> std::ops::Deref for Elements<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Elements::Heap(v) => v,
            // SAFETY: `len` elements fit the allocation (made for them, page-aligned, so
            // aligned for T), zeroed at first and written only as T since; every
            // element type is plain numbers, for which any bytes are a value.
            Elements::Window { memory, len, .. } => unsafe {
                std::slice::from_raw_parts(memory.as_ptr().cast::<T>(), *len)
            },
        }
    }
}

impl<T> std::ops::DerefMut for Elements<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Elements::Heap(v) => v,
            // SAFETY: as in `deref`, borrowed exclusively through `self`.
            Elements::Window { memory, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(memory.as_ptr().cast::<T>(), *len)
            },
        }
    }
}

/// Where a call's input and output live.
struct Buffers<T> {
    mem: Elements<T>,
    input_at: usize,
    output_at: usize,
    in_len: usize,
    out_len: usize,
}

impl<T: Element + Default> Buffers<T> {
    /// Separate input and output, or one buffer laid out as NCCL's in-place call.
    fn new(c: Collective, count: usize, rank: usize, n: usize, in_place: bool) -> Self {
        let (in_len, out_len) = match c {
            Collective::Send { .. } => (count, count),
            _ => c.buffer_lens(count, rank, n),
        };
        let (len, input_at, output_at) = if !in_place {
            (in_len + out_len, 0, in_len)
        } else {
            match (
                c.input_in_output(count, rank),
                c.output_in_input(count, rank),
            ) {
                (_, Some(at)) => (in_len, 0, at),
                (Some(at), _) => (out_len.max(at + in_len), at, 0),
                (None, None) => (in_len.max(out_len), 0, 0),
            }
        };
        Buffers {
            mem: Elements::Heap(vec![T::default(); len]),
            input_at,
            output_at,
            in_len,
            out_len,
        }
    }

    /// The same buffer in a window of `comm`'s (collective): `-R 2`.
    fn into_window(self, comm: &Communicator) -> Result<Self> {
        let len = self.mem.len();
        let bytes = len * std::mem::size_of::<T>();
        let memory = SharedMemory::new(bytes)?;
        // SAFETY: the memory lives as long as the window (both in `Elements`), and this
        // rank passes it only to this communicator's calls.
        let window = unsafe { comm.register_window(memory.as_ptr(), bytes) }?;
        Ok(Buffers {
            mem: Elements::Window {
                memory,
                window,
                len,
                _elements: std::marker::PhantomData,
            },
            ..self
        })
    }

    /// Deregisters the window, if any (collective, as registering was).
    fn release(self, comm: &Communicator) -> Result<()> {
        match self.mem {
            Elements::Heap(_) => Ok(()),
            Elements::Window { window, .. } => comm.deregister_window(window),
        }
    }

    fn fill_input(&mut self, values: &[T]) {
        self.mem.fill(T::default());
        self.mem[self.input_at..self.input_at + self.in_len].copy_from_slice(values);
    }

    fn output(&self) -> &[T] {
        &self.mem[self.output_at..self.output_at + self.out_len]
    }
}

/// Measures one size: out of place, then in place.
fn measure<T: Element + Default>(
    comm: &Communicator,
    test: Test,
    op: Option<ReduceOp>,
    root: usize,
    bytes: usize,
    args: &PerfArgs,
    target: &Target,
) -> Result<Row> {
    let (rank, n) = (comm.rank(), comm.size());
    let elem = std::mem::size_of::<T>();
    let (count, size) = test.shape(bytes, elem, n);
    let c = test.collective(root);
    let call = Call {
        test,
        c,
        op,
        count,
        size,
    };
    // On host memory, the choice while the buffers are in place (windows change it).
    let mut algorithm = None;
    let mut mode = |in_place: bool| match target {
        Target::Host => run_mode::<T>(comm, &call, in_place, args, &mut algorithm),
        Target::Device(d, library) => d.run_mode::<T>(*library, &call, in_place, args),
    };
    let mut modes = vec![mode(false)?];
    if test.has_in_place() {
        modes.push(mode(true)?);
    }
    let in_place = if modes.len() > 1 { modes.pop() } else { None };
    Ok(Row {
        size,
        count: size / elem,
        dtype: T::DTYPE,
        op,
        root: test.rooted().then_some(root),
        out_of_place: modes.pop().expect("out-of-place measured"),
        in_place,
        algorithm: algorithm.unwrap_or_else(|| match target {
            // NCCL chooses inside itself, and says nothing of it.
            Target::Device(_, device::Library::Nccl) => "(nccl)".into(),
            _ => test.algorithm(comm, count, elem, matches!(target, Target::Device(..))),
        }),
        rank,
    })
}

/// One size of one test, as both kinds of memory run it.
struct Call {
    test: Test,
    c: Collective,
    op: Option<ReduceOp>,
    count: usize,
    size: usize,
}

/// Checks (with `-c 1`) and times one mode of one size on host memory.
fn run_mode<T: Element + Default>(
    comm: &Communicator,
    call: &Call,
    in_place: bool,
    args: &PerfArgs,
    algorithm: &mut Option<String>,
) -> Result<Measure> {
    let (rank, n) = (comm.rank(), comm.size());
    let Call {
        test, c, op, count, ..
    } = *call;
    let mut bufs = Buffers::<T>::new(c, count, rank, n, in_place);
    if args.windows {
        bufs = bufs.into_window(comm)?;
    }
    let run = |bufs: &mut Buffers<T>| -> Result<()> {
        let base = bufs.mem.as_mut_ptr();
        if test == Test::SendRecv {
            let (input, output) = bufs.mem.split_at_mut(bufs.output_at);
            let mut g = comm.group();
            g.send(&input[..count], (rank + 1) % n)?;
            g.recv(&mut output[..count], (rank + n - 1) % n)?;
            return g.end();
        }
        // SAFETY: the buffer holds both regions at the offsets the collective's layout
        // prescribes (Buffers::new), and is borrowed mutably for the call.
        unsafe {
            comm.collective_raw(
                c,
                count,
                T::DTYPE,
                op.unwrap_or(ReduceOp::Sum),
                base.add(bufs.input_at) as *const u8,
                base.add(bufs.output_at) as *mut u8,
            )
        }
    };
    let mut wrong = None;
    if args.check {
        bufs.fill_input(&call.input::<T>(rank, n, bufs.in_len));
        run(&mut bufs)?;
        wrong = Some(call.count_wrong(comm, &mut bufs)?);
    }
    bufs.mem.fill(T::default());
    let measured = call.time(comm, args, || run(&mut bufs), || Ok(()))?;
    *algorithm = Some(test.algorithm(comm, count, std::mem::size_of::<T>(), false));
    bufs.release(comm)?;
    Ok(Measure { wrong, ..measured })
}

impl Call {
    /// Rank `rank`'s input of `len` elements (values the check can verify).
    fn input<T: Element>(&self, rank: usize, n: usize, len: usize) -> Vec<T> {
        let data_op = self.test.reduces().then_some(self.op).flatten();
        check::input::<T>(data_op, n, rank, len)
    }

    /// Wrong elements of the output in `bufs`, over all ranks.
    fn count_wrong<T: Element + Default>(
        &self,
        comm: &Communicator,
        bufs: &mut Buffers<T>,
    ) -> Result<u64> {
        let (rank, n) = (comm.rank(), comm.size());
        if rank == 0 && bufs.out_len > 0 && std::env::var_os(CORRUPT_HOOK).is_some() {
            // Test hook: make one element wrong so that the check must notice.
            let at = bufs.output_at;
            bufs.mem[at] = T::from_f64(bufs.mem[at].to_f64() + 1.0);
        }
        let want = if self.test == Test::SendRecv {
            Some(check::input::<T>(None, n, (rank + n - 1) % n, self.count))
        } else {
            check::expected::<T>(
                self.c,
                self.op.unwrap_or(ReduceOp::Sum),
                self.count,
                n,
                rank,
            )
        };
        let mine = want.map_or(0, |want| {
            want.iter()
                .zip(bufs.output())
                .filter(|(w, g)| w != g)
                .count() as u64
        });
        let mut all = [mine];
        comm.all_reduce_in_place(&mut all, ReduceOp::Sum)?;
        Ok(all[0])
    }

    /// Times `run` (after warm-up; `finish` waits for what `run` only enqueued) and
    /// combines the ranks' times as `-a` asks.
    fn time(
        &self,
        comm: &Communicator,
        args: &PerfArgs,
        mut run: impl FnMut() -> Result<()>,
        finish: impl Fn() -> Result<()>,
    ) -> Result<Measure> {
        let (iters, warmup) = args.iterations(self.size);
        for _ in 0..warmup {
            run()?;
        }
        finish()?;
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            run()?;
        }
        finish()?;
        let mine = start.elapsed().as_secs_f64() / iters as f64;
        let seconds = across_ranks(comm, mine, args.average)?;
        let algbw = if seconds > 0.0 {
            self.size as f64 / seconds / 1e9
        } else {
            0.0
        };
        Ok(Measure {
            time_us: seconds * 1e6,
            algbw,
            busbw: algbw * self.test.bus_factor(comm.size()),
            wrong: None,
        })
    }
}

/// Combines the ranks' times as `-a` asks.
fn across_ranks(comm: &Communicator, seconds: f64, how: Average) -> Result<f64> {
    let mut v = [seconds];
    match how {
        Average::Rank0 => comm.broadcast_in_place(&mut v, 0)?,
        Average::Mean => {
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            v[0] /= comm.size() as f64;
        }
        Average::Min => comm.all_reduce_in_place(&mut v, ReduceOp::Min)?,
        Average::Max => comm.all_reduce_in_place(&mut v, ReduceOp::Max)?,
    }
    Ok(v[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(Test::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Test::AllGather.bus_factor(4), 0.75);
        assert_eq!(Test::Broadcast.bus_factor(4), 1.0);
        assert_eq!(Test::SendRecv.bus_factor(8), 1.0);
        assert_eq!(Test::AllToAll.shape(1000, 4, 3), (83, 996));
        assert_eq!(Test::AllReduce.shape(1001, 4, 3), (250, 1000));
    }
}
