//! What the machine itself allows a collective on one host: the two reference columns
//! of `tools/compare` that are not libraries.
//!
//! - **Small-message floor** ([`one_way_latency`]): the time a cache line takes to
//!   travel from one core to another, measured as half the round trip of a spin-flag
//!   ping-pong between two threads pinned to the first two CPUs this process may use
//!   (where local ranks 0 and 1 are bound). An all-reduce of n ranks cannot finish
//!   sooner than one such hand-off.
//! - **Large-message bound** ([`memory_bandwidth`], [`all_reduce_bound`]): the bytes an
//!   out-of-place all-reduce must move through memory, at the read+write bandwidth that
//!   as many concurrent workers as there are ranks (at most one per CPU) reach on
//!   buffers far larger than the caches. Each rank reads its block of every input and
//!   writes the reduced block (`S` read … `S/n` written), then reads the other blocks
//!   of the result and writes them: about `(2n−1)/n·S` read and `S` written per rank
//!   for a buffer of `S` bytes, `(3n−1)·S` over all ranks. The workers copy
//!   ([`Pass::Copy`]) and, separately, reduce in place ([`Pass::Reduce`]); the bound
//!   takes the better of the two, because neither alone is what memory gives: on the
//!   project's VM with its two vCPUs near each other, two reductions moved 67 GB/s
//!   where two copies moved 44–58 (2026-11-28), and an all-reduce exceeded a bound
//!   taken from copies alone.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::reduce::Kernel;
use crate::types::{DataType, ReduceOp};

/// A counter alone on its cache line (so the two flags never share one).
#[repr(align(128))]
#[derive(Default)]
struct Line(AtomicU64);

/// One-way latency of a cache line between the first two CPUs this process may use:
/// half the median round trip of `rounds` spin-flag ping-pongs, after a tenth as many
/// for warm-up. Needs two CPUs (with one, the threads would take turns on it and the
/// figure would be the scheduler's, not the hardware's).
pub fn one_way_latency(rounds: u64) -> Result<Duration> {
    let cpus = crate::topo::available_cpus()?;
    if cpus.len() < 2 {
        return Err(Error::invalid(format!(
            "the cache-line floor needs two CPUs; this process may use {}",
            cpus.len()
        )));
    }
    let rounds = rounds.max(10);
    let flags = Arc::new([Line::default(), Line::default()]);
    let echo = {
        let flags = flags.clone();
        let cpu = cpus[1];
        std::thread::spawn(move || -> Result<()> {
            crate::topo::pin_thread_to(cpu)?;
            let total = rounds + rounds / 10;
            for i in 1..=total {
                while flags[0].0.load(Ordering::Acquire) != i {
                    std::hint::spin_loop();
                }
                flags[1].0.store(i, Ordering::Release);
            }
            Ok(())
        })
    };
    // The timing side runs on a thread of its own too, so the caller stays unpinned.
    let ping = {
        let cpu = cpus[0];
        std::thread::spawn(move || -> Result<Vec<Duration>> {
            crate::topo::pin_thread_to(cpu)?;
            // Rounds are timed in batches of 100 (a clock read costs about a round).
            let mut batches = Vec::new();
            let mut batch_start = Instant::now();
            let warm = rounds / 10;
            for i in 1..=rounds + warm {
                if i > warm && (i - warm) % 100 == 1 {
                    batch_start = Instant::now();
                }
                flags[0].0.store(i, Ordering::Release);
                while flags[1].0.load(Ordering::Acquire) != i {
                    std::hint::spin_loop();
                }
                if i > warm && (i - warm).is_multiple_of(100) {
                    batches.push(batch_start.elapsed() / 100);
                }
            }
            Ok(batches)
        })
    };
    let mut batches = ping.join().expect("ping-pong thread panicked")?;
    echo.join().expect("ping-pong thread panicked")?;
    batches.sort_unstable();
    let median = batches.get(batches.len() / 2).copied().unwrap_or_default();
    Ok(median / 2)
}

/// What each worker of [`memory_bandwidth`] does to its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// `dst = src` (`memcpy`): each byte read once and written once.
    Copy,
    /// `dst += src` over `f32`, an all-reduce's inner loop: each byte of `src` and `dst`
    /// read and each of `dst` written.
    Reduce,
}

impl Pass {
    /// Bytes through memory per byte of buffer.
    fn traffic(self) -> usize {
        match self {
            Pass::Copy => 2,
            Pass::Reduce => 3,
        }
    }

    /// Runs the pass once over `dst` and `src` (of equal lengths); a reduction runs the
    /// engine's own kernel.
    fn run(self, dst: &mut [f32], src: &[f32]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "a pass over buffers of different lengths"
        );
        match self {
            Pass::Copy => dst.copy_from_slice(src),
            Pass::Reduce => {
                let sum = Kernel::new(DataType::Float32, ReduceOp::Sum, 1)
                    .expect("a sum of float32 is a valid kernel");
                let d = dst.as_mut_ptr().cast::<u8>();
                // SAFETY: the kernel's dtype is f32; `dst` and `src` hold `dst.len()`
                // elements each (checked above), and `dst` is passed as its own first
                // operand, which the kernel allows (exactly equal, not overlapping
                // `src`: the borrows are distinct).
                unsafe { sum.reduce(d, d, src.as_ptr().cast(), dst.len()) };
            }
        }
    }
}

/// Read+write bandwidth in GB/s (bytes through memory / time, summed over workers) of
/// `workers` threads, each pinned to its own CPU (in the order ranks are bound) and
/// running `pass` over its own two buffers of `bytes` bytes, best of `reps` timed rounds
/// in which all run at once.
pub fn memory_bandwidth(pass: Pass, workers: usize, bytes: usize, reps: usize) -> Result<f64> {
    let cpus = crate::topo::available_cpus()?;
    if workers == 0 || workers > cpus.len() {
        return Err(Error::invalid(format!(
            "memory bandwidth: {workers} workers on {} available CPUs (one per CPU)",
            cpus.len()
        )));
    }
    let reps = reps.max(1);
    let elems = bytes / size_of::<f32>();
    let start = Arc::new(Barrier::new(workers + 1));
    let end = Arc::new(Barrier::new(workers + 1));
    let threads: Vec<_> = cpus[..workers]
        .iter()
        .map(|&cpu| {
            let (start, end) = (start.clone(), end.clone());
            std::thread::spawn(move || -> Result<()> {
                crate::topo::pin_thread_to(cpu)?;
                // First touch on the worker's own CPU (its NUMA node), every page.
                let src = vec![1.0f32; elems];
                let mut dst = vec![2.0f32; elems];
                pass.run(&mut dst, &src);
                for _ in 0..reps {
                    start.wait();
                    pass.run(&mut dst, black_box(&src));
                    black_box(&mut dst);
                    end.wait();
                }
                Ok(())
            })
        })
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        start.wait();
        let t = Instant::now();
        end.wait();
        best = best.min(t.elapsed().as_secs_f64());
    }
    for t in threads {
        t.join().expect("memory bandwidth thread panicked")?;
    }
    let moved = pass.traffic() * workers * elems * size_of::<f32>();
    Ok(moved as f64 / best / 1e9)
}

/// Bytes an out-of-place all-reduce of `bytes` per rank moves through memory on
/// `nranks` ranks, all ranks together: each reads `(2n−1)/n` of the buffer and writes
/// all of it.
pub fn all_reduce_traffic(bytes: usize, nranks: usize) -> f64 {
    let (s, n) = (bytes as f64, nranks as f64);
    n * ((2.0 * n - 1.0) / n * s + s)
}

/// The shortest time (seconds) an all-reduce of `bytes` on `nranks` ranks can take at
/// `rw_gbps` of read+write bandwidth ([`memory_bandwidth`]).
pub fn all_reduce_bound(bytes: usize, nranks: usize, rw_gbps: f64) -> f64 {
    all_reduce_traffic(bytes, nranks) / (rw_gbps * 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_traffic_counts_each_ranks_reads_and_writes() {
        // 2 ranks: each reads 1.5 S and writes S.
        assert_eq!(all_reduce_traffic(1000, 2), 5000.0);
        // 4 ranks: each reads 1.75 S and writes S.
        assert_eq!(all_reduce_traffic(1000, 4), 11000.0);
        // At 10 GB/s read+write, 5 GB of traffic takes half a second.
        assert!((all_reduce_bound(1_000_000_000, 2, 10.0) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn workers_beyond_the_cpus_are_refused_by_name() {
        let cpus = crate::topo::available_cpus().unwrap().len();
        for pass in [Pass::Copy, Pass::Reduce] {
            let e = memory_bandwidth(pass, cpus + 1, 4096, 1)
                .unwrap_err()
                .to_string();
            assert!(e.contains("workers"), "{e}");
            assert!(memory_bandwidth(pass, 0, 4096, 1).is_err());
            // A small pass measures something positive and finite.
            let bw = memory_bandwidth(pass, 1, 1 << 20, 2).unwrap();
            assert!(bw.is_finite() && bw > 0.0, "{pass:?}: {bw}");
        }
    }

    #[test]
    fn the_passes_do_what_they_say() {
        let src = [1.0f32, 2.0, 3.0];
        let mut dst = [10.0f32, 20.0, 30.0];
        Pass::Reduce.run(&mut dst, &src);
        assert_eq!(dst, [11.0, 22.0, 33.0]);
        Pass::Copy.run(&mut dst, &src);
        assert_eq!(dst, src);
        assert_eq!((Pass::Copy.traffic(), Pass::Reduce.traffic()), (2, 3));
    }
}
