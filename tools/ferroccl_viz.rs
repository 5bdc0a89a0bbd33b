//! `ferroccl-viz`: see how collectives move data, from the plans the engine runs.
//!
//! ```text
//! ferroccl-viz ring --ranks 4                    # ring all-reduce, round by round
//! ferroccl-viz ring --ranks 4 --collective reduce_scatter
//! ferroccl-viz tree --ranks 8                    # double binary tree all-reduce
//! ferroccl-viz oneshot --ranks 4                 # one-shot all-reduce (also: twoshot)
//! ferroccl-viz all-gather --ranks 4 --algorithm oneshot
//! ferroccl-viz all-gather --ranks 4              # also: reduce-scatter, broadcast, reduce
//! ferroccl-viz ring --ranks 4 --html ring.html   # the same as an animated page
//! ferroccl-viz ring --ranks 4 --values 7         # random small values (seed 7)
//! ferroccl-viz simulate --topology topologies/this-machine.json --size 1G [--plot f.svg]
//! ferroccl-viz trace DIR [--svg timeline.svg] [--chrome trace.json]
//! ```

use std::process::ExitCode;

use ferroccl::plan::{Algorithm, Collective};
use ferroccl::viz::{self, html};

fn usage() -> &'static str {
    "usage:\n  ferroccl-viz ring|tree|oneshot|twoshot|reduce-scatter|all-gather|broadcast|reduce \
     --ranks N [--collective NAME] [--algorithm ring|tree|oneshot|twoshot] [--root R] \
     [--values SEED] [--html FILE]\n  ferroccl-viz simulate \
     --topology FILE.json [--size BYTES] [--plot FILE.svg]\n  ferroccl-viz trace DIR \
     [--svg FILE] [--chrome FILE]"
}

fn main() -> ExitCode {
    // Like other Unix filters, end quietly when the reader of our output goes away
    // (`ferroccl-viz ring | head`) instead of panicking on a broken pipe.
    // SAFETY: restoring the default action of SIGPIPE before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl-viz: {e}\n{}", usage());
            ExitCode::from(2)
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let Some(cmd) = args.first() else {
        return Err("no command".into());
    };
    match cmd.as_str() {
        "-h" | "--help" => {
            println!("{}", usage());
            Ok(())
        }
        "simulate" => ferroccl::viz::predict::command(&args[1..]),
        "trace" => {
            let dir = args.get(1).ok_or("trace needs a directory or file")?;
            ferroccl::viz::timeline::command(dir, &args[2..])
        }
        _ => table_command(cmd, &args[1..]),
    }
}

fn table_command(cmd: &str, args: &[String]) -> Result<(), String> {
    let opts = viz::Options::parse(
        args,
        &["ranks", "collective", "algorithm", "root", "values", "html"],
    )?;
    let get = |k: &str| opts.get(k);
    let ranks: usize = get("ranks")
        .unwrap_or("4")
        .parse()
        .map_err(|_| "--ranks needs a number")?;
    let root: usize = get("root")
        .unwrap_or("0")
        .parse()
        .map_err(|_| "--root needs a number")?;
    if root >= ranks {
        return Err(format!("--root {root} is not one of the {ranks} ranks"));
    }
    let (default, algorithm) = match cmd {
        "ring" => ("all_reduce", Algorithm::Ring),
        "tree" => ("all_reduce", Algorithm::Tree),
        "oneshot" => ("all_reduce", Algorithm::OneShot),
        "twoshot" => ("all_reduce", Algorithm::TwoShot),
        "reduce-scatter" => ("reduce_scatter", Algorithm::Ring),
        "all-gather" => ("all_gather", Algorithm::Ring),
        "broadcast" => ("broadcast", Algorithm::Ring),
        "reduce" => ("reduce", Algorithm::Ring),
        other => return Err(format!("unknown command {other:?}")),
    };
    let algorithm = match get("algorithm") {
        None => algorithm,
        Some(name) => Algorithm::named(name).ok_or_else(|| {
            format!("unknown algorithm {name:?} (ring, tree, oneshot or twoshot)")
        })?,
    };
    let collective = viz::collective_named(get("collective").unwrap_or(default), root)
        .map_err(|e| e.to_string())?;
    if !algorithm.applies_to(collective) {
        return Err(format!(
            "{} has no {} plan",
            collective.name(),
            algorithm.name()
        ));
    }
    let table = match get("values") {
        None => viz::step_table(collective, algorithm, ranks),
        Some(seed) => {
            let seed: u64 = seed
                .parse()
                .map_err(|_| "--values needs a seed (a number)")?;
            viz::step_table_seeded(collective, algorithm, ranks, seed)
        }
    }
    .map_err(|e| e.to_string())?;
    print!("{}", table.render_text());
    if collective.is_reducing() || matches!(collective, Collective::AllGather) {
        print!(
            "{}",
            viz::bytes_summary(collective, algorithm, ranks).map_err(|e| e.to_string())?
        );
    }
    if let Some(path) = get("html") {
        std::fs::write(path, html::page(&table)).map_err(|e| format!("write {path}: {e}"))?;
        println!("\nwrote {path}");
    }
    Ok(())
}
