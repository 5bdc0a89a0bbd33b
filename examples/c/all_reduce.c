/* A complete NCCL program: four ranks driven by one thread (ncclCommInitAll), an
 * all-reduce of each rank's buffer in one group, and a check of the sums. It uses only
 * nccl.h, so it builds against NVIDIA's NCCL as well; with ferroccl the buffers are
 * host memory and the stream is NULL.
 *
 *   tools/install-libnccl /tmp/ferroccl
 *   cc -I/tmp/ferroccl/include examples/c/all_reduce.c -L/tmp/ferroccl/lib -lnccl -o all_reduce
 *   LD_LIBRARY_PATH=/tmp/ferroccl/lib ./all_reduce
 */
#include <nccl.h>
#include <stdio.h>

#define RANKS 4
#define COUNT 1000000

static float bufs[RANKS][COUNT];

int main(void) {
  ncclComm_t comms[RANKS];
  int version;
  if (ncclGetVersion(&version) != ncclSuccess || ncclCommInitAll(comms, RANKS, NULL) != ncclSuccess) {
    fprintf(stderr, "init failed: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  for (int r = 0; r < RANKS; r++)
    for (int i = 0; i < COUNT; i++) bufs[r][i] = (float)(r + 1);
  ncclGroupStart();
  for (int r = 0; r < RANKS; r++)
    ncclAllReduce(bufs[r], bufs[r], COUNT, ncclFloat, ncclSum, comms[r], NULL);
  if (ncclGroupEnd() != ncclSuccess) {
    fprintf(stderr, "all-reduce failed: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  int wrong = 0;
  for (int r = 0; r < RANKS; r++)
    for (int i = 0; i < COUNT; i++) wrong += bufs[r][i] != RANKS * (RANKS + 1) / 2;
  for (int r = 0; r < RANKS; r++) ncclCommDestroy(comms[r]);
  printf("NCCL API %d: all-reduce of %d floats on %d ranks: %s (every element %g)\n", version,
         COUNT, RANKS, wrong ? "WRONG" : "OK", bufs[0][0]);
  return wrong != 0;
}
