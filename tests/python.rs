//! The Python package's tests, run by `cargo test` so that the README's one test command
//! covers them on a fresh machine.
//!
//! It provisions what they need itself: a virtualenv at `target/pyenv` with torch (from
//! PyPI, about 5.5 GB; a later run reuses it), numpy, pytest, maturin and ruff, pinned in
//! `python/requirements-test.txt`. Then it builds and installs the extension module with
//! maturin, lints the package with ruff, and runs `pytest python/tests` (its slowest
//! tests named in the log). Nothing here skips: a machine that cannot reach the package
//! registry fails this test.

mod pyenv;
// The simulated CUDA driver, for the device tests one level below torch.
#[allow(unused_imports)]
mod common;

use std::path::Path;
use std::process::Command;

use pyenv::{provision, root, run};

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
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--durations=8",
                "tests",
            ])
            .env("PYTHONWARNINGS", "ignore::FutureWarning")
            .env("FERROCCL_TEST_SIM_ENV", simulated_driver_env()),
    );
}

/// The simulated driver's environment as JSON, for python/tests/test_cuda_array.py to
/// give its rank processes (and only them: torch's tests keep the machine's own driver).
fn simulated_driver_env() -> String {
    let map: serde_json::Map<String, serde_json::Value> = common::simulated_gpu_env(1)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned().into()))
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// Not a test: prints the simulated driver's environment (building the driver) for
/// `tools/device-coverage`, which runs python/tests through an instrumented extension
/// module with the same environment this file gives pytest.
#[test]
#[ignore = "a helper of tools/device-coverage"]
fn print_simulated_driver_env() {
    println!("FERROCCL_TEST_SIM_ENV={}", simulated_driver_env());
}
