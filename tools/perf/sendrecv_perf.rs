//! `sendrecv_perf`: nccl-tests' `sendrecv_perf` on ferroccl; `sendrecv_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::SendRecv)
}
