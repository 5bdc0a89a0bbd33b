//! `all_gather_perf`: nccl-tests' `all_gather_perf` on ferroccl; `all_gather_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::AllGather)
}
