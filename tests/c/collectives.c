/* Every collective × types × ops × counts × in place and out of place, checked against
 * a reference computed here, on `nranks` processes that share a unique id through a
 * file. Also: grouped send/recv around a ring, ncclBcast, a pre-multiplied sum (host
 * and "device" residence), and ncclCommSplit.
 *
 * usage: collectives RANK NRANKS ID_FILE */
#include "common.h"

enum { SUM, PROD, MAX, MIN, AVG };
static const ncclRedOp_t OPS[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};
static const char* OP_NAMES[] = {"sum", "prod", "max", "min", "avg"};
static const size_t COUNTS[] = {0, 1, 7, 1031};

static int rank, nranks, failures, checks;

/* Input element i of rank r for a call reducing with op (values keep every result an
 * exact small integer in every type: products of 1s and 2s, averages of equal values). */
static double input(int r, size_t i, int op) {
  if (op == PROD) return (double)((r + i) % 2 + 1);
  if (op == AVG) return (double)(i % 5 + 1);
  return (double)((r * 3 + i * 7) % 5 + 1);
}

static double reduced(size_t i, int op) {
  double acc = input(0, i, op);
  for (int r = 1; r < nranks; r++) {
    double v = input(r, i, op);
    switch (op) {
      case SUM: case AVG: acc += v; break;
      case PROD: acc *= v; break;
      case MAX: acc = v > acc ? v : acc; break;
      case MIN: acc = v < acc ? v : acc; break;
    }
  }
  return op == AVG ? acc / nranks : acc;
}

static void expect(const char* what, const void* buf, ncclDataType_t t, size_t i, double v) {
  checks++;
  if (!holds(buf, t, i, v) && failures++ < 20)
    fprintf(stderr, "rank %d: %s: element %zu is not %g\n", rank, what, i, v);
}

static void* alloc(size_t elems, ncclDataType_t t) {
  void* p = calloc(elems ? elems : 1, type_size(t));
  if (!p) { perror("calloc"); exit(1); }
  return p;
}

static void reductions(ncclComm_t comm, int ti, size_t count, int op, int in_place) {
  ncclDataType_t t = TYPES[ti];
  char what[128];
  snprintf(what, sizeof what, "%s %s count %zu %s", TYPE_NAMES[ti], OP_NAMES[op], count,
           in_place ? "in place" : "out of place");
  /* all-reduce */
  void* send = alloc(count, t);
  void* recv = in_place ? send : alloc(count, t);
  for (size_t i = 0; i < count; i++) put(send, t, i, input(rank, i, op));
  CHECK(ncclAllReduce(send, recv, count, t, OPS[op], comm, NULL));
  for (size_t i = 0; i < count; i++) expect(what, recv, t, i, reduced(i, op));
  if (!in_place) free(recv);
  free(send);
  /* reduce to every root */
  for (int root = 0; root < nranks; root++) {
    send = alloc(count, t);
    recv = in_place ? send : alloc(count, t);
    for (size_t i = 0; i < count; i++) put(send, t, i, input(rank, i, op));
    CHECK(ncclReduce(send, recv, count, t, OPS[op], root, comm, NULL));
    if (rank == root)
      for (size_t i = 0; i < count; i++) expect(what, recv, t, i, reduced(i, op));
    if (!in_place) free(recv);
    free(send);
  }
  /* reduce-scatter: rank r's block is the reduction of element r*count + i */
  send = alloc(count * nranks, t);
  for (int b = 0; b < nranks; b++)
    for (size_t i = 0; i < count; i++)
      put(send, t, b * count + i, input(rank, b * count + i, op));
  recv = in_place ? (char*)send + rank * count * type_size(t) : alloc(count, t);
  CHECK(ncclReduceScatter(send, recv, count, t, OPS[op], comm, NULL));
  for (size_t i = 0; i < count; i++) expect(what, recv, t, i, reduced(rank * count + i, op));
  if (!in_place) free(recv);
  free(send);
}

static void data_movement(ncclComm_t comm, int ti, size_t count, int in_place) {
  ncclDataType_t t = TYPES[ti];
  size_t sz = type_size(t);
  char what[128];
  snprintf(what, sizeof what, "%s count %zu %s", TYPE_NAMES[ti], count,
           in_place ? "in place" : "out of place");
  /* Rank r's element i is r*11 + i%11 + 1 (distinct per rank, small). */
#define VAL(r, i) ((double)((r) * 11 + (i) % 11 + 1))
  for (int root = 0; root < nranks; root++) {
    /* broadcast (ncclBcast when in place) */
    void* send = alloc(count, t);
    void* recv = in_place ? send : alloc(count, t);
    if (rank == root) for (size_t i = 0; i < count; i++) put(send, t, i, VAL(root, i));
    if (in_place) CHECK(ncclBcast(send, count, t, root, comm, NULL));
    else CHECK(ncclBroadcast(send, recv, count, t, root, comm, NULL));
    for (size_t i = 0; i < count; i++) expect("broadcast", recv, t, i, VAL(root, i));
    if (!in_place) free(recv);
    free(send);
    /* gather */
    recv = alloc(count * nranks, t);
    send = in_place ? (char*)recv + rank * count * sz : alloc(count, t);
    for (size_t i = 0; i < count; i++) put(send, t, i, VAL(rank, i));
    CHECK(ncclGather(send, rank == root ? recv : NULL, count, t, root, comm, NULL));
    if (rank == root)
      for (int r = 0; r < nranks; r++)
        for (size_t i = 0; i < count; i++) expect("gather", recv, t, r * count + i, VAL(r, i));
    if (!in_place) free(send);
    free(recv);
    /* scatter */
    send = alloc(count * nranks, t);
    if (rank == root)
      for (int r = 0; r < nranks; r++)
        for (size_t i = 0; i < count; i++) put(send, t, r * count + i, VAL(r, i));
    recv = in_place ? (char*)send + rank * count * sz : alloc(count, t);
    CHECK(ncclScatter(rank == root ? send : NULL, recv, count, t, root, comm, NULL));
    for (size_t i = 0; i < count; i++) expect("scatter", recv, t, i, VAL(rank, i));
    if (!in_place) free(recv);
    free(send);
  }
  /* all-gather */
  void* recv = alloc(count * nranks, t);
  void* send = in_place ? (char*)recv + rank * count * sz : alloc(count, t);
  for (size_t i = 0; i < count; i++) put(send, t, i, VAL(rank, i));
  CHECK(ncclAllGather(send, recv, count, t, comm, NULL));
  for (int r = 0; r < nranks; r++)
    for (size_t i = 0; i < count; i++) expect("all_gather", recv, t, r * count + i, VAL(r, i));
  if (!in_place) free(send);
  free(recv);
  /* all-to-all (out of place only, as in NCCL): block j of rank r holds VAL(r*4+j, i) */
  if (!in_place) {
    send = alloc(count * nranks, t);
    recv = alloc(count * nranks, t);
    for (int j = 0; j < nranks; j++)
      for (size_t i = 0; i < count; i++) put(send, t, j * count + i, VAL(rank * 4 + j, i));
    CHECK(ncclAlltoAll(send, recv, count, t, comm, NULL));
    for (int r = 0; r < nranks; r++)
      for (size_t i = 0; i < count; i++)
        expect("all_to_all", recv, t, r * count + i, VAL(r * 4 + rank, i));
    free(send);
    free(recv);
  }
#undef VAL
}

static void ring_exchange(ncclComm_t comm) {
  /* Grouped send to the next rank and receive from the previous, plus a send to self. */
  size_t count = 4099;
  int32_t* out = alloc(count, ncclInt32);
  int32_t* in = alloc(count, ncclInt32);
  int32_t* self_in = alloc(count, ncclInt32);
  for (size_t i = 0; i < count; i++) out[i] = rank * 100000 + (int32_t)i;
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  CHECK(ncclGroupStart());
  CHECK(ncclSend(out, count, ncclInt32, next, comm, NULL));
  CHECK(ncclRecv(in, count, ncclInt32, prev, comm, NULL));
  CHECK(ncclGroupStart()); /* groups nest */
  CHECK(ncclSend(out, count, ncclInt32, rank, comm, NULL));
  CHECK(ncclRecv(self_in, count, ncclInt32, rank, comm, NULL));
  CHECK(ncclGroupEnd());
  CHECK(ncclGroupEnd());
  for (size_t i = 0; i < count; i++) {
    checks += 2;
    if (in[i] != prev * 100000 + (int32_t)i || self_in[i] != out[i]) {
      if (failures++ < 20) fprintf(stderr, "rank %d: ring exchange element %zu\n", rank, i);
    }
  }
  free(out);
  free(in);
  free(self_in);
}

static void pre_mul_sum(ncclComm_t comm) {
  float scalar = 0.5f;
  ncclRedOp_t half_sum, at_call;
  CHECK(ncclRedOpCreatePreMulSum(&half_sum, &scalar, ncclFloat32, ncclScalarHostImmediate, comm));
  CHECK(ncclRedOpCreatePreMulSum(&at_call, &scalar, ncclFloat32, ncclScalarDevice, comm));
  float buf[5];
  for (int i = 0; i < 5; i++) buf[i] = (float)(2 * (rank + i));
  CHECK(ncclAllReduce(buf, buf, 5, ncclFloat32, half_sum, comm, NULL));
  for (int i = 0; i < 5; i++) {
    double want = 0;
    for (int r = 0; r < nranks; r++) want += r + i;
    checks++;
    if (buf[i] != (float)want && failures++ < 20)
      fprintf(stderr, "rank %d: premulsum element %d is %g, not %g\n", rank, i, buf[i], want);
  }
  /* The "device" residence op reads the scalar at each call. */
  scalar = 3.0f;
  for (int i = 0; i < 5; i++) buf[i] = 1.0f;
  CHECK(ncclAllReduce(buf, buf, 5, ncclFloat32, at_call, comm, NULL));
  for (int i = 0; i < 5; i++) {
    checks++;
    if (buf[i] != 3.0f * nranks && failures++ < 20)
      fprintf(stderr, "rank %d: premulsum (read at call) element %d is %g\n", rank, i, buf[i]);
  }
  CHECK(ncclRedOpDestroy(half_sum, comm));
  CHECK(ncclRedOpDestroy(at_call, comm));
}

static void split(ncclComm_t comm) {
  /* Even and odd ranks, each ordered by descending parent rank. */
  ncclComm_t sub;
  CHECK(ncclCommSplit(comm, rank % 2, -rank, &sub, NULL));
  int count, sub_rank, members = 0, position = 0;
  for (int r = nranks - 1; r >= 0; r--) {
    if (r % 2 != rank % 2) continue;
    if (r == rank) position = members;
    members++;
  }
  CHECK(ncclCommCount(sub, &count));
  CHECK(ncclCommUserRank(sub, &sub_rank));
  checks += 3;
  if (count != members || sub_rank != position) {
    failures++;
    fprintf(stderr, "rank %d: split gave rank %d of %d, want %d of %d\n", rank, sub_rank,
            count, position, members);
  }
  int64_t v = rank;
  CHECK(ncclAllReduce(&v, &v, 1, ncclInt64, ncclSum, sub, NULL));
  int64_t want = 0;
  for (int r = rank % 2; r < nranks; r += 2) want += r;
  if (v != want) {
    failures++;
    fprintf(stderr, "rank %d: split all-reduce gave %lld, want %lld\n", rank, (long long)v,
            (long long)want);
  }
  CHECK(ncclCommDestroy(sub));
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s RANK NRANKS ID_FILE\n", argv[0]);
    return 2;
  }
  rank = atoi(argv[1]);
  nranks = atoi(argv[2]);
  ncclUniqueId id = share_unique_id(rank, argv[3]);
  ncclComm_t comm;
  CHECK(ncclCommInitRank(&comm, nranks, id, rank));
  int n, me, version;
  CHECK(ncclCommCount(comm, &n));
  CHECK(ncclCommUserRank(comm, &me));
  CHECK(ncclGetVersion(&version));
  if (n != nranks || me != rank || version < 22100) {
    fprintf(stderr, "rank %d: count %d, rank %d, version %d\n", rank, n, me, version);
    return 1;
  }
  for (int ti = 0; ti < NTYPES; ti++)
    for (size_t ci = 0; ci < sizeof COUNTS / sizeof COUNTS[0]; ci++)
      for (int in_place = 0; in_place < 2; in_place++) {
        for (int op = 0; op < 5; op++) reductions(comm, ti, COUNTS[ci], op, in_place);
        data_movement(comm, ti, COUNTS[ci], in_place);
      }
  ring_exchange(comm);
  pre_mul_sum(comm);
  split(comm);
  CHECK(ncclCommFinalize(comm));
  CHECK(ncclCommDestroy(comm));
  if (failures) {
    fprintf(stderr, "rank %d: %d of %d checks failed\n", rank, failures, checks);
    return 1;
  }
  printf("rank %d: OK, %d checks\n", rank, checks);
  return 0;
}
