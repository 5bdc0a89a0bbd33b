//! Four ranks all-reduce a vector: `cargo run --example all_reduce`.
//!
//! The ranks are threads of this process (`Communicator::init_all`); the same code runs
//! as separate processes with `Communicator::from_env()` under `ferrorun`.

use ferroccl::{Communicator, ReduceOp};

// ANCHOR: collective
fn main() -> ferroccl::Result<()> {
    let comms = Communicator::init_all(4)?;
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || -> ferroccl::Result<String> {
                    let rank = comm.rank();
                    // Rank r contributes [r, 10r, 100r]; everyone gets the sums.
                    let mine = [rank as f32, 10.0 * rank as f32, 100.0 * rank as f32];
                    let mut sum = [0.0f32; 3];
                    comm.all_reduce(&mine, &mut sum, ReduceOp::Sum)?;
                    Ok(format!("rank {rank}: sent {mine:?}, all-reduced {sum:?}"))
                })
            })
            .collect();
        for rank in ranks {
            println!("{}", rank.join().expect("rank thread panicked")?);
        }
        Ok(())
    })
}
// ANCHOR_END: collective
