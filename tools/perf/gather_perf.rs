//! `gather_perf`: nccl-tests' `gather_perf` on ferroccl; `gather_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::Gather)
}
