//! Data-parallel training of a small MLP on the UCI handwritten digits (1 797 images of
//! 8×8 pixels, `data/digits.csv.gz`), with ferroccl's `ProcessGroup` and `Reducer`.
//!
//! ```text
//! cargo build --release --example ddp_train --bin ferrorun
//! target/release/examples/ddp_train                                  # 1 rank
//! target/release/ferrorun --nproc-per-node 4 target/release/examples/ddp_train
//! target/release/ferrorun --nproc-per-node 4 target/release/examples/ddp_train --no-overlap
//! ```
//!
//! Every rank trains on its shard of each epoch (`DistributedSampler`); backward hands
//! each gradient to the reducer as soon as it is final, and full buckets are all-reduced
//! while backward goes on. Per epoch, rank 0 prints the loss, train and test accuracy,
//! and the time per step split into compute and exposed communication (time spent
//! waiting for all-reduces after backward). Options: `--epochs N` (40), `--batch B` per
//! rank (32), `--lr X` (0.1), `--hidden H` (256), `--bucket-kib K` (64),
//! `--no-overlap`, `--bf16`.

use std::io::Read;
use std::time::{Duration, Instant};

use ferroccl::ddp::mlp::Mlp;
use ferroccl::ddp::{Compression, DistributedSampler, Reducer, ReducerOptions};
use ferroccl::pg::{PgOptions, ProcessGroup};
use ferroccl::{Communicator, ReduceOp};

struct Digits {
    x: Vec<f32>,
    y: Vec<usize>,
}

fn load() -> Result<Digits, String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz");
    let file = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .map_err(|e| format!("{path}: {e}"))?;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for (n, line) in text.lines().enumerate() {
        let v: Vec<f32> = line
            .split(',')
            .map(|t| t.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{path}: line {}: {e}", n + 1))?;
        if v.len() != 65 {
            return Err(format!(
                "{path}: line {} has {} fields, not 65",
                n + 1,
                v.len()
            ));
        }
        x.extend(v[..64].iter().map(|p| p / 16.0));
        y.push(v[64] as usize);
    }
    Ok(Digits { x, y })
}

struct Args {
    epochs: usize,
    batch: usize,
    lr: f32,
    hidden: usize,
    bucket_kib: usize,
    overlap: bool,
    bf16: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        epochs: 40,
        batch: 32,
        lr: 0.1,
        hidden: 256,
        bucket_kib: 64,
        overlap: true,
        bf16: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--epochs" => a.epochs = value()?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--batch" => a.batch = value()?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--lr" => a.lr = value()?.parse().map_err(|e| format!("--lr: {e}"))?,
            "--hidden" => a.hidden = value()?.parse().map_err(|e| format!("--hidden: {e}"))?,
            "--bucket-kib" => {
                a.bucket_kib = value()?.parse().map_err(|e| format!("--bucket-kib: {e}"))?
            }
            "--no-overlap" => a.overlap = false,
            "--bf16" => a.bf16 = true,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.batch == 0 || a.epochs == 0 || a.bucket_kib == 0 {
        return Err("--epochs, --batch and --bucket-kib must be positive".into());
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ddp_train: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = args()?;
    let data = load()?;
    let e = |e: ferroccl::Error| e.to_string();
    // Under a launcher (ferrorun, torchrun) every rank joins through env://; started
    // alone, it is a one-rank job.
    let pg = if std::env::var_os("RANK").is_some() {
        ProcessGroup::init_from_env(PgOptions::from_env().map_err(e)?).map_err(e)?
    } else {
        let comm = Communicator::init_all(1)
            .map_err(e)?
            .pop()
            .expect("one rank");
        ProcessGroup::from_communicator(comm, "default", PgOptions::from_env().map_err(e)?)
            .map_err(e)?
    };
    let (rank, world) = (pg.rank(), pg.size());
    // A fixed split: 1 437 images to train on, 360 to test, the same on every rank.
    let order = DistributedSampler::new(data.y.len(), 1, 0, true, 2024, false)
        .map_err(e)?
        .indices();
    let (train, test) = order.split_at(1437);
    let mut model = Mlp::new(&[64, args.hidden, args.hidden / 2, 10], 7);
    let options = ReducerOptions {
        first_bucket_bytes: args.bucket_kib << 10,
        bucket_bytes: args.bucket_kib << 10,
        overlap: args.overlap,
        compression: if args.bf16 {
            Compression::Bf16
        } else {
            Compression::None
        },
    };
    let mut reducer = Reducer::new(&pg, &model.lengths(), options).map_err(e)?;
    reducer.broadcast_parameters(&mut model).map_err(e)?;
    let mut sampler =
        DistributedSampler::new(train.len(), world, rank, true, 1, true).map_err(e)?;
    if rank == 0 {
        println!(
            "ddp_train: {world} rank(s), batch {} per rank ({} in all), {} buckets, overlap {}, {}",
            args.batch,
            args.batch * world,
            reducer.bucket_layout().len(),
            if args.overlap { "on" } else { "off" },
            if args.bf16 {
                "bf16 gradients"
            } else {
                "f32 gradients"
            }
        );
        println!(
            "epoch   loss  train%   test%  epoch(ms)  compute(ms/step)  exposed comm(ms/step)"
        );
    }
    let gather = |xs: &[usize]| -> (Vec<f32>, Vec<usize>) {
        let mut x = Vec::with_capacity(xs.len() * 64);
        let mut y = Vec::with_capacity(xs.len());
        for &i in xs {
            x.extend_from_slice(&data.x[i * 64..(i + 1) * 64]);
            y.push(data.y[i]);
        }
        (x, y)
    };
    let (mut total, mut all_compute, mut all_comm, mut all_steps) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO, 0usize);
    for epoch in 0..args.epochs {
        sampler.set_epoch(epoch as u64);
        let mine: Vec<usize> = sampler.indices().iter().map(|&i| train[i]).collect();
        let start = Instant::now();
        let (mut compute, mut comm) = (Duration::ZERO, Duration::ZERO);
        let (mut loss_sum, mut correct, mut seen, mut steps) = (0.0f64, 0usize, 0usize, 0usize);
        for chunk in mine.chunks(args.batch) {
            let t = Instant::now();
            let (x, y) = gather(chunk);
            model.forward(&x, y.len());
            loss_sum += model.loss(&y) as f64 * y.len() as f64;
            correct += model.correct(&y);
            seen += y.len();
            let mut failure = None;
            model.backward(&y, false, |p, g| {
                if let Err(err) = reducer.mark_ready(p, g) {
                    failure.get_or_insert(err);
                }
            });
            if let Some(err) = failure {
                return Err(err.to_string());
            }
            compute += t.elapsed();
            comm += reducer.finish(&mut model).map_err(e)?.exposed_comm;
            model.sgd_step(args.lr);
            steps += 1;
        }
        let epoch_time = start.elapsed();
        total += epoch_time;
        all_compute += compute;
        all_comm += comm;
        all_steps += steps;
        // Epoch statistics over all ranks.
        let stats = pg
            .all_reduce(vec![loss_sum, correct as f64, seen as f64], ReduceOp::Sum)
            .map_err(e)?
            .wait()
            .map_err(e)?;
        let (tx, ty) = gather(test);
        model.forward(&tx, ty.len());
        let test_acc = model.correct(&ty) as f64 / ty.len() as f64;
        // The weights must be identical on every rank.
        let hash = model.weights_hash();
        let hashes = pg.all_gather(vec![hash]).map_err(e)?.wait().map_err(e)?;
        if hashes.iter().any(|&h| h != hash) {
            return Err(format!(
                "epoch {epoch}: weights differ across ranks: {hashes:x?}"
            ));
        }
        if rank == 0 {
            println!(
                "{:>5} {:>6.3} {:>7.2} {:>7.2} {:>10.1} {:>17.3} {:>22.3}",
                epoch + 1,
                stats[0] / stats[2],
                100.0 * stats[1] / stats[2],
                100.0 * test_acc,
                epoch_time.as_secs_f64() * 1e3,
                compute.as_secs_f64() * 1e3 / steps as f64,
                comm.as_secs_f64() * 1e3 / steps as f64,
            );
        }
    }
    if rank == 0 {
        let (tx, ty) = gather(test);
        model.forward(&tx, ty.len());
        println!(
            "final test accuracy {:.2}% after {} epochs; {:.1} ms per epoch, per step {:.3} ms \
             compute and {:.3} ms exposed communication (averages); weights hash {:016x} on \
             every rank",
            100.0 * model.correct(&ty) as f64 / ty.len() as f64,
            args.epochs,
            total.as_secs_f64() * 1e3 / args.epochs as f64,
            all_compute.as_secs_f64() * 1e3 / all_steps as f64,
            all_comm.as_secs_f64() * 1e3 / all_steps as f64,
            model.weights_hash()
        );
    }
    pg.destroy().map_err(e)?;
    Ok(())
}
