//! `reduce_perf`: nccl-tests' `reduce_perf` on ferroccl; `reduce_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::Reduce)
}
