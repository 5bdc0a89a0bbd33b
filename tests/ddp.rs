//! The data-parallel invariant: after k steps, N ranks with per-rank batch B hold the
//! weights one rank gets training on the whole batch N·B (to float tolerance), and the
//! N ranks' weights are bitwise identical at every step.

use std::time::Duration;

use ferroccl::Communicator;
use ferroccl::comm::CommConfig;
use ferroccl::ddp::mlp::Mlp;
use ferroccl::ddp::{Compression, Parameters, Reducer, ReducerOptions};
use ferroccl::pg::{PgOptions, ProcessGroup};

const WIDTHS: [usize; 4] = [16, 32, 24, 5];
const STEPS: usize = 6;
const LR: f32 = 0.2;

/// Example `i` of step `step`: deterministic inputs and labels.
fn example(step: usize, i: usize) -> (Vec<f32>, usize) {
    let x = (0..WIDTHS[0])
        .map(|j| (((step * 131 + i * 17 + j * 7) % 23) as f32 - 11.0) / 11.0)
        .collect();
    (x, (step * 7 + i * 3) % WIDTHS[3])
}

fn batch(step: usize, range: std::ops::Range<usize>) -> (Vec<f32>, Vec<usize>) {
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for i in range {
        let (x, y) = example(step, i);
        xs.extend(x);
        ys.push(y);
    }
    (xs, ys)
}

/// One rank, whole batches of `n * b`.
fn reference(n: usize, b: usize) -> Vec<Vec<f32>> {
    let mut m = Mlp::new(&WIDTHS, 42);
    for step in 0..STEPS {
        let (x, y) = batch(step, 0..n * b);
        m.forward(&x, n * b);
        m.backward(&y, false, |_, _| {});
        m.sgd_step(LR);
    }
    (0..m.count()).map(|i| m.param(i).to_vec()).collect()
}

/// `n` ranks, batch `b` each; returns every rank's final weights and per-step hashes.
fn data_parallel(n: usize, b: usize, options: ReducerOptions) -> Vec<(Vec<Vec<f32>>, Vec<u64>)> {
    let config = CommConfig {
        timeout: Duration::from_secs(60),
        ..CommConfig::default()
    };
    let pgs: Vec<ProcessGroup> = Communicator::init_all_with(n, config)
        .unwrap()
        .into_iter()
        .map(|c| ProcessGroup::from_communicator(c, "default", PgOptions::default()).unwrap())
        .collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = pgs
            .iter()
            .map(|pg| {
                let options = options.clone();
                let overlap = options.overlap;
                s.spawn(move || {
                    // Different seeds: the broadcast from rank 0 must make them equal.
                    let mut m = Mlp::new(&WIDTHS, 42 + pg.rank() as u64);
                    let mut reducer = Reducer::new(pg, &m.lengths(), options).unwrap();
                    reducer.broadcast_parameters(&mut m).unwrap();
                    let mut hashes = Vec::new();
                    for step in 0..STEPS {
                        let r = pg.rank();
                        let (x, y) = batch(step, r * b..(r + 1) * b);
                        m.forward(&x, b);
                        let mut err = None;
                        m.backward(&y, false, |p, g| {
                            if let Err(e) = reducer.mark_ready(p, g) {
                                err.get_or_insert(e);
                            }
                        });
                        assert!(err.is_none(), "{err:?}");
                        // With overlap every full bucket is already on its way before
                        // finish; without, none is.
                        let in_flight = reducer.buckets_in_flight();
                        let buckets = reducer.bucket_layout().len();
                        assert_eq!(in_flight, if overlap { buckets } else { 0 });
                        reducer.finish(&mut m).unwrap();
                        m.sgd_step(LR);
                        hashes.push(m.weights_hash());
                    }
                    (
                        (0..m.count()).map(|i| m.param(i).to_vec()).collect(),
                        hashes,
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Largest difference between two weight sets, relative to the largest weight.
fn difference_to_scale(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = b.iter().flatten().map(|x| x.abs()).fold(0.0, f32::max);
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

fn max_relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn n_ranks_with_batch_b_equal_one_rank_with_batch_n_b() {
    for n in [2, 4] {
        let b = 6;
        let want = reference(n, b);
        // Small buckets: several per step, launched while backward still runs.
        let options = ReducerOptions {
            first_bucket_bytes: 512,
            bucket_bytes: 2048,
            ..ReducerOptions::default()
        };
        let ranks = data_parallel(n, b, options);
        for (r, (weights, hashes)) in ranks.iter().enumerate() {
            assert_eq!(
                hashes, &ranks[0].1,
                "rank {r} diverged from rank 0 (bitwise)"
            );
            let d = max_relative_difference(weights, &want);
            assert!(
                d < 1e-4,
                "n {n} rank {r}: weights differ from one rank by {d}"
            );
        }
    }
}

#[test]
fn buckets_fill_in_reverse_order_and_overlap_can_be_turned_off() {
    let m = Mlp::new(&WIDTHS, 1);
    let pgs: Vec<ProcessGroup> = Communicator::init_all(1)
        .unwrap()
        .into_iter()
        .map(|c| ProcessGroup::from_communicator(c, "default", PgOptions::default()).unwrap())
        .collect();
    let lengths = m.lengths();
    // Lengths 512, 32, 768, 24, 120, 5 floats, taken last first: the first bucket
    // (256 B = 64 floats) holds only the 5; the next (4 KiB) 120 + 24 + 768 + 32; the
    // 512 starts a third.
    let r = Reducer::new(
        &pgs[0],
        &lengths,
        ReducerOptions {
            first_bucket_bytes: 256,
            bucket_bytes: 4096,
            ..ReducerOptions::default()
        },
    )
    .unwrap();
    assert_eq!(r.bucket_layout(), vec![vec![5], vec![4, 3, 2, 1], vec![0]]);
    // Without overlap, or with bf16 compression, the invariant still holds (bf16 to
    // its precision), and ranks stay bitwise identical.
    for (options, tolerance) in [
        (
            ReducerOptions {
                overlap: false,
                ..ReducerOptions::default()
            },
            1e-5,
        ),
        (
            ReducerOptions {
                compression: Compression::Bf16,
                ..ReducerOptions::default()
            },
            // bf16 keeps 8 bits of mantissa (0.4 %); six steps of rounded gradients
            // move the weights about 1 % of the largest one.
            0.03,
        ),
    ] {
        let want = reference(2, 4);
        let ranks = data_parallel(2, 4, options.clone());
        assert_eq!(ranks[0].1, ranks[1].1, "{options:?}");
        let d = difference_to_scale(&ranks[0].0, &want);
        assert!(d < tolerance, "{options:?}: {d}");
    }
}

#[test]
fn unready_gradients_are_an_error_not_a_hang() {
    let pgs: Vec<ProcessGroup> = Communicator::init_all(1)
        .unwrap()
        .into_iter()
        .map(|c| ProcessGroup::from_communicator(c, "default", PgOptions::default()).unwrap())
        .collect();
    let mut m = Mlp::new(&WIDTHS, 1);
    let mut r = Reducer::new(&pgs[0], &m.lengths(), ReducerOptions::default()).unwrap();
    let g = vec![0.0f32; m.lengths()[5]];
    r.mark_ready(5, &g).unwrap();
    assert!(
        r.mark_ready(5, &g)
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
    let e = r.finish(&mut m).unwrap_err().to_string();
    assert!(
        e.contains("[0, 1, 2, 3, 4]") && e.contains("never marked ready"),
        "{e}"
    );
    // no_sync: nothing is exchanged and the gradients are left as they are.
    let mut r = Reducer::new(&pgs[0], &m.lengths(), ReducerOptions::default()).unwrap();
    r.no_sync(true);
    m.grad(0)[0] = 7.0;
    r.mark_ready(0, &[1.0]).unwrap();
    r.finish(&mut m).unwrap();
    assert_eq!(m.grad(0)[0], 7.0);
}

#[test]
fn the_example_learns_the_digits_on_four_ranks() {
    // examples/ddp_train, built by `cargo test` next to this test, started by ferrorun.
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("examples/ddp_train"))
        .unwrap();
    assert!(example.exists(), "{} not built", example.display());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrorun"))
        .args(["--nproc-per-node", "4", "--no-prefix"])
        .arg(&example)
        .args(["--epochs", "30"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("final test accuracy"))
        .unwrap_or_else(|| panic!("no summary in:\n{stdout}"));
    let accuracy: f64 = line["final test accuracy ".len()..]
        .split('%')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(accuracy >= 90.0, "{line}");
    assert!(stdout.contains("4 rank(s)"), "{stdout}");
}
