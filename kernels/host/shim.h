// Runs ferroccl's CUDA sources as host C++, so that tests on machines without a GPU
// execute the very kernels a GPU would (see kernels/README.md).
//
// A launch of B blocks of T threads becomes B × T host threads. `threadIdx`,
// `blockIdx`, `blockDim` and `gridDim` are per-thread values; `__syncthreads()` is a
// barrier of the block's threads; block-shared memory is one small arena per block; the
// memory-ordering primitives of ferroccl.cuh become C++ atomics (acquire/release for
// the FIFO counters, relaxed 8-byte atomics for LL lines), and a spin yields the core,
// since simulated GPUs far outnumber the cores they run on.
#pragma once

#define FERROCCL_HOST_SHIM 1

#include <sched.h>

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#define __align__(n) alignas(n)

struct FcclDim3 {
  uint32_t x, y, z;
};

namespace fccl_shim {

// What the threads of one block share.
struct Block {
  explicit Block(uint32_t threads) : barrier(threads) {}
  std::barrier<> barrier;
  alignas(64) unsigned char shared[256] = {};
};

inline thread_local FcclDim3 thread_idx;
inline thread_local FcclDim3 block_idx;
inline thread_local FcclDim3 block_dim;
inline thread_local FcclDim3 grid_dim;
inline thread_local Block* block;

// A scheduler of the block's threads as fibers on one host thread (the simulated CUDA
// driver's, tests/simcuda) sets these on that thread: a spin then yields to the next
// fiber, and `__syncthreads()` waits for the block's other fibers. Unset, every
// simulated thread is a host thread.
inline thread_local void (*yield_hook)() = nullptr;
inline thread_local void (*sync_hook)() = nullptr;

inline void pause() {
  if (yield_hook)
    yield_hook();
  else
    sched_yield();
}

// The block's shared arena as one `T` (each kernel declares one shared struct).
template <typename T>
T& block_shared() {
  static_assert(sizeof(T) <= sizeof(Block::shared), "block-shared state too large");
  return *reinterpret_cast<T*>(block->shared);
}

// Runs `kernel(args...)` as `blocks` blocks of `threads` threads and waits for them all.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), uint32_t blocks, uint32_t threads, Args... args) {
  std::vector<Block*> all;
  for (uint32_t b = 0; b < blocks; b++) all.push_back(new Block(threads));
  std::vector<std::thread> running;
  for (uint32_t b = 0; b < blocks; b++) {
    for (uint32_t t = 0; t < threads; t++) {
      running.emplace_back([=] {
        thread_idx = {t, 0, 0};
        block_idx = {b, 0, 0};
        block_dim = {threads, 1, 1};
        grid_dim = {blocks, 1, 1};
        block = all[b];
        kernel(args...);
      });
    }
  }
  for (auto& t : running) t.join();
  for (Block* b : all) delete b;
}

}  // namespace fccl_shim

#define threadIdx (fccl_shim::thread_idx)
#define blockIdx (fccl_shim::block_idx)
#define blockDim (fccl_shim::block_dim)
#define gridDim (fccl_shim::grid_dim)
#define __syncthreads() \
  (fccl_shim::sync_hook ? fccl_shim::sync_hook() : fccl_shim::block->barrier.arrive_and_wait())
