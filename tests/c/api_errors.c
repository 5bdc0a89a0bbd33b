/* Bad input and misuse, each checked for its ncclResult_t and a message from
 * ncclGetLastError naming what was wrong; plus non-blocking init, ncclMemAlloc and
 * buffer registration. One process, one-rank communicators.
 *
 * usage: api_errors */
#include "common.h"

static int failures;

/* Checks that `got` is `want` and the last error mentions `needle`. */
static void expect_error(const char* what, ncclResult_t got, ncclResult_t want,
                         const char* needle) {
  const char* msg = ncclGetLastError(NULL);
  if (got != want || (needle && !strstr(msg, needle))) {
    failures++;
    fprintf(stderr, "%s: got %d, want %d; last error \"%s\" should contain \"%s\"\n", what,
            (int)got, (int)want, msg, needle ? needle : "");
  } else {
    printf("ok: %s -> %d (%s)\n", what, (int)got, msg);
  }
}

static ncclComm_t one_rank_comm(void) {
  ncclUniqueId id;
  ncclComm_t comm;
  CHECK(ncclGetUniqueId(&id));
  CHECK(ncclCommInitRank(&comm, 1, id, 0));
  return comm;
}

int main(void) {
  ncclComm_t comm = one_rank_comm();
  float a[4] = {1, 2, 3, 4}, b[4];
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));

  expect_error("NULL comm", ncclAllReduce(a, b, 4, ncclFloat32, ncclSum, NULL, NULL),
               ncclInvalidArgument, "comm is NULL");
  expect_error("made-up comm", ncclAllReduce(a, b, 4, ncclFloat32, ncclSum, (ncclComm_t)a, NULL),
               ncclInvalidArgument, "not a live communicator");
  expect_error("data type 12", ncclAllReduce(a, b, 4, (ncclDataType_t)12, ncclSum, comm, NULL),
               ncclInvalidArgument, "data type 12");
  expect_error("op 9", ncclAllReduce(a, b, 4, ncclFloat32, (ncclRedOp_t)9, comm, NULL),
               ncclInvalidArgument, "reduction op 9");
  expect_error("op -1", ncclAllReduce(a, b, 4, ncclFloat32, (ncclRedOp_t)-1, comm, NULL),
               ncclInvalidArgument, "reduction op -1");
  expect_error("root 5", ncclBroadcast(a, b, 4, ncclFloat32, 5, comm, NULL),
               ncclInvalidArgument, "root 5");
  expect_error("root -1", ncclReduce(a, b, 4, ncclFloat32, ncclSum, -1, comm, NULL),
               ncclInvalidArgument, "root -1");
  expect_error("peer 1 of 1", ncclSend(a, 4, ncclFloat32, 1, comm, NULL),
               ncclInvalidArgument, "peer 1");
  expect_error("NULL sendbuff", ncclAllReduce(NULL, b, 4, ncclFloat32, ncclSum, comm, NULL),
               ncclInvalidArgument, "sendbuff is NULL");
  expect_error("NULL recvbuff", ncclAllGather(a, NULL, 4, ncclFloat32, comm, NULL),
               ncclInvalidArgument, "recvbuff is NULL");
  expect_error("count overflow", ncclAllReduce(a, b, SIZE_MAX / 2, ncclFloat32, ncclSum, comm, NULL),
               ncclInvalidArgument, "overflows");
  expect_error("a stream without CUDA",
               ncclAllReduce(a, b, 4, ncclFloat32, ncclSum, comm, (cudaStream_t)a),
               ncclUnhandledCudaError, "no CUDA driver");
  int device = -1;
  expect_error("cuDevice of a host comm", ncclCommCuDevice(comm, &device), ncclInvalidUsage,
               "no CUDA device");
  expect_error("destroy a built-in op", ncclRedOpDestroy(ncclSum, comm), ncclInvalidArgument,
               "built in");
  expect_error("destroy an op never made", ncclRedOpDestroy((ncclRedOp_t)7, comm),
               ncclInvalidArgument, "not made");
  ncclRedOp_t op;
  expect_error("premulsum scalar NULL",
               ncclRedOpCreatePreMulSum(&op, NULL, ncclFloat32, ncclScalarHostImmediate, comm),
               ncclInvalidArgument, "scalar is NULL");
  double two = 2;
  CHECK(ncclRedOpCreatePreMulSum(&op, &two, ncclFloat64, ncclScalarHostImmediate, comm));
  expect_error("premulsum op on another type",
               ncclAllReduce(a, b, 4, ncclFloat32, op, comm, NULL), ncclInvalidArgument,
               "made for double");
  CHECK(ncclRedOpDestroy(op, comm));
  expect_error("op used after destroy", ncclAllReduce(a, b, 4, ncclFloat32, op, comm, NULL),
               ncclInvalidArgument, "reduction op");

  ncclComm_t c2;
  expect_error("nranks 0", ncclCommInitRank(&c2, 0, id, 0), ncclInvalidArgument, "nranks 0");
  expect_error("rank 3 of 2", ncclCommInitRank(&c2, 2, id, 3), ncclInvalidArgument, "rank 3");
  expect_error("NULL comm pointer", ncclCommInitRank(NULL, 1, id, 0), ncclInvalidArgument,
               "NULL");
  ncclUniqueId zeros;
  memset(&zeros, 0, sizeof zeros);
  expect_error("all-zero unique id", ncclCommInitRank(&c2, 1, zeros, 0), ncclInvalidArgument,
               "unique id");
  ncclConfig_t bad = NCCL_CONFIG_INITIALIZER;
  bad.magic = 0;
  expect_error("config without the initializer", ncclCommInitRankConfig(&c2, 1, id, 0, &bad),
               ncclInvalidArgument, "NCCL_CONFIG_INITIALIZER");
#ifdef FERROCCL_NCCL_H
  /* ferroccl's own config field: 0 or 1 (or unset), anything else named. */
  ncclConfig_t det = NCCL_CONFIG_INITIALIZER;
  det.ferrocclDeterministic = 7;
  expect_error("ferrocclDeterministic of 7", ncclCommInitRankConfig(&c2, 1, id, 0, &det),
               ncclInvalidArgument, "ferrocclDeterministic is 7");
  det.ferrocclDeterministic = 1;
  CHECK(ncclGetUniqueId(&id));
  CHECK(ncclCommInitRankConfig(&c2, 1, id, 0, &det));
  float d = 2;
  CHECK(ncclAllReduce(&d, &d, 1, ncclFloat32, ncclAvg, c2, NULL));
  if (d != 2) {
    failures++;
    fprintf(stderr, "deterministic 1-rank avg gave %g\n", (double)d);
  }
  CHECK(ncclCommDestroy(c2));
#endif

  expect_error("group end without start", ncclGroupEnd(), ncclInvalidUsage, "without");
  CHECK(ncclGroupStart());
  expect_error("bad call inside a group",
               ncclAllReduce(a, b, 4, (ncclDataType_t)99, ncclSum, comm, NULL),
               ncclInvalidArgument, "data type 99");
  expect_error("the group fails with it", ncclGroupEnd(), ncclInvalidArgument, "data type 99");

  void* mem = NULL;
  CHECK(ncclMemAlloc(&mem, 1 << 20));
  if (!mem || ((uintptr_t)mem % 4096) != 0) {
    failures++;
    fprintf(stderr, "ncclMemAlloc gave %p\n", mem);
  }
  memset(mem, 1, 1 << 20);
  CHECK(ncclMemFree(mem));
  expect_error("free twice", ncclMemFree(mem), ncclInvalidArgument, "not allocated");
#ifdef NCCL_WIN_COLL_SYMMETRIC
  /* A window of ncclMemAlloc memory: registered, used by a call, ended; the rest named. */
  {
    void* wmem = NULL;
    ncclWindow_t win;
    CHECK(ncclMemAlloc(&wmem, 1 << 16));
    float* wf = (float*)wmem;
    for (int i = 0; i < 16; i++) wf[i] = (float)i;
    CHECK(ncclCommWindowRegister(comm, wmem, 1 << 16, &win, NCCL_WIN_COLL_SYMMETRIC));
    CHECK(ncclAllReduce(wf, wf + 16, 16, ncclFloat32, ncclSum, comm, NULL));
    for (int i = 0; i < 16; i++) {
      if (wf[16 + i] != (float)i) {
        failures++;
        fprintf(stderr, "all-reduce in a window: element %d is %g\n", i, (double)wf[16 + i]);
      }
    }
    CHECK(ncclCommWindowDeregister(comm, win));
    expect_error("window deregistered twice", ncclCommWindowDeregister(comm, win),
                 ncclInvalidArgument, "not a window of this communicator");
    expect_error("window of stack memory", ncclCommWindowRegister(comm, a, sizeof a, &win, 0),
                 ncclInvalidArgument, "not in one allocation of shared memory");
    expect_error("window flags 2", ncclCommWindowRegister(comm, wmem, 64, &win, 2),
                 ncclInvalidArgument, "winFlags 0x2");
    expect_error("window into NULL", ncclCommWindowRegister(comm, wmem, 64, NULL, 0),
                 ncclInvalidArgument, "win is NULL");
    expect_error("window of NULL", ncclCommWindowRegister(comm, NULL, 64, &win, 0),
                 ncclInvalidArgument, "buff is NULL for 64 bytes");
    CHECK(ncclGroupStart());
    expect_error("window inside a group", ncclCommWindowRegister(comm, wmem, 64, &win, 0),
                 ncclInvalidUsage, "inside ncclGroupStart/ncclGroupEnd");
    CHECK(ncclGroupEnd());
    /* After those refusals the communicator registers as before. */
    CHECK(ncclCommWindowRegister(comm, wmem, 64, &win, 0));
    CHECK(ncclCommWindowDeregister(comm, win));
    CHECK(ncclMemFree(wmem));
  }
#endif
  void* reg;
  CHECK(ncclCommRegister(comm, a, sizeof a, &reg));
  CHECK(ncclCommDeregister(comm, reg));
  expect_error("deregister twice", ncclCommDeregister(comm, reg), ncclInvalidArgument,
               "not a registration");

  /* NULL out-pointers and values out of range, each named. */
  expect_error("version NULL", ncclGetVersion(NULL), ncclInvalidArgument, "version is NULL");
  expect_error("uniqueId NULL", ncclGetUniqueId(NULL), ncclInvalidArgument, "uniqueId is NULL");
  expect_error("init-all output NULL", ncclCommInitAll(NULL, 1, NULL), ncclInvalidArgument,
               "output array");
  expect_error("init-all of 0", ncclCommInitAll(&c2, 0, NULL), ncclInvalidArgument, "ndev 0");
  expect_error("asyncError NULL", ncclCommGetAsyncError(comm, NULL), ncclInvalidArgument,
               "asyncError is NULL");
  expect_error("count NULL", ncclCommCount(comm, NULL), ncclInvalidArgument, "count is NULL");
  expect_error("rank NULL", ncclCommUserRank(comm, NULL), ncclInvalidArgument, "rank is NULL");
  expect_error("device NULL", ncclCommCuDevice(comm, NULL), ncclInvalidArgument,
               "device is NULL");
  expect_error("split into NULL", ncclCommSplit(comm, 0, 0, NULL, NULL), ncclInvalidArgument,
               "newcomm is NULL");
  expect_error("split color -5", ncclCommSplit(comm, -5, 0, &c2, NULL), ncclInvalidArgument,
               "color -5");
  CHECK(ncclGroupStart());
  expect_error("split inside a group", ncclCommSplit(comm, 0, 0, &c2, NULL), ncclInvalidUsage,
               "inside ncclGroupStart");
  CHECK(ncclGroupEnd());
#ifdef FERROCCL_NCCL_H
  int exclude[1] = {0};
  expect_error("shrink into NULL", ncclCommShrink(comm, exclude, 0, NULL, NULL, 0),
               ncclInvalidArgument, "newcomm is NULL");
  expect_error("shrink count -1", ncclCommShrink(comm, exclude, -1, &c2, NULL, 0),
               ncclInvalidArgument, "excludeRanksCount -1");
  expect_error("shrink list NULL", ncclCommShrink(comm, NULL, 1, &c2, NULL, 0),
               ncclInvalidArgument, "excludeRanksList is NULL");
  expect_error("shrink flags 4", ncclCommShrink(comm, exclude, 0, &c2, NULL, 4),
               ncclInvalidArgument, "shrinkFlags 0x4");
  CHECK(ncclGroupStart());
  expect_error("shrink inside a group", ncclCommShrink(comm, exclude, 0, &c2, NULL, 0),
               ncclInvalidUsage, "inside ncclGroupStart");
  CHECK(ncclGroupEnd());
#endif
  void* out_reg;
  expect_error("register into NULL", ncclCommRegister(comm, a, sizeof a, NULL),
               ncclInvalidArgument, "handle is NULL");
  expect_error("register NULL buffer", ncclCommRegister(comm, NULL, 64, &out_reg),
               ncclInvalidArgument, "buff is NULL for 64 bytes");
  expect_error("ncclMemAlloc into NULL", ncclMemAlloc(NULL, 64), ncclInvalidArgument,
               "ptr is NULL");
  CHECK(ncclMemFree(NULL));
  expect_error("premulsum into NULL",
               ncclRedOpCreatePreMulSum(NULL, &two, ncclFloat64, ncclScalarHostImmediate, comm),
               ncclInvalidArgument, "op is NULL");
  expect_error("premulsum residence 7",
               ncclRedOpCreatePreMulSum(&op, &two, ncclFloat64, (ncclScalarResidence_t)7, comm),
               ncclInvalidArgument, "residence 7");
  static const char* codes[] = {"no error", "unhandled cuda error", "unhandled system error",
                                "internal error", "invalid argument", "invalid usage",
                                "remote process exited", "in progress", "unknown result code"};
  for (int code = 0; code <= 8; code++) {
    if (!strstr(ncclGetErrorString((ncclResult_t)code), codes[code])) {
      failures++;
      fprintf(stderr, "ncclGetErrorString(%d) is \"%s\"\n", code,
              ncclGetErrorString((ncclResult_t)code));
    }
  }

  /* Configs that are too small or say blocking = 5. */
  ncclConfig_t small = NCCL_CONFIG_INITIALIZER;
  small.size = 8;
  expect_error("config of 8 bytes", ncclCommInitRankConfig(&c2, 1, id, 0, &small),
               ncclInvalidArgument, "config size 8 is too small");
  ncclConfig_t five = NCCL_CONFIG_INITIALIZER;
  five.blocking = 5;
  expect_error("config.blocking 5", ncclCommInitRankConfig(&c2, 1, id, 0, &five),
               ncclInvalidArgument, "config.blocking is 5");

  /* A communicator created in a group that fails: its init never runs, and every later
   * use says why; ncclCommGetAsyncError reports the group's error. */
  ncclComm_t in_failed_group;
  CHECK(ncclGetUniqueId(&id));
  CHECK(ncclGroupStart());
  CHECK(ncclCommInitRank(&in_failed_group, 1, id, 0));
  expect_error("a bad call in that group",
               ncclAllReduce(a, b, 4, (ncclDataType_t)99, ncclSum, in_failed_group, NULL),
               ncclInvalidArgument, "data type 99");
  expect_error("destroy before it exists", ncclCommDestroy(in_failed_group), ncclInvalidUsage,
               "still initialising");
  ncclResult_t st = ncclSuccess;
  CHECK(ncclCommGetAsyncError(in_failed_group, &st));
  if (st != ncclInProgress) {
    failures++;
    fprintf(stderr, "a comm of an open group is %d, not in progress\n", (int)st);
  }
  expect_error("the group fails", ncclGroupEnd(), ncclInvalidArgument, "data type 99");
  CHECK(ncclCommGetAsyncError(in_failed_group, &st));
  if (st == ncclSuccess || st == ncclInProgress) {
    failures++;
    fprintf(stderr, "a comm of a failed group reports %d\n", (int)st);
  }
  expect_error("use after its group failed",
               ncclAllReduce(a, b, 4, ncclFloat32, ncclSum, in_failed_group, NULL),
               ncclInvalidArgument, "initialisation failed");
  CHECK(ncclCommDestroy(in_failed_group));

  /* After ncclCommFinalize only queries and ncclCommDestroy. */
  ncclComm_t fin = one_rank_comm();
  CHECK(ncclCommFinalize(fin));
  expect_error("a call after finalize",
               ncclAllReduce(a, b, 4, ncclFloat32, ncclSum, fin, NULL), ncclInvalidUsage,
               "finalized");
  int n = 0;
  CHECK(ncclCommCount(fin, &n));
  if (n != 1) failures++;
  CHECK(ncclCommDestroy(fin));

  /* Non-blocking init: ncclInProgress, then poll until done. */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t nb;
  CHECK(ncclGetUniqueId(&id));
  ncclResult_t r = ncclCommInitRankConfig(&nb, 1, id, 0, &cfg);
  if (r != ncclInProgress && r != ncclSuccess) {
    failures++;
    fprintf(stderr, "non-blocking init returned %d\n", (int)r);
  }
  ncclResult_t state = ncclInProgress;
  for (int i = 0; i < 6000 && state == ncclInProgress; i++) {
    CHECK(ncclCommGetAsyncError(nb, &state));
    if (state == ncclInProgress) usleep(10 * 1000);
  }
  if (state != ncclSuccess) {
    failures++;
    fprintf(stderr, "non-blocking init ended with %d: %s\n", (int)state, ncclGetLastError(NULL));
  }
  float x = 5;
  CHECK(ncclAllReduce(&x, &x, 1, ncclFloat32, ncclSum, nb, NULL));
  CHECK(ncclCommDestroy(nb));

  CHECK(ncclAllReduce(a, b, 4, ncclFloat32, ncclMax, comm, NULL));
  if (b[3] != 4) failures++;
  CHECK(ncclCommDestroy(comm));
  expect_error("use after destroy", ncclAllReduce(a, b, 4, ncclFloat32, ncclSum, comm, NULL),
               ncclInvalidArgument, "not a live communicator");
  expect_error("destroy twice", ncclCommDestroy(comm), ncclInvalidArgument,
               "not a live communicator");
  if (strlen(ncclGetErrorString(ncclInvalidArgument)) == 0) failures++;

  if (failures) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("OK, every error checked\n");
  return 0;
}
