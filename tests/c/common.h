/* Helpers shared by the C test programs: rendezvous through a file, result checks, and
 * element conversions for small integer values (exact in every type). Builds against
 * ferroccl's include/nccl.h and against NVIDIA's nccl.h alike. */
#ifndef FERROCCL_TEST_COMMON_H
#define FERROCCL_TEST_COMMON_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

/* Not every program uses every helper. */
#define HELPER static __attribute__((unused))

#define CHECK(call)                                                                     \
  do {                                                                                  \
    ncclResult_t r_ = (call);                                                           \
    if (r_ != ncclSuccess) {                                                            \
      fprintf(stderr, "%s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #call,    \
              (int)r_, ncclGetErrorString(r_), ncclGetLastError(NULL));                 \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

/* Rank 0 makes the unique id and writes it to `path` (atomically, through a rename);
 * the others wait for the file, as NCCL programs share the id out of band. */
HELPER ncclUniqueId share_unique_id(int rank, const char* path) {
  ncclUniqueId id;
  if (rank == 0) {
    char tmp[4096];
    CHECK(ncclGetUniqueId(&id));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
      fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
      exit(1);
    }
    return id;
  }
  for (int waited_ms = 0; waited_ms < 60000; waited_ms += 10) {
    FILE* f = fopen(path, "rb");
    if (f) {
      size_t got = fread(&id, sizeof id, 1, f);
      fclose(f);
      if (got == 1) return id;
    }
    usleep(10 * 1000);
  }
  fprintf(stderr, "rank %d: no unique id in %s after 60 s\n", rank, path);
  exit(1);
}

/* Bits of an IEEE half holding the small non-negative integer v (< 2048). */
HELPER uint16_t half_bits(double v) {
  if (v == 0) return 0;
  int e = 0;
  while (v >= 2) { v /= 2; e++; }
  return (uint16_t)(((e + 15) << 10) | (int)((v - 1) * 1024));
}

/* Bits of a bfloat16 holding v (exact for small integers): the top half of a float. */
HELPER uint16_t bf16_bits(double v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

/* The types the programs test, with their element sizes. */
HELPER const ncclDataType_t TYPES[] = {ncclInt8,    ncclUint8,  ncclInt32, ncclUint64,
                                       ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16};
HELPER const char* TYPE_NAMES[] = {"int8", "uint8", "int32", "uint64",
                                   "half", "float", "double", "bfloat16"};
#define NTYPES ((int)(sizeof TYPES / sizeof TYPES[0]))

HELPER size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

/* Stores the small integer v as element i of buf. */
HELPER void put(void* buf, ncclDataType_t t, size_t i, double v) {
  switch (t) {
    case ncclInt8: ((int8_t*)buf)[i] = (int8_t)v; break;
    case ncclUint8: ((uint8_t*)buf)[i] = (uint8_t)v; break;
    case ncclInt32: ((int32_t*)buf)[i] = (int32_t)v; break;
    case ncclUint32: ((uint32_t*)buf)[i] = (uint32_t)v; break;
    case ncclInt64: ((int64_t*)buf)[i] = (int64_t)v; break;
    case ncclUint64: ((uint64_t*)buf)[i] = (uint64_t)v; break;
    case ncclFloat16: ((uint16_t*)buf)[i] = half_bits(v); break;
    case ncclBfloat16: ((uint16_t*)buf)[i] = bf16_bits(v); break;
    case ncclFloat32: ((float*)buf)[i] = (float)v; break;
    case ncclFloat64: ((double*)buf)[i] = v; break;
    default: fprintf(stderr, "put: type %d not handled\n", (int)t); exit(1);
  }
}

/* Whether element i of buf holds the small integer v. */
HELPER int holds(const void* buf, ncclDataType_t t, size_t i, double v) {
  char want[8];
  size_t n = type_size(t);
  put(want, t, 0, v);
  return memcmp((const char*)buf + i * n, want, n) == 0;
}

#endif
