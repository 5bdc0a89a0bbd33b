//! `alltoall_perf`: nccl-tests' `alltoall_perf` on ferroccl; `alltoall_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::AllToAll)
}
