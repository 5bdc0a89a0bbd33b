// The host build of kernels/*.cu (through shim.h): C entry points that launch each
// kernel on host threads, for the tests (`tests/kernels.rs`).
#include "shim.h"

#include "../executor.cu"
#include "../reduce.cu"

// Sizes of the structures the Rust side lays out (`cuda::work`), to check they agree.
extern "C" void ferroccl_host_abi(uint64_t* sizes) {
  sizes[0] = sizeof(FcclRegion);
  sizes[1] = sizeof(FcclStep);
  sizes[2] = sizeof(FcclLane);
  sizes[3] = sizeof(FcclFifo);
  sizes[4] = sizeof(FcclOp);
  sizes[5] = sizeof(FcclWork);
}

// `ferroccl_execute` over `work.nlanes` blocks of `threads` threads.
extern "C" void ferroccl_host_execute(const FcclWork* work, uint32_t threads) {
  fccl_shim::launch(ferroccl_execute, work->nlanes, threads, *work);
}

// `ferroccl_reduce` over `blocks` × `threads`.
extern "C" void ferroccl_host_reduce(uint32_t blocks, uint32_t threads, void* dst, const void* a,
                                     const void* b, uint64_t n, uint32_t dtype, uint32_t redop,
                                     uint64_t scalar) {
  fccl_shim::launch(ferroccl_reduce, blocks, threads, dst, a, b, n, dtype, redop, scalar);
}

// `ferroccl_pre` over `blocks` × `threads`.
extern "C" void ferroccl_host_pre(uint32_t blocks, uint32_t threads, void* dst, const void* src,
                                  uint64_t n, uint32_t dtype, uint32_t redop, uint64_t scalar) {
  fccl_shim::launch(ferroccl_pre, blocks, threads, dst, src, n, dtype, redop, scalar);
}

// `ferroccl_post` over `blocks` × `threads`.
extern "C" void ferroccl_host_post(uint32_t blocks, uint32_t threads, void* buf, uint64_t n,
                                   uint32_t dtype, uint32_t redop, uint32_t nranks) {
  fccl_shim::launch(ferroccl_post, blocks, threads, buf, n, dtype, redop, nranks);
}
