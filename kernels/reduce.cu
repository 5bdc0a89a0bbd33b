// Element-wise reductions over whole buffers, for every dtype and op: the device
// counterparts of `reduce::Kernel::{reduce, pre, post}`. Each is a grid-stride loop of
// 16-byte vector loads (see `fccl_zip` in ferroccl.cuh) over all blocks of the launch.
#include "ferroccl.cuh"

#define FCCL_GRID_TID (blockIdx.x * blockDim.x + threadIdx.x)
#define FCCL_GRID_THREADS (gridDim.x * blockDim.x)

struct FcclReduceAll {
  template <typename T>
  FCCL_FN void run(void* dst, const void* a, const void* b, uint64_t n, uint32_t redop,
                   uint64_t scalar) {
    fccl_reduce<T>((T*)dst, (const T*)a, (const T*)b, n, redop, scalar, FCCL_GRID_TID,
                   FCCL_GRID_THREADS);
  }
};

struct FcclPreAll {
  template <typename T>
  FCCL_FN void run(void* dst, const void* src, uint64_t n, uint32_t redop, uint64_t scalar) {
    fccl_pre<T>((T*)dst, (const T*)src, n, redop, scalar, FCCL_GRID_TID, FCCL_GRID_THREADS);
  }
};

struct FcclPostAll {
  template <typename T>
  FCCL_FN void run(void* buf, uint64_t n, uint32_t redop, uint32_t nranks) {
    fccl_post<T>((T*)buf, n, redop, nranks, FCCL_GRID_TID, FCCL_GRID_THREADS);
  }
};

// dst[i] = a[i] ⊕ pre(b[i]) for i < n (`Kernel::reduce`).
FCCL_GLOBAL void ferroccl_reduce(void* dst, const void* a, const void* b, uint64_t n,
                                 uint32_t dtype, uint32_t redop, uint64_t scalar) {
  fccl_with_dtype<FcclReduceAll>(dtype, dst, a, b, n, redop, scalar);
}

// dst[i] = pre(src[i]) (`Kernel::pre`).
FCCL_GLOBAL void ferroccl_pre(void* dst, const void* src, uint64_t n, uint32_t dtype,
                              uint32_t redop, uint64_t scalar) {
  fccl_with_dtype<FcclPreAll>(dtype, dst, src, n, redop, scalar);
}

// buf[i] = post(buf[i]) (`Kernel::post`).
FCCL_GLOBAL void ferroccl_post(void* buf, uint64_t n, uint32_t dtype, uint32_t redop,
                               uint32_t nranks) {
  fccl_with_dtype<FcclPostAll>(dtype, buf, n, redop, nranks);
}
