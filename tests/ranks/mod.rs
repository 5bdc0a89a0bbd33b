//! For test binaries that are their own rank program (`tests/processes.rs`,
//! `tests/faults.rs`): the parent, run by `cargo test`, starts copies of the binary with
//! `FERROCCL_TEST_ROLE` set, so such a binary has no libtest harness. This module is its
//! harness (filters, libtest's summary line) and the parent's process handling.

#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// A test: `Err` carries the failure message.
pub type TestFn = Box<dyn Fn() -> Result<(), String>>;

/// A test that captures nothing.
pub type PlainTest = fn() -> Result<(), String>;

/// The parent's `main`: runs the tests whose names contain one of the command line's
/// filters (all without filters) and none of its `--skip` names, and prints libtest's
/// lines.
pub fn run_tests(tests: Vec<(String, TestFn)>) -> ExitCode {
    // libtest's arguments: names to run (substrings, or whole with `--exact`), names to
    // skip (`--skip NAME`); other flags (`--nocapture`, `--test-threads N`, …) change
    // nothing here.
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--skip" => skips.extend(args.next()),
            "--test-threads" | "--color" | "--format" | "-Z" => {
                args.next();
            }
            _ if a.starts_with('-') => {}
            _ => filters.push(a),
        }
    }
    let exact = std::env::args().any(|a| a == "--exact");
    let start = Instant::now();
    let (mut passed, mut failed, mut filtered) = (0, 0, 0);
    for (name, test) in tests {
        let matches = |f: &String| {
            if exact {
                name == *f
            } else {
                name.contains(f.as_str())
            }
        };
        let chosen =
            (filters.is_empty() || filters.iter().any(matches)) && !skips.iter().any(matches);
        if !chosen {
            filtered += 1;
            continue;
        }
        let t = Instant::now();
        match test() {
            Ok(()) => {
                passed += 1;
                println!("test {name} ... ok ({:.1?})", t.elapsed());
            }
            Err(e) => {
                failed += 1;
                println!("test {name} ... FAILED\n{e}");
            }
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {failed} failed; 0 ignored; 0 measured; \
         {filtered} filtered out; finished in {:.2}s\n",
        if failed == 0 { "ok" } else { "FAILED" },
        start.elapsed().as_secs_f64()
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A command that runs this binary again as a rank with `role`, output piped.
pub fn rank_command(role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env("FERROCCL_TEST_ROLE", role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// How a child ended.
pub struct Ended {
    /// Its exit code, or `None` when a signal ended it.
    pub code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// When the parent saw it end.
    pub at: Instant,
    /// What it printed.
    pub stdout: String,
    /// What it printed on stderr.
    pub stderr: String,
}

/// Waits for every child, noting when each ended; kills those still running after
/// `limit` and names them in the error.
pub fn wait_all(mut children: Vec<Child>, limit: Duration) -> Result<Vec<Ended>, String> {
    use std::os::unix::process::ExitStatusExt;
    let deadline = Instant::now() + limit;
    let mut ended: Vec<Option<Ended>> = children.iter().map(|_| None).collect();
    // Drain the pipes as they fill, so a chatty child never blocks on a full pipe.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let (mut out, mut err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
            (
                std::thread::spawn(move || {
                    let mut s = String::new();
                    out.read_to_string(&mut s).ok();
                    s
                }),
                std::thread::spawn(move || {
                    let mut s = String::new();
                    err.read_to_string(&mut s).ok();
                    s
                }),
            )
        })
        .collect();
    let mut statuses = vec![None; children.len()];
    while statuses.iter().any(Option::is_none) {
        for (i, child) in children.iter_mut().enumerate() {
            if statuses[i].is_none()
                && let Some(s) = child.try_wait().map_err(|e| e.to_string())?
            {
                statuses[i] = Some((s, Instant::now()));
            }
        }
        if Instant::now() > deadline {
            let running: Vec<usize> = (0..children.len())
                .filter(|&i| statuses[i].is_none())
                .collect();
            for &i in &running {
                let _ = children[i].kill();
                let _ = children[i].wait();
            }
            return Err(format!(
                "children {running:?} still running after {limit:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for (i, (out, err)) in readers.into_iter().enumerate() {
        let (status, at) = statuses[i].take().unwrap();
        ended[i] = Some(Ended {
            code: status.code(),
            signal: status.signal(),
            at,
            stdout: out.join().unwrap(),
            stderr: err.join().unwrap(),
        });
    }
    Ok(ended.into_iter().map(Option::unwrap).collect())
}
