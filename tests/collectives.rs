//! Every collective, on ranks that are threads, against a serial reference: ranks 1–8 ×
//! counts 0, 1, 2, 7, 1023, 65 537 × all 12 dtypes × all ops × every root × in place and
//! out of place, plus counts of 16 Mi elements and more. `tests/shm_processes.rs` runs
//! the same checks with ranks as processes over `/dev/shm`.

mod common;

use std::time::Duration;

use common::{collectives, ops, run_and_check};
use ferroccl::bootstrap::UniqueId;
use ferroccl::comm::CommConfig;
use ferroccl::plan::Collective;
use ferroccl::transport::{Protocol, SlotStores};
use ferroccl::{Communicator, DataType, ReduceOp};

const COUNTS: [usize; 6] = [0, 1, 2, 7, 1023, 65_537];

fn config(channels: usize) -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(120),
        channels,
        // Small slots so that 65 537 elements take many slices and chunks.
        slot_bytes: 16 << 10,
        chunk_bytes: 4 * (16 << 10),
        ..CommConfig::default()
    }
}

/// Runs `calls` on every rank (one thread each) and returns every mismatch found.
fn run_grid(
    n: usize,
    config: CommConfig,
    calls: &[(Collective, DataType, ReduceOp, usize, bool)],
) -> Vec<String> {
    let comms = Communicator::init_all_with(n, config).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || {
                    let mut wrong = Vec::new();
                    for &(c, dtype, op, count, in_place) in calls {
                        let r = ferroccl::with_element_type!(dtype, T => run_and_check::<T>(comm, c, op, count, in_place));
                        if let Err(e) = r {
                            if comm.failure().is_some() {
                                // The communicator is dead: stop, so peers fail fast too.
                                comm.abort();
                                wrong.push(e);
                                break;
                            }
                            wrong.push(e);
                        }
                    }
                    wrong
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// The full grid for `n` ranks.
fn grid(n: usize) -> Vec<common::Call> {
    collectives(n)
        .into_iter()
        .flat_map(|c| common::calls_of(c, &DataType::ALL, &COUNTS))
        .collect()
}

fn check_ranks(n: usize, channels: usize) {
    check_ranks_with(n, config(channels));
}

fn check_ranks_with(n: usize, config: CommConfig) {
    let calls = grid(n);
    let wrong = run_grid(n, config, &calls);
    assert!(
        wrong.is_empty(),
        "{} of {} checks failed on {n} ranks, e.g.:\n{}",
        wrong.len(),
        calls.len() * n,
        wrong
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The cost model gives the smallest calls to LL and the rest to Simple; these run the
/// whole grid with one protocol forced, LL through many slots and chunks.
#[test]
fn three_ranks_two_channels_with_ll_forced() {
    let mut config = config(2);
    config.protocols = vec![Protocol::LL];
    check_ranks_with(3, config);
}

/// Ranks that are threads read each other's buffers with plain copies: the whole grid
/// with single copy forced (2 ranks, so the ring's reductions carry it too).
#[test]
fn two_ranks_two_channels_with_single_copy_forced() {
    let mut config = config(2);
    config.protocols = vec![Protocol::SingleCopy];
    check_ranks_with(2, config);
}

/// The two-shot all-reduce with single copy between threads: each piece's owner folds
/// it from every rank's input in place, all contributions slice by slice (a fold run
/// whole), and every rank reads the other pieces back (between threads no rank writes
/// a peer's memory: `PeerMemory::writable`). The whole grid on 2, 3 and 4 ranks (other
/// collectives on their default algorithms), then calls whose results stream past the
/// caches (4 ranks, 6 MiB, streaming stores forced), avg so the post-operation runs on
/// the streamed lines, and bf16.
#[test]
fn two_shot_folding_whole_pieces_between_threads() {
    for n in [2, 3, 4] {
        let mut config = config(2);
        config.protocols = vec![Protocol::SingleCopy];
        config.algorithms = vec![ferroccl::plan::Algorithm::TwoShot];
        check_ranks_with(n, config);
    }
    let mut config = config(1);
    config.protocols = vec![Protocol::SingleCopy];
    config.algorithms = vec![ferroccl::plan::Algorithm::TwoShot];
    config.slot_stores = SlotStores::Streaming;
    let large = 1_572_869;
    let calls: Vec<common::Call> = [
        (DataType::Float32, ReduceOp::Avg),
        (DataType::Bfloat16, ReduceOp::Sum),
    ]
    .into_iter()
    .flat_map(|(dtype, op)| {
        [false, true].map(|in_place| (Collective::AllReduce, dtype, op, large, in_place))
    })
    .collect();
    let wrong = run_grid(4, config, &calls);
    assert!(wrong.is_empty(), "{wrong:?}");
}

/// Slots written with non-temporal stores (what a rank does towards a peer it measures
/// far): the grid on 2 ranks (one-shot, two-shot and the ring's reductions into slots)
/// and on 3 (the ring's copy-and-send and receive-reduce-send steps), Simple and LL (an
/// LL message streamed behind the header that shares its first line; on one channel
/// the small calls run in order, on two they are swept).
#[test]
fn streaming_slot_stores_on_two_and_three_ranks() {
    for protocol in [Protocol::Simple, Protocol::LL] {
        for (ranks, channels) in [(2, 2), (3, 1)] {
            let mut config = config(channels);
            config.protocols = vec![protocol];
            config.slot_stores = SlotStores::Streaming;
            check_ranks_with(ranks, config);
        }
    }
}

#[test]
fn four_ranks_with_simple_forced() {
    let mut config = config(1);
    config.protocols = vec![Protocol::Simple];
    check_ranks_with(4, config);
}

/// Ranks that would plan differently (here: one allows only Simple) fail at
/// initialisation with the setting named, instead of hanging in their first call.
#[test]
fn ranks_with_different_settings_fail_at_init() {
    let id = UniqueId::hosted_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let id = &id;
                s.spawn(move || {
                    let mut c = config(1);
                    if rank == 1 {
                        c.protocols = vec![Protocol::Simple];
                    }
                    Communicator::init_rank_with(id, 2, rank, c)
                        .map(|_| ())
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(
            e.contains(
                "rank 1's settings differ from rank 0's: FERROCCL_PROTO: Simple,LL,SingleCopy vs Simple"
            ),
            "{e}"
        );
    }
}

/// Ranks that call the same collective with different counts fail with both sizes
/// named, never with data: 2 floats against 3 on two ranks, once with LL (a small plan,
/// run in order) and once with Simple (the lanes swept).
#[test]
fn ranks_that_call_with_different_counts_fail_naming_the_sizes() {
    for protocol in [Protocol::LL, Protocol::Simple] {
        let mut c = config(1);
        c.protocols = vec![protocol];
        c.timeout = Duration::from_secs(20);
        let comms = Communicator::init_all_with(2, c).unwrap();
        let errors: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(rank, comm)| {
                    s.spawn(move || {
                        let mut buf = vec![1.0f32; 2 + rank];
                        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                            .unwrap_err()
                            .to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, e) in errors.iter().enumerate() {
            let (want, got) = if rank == 0 { (8, 12) } else { (12, 8) };
            // A rank may also learn of the mismatch from its peer, which aborted first.
            assert!(
                e.contains(&format!(
                    "expected a slice of {want} bytes from rank {}",
                    1 - rank
                )) && e.contains(&format!("but got {got}"))
                    && e.contains("different operations or counts")
                    || e.contains(&format!("rank {} failed", 1 - rank)),
                "{protocol:?}, rank {rank}: {e}"
            );
        }
        assert!(
            errors.iter().any(|e| e.contains("expected a slice of")),
            "{protocol:?}: no rank named the sizes: {errors:?}"
        );
    }
}

#[test]
fn one_rank() {
    check_ranks(1, 1);
}

#[test]
fn two_ranks() {
    check_ranks(2, 1);
}

#[test]
fn three_ranks_two_channels() {
    check_ranks(3, 2);
}

#[test]
fn four_ranks() {
    check_ranks(4, 1);
}

#[test]
fn five_ranks_three_channels() {
    check_ranks(5, 3);
}

#[test]
fn six_ranks() {
    check_ranks(6, 1);
}

#[test]
fn seven_ranks_two_channels() {
    check_ranks(7, 2);
}

#[test]
fn eight_ranks() {
    check_ranks(8, 1);
}

#[test]
fn tree_all_reduce_broadcast_and_reduce_on_every_rank_count() {
    for n in 2..=8 {
        let mut config = config(1 + n % 2);
        config.algorithms = vec![ferroccl::plan::Algorithm::Tree];
        let comms = Communicator::init_all_with(n, config).unwrap();
        let mut calls = Vec::new();
        for dtype in DataType::ALL {
            for op in ops() {
                for count in COUNTS {
                    for in_place in [false, true] {
                        calls.push((Collective::AllReduce, dtype, op, count, in_place));
                    }
                }
            }
            for root in 0..n {
                for count in COUNTS {
                    calls.push((
                        Collective::Broadcast { root },
                        dtype,
                        ReduceOp::Sum,
                        count,
                        root % 2 == 0,
                    ));
                    for op in ops() {
                        calls.push((Collective::Reduce { root }, dtype, op, count, root % 2 == 1));
                    }
                }
            }
        }
        let wrong = common::run_calls(&comms, &calls);
        assert!(
            wrong.is_empty(),
            "{n} ranks: {:?}",
            &wrong[..wrong.len().min(5)]
        );
    }
}

/// Counts large enough that results of 8 MiB and more go past the caches: as the cost
/// model plans them (single copy between threads), and through FIFO slots written past
/// the caches too (as towards a far peer), where one reduction streams to both the
/// output and the slot.
#[test]
fn sixteen_mebi_elements_and_more() {
    let big = 16 << 20;
    let calls = [
        (
            Collective::AllReduce,
            DataType::Float32,
            ReduceOp::Sum,
            big + 1,
            false,
        ),
        (
            Collective::AllReduce,
            DataType::Bfloat16,
            ReduceOp::Max,
            big,
            true,
        ),
        (
            Collective::ReduceScatter,
            DataType::Int32,
            ReduceOp::Sum,
            big / 3 + 5,
            false,
        ),
        (
            Collective::Broadcast { root: 2 },
            DataType::Float64,
            ReduceOp::Sum,
            big,
            false,
        ),
        (
            Collective::AllGather,
            DataType::Uint8,
            ReduceOp::Sum,
            big,
            true,
        ),
        (
            Collective::AllReduce,
            DataType::Float32,
            ReduceOp::Avg,
            big / 2 + 3,
            false,
        ),
    ];
    let mut streaming = config(2);
    streaming.protocols = vec![Protocol::Simple];
    streaming.slot_stores = SlotStores::Streaming;
    for config in [config(2), streaming] {
        let wrong = run_grid(3, config, &calls);
        assert!(wrong.is_empty(), "{wrong:?}");
    }
}

/// `len` elements of `v` starting `distance` bytes past a page boundary.
fn past_a_page(v: &mut [f32], distance: usize, len: usize) -> &mut [f32] {
    let at = v.as_ptr().cast::<u8>().align_offset(4096) / 4 + distance / 4;
    &mut v[at..at + len]
}

/// Outputs that start a few bytes past a page, where a slot's copy into them takes the
/// vector loop instead of `rep movsb` (`ferroccl::reduce::copy`), and at distances
/// where it does not: all-reduce, all-gather and broadcast on 3 ranks, out of place and
/// against the serial result, with slices well above the copy's 2 KiB threshold.
#[test]
fn outputs_a_few_bytes_past_a_page() {
    const N: usize = 3;
    const COUNT: usize = 30_011;
    let comms = Communicator::init_all_with(N, config(1)).unwrap();
    let inputs: Vec<Vec<f32>> = (0..N)
        .map(|r| {
            (0..COUNT)
                .map(|i| ((i * 7 + r * 13) % 101) as f32)
                .collect()
        })
        .collect();
    let sum: Vec<f32> = (0..COUNT)
        .map(|i| inputs.iter().map(|input| input[i]).sum())
        .collect();
    let gathered: Vec<f32> = inputs.concat();
    // Rank 1 broadcasts its input; the others pass zeros.
    let root = 1;
    std::thread::scope(|s| {
        for (rank, comm) in comms.iter().enumerate() {
            let (inputs, sum, gathered) = (&inputs, &sum, &gathered);
            s.spawn(move || {
                let input = &inputs[rank];
                let zeros = vec![0.0; COUNT];
                let root_data = if rank == root { input } else { &zeros };
                for distance in [0, 8, 16, 40, 60, 64] {
                    let mut out = vec![-1.0f32; N * COUNT + 2048];
                    let o = past_a_page(&mut out, distance, COUNT);
                    comm.all_reduce(input, o, ReduceOp::Sum).unwrap();
                    assert!(o == &sum[..], "all-reduce, distance {distance}");
                    let o = past_a_page(&mut out, distance, COUNT);
                    comm.broadcast(root_data, o, root).unwrap();
                    assert!(o == &inputs[root][..], "broadcast, distance {distance}");
                    let o = past_a_page(&mut out, distance, N * COUNT);
                    comm.all_gather(input, o).unwrap();
                    assert!(o == &gathered[..], "all-gather, distance {distance}");
                }
            });
        }
    });
}

#[test]
fn two_communicators_used_concurrently_from_one_process() {
    // Two independent groups of 3 ranks, each rank thread driving one communicator of
    // each group alternately, while the other group's calls are in flight.
    let a = Communicator::init_all_with(3, config(1)).unwrap();
    let b = Communicator::init_all_with(3, config(2)).unwrap();
    let wrong: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = a
            .iter()
            .zip(&b)
            .map(|(ca, cb)| {
                s.spawn(move || {
                    let mut wrong = Vec::new();
                    for count in [1usize, 1023, 65_537] {
                        for (comm, op) in [
                            (ca, ReduceOp::Sum),
                            (cb, ReduceOp::Max),
                            (ca, ReduceOp::Min),
                        ] {
                            if let Err(e) =
                                run_and_check::<i64>(comm, Collective::AllReduce, op, count, false)
                            {
                                wrong.push(e);
                            }
                        }
                    }
                    wrong
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(wrong.is_empty(), "{wrong:?}");
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // Each case builds its own communicator (shape, chunk and channels vary).
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn random_calls_match_the_reference(
            n in 1usize..=6,
            count in 0usize..5000,
            dtype_index in 0usize..12,
            op_index in 0usize..6,
            which in 0usize..8,
            root_seed in 0usize..6,
            chunk_slots in 1usize..=4,
            slot_kib in prop::sample::select(vec![1usize, 4, 16]),
            channels in 1usize..=3,
            protocols_index in 0usize..4,
            in_place in any::<bool>(),
        ) {
            let root = root_seed % n;
            let c = [
                Collective::AllReduce,
                Collective::AllGather,
                Collective::ReduceScatter,
                Collective::AllToAll,
                Collective::Broadcast { root },
                Collective::Reduce { root },
                Collective::Gather { root },
                Collective::Scatter { root },
            ][which];
            let in_place = in_place && c != Collective::AllToAll;
            let config = CommConfig {
                timeout: Duration::from_secs(60),
                channels,
                slot_bytes: slot_kib << 10,
                chunk_bytes: chunk_slots * (slot_kib << 10),
                // Small LL slots, so LL calls span many slices too.
                ll_payload_bytes: 512,
                protocols: [
                    Protocol::ALL.to_vec(),
                    vec![Protocol::LL],
                    vec![Protocol::Simple],
                    vec![Protocol::SingleCopy],
                ][protocols_index]
                    .clone(),
                ..CommConfig::default()
            };
            let comms = Communicator::init_all_with(n, config).unwrap();
            let (dtype, op) = (DataType::ALL[dtype_index], ops()[op_index]);
            let wrong: Vec<String> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|comm| s.spawn(move || {
                        ferroccl::with_element_type!(dtype, T => run_and_check::<T>(comm, c, op, count, in_place)).err()
                    }))
                    .collect();
                hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
            });
            prop_assert!(wrong.is_empty(), "{:?}", wrong);
        }
    }
}

#[test]
fn abort_from_another_thread_ends_a_waiting_call_at_once() {
    // Rank 1 never calls: rank 0's all-reduce waits (deadline 120 s) until the main
    // thread aborts rank 0's communicator, as a watchdog or ncclCommAbort would.
    let mut comms = Communicator::init_all_with(2, config(1))
        .unwrap()
        .into_iter();
    let comm0 = std::sync::Arc::new(comms.next().unwrap());
    let _idle_rank1 = comms.next().unwrap();
    let waiting = {
        let comm0 = comm0.clone();
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut buf = vec![1.0f32; 1024];
            (
                comm0.all_reduce_in_place(&mut buf, ReduceOp::Sum),
                start.elapsed(),
            )
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let aborted_at = std::time::Instant::now();
    comm0.abort();
    let (result, waited) = waiting.join().unwrap();
    let err = result.unwrap_err().to_string();
    assert!(err.contains("aborted by the user"), "{err}");
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    assert!(aborted_at.elapsed() < Duration::from_secs(2));
    // Later calls fail at once, naming the abort.
    let err = comm0
        .all_reduce_in_place(&mut [0u8], ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(err.contains("aborted"), "{err}");
}
