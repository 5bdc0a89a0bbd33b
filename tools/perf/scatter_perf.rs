//! `scatter_perf`: nccl-tests' `scatter_perf` on ferroccl; `scatter_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::Scatter)
}
