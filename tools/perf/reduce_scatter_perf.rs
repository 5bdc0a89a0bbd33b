//! `reduce_scatter_perf`: nccl-tests' `reduce_scatter_perf` on ferroccl; `reduce_scatter_perf -h` lists the flags.

fn main() -> std::process::ExitCode {
    ferroccl::perf::main(ferroccl::perf::Test::ReduceScatter)
}
