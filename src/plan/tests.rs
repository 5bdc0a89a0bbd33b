//! Plan tests: every collective, run by the simulator on every rank, against a serial
//! reference, over ranks × counts × roots × channels × chunk sizes × in/out of place.

use super::sim::{Arith, Buffers, simulate, simulate_with};
use super::*;

/// Integer-valued input of `rank`, distinct per rank and element.
fn input_of(rank: usize, len: usize) -> Vec<i64> {
    (0..len)
        .map(|i| (rank as i64 + 1) * 1000 + i as i64)
        .collect()
}

/// What every rank's output must hold, computed serially from all inputs.
fn reference(c: Collective, count: usize, n: usize, inputs: &[Vec<i64>]) -> Vec<Option<Vec<i64>>> {
    let sum = |range: std::ops::Range<usize>| -> Vec<i64> {
        range.map(|i| inputs.iter().map(|v| v[i]).sum()).collect()
    };
    (0..n)
        .map(|r| match c {
            Collective::AllReduce => Some(sum(0..count)),
            Collective::Reduce { root } => (r == root).then(|| sum(0..count)),
            Collective::ReduceScatter => Some(sum(r * count..(r + 1) * count)),
            Collective::Broadcast { root } => Some(inputs[root].clone()),
            Collective::AllGather => Some(inputs.concat()),
            Collective::Gather { root } => (r == root).then(|| inputs.concat()),
            Collective::Scatter { root } => Some(inputs[root][r * count..(r + 1) * count].to_vec()),
            Collective::AllToAll => Some(
                (0..n)
                    .flat_map(|i| inputs[i][r * count..(r + 1) * count].to_vec())
                    .collect(),
            ),
            Collective::Send { .. } | Collective::Recv { .. } => None,
        })
        .collect()
}

/// Runs collective `c` on `n` ranks in the simulator and checks every output.
fn check(c: Collective, count: usize, n: usize, options: &PlanOptions, in_place: bool) {
    let plans: Vec<Plan> = (0..n)
        .map(|r| plan(c, count, r, n, options).unwrap())
        .collect();
    let mut inputs = Vec::new();
    let mut bufs = Vec::new();
    for r in 0..n {
        let (in_len, out_len) = c.buffer_lens(count, r, n);
        // Every rank gets a full-size input for the reference, even where the collective
        // ignores it.
        let full_in = input_of(
            r,
            c.buffer_lens(count, c.root().unwrap_or(r), n).0.max(in_len),
        );
        inputs.push(full_in.clone());
        let own_in = full_in[..in_len].to_vec();
        let b = match (
            in_place,
            c.input_in_output(count, r),
            c.output_in_input(count, r),
        ) {
            (true, Some(at), _) if out_len > 0 => {
                let mut mem = vec![-1; out_len];
                mem[at..at + in_len].clone_from_slice(&own_in);
                Buffers::input_inside_output(mem, at, in_len)
            }
            (true, _, Some(at)) if in_len > 0 => Buffers::output_inside_input(own_in, at, out_len),
            _ => Buffers::separate(own_in, out_len, -1),
        };
        bufs.push(vec![b]);
    }
    let arith = [if c.is_reducing() {
        Arith::reduce(|a: &i64, b: &i64| a + b)
    } else {
        Arith::copy()
    }];
    simulate(&plans, &mut bufs, &arith)
        .unwrap_or_else(|e| panic!("{c} count {count} n {n} {options:?}: {e}"));
    for (r, want) in reference(c, count, n, &inputs).into_iter().enumerate() {
        if let Some(want) = want {
            assert_eq!(
                bufs[r][0].output(),
                &want[..],
                "{c} count {count} n {n} in_place {in_place} rank {r} {options:?}"
            );
        }
    }
    // No step moves more than a chunk, except the direct algorithms (whole blocks).
    let ring_algo = !matches!(
        c,
        Collective::AllToAll | Collective::Gather { .. } | Collective::Scatter { .. }
    );
    if ring_algo {
        for p in &plans {
            assert!(
                p.steps()
                    .all(|s| s.send_to().is_none() || s.len() <= options.chunk_elems),
                "{c}: step over a chunk"
            );
        }
    }
}

fn collectives(n: usize) -> Vec<Collective> {
    Collective::every(n)
}

#[test]
fn every_collective_matches_the_reference() {
    for n in 1..=8 {
        for &count in &[0usize, 1, 2, 7, 64, 1023] {
            for channels in [1, 2, 3] {
                for chunk in [1usize, 5, 64, 4096] {
                    for algorithm in Algorithm::ALL {
                        let options = PlanOptions::with_channels(n, channels, chunk)
                            .with_algorithm(algorithm);
                        for c in collectives(n) {
                            for in_place in [false, true] {
                                check(c, count, n, &options, in_place);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// An order-sensitive "reduction" (neither commutative nor associative), so that the
/// order in which a plan combines contributions shows in the result.
fn ordered(a: &i64, b: &i64) -> i64 {
    a.wrapping_mul(31).wrapping_add(*b) % 1_000_000_007
}

/// Every rank's output of reducing collective `c` under an order-sensitive reduction.
fn ordered_outputs(c: Collective, count: usize, n: usize, options: &PlanOptions) -> Vec<Vec<i64>> {
    let plans: Vec<Plan> = (0..n)
        .map(|r| plan(c, count, r, n, options).unwrap())
        .collect();
    let mut bufs: Vec<_> = (0..n)
        .map(|r| {
            let (in_len, out_len) = c.buffer_lens(count, r, n);
            vec![Buffers::separate(input_of(r, in_len), out_len, -1)]
        })
        .collect();
    simulate(&plans, &mut bufs, &[Arith::reduce(ordered)]).unwrap();
    bufs.iter().map(|b| b[0].output().to_vec()).collect()
}

#[test]
fn every_algorithm_gives_every_rank_the_same_bits_and_direct_ones_fold_in_rank_order() {
    for n in 1..=7 {
        for count in [1usize, 13, 100] {
            // The serial left fold x0 ⊕ x1 ⊕ … ⊕ x(n-1), element by element.
            let fold = |lo: usize, len: usize| -> Vec<i64> {
                (lo..lo + len)
                    .map(|i| {
                        (1..n).fold(input_of(0, lo + len)[i], |acc, r| {
                            ordered(&acc, &input_of(r, lo + len)[i])
                        })
                    })
                    .collect()
            };
            for channels in [1, 2] {
                for chunk in [1usize, 4, 1000] {
                    for algorithm in Algorithm::ALL {
                        let options = PlanOptions::with_channels(n, channels, chunk)
                            .with_algorithm(algorithm);
                        let all = ordered_outputs(Collective::AllReduce, count, n, &options);
                        assert!(all.iter().all(|o| *o == all[0]), "{algorithm:?} n {n}");
                        if algorithm.folds_in_rank_order() {
                            assert_eq!(all[0], fold(0, count), "{algorithm:?} n {n}");
                        }
                        // Reduce-scatter and reduce fold in rank order with the one-shot.
                        if algorithm == Algorithm::OneShot {
                            let rs = ordered_outputs(Collective::ReduceScatter, count, n, &options);
                            for (r, out) in rs.iter().enumerate() {
                                assert_eq!(*out, fold(r * count, count), "{algorithm:?} n {n}");
                            }
                            let root = n / 2;
                            let red =
                                ordered_outputs(Collective::Reduce { root }, count, n, &options);
                            assert_eq!(red[root], fold(0, count), "{algorithm:?} n {n}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn unusual_ring_orders_work() {
    let options = PlanOptions {
        chunk_elems: 3,
        rings: vec![vec![2, 0, 3, 1], vec![1, 3, 0, 2]],
        ..PlanOptions::with_channels(4, 2, 3)
    };
    for c in collectives(4) {
        check(c, 37, 4, &options, false);
    }
}

#[test]
fn ring_all_reduce_moves_2_n_minus_1_over_n_of_the_data() {
    for n in 2..=16 {
        let count = n * 1000;
        let options = PlanOptions::with_channels(n, 1, count);
        for r in 0..n {
            let p = plan(Collective::AllReduce, count, r, n, &options).unwrap();
            // Reduce-scatter and all-gather each send (n-1)/n of the buffer.
            assert_eq!(p.elems_sent(), 2 * (n - 1) * count / n, "n {n}");
            // 2(n-1) rounds of communication: n-1 that send, n-1 that receive, all but
            // the first and the last doing both, so 2n-1 steps.
            assert_eq!(p.lanes[0].steps.len(), 2 * n - 1);
        }
    }
}

#[test]
fn classic_four_rank_table() {
    // Rank r, chunk c starts at (r+1)*10 + c; one element per chunk.
    let n = 4;
    let options = PlanOptions::with_channels(n, 1, 1);
    let plans: Vec<Plan> = (0..n)
        .map(|r| plan(Collective::AllReduce, n, r, n, &options).unwrap())
        .collect();
    let mut bufs: Vec<Vec<Buffers<i64>>> = (0..n)
        .map(|r| {
            let mem = (0..n).map(|c| (r as i64 + 1) * 10 + c as i64).collect();
            vec![Buffers::input_inside_output(mem, 0, n)]
        })
        .collect();
    let mut after = Vec::new();
    let report = simulate_with(
        &plans,
        &mut bufs,
        &[Arith::reduce(|a: &i64, b: &i64| a + b)],
        |round, b| {
            after.push((
                round,
                b.iter().map(|r| r[0].mem.clone()).collect::<Vec<_>>(),
            ))
        },
    )
    .unwrap();
    assert_eq!(report.rounds, 2 * (n - 1) + 1);
    // Messages travel one hop per round; after round 1 (the first receive), rank 1 has
    // added rank 0's chunk a to its own: 10 + 20. In place, that partial sum travels and
    // is not stored, so look at the event: rank 1's step in round 1 is recvReduceSend of
    // chunk a.
    let round1: Vec<&Step> = report
        .events
        .iter()
        .filter(|e| e.round == 1 && e.rank == 1)
        .map(|e| &e.step)
        .collect();
    assert_eq!(
        round1,
        [&Step::RecvReduceSend {
            from: 0,
            to: 2,
            src: Region::input(0, 1)
        }]
    );
    // After 3 rounds of receiving (round 3), each rank owns one fully reduced chunk.
    let (_, snap) = &after[3];
    let mut owned: Vec<i64> = (0..n).map(|r| snap[r][(r + 1) % n]).collect();
    owned.sort_unstable();
    assert_eq!(owned, [100, 104, 108, 112]);
    for b in &bufs {
        assert_eq!(b[0].output(), &[100, 104, 108, 112]);
    }
}

#[test]
fn fused_sends_and_receives_keep_order_per_peer() {
    // Rank 0 sends two messages to rank 1 and receives one from it, in one group.
    let n = 2;
    let send = |peer, count| {
        plan(
            Collective::Send { peer },
            count,
            0,
            n,
            &PlanOptions::with_channels(n, 1, 8),
        )
        .unwrap()
    };
    let recv = |rank, peer, count| {
        plan(
            Collective::Recv { peer },
            count,
            rank,
            n,
            &PlanOptions::with_channels(n, 1, 8),
        )
        .unwrap()
    };
    let p0 = Plan::fuse(vec![send(1, 3), recv(0, 1, 2), send(1, 4)]).unwrap();
    // Rank 1 posts its send before its receives: order across directions is free.
    let p1_send = plan(
        Collective::Send { peer: 0 },
        2,
        1,
        n,
        &PlanOptions::with_channels(n, 1, 8),
    )
    .unwrap();
    let p1 = Plan::fuse(vec![p1_send, recv(1, 0, 3), recv(1, 0, 4)]).unwrap();
    assert_eq!(
        p0.lanes.len(),
        2,
        "sends to rank 1 share a lane, the receive has its own"
    );
    let mut bufs = vec![
        vec![
            Buffers::separate(vec![1, 2, 3], 0, 0),
            Buffers::separate(vec![], 2, 0),
            Buffers::separate(vec![4, 5, 6, 7], 0, 0),
        ],
        vec![
            Buffers::separate(vec![8, 9], 0, 0),
            Buffers::separate(vec![], 3, 0),
            Buffers::separate(vec![], 4, 0),
        ],
    ];
    let arith = [Arith::copy(), Arith::copy(), Arith::copy()];
    simulate(&[p0, p1], &mut bufs, &arith).unwrap();
    assert_eq!(bufs[0][1].output(), &[8, 9]);
    assert_eq!(bufs[1][1].output(), &[1, 2, 3]);
    assert_eq!(bufs[1][2].output(), &[4, 5, 6, 7]);
}

#[test]
fn mismatched_plans_are_caught() {
    let o = PlanOptions::with_channels(2, 1, 8);
    let p0 = plan(Collective::Send { peer: 1 }, 3, 0, 2, &o).unwrap();
    let p1 = plan(Collective::Recv { peer: 0 }, 4, 1, 2, &o).unwrap();
    let mut bufs = vec![
        vec![Buffers::separate(vec![1, 2, 3], 0, 0)],
        vec![Buffers::separate(vec![], 4, 0)],
    ];
    let err = simulate(&[p0.clone(), p1], &mut bufs, &[Arith::copy()]).unwrap_err();
    assert!(err.to_string().contains("expects 4 elements"), "{err}");
    let lonely = plan(Collective::Recv { peer: 1 }, 0, 1, 2, &o).unwrap();
    let err = simulate(&[p0, lonely], &mut bufs, &[Arith::copy()]).unwrap_err();
    assert!(err.to_string().contains("never"), "{err}");
}

#[test]
fn bad_arguments_are_errors() {
    let o = PlanOptions::with_channels(4, 1, 8);
    assert!(plan(Collective::AllReduce, 1, 4, 4, &o).is_err());
    let err = plan(Collective::Broadcast { root: 9 }, 1, 0, 4, &o).unwrap_err();
    assert!(err.to_string().contains("root/peer 9"), "{err}");
    let bad_ring = PlanOptions {
        rings: vec![vec![0, 1, 1, 3]],
        ..PlanOptions::with_channels(4, 1, 1)
    };
    assert!(plan(Collective::AllReduce, 1, 0, 4, &bad_ring).is_err());
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn random_collectives_match_the_reference(
            n in 1usize..=8,
            count in 0usize..300,
            channels in 1usize..=4,
            chunk in 1usize..100,
            which in 0usize..8,
            root_seed in 0usize..8,
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
            check(c, count, n, &PlanOptions::with_channels(n, channels, chunk), in_place);
        }
    }
}

#[test]
fn tree_all_reduce_matches_the_reference() {
    for n in 1..=9 {
        // One rank per host, two per host, all on one host.
        let layouts: [Vec<usize>; 3] = [
            (0..n).collect(),
            (0..n).map(|r| r / 2).collect(),
            vec![0; n],
        ];
        for hosts in &layouts {
            for channels in [1, 2, 3] {
                for chunk in [1usize, 4, 1000] {
                    let mut options = PlanOptions::with_channels(n, channels, chunk)
                        .with_algorithm(Algorithm::Tree);
                    options.hosts = hosts.clone();
                    for count in [0usize, 1, 7, 64, 1023] {
                        for in_place in [false, true] {
                            check(Collective::AllReduce, count, n, &options, in_place);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn tree_all_reduce_sends_the_buffer_about_twice_per_rank() {
    // Across 8 hosts of one rank (tree 0 -> 4 -> {2, 6} -> {1, 3, 5, 7}), one chunk
    // takes two rounds per level and direction, the second child one round after the
    // first: 12 rounds against 2(n-1) + 1 = 15 for the ring, and the tree's count grows
    // with log2 of the hosts where the ring's grows with the ranks.
    let n = 8;
    let options = PlanOptions::with_channels(n, 1, 1000).with_algorithm(Algorithm::Tree);
    let plans: Vec<Plan> = (0..n)
        .map(|r| plan(Collective::AllReduce, 1000, r, n, &options).unwrap())
        .collect();
    let mut bufs: Vec<Vec<Buffers<i64>>> = (0..n)
        .map(|r| vec![Buffers::separate(vec![r as i64; 1000], 1000, 0)])
        .collect();
    let report = simulate(
        &plans,
        &mut bufs,
        &[Arith::reduce(|a: &i64, b: &i64| a + b)],
    )
    .unwrap();
    assert!(bufs.iter().all(|b| b[0].output().iter().all(|&v| v == 28)));
    assert_eq!(report.rounds, 12);
    for p in &plans {
        assert!(
            p.elems_sent() <= 3 * 1000,
            "an inner rank sends up once, down twice"
        );
    }
}

/// Checks the rooted collective `rooted(root)` on trees: 1–9 ranks, one host per rank
/// and three ranks per host, 1 and 2 channels, every root, in and out of place.
fn check_on_trees_at_every_root(rooted: fn(usize) -> Collective) {
    for n in 1..=9 {
        let layouts: [Vec<usize>; 2] = [(0..n).collect(), (0..n).map(|r| r / 3).collect()];
        for hosts in &layouts {
            for channels in [1, 2] {
                let mut options =
                    PlanOptions::with_channels(n, channels, 5).with_algorithm(Algorithm::Tree);
                options.hosts = hosts.clone();
                for root in 0..n {
                    for count in [0usize, 1, 23] {
                        for in_place in [false, true] {
                            check(rooted(root), count, n, &options, in_place);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn tree_broadcast_matches_the_reference_from_every_root() {
    check_on_trees_at_every_root(|root| Collective::Broadcast { root });
}

#[test]
fn tree_reduce_matches_the_reference_at_every_root() {
    check_on_trees_at_every_root(|root| Collective::Reduce { root });
}

#[test]
fn tree_reduce_uses_scratch_only_where_partial_sums_wait() {
    // One rank per host: a binary tree, whose inner ranks add two children's partials
    // (5 hosts is the multi-host process test's shape).
    let count = 40;
    for n in [5, 7] {
        let options = PlanOptions::with_channels(n, 1, 8).with_algorithm(Algorithm::Tree);
        for root in 0..n {
            let tree = tree::RankTree::rooted_at(&(0..n).collect::<Vec<_>>(), root);
            let mut with_scratch = 0;
            for r in 0..n {
                let p = plan(Collective::Reduce { root }, count, r, n, &options).unwrap();
                let kids = tree.children[r].len();
                let wanted = if r != root && kids > 1 { count } else { 0 };
                assert_eq!(p.scratch_elems(0), wanted, "rank {r} with {kids} children");
                with_scratch += usize::from(wanted > 0);
                // Only the root writes its receive buffer.
                let writes_output = p
                    .steps()
                    .flat_map(|s| s.regions())
                    .any(|reg| reg.buf == Buf::Output);
                assert_eq!(writes_output, r == root, "rank {r}");
            }
            assert!(with_scratch > 0, "{n} ranks, root {root}: no inner rank");
        }
    }
}

#[test]
fn direct_algorithms_send_what_the_model_says() {
    // One-shot: the whole buffer to each of the n-1 peers; two-shot: the ring's bytes.
    let (n, count) = (5, 1000);
    for (algorithm, sent) in [
        (Algorithm::OneShot, (n - 1) * count),
        (Algorithm::TwoShot, 2 * (n - 1) * count / n),
    ] {
        let options = PlanOptions::with_channels(n, 2, 64).with_algorithm(algorithm);
        for r in 0..n {
            let p = plan(Collective::AllReduce, count, r, n, &options).unwrap();
            assert_eq!(p.elems_sent(), sent, "{algorithm:?} rank {r}");
        }
    }
    // Recursive doubling: the buffer once a round. On 5 ranks, 4 double (2 rounds);
    // rank 1 hands its buffer to rank 0, which sends it the result.
    let options = PlanOptions::with_channels(n, 2, 64).with_algorithm(Algorithm::Doubling);
    for (r, rounds) in [3, 1, 2, 2, 2].into_iter().enumerate() {
        let p = plan(Collective::AllReduce, count, r, n, &options).unwrap();
        assert_eq!(p.elems_sent(), rounds * count, "doubling rank {r}");
    }
    // The ranks that double: the even ones of the pairs, then the rest.
    let doubling = |n: usize| {
        (0..1 << n.ilog2())
            .map(|v| doubling_rank(v, n))
            .collect::<Vec<_>>()
    };
    assert_eq!(doubling(5), [0, 2, 3, 4]);
    assert_eq!(doubling(7), [0, 2, 4, 6]);
    assert_eq!(doubling(8), [0, 1, 2, 3, 4, 5, 6, 7]);
    for n in [2, 4, 8] {
        let options = PlanOptions::with_channels(n, 1, 64).with_algorithm(Algorithm::Doubling);
        for r in 0..n {
            let p = plan(Collective::AllReduce, count, r, n, &options).unwrap();
            assert_eq!(
                p.elems_sent(),
                n.ilog2() as usize * count,
                "{n} ranks, rank {r}"
            );
        }
    }
}
