//! The test virtualenv at `target/pyenv` (torch, numpy, pytest, maturin, ruff, pinned in
//! `python/requirements-test.txt`), made or brought up to date on first use, for every
//! test that needs Python with torch.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `cmd`, failing the test (naming `what`) if it does not succeed.
/// Its time goes to stderr past the test harness's capture, so that CI's log shows it.
pub fn run(what: &str, cmd: &mut Command) {
    eprintln!("python tests: {what}: {cmd:?}");
    let started = std::time::Instant::now();
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{what}: cannot start {cmd:?}: {e}"));
    assert!(status.success(), "{what} failed ({status}): {cmd:?}");
    let line = format!(
        "python tests: {what}: {:.0} s\n",
        started.elapsed().as_secs_f64()
    );
    // A failed write to stderr loses only the timing line.
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
}

/// The virtualenv, made (or brought up to the pinned requirements) if need be. Not safe
/// to call from two processes at once the first time (test binaries run one after the
/// other; within one, call it once).
pub fn provision() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"));
    let venv = target.join("pyenv");
    let requirements = root().join("python/requirements-test.txt");
    let wanted = std::fs::read_to_string(&requirements).expect("python/requirements-test.txt");
    let stamp = venv.join("ferroccl-requirements.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return venv;
    }
    if !venv.join("bin/python").exists() {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(
            "create the virtualenv",
            Command::new(python).args(["-m", "venv"]).arg(&venv),
        );
    }
    run(
        "install torch, numpy, pytest, maturin and ruff (torch is large: minutes)",
        Command::new(venv.join("bin/pip"))
            // No wheel cache: it would keep a second copy of torch's 3 GB of wheels.
            .args([
                "install",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "-q",
                "-r",
            ])
            .arg(&requirements),
    );
    std::fs::write(&stamp, wanted).expect("write the requirements stamp");
    venv
}
