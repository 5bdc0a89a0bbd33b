//! `all_reduce_perf`: nccl-tests' `all_reduce_perf` on ferroccl; `all_reduce_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::AllReduce)
}
