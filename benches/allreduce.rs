//! All-reduce throughput over shared memory: `cargo bench --bench allreduce`.
//!
//! Ranks are threads of the bench process, connected through `/dev/shm` FIFOs
//! (`TransportChoice::Shm`), so this measures the same transport and engine as separate processes.
//! Rank 0 runs under criterion; the other ranks run the same number of calls in their own
//! threads. Throughput is algorithm bandwidth (buffer bytes / time); nccl-tests' bus
//! bandwidth is that × 2(n−1)/n.
//!
//! `all_reduce_f32_shm_2ranks_alternating` times calls of two sizes in turn, as a training
//! step's loss and gradient buckets are: one iteration is one call of each.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ferroccl::comm::CommConfig;
use ferroccl::transport::TransportChoice;
use ferroccl::{Communicator, ReduceOp};

const SIZES: [usize; 4] = [8, 64 << 10, 1 << 20, 64 << 20];

/// Pairs of sizes (bytes) called in turn.
const ALTERNATING: [[usize; 2]; 2] = [[8, 16], [8, 64 << 10]];

/// Buffers for calls of each of `sizes` (bytes), all ones.
fn buffers(sizes: &[usize]) -> Vec<(Vec<f32>, Vec<f32>)> {
    sizes
        .iter()
        .map(|&bytes| (vec![1.0f32; bytes / 4], vec![0.0f32; bytes / 4]))
        .collect()
}

/// One iteration: an all-reduce of each buffer in turn.
fn all_reduce_each(comm: &Communicator, buffers: &mut [(Vec<f32>, Vec<f32>)]) {
    for (send, recv) in buffers {
        comm.all_reduce(send, recv, ReduceOp::Sum).unwrap();
    }
}

/// Runs `bench` with rank 0 of `nranks` in this thread and the other ranks in helper
/// threads; `bench` gets a function that times `iters` iterations over the given sizes
/// on every rank.
fn with_ranks(nranks: usize, bench: impl FnOnce(&dyn Fn(&[usize], u64) -> Duration)) {
    let config = CommConfig {
        transport: TransportChoice::Shm,
        ..CommConfig::default()
    };
    let mut comms = Communicator::init_all_with(nranks, config).unwrap();
    let rank0 = comms.remove(0);
    std::thread::scope(|s| {
        // Each helper rank waits for (sizes, iterations), runs them, and reports back.
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let helpers: Vec<mpsc::Sender<(Vec<usize>, u64)>> = comms
            .iter()
            .map(|comm| {
                let (tx, rx) = mpsc::channel::<(Vec<usize>, u64)>();
                let done = done_tx.clone();
                s.spawn(move || {
                    for (sizes, iters) in rx {
                        let mut bufs = buffers(&sizes);
                        for _ in 0..iters {
                            all_reduce_each(comm, &mut bufs);
                        }
                        done.send(()).unwrap();
                    }
                });
                tx
            })
            .collect();
        let time = |sizes: &[usize], iters: u64| {
            for h in &helpers {
                h.send((sizes.to_vec(), iters)).unwrap();
            }
            let mut bufs = buffers(sizes);
            let start = Instant::now();
            for _ in 0..iters {
                all_reduce_each(&rank0, &mut bufs);
            }
            for _ in &helpers {
                done_rx.recv().unwrap();
            }
            let elapsed = start.elapsed();
            for (_, recv) in &bufs {
                assert!(recv.iter().all(|&v| v == nranks as f32));
            }
            elapsed
        };
        bench(&time);
        drop(helpers);
    });
}

fn all_reduce(c: &mut Criterion) {
    for nranks in [2usize, 4] {
        let mut group = c.benchmark_group(format!("all_reduce_f32_shm_{nranks}ranks"));
        group.sample_size(10).warm_up_time(Duration::from_secs(1));
        with_ranks(nranks, |time| {
            for bytes in SIZES {
                group.throughput(Throughput::Bytes(bytes as u64));
                group.measurement_time(if bytes >= 1 << 26 {
                    Duration::from_secs(8)
                } else {
                    Duration::from_secs(3)
                });
                group.bench_function(BenchmarkId::from_parameter(bytes), |b| {
                    b.iter_custom(|iters| time(&[bytes], iters))
                });
            }
        });
        group.finish();
    }
}

fn all_reduce_alternating(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_f32_shm_2ranks_alternating");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    with_ranks(2, |time| {
        for sizes in ALTERNATING {
            let name = format!("{}+{}", sizes[0], sizes[1]);
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| time(&sizes, iters))
            });
        }
    });
    group.finish();
}

criterion_group!(benches, all_reduce, all_reduce_alternating);
criterion_main!(benches);
