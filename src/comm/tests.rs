//! Communicator unit tests: argument checks, groups, split, abort. The full grid of
//! collectives × dtypes × ops × counts lives in `tests/collectives.rs`.

use super::*;

fn comms(n: usize) -> Vec<Communicator> {
    let config = CommConfig {
        timeout: std::time::Duration::from_secs(30),
        slot_bytes: 4096,
        chunk_bytes: 4 * 4096,
        ..CommConfig::default()
    };
    Communicator::init_all_with(n, config).unwrap()
}

/// Runs `f(comm)` on every rank, each in its own thread; returns the results by rank.
fn on_all<C: Sync, R: Send>(comms: &[C], f: impl Fn(&C) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_reduce_on_threads() {
    let cs = comms(3);
    let out = on_all(&cs, |c| {
        let send: Vec<f32> = (0..1000).map(|i| (c.rank() * 1000 + i) as f32).collect();
        let mut recv = vec![0f32; 1000];
        c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        recv
    });
    for r in out {
        for (i, v) in r.iter().enumerate() {
            assert_eq!(*v, (3 * i + 3000) as f32);
        }
    }
}

#[test]
fn wrong_arguments_are_named_and_leave_the_communicator_usable() {
    let cs = comms(2);
    let c = &cs[0];
    let err = c
        .all_reduce(&[1i32, 2], &mut [0i32; 3], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("send has 2 elements but recv has 3"),
        "{err}"
    );
    let err = c.broadcast(&[1u8], &mut [0u8], 2).unwrap_err();
    assert!(err.to_string().contains("root 2"), "{err}");
    let err = c.all_gather(&[1u8; 3], &mut [0u8; 5]).unwrap_err();
    assert!(
        err.to_string()
            .contains("recv has 5 elements but must have 6"),
        "{err}"
    );
    let err = c.all_gather_in_place(&mut [0u8; 5]).unwrap_err();
    assert!(err.to_string().contains("2 equal blocks"), "{err}");
    let err = c.send(&[1u8], 7).unwrap_err();
    assert!(err.to_string().contains("peer 7"), "{err}");
    assert!(c.failure().is_none());
    on_all(&cs, |c| c.barrier().unwrap());
}

#[test]
fn group_send_recv_in_both_directions_cannot_deadlock() {
    // Each rank sends far more than a FIFO holds to its neighbour while receiving from
    // the other neighbour, in one group.
    let cs = comms(4);
    let n = 4;
    let out = on_all(&cs, |c| {
        let r = c.rank();
        let send: Vec<u64> = (0..200_000).map(|i| (r * 1_000_000 + i) as u64).collect();
        let mut from_prev = vec![0u64; 200_000];
        let mut g = c.group();
        g.send(&send, (r + 1) % n).unwrap();
        g.recv(&mut from_prev, (r + n - 1) % n).unwrap();
        g.end().unwrap();
        from_prev
    });
    for (r, got) in out.iter().enumerate() {
        let prev = (r + n - 1) % n;
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, v)| *v == (prev * 1_000_000 + i) as u64)
        );
    }
}

#[test]
fn grouped_and_lone_sends_and_receives_agree_on_each_protocol() {
    // Rank 0 groups a small send (LL on its own) with a large receive (single copy
    // between threads of one process); its peers make the matching calls alone. Each
    // operation keeps its own protocol, so both ends of every FIFO agree.
    let cs = comms(3);
    let (small, large) = (2usize, 100_000usize);
    assert_eq!(
        cs[0]
            .choice_for(Collective::Send { peer: 1 }, small * 4)
            .protocol,
        Protocol::LL
    );
    assert_eq!(
        cs[0]
            .choice_for(Collective::Recv { peer: 2 }, large * 4)
            .protocol,
        Protocol::SingleCopy
    );
    let out = on_all(&cs, |c| match c.rank() {
        0 => {
            let (send, mut recv) = ([7u32; 2], vec![0u32; large]);
            let mut g = c.group();
            g.send(&send, 1).unwrap();
            g.recv(&mut recv, 2).unwrap();
            g.end().unwrap();
            recv
        }
        1 => {
            let mut recv = vec![0u32; small];
            c.recv(&mut recv, 0).unwrap();
            recv
        }
        _ => {
            let send: Vec<u32> = (0..large as u32).collect();
            c.send(&send, 0).unwrap();
            send
        }
    });
    assert_eq!(out[1], [7, 7]);
    assert_eq!(out[0], out[2]);
}

#[test]
fn split_makes_independent_sub_communicators() {
    let cs = comms(4);
    let out = on_all(&cs, |c| {
        // Even and odd ranks, in reverse order of rank.
        let sub = c
            .split(Some((c.rank() % 2) as u32), -(c.rank() as i32))
            .unwrap()
            .unwrap();
        let mut buf = [c.rank() as i64 + 1];
        sub.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        let none = c.split(None, 0).unwrap();
        assert!(none.is_none());
        (sub.rank(), sub.size(), buf[0])
    });
    // Ranks 0 and 2 sum 1 + 3; ranks 1 and 3 sum 2 + 4; the higher parent rank is 0.
    assert_eq!(out, [(1, 2, 4), (1, 2, 6), (0, 2, 4), (0, 2, 6)]);
}

#[test]
fn abort_fails_the_peers_that_wait() {
    let cs = comms(2);
    let out = on_all(&cs, |c| {
        if c.rank() == 1 {
            c.abort();
            let err = c.barrier().unwrap_err();
            assert!(matches!(err, Error::Aborted { .. }), "{err}");
            None
        } else {
            Some(c.barrier().unwrap_err())
        }
    });
    match &out[0] {
        Some(Error::PeerFailed {
            failed_rank: 1,
            detail,
            ..
        }) => {
            assert!(detail.contains("rank 1 aborted"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn asynchronous_calls_keep_issue_order_with_blocking_ones() {
    let cs: Vec<Arc<Communicator>> = comms(3).into_iter().map(Arc::new).collect();
    let out = on_all(&cs, |c| {
        let r = c.rank() as i64;
        // Issue two async all-reduces, then a blocking one, then another async one. If
        // any rank ran them out of order the sums (or the buffer sizes) would not match.
        let a = c.all_reduce_async(vec![r; 1000], ReduceOp::Sum).unwrap();
        let b = c.all_reduce_async(vec![10 * r; 7], ReduceOp::Max).unwrap();
        let mut blocking = [100 * r; 3];
        c.all_reduce_in_place(&mut blocking, ReduceOp::Sum).unwrap();
        let d = c
            .submit(|comm| {
                let mut v = [comm.rank() as u8 + 1];
                comm.all_reduce_in_place(&mut v, ReduceOp::Prod)?;
                Ok(v[0])
            })
            .unwrap();
        (
            a.wait().unwrap(),
            b.wait().unwrap(),
            blocking,
            d.wait().unwrap(),
        )
    });
    for (a, b, blocking, d) in out {
        assert_eq!(a, vec![3; 1000]);
        assert_eq!(b, vec![20; 7]);
        assert_eq!(blocking, [300; 3]);
        assert_eq!(d, 6);
    }
}

#[test]
fn windows_must_be_shared_memory_and_are_refused_alike_on_every_rank() {
    use crate::transport::window::SharedMemory;
    let cs = comms(2);
    // Rank 1's bytes are on the heap: both ranks fail, naming rank 1.
    let errs = on_all(&cs, |c| {
        let mut shared = SharedMemory::new(4096).unwrap();
        let mut heap = vec![0u8; 4096];
        let ptr = if c.rank() == 0 {
            shared.as_mut_slice().as_mut_ptr()
        } else {
            heap.as_mut_ptr()
        };
        // SAFETY: live memory of 4096 bytes, unused by calls.
        unsafe { c.register_window(ptr, 4096) }
            .unwrap_err()
            .to_string()
    });
    for e in errs {
        assert!(
            e.contains("rank 1: the window's 4096 bytes") && e.contains("not in one allocation"),
            "{e}"
        );
    }
    // Past its end is not inside it either.
    let errs = on_all(&cs, |c| {
        let shared = SharedMemory::new(4096).unwrap();
        // SAFETY: as above (the call fails before anything reads).
        unsafe { c.register_window(shared.as_ptr(), 4097) }
            .unwrap_err()
            .to_string()
    });
    assert!(errs.iter().all(|e| e.contains("rank 0:")), "{errs:?}");
    // A rank that cannot say which bytes (a binding could not lend its buffer) refuses
    // in turn: every rank fails with its reason rather than waiting for it, and the
    // registrations after line up again (below).
    let errs = on_all(&cs, |c| {
        let shared = SharedMemory::new(4096).unwrap();
        if c.rank() == 1 {
            c.refuse_window("its tensor is strided").to_string()
        } else {
            // SAFETY: as above.
            unsafe { c.register_window(shared.as_ptr(), 4096) }
                .unwrap_err()
                .to_string()
        }
    });
    for e in &errs {
        assert!(
            e.contains("registering a window: rank 1: its tensor is strided"),
            "{e}"
        );
    }
    // A window made on one communicator is not another's to end; calls still work.
    let windows = on_all(&cs, |c| {
        let shared = SharedMemory::new(1 << 20).unwrap();
        // SAFETY: the window keeps the memory mapped; no call uses it.
        unsafe { c.register_window(shared.as_ptr(), 1 << 20) }.unwrap()
    });
    let others = comms(2);
    let mut windows = windows.into_iter();
    let stray = windows.next().unwrap();
    let err = others[0].deregister_window(stray).unwrap_err().to_string();
    assert!(
        err.contains("not a live window of this communicator"),
        "{err}"
    );
    let out = on_all(&cs, |c| {
        let mut v = [c.rank() as u32 + 1];
        c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        v[0]
    });
    assert_eq!(out, [3, 3]);
}

/// A step whose FIFO was never made (the plan and the connections disagree: an internal
/// invariant, here broken on purpose by marking a new plan connected) fails the call
/// with the step and channel named, on every rank, instead of waiting on a FIFO that is
/// not there.
#[test]
fn a_step_without_its_fifo_fails_naming_it() {
    let cs = comms(3);
    let errors = on_all(&cs, |c| {
        let send = [1f32, 2.0];
        let mut recv = [0f32; 2];
        let raw = RawCall {
            collective: Collective::AllReduce,
            count: 2,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            input: send.as_ptr().cast(),
            output: recv.as_mut_ptr().cast(),
        };
        {
            let mut st = c.lock();
            let cached = c
                .single_plan(c.host_planner(0), &mut st.host_plans, &raw)
                .unwrap();
            // The one-shot sends to both peers; the ring made only the FIFO to the next.
            assert_eq!(cached.choice.algorithm, Algorithm::OneShot);
            st.host_plans.current_mut().unwrap().connected = true;
        }
        c.all_reduce(&send, &mut recv, ReduceOp::Sum)
            .unwrap_err()
            .to_string()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("engine: no connection for step") && e.contains("on channel 0"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn results_stay_right_while_trials_alternate_the_stores() {
    use crate::tune::stores::{LARGE, PAIRED_TRIAL_CALLS, PAIRED_TRIAL_FROM, SINGLE_TRIAL_CALLS};
    let cs = comms(2);
    // 2.4 KB (an LL call), 4 KiB (one slot), a prime count (400 KB), 2 MiB, and 8 MiB
    // (results streamed or not): five size groups, each tried once, out of place.
    let counts = [600usize, 1024, 100_003, 1 << 19, LARGE / 4];
    let trials = on_all(&cs, |c| {
        for &count in &counts {
            let calls = match count * 4 < LARGE {
                true => PAIRED_TRIAL_FROM + PAIRED_TRIAL_CALLS,
                false => 2 * SINGLE_TRIAL_CALLS,
            };
            for call in 0..calls as usize {
                let send: Vec<f32> = (0..count)
                    .map(|i| ((i + call) % 97 + c.rank()) as f32)
                    .collect();
                let mut recv = vec![0f32; count];
                c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                for (i, v) in recv.iter().enumerate() {
                    let want = (2 * ((i + call) % 97) + 1) as f32;
                    assert_eq!(*v, want, "count {count} call {call} [{i}]");
                }
            }
        }
        let st = c.lock();
        counts.map(|n| st.store_trial.trials_done(n * 4))
    });
    assert_eq!(trials, [[1; 5]; 2], "each rank ran one trial of each size");
}

#[test]
fn alternating_calls_keep_their_plans_and_stay_right() {
    let cs = comms(3);
    // Ten distinct calls, more than are kept, three times round; then two alternating.
    let counts = [0usize, 1, 2, 3, 7, 100, 1000, 4099, 10_007, 65_536];
    let run = |c: &Communicator, count: usize, round: usize| {
        let send: Vec<i32> = (0..count)
            .map(|i| (i * 7 + round + c.rank()) as i32)
            .collect();
        let mut recv = vec![-1i32; count];
        c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        for (i, v) in recv.iter().enumerate() {
            assert_eq!(
                *v,
                (3 * (i * 7 + round) + 3) as i32,
                "count {count} round {round} [{i}]"
            );
        }
    };
    let keys = on_all(&cs, |c| {
        for round in 0..3 {
            for &count in &counts {
                run(c, count, round);
            }
        }
        assert_eq!(c.lock().host_plans.keys().len(), PlanCache::KEPT);
        for round in 0..20 {
            run(c, 5, round);
            run(c, 1000, round);
        }
        c.lock().host_plans.keys()
    });
    let key = |count| (Collective::AllReduce, count, 4);
    for k in keys {
        assert_eq!(k.len(), PlanCache::KEPT);
        assert_eq!(
            k[..2],
            [key(1000), key(5)],
            "the two alternating calls, most recent first"
        );
        assert!(
            !k.contains(&key(1)),
            "the least recently used went first: {k:?}"
        );
    }
}

#[test]
fn two_ranks_with_a_core_each_exchange_ll_slots_and_stay_right() {
    // LL all-reduces long enough to move their slots (2 and 4 KiB, and a ring of many
    // slots), then short and odd ones that do not, in place and not, one-shot and ring,
    // with the slots exchanged and kept; the LL FIFOs pair where every rank has a core.
    for exchange in [true, false] {
        for algorithm in [Algorithm::OneShot, Algorithm::Ring] {
            let config = CommConfig {
                timeout: std::time::Duration::from_secs(30),
                slot_exchange: exchange,
                algorithms: vec![algorithm],
                protocols: vec![Protocol::LL],
                ..CommConfig::default()
            };
            let cs = Communicator::init_all_with(2, config).unwrap();
            on_all(&cs, |c| {
                for (call, count) in [512usize, 1024, 1, 7, 509, 1021, 100_003, 512]
                    .into_iter()
                    .enumerate()
                {
                    let what = format!("exchange {exchange}, {algorithm:?}, count {count}");
                    let send: Vec<i32> = (0..count)
                        .map(|i| ((i * 7 + call) % 101) as i32 - 50 + 3 * c.rank() as i32)
                        .collect();
                    let want: Vec<i32> = (0..count)
                        .map(|i| 2 * (((i * 7 + call) % 101) as i32 - 50) + 3)
                        .collect();
                    let mut recv = vec![0i32; count];
                    c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                    assert_eq!(recv, want, "{what}, out of place");
                    let mut inplace = send.clone();
                    c.all_reduce_in_place(&mut inplace, ReduceOp::Sum).unwrap();
                    assert_eq!(inplace, want, "{what}, in place");
                }
                let mut st = c.lock();
                let dedicated = !st.conns.oversubscribed();
                let (send, _) = st.conns.ends(0, Protocol::LL, Some(1 - c.rank()), None);
                assert_eq!(
                    send.expect("the LL FIFO").exchanges_slots(),
                    exchange && dedicated,
                    "rank {}, {algorithm:?}",
                    c.rank()
                );
            });
        }
    }
}

#[test]
fn two_ranks_exchange_slots_unless_told_not_to_and_stay_right_either_way() {
    // All-reduces (a ring of many slots each way, then prime and tiny counts) and
    // broadcasts (one way only, so the swaps stop for want of a free slot the other
    // way), in place and not, with the FIFOs' slots exchanged and kept.
    for exchange in [true, false] {
        let config = CommConfig {
            timeout: std::time::Duration::from_secs(30),
            slot_bytes: 4096,
            chunk_bytes: 4 * 4096,
            slot_exchange: exchange,
            algorithms: vec![Algorithm::Ring],
            ..CommConfig::default()
        };
        let cs = Communicator::init_all_with(2, config).unwrap();
        on_all(&cs, |c| {
            for (call, count) in [40_000usize, 100_003, 1, 7, 65_536, 40_000]
                .into_iter()
                .enumerate()
            {
                let send: Vec<f32> = (0..count)
                    .map(|i| ((i * 7 + call) % 101 + 3 * c.rank()) as f32)
                    .collect();
                let want: Vec<f32> = (0..count)
                    .map(|i| (2 * ((i * 7 + call) % 101) + 3) as f32)
                    .collect();
                let mut recv = vec![0f32; count];
                c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                assert_eq!(
                    recv, want,
                    "exchange {exchange}, count {count}, out of place"
                );
                let mut inplace = send.clone();
                c.all_reduce_in_place(&mut inplace, ReduceOp::Sum).unwrap();
                assert_eq!(
                    inplace, want,
                    "exchange {exchange}, count {count}, in place"
                );
                let root = call % 2;
                let mut b: Vec<u32> = (0..count as u32)
                    .map(|i| i ^ (c.rank() as u32 * 0x55))
                    .collect();
                let theirs: Vec<u32> = (0..count as u32)
                    .map(|i| i ^ (root as u32 * 0x55))
                    .collect();
                c.broadcast_in_place(&mut b, root).unwrap();
                assert_eq!(
                    b, theirs,
                    "exchange {exchange}, count {count}, broadcast from {root}"
                );
            }
            let mut st = c.lock();
            let peer = 1 - c.rank();
            let (send, _) = st.conns.ends(0, Protocol::Simple, Some(peer), None);
            assert_eq!(
                send.expect("the ring's FIFO").exchanges_slots(),
                exchange,
                "rank {}",
                c.rank()
            );
        });
    }
}

#[test]
fn results_stream_where_the_outputs_of_a_cpus_ranks_outgrow_its_caches() {
    use crate::types::DataType;
    // Addresses only: the decision never touches the buffers.
    let at = |offset: usize| std::ptr::null_mut::<u8>().wrapping_add(0x1000_0000 + offset);
    let call = |bytes: usize, in_place: bool| RawCall {
        collective: Collective::AllReduce,
        count: bytes / 4,
        dtype: DataType::Float32,
        op: ReduceOp::Sum,
        input: at(0),
        output: if in_place { at(0) } else { at(bytes) },
    };
    let (never, always, tried) = (
        ResultStreaming::Never,
        ResultStreaming::Always,
        ResultStreaming::AsTried,
    );
    let mib = 1 << 20;
    for (per_cpu, bytes, want) in [
        // A CPU of its own: the store trial decides from 8 MiB, as before.
        (1, 4 * mib, never),
        (1, 8 * mib, tried),
        (1, 128 * mib, tried),
        // Two ranks to a CPU (3 or 4 ranks on 2): from 4 MiB.
        (2, 2 * mib, never),
        (2, 4 * mib, always),
        (2, 8 * mib, tried),
        // Four (8 ranks on 2): from 2 MiB.
        (4, mib, never),
        (4, 2 * mib, always),
        (4, 4 * mib, always),
        (4, 32 * mib, tried),
    ] {
        let got = call(bytes, false).result_streaming(0, 8, per_cpu);
        assert_eq!(
            got, want,
            "{per_cpu} ranks to a CPU, {bytes} bytes out of place"
        );
        // In place, the input's lines are cached when the result replaces them.
        let got = call(bytes, true).result_streaming(0, 8, per_cpu);
        assert_eq!(
            got, never,
            "{per_cpu} ranks to a CPU, {bytes} bytes in place"
        );
    }
}

/// A rank whose single-copy call fails returns, and its caller may free the buffers it
/// published, while a peer of its process has yet to read them: the peer must fail
/// without reading (here the buffers are unmapped, so a read would fault). Three
/// threads, two-shot over single copy, after a call that made the FIFOs: ranks 0 and 1
/// time out waiting for rank 2, free their buffers, and only then does rank 2 call,
/// finding their pieces published.
#[test]
fn a_rank_that_failed_lets_no_peer_read_its_freed_buffers() {
    use crate::plan::Algorithm;
    use std::sync::Barrier;
    let config = CommConfig {
        timeout: std::time::Duration::from_millis(300),
        algorithms: vec![Algorithm::TwoShot],
        protocols: vec![Protocol::SingleCopy],
        ..CommConfig::default()
    };
    let cs = Communicator::init_all_with(3, config).unwrap();
    let count = 1 << 20;
    let freed = Barrier::new(3);
    let out = on_all(&cs, |c| {
        let mut whole = vec![1f32; count];
        c.all_reduce_in_place(&mut whole, ReduceOp::Sum).unwrap();
        assert!(whole.iter().all(|&x| x == 3.0));
        if c.rank() == 2 {
            freed.wait();
        }
        let bytes = count * std::mem::size_of::<f32>();
        let mut input = memmap2::MmapMut::map_anon(bytes).unwrap();
        let mut output = memmap2::MmapMut::map_anon(bytes).unwrap();
        input.fill(1);
        // SAFETY: the mappings are `bytes` long and page-aligned: `count` f32s each,
        // which live until the mappings are dropped below.
        let (send, recv) = unsafe {
            (
                std::slice::from_raw_parts(input.as_ptr().cast::<f32>(), count),
                std::slice::from_raw_parts_mut(output.as_mut_ptr().cast::<f32>(), count),
            )
        };
        let result = c.all_reduce(send, recv, ReduceOp::Sum);
        drop((input, output));
        if c.rank() != 2 {
            freed.wait();
        }
        result
    });
    for (rank, r) in out.iter().enumerate() {
        let err = r
            .as_ref()
            .expect_err("a call with a missing rank succeeded");
        assert!(err.to_string().contains("rank "), "rank {rank}: {err}");
    }
    assert!(
        matches!(out[2], Err(Error::PeerFailed { .. })),
        "rank 2 should find its peers gone: {:?}",
        out[2]
    );
}
