/* One thread driving several ranks, as single-process multi-GPU NCCL programs do:
 * ncclCommInitAll, and ncclCommInitRank for every rank inside one group; then grouped
 * collectives and send/recv across all the ranks.
 *
 * usage: one_thread NRANKS */
#include "common.h"

static int failures;

static void all_reduce_everywhere(ncclComm_t* comms, int n, const char* what) {
  enum { COUNT = 10007 };
  static int32_t bufs[16][COUNT];
  CHECK(ncclGroupStart());
  for (int r = 0; r < n; r++) {
    for (int i = 0; i < COUNT; i++) bufs[r][i] = r + i;
    CHECK(ncclAllReduce(bufs[r], bufs[r], COUNT, ncclInt32, ncclSum, comms[r], NULL));
  }
  CHECK(ncclGroupEnd());
  for (int r = 0; r < n; r++)
    for (int i = 0; i < COUNT; i++)
      if (bufs[r][i] != n * i + n * (n - 1) / 2 && failures++ < 10)
        fprintf(stderr, "%s: rank %d element %d is %d\n", what, r, i, bufs[r][i]);
}

int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 4;
  if (n < 1 || n > 16) return 2;
  ncclComm_t comms[16];

  CHECK(ncclCommInitAll(comms, n, NULL));
  all_reduce_everywhere(comms, n, "ncclCommInitAll");
  for (int r = 0; r < n; r++) CHECK(ncclCommDestroy(comms[r]));

  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  CHECK(ncclGroupStart());
  for (int r = 0; r < n; r++) CHECK(ncclCommInitRank(&comms[r], n, id, r));
  CHECK(ncclGroupEnd());
  all_reduce_everywhere(comms, n, "ncclCommInitRank in a group");

  /* Every rank sends its rank to every other rank, all in one group. */
  int64_t got[16][16], mine[16];
  CHECK(ncclGroupStart());
  for (int r = 0; r < n; r++) {
    mine[r] = 1000 + r;
    for (int p = 0; p < n; p++) {
      CHECK(ncclSend(&mine[r], 1, ncclInt64, p, comms[r], NULL));
      CHECK(ncclRecv(&got[r][p], 1, ncclInt64, p, comms[r], NULL));
    }
  }
  CHECK(ncclGroupEnd());
  for (int r = 0; r < n; r++)
    for (int p = 0; p < n; p++)
      if (got[r][p] != 1000 + p && failures++ < 10)
        fprintf(stderr, "send/recv: rank %d got %lld from %d\n", r, (long long)got[r][p], p);
  for (int r = 0; r < n; r++) CHECK(ncclCommDestroy(comms[r]));
  if (failures) return 1;
  printf("OK, %d ranks in one thread\n", n);
  return 0;
}
