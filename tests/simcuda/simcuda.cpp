// A simulated CUDA driver (`libcuda`) for ferroccl's tests: the driver-API calls that
// ferroccl, cudarc and the tests make, implemented on host memory with the real
// semantics and error codes, and stricter than the hardware about misuse. See
// tests/simcuda/README.md for what it simulates, what it checks and how it is selected.
//
// - Devices: FERROCCL_SIM_GPUS (default 1) GPUs per host with the attributes ferroccl
//   reads (FERROCCL_SIM_CC "9.0", FERROCCL_SIM_SMS 132, FERROCCL_SIM_MEMORY_MIB 81920,
//   FERROCCL_SIM_DRIVER_VERSION 13000, FERROCCL_SIM_COMPUTE_MODE default|exclusive-process|
//   prohibited), and P2P between them (FERROCCL_SIM_P2P: "all", "none" or pairs "0-1,2-3";
//   FERROCCL_SIM_LINK: over "pcie" or "nvlink", which has native atomics).
// - Memory: every allocation is its own mapping; a freed one is replaced by an
//   inaccessible mapping (kept in quarantine), so a use after free faults at the access.
//   Device memory is a file on /dev/shm (unnamed until exported), so IPC handles map it
//   in other processes.
// - Streams are in-order worker threads; the legacy default stream synchronises with
//   blocking streams; events, cuStreamWaitValue32, host-mapped memory.
// - Kernels: cuModuleLoadData takes a cubin (ELF, EM_CUDA) for the device's architecture
//   and resolves its entry points to the host-C++ builds of the same kernels/*.cu;
//   cuLaunchKernel runs the grid on host threads, at most FERROCCL_SIM_RESIDENT_BLOCKS
//   (default: the SM count) blocks of a device at once: a block that does not fit waits
//   for an earlier one to finish. Before a kernel runs, every address it will touch is
//   checked: live, inside its allocation, and reachable from the launching device (its
//   own memory, host-mapped memory, IPC mappings, or a peer's with peer access enabled).
//   A bad one is a sticky CUDA_ERROR_ILLEGAL_ADDRESS on the context, named on stderr.
//   Kernels load lazily, as CUDA_MODULE_LOADING=LAZY (the real default) does: at
//   cuFuncLoad or at their first launch, which waits for the context's queued work.
// - Faults: FERROCCL_SIM_FAIL names driver calls that fail (CUDA_ERROR_UNKNOWN).
#include "../../kernels/host/shim.h"

#include "../../kernels/executor.cu"
#include "../../kernels/reduce.cu"

#include <dirent.h>
#include <cerrno>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#define SIM_API extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
namespace sim {
struct Ctx;
struct Stream;
struct Event;
struct Module;
struct Function;
}  // namespace sim
typedef sim::Ctx* CUcontext;
typedef sim::Stream* CUstream;
typedef sim::Event* CUevent;
typedef sim::Module* CUmodule;
typedef sim::Function* CUfunction;
struct CUipcMemHandle {
  char reserved[64];
};
struct CUuuid {
  char bytes[16];
};

enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_MAP_FAILED = 205,
  CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
  CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
  CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_UNKNOWN = 999,
};

namespace sim {

// ----- configuration ------------------------------------------------------------------

long env_long(const char* name, long fallback) {
  const char* v = getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = strtol(v, &end, 10);
  if (*end) {
    fprintf(stderr, "simcuda: %s=%s is not a number\n", name, v);
    abort();
  }
  return x;
}

struct Config {
  int devices = 1;
  int cc_major = 9, cc_minor = 0;
  int sms = 132;
  size_t memory = 81920ull << 20;
  int driver_version = 13000;
  int resident_blocks = 132;
  int compute_mode = 0;  // 0 default, 2 prohibited, 3 exclusive-process
  std::string p2p = "all";
  bool nvlink = false;  // P2P pairs over NVLink (native atomics) rather than PCIe
  bool verbose = false;
  bool eager = false;  // CUDA_MODULE_LOADING=EAGER: kernels load with their module

  void load() {
    if (const char* m = getenv("CUDA_MODULE_LOADING")) eager = strcmp(m, "EAGER") == 0;
    devices = (int)env_long("FERROCCL_SIM_GPUS", 1);
    if (const char* cc = getenv("FERROCCL_SIM_CC")) {
      if (sscanf(cc, "%d.%d", &cc_major, &cc_minor) != 2) {
        fprintf(stderr, "simcuda: FERROCCL_SIM_CC=%s is not MAJOR.MINOR\n", cc);
        abort();
      }
    }
    sms = (int)env_long("FERROCCL_SIM_SMS", 132);
    memory = (size_t)env_long("FERROCCL_SIM_MEMORY_MIB", 81920) << 20;
    driver_version = (int)env_long("FERROCCL_SIM_DRIVER_VERSION", 13000);
    resident_blocks = (int)env_long("FERROCCL_SIM_RESIDENT_BLOCKS", sms);
    if (const char* p = getenv("FERROCCL_SIM_P2P")) p2p = p;
    if (const char* l = getenv("FERROCCL_SIM_LINK")) {
      std::string s = l;
      if (s != "pcie" && s != "nvlink") {
        fprintf(stderr, "simcuda: FERROCCL_SIM_LINK=%s is not pcie or nvlink\n", l);
        abort();
      }
      nvlink = s == "nvlink";
    }
    if (const char* m = getenv("FERROCCL_SIM_COMPUTE_MODE")) {
      std::string s = m;
      compute_mode = s == "exclusive-process" ? 3 : s == "prohibited" ? 2 : 0;
    }
    verbose = getenv("FERROCCL_SIM_VERBOSE") != nullptr;
  }

  bool can_access_peer(int a, int b) const {
    if (a == b) return false;
    if (p2p == "all") return true;
    if (p2p == "none") return false;
    // Pairs "0-1,2-3", symmetric.
    size_t at = 0;
    while (at < p2p.size()) {
      int x = -1, y = -1;
      if (sscanf(p2p.c_str() + at, "%d-%d", &x, &y) == 2 && ((x == a && y == b) || (x == b && y == a)))
        return true;
      size_t comma = p2p.find(',', at);
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    return false;
  }
};

Config config;
std::atomic<bool> initialised{false};

void say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "simcuda[%d]: ", getpid());
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

// ----- one lock for the driver's state, one condition for progress -----------------------

std::mutex mu;                    // every table below, and the streams' counters
std::condition_variable progress;  // a stream op finished, an event fired
thread_local std::vector<Ctx*> current;

// ----- memory -----------------------------------------------------------------------------

enum class Kind { Device, HostMapped, Imported };

struct Region {
  uintptr_t base;
  size_t size;
  Kind kind;
  int device;   // Device / Imported: the GPU it lives on
  Ctx* ctx;     // the context that made it
  int fd = -1;  // Device: the /dev/shm file behind it
  uint64_t id = 0;
  bool exported = false;
  unsigned flags = 0;
  bool registered = false;  // cuMemHostRegister: someone else's mapping
};

std::map<uintptr_t, Region> regions;  // by base
std::deque<std::pair<void*, size_t>> quarantine;
size_t quarantined = 0;
const size_t QUARANTINE_LIMIT = 16ull << 30;  // address space only (PROT_NONE, no memory)
std::atomic<uint64_t> next_id{1};
size_t allocated[64];

const Region* find_region(uintptr_t p) {
  auto it = regions.upper_bound(p);
  if (it == regions.begin()) return nullptr;
  --it;
  if (p >= it->second.base && p < it->second.base + std::max<size_t>(it->second.size, 1)) return &it->second;
  return nullptr;
}

size_t round_pages(size_t n) {
  size_t page = 4096;
  return (std::max<size_t>(n, 1) + page - 1) / page * page;
}

// Replaces a mapping by an inaccessible one, so that later accesses fault.
void retire_mapping(void* base, size_t size) {
  size = round_pages(size);
  void* p = mmap(base, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    munmap(base, size);
    return;
  }
  quarantine.emplace_back(base, size);
  quarantined += size;
  while (quarantined > QUARANTINE_LIMIT && !quarantine.empty()) {
    munmap(quarantine.front().first, quarantine.front().second);
    quarantined -= quarantine.front().second;
    quarantine.pop_front();
  }
}

std::string shm_name(int pid, uint64_t id) {
  char name[96];
  snprintf(name, sizeof name, "/dev/shm/ferroccl-simcuda-%d-%llu", pid, (unsigned long long)id);
  return name;
}

// Files of exported allocations whose process is gone (killed before it could free
// them): the real driver reclaims a dead process's memory, so the simulated one does.
void sweep_dead_exports() {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  while (dirent* e = readdir(d)) {
    int pid = 0;
    unsigned long long id = 0;
    if (sscanf(e->d_name, "ferroccl-simcuda-%d-%llu", &pid, &id) == 2 && pid > 0 && kill(pid, 0) != 0 &&
        errno == ESRCH) {
      std::string path = std::string("/dev/shm/") + e->d_name;
      unlink(path.c_str());
    }
  }
  closedir(d);
}

// ----- contexts -------------------------------------------------------------------------

struct Ctx {
  int device;
  int retained = 0;
  bool active = false;
  CUresult sticky = CUDA_SUCCESS;
  std::set<int> peers;  // devices whose memory this context's kernels may touch
  Stream* legacy = nullptr;
};

Ctx* primary[64];
int exclusive_lock[64];

// ----- streams ----------------------------------------------------------------------------

struct Op {
  std::string what;
  std::function<bool()> ready;  // evaluated under `mu`; null: ready
  bool polls_memory = false;    // `ready` reads memory the host writes without notifying
  std::function<void()> run;    // runs without `mu`
};

struct Stream {
  Ctx* ctx;
  bool blocking;
  bool legacy;
  bool live = true;
  bool capturing = false;
  uint64_t enqueued = 0, completed = 0;
  std::deque<Op> queue;
  std::condition_variable wake;
};

std::set<Stream*> streams;  // live user streams (the legacy ones are in their Ctx)
std::vector<Stream*> retired_streams;  // destroyed, their handles to be handed out again

void* worker_main(void* arg);

void start_worker(Stream* s) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 1 << 20);
  pthread_t t;
  if (pthread_create(&t, &attr, worker_main, s) != 0) {
    say("cannot start a stream worker thread");
    abort();
  }
  pthread_attr_destroy(&attr);
}

Stream* legacy_of(Ctx* c) {
  if (!c->legacy) {
    c->legacy = new Stream{c, true, true};
    start_worker(c->legacy);
  }
  return c->legacy;
}

// Queues `op` on `s` (with `mu` held), after the legacy stream's earlier work for a
// blocking stream, or every blocking stream's earlier work for the legacy stream.
void enqueue_locked(Stream* s, Op op) {
  std::vector<std::pair<Stream*, uint64_t>> after;
  if (s->legacy) {
    for (Stream* o : streams)
      if (o->ctx == s->ctx && o->blocking && o->enqueued > o->completed) after.emplace_back(o, o->enqueued);
  } else if (s->blocking && s->ctx->legacy && s->ctx->legacy->enqueued > s->ctx->legacy->completed) {
    after.emplace_back(s->ctx->legacy, s->ctx->legacy->enqueued);
  }
  if (!after.empty()) {
    auto inner = op.ready;
    op.ready = [after, inner] {
      for (auto& [o, t] : after)
        if (o->completed < t) return false;
      return !inner || inner();
    };
  }
  s->queue.push_back(std::move(op));
  s->enqueued++;
  s->wake.notify_one();
}

void* worker_main(void* arg) {
  Stream* s = (Stream*)arg;
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    s->wake.wait(lock, [&] { return !s->queue.empty(); });
    Op& op = s->queue.front();
    while (op.ready && !op.ready()) {
      if (op.polls_memory)
        progress.wait_for(lock, std::chrono::microseconds(200));
      else
        progress.wait(lock);
    }
    bool skip = s->ctx->sticky != CUDA_SUCCESS;
    auto run = std::move(op.run);
    lock.unlock();
    if (!skip && run) run();
    lock.lock();
    s->queue.pop_front();
    s->completed++;
    progress.notify_all();
  }
  return nullptr;
}

// Waits (with `lock` on `mu`) until everything queued on `s` so far has run.
void drain(std::unique_lock<std::mutex>& lock, Stream* s) {
  uint64_t t = s->enqueued;
  progress.wait(lock, [&] { return s->completed >= t; });
}

// ----- events ----------------------------------------------------------------------------

struct Signal {
  bool fired = false;
};

struct Event {
  Ctx* ctx;
  std::shared_ptr<Signal> last;  // null: never recorded (complete)
};

std::set<Event*> events;

// ----- modules and kernels ---------------------------------------------------------------

// A kernel's parameters, copied at launch (cuLaunchKernel's contract).
typedef std::vector<std::vector<char>> Params;

struct KernelDef {
  const char* name;
  std::vector<size_t> sizes;  // bytes of each parameter
  // Every range the kernel will touch, as (address, bytes, what).
  std::function<void(const Params&, std::vector<std::tuple<uintptr_t, size_t, std::string>>&)> touches;
  // Runs the kernel body for the current (simulated) thread.
  std::function<void(const Params&)> body;
};

template <typename T>
T param(const Params& p, size_t i) {
  T v;
  memcpy(&v, p[i].data(), sizeof(T));
  return v;
}

void executor_touches(const Params& p, std::vector<std::tuple<uintptr_t, size_t, std::string>>& out);

const std::vector<KernelDef>& kernels() {
  static const std::vector<KernelDef> defs = {
      {"ferroccl_execute",
       {sizeof(FcclWork)},
       executor_touches,
       [](const Params& p) { ferroccl_execute(param<FcclWork>(p, 0)); }},
      {"ferroccl_reduce",
       {8, 8, 8, 8, 4, 4, 8},
       [](const Params& p, auto& out) {
         uint64_t n = param<uint64_t>(p, 3) * fccl_dtype_size(param<uint32_t>(p, 4));
         out.emplace_back(param<uintptr_t>(p, 0), n, "dst");
         out.emplace_back(param<uintptr_t>(p, 1), n, "a");
         out.emplace_back(param<uintptr_t>(p, 2), n, "b");
       },
       [](const Params& p) {
         ferroccl_reduce(param<void*>(p, 0), param<const void*>(p, 1), param<const void*>(p, 2),
                         param<uint64_t>(p, 3), param<uint32_t>(p, 4), param<uint32_t>(p, 5),
                         param<uint64_t>(p, 6));
       }},
      {"ferroccl_pre",
       {8, 8, 8, 4, 4, 8},
       [](const Params& p, auto& out) {
         uint64_t n = param<uint64_t>(p, 2) * fccl_dtype_size(param<uint32_t>(p, 3));
         out.emplace_back(param<uintptr_t>(p, 0), n, "dst");
         out.emplace_back(param<uintptr_t>(p, 1), n, "src");
       },
       [](const Params& p) {
         ferroccl_pre(param<void*>(p, 0), param<const void*>(p, 1), param<uint64_t>(p, 2), param<uint32_t>(p, 3),
                      param<uint32_t>(p, 4), param<uint64_t>(p, 5));
       }},
      {"ferroccl_post",
       {8, 8, 4, 4, 4},
       [](const Params& p, auto& out) {
         uint64_t n = param<uint64_t>(p, 1) * fccl_dtype_size(param<uint32_t>(p, 2));
         out.emplace_back(param<uintptr_t>(p, 0), n, "buf");
       },
       [](const Params& p) {
         ferroccl_post(param<void*>(p, 0), param<uint64_t>(p, 1), param<uint32_t>(p, 2), param<uint32_t>(p, 3),
                       param<uint32_t>(p, 4));
       }},
  };
  return defs;
}

// The executor's memory: its arrays, each FIFO end it uses, each step's regions. The
// arrays are read here from (simulated) device memory after their own ranges checked.
void executor_touches(const Params& p, std::vector<std::tuple<uintptr_t, size_t, std::string>>& out) {
  FcclWork w = param<FcclWork>(p, 0);
  auto ok = [](const void* a, size_t n) {
    std::lock_guard<std::mutex> g(mu);
    const Region* r = find_region((uintptr_t)a);
    return r && (uintptr_t)a + n <= r->base + r->size;
  };
  out.emplace_back((uintptr_t)w.lanes, w.nlanes * sizeof(FcclLane), "work.lanes");
  out.emplace_back((uintptr_t)w.status, w.nlanes * 4, "work.status");
  out.emplace_back((uintptr_t)w.abort, 4, "work.abort");
  if (!ok(w.lanes, w.nlanes * sizeof(FcclLane))) return;
  uint32_t nsteps = 0;
  for (uint32_t l = 0; l < w.nlanes; l++) nsteps = std::max(nsteps, w.lanes[l].first + w.lanes[l].count);
  out.emplace_back((uintptr_t)w.steps, nsteps * sizeof(FcclStep), "work.steps");
  if (!ok(w.steps, nsteps * sizeof(FcclStep))) return;
  int32_t nfifos = 0;
  uint32_t nops = 0;
  for (uint32_t s = 0; s < nsteps; s++) {
    const FcclStep& st = w.steps[s];
    nfifos = std::max({nfifos, st.send_fifo + 1, st.recv_fifo + 1});
    nops = std::max({nops, st.src.op + 1, st.dst.op + 1, st.b.op + 1});
  }
  out.emplace_back((uintptr_t)w.fifos, nfifos * sizeof(FcclFifo), "work.fifos");
  out.emplace_back((uintptr_t)w.ops, nops * sizeof(FcclOp), "work.ops");
  if (!ok(w.fifos, nfifos * sizeof(FcclFifo)) || !ok(w.ops, nops * sizeof(FcclOp))) return;
  for (int32_t f = 0; f < nfifos; f++) {
    const FcclFifo& ff = w.fifos[f];
    std::string n = "fifo " + std::to_string(f);
    out.emplace_back((uintptr_t)ff.head, 8, n + ".head");
    out.emplace_back((uintptr_t)ff.tail, 8, n + ".tail");
    out.emplace_back((uintptr_t)ff.sizes, (size_t)ff.slots * 4, n + ".sizes");
    out.emplace_back((uintptr_t)ff.data, (size_t)ff.slots * ff.slot_bytes, n + ".data");
    out.emplace_back((uintptr_t)ff.stage, 64, n + ".stage");
  }
  for (uint32_t s = 0; s < nsteps; s++) {
    const FcclStep& st = w.steps[s];
    const FcclRegion* used[3] = {nullptr, nullptr, nullptr};
    // Which regions a step kind reads or writes (see FcclStep in kernels/ferroccl.cuh).
    switch (st.kind) {
      case 0: case 3: used[0] = &st.src; break;                       // Send, RecvReduceSend
      case 1: case 6: used[1] = &st.dst; break;                       // Recv, RecvCopySend
      case 8: used[0] = &st.src; used[1] = &st.dst; used[2] = &st.b; break;  // Reduce
      default: used[0] = &st.src; used[1] = &st.dst; break;
    }
    for (const FcclRegion* r : used) {
      if (!r || r->len == 0) continue;
      const FcclOp& op = w.ops[r->op];
      void* base = r->buf == 0 ? op.input : r->buf == 1 ? op.output : op.scratch;
      size_t size = fccl_dtype_size(op.dtype);
      std::string what = "step " + std::to_string(s) + " op " + std::to_string(r->op) + " " +
                         (r->buf == 0 ? "input" : r->buf == 1 ? "output" : "scratch");
      out.emplace_back((uintptr_t)base + r->offset * size, r->len * size, what);
    }
  }
}

struct Module {
  Ctx* ctx;
  std::set<std::string> entries;
  std::set<std::string> loaded;  // entries whose code is on the GPU
};

struct Function {
  Module* module;
  const KernelDef* def;
};

std::set<Module*> modules;
std::set<Function*> functions;
uint64_t launches = 0;

// Blocks resident on each device now (at most config.resident_blocks).
int resident[64];
std::condition_variable residency;

std::vector<pthread_t> spawn(size_t n, void* (*f)(void*), std::function<void*(size_t)> arg) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 20);
  std::vector<pthread_t> out(n);
  for (size_t i = 0; i < n; i++) {
    if (pthread_create(&out[i], &attr, f, arg(i)) != 0) {
      say("cannot start a thread for a kernel (%zu wanted)", n);
      abort();
    }
  }
  pthread_attr_destroy(&attr);
  return out;
}

struct GridRun {
  const KernelDef* def;
  Params params;
  uint32_t blocks, threads;
  int device;
};

// One block's threads as fibers on one host thread, switched cooperatively: at a spin
// (fccl_pause) a fiber yields to the next; at __syncthreads it waits until every fiber
// of the block has arrived. The host thread gives its core away after a round in which
// no fiber finished and no barrier opened (every fiber waits on another block, rank or
// the host). (A host thread per simulated thread, as kernels/host/shim.h's
// own launch does, makes hundreds of threads per block: on 2 cores most of the time
// went to creating them and to sched_yield.)
struct Fibers {
  ucontext_t scheduler;
  std::vector<ucontext_t> fibers;
  std::vector<bool> done;
  uint32_t running = 0;
  uint32_t arrived = 0;  // at the barrier now
  uint64_t generation = 0;
  bool progressed = false;  // in this round: a fiber finished, or a barrier opened
  const GridRun* grid;
};

thread_local Fibers* fibers_here;

void fiber_yield() {
  Fibers* f = fibers_here;
  swapcontext(&f->fibers[f->running], &f->scheduler);
}

void fiber_sync() {
  Fibers* f = fibers_here;
  uint64_t g = f->generation;
  if (++f->arrived == f->grid->threads) {
    f->arrived = 0;
    f->generation++;
    f->progressed = true;
    return;
  }
  while (f->generation == g) swapcontext(&f->fibers[f->running], &f->scheduler);
}

void fiber_main() {
  Fibers* f = fibers_here;
  f->grid->def->body(f->grid->params);
  f->done[f->running] = true;
  f->progressed = true;
  // Returning resumes uc_link: the scheduler.
}

void* block_main(void* arg) {
  auto* a = (std::pair<GridRun*, uint32_t>*)arg;
  GridRun* g = a->first;
  {
    std::unique_lock<std::mutex> lock(mu);
    residency.wait(lock, [&] { return resident[g->device] < config.resident_blocks; });
    resident[g->device]++;
  }
  fccl_shim::Block shared(1);
  fccl_shim::block_idx = {a->second, 0, 0};
  fccl_shim::block_dim = {g->threads, 1, 1};
  fccl_shim::grid_dim = {g->blocks, 1, 1};
  fccl_shim::block = &shared;
  fccl_shim::yield_hook = fiber_yield;
  fccl_shim::sync_hook = fiber_sync;
  const size_t stack = 64 << 10;
  char* stacks = (char*)mmap(nullptr, stack * g->threads, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stacks == MAP_FAILED) {
    say("cannot map fiber stacks");
    abort();
  }
  Fibers f;
  f.grid = g;
  f.fibers.resize(g->threads);
  f.done.assign(g->threads, false);
  fibers_here = &f;
  for (uint32_t t = 0; t < g->threads; t++) {
    getcontext(&f.fibers[t]);
    f.fibers[t].uc_stack.ss_sp = stacks + t * stack;
    f.fibers[t].uc_stack.ss_size = stack;
    f.fibers[t].uc_link = &f.scheduler;
    makecontext(&f.fibers[t], fiber_main, 0);
  }
  uint32_t left = g->threads;
  while (left > 0) {
    f.progressed = false;
    for (uint32_t t = 0; t < g->threads; t++) {
      if (f.done[t]) continue;
      f.running = t;
      fccl_shim::thread_idx = {t, 0, 0};
      swapcontext(&f.scheduler, &f.fibers[t]);
      if (f.done[t]) left--;
    }
    if (!f.progressed) sched_yield();  // every fiber waits on something outside the block
  }
  fccl_shim::yield_hook = nullptr;
  fccl_shim::sync_hook = nullptr;
  munmap(stacks, stack * g->threads);
  {
    std::lock_guard<std::mutex> lock(mu);
    resident[g->device]--;
  }
  residency.notify_all();
  return nullptr;
}

void run_grid(GridRun& g) {
  std::vector<std::pair<GridRun*, uint32_t>> args(g.blocks);
  auto bs = spawn(g.blocks, block_main, [&](size_t i) {
    args[i] = {&g, (uint32_t)i};
    return (void*)&args[i];
  });
  for (pthread_t t : bs) pthread_join(t, nullptr);
}

// ----- checks every call makes -----------------------------------------------------------

// FERROCCL_SIM_FAIL=cuA,cuB: every call of the driver entry points named fails with
// CUDA_ERROR_UNKNOWN before doing anything, as a driver call can fail on a real machine
// (a lost device, an out-of-resources the simulation does not model); the tests use it
// to see that ferroccl names the call and cleans up.
bool injected_failure(const char* call) {
  static const std::string failing = [] {
    const char* v = getenv("FERROCCL_SIM_FAIL");
    return v ? "," + std::string(v) + "," : std::string();
  }();
  if (failing.empty() || failing.find("," + std::string(call) + ",") == std::string::npos) return false;
  if (config.verbose) say("%s fails as FERROCCL_SIM_FAIL asks", call);
  return true;
}

#define FAULT_POINT()                                      \
  do {                                                     \
    if (injected_failure(__func__)) return CUDA_ERROR_UNKNOWN; \
  } while (0)

#define CHECK_INIT()                                          \
  do {                                                        \
    if (!initialised.load()) return CUDA_ERROR_NOT_INITIALIZED; \
  } while (0)

// The current context (or the error to return), with `mu` held.
CUresult current_ctx(Ctx** out) {
  if (!initialised.load()) return CUDA_ERROR_NOT_INITIALIZED;
  if (current.empty() || !current.back()) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = current.back();
  if (!c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (c->sticky != CUDA_SUCCESS) return c->sticky;
  *out = c;
  return CUDA_SUCCESS;
}

// The stream `h` names for work in context `c` (NULL and CU_STREAM_LEGACY: the legacy
// default stream), with `mu` held.
CUresult stream_of(CUstream h, Ctx* c, Stream** out) {
  if (h == nullptr || h == (CUstream)0x1) {
    *out = legacy_of(c);
    return CUDA_SUCCESS;
  }
  if (h == (CUstream)0x2) {
    say("the per-thread default stream (CU_STREAM_PER_THREAD) is not simulated");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (!streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
  if (h->ctx != c) {
    say("a stream of GPU %d's context used in GPU %d's context", h->ctx->device, c->device);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (h->capturing) {
    say("work queued on a capturing stream: the simulated driver has no graphs");
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  *out = h;
  return CUDA_SUCCESS;
}

// Whether a kernel of context `c` may touch [p, p + n): live, inside one allocation,
// reachable from `c`'s device. Returns what is wrong ("" when nothing), with `mu` held.
std::string access_problem(Ctx* c, uintptr_t p, size_t n) {
  const Region* r = find_region(p);
  if (!r) return "not in any live allocation (freed, or never allocated)";
  if (p + n > r->base + r->size) {
    char buf[160];
    snprintf(buf, sizeof buf, "runs %zu bytes past the end of its %zu-byte allocation",
             (size_t)(p + n - (r->base + r->size)), r->size);
    return buf;
  }
  switch (r->kind) {
    case Kind::HostMapped:
      if (r->ctx != c && !(r->flags & 0x1))
        return "page-locked memory of GPU " + std::to_string(r->ctx->device) +
               "'s context, not registered as portable";
      if (!(r->flags & 0x2)) return "page-locked memory not mapped for the device";
      return "";
    case Kind::Imported:
      if (r->ctx != c) return "an IPC mapping of another context";
      return "";
    case Kind::Device:
      if (r->device == c->device || c->peers.count(r->device)) return "";
      return "memory of GPU " + std::to_string(r->device) + ", and peer access from GPU " +
             std::to_string(c->device) + " to it is not enabled";
  }
  return "";
}

CUresult copy_check(Ctx* c, uintptr_t device_ptr, size_t n, const char* call) {
  std::string why = access_problem(c, device_ptr, n);
  if (!why.empty()) {
    say("%s: device range [%#lx, +%zu) %s", call, (unsigned long)device_ptr, n, why.c_str());
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

bool cubin_arch(const unsigned char* image, int* major, int* minor, std::set<std::string>* entries) {
  if (memcmp(image, "\x7f" "ELF", 4) != 0 || image[4] != 2) return false;
  uint16_t machine;
  memcpy(&machine, image + 18, 2);
  if (machine != 190) return false;  // EM_CUDA
  uint32_t flags;
  memcpy(&flags, image + 48, 4);
  uint8_t abi_version = image[8];
  // The SM number: bits 0-7 of e_flags before ELF ABI version 8 (CUDA 12.x), bits 8-15
  // from it on.
  unsigned sm = abi_version >= 8 ? (flags >> 8) & 0xff : flags & 0xff;
  *major = (int)sm / 10;
  *minor = (int)sm % 10;
  uint64_t shoff;
  uint16_t shentsize, shnum, shstrndx;
  memcpy(&shoff, image + 40, 8);
  memcpy(&shentsize, image + 58, 2);
  memcpy(&shnum, image + 60, 2);
  memcpy(&shstrndx, image + 62, 2);
  auto section = [&](int i) { return image + shoff + (size_t)i * shentsize; };
  uint64_t strtab;
  memcpy(&strtab, section(shstrndx) + 24, 8);
  for (int i = 0; i < shnum; i++) {
    uint32_t name;
    memcpy(&name, section(i), 4);
    const char* s = (const char*)image + strtab + name;
    if (strncmp(s, ".text.", 6) == 0) entries->insert(s + 6);
  }
  return true;
}

const char* error_name(CUresult rc) {
  switch (rc) {
#define E(x) \
  case x:    \
    return #x;
    E(CUDA_SUCCESS) E(CUDA_ERROR_INVALID_VALUE) E(CUDA_ERROR_OUT_OF_MEMORY) E(CUDA_ERROR_NOT_INITIALIZED)
    E(CUDA_ERROR_DEVICE_UNAVAILABLE) E(CUDA_ERROR_NO_DEVICE) E(CUDA_ERROR_INVALID_DEVICE)
    E(CUDA_ERROR_INVALID_IMAGE) E(CUDA_ERROR_INVALID_CONTEXT) E(CUDA_ERROR_MAP_FAILED)
    E(CUDA_ERROR_NO_BINARY_FOR_GPU) E(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED) E(CUDA_ERROR_OPERATING_SYSTEM)
    E(CUDA_ERROR_INVALID_HANDLE) E(CUDA_ERROR_ILLEGAL_STATE) E(CUDA_ERROR_NOT_FOUND) E(CUDA_ERROR_NOT_READY)
    E(CUDA_ERROR_ILLEGAL_ADDRESS) E(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES) E(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    E(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED) E(CUDA_ERROR_CONTEXT_IS_DESTROYED) E(CUDA_ERROR_NOT_SUPPORTED)
    E(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) E(CUDA_ERROR_UNKNOWN)
#undef E
    default:
      return nullptr;
  }
}

}  // namespace sim
using namespace sim;

// ===== the driver API ======================================================================

SIM_API const char* ferroccl_simcuda_describe() {
  static std::string text;
  static std::once_flag once;
  std::call_once(once, [] {
    Config c;
    c.load();
    char buf[256];
    snprintf(buf, sizeof buf,
             "ferroccl's simulated CUDA driver (test code: host memory and host threads): %d GPU%s, sm_%d%d, "
             "driver %d, P2P %s",
             c.devices, c.devices == 1 ? "" : "s", c.cc_major, c.cc_minor, c.driver_version, c.p2p.c_str());
    text = buf;
  });
  return text.c_str();
}

// What is still allocated in this process: device allocations, host-mapped allocations,
// IPC mappings, retained primary contexts, live streams, live events; and how many
// kernels have been launched (so a test can tell work ran on the device, which host code
// could otherwise do on this driver's host-accessible "device" memory).
SIM_API void ferroccl_simcuda_live(uint64_t out[7]) {
  std::lock_guard<std::mutex> g(mu);
  for (int i = 0; i < 7; i++) out[i] = 0;
  out[6] = launches;
  for (auto& [_, r] : regions) out[r.kind == Kind::Device ? 0 : r.kind == Kind::HostMapped ? 1 : 2]++;
  for (int d = 0; d < config.devices; d++)
    if (primary[d] && primary[d]->retained > 0) out[3]++;
  out[4] = streams.size();
  out[5] = events.size();
}

SIM_API CUresult cuGetErrorString(CUresult rc, const char** out) {
  FAULT_POINT();
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = error_name(rc);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_API CUresult cuGetErrorName(CUresult rc, const char** out) { return cuGetErrorString(rc, out); }

SIM_API CUresult cuInit(unsigned flags) {
  FAULT_POINT();
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  static std::once_flag once;
  std::call_once(once, [] {
    config.load();
    if (config.devices < 0 || config.devices > 64) {
      say("FERROCCL_SIM_GPUS=%d: 0 to 64", config.devices);
      abort();
    }
    sweep_dead_exports();
    for (int d = 0; d < 64; d++) exclusive_lock[d] = -1;
    if (config.verbose) say("%s", ferroccl_simcuda_describe());
    initialised = true;
  });
  return config.devices == 0 ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

SIM_API CUresult cuDriverGetVersion(int* v) {
  FAULT_POINT();
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  Config c;
  c.load();
  *v = c.driver_version;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetCount(int* n) {
  FAULT_POINT();
  CHECK_INIT();
  if (!n) return CUDA_ERROR_INVALID_VALUE;
  *n = config.devices;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
  FAULT_POINT();
  CHECK_INIT();
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case 1: *v = 1024; return CUDA_SUCCESS;                      // MAX_THREADS_PER_BLOCK
    case 2: *v = 1024; return CUDA_SUCCESS;                      // MAX_BLOCK_DIM_X
    case 3: case 4: *v = 1024; return CUDA_SUCCESS;              // MAX_BLOCK_DIM_Y/Z
    case 5: *v = 0x7fffffff; return CUDA_SUCCESS;                // MAX_GRID_DIM_X
    case 6: case 7: *v = 65535; return CUDA_SUCCESS;             // MAX_GRID_DIM_Y/Z
    case 8: *v = 48 << 10; return CUDA_SUCCESS;                  // MAX_SHARED_MEMORY_PER_BLOCK
    case 10: *v = 32; return CUDA_SUCCESS;                       // WARP_SIZE
    case 16: *v = config.sms; return CUDA_SUCCESS;               // MULTIPROCESSOR_COUNT
    case 19: *v = 1; return CUDA_SUCCESS;                        // CAN_MAP_HOST_MEMORY
    case 20: *v = config.compute_mode; return CUDA_SUCCESS;      // COMPUTE_MODE
    case 31: *v = 1; return CUDA_SUCCESS;                        // CONCURRENT_KERNELS
    case 33: *v = 0x10 + dev; return CUDA_SUCCESS;               // PCI_BUS_ID
    case 34: *v = 0; return CUDA_SUCCESS;                        // PCI_DEVICE_ID
    case 41: *v = 1; return CUDA_SUCCESS;                        // UNIFIED_ADDRESSING
    case 50: *v = 0; return CUDA_SUCCESS;                        // PCI_DOMAIN_ID
    case 75: *v = config.cc_major; return CUDA_SUCCESS;          // COMPUTE_CAPABILITY_MAJOR
    case 76: *v = config.cc_minor; return CUDA_SUCCESS;          // COMPUTE_CAPABILITY_MINOR
    case 81: *v = 228 << 10; return CUDA_SUCCESS;                // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    case 82: *v = 64 << 10; return CUDA_SUCCESS;                 // MAX_REGISTERS_PER_MULTIPROCESSOR
    case 83: *v = 0; return CUDA_SUCCESS;                        // MANAGED_MEMORY
    case 95: *v = 1; return CUDA_SUCCESS;                        // COOPERATIVE_LAUNCH
    case 97: *v = 227 << 10; return CUDA_SUCCESS;                // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    case 106: *v = 32; return CUDA_SUCCESS;                      // MAX_BLOCKS_PER_MULTIPROCESSOR
    case 115: *v = 0; return CUDA_SUCCESS;                       // MEMORY_POOLS_SUPPORTED: no
    default:
      say("cuDeviceGetAttribute: attribute %d is not simulated", attribute);
      return CUDA_ERROR_INVALID_VALUE;
  }
}

SIM_API CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(name, len, "ferroccl simulated GPU %d (sm_%d%d)", dev, config.cc_major, config.cc_minor);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  memcpy(uuid->bytes, "fccl-simgpu-", 12);
  uuid->bytes[12] = uuid->bytes[13] = uuid->bytes[14] = 0;
  uuid->bytes[15] = (char)dev;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

SIM_API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = config.memory;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetPCIBusId(char* out, int len, CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (!out || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(out, len, "0000:%02x:00.0", 0x10 + dev);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceCanAccessPeer(int* can, CUdevice a, CUdevice b) {
  FAULT_POINT();
  CHECK_INIT();
  if (!can) return CUDA_ERROR_INVALID_VALUE;
  if (a < 0 || a >= config.devices || b < 0 || b >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  *can = config.can_access_peer(a, b) ? 1 : 0;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDeviceGetP2PAttribute(int* v, int attribute, CUdevice a, CUdevice b) {
  FAULT_POINT();
  CHECK_INIT();
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  if (a < 0 || a >= config.devices || b < 0 || b >= config.devices || a == b) return CUDA_ERROR_INVALID_DEVICE;
  bool p2p = config.can_access_peer(a, b);
  switch (attribute) {
    case 1: *v = 0; return CUDA_SUCCESS;       // PERFORMANCE_RANK
    case 2: *v = p2p; return CUDA_SUCCESS;     // ACCESS_SUPPORTED
    case 3: *v = p2p && config.nvlink; return CUDA_SUCCESS;  // NATIVE_ATOMIC_SUPPORTED: NVLink only
    case 4: *v = p2p; return CUDA_SUCCESS;     // CUDA_ARRAY_ACCESS_SUPPORTED
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

// ----- contexts --------------------------------------------------------------------------

SIM_API CUresult cuDevicePrimaryCtxRetain(CUcontext* out, CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> g(mu);
  if (config.compute_mode == 2) {
    say("GPU %d is in prohibited compute mode: no context can be made on it", dev);
    return CUDA_ERROR_DEVICE_UNAVAILABLE;
  }
  if (!primary[dev]) primary[dev] = new Ctx{dev};
  Ctx* c = primary[dev];
  if (!c->active && config.compute_mode == 3) {
    // Exclusive-process: one process's context per GPU on the host, held by a lock file.
    char path[96];
    snprintf(path, sizeof path, "/dev/shm/ferroccl-simcuda-gpu%d.exclusive", dev);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || lockf(fd, F_TLOCK, 0) != 0) {
      if (fd >= 0) close(fd);
      say("GPU %d is in exclusive-process compute mode and another process has a context on it", dev);
      return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    exclusive_lock[dev] = fd;
  }
  c->active = true;
  c->retained++;
  *out = c;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  FAULT_POINT();
  CHECK_INIT();
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c = primary[dev];
  if (!c || c->retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
  // The context lives on while anything of it does (the simulated driver keeps it).
  c->retained--;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

SIM_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned* flags, int* active) {
  FAULT_POINT();
  CHECK_INIT();
  if (dev < 0 || dev >= config.devices) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> g(mu);
  if (flags) *flags = 0;
  if (active) *active = primary[dev] && primary[dev]->retained > 0;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetCurrent(CUcontext* out) {
  FAULT_POINT();
  CHECK_INIT();
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = current.empty() ? nullptr : current.back();
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxSetCurrent(CUcontext c) {
  FAULT_POINT();
  CHECK_INIT();
  if (c) {
    std::lock_guard<std::mutex> g(mu);
    bool known = false;
    for (int d = 0; d < config.devices; d++) known |= primary[d] == c;
    if (!known || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (current.empty()) {
    if (c) current.push_back(c);
  } else if (c) {
    current.back() = c;
  } else {
    current.pop_back();
  }
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxPushCurrent_v2(CUcontext c) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  bool known = false;
  for (int d = 0; d < config.devices; d++) known |= c && primary[d] == c;
  if (!known || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
  current.push_back(c);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxPopCurrent_v2(CUcontext* out) {
  FAULT_POINT();
  CHECK_INIT();
  if (current.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (out) *out = current.back();
  current.pop_back();
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetDevice(CUdevice* dev) {
  FAULT_POINT();
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  *dev = c->device;
  return CUDA_SUCCESS;
}

long sync_timeout_s();
bool wait_for_queued(std::unique_lock<std::mutex>& lock, const std::vector<Stream*>& busy);

SIM_API CUresult cuCtxSynchronize() {
  FAULT_POINT();
  std::unique_lock<std::mutex> lock(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  std::vector<Stream*> all;
  for (Stream* s : streams)
    if (s->ctx == c) all.push_back(s);
  if (c->legacy) all.push_back(c->legacy);
  // A stream held by a wait that only this thread's later calls would release never
  // drains (cudarc's first stream of a context synchronises it: two ranks of one process
  // hung so in CI, 2026-11-30); on a GPU that is a hang, here an error after the timeout.
  if (!wait_for_queued(lock, all)) {
    say("cuCtxSynchronize waited %lds for GPU %d's queued work, which does not finish: on a GPU this is a "
        "hang (a stream waits for something only a later call can give it)",
        sync_timeout_s(), c->device);
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  return c->sticky;
}

SIM_API CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  FAULT_POINT();
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  bool known = false;
  for (int d = 0; d < config.devices; d++) known |= peer && primary[d] == peer;
  if (!known || !peer->active) return CUDA_ERROR_INVALID_CONTEXT;
  if (peer->device == c->device) return CUDA_ERROR_INVALID_DEVICE;
  if (!config.can_access_peer(c->device, peer->device)) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  if (!c->peers.insert(peer->device).second) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxDisablePeerAccess(CUcontext peer) {
  FAULT_POINT();
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (!peer || !c->peers.erase(peer->device)) return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
  return CUDA_SUCCESS;
}

// ----- memory ----------------------------------------------------------------------------

SIM_API CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t bytes) {
  FAULT_POINT();
  if (!out || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (allocated[c->device] + bytes > config.memory) return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    say("cuMemAlloc: cannot make a file on /dev/shm: %s", strerror(errno));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  size_t size = round_pages(bytes);
  if (posix_fallocate(fd, 0, (off_t)size) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Region r{(uintptr_t)p, bytes, Kind::Device, c->device, c, fd, next_id++};
  regions[r.base] = r;
  allocated[c->device] += bytes;
  *out = r.base;
  return CUDA_SUCCESS;
}

// How long a call that synchronises with a GPU's queued work waits before it calls the
// wait a hang.
long sync_timeout_s() { return env_long("FERROCCL_SIM_SYNC_TIMEOUT_S", 60); }

// Waits (with `lock` on `mu`) for the work queued so far on `busy`; false if it does not
// finish within sync_timeout_s().
bool wait_for_queued(std::unique_lock<std::mutex>& lock, const std::vector<Stream*>& busy) {
  for (Stream* s : busy) {
    uint64_t t = s->enqueued;
    if (!progress.wait_for(lock, std::chrono::seconds(sync_timeout_s()), [&] { return s->completed >= t; }))
      return false;
  }
  return true;
}

// Threads of this process now in cuMemFree or cuMemFreeHost, waiting for the device.
int freeing = 0;

// A call that queues work (a launch, an event record) waits while another thread of the
// process frees memory: on a GPU the free holds the driver until the device is idle, so
// a rank whose kernel waits for this launch never ends, and neither does the free
// (three and four ranks of one process on an H100 hung so). Here both waits give up
// after sync_timeout_s() and say so.
CUresult wait_for_frees(std::unique_lock<std::mutex>& lock, const char* by) {
  if (freeing == 0) return CUDA_SUCCESS;
  if (!progress.wait_for(lock, std::chrono::seconds(sync_timeout_s()), [] { return freeing == 0; })) {
    say("%s waited %lds for another thread's cuMemFree/cuMemFreeHost, which waits for the device: on a GPU "
        "this is a hang (free memory only when no call that needs this thread can be running)",
        by, sync_timeout_s());
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  return CUDA_SUCCESS;
}

// Loads f's kernel onto the GPU if it is not there yet. Lazy loading may synchronise the
// context, and this driver always does: it waits for the work queued on every stream of
// f's context. On a GPU, a kernel that waits for one whose load waits for it never ends;
// here the wait gives up after sync_timeout_s() and says so. `by` names the call.
CUresult load_function(std::unique_lock<std::mutex>& lock, Function* f, const char* by) {
  Module* m = f->module;
  std::string name = f->def->name;
  if (config.eager || m->loaded.count(name)) return CUDA_SUCCESS;
  Ctx* c = m->ctx;
  std::vector<Stream*> busy;
  for (Stream* s : streams)
    if (s->ctx == c && s->enqueued > s->completed) busy.push_back(s);
  if (c->legacy && c->legacy->enqueued > c->legacy->completed) busy.push_back(c->legacy);
  if (!wait_for_queued(lock, busy)) {
    say("%s: loading %s (lazy loading, as CUDA_MODULE_LOADING=LAZY) waits for GPU %d's queued work, which "
        "does not finish within %lds: on a GPU this is a hang. Load kernels (cuFuncLoad) before launching "
        "work that waits on them",
        by, name.c_str(), c->device, sync_timeout_s());
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  if (!modules.count(m)) return CUDA_ERROR_INVALID_HANDLE;  // unloaded meanwhile
  m->loaded.insert(name);
  return CUDA_SUCCESS;
}

// What a free does first (cuMemFree, cuMemFreeHost): waits for the work queued on every
// stream of `device` and its legacy stream, counted in `freeing` meanwhile (see
// wait_for_frees); false if that work does not finish within sync_timeout_s().
bool wait_before_free(std::unique_lock<std::mutex>& lock, int device) {
  std::vector<Stream*> busy;
  for (Stream* s : streams)
    if (s->ctx->device == device && s->enqueued > s->completed) busy.push_back(s);
  if (primary[device] && primary[device]->legacy) busy.push_back(primary[device]->legacy);
  freeing++;
  bool idle = wait_for_queued(lock, busy);
  freeing--;
  progress.notify_all();
  return idle;
}

// cuMemFree synchronises with the device's work first, as the real driver does: the
// memory may be in use by a kernel queued before the call.
SIM_API CUresult cuMemFree_v2(CUdeviceptr p) {
  FAULT_POINT();
  std::unique_lock<std::mutex> lock(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  auto it = regions.find((uintptr_t)p);
  if (it == regions.end() || it->second.kind != Kind::Device) {
    say("cuMemFree(%#llx): not the start of a live device allocation", p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  int device = it->second.device;
  if (!wait_before_free(lock, device)) {
    say("cuMemFree(%#llx) waited %lds for GPU %d's queued work, which does not finish: on a GPU this "
        "is a hang",
        p, sync_timeout_s(), device);
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  it = regions.find((uintptr_t)p);
  if (it == regions.end()) return CUDA_ERROR_INVALID_VALUE;
  Region r = it->second;
  regions.erase(it);
  allocated[r.device] -= r.size;
  if (r.exported) unlink(shm_name(getpid(), r.id).c_str());
  close(r.fd);
  retire_mapping((void*)r.base, r.size);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  FAULT_POINT();
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (free_bytes) *free_bytes = config.memory - allocated[c->device];
  if (total) *total = config.memory;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuMemHostAlloc(void** out, size_t bytes, unsigned flags) {
  FAULT_POINT();
  if (!out || bytes == 0 || (flags & ~0x7u)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  size_t size = round_pages(bytes);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  Region r{(uintptr_t)p, bytes, Kind::HostMapped, -1, c};
  r.flags = flags;
  regions[r.base] = r;
  *out = p;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuMemAllocHost_v2(void** out, size_t bytes) { return cuMemHostAlloc(out, bytes, 0); }

SIM_API CUresult cuMemFreeHost(void* p) {
  FAULT_POINT();
  std::unique_lock<std::mutex> lock(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  auto it = regions.find((uintptr_t)p);
  if (it == regions.end() || it->second.kind != Kind::HostMapped || it->second.registered) {
    say("cuMemFreeHost(%p): not the start of a live page-locked allocation", p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Like cuMemFree, it waits for the device's queued work first.
  if (!wait_before_free(lock, c->device)) {
    say("cuMemFreeHost(%p) waited %lds for GPU %d's queued work, which does not finish: on a GPU this is a hang",
        p, sync_timeout_s(), c->device);
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  it = regions.find((uintptr_t)p);
  if (it == regions.end()) return CUDA_ERROR_INVALID_VALUE;
  Region r = it->second;
  regions.erase(it);
  retire_mapping((void*)r.base, r.size);
  return CUDA_SUCCESS;
}

// Registers someone else's mapping as page-locked (unregistering leaves it mapped).
SIM_API CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned flags) {
  FAULT_POINT();
  if (!p || bytes == 0 || (flags & ~0xfu)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  uintptr_t a = (uintptr_t)p;
  auto it = regions.lower_bound(a);
  bool overlaps = (it != regions.end() && it->first < a + bytes) || find_region(a);
  if (overlaps) {
    say("cuMemHostRegister(%p, %zu): overlaps memory the driver knows already", p, bytes);
    return CUDA_ERROR_INVALID_VALUE;  // the real driver: HOST_MEMORY_ALREADY_REGISTERED
  }
  Region r{a, bytes, Kind::HostMapped, -1, c};
  // CU_MEMHOSTREGISTER_DEVICEMAP is 2, as CU_MEMHOSTALLOC_DEVICEMAP; PORTABLE is 1 in both.
  r.flags = flags;
  r.registered = true;
  regions[r.base] = r;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuMemHostUnregister(void* p) {
  FAULT_POINT();
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  auto it = regions.find((uintptr_t)p);
  if (it == regions.end() || !it->second.registered) {
    say("cuMemHostUnregister(%p): not registered memory", p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  regions.erase(it);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* out, void* p, unsigned flags) {
  FAULT_POINT();
  if (!out || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  const Region* r = find_region((uintptr_t)p);
  if (!r || r->kind != Kind::HostMapped) return CUDA_ERROR_INVALID_VALUE;
  if (!(r->flags & 0x2)) {  // CU_MEMHOSTALLOC_DEVICEMAP
    say("cuMemHostGetDevicePointer(%p): allocated without CU_MEMHOSTALLOC_DEVICEMAP", p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  *out = (CUdeviceptr)(uintptr_t)p;  // unified addressing: the same address
  return CUDA_SUCCESS;
}

SIM_API CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr p) {
  FAULT_POINT();
  CHECK_INIT();
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  const Region* r = find_region((uintptr_t)p);
  if (!r) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case 1:  // CONTEXT
      *(CUcontext*)data = r->ctx;
      return CUDA_SUCCESS;
    case 2:  // MEMORY_TYPE: 1 host, 2 device
      *(unsigned*)data = r->kind == Kind::HostMapped ? 1 : 2;
      return CUDA_SUCCESS;
    case 3:  // DEVICE_POINTER
      *(CUdeviceptr*)data = p;
      return CUDA_SUCCESS;
    case 9:  // DEVICE_ORDINAL
      *(int*)data = r->kind == Kind::HostMapped ? r->ctx->device : r->device;
      return CUDA_SUCCESS;
    default:
      say("cuPointerGetAttribute: attribute %d is not simulated", attribute);
      return CUDA_ERROR_INVALID_VALUE;
  }
}

// ----- IPC -------------------------------------------------------------------------------

namespace sim {
struct IpcHandle {
  char magic[8];
  int32_t pid;
  int32_t device;
  uint64_t id;
  uint64_t size;
};
static_assert(sizeof(IpcHandle) <= 64, "an IPC handle is 64 bytes");
}  // namespace sim
using namespace sim;

SIM_API CUresult cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr p) {
  FAULT_POINT();
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  auto it = regions.find((uintptr_t)p);
  if (it == regions.end() || it->second.kind != Kind::Device) {
    say("cuIpcGetMemHandle(%#llx): not the start of a device allocation of this process", p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  Region& r = it->second;
  if (!r.exported) {
    char fdpath[64];
    snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", r.fd);
    std::string name = shm_name(getpid(), r.id);
    if (linkat(AT_FDCWD, fdpath, AT_FDCWD, name.c_str(), AT_SYMLINK_FOLLOW) != 0) {
      say("cuIpcGetMemHandle: cannot name %s: %s", name.c_str(), strerror(errno));
      return CUDA_ERROR_OPERATING_SYSTEM;
    }
    r.exported = true;
  }
  IpcHandle h{{'S', 'I', 'M', 'C', 'U', 'I', 'P', 'C'}, getpid(), r.device, r.id, r.size};
  memset(handle->reserved, 0, 64);
  memcpy(handle->reserved, &h, sizeof h);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, CUipcMemHandle handle, unsigned flags) {
  FAULT_POINT();
  if (!out || (flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  IpcHandle h;
  memcpy(&h, handle.reserved, sizeof h);
  if (memcmp(h.magic, "SIMCUIPC", 8) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (h.pid == getpid()) {
    say("cuIpcOpenMemHandle: the handle is this process's own memory (the driver refuses that)");
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (h.device != c->device && !config.can_access_peer(c->device, h.device)) {
    say("cuIpcOpenMemHandle: GPU %d's memory from GPU %d, which has no P2P to it", h.device, c->device);
    return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  }
  std::string name = shm_name(h.pid, h.id);
  int fd = open(name.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    say("cuIpcOpenMemHandle: %s: %s (its owner freed it or exited)", name.c_str(), strerror(errno));
    return CUDA_ERROR_INVALID_HANDLE;
  }
  void* p = mmap(nullptr, round_pages(h.size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return CUDA_ERROR_MAP_FAILED;
  Region r{(uintptr_t)p, h.size, Kind::Imported, h.device, c};
  regions[r.base] = r;
  *out = r.base;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  FAULT_POINT();
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  auto it = regions.find((uintptr_t)p);
  if (it == regions.end() || it->second.kind != Kind::Imported) {
    say("cuIpcCloseMemHandle(%#llx): not an IPC mapping", p);
    return CUDA_ERROR_INVALID_VALUE;
  }
  Region r = it->second;
  regions.erase(it);
  retire_mapping((void*)r.base, r.size);
  return CUDA_SUCCESS;
}

// ----- streams ---------------------------------------------------------------------------

SIM_API CUresult cuStreamCreate(CUstream* out, unsigned flags) {
  FAULT_POINT();
  if (!out || flags > 1) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  // The real driver hands a destroyed stream's handle to a later stream; this one always
  // does when it can, so that code keying state by handle meets it (a claim that outlived
  // its stream refused ranks' calls on an H100). A stream is reused once its queue is
  // empty; its worker thread serves it again.
  Stream* s = nullptr;
  for (auto it = retired_streams.rbegin(); it != retired_streams.rend(); ++it) {
    if ((*it)->queue.empty()) {
      s = *it;
      retired_streams.erase(std::next(it).base());
      break;
    }
  }
  if (s) {
    s->ctx = c;
    s->blocking = flags == 0;
    s->live = true;
    s->capturing = false;
  } else {
    s = new Stream{c, flags == 0, false};
    start_worker(s);
  }
  streams.insert(s);
  *out = s;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamCreateWithPriority(CUstream* out, unsigned flags, int) { return cuStreamCreate(out, flags); }

SIM_API CUresult cuStreamGetPriority(CUstream, int* p) {
  FAULT_POINT();
  if (p) *p = 0;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  FAULT_POINT();
  if (least) *least = 0;
  if (greatest) *greatest = 0;
  return CUDA_SUCCESS;
}

// The stream's worker drains what was queued, then the stream is gone (its handle is
// refused from now on), as with the real driver.
SIM_API CUresult cuStreamDestroy_v2(CUstream s) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  if (!streams.erase(s)) return CUDA_ERROR_INVALID_HANDLE;
  s->live = false;
  retired_streams.push_back(s);
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamGetCtx(CUstream h, CUcontext* out) {
  FAULT_POINT();
  CHECK_INIT();
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  if (h == nullptr || h == (CUstream)0x1) {
    if (current.empty() || !current.back()) return CUDA_ERROR_INVALID_CONTEXT;
    *out = current.back();
    return CUDA_SUCCESS;
  }
  if (!streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
  *out = h->ctx;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamGetFlags(CUstream h, unsigned* flags) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  if (!flags) return CUDA_ERROR_INVALID_VALUE;
  if (h == nullptr || h == (CUstream)0x1) {
    *flags = 0;
    return CUDA_SUCCESS;
  }
  if (!streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
  *flags = h->blocking ? 0 : 1;
  return CUDA_SUCCESS;
}

namespace sim {
// The stream a synchronisation call names (NULL: the current context's legacy stream).
CUresult any_stream(CUstream h, Stream** out) {
  if (h == nullptr || h == (CUstream)0x1) {
    Ctx* c;
    if (CUresult rc = current_ctx(&c)) return rc;
    *out = legacy_of(c);
    return CUDA_SUCCESS;
  }
  if (!streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
  *out = h;
  return CUDA_SUCCESS;
}
}  // namespace sim
using namespace sim;

SIM_API CUresult cuStreamSynchronize(CUstream h) {
  FAULT_POINT();
  CHECK_INIT();
  std::unique_lock<std::mutex> lock(mu);
  Stream* s;
  if (CUresult rc = any_stream(h, &s)) return rc;
  if (s->legacy) enqueue_locked(s, Op{"synchronize"});  // waits for the blocking streams too
  drain(lock, s);
  return s->ctx->sticky;
}

SIM_API CUresult cuStreamQuery(CUstream h) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  Stream* s;
  if (CUresult rc = any_stream(h, &s)) return rc;
  if (s->ctx->sticky) return s->ctx->sticky;
  return s->completed == s->enqueued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_API CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned flags) {
  FAULT_POINT();
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  Stream* s;
  if (CUresult rc = stream_of(h, c, &s)) return rc;
  if (!events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
  auto sig = e->last;
  if (!sig) return CUDA_SUCCESS;
  enqueue_locked(s, Op{"wait event", [sig] { return sig->fired; }});
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  FAULT_POINT();
  if (flags > 3) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  Stream* s;
  if (CUresult rc = stream_of(h, c, &s)) return rc;
  if (addr % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult rc = copy_check(c, addr, 4, "cuStreamWaitValue32")) return rc;
  auto* word = (const uint32_t*)(uintptr_t)addr;
  Op op{"wait value", [word, value, flags] {
          uint32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
          switch (flags) {
            case 0: return (int32_t)(v - value) >= 0;  // GEQ (cyclic)
            case 1: return v == value;                 // EQ
            case 2: return (v & value) != 0;           // AND
            default: return ~(v | value) != 0;        // NOR
          }
        }};
  op.polls_memory = true;
  enqueue_locked(s, std::move(op));
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamWaitValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  FAULT_POINT();
  return cuStreamWaitValue32_v2(h, addr, value, flags);
}

SIM_API CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned flags) {
  FAULT_POINT();
  if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  Stream* s;
  if (CUresult rc = stream_of(h, c, &s)) return rc;
  if (CUresult rc = copy_check(c, addr, 4, "cuStreamWriteValue32")) return rc;
  auto* word = (uint32_t*)(uintptr_t)addr;
  enqueue_locked(s, Op{"write value", nullptr, false, [word, value] { __atomic_store_n(word, value, __ATOMIC_RELEASE); }});
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamBeginCapture_v2(CUstream h, int) {
  FAULT_POINT();
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (h == nullptr || h == (CUstream)0x1) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (!streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
  if (h->capturing) return CUDA_ERROR_ILLEGAL_STATE;
  h->capturing = true;
  return CUDA_SUCCESS;
}

// Ends a capture into which nothing was queued (the simulated driver has no graphs: work
// queued while capturing is refused), giving no graph.
SIM_API CUresult cuStreamEndCapture(CUstream h, void** graph) {
  FAULT_POINT();
  std::lock_guard<std::mutex> g(mu);
  if (!streams.count(h) || !h->capturing) return CUDA_ERROR_ILLEGAL_STATE;
  h->capturing = false;
  if (graph) *graph = nullptr;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuStreamIsCapturing(CUstream h, int* status) {
  FAULT_POINT();
  CHECK_INIT();
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  if (h == nullptr || h == (CUstream)0x1) {
    *status = 0;
    return CUDA_SUCCESS;
  }
  if (!streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
  *status = h->capturing ? 1 : 0;  // CU_STREAM_CAPTURE_STATUS_ACTIVE / NONE
  return CUDA_SUCCESS;
}

// ----- events ----------------------------------------------------------------------------

SIM_API CUresult cuEventCreate(CUevent* out, unsigned flags) {
  FAULT_POINT();
  if (!out || flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  Event* e = new Event{c, nullptr};
  events.insert(e);
  *out = e;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuEventRecord(CUevent e, CUstream h) {
  FAULT_POINT();
  std::unique_lock<std::mutex> lock(mu);
  if (CUresult rc = wait_for_frees(lock, "cuEventRecord")) return rc;
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (!events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
  Stream* s;
  if (CUresult rc = stream_of(h, c, &s)) return rc;
  if (e->ctx != s->ctx) {
    say("cuEventRecord: an event of GPU %d's context on a stream of GPU %d's", e->ctx->device, s->ctx->device);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  auto sig = std::make_shared<Signal>();
  e->last = sig;
  enqueue_locked(s, Op{"record event", nullptr, false, [sig] {
                         std::lock_guard<std::mutex> g(mu);
                         sig->fired = true;
                       }});
  return CUDA_SUCCESS;
}

SIM_API CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned) { return cuEventRecord(e, h); }

SIM_API CUresult cuEventQuery(CUevent e) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  if (!events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
  if (e->ctx->sticky) return e->ctx->sticky;
  return !e->last || e->last->fired ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_API CUresult cuEventSynchronize(CUevent e) {
  FAULT_POINT();
  CHECK_INIT();
  std::unique_lock<std::mutex> lock(mu);
  if (!events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
  auto sig = e->last;
  if (sig) progress.wait(lock, [&] { return sig->fired || e->ctx->sticky; });
  return e->ctx->sticky;
}

SIM_API CUresult cuEventElapsedTime(float* ms, CUevent, CUevent) {
  FAULT_POINT();
  if (ms) *ms = 0;
  say("cuEventElapsedTime: the simulated driver keeps no device time");
  return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_API CUresult cuEventDestroy_v2(CUevent e) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  if (!events.erase(e)) return CUDA_ERROR_INVALID_HANDLE;
  delete e;  // queued records hold their signal, not the event
  return CUDA_SUCCESS;
}

// ----- copies ----------------------------------------------------------------------------

namespace sim {
// Queues a copy (or fill) on `h` after checking its device ranges; waits for it when
// `sync`. `dst_dev` / `src_dev`: which side is device memory.
CUresult copy(CUstream h, void* dst, const void* src, size_t n, bool dst_dev, bool src_dev, bool sync,
              const char* call, int fill = -1) {
  std::unique_lock<std::mutex> lock(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  Stream* s;
  if (CUresult rc = stream_of(h, c, &s)) return rc;
  if (n == 0) return CUDA_SUCCESS;
  if (dst_dev)
    if (CUresult rc = copy_check(c, (uintptr_t)dst, n, call)) return rc;
  if (src_dev)
    if (CUresult rc = copy_check(c, (uintptr_t)src, n, call)) return rc;
  // Pageable host memory, as the real driver treats it: a copy from it is staged before
  // the call returns (the caller may reuse the buffer at once); a copy to it is
  // synchronous.
  bool pinned_src = src_dev || fill >= 0 || find_region((uintptr_t)src);
  bool pinned_dst = dst_dev || find_region((uintptr_t)dst);
  std::shared_ptr<std::vector<char>> staged;
  if (!pinned_src) staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + n);
  enqueue_locked(s, Op{call, nullptr, false, [=] {
                         if (fill >= 0)
                           memset(dst, fill, n);
                         else
                           memmove(dst, staged ? staged->data() : src, n);
                       }});
  if (sync || !pinned_dst) {
    drain(lock, s);
    return s->ctx->sticky;
  }
  return CUDA_SUCCESS;
}
}  // namespace sim
using namespace sim;

SIM_API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, size_t n) {
  FAULT_POINT();
  return copy(nullptr, (void*)(uintptr_t)d, h, n, true, false, true, "cuMemcpyHtoD");
}
SIM_API CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, size_t n) {
  FAULT_POINT();
  return copy(nullptr, h, (void*)(uintptr_t)d, n, false, true, true, "cuMemcpyDtoH");
}
SIM_API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
  FAULT_POINT();
  return copy(nullptr, (void*)(uintptr_t)d, (void*)(uintptr_t)s, n, true, true, true, "cuMemcpyDtoD");
}
SIM_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, size_t n, CUstream s) {
  FAULT_POINT();
  return copy(s, (void*)(uintptr_t)d, h, n, true, false, false, "cuMemcpyHtoDAsync");
}
SIM_API CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, size_t n, CUstream s) {
  FAULT_POINT();
  return copy(s, h, (void*)(uintptr_t)d, n, false, true, false, "cuMemcpyDtoHAsync");
}
SIM_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s) {
  FAULT_POINT();
  return copy(s, (void*)(uintptr_t)d, (void*)(uintptr_t)src, n, true, true, false, "cuMemcpyDtoDAsync");
}
SIM_API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
  FAULT_POINT();
  return copy(nullptr, (void*)(uintptr_t)d, nullptr, n, true, false, true, "cuMemsetD8", v);
}
SIM_API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
  FAULT_POINT();
  return copy(s, (void*)(uintptr_t)d, nullptr, n, true, false, false, "cuMemsetD8Async", v);
}

// ----- modules and launches ---------------------------------------------------------------

SIM_API CUresult cuModuleLoadData(CUmodule* out, const void* image) {
  FAULT_POINT();
  if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  const unsigned char* bytes = (const unsigned char*)image;
  if (memcmp(bytes, "\x7f" "ELF", 4) != 0) {
    say("cuModuleLoadData: not a cubin (the simulated driver has no PTX JIT; compile to a cubin)");
    return CUDA_ERROR_INVALID_IMAGE;
  }
  int major = 0, minor = 0;
  std::set<std::string> entries;
  if (!cubin_arch(bytes, &major, &minor, &entries)) {
    say("cuModuleLoadData: an ELF image that is not a 64-bit CUDA cubin");
    return CUDA_ERROR_INVALID_IMAGE;
  }
  if (major != config.cc_major || minor != config.cc_minor) {
    say("cuModuleLoadData: a cubin for sm_%d%d on a sm_%d%d device", major, minor, config.cc_major, config.cc_minor);
    return CUDA_ERROR_NO_BINARY_FOR_GPU;
  }
  Module* m = new Module{c, entries};
  modules.insert(m);
  *out = m;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleUnload(CUmodule m) {
  FAULT_POINT();
  CHECK_INIT();
  std::lock_guard<std::mutex> g(mu);
  if (!modules.erase(m)) return CUDA_ERROR_INVALID_HANDLE;
  for (auto it = functions.begin(); it != functions.end();)
    if ((*it)->module == m)
      it = functions.erase(it);
    else
      ++it;
  return CUDA_SUCCESS;
}

SIM_API CUresult cuModuleGetFunction(CUfunction* out, CUmodule m, const char* name) {
  FAULT_POINT();
  if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (!modules.count(m)) return CUDA_ERROR_INVALID_HANDLE;
  if (m->ctx != c) return CUDA_ERROR_INVALID_CONTEXT;
  if (!m->entries.count(name)) return CUDA_ERROR_NOT_FOUND;
  for (const KernelDef& k : kernels()) {
    if (strcmp(k.name, name) == 0) {
      Function* f = new Function{m, &k};
      functions.insert(f);
      *out = f;
      return CUDA_SUCCESS;
    }
  }
  say("cuModuleGetFunction: the cubin has %s, but the simulated driver has no host build of it", name);
  return CUDA_ERROR_NOT_FOUND;
}

SIM_API CUresult cuFuncGetAttribute(int* v, int attribute, CUfunction f) {
  FAULT_POINT();
  CHECK_INIT();
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  if (!functions.count(f)) return CUDA_ERROR_INVALID_HANDLE;
  switch (attribute) {
    case 0: *v = 1024; return CUDA_SUCCESS;  // MAX_THREADS_PER_BLOCK
    default: *v = 0; return CUDA_SUCCESS;
  }
}

SIM_API CUresult cuFuncLoad(CUfunction f) {
  FAULT_POINT();
  CHECK_INIT();
  std::unique_lock<std::mutex> lock(mu);
  if (!functions.count(f)) return CUDA_ERROR_INVALID_HANDLE;
  return load_function(lock, f, "cuFuncLoad");
}

SIM_API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned shared, CUstream h, void** params, void** extra) {
  FAULT_POINT();
  std::unique_lock<std::mutex> lock(mu);
  Ctx* c;
  if (CUresult rc = current_ctx(&c)) return rc;
  if (!functions.count(f)) return CUDA_ERROR_INVALID_HANDLE;
  // A kernel not loaded yet loads now, before its launch is queued.
  if (CUresult rc = load_function(lock, f, "cuLaunchKernel")) return rc;
  if (CUresult rc = wait_for_frees(lock, "cuLaunchKernel")) return rc;
  if (!functions.count(f)) return CUDA_ERROR_INVALID_HANDLE;
  if (f->module->ctx != c) {
    say("cuLaunchKernel: %s was loaded in GPU %d's context, launched in GPU %d's", f->def->name,
        f->module->ctx->device, c->device);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  Stream* s;
  if (CUresult rc = stream_of(h, c, &s)) return rc;
  if (extra) {
    say("cuLaunchKernel: `extra` parameters are not simulated");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || gx == 0 || bx == 0 || bx > 1024 || shared > 48 * 1024) {
    say("cuLaunchKernel: %s with grid %ux%ux%u, block %ux%ux%u, %u B shared: the kernels are 1-D", f->def->name,
        gx, gy, gz, bx, by, bz, shared);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!params) return CUDA_ERROR_INVALID_VALUE;
  launches++;
  auto run = std::make_shared<GridRun>();
  run->def = f->def;
  run->blocks = gx;
  run->threads = bx;
  run->device = c->device;
  for (size_t i = 0; i < f->def->sizes.size(); i++) {
    const char* p = (const char*)params[i];
    run->params.emplace_back(p, p + f->def->sizes[i]);
  }
  enqueue_locked(s, Op{f->def->name, nullptr, false, [run, c] {
                         std::vector<std::tuple<uintptr_t, size_t, std::string>> ranges;
                         run->def->touches(run->params, ranges);
                         {
                           std::lock_guard<std::mutex> g(mu);
                           for (auto& [p, n, what] : ranges) {
                             if (n == 0) continue;
                             std::string why = access_problem(c, p, n);
                             if (!why.empty()) {
                               say("%s on GPU %d: illegal address: %s [%#lx, +%zu) is %s", run->def->name,
                                   c->device, what.c_str(), (unsigned long)p, n, why.c_str());
                               c->sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
                               progress.notify_all();
                               return;
                             }
                           }
                         }
                         run_grid(*run);
                       }});
  return CUDA_SUCCESS;
}
