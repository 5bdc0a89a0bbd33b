//! All-reduce throughput over shared memory: `cargo bench --bench allreduce`.
//!
//! Ranks are threads of the bench process, connected through `/dev/shm` FIFOs
//! (`TransportChoice::Shm`), so this measures the same transport and engine as separate processes.
//! Rank 0 runs under criterion; the other ranks run the same number of calls in their own
//! threads. Throughput is algorithm bandwidth (buffer bytes / time); nccl-tests' bus
//! bandwidth is that × 2(n−1)/n.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ferroccl::comm::CommConfig;
use ferroccl::transport::TransportChoice;
use ferroccl::{Communicator, ReduceOp};

const SIZES: [usize; 4] = [8, 64 << 10, 1 << 20, 64 << 20];

fn all_reduce(c: &mut Criterion) {
    for nranks in [2usize, 4] {
        let config = CommConfig {
            transport: TransportChoice::Shm,
            ..CommConfig::default()
        };
        let mut comms = Communicator::init_all_with(nranks, config).unwrap();
        let rank0 = comms.remove(0);
        let mut group = c.benchmark_group(format!("all_reduce_f32_shm_{nranks}ranks"));
        group.sample_size(10).warm_up_time(Duration::from_secs(1));
        std::thread::scope(|s| {
            // Each helper rank waits for (bytes, iterations), runs them, and reports back.
            let (done_tx, done_rx) = mpsc::channel::<()>();
            let helpers: Vec<mpsc::Sender<(usize, u64)>> = comms
                .iter()
                .map(|comm| {
                    let (tx, rx) = mpsc::channel::<(usize, u64)>();
                    let done = done_tx.clone();
                    s.spawn(move || {
                        let (mut send, mut recv) = (Vec::new(), Vec::new());
                        for (bytes, iters) in rx {
                            if send.len() != bytes / 4 {
                                send = vec![1.0f32; bytes / 4];
                                recv = vec![0.0f32; bytes / 4];
                            }
                            for _ in 0..iters {
                                comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                            }
                            done.send(()).unwrap();
                        }
                    });
                    tx
                })
                .collect();
            for bytes in SIZES {
                let send = vec![1.0f32; bytes / 4];
                let mut recv = vec![0.0f32; bytes / 4];
                group.throughput(Throughput::Bytes(bytes as u64));
                group.measurement_time(if bytes >= 1 << 26 {
                    Duration::from_secs(8)
                } else {
                    Duration::from_secs(3)
                });
                group.bench_function(BenchmarkId::from_parameter(bytes), |b| {
                    b.iter_custom(|iters| {
                        for h in &helpers {
                            h.send((bytes, iters)).unwrap();
                        }
                        let start = Instant::now();
                        for _ in 0..iters {
                            rank0.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                        }
                        for _ in &helpers {
                            done_rx.recv().unwrap();
                        }
                        start.elapsed()
                    })
                });
                assert!(recv.iter().all(|&v| v == nranks as f32));
            }
            drop(helpers);
        });
        group.finish();
    }
}

criterion_group!(benches, all_reduce);
criterion_main!(benches);
