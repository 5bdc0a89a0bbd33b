// ferroccl's device code: element arithmetic, the layout of a plan as the device
// executor reads it, and the memory-ordering primitives the FIFOs use.
//
// Compiled two ways from the same text:
// - by NVRTC for a GPU (`__CUDACC_RTC__`): no headers at all, so no toolkit is needed;
// - as host C++ with `kernels/host/shim.h` included first (`FERROCCL_HOST_SHIM`), where
//   blocks and threads are host threads, so the tests run this very code on a CPU.
//
// Arithmetic is bit for bit that of the host kernels (`src/reduce/num.rs`): integers
// wrap; f32/f64 are native with no fused multiply-add (compile with --fmad=false; the
// `_rn` intrinsics below make it explicit); f16, bf16 and the 8-bit floats widen to f32,
// operate and round back once, to nearest even, the 8-bit floats saturating. Max and min
// of floats return `b` when `b` is greater (smaller) or `a` is NaN, else `a`: that is
// what the host's `f32::max` compiles to on x86-64, including which zero wins.
#pragma once

#ifdef FERROCCL_HOST_SHIM
#define FCCL_FN static inline
#define FCCL_GLOBAL extern "C"
#else
#define FCCL_FN static __device__ __forceinline__
#define FCCL_GLOBAL extern "C" __global__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#endif

// ----- the plan, as the executor reads it (mirrored by `src/cuda/device_plan.rs`) ----

// Which buffer a region lies in (`plan::Buf`).
#define FCCL_BUF_INPUT 0u
#define FCCL_BUF_OUTPUT 1u
#define FCCL_BUF_SCRATCH 2u

// Step kinds (`plan::Step`).
#define FCCL_SEND 0u
#define FCCL_RECV 1u
#define FCCL_COPY_SEND 2u
#define FCCL_RECV_REDUCE_SEND 3u
#define FCCL_RECV_REDUCE_COPY 4u
#define FCCL_RECV_REDUCE_COPY_SEND 5u
#define FCCL_RECV_COPY_SEND 6u
#define FCCL_COPY 7u
#define FCCL_REDUCE 8u
#define FCCL_RECV_REDUCE_COPY_LOCAL_FIRST 9u  // dst = src ⊕ x (a rank-order fold)

// Protocols (`transport::Protocol`).
#define FCCL_SIMPLE 0u
#define FCCL_LL 1u

// Reduction ops (`reduce::Op`).
#define FCCL_OP_SUM 0u
#define FCCL_OP_PROD 1u
#define FCCL_OP_MAX 2u
#define FCCL_OP_MIN 3u
#define FCCL_OP_AVG 4u
#define FCCL_OP_PREMULSUM 5u

// A lane's outcome, in `FcclWork::status[lane]`.
#define FCCL_STATUS_OK 0u
#define FCCL_STATUS_ABORTED 1u
#define FCCL_STATUS_SIZE_MISMATCH 2u
#define FCCL_STATUS_BAD_PLAN 3u

// Elements `offset .. offset + len` of buffer `buf` of operation `op`.
struct FcclRegion {
  uint64_t offset;
  uint64_t len;
  uint32_t op;
  uint32_t buf;
};

// One step; `send_fifo` / `recv_fifo` index `FcclWork::fifos` (-1: none).
struct FcclStep {
  uint32_t kind;
  uint32_t post;
  int32_t send_fifo;
  int32_t recv_fifo;
  FcclRegion src;  // a `Reduce`'s first operand
  FcclRegion dst;
  FcclRegion b;  // a `Reduce`'s second operand
};

// Steps `first .. first + count` of `FcclWork::steps`, run by one thread block.
struct FcclLane {
  uint32_t first;
  uint32_t count;
};

// This rank's end of one FIFO (one direction between two ranks). `head` counts slots
// published (written by the sender only), `tail` slots consumed (written by the receiver
// only); both live in memory the two ranks reach. `stage` is private to this end: LL
// slots are unpacked into it (receiver) or packed from it (sender).
struct FcclFifo {
  uint64_t* head;
  uint64_t* tail;
  uint32_t* sizes;
  char* data;
  char* stage;
  uint32_t slots;       // a power of two
  uint32_t slot_bytes;  // bytes of one slot in `data`, a multiple of 64
  uint32_t protocol;
  uint32_t pad;
};

// One operation of a (possibly fused) plan: buffers and arithmetic.
struct FcclOp {
  void* input;
  void* output;
  void* scratch;
  uint64_t scalar;  // pre-mul-sum's scalar, as the element type's bits
  uint32_t dtype;   // `DataType` (NCCL's numbering)
  uint32_t redop;   // FCCL_OP_*
  uint32_t nranks;
  uint32_t reducing;
};

// Everything one rank's launch needs. Block `b` runs lane `b`.
struct FcclWork {
  const FcclLane* lanes;
  const FcclStep* steps;
  const FcclFifo* fifos;
  const FcclOp* ops;
  uint32_t* status;        // one per lane
  const uint32_t* abort;   // non-zero: give up waiting (host-mapped memory)
  uint32_t nlanes;
  uint32_t pad;
};

// ----- memory ordering -------------------------------------------------------------

#ifdef FERROCCL_HOST_SHIM
FCCL_FN uint64_t fccl_load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
FCCL_FN void fccl_store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
FCCL_FN uint64_t fccl_load_line(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
FCCL_FN void fccl_store_line(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
FCCL_FN uint32_t fccl_load_flag(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
FCCL_FN void fccl_pause() { fccl_shim::pause(); }
FCCL_FN void fccl_fence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#define FCCL_BLOCK_SHARED(T, name) T& name = fccl_shim::block_shared<T>()
#else
#define FCCL_BLOCK_SHARED(T, name) __shared__ T name
// System scope: the peer may be another GPU (peer access) or the host.
FCCL_FN uint64_t fccl_load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
FCCL_FN void fccl_store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// An LL line: 4 bytes of data and their 4-byte flag, read and written as one 8-byte word.
FCCL_FN uint64_t fccl_load_line(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
FCCL_FN void fccl_store_line(uint64_t* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
FCCL_FN uint32_t fccl_load_flag(const uint32_t* p) { return *(const volatile uint32_t*)p; }
FCCL_FN void fccl_pause() { __nanosleep(64); }
FCCL_FN void fccl_fence_system() { __threadfence_system(); }
#endif

// ----- element types and arithmetic -----------------------------------------------

FCCL_FN float fccl_f32(uint32_t b) {
  union { uint32_t u; float f; } x;
  x.u = b;
  return x.f;
}
FCCL_FN uint32_t fccl_bits32(float f) {
  union { uint32_t u; float f; } x;
  x.f = f;
  return x.u;
}

#ifdef FERROCCL_HOST_SHIM
FCCL_FN float fccl_fadd(float a, float b) { return a + b; }
FCCL_FN float fccl_fsub(float a, float b) { return a - b; }
FCCL_FN float fccl_fmul(float a, float b) { return a * b; }
FCCL_FN float fccl_fdiv(float a, float b) { return a / b; }
FCCL_FN double fccl_dadd(double a, double b) { return a + b; }
FCCL_FN double fccl_dmul(double a, double b) { return a * b; }
FCCL_FN double fccl_ddiv(double a, double b) { return a / b; }
#else
FCCL_FN float fccl_fadd(float a, float b) { return __fadd_rn(a, b); }
FCCL_FN float fccl_fsub(float a, float b) { return __fsub_rn(a, b); }
FCCL_FN float fccl_fmul(float a, float b) { return __fmul_rn(a, b); }
FCCL_FN float fccl_fdiv(float a, float b) { return __fdiv_rn(a, b); }
FCCL_FN double fccl_dadd(double a, double b) { return __dadd_rn(a, b); }
FCCL_FN double fccl_dmul(double a, double b) { return __dmul_rn(a, b); }
FCCL_FN double fccl_ddiv(double a, double b) { return __ddiv_rn(a, b); }
#endif

// f16 <-> f32, branch-free as `num::f16_to_f32` / `num::f32_to_f16`.
FCCL_FN float fccl_f16_to_f32(uint32_t h) {
  const uint32_t shifted_exp = 0x7C00u << 13;
  uint32_t o = ((h & 0x7FFFu) << 13) + ((127u - 15u) << 23);
  uint32_t exp = (h << 13) & shifted_exp;
  uint32_t inf_nan = o + ((128u - 16u) << 23);
  float magic = fccl_f32(113u << 23);
  uint32_t sub = fccl_bits32(fccl_fsub(fccl_f32(o + (1u << 23)), magic));
  o = exp == shifted_exp ? inf_nan : (exp == 0 ? sub : o);
  return fccl_f32(o | ((h & 0x8000u) << 16));
}

FCCL_FN uint16_t fccl_f32_to_f16(float f) {
  uint32_t x = fccl_bits32(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7FFFFFFFu;
  uint32_t inf_nan = a > 0x7F800000u ? 0x7E00u : 0x7C00u;
  float magic = fccl_f32(126u << 23);
  uint32_t sub = fccl_bits32(fccl_fadd(fccl_f32(a), magic)) - fccl_bits32(magic);
  uint32_t odd = (a >> 13) & 1u;
  uint32_t normal = (a - (112u << 23) + 0xFFFu + odd) >> 13;
  uint32_t r = a >= 0x47800000u ? inf_nan : (a < 0x38800000u ? sub : normal);
  return (uint16_t)(r | sign);
}

FCCL_FN float fccl_bf16_to_f32(uint32_t h) { return fccl_f32(h << 16); }

FCCL_FN uint16_t fccl_f32_to_bf16(float f) {
  uint32_t x = fccl_bits32(f);
  uint16_t nan = (uint16_t)((x >> 16) | 0x40u);
  uint16_t rounded = (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
  return (x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}

// f32 -> 8-bit float with M mantissa bits and bias BIAS, to nearest even, saturating at
// the code MAXC; NaN -> 0x7F with the sign (`types::f32_to_f8`).
template <uint32_t M, uint32_t BIAS, uint32_t MAXC>
FCCL_FN uint8_t fccl_f32_to_f8(float x) {
  uint32_t bits = fccl_bits32(x);
  uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t abs = bits & 0x7FFFFFFFu;
  const uint32_t shift = 23u - M;
  uint32_t rebiased = abs - ((127u - BIAS) << 23);
  uint32_t odd = (rebiased >> shift) & 1u;
  uint32_t normal = (rebiased + (1u << (shift - 1)) - 1u + odd) >> shift;
  normal = normal < MAXC ? normal : MAXC;
  float magic = fccl_f32((127u + 24u - BIAS - M) << 23);
  uint32_t sub = fccl_bits32(fccl_fadd(fccl_f32(abs), magic)) - fccl_bits32(magic);
  uint32_t code = abs < ((127u + 1u - BIAS) << 23) ? sub : normal;
  code = abs > 0x7F800000u ? 0x7Fu : code;
  return (uint8_t)(code | sign);
}

FCCL_FN float fccl_e4m3_to_f32(uint32_t b) {
  uint32_t sign = (b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xFu;
  uint32_t man = b & 7u;
  float normal = fccl_f32(sign | ((exp + 120u) << 23) | (man << 20));
  float sub = fccl_f32(sign | fccl_bits32(fccl_fmul((float)(int32_t)man, 1.0f / 512.0f)));
  float nan = fccl_f32(sign | 0x7FC00000u);
  return exp == 0 ? sub : ((b & 0x7Fu) == 0x7Fu ? nan : normal);
}

FCCL_FN float fccl_e5m2_to_f32(uint32_t b) {
  uint32_t sign = (b & 0x80u) << 24;
  uint32_t exp = (b >> 2) & 0x1Fu;
  uint32_t man = b & 3u;
  float normal = fccl_f32(sign | ((exp + 112u) << 23) | (man << 21));
  float sub = fccl_f32(sign | fccl_bits32(fccl_fmul((float)(int32_t)man, 1.0f / 65536.0f)));
  float special = fccl_f32(sign | (man == 0 ? 0x7F800000u : 0x7FC00000u));
  return exp == 0 ? sub : (exp == 31 ? special : normal);
}

// maxNum / minNum as the host computes them (see the top of this file).
FCCL_FN float fccl_fmax(float a, float b) { return (b > a || a != a) ? b : a; }
FCCL_FN float fccl_fmin(float a, float b) { return (b < a || a != a) ? b : a; }
FCCL_FN double fccl_dmax(double a, double b) { return (b > a || a != a) ? b : a; }
FCCL_FN double fccl_dmin(double a, double b) { return (b < a || a != a) ? b : a; }

// The narrow floats, as raw bit patterns.
struct FcclF16 { uint16_t bits; };
struct FcclBf16 { uint16_t bits; };
struct FcclE4M3 { uint8_t bits; };
struct FcclE5M2 { uint8_t bits; };

// `Arith<T>`: add, mul, max, min, div (avg's post-op by nranks), from_raw (the
// pre-mul-sum scalar's bits).
template <typename T> struct FcclArith;

// Integers: wrap-around through the unsigned type; avg divides truncating toward zero
// in 64 bits (exact for every divisor, as the host's i128 fallback).
template <typename T, typename U, typename W> struct FcclIntArith {
  FCCL_FN T add(T a, T b) { return (T)(U)((U)a + (U)b); }
  FCCL_FN T mul(T a, T b) { return (T)(U)((U)a * (U)b); }
  FCCL_FN T max(T a, T b) { return a < b ? b : a; }
  FCCL_FN T min(T a, T b) { return b < a ? b : a; }
  FCCL_FN T div(T a, uint32_t n) { return (T)((W)a / (W)n); }
  FCCL_FN T from_raw(uint64_t raw) { return (T)raw; }
};
template <> struct FcclArith<int8_t> : FcclIntArith<int8_t, uint8_t, int64_t> {};
template <> struct FcclArith<uint8_t> : FcclIntArith<uint8_t, uint8_t, uint64_t> {};
template <> struct FcclArith<int32_t> : FcclIntArith<int32_t, uint32_t, int64_t> {};
template <> struct FcclArith<uint32_t> : FcclIntArith<uint32_t, uint32_t, uint64_t> {};
template <> struct FcclArith<int64_t> : FcclIntArith<int64_t, uint64_t, int64_t> {};
template <> struct FcclArith<uint64_t> : FcclIntArith<uint64_t, uint64_t, uint64_t> {};

template <> struct FcclArith<float> {
  FCCL_FN float add(float a, float b) { return fccl_fadd(a, b); }
  FCCL_FN float mul(float a, float b) { return fccl_fmul(a, b); }
  FCCL_FN float max(float a, float b) { return fccl_fmax(a, b); }
  FCCL_FN float min(float a, float b) { return fccl_fmin(a, b); }
  FCCL_FN float div(float a, uint32_t n) { return fccl_fdiv(a, (float)n); }
  FCCL_FN float from_raw(uint64_t raw) { return fccl_f32((uint32_t)raw); }
};

template <> struct FcclArith<double> {
  FCCL_FN double add(double a, double b) { return fccl_dadd(a, b); }
  FCCL_FN double mul(double a, double b) { return fccl_dmul(a, b); }
  FCCL_FN double max(double a, double b) { return fccl_dmax(a, b); }
  FCCL_FN double min(double a, double b) { return fccl_dmin(a, b); }
  FCCL_FN double div(double a, uint32_t n) { return fccl_ddiv(a, (double)n); }
  FCCL_FN double from_raw(uint64_t raw) {
    union { uint64_t u; double d; } x;
    x.u = raw;
    return x.d;
  }
};

// Narrow floats: widen, operate in f32, round back once. `C` names the conversions.
template <typename T, typename B, typename C>
struct FcclNarrowArith {
  FCCL_FN float w(T a) { return C::widen(a.bits); }
  FCCL_FN T n(float f) {
    T r;
    r.bits = C::narrow(f);
    return r;
  }
  FCCL_FN T add(T a, T b) { return n(fccl_fadd(w(a), w(b))); }
  FCCL_FN T mul(T a, T b) { return n(fccl_fmul(w(a), w(b))); }
  FCCL_FN T max(T a, T b) { return n(fccl_fmax(w(a), w(b))); }
  FCCL_FN T min(T a, T b) { return n(fccl_fmin(w(a), w(b))); }
  FCCL_FN T div(T a, uint32_t k) { return n(fccl_fdiv(w(a), (float)k)); }
  FCCL_FN T from_raw(uint64_t raw) {
    T r;
    r.bits = (B)raw;
    return r;
  }
};
struct FcclF16Conv {
  FCCL_FN float widen(uint32_t b) { return fccl_f16_to_f32(b); }
  FCCL_FN uint16_t narrow(float f) { return fccl_f32_to_f16(f); }
};
struct FcclBf16Conv {
  FCCL_FN float widen(uint32_t b) { return fccl_bf16_to_f32(b); }
  FCCL_FN uint16_t narrow(float f) { return fccl_f32_to_bf16(f); }
};
struct FcclE4M3Conv {
  FCCL_FN float widen(uint32_t b) { return fccl_e4m3_to_f32(b); }
  FCCL_FN uint8_t narrow(float f) { return fccl_f32_to_f8<3, 7, 0x7E>(f); }
};
struct FcclE5M2Conv {
  FCCL_FN float widen(uint32_t b) { return fccl_e5m2_to_f32(b); }
  FCCL_FN uint8_t narrow(float f) { return fccl_f32_to_f8<2, 15, 0x7B>(f); }
};
template <> struct FcclArith<FcclF16> : FcclNarrowArith<FcclF16, uint16_t, FcclF16Conv> {};
template <> struct FcclArith<FcclBf16> : FcclNarrowArith<FcclBf16, uint16_t, FcclBf16Conv> {};
template <> struct FcclArith<FcclE4M3> : FcclNarrowArith<FcclE4M3, uint8_t, FcclE4M3Conv> {};
template <> struct FcclArith<FcclE5M2> : FcclNarrowArith<FcclE5M2, uint8_t, FcclE5M2Conv> {};

// ----- element-wise loops over a thread block ---------------------------------------

// Sixteen bytes, the width of one vector load or store.
struct __align__(16) FcclVec16 {
  uint32_t w[4];
};

template <typename T> union FcclLanes {
  FcclVec16 v;
  T e[16 / sizeof(T)];
};

// Elements before `p` reaches a 16-byte boundary, or `n` (all scalar) when the pointers
// of one call cannot be brought to a boundary together.
template <typename T>
FCCL_FN uint64_t fccl_vector_start(uint64_t n, uintptr_t a, uintptr_t b, uintptr_t c) {
  if (((a ^ b) & 15) != 0 || ((a ^ c) & 15) != 0 || (a % sizeof(T)) != 0) return n;
  uint64_t head = ((16 - (a & 15)) & 15) / sizeof(T);
  return head < n ? head : n;
}

// dst[i] = f(a[i], b[i]) for i < n, by threads `tid` of `nthreads`, 16 bytes at a time
// where alignment allows. dst may equal a or b.
template <typename T, typename F>
FCCL_FN void fccl_zip(T* dst, const T* a, const T* b, uint64_t n, F f, uint32_t tid,
                      uint32_t nthreads) {
  const uint64_t K = 16 / sizeof(T);
  uint64_t head = fccl_vector_start<T>(n, (uintptr_t)a, (uintptr_t)b, (uintptr_t)dst);
  for (uint64_t i = tid; i < head; i += nthreads) dst[i] = f(a[i], b[i]);
  uint64_t nvec = (n - head) / K;
  const FcclVec16* va = (const FcclVec16*)(a + head);
  const FcclVec16* vb = (const FcclVec16*)(b + head);
  FcclVec16* vd = (FcclVec16*)(dst + head);
  for (uint64_t v = tid; v < nvec; v += nthreads) {
    FcclLanes<T> x, y, r;
    x.v = va[v];
    y.v = vb[v];
    for (uint64_t k = 0; k < K; k++) r.e[k] = f(x.e[k], y.e[k]);
    vd[v] = r.v;
  }
  for (uint64_t i = head + nvec * K + tid; i < n; i += nthreads) dst[i] = f(a[i], b[i]);
}

// dst[i] = f(src[i]) for i < n. dst may equal src.
template <typename T, typename F>
FCCL_FN void fccl_map(T* dst, const T* src, uint64_t n, F f, uint32_t tid, uint32_t nthreads) {
  const uint64_t K = 16 / sizeof(T);
  uint64_t head = fccl_vector_start<T>(n, (uintptr_t)src, (uintptr_t)dst, (uintptr_t)dst);
  for (uint64_t i = tid; i < head; i += nthreads) dst[i] = f(src[i]);
  uint64_t nvec = (n - head) / K;
  const FcclVec16* vs = (const FcclVec16*)(src + head);
  FcclVec16* vd = (FcclVec16*)(dst + head);
  for (uint64_t v = tid; v < nvec; v += nthreads) {
    FcclLanes<T> x, r;
    x.v = vs[v];
    for (uint64_t k = 0; k < K; k++) r.e[k] = f(x.e[k]);
    vd[v] = r.v;
  }
  for (uint64_t i = head + nvec * K + tid; i < n; i += nthreads) dst[i] = f(src[i]);
}

// Byte copy of `bytes` (dst and src do not overlap, or are equal).
FCCL_FN void fccl_copy(char* dst, const char* src, uint64_t bytes, uint32_t tid, uint32_t nthreads) {
  if (dst == src) return;
  fccl_map<uint8_t>((uint8_t*)dst, (const uint8_t*)src, bytes, [](uint8_t x) { return x; }, tid,
                    nthreads);
}

// dst = a ⊕ pre(b) for op `redop` (avg sums; pre-mul-sum scales b by `scalar` first).
template <typename T>
FCCL_FN void fccl_reduce(T* dst, const T* a, const T* b, uint64_t n, uint32_t redop, uint64_t scalar,
                         uint32_t tid, uint32_t nthreads) {
  typedef FcclArith<T> A;
  switch (redop) {
    case FCCL_OP_SUM:
    case FCCL_OP_AVG:
      fccl_zip(dst, a, b, n, [](T x, T y) { return A::add(x, y); }, tid, nthreads);
      break;
    case FCCL_OP_PROD:
      fccl_zip(dst, a, b, n, [](T x, T y) { return A::mul(x, y); }, tid, nthreads);
      break;
    case FCCL_OP_MAX:
      fccl_zip(dst, a, b, n, [](T x, T y) { return A::max(x, y); }, tid, nthreads);
      break;
    case FCCL_OP_MIN:
      fccl_zip(dst, a, b, n, [](T x, T y) { return A::min(x, y); }, tid, nthreads);
      break;
    case FCCL_OP_PREMULSUM: {
      T s = A::from_raw(scalar);
      fccl_zip(dst, a, b, n, [s](T x, T y) { return A::add(x, A::mul(y, s)); }, tid, nthreads);
      break;
    }
  }
}

// dst = pre(src): a copy, or `scalar * src` for pre-mul-sum.
template <typename T>
FCCL_FN void fccl_pre(T* dst, const T* src, uint64_t n, uint32_t redop, uint64_t scalar,
                      uint32_t tid, uint32_t nthreads) {
  typedef FcclArith<T> A;
  if (redop == FCCL_OP_PREMULSUM) {
    T s = A::from_raw(scalar);
    fccl_map(dst, src, n, [s](T x) { return A::mul(x, s); }, tid, nthreads);
  } else {
    fccl_copy((char*)dst, (const char*)src, n * sizeof(T), tid, nthreads);
  }
}

// buf = post(buf): division by nranks for avg (nothing otherwise, or for one rank).
template <typename T>
FCCL_FN void fccl_post(T* buf, uint64_t n, uint32_t redop, uint32_t nranks, uint32_t tid,
                       uint32_t nthreads) {
  if (redop != FCCL_OP_AVG || nranks <= 1) return;
  fccl_map(buf, buf, n, [nranks](T x) { return FcclArith<T>::div(x, nranks); }, tid, nthreads);
}

// Calls `F::template run<T>(args...)` with T the element type of `dtype` (NCCL's
// numbering); returns false for an unknown dtype.
template <typename F, typename... Args>
FCCL_FN bool fccl_with_dtype(uint32_t dtype, Args... args) {
  switch (dtype) {
    case 0: F::template run<int8_t>(args...); return true;
    case 1: F::template run<uint8_t>(args...); return true;
    case 2: F::template run<int32_t>(args...); return true;
    case 3: F::template run<uint32_t>(args...); return true;
    case 4: F::template run<int64_t>(args...); return true;
    case 5: F::template run<uint64_t>(args...); return true;
    case 6: F::template run<FcclF16>(args...); return true;
    case 7: F::template run<float>(args...); return true;
    case 8: F::template run<double>(args...); return true;
    case 9: F::template run<FcclBf16>(args...); return true;
    case 10: F::template run<FcclE4M3>(args...); return true;
    case 11: F::template run<FcclE5M2>(args...); return true;
    default: return false;
  }
}

// Bytes of one element of `dtype` (0 for an unknown one).
FCCL_FN uint32_t fccl_dtype_size(uint32_t dtype) {
  switch (dtype) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
  }
}
