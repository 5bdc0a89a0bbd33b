//! `broadcast_perf`: nccl-tests' `broadcast_perf` on ferroccl; `broadcast_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::Broadcast)
}
