/* Collectives on CUDA device memory through the C ABI, as an NCCL program makes them:
 * buffers from the CUDA driver, calls enqueued on a stream of the rank's own, results
 * read back after cuStreamSynchronize. The driver is the library FERROCCL_CUDA_DRIVER
 * names (the tests' simulated one), else NVIDIA's libcuda.so.1; it is called through
 * dlsym so that the program needs no CUDA header or toolkit.
 *
 * usage: device RANK NRANKS ID_FILE MODE
 *   collectives  every collective in and out of place over several counts and dtypes,
 *                a group of device calls, ncclMemAlloc buffers
 *   abort        rank 0 waits in a kernel for rank 1, which never calls; rank 0's
 *                ncclCommAbort gives its stream back
 *   timeout      as abort, but nobody aborts: the communicator's timeout
 *                (FERROCCL_TIMEOUT) gives the stream back and ncclCommGetAsyncError
 *                reports the failure
 *   killed       rank 1 is killed (SIGKILL) while rank 0's kernel waits on it: rank 0's
 *                stream comes back long before the timeout, and its error names rank 1
 *   mismatch     the ranks call all-reduce with different counts: every stream comes
 *                back (by the timeout at worst) and every rank reports an error
 *   initall      one process (RANK 0, ID_FILE unused): ncclCommInitAll of NRANKS ranks
 *                on the GPUs of a devlist, a group of all-reduces, one per rank
 * On the simulated driver each survivor checks at exit that ferroccl left no device or
 * page-locked allocation, IPC mapping, stream or event behind.
 */
#include <signal.h>
#include <dlfcn.h>

#include "common.h"

typedef int drv_result;
typedef unsigned long long drv_ptr;

static drv_result (*drv_init)(unsigned);
static drv_result (*drv_device_count)(int*);
static drv_result (*drv_primary_retain)(void**, int);
static drv_result (*drv_set_current)(void*);
static drv_result (*drv_alloc)(drv_ptr*, size_t);
static drv_result (*drv_free)(drv_ptr);
static drv_result (*drv_htod)(drv_ptr, const void*, size_t);
static drv_result (*drv_dtoh)(void*, drv_ptr, size_t);
static drv_result (*drv_stream_create)(void**, unsigned);
static drv_result (*drv_stream_sync)(void*);
static drv_result (*drv_stream_destroy)(void*);
static drv_result (*drv_pointer_attribute)(void*, int, drv_ptr);
/* The simulated driver's own count of what is live (NULL on NVIDIA's driver). */
static void (*sim_live)(uint64_t*);

#define DRV(call)                                                              \
  do {                                                                         \
    drv_result r_ = (call);                                                    \
    if (r_ != 0) {                                                             \
      fprintf(stderr, "%s:%d: %s returned CUDA error %d\n", __FILE__, __LINE__, \
              #call, r_);                                                      \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

static void* symbol(void* lib, const char* name) {
  void* f = dlsym(lib, name);
  if (!f) {
    fprintf(stderr, "the CUDA driver has no %s\n", name);
    exit(1);
  }
  return f;
}

/* Loads the driver and makes the rank's GPU (rank % GPUs) current; returns a new
 * non-blocking stream on it. */
static void* open_gpu(int rank) {
  const char* path = getenv("FERROCCL_CUDA_DRIVER");
  void* lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    fprintf(stderr, "no CUDA driver: %s\n", dlerror());
    exit(1);
  }
  *(void**)&drv_init = symbol(lib, "cuInit");
  *(void**)&drv_device_count = symbol(lib, "cuDeviceGetCount");
  *(void**)&drv_primary_retain = symbol(lib, "cuDevicePrimaryCtxRetain");
  *(void**)&drv_set_current = symbol(lib, "cuCtxSetCurrent");
  *(void**)&drv_alloc = symbol(lib, "cuMemAlloc_v2");
  *(void**)&drv_free = symbol(lib, "cuMemFree_v2");
  *(void**)&drv_htod = symbol(lib, "cuMemcpyHtoD_v2");
  *(void**)&drv_dtoh = symbol(lib, "cuMemcpyDtoH_v2");
  *(void**)&drv_stream_create = symbol(lib, "cuStreamCreate");
  *(void**)&drv_stream_sync = symbol(lib, "cuStreamSynchronize");
  *(void**)&drv_stream_destroy = symbol(lib, "cuStreamDestroy_v2");
  *(void**)&drv_pointer_attribute = symbol(lib, "cuPointerGetAttribute");
  *(void**)&sim_live = dlsym(lib, "ferroccl_simcuda_live");
  DRV(drv_init(0));
  int gpus = 0;
  DRV(drv_device_count(&gpus));
  void* ctx = NULL;
  DRV(drv_primary_retain(&ctx, rank % gpus));
  DRV(drv_set_current(ctx));
  void* stream = NULL;
  DRV(drv_stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */));
  return stream;
}

/* Element i of rank r's input: small non-negative integers, exact in every type. */
static int value(int r, size_t i) { return (int)((i * 7 + (size_t)r * 3) % 11); }

static drv_ptr device_alloc(size_t bytes) {
  drv_ptr p = 0;
  DRV(drv_alloc(&p, bytes ? bytes : 1));
  return p;
}

enum { ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, NCOLL };
static const char* COLL_NAMES[] = {"all_reduce", "broadcast", "reduce", "all_gather",
                                   "reduce_scatter"};

/* Runs one collective on device memory and checks this rank's result; returns the
 * number of wrong elements. */
static int run_one(ncclComm_t comm, void* stream, int coll, ncclDataType_t type, size_t count,
                   int in_place, int rank, int nranks) {
  size_t es = type_size(type);
  size_t in_elems = coll == REDUCE_SCATTER ? count * nranks : count;
  size_t out_elems = coll == ALL_GATHER ? count * nranks : count;
  size_t buf_elems = in_elems > out_elems ? in_elems : out_elems;
  char* host = calloc(buf_elems + 1, es);
  for (size_t i = 0; i < in_elems; i++) put(host, type, i, value(rank, i));
  drv_ptr out = device_alloc(buf_elems * es);
  drv_ptr in = in_place ? out : device_alloc(in_elems * es);
  /* In place, the input sits where NCCL wants it inside the output. */
  size_t at = in_place && coll == ALL_GATHER ? (size_t)rank * count : 0;
  DRV(drv_htod(in + at * es, host, in_elems * es));
  drv_ptr send = in + at * es;
  drv_ptr recv = out;
  if (in_place && coll == REDUCE_SCATTER) recv = out + (size_t)rank * count * es;
  int root = nranks - 1;
  switch (coll) {
    case ALL_REDUCE:
      CHECK(ncclAllReduce((void*)send, (void*)recv, count, type, ncclSum, comm, stream));
      break;
    case BROADCAST:
      CHECK(ncclBroadcast((void*)send, (void*)recv, count, type, root, comm, stream));
      break;
    case REDUCE:
      CHECK(ncclReduce((void*)send, (void*)recv, count, type, ncclSum, root, comm, stream));
      break;
    case ALL_GATHER:
      CHECK(ncclAllGather((void*)send, (void*)recv, count, type, comm, stream));
      break;
    default:
      CHECK(ncclReduceScatter((void*)send, (void*)recv, count, type, ncclSum, comm, stream));
      break;
  }
  DRV(drv_stream_sync(stream));
  memset(host, 0, (buf_elems + 1) * es);
  DRV(drv_dtoh(host, recv, out_elems * es));
  int wrong = 0;
  for (size_t i = 0; i < out_elems; i++) {
    int want = 0;
    switch (coll) {
      case ALL_REDUCE:
        for (int r = 0; r < nranks; r++) want += value(r, i);
        break;
      case BROADCAST: want = value(root, i); break;
      case REDUCE:
        if (rank != root) continue; /* the others' recvbuff is unused */
        for (int r = 0; r < nranks; r++) want += value(r, i);
        break;
      case ALL_GATHER: want = value((int)(i / count), i % count); break;
      default:
        if (i >= count) continue;
        for (int r = 0; r < nranks; r++) want += value(r, (size_t)rank * count + i);
        break;
    }
    if (!holds(host, type, i, want) && wrong++ < 3)
      fprintf(stderr, "rank %d: %s of type %d, count %zu %s: element %zu is not %d\n", rank,
              COLL_NAMES[coll], (int)type, count, in_place ? "in place" : "out of place", i,
              want);
  }
  if (!in_place) DRV(drv_free(in));
  DRV(drv_free(out));
  free(host);
  return wrong;
}

/* 1 (and says why) unless `got` is `want` with a last error that contains `needle`. */
static int refused(const char* what, ncclResult_t got, ncclResult_t want, const char* needle) {
  const char* msg = ncclGetLastError(NULL);
  if (got == want && strstr(msg, needle)) return 0;
  fprintf(stderr, "%s: got %d (%s), want %d with \"%s\"\n", what, (int)got, msg, (int)want,
          needle);
  return 1;
}

static int collectives(ncclComm_t comm, void* stream, int rank, int nranks) {
  const ncclDataType_t types[] = {ncclInt8, ncclInt32, ncclFloat32, ncclFloat64};
  const size_t counts[] = {0, 1, 1001, 65537};
  int wrong = 0, calls = 0;
  for (int t = 0; t < 4; t++)
    for (int c = 0; c < 4; c++)
      for (int coll = 0; coll < NCOLL; coll++)
        for (int in_place = 0; in_place < 2; in_place++, calls++)
          wrong += run_one(comm, stream, coll, types[t], counts[c], in_place, rank, nranks);

  /* Misuse on device memory, each refused with its reason before anything runs (every
   * rank makes the same mistakes, so no peer waits on another). */
  int misuse = 0;
  int gpus = 0, device = -1;
  DRV(drv_device_count(&gpus));
  CHECK(ncclCommCuDevice(comm, &device));
  if (device != rank % gpus) {
    fprintf(stderr, "ncclCommCuDevice says GPU %d, not %d\n", device, rank % gpus);
    misuse++;
  }
  {
    drv_ptr d = device_alloc(64);
    int32_t h[16] = {0};
    misuse += refused("host and device buffers in one call",
                      ncclAllReduce((void*)d, h, 16, ncclInt32, ncclSum, comm, stream),
                      ncclInvalidArgument, "is host memory while the other buffer is CUDA device");
    ncclRedOp_t op;
    misuse += refused("a pre-mul-sum scalar in device memory",
                      ncclRedOpCreatePreMulSum(&op, (void*)d, ncclInt32, ncclScalarDevice, comm),
                      ncclInvalidUsage, "scalar is in device memory");
    CHECK(ncclGroupStart());
    CHECK(ncclAllReduce((void*)d, (void*)d, 16, ncclInt32, ncclSum, comm, stream));
    CHECK(ncclAllReduce(h, h, 16, ncclInt32, ncclSum, comm, NULL));
    misuse += refused("a group mixing device and host calls", ncclGroupEnd(), ncclInvalidUsage,
                      "must all be on device memory and name the same stream");
    void* other;
    DRV(drv_stream_create(&other, 1));
    CHECK(ncclGroupStart());
    CHECK(ncclAllReduce((void*)d, (void*)d, 16, ncclInt32, ncclSum, comm, stream));
    CHECK(ncclAllReduce((void*)d, (void*)d, 16, ncclInt32, ncclSum, comm, other));
    misuse += refused("a group on two streams", ncclGroupEnd(), ncclInvalidUsage,
                      "name the same stream");
    DRV(drv_stream_destroy(other));
    DRV(drv_free(d));
  }
  if (misuse) exit(1);

  /* A group of two all-reduces on device memory: one fused launch. */
  size_t n = 4099;
  int32_t* host = malloc(n * 4);
  drv_ptr a = device_alloc(n * 4), b = device_alloc(n * 4);
  for (size_t i = 0; i < n; i++) host[i] = value(rank, i);
  DRV(drv_htod(a, host, n * 4));
  for (size_t i = 0; i < n; i++) host[i] = 2 * value(rank, i);
  DRV(drv_htod(b, host, n * 4));
  CHECK(ncclGroupStart());
  CHECK(ncclAllReduce((void*)a, (void*)a, n, ncclInt32, ncclSum, comm, stream));
  CHECK(ncclAllReduce((void*)b, (void*)b, n, ncclInt32, ncclMax, comm, stream));
  CHECK(ncclGroupEnd());
  DRV(drv_stream_sync(stream));
  DRV(drv_dtoh(host, a, n * 4));
  for (size_t i = 0; i < n; i++) {
    int want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    if (host[i] != want && wrong++ < 3) fprintf(stderr, "group sum: element %zu\n", i);
  }
  DRV(drv_dtoh(host, b, n * 4));
  for (size_t i = 0; i < n; i++) {
    int want = 0;
    for (int r = 0; r < nranks; r++)
      if (2 * value(r, i) > want) want = 2 * value(r, i);
    if (host[i] != want && wrong++ < 3) fprintf(stderr, "group max: element %zu\n", i);
  }
  DRV(drv_free(a));
  DRV(drv_free(b));

  /* ncclMemAlloc with a context current: device memory, usable by the collectives. */
  void* mem = NULL;
  CHECK(ncclMemAlloc(&mem, n * 4));
  unsigned kind = 0;
  DRV(drv_pointer_attribute(&kind, 2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */, (drv_ptr)mem));
  if (kind != 2 /* CU_MEMORYTYPE_DEVICE */) {
    fprintf(stderr, "ncclMemAlloc gave memory of type %u, not device memory\n", kind);
    exit(1);
  }
  for (size_t i = 0; i < n; i++) host[i] = value(rank, i);
  DRV(drv_htod((drv_ptr)mem, host, n * 4));
  CHECK(ncclAllReduce(mem, mem, n, ncclInt32, ncclSum, comm, stream));
  DRV(drv_stream_sync(stream));
  DRV(drv_dtoh(host, (drv_ptr)mem, n * 4));
  for (size_t i = 0; i < n; i++) {
    int want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    if (host[i] != want && wrong++ < 3) fprintf(stderr, "ncclMemAlloc buffer: element %zu\n", i);
  }
  CHECK(ncclMemFree(mem));
  free(host);
  if (wrong) {
    fprintf(stderr, "rank %d: %d wrong elements\n", rank, wrong);
    exit(1);
  }
  printf("OK %d device calls checked, a group of 2, ncclMemAlloc, 4 misuses refused\n", calls + 2);
  return 0;
}

/* ncclCommInitAll in one process, ranks on the GPUs of `devlist` (reversed, so that the
 * list is seen to be followed): ncclCommCuDevice reports each rank's GPU, and a group of
 * all-reduces, one per rank on a stream of its GPU, is checked. */
static int init_all(int nranks) {
  int gpus = 0;
  DRV(drv_device_count(&gpus));
  ncclComm_t comms[8];
  int devlist[8];
  void* ctx[8];
  void* streams[8];
  drv_ptr bufs[8];
  size_t n = 5003;
  int32_t* host = malloc(n * 4);
  for (int r = 0; r < nranks; r++) devlist[r] = (nranks - 1 - r) % gpus;
  CHECK(ncclCommInitAll(comms, nranks, devlist));
  for (int r = 0; r < nranks; r++) {
    int device = -1;
    CHECK(ncclCommCuDevice(comms[r], &device));
    if (device != devlist[r]) {
      fprintf(stderr, "rank %d: ncclCommCuDevice says GPU %d, devlist %d\n", r, device, devlist[r]);
      exit(1);
    }
    DRV(drv_primary_retain(&ctx[r], devlist[r]));
    DRV(drv_set_current(ctx[r]));
    DRV(drv_stream_create(&streams[r], 1));
    bufs[r] = device_alloc(n * 4);
    for (size_t i = 0; i < n; i++) host[i] = value(r, i);
    DRV(drv_htod(bufs[r], host, n * 4));
  }
  CHECK(ncclGroupStart());
  for (int r = 0; r < nranks; r++) {
    DRV(drv_set_current(ctx[r]));
    CHECK(ncclAllReduce((void*)bufs[r], (void*)bufs[r], n, ncclInt32, ncclSum, comms[r], streams[r]));
  }
  CHECK(ncclGroupEnd());
  int wrong = 0;
  for (int r = 0; r < nranks; r++) {
    DRV(drv_set_current(ctx[r]));
    DRV(drv_stream_sync(streams[r]));
    DRV(drv_dtoh(host, bufs[r], n * 4));
    for (size_t i = 0; i < n; i++) {
      int want = 0;
      for (int q = 0; q < nranks; q++) want += value(q, i);
      if (host[i] != want && wrong++ < 3) fprintf(stderr, "rank %d: element %zu\n", r, i);
    }
    DRV(drv_free(bufs[r]));
    CHECK(ncclCommDestroy(comms[r]));
    DRV(drv_stream_destroy(streams[r]));
  }
  free(host);
  if (wrong) return 1;
  printf("OK ncclCommInitAll of %d ranks on GPUs from devlist, a group of all-reduces\n", nranks);
  return 0;
}

/* On the simulated driver: fails unless nothing of ferroccl's is left (the program's own
 * stream is destroyed first). */
static void nothing_left(const char* when) {
  if (!sim_live) return;
  uint64_t live[7];
  sim_live(live);
  if (live[0] || live[1] || live[2] || live[4] || live[5]) {
    fprintf(stderr,
            "%s: left behind: %llu device allocations, %llu page-locked, %llu IPC mappings, "
            "%llu streams, %llu events\n",
            when, (unsigned long long)live[0], (unsigned long long)live[1],
            (unsigned long long)live[2], (unsigned long long)live[4], (unsigned long long)live[5]);
    exit(1);
  }
  printf("nothing left (%llu kernels ran)\n", (unsigned long long)live[6]);
}

/* One all-reduce by every rank, so that the FIFOs are connected. */
static void warm_up(ncclComm_t comm, void* stream, int rank, int nranks) {
  if (run_one(comm, stream, ALL_REDUCE, ncclInt32, 1001, 0, rank, nranks)) exit(1);
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Rank 0 waits in a kernel for rank 1, which never makes the call; rank 0's stream must
 * come back: after ncclCommAbort (`abort`), or after the timeout (`timeout`). */
static int stalled_peer(ncclComm_t comm, void* stream, int rank, int nranks, int by_abort) {
  warm_up(comm, stream, rank, nranks);
  if (rank != 0 && by_abort == 2) {
    usleep(300 * 1000);
    kill(getpid(), SIGKILL);
  }
  if (rank != 0) {
    /* Never makes the second call; leaves once rank 0 is done with it. */
    sleep(by_abort ? 3 : 8);
    CHECK(ncclCommAbort(comm));
    printf("OK\n");
    return 0;
  }
  size_t n = 1001;
  drv_ptr buf = device_alloc(n * 4);
  double start = now();
  CHECK(ncclAllReduce((void*)buf, (void*)buf, n, ncclInt32, ncclSum, comm, stream));
  if (by_abort == 1) {
    usleep(300 * 1000);
    CHECK(ncclCommAbort(comm));
  }
  DRV(drv_stream_sync(stream));
  double waited = now() - start;
  if (by_abort != 1) {
    ncclResult_t async = ncclSuccess;
    CHECK(ncclCommGetAsyncError(comm, &async));
    if (async == ncclSuccess || async == ncclInProgress) {
      fprintf(stderr, "after the timeout, ncclCommGetAsyncError says %d\n", (int)async);
      exit(1);
    }
    printf("async error %d (%s)\n", (int)async, ncclGetLastError(comm));
    if (by_abort == 2 && waited > 10) {
      fprintf(stderr, "the killed peer was noticed only after %.1f s\n", waited);
      exit(1);
    }
    CHECK(ncclCommAbort(comm));
  }
  DRV(drv_free(buf));
  printf("OK the stream came back after %.1f s\n", waited);
  return 0;
}

/* Rank r calls all-reduce with 1001 + 64 r elements: no rank may hang, and each must
 * report an error for the call. */
static int mismatch(ncclComm_t comm, void* stream, int rank, int nranks) {
  warm_up(comm, stream, rank, nranks);
  size_t n = 1001 + 64 * (size_t)rank;
  drv_ptr buf = device_alloc(n * 4);
  double start = now();
  ncclResult_t r = ncclAllReduce((void*)buf, (void*)buf, n, ncclInt32, ncclSum, comm, stream);
  DRV(drv_stream_sync(stream));
  ncclResult_t async = ncclSuccess;
  if (r == ncclSuccess) CHECK(ncclCommGetAsyncError(comm, &async));
  if (r == ncclSuccess && async == ncclSuccess) {
    fprintf(stderr, "rank %d: all-reduces of different counts reported no error\n", rank);
    exit(1);
  }
  printf("rank %d: error %d/%d after %.1f s (%s)\n", rank, (int)r, (int)async, now() - start,
         ncclGetLastError(comm));
  CHECK(ncclCommAbort(comm));
  DRV(drv_free(buf));
  printf("OK\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: device RANK NRANKS ID_FILE MODE (see the top of device.c)\n");
    return 2;
  }
  int rank = atoi(argv[1]), nranks = atoi(argv[2]);
  void* stream = open_gpu(rank);
  if (strcmp(argv[4], "initall") == 0) {
    DRV(drv_stream_destroy(stream));
    int rc = init_all(nranks);
    nothing_left("initall");
    return rc;
  }
  ncclUniqueId id = share_unique_id(rank, argv[3]);
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  int rc;
  const char* mode = argv[4];
  if (strcmp(mode, "collectives") == 0) {
    rc = collectives(comm, stream, rank, nranks);
    CHECK(ncclCommDestroy(comm));
  } else if (strcmp(mode, "mismatch") == 0) {
    rc = mismatch(comm, stream, rank, nranks);
  } else {
    int how = strcmp(mode, "abort") == 0 ? 1 : strcmp(mode, "killed") == 0 ? 2 : 0;
    rc = stalled_peer(comm, stream, rank, nranks, how);
  }
  DRV(drv_stream_destroy(stream));
  nothing_left(mode);
  return rc;
}
