//! The Python package's tests, run by `cargo test` so that the README's one test command
//! covers them on a fresh machine.
//!
//! It provisions what they need itself: a virtualenv at `target/pyenv` with torch (from
//! PyPI, about 5.5 GB; a later run reuses it), numpy, pytest, maturin and ruff, pinned in
//! `python/requirements-test.txt`. Then it builds and installs the extension module with
//! maturin, lints the package with ruff, and runs `pytest python/tests`. Nothing here
//! skips: a machine that cannot reach the package registry fails this test.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(what: &str, cmd: &mut Command) {
    eprintln!("python tests: {what}: {cmd:?}");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{what}: cannot start {cmd:?}: {e}"));
    assert!(status.success(), "{what} failed ({status}): {cmd:?}");
}

/// The virtualenv, made (or brought up to the pinned requirements) if need be.
fn provision() -> PathBuf {
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
            .args(["install", "--disable-pip-version-check", "-q", "-r"])
            .arg(&requirements),
    );
    std::fs::write(&stamp, wanted).expect("write the requirements stamp");
    venv
}

fn python_tool(venv: &Path, tool: &str) -> Command {
    let mut c = Command::new(venv.join("bin").join(tool));
    c.env("VIRTUAL_ENV", venv)
        .current_dir(root().join("python"));
    c
}

#[test]
fn python_package_and_torch_backend() {
    let venv = provision();
    run(
        "build and install the extension module",
        python_tool(&venv, "maturin").args(["develop", "--release", "--quiet"]),
    );
    run(
        "ruff",
        python_tool(&venv, "ruff").args([
            "check",
            "--config",
            "pyproject.toml",
            "ferroccl",
            "tests",
            "../tools/torch_bench.py",
        ]),
    );
    run(
        "pytest",
        python_tool(&venv, "python")
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
            .env("PYTHONWARNINGS", "ignore::FutureWarning"),
    );
}
