//! The direct algorithms (one-shot, two-shot) and deterministic mode, on ranks that are
//! threads:
//!
//! - each direct algorithm forced on every rank count, over the integer grid of
//!   `tests/collectives.rs` (every dtype and op, counts 0 to 65 537, in place and out);
//! - with random floats, every algorithm × protocol gives every rank of an all-reduce
//!   the same bits;
//! - in deterministic mode, all-reduce, reduce-scatter and reduce give the bits of a
//!   serial left fold in rank order (computed with the host kernels) whatever the
//!   algorithms allowed, the protocol, the chunk size and the channel count — and the
//!   ring, outside deterministic mode, does not (so the comparison can fail).

mod common;

use std::time::Duration;

use ferroccl::comm::CommConfig;
use ferroccl::plan::{Algorithm, Collective};
use ferroccl::reduce::{Kernel, post_slice, pre_slice, reduce_slice};
use ferroccl::transport::Protocol;
use ferroccl::types::Scalar;
use ferroccl::{Communicator, DataType, Element, ReduceOp};

const COUNTS: [usize; 6] = [0, 1, 2, 7, 1023, 65_537];
const FLOATS: [DataType; 4] = [
    DataType::Float16,
    DataType::Bfloat16,
    DataType::Float32,
    DataType::Float64,
];

/// Small slots and chunks, so that 65 537 elements take many slices, chunks and
/// iterations.
fn config(algorithms: &[Algorithm], channels: usize, chunk_bytes: usize) -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(120),
        channels,
        slot_bytes: 16 << 10,
        chunk_bytes,
        algorithms: algorithms.to_vec(),
        ..CommConfig::default()
    }
}

/// Runs `f` on every rank (one thread each), returning the ranks' results in order.
fn on_ranks<R: Send>(comms: &[Communicator], f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Uniform random floats in (-1, 1) with all their mantissa bits, different per rank
/// and seed, so that the order of additions shows in the last bits.
fn random<T: Element>(rank: usize, seed: u64, len: usize) -> Vec<T> {
    let mut x = (rank as u64 + 1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(seed.wrapping_mul(0xBF58_476D_1CE4_E5B9));
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f64((x >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
        })
        .collect()
}

fn float_ops() -> [ReduceOp; 4] {
    [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(Scalar::Float(0.3)),
    ]
}

/// The bytes of a typed buffer (for bitwise comparison).
fn bytes_of<T: Element>(v: &[T]) -> Vec<u8> {
    // SAFETY: elements are plain values; the slice covers exactly their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        .to_vec()
}

/// The latency algorithms (one-shot, two-shot, recursive doubling) on 1 to 8 ranks: the
/// powers of two and the counts between them, where doubling hands over first.
#[test]
fn direct_algorithms_match_the_reference_on_every_rank_count() {
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Doubling] {
        for n in 1..=8 {
            let comms =
                Communicator::init_all_with(n, config(&[algorithm], 1 + n % 3, 64 << 10)).unwrap();
            let dtypes: &[DataType] = if n == 3 || n == 4 {
                &DataType::ALL
            } else {
                &[DataType::Float32, DataType::Int32, DataType::Float16]
            };
            let calls: Vec<common::Call> = common::collectives(n)
                .into_iter()
                .filter(|&c| algorithm.applies_to(c) && c.root().is_none_or(|r| r == n / 2))
                .flat_map(|c| common::calls_of(c, dtypes, &COUNTS))
                .collect();
            let wrong = common::run_calls(&comms, &calls);
            assert!(
                wrong.is_empty(),
                "{algorithm:?} on {n} ranks: {} wrong, e.g. {:?}",
                wrong.len(),
                &wrong[..wrong.len().min(5)]
            );
            // The plans ran with the algorithm forced, as the choice reports.
            let choice = comms[0].choice_for(Collective::AllReduce, 1 << 20);
            assert_eq!(choice.algorithm, algorithm);
        }
    }
}

/// Every rank's all-reduce output bytes for random floats of `dtype` with `op`.
fn all_reduce_bytes(
    comms: &[Communicator],
    dtype: DataType,
    op: ReduceOp,
    count: usize,
) -> Vec<Vec<u8>> {
    on_ranks(comms, |comm| {
        ferroccl::with_element_type!(dtype, T => {
            let send: Vec<T> = random(comm.rank(), count as u64, count);
            let mut recv = vec![T::from_f64(0.0); count];
            comm.all_reduce(&send, &mut recv, op).unwrap();
            bytes_of(&recv)
        })
    })
}

#[test]
fn every_algorithm_gives_every_rank_the_same_bits() {
    for n in [2, 3, 4, 5, 8] {
        for algorithm in Algorithm::ALL {
            for protocol in Protocol::ALL {
                let mut config = config(&[algorithm], 1 + n % 2, 32 << 10);
                config.protocols = vec![protocol];
                let comms = Communicator::init_all_with(n, config).unwrap();
                for dtype in FLOATS {
                    for op in float_ops() {
                        for count in [1, 7, 1023, 65_537] {
                            let out = all_reduce_bytes(&comms, dtype, op, count);
                            for (r, o) in out.iter().enumerate() {
                                assert!(
                                    *o == out[0],
                                    "{algorithm:?}/{protocol:?} {n} ranks {dtype:?} {op} \
                                     count {count}: rank {r}'s output differs from rank 0's"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The serial rank-order fold `x₀ ⊕ x₁ ⊕ … ⊕ xₙ₋₁` of `inputs` (with the op's pre- and
/// post-operations), by the host kernels: what deterministic mode promises.
fn serial_fold<T: Element>(dtype: DataType, op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
    let k = Kernel::new(dtype, op, inputs.len()).unwrap();
    let mut acc = inputs[0].clone();
    pre_slice(&k, &mut acc, &inputs[0]).unwrap();
    for x in &inputs[1..] {
        let a = acc.clone();
        reduce_slice(&k, &mut acc, &a, x).unwrap();
    }
    post_slice(&k, &mut acc).unwrap();
    acc
}

/// Runs all-reduce, reduce-scatter and reduce (root n−1) of random floats on `comms`
/// and returns, per call, whether every rank's output equals the serial fold's bits.
fn matches_serial_fold(
    comms: &[Communicator],
    dtype: DataType,
    op: ReduceOp,
    count: usize,
) -> [bool; 3] {
    let n = comms.len();
    let seed = count as u64 * 7 + 1;
    ferroccl::with_element_type!(dtype, T => {
        let inputs: Vec<Vec<T>> = (0..n).map(|r| random(r, seed, n * count)).collect();
        let full = serial_fold(dtype, op, &inputs);
        let firsts: Vec<Vec<T>> = inputs.iter().map(|v| v[..count].to_vec()).collect();
        let all = serial_fold(dtype, op, &firsts);
        let outputs = on_ranks(comms, |comm| {
            let r = comm.rank();
            let mine = &inputs[r];
            let mut ar = vec![T::from_f64(0.0); count];
            comm.all_reduce(&mine[..count], &mut ar, op).unwrap();
            let mut rs = vec![T::from_f64(0.0); count];
            comm.reduce_scatter(mine, &mut rs, op).unwrap();
            let mut red = vec![T::from_f64(0.0); if r == n - 1 { count } else { 0 }];
            comm.reduce(&mine[..count], &mut red, op, n - 1).unwrap();
            (bytes_of(&ar), bytes_of(&rs), bytes_of(&red))
        });
        let mut ok = [true; 3];
        for (r, (ar, rs, red)) in outputs.iter().enumerate() {
            ok[0] &= *ar == bytes_of(&all);
            ok[1] &= *rs == bytes_of(&full[r * count..(r + 1) * count]);
            if r == n - 1 {
                ok[2] &= *red == bytes_of(&all);
            }
        }
        ok
    })
}

#[test]
fn deterministic_mode_gives_the_serial_rank_order_fold_whatever_the_choices() {
    // (algorithms allowed, protocols, channels, chunk bytes)
    let choices: [(&[Algorithm], &[Protocol], usize, usize); 6] = [
        (&Algorithm::ALL, &Protocol::ALL, 1, 64 << 10),
        (&[Algorithm::OneShot], &[Protocol::LL], 2, 8 << 10),
        (&[Algorithm::OneShot], &[Protocol::Simple], 3, 64 << 10),
        (&[Algorithm::TwoShot], &[Protocol::Simple], 1, 16 << 10),
        (&[Algorithm::TwoShot], &[Protocol::LL], 2, 4 << 10),
        // Only algorithms that do not fold in rank order allowed: reductions still do.
        (
            &[Algorithm::Ring, Algorithm::Tree],
            &Protocol::ALL,
            2,
            32 << 10,
        ),
    ];
    for n in [2, 3, 4, 7] {
        for (algorithms, protocols, channels, chunk) in choices {
            let mut config = config(algorithms, channels, chunk);
            config.protocols = protocols.to_vec();
            config.deterministic = true;
            let comms = Communicator::init_all_with(n, config).unwrap();
            for dtype in FLOATS {
                for op in float_ops() {
                    for count in [1, 7, 1023, 65_537] {
                        let ok = matches_serial_fold(&comms, dtype, op, count);
                        assert_eq!(
                            ok, [true; 3],
                            "deterministic, {n} ranks, {algorithms:?}/{protocols:?}, {channels} \
                             channels, chunk {chunk}: {dtype:?} {op} count {count} \
                             (all-reduce, reduce-scatter, reduce)"
                        );
                    }
                }
            }
        }
    }
    // The comparison can fail: the ring, outside deterministic mode, starts each
    // block's sum at a different rank.
    let comms = Communicator::init_all_with(4, config(&[Algorithm::Ring], 1, 64 << 10)).unwrap();
    let ok = matches_serial_fold(&comms, DataType::Float32, ReduceOp::Sum, 65_537);
    assert!(
        !ok[0],
        "the ring's all-reduce happened to match the rank-order fold"
    );
}

#[test]
fn deterministic_mode_is_a_shared_setting_and_reported() {
    let mut config = config(&Algorithm::ALL, 1, 64 << 10);
    config.deterministic = true;
    let comms = Communicator::init_all_with(3, config).unwrap();
    for bytes in [8, 1 << 10, 1 << 20, 1 << 27] {
        for c in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Reduce { root: 0 },
        ] {
            let choice = comms[0].choice_for(c, bytes);
            assert!(
                choice.algorithm.folds_in_rank_order(),
                "{c} of {bytes} B chose {}",
                choice.name()
            );
        }
    }
    assert!(
        comms[0]
            .config()
            .shared_settings()
            .contains("FERROCCL_DETERMINISTIC=1")
    );
}

/// The longest step of `plan`, in elements.
fn longest_step(plan: &ferroccl::plan::Plan) -> usize {
    plan.lanes
        .iter()
        .flat_map(|lane| lane.steps.iter().map(|s| s.len()))
        .max()
        .unwrap_or(0)
}

/// Ranks that outnumber the CPUs they may use (here: two thread ranks confined to one
/// CPU) get short FIFOs, and their host calls ring steps of half of one; the all-reduce
/// over them still gives every rank the serial sum. Ranks with a CPU each keep the
/// steps of `chunk_bytes`.
#[test]
fn ranks_that_outnumber_their_cpus_take_short_ring_steps() {
    let config = CommConfig {
        timeout: Duration::from_secs(120),
        algorithms: vec![Algorithm::Ring],
        protocols: vec![Protocol::Simple],
        ..CommConfig::default()
    };
    let count = 1 << 20;
    let slot_elems = config.slot_bytes / 4;
    assert_eq!(config.chunk_bytes, 4 * config.slot_bytes);
    let cpus = ferroccl::topo::available_cpus().unwrap();
    if cpus.len() >= 2 {
        let comms = Communicator::init_all_with(2, config.clone()).unwrap();
        assert!(comms.iter().all(|c| !c.crowded()));
        let plan = comms[0]
            .plan_for(Collective::AllReduce, count, DataType::Float32)
            .unwrap();
        assert_eq!(longest_step(&plan), 4 * slot_elems);
    }
    // The ranks' threads inherit this thread's CPUs: one.
    std::thread::scope(|s| {
        s.spawn(|| {
            ferroccl::topo::pin_thread_to(cpus[0]).unwrap();
            let comms = Communicator::init_all_with(2, config.clone()).unwrap();
            assert!(comms.iter().all(|c| c.crowded()));
            let plan = comms[0]
                .plan_for(Collective::AllReduce, count, DataType::Float32)
                .unwrap();
            assert_eq!(longest_step(&plan), slot_elems);
            let inputs: Vec<Vec<f32>> = (0..2)
                .map(|r| {
                    (0..count)
                        .map(|i| ((i * 7 + r * 3) % 1001) as f32)
                        .collect()
                })
                .collect();
            let outputs = on_ranks(&comms, |c| {
                let mut out = vec![0f32; count];
                c.all_reduce(&inputs[c.rank()], &mut out, ReduceOp::Sum)
                    .unwrap();
                out
            });
            for (rank, out) in outputs.iter().enumerate() {
                let wrong = (0..count)
                    .filter(|&i| out[i] != inputs[0][i] + inputs[1][i])
                    .count();
                assert_eq!(wrong, 0, "rank {rank}: {wrong} wrong elements");
            }
        });
    });
}
