//! ProcessGroup, Work, DeviceMesh, the desync check and the watchdog, on ranks that are
//! threads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroccl::comm::CommConfig;
use ferroccl::pg::{DeviceMesh, PgOptions, ProcessGroup};
use ferroccl::{Communicator, ReduceOp};

fn groups(n: usize, options: PgOptions) -> Vec<ProcessGroup> {
    let config = CommConfig {
        timeout: Duration::from_secs(120),
        ..CommConfig::default()
    };
    Communicator::init_all_with(n, config)
        .unwrap()
        .into_iter()
        .map(|c| ProcessGroup::from_communicator(c, "default", options.clone()).unwrap())
        .collect()
}

/// Runs `f` on every rank's group, one thread each; returns the results by rank.
fn on_ranks<T: Send>(pgs: &[ProcessGroup], f: impl Fn(&ProcessGroup) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = pgs.iter().map(|pg| s.spawn(|| f(pg))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn work_waits_times_out_and_reports_failures() {
    let pgs = groups(3, PgOptions::default());
    // Every collective hands its buffer back through the Work, in issue order.
    let out = on_ranks(&pgs, |pg| {
        let r = pg.rank() as i64;
        let a = pg.all_reduce(vec![r; 1000], ReduceOp::Sum).unwrap();
        let b = pg.broadcast(vec![r * 10; 5], 2).unwrap();
        let c = pg.all_gather(vec![r; 2]).unwrap();
        let d = pg.reduce_scatter(vec![r + 1; 6], ReduceOp::Max).unwrap();
        let e = pg.all_to_all((0..3).map(|j| r * 10 + j).collect()).unwrap();
        assert_eq!((a.seq(), e.seq()), (0, 4));
        let g = pg.gather(vec![r + 5], 1).unwrap();
        let root_data: Vec<i64> = if r == 0 {
            vec![7, 8, 9, 10, 11, 12]
        } else {
            Vec::new()
        };
        let sc = pg.scatter(root_data, 2, 0).unwrap();
        let (g, sc) = (g.wait().unwrap(), sc.wait().unwrap());
        assert_eq!(g, if r == 1 { vec![5, 6, 7] } else { vec![] });
        assert_eq!(sc, vec![7 + 2 * r, 8 + 2 * r]);
        (
            a.wait().unwrap(),
            b.wait().unwrap(),
            c.wait().unwrap(),
            d.wait().unwrap(),
            e.wait().unwrap(),
        )
    });
    for (r, (a, b, c, d, e)) in out.into_iter().enumerate() {
        assert!(a.iter().all(|&x| x == 3));
        assert_eq!(b, vec![20; 5]);
        assert_eq!(c, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(d, vec![3, 3]);
        assert_eq!(e, (0..3).map(|i| i * 10 + r as i64).collect::<Vec<_>>());
    }
    // A call some rank has not made yet: not completed, wait_timeout gives it back.
    let out = on_ranks(&pgs, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let mut w = pg.all_reduce(vec![1u32; 10], ReduceOp::Sum).unwrap();
        let early = pg.rank() == 0 && !w.is_completed() && !w.is_success();
        let w = match w.wait_timeout(Duration::from_millis(50)) {
            Ok(r) => {
                assert_ne!(pg.rank(), 0, "rank 0 cannot finish before rank 1 starts");
                return (early, r.unwrap());
            }
            Err(w) => w,
        };
        (early, w.wait().unwrap())
    });
    assert!(out[0].0, "rank 0's call was still running at first");
    assert!(out.iter().all(|(_, v)| v == &vec![3u32; 10]));
    // A failure shows up as an exception: rank 2 aborts, the others' call fails.
    let out = on_ranks(&pgs, |pg| {
        if pg.rank() == 2 {
            pg.abort();
            return None;
        }
        let mut w = pg.all_reduce(vec![1.0f32; 64], ReduceOp::Sum).unwrap();
        while !w.is_completed() {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!w.is_success());
        w.exception()
    });
    for e in out.into_iter().take(2) {
        let e = e.expect("an exception");
        assert!(e.contains("rank 2"), "{e}");
    }
}

#[test]
fn device_mesh_groups_and_sums_along_each_dimension() {
    for (shape, names) in [
        (vec![2usize, 4], vec!["dp", "tp"]),
        (vec![2, 2, 2], vec!["pp", "dp", "tp"]),
    ] {
        let n: usize = shape.iter().product();
        let pgs = groups(n, PgOptions::default());
        let out = on_ranks(&pgs, |pg| {
            let mesh = DeviceMesh::new(pg, &shape, &names).unwrap();
            let me = mesh.my_coordinates();
            assert_eq!(mesh.rank_at(&me).unwrap(), pg.rank());
            let mut sums = Vec::new();
            for (d, name) in names.iter().enumerate() {
                let g = mesh.get_group(name).unwrap();
                assert_eq!(g.size(), shape[d], "{name}");
                assert_eq!(
                    g.rank(),
                    me[d],
                    "{name}: rank in the group is the coordinate"
                );
                let v = g
                    .all_reduce(vec![pg.rank() as u64], ReduceOp::Sum)
                    .unwrap()
                    .wait()
                    .unwrap();
                sums.push(v[0]);
            }
            assert!(mesh.get_group("nope").is_err());
            (me, sums)
        });
        for (rank, (me, sums)) in out.iter().enumerate() {
            for (d, sum) in sums.iter().enumerate() {
                // The ranks of my slice along d: my coordinates with d varying.
                let want: u64 = (0..shape[d])
                    .map(|k| {
                        let mut c = me.clone();
                        c[d] = k;
                        c.iter().zip(&shape).fold(0, |acc, (c, s)| acc * s + c) as u64
                    })
                    .sum();
                assert_eq!(*sum, want, "rank {rank} dimension {}", names[d]);
            }
        }
    }
}

#[test]
fn desync_check_names_the_ranks_and_both_calls() {
    let options = PgOptions {
        desync_debug: true,
        timeout: Duration::from_secs(30),
        ..PgOptions::default()
    };
    let pgs = groups(4, options);
    let out = on_ranks(&pgs, |pg| {
        // One matching call first, then rank 2 calls all_gather where the others
        // call all_reduce.
        pg.all_reduce(vec![1i32; 8], ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        // A send and its receive are a pair, not a desync (and involve two ranks only).
        match pg.rank() {
            0 => drop(pg.send(vec![5u8; 3], 3).unwrap().wait().unwrap()),
            3 => assert_eq!(pg.recv(vec![0u8; 3], 0).unwrap().wait().unwrap(), [5, 5, 5]),
            _ => {}
        }
        let r = if pg.rank() == 2 {
            pg.all_gather(vec![1i32; 8]).map(|_| ())
        } else {
            pg.all_reduce(vec![1i32; 8], ReduceOp::Sum).map(|_| ())
        };
        r.unwrap_err().to_string()
    });
    for e in out {
        assert!(e.contains("desync at #1"), "{e}");
        assert!(
            e.contains("ranks [0, 1, 3] called all_reduce(count 8, int32, sum)"),
            "{e}"
        );
        assert!(
            e.contains("ranks [2] called all_gather(count 8, int32)"),
            "{e}"
        );
    }
}

#[test]
fn watchdog_names_the_rank_that_stopped_and_every_rank_dumps() {
    let dir = tempfile::tempdir().unwrap();
    let options = PgOptions {
        timeout: Duration::from_millis(800),
        dump_dir: dir.path().to_path_buf(),
        ..PgOptions::default()
    };
    let pgs = groups(3, options);
    let start = Instant::now();
    let out = on_ranks(&pgs, |pg| {
        for _ in 0..3 {
            pg.all_reduce(vec![1.0f32; 100], ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
        }
        if pg.rank() == 1 {
            // Rank 1 stops calling collectives (but its process lives on).
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        let w = pg.all_reduce(vec![1.0f32; 100], ReduceOp::Sum).unwrap();
        Some(w.wait().unwrap_err().to_string())
    });
    assert!(start.elapsed() < Duration::from_secs(20));
    for e in out.into_iter().flatten() {
        assert!(e.contains("#3") && e.contains("watchdog"), "{e}");
        assert!(e.contains("waiting on ranks [1]"), "{e}");
    }
    // Every rank dumped its recorder, with the stuck call's sequence number.
    let deadline = Instant::now() + Duration::from_secs(5);
    for rank in 0..3 {
        let file = dir
            .path()
            .join(format!("ferroccl-fr-default-rank{rank}.json"));
        while !file.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).expect("a dump")).unwrap();
        assert_eq!(doc["stuck_seq"], 3, "rank {rank}: {doc}");
        let entries = doc["entries"].as_array().unwrap();
        let completed = entries.iter().filter(|e| e["state"] == "completed").count();
        assert_eq!(completed, 3, "rank {rank}: {doc}");
        if rank != 1 {
            assert!(entries.iter().any(|e| e["seq"] == 3), "rank {rank}: {doc}");
        }
    }
    drop(Arc::new(pgs));
}

#[test]
fn new_group_takes_the_listed_ranks_in_order() {
    let pgs = groups(4, PgOptions::default());
    let out = on_ranks(&pgs, |pg| {
        let g = pg.new_group(&[3, 1]).unwrap();
        let r = g.as_ref().map(|g| {
            let v = g
                .all_reduce(vec![pg.rank() as u32], ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
            (g.rank(), g.size(), v[0])
        });
        assert!(pg.new_group(&[0, 0]).is_err());
        pg.barrier().unwrap();
        r
    });
    assert_eq!(out, vec![None, Some((1, 2, 4)), None, Some((0, 2, 4))]);
}
