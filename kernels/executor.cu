// The device executor of ferroccl's plans: the fourth consumer of `plan::Plan`, after
// the host engine, the simulator and the visualizer.
//
// One thread block runs one lane: it walks the lane's steps in order, moving each step's
// elements through the FIFOs one slot-sized slice at a time, as `engine::advance` does on
// the host, with the same arithmetic and the same rules for pre- and post-operations
// (`engine::move_slice`), so a plan gives the same bits on either side. Within a slice
// every thread of the block takes its share of the elements, 16 bytes at a time.
//
// Waiting, as in NCCL's primitives: thread 0 polls the peer's counter (`head` of the
// FIFO it receives on, `tail` of the one it sends on) with acquire loads and posts its
// own with release stores (Simple); with LL every thread polls the flags of its own lines.
// Every wait looks at the abort word now and then, so a host that gives up (deadline,
// failed peer, user abort) gets its stream back.
#include "ferroccl.cuh"

// Spins between looks at the abort word.
#define FCCL_ABORT_CHECK_SPINS 1024u

// Data bytes of one LL line (4 data + 4 flag).
#define FCCL_LL_DATA 4u
// Every this many positions each slot's first use rewrites all its lines, so no stale
// flag can come round again (NCCL's NCCL_LL_CLEAN_MASK). The host's LL slots have one
// flag, in a header that every use rewrites (`transport::fifo`).
#define FCCL_LL_CLEAN_PERIOD 0x80000000ull

// What the threads of one block share.
struct FcclBlockState {
  uint64_t recv_pos;  // this end's `tail` of the FIFO received on
  uint64_t send_pos;  // this end's `head` of the FIFO sent on
  uint32_t got_bytes;
  uint32_t failed;    // an FCCL_STATUS_* other than OK ends the lane
};

// Most bytes one slot of `f` carries.
FCCL_FN uint32_t fccl_payload(const FcclFifo& f) {
  if (f.protocol == FCCL_LL) return ((f.slot_bytes / 8u - 1u) * FCCL_LL_DATA) & ~63u;
  return f.slot_bytes;
}

// Whether the abort word is set (checked every FCCL_ABORT_CHECK_SPINS spins).
FCCL_FN bool fccl_should_stop(const uint32_t* abort, uint32_t* spins) {
  if (++*spins % FCCL_ABORT_CHECK_SPINS != 0) {
    fccl_pause();
    return false;
  }
  return fccl_load_flag(abort) != 0;
}

// Thread 0: waits until the slot at `pos` of `f` holds a message (Simple); false if
// aborted.
FCCL_FN bool fccl_wait_published(const FcclFifo& f, uint64_t pos, const uint32_t* abort) {
  uint32_t spins = 0;
  while (fccl_load_acquire(f.head) <= pos) {
    if (fccl_should_stop(abort, &spins)) return false;
  }
  return true;
}

// Thread 0: waits until the slot at `pos` of `f` is free (both protocols); false if
// aborted.
FCCL_FN bool fccl_wait_free(const FcclFifo& f, uint64_t pos, const uint32_t* abort) {
  uint32_t spins = 0;
  while (pos - fccl_load_acquire(f.tail) >= f.slots) {
    if (fccl_should_stop(abort, &spins)) return false;
  }
  return true;
}

FCCL_FN char* fccl_slot(const FcclFifo& f, uint64_t pos) {
  return f.data + (uint64_t)(pos & (f.slots - 1)) * f.slot_bytes;
}

// The flag of use `pos` of a slot (0 is never current: lines start zeroed).
FCCL_FN uint32_t fccl_ll_flag(uint64_t pos) { return (uint32_t)(pos + 1); }

FCCL_FN uint64_t fccl_ll_line(uint32_t data, uint32_t flag) {
  return (uint64_t)data | ((uint64_t)flag << 32);
}

// All threads: unpacks the LL message at `pos` of `f` into `f.stage`, once line 0 says
// how long it is. Returns its byte count (in `st.got_bytes`), or sets `st.failed`.
FCCL_FN void fccl_ll_receive(const FcclFifo& f, uint64_t pos, uint32_t expected, const uint32_t* abort,
                             FcclBlockState& st, uint32_t tid, uint32_t nthreads) {
  const uint64_t* lines = (const uint64_t*)fccl_slot(f, pos);
  const uint32_t flag = fccl_ll_flag(pos);
  if (tid == 0) {
    uint32_t spins = 0;
    uint64_t v;
    while ((uint32_t)((v = fccl_load_line(&lines[0])) >> 32) != flag) {
      if (fccl_should_stop(abort, &spins)) {
        st.failed = FCCL_STATUS_ABORTED;
        break;
      }
    }
    if (st.failed == FCCL_STATUS_OK) {
      st.got_bytes = (uint32_t)v;
      if (st.got_bytes != expected) st.failed = FCCL_STATUS_SIZE_MISMATCH;
    }
  }
  __syncthreads();
  if (st.failed != FCCL_STATUS_OK) return;
  const uint32_t nlines = (expected + FCCL_LL_DATA - 1) / FCCL_LL_DATA;
  uint32_t* stage = (uint32_t*)f.stage;
  for (uint32_t i = tid; i < nlines; i += nthreads) {
    uint32_t spins = 0;
    uint64_t v;
    bool stop = false;
    while ((uint32_t)((v = fccl_load_line(&lines[1 + i])) >> 32) != flag) {
      if (fccl_should_stop(abort, &spins)) {
        stop = true;
        break;
      }
    }
    if (stop) {
      st.failed = FCCL_STATUS_ABORTED;
      break;
    }
    stage[i] = (uint32_t)v;
  }
}

// All threads: packs `bytes` of `f.stage` into the LL slot at `pos` (line 0: the count).
FCCL_FN void fccl_ll_send(const FcclFifo& f, uint64_t pos, uint32_t bytes, uint32_t tid,
                          uint32_t nthreads) {
  uint64_t* lines = (uint64_t*)fccl_slot(f, pos);
  const uint32_t flag = fccl_ll_flag(pos);
  const uint32_t data_lines = (bytes + FCCL_LL_DATA - 1) / FCCL_LL_DATA;
  // Each slot's first use in every clean period of positions rewrites all its lines
  // (the host's rule: `head % 2^31 < slots`), so no line's flag is 2^32 positions old.
  const bool clean = (pos % FCCL_LL_CLEAN_PERIOD) < f.slots;
  const uint32_t written = clean ? f.slot_bytes / 8u - 1u : data_lines;
  const uint32_t* stage = (const uint32_t*)f.stage;
  for (uint32_t i = tid; i < written; i += nthreads) {
    uint32_t d = 0;
    if (i < data_lines) {
      if ((i + 1) * FCCL_LL_DATA <= bytes) {
        d = stage[i];
      } else {
        const uint8_t* b = (const uint8_t*)f.stage;
        for (uint32_t k = 0; i * FCCL_LL_DATA + k < bytes; k++) d |= (uint32_t)b[i * FCCL_LL_DATA + k] << (8 * k);
      }
    }
    fccl_store_line(&lines[1 + i], fccl_ll_line(d, flag));
  }
  // Line 0 last is not needed for correctness (every line carries its own flag) but
  // lets the receiver start on a complete count.
  if (tid == 0) fccl_store_line(&lines[0], fccl_ll_line(bytes, flag));
}

// Address of element `skip` of region `r`.
FCCL_FN char* fccl_addr(const FcclWork& w, const FcclRegion& r, uint64_t skip, uint32_t elem) {
  const FcclOp& op = w.ops[r.op];
  char* base = (char*)(r.buf == FCCL_BUF_INPUT ? op.input
                       : r.buf == FCCL_BUF_OUTPUT ? op.output
                                                  : op.scratch);
  return base + (r.offset + skip) * elem;
}

// `engine::move_slice` for element type T: one slice of `n` elements, `skip` into the
// step; `x` is the received slice (or null), `o` the slice to send (or null). Passes
// that read what an earlier pass wrote are separated by a barrier: two passes may share
// the elements out among the threads differently (their alignments differ).
struct FcclMoveSlice {
  template <typename T>
  FCCL_FN void run(const FcclWork* w, const FcclStep* s, uint64_t skip, uint64_t n, const char* x,
                   char* o, uint32_t tid, uint32_t nthreads) {
    const FcclOp& op = w->ops[s->kind == FCCL_RECV || s->kind == FCCL_RECV_COPY_SEND ? s->dst.op : s->src.op];
    const uint32_t E = sizeof(T);
    const uint64_t bytes = n * E;
    // This rank's contribution gets the pre-operation; a partial result does not (for
    // pre-mul-sum the partial is summed plainly).
    const uint32_t operand_op =
        (op.redop == FCCL_OP_PREMULSUM && s->src.buf != FCCL_BUF_INPUT) ? FCCL_OP_SUM : op.redop;
    const bool pre_src = op.reducing && s->src.buf == FCCL_BUF_INPUT;
    switch (s->kind) {
      case FCCL_SEND:
      case FCCL_COPY_SEND: {
        const char* src = fccl_addr(*w, s->src, skip, E);
        if (pre_src) fccl_pre<T>((T*)o, (const T*)src, n, op.redop, op.scalar, tid, nthreads);
        else fccl_copy(o, src, bytes, tid, nthreads);
        char* dst = s->kind == FCCL_COPY_SEND ? fccl_addr(*w, s->dst, skip, E) : nullptr;
        if (dst != nullptr && dst != src) {
          __syncthreads();
          fccl_copy(dst, o, bytes, tid, nthreads);
        }
        break;
      }
      case FCCL_RECV:
        fccl_copy(fccl_addr(*w, s->dst, skip, E), x, bytes, tid, nthreads);
        break;
      case FCCL_RECV_REDUCE_SEND:
        fccl_reduce<T>((T*)o, (const T*)x, (const T*)fccl_addr(*w, s->src, skip, E), n, operand_op,
                       op.scalar, tid, nthreads);
        break;
      case FCCL_RECV_REDUCE_COPY:
      case FCCL_RECV_REDUCE_COPY_SEND: {
        // The result goes to dst; a copy that is also sent is final (post-operation).
        const bool sends = s->kind == FCCL_RECV_REDUCE_COPY_SEND;
        T* dst = (T*)fccl_addr(*w, s->dst, skip, E);
        fccl_reduce<T>(dst, (const T*)x, (const T*)fccl_addr(*w, s->src, skip, E), n, operand_op,
                       op.scalar, tid, nthreads);
        __syncthreads();
        if (sends || s->post) fccl_post<T>(dst, n, op.redop, op.nranks, tid, nthreads);
        if (sends) {
          __syncthreads();
          fccl_copy(o, (const char*)dst, bytes, tid, nthreads);
        }
        break;
      }
      case FCCL_RECV_REDUCE_COPY_LOCAL_FIRST: {
        // dst = src ⊕ x: the received contribution was pre-processed by its sender; a
        // local contribution gets its pre-operation first (into dst).
        T* dst = (T*)fccl_addr(*w, s->dst, skip, E);
        const T* src = (const T*)fccl_addr(*w, s->src, skip, E);
        const bool premul = op.redop == FCCL_OP_PREMULSUM;
        if (premul && s->src.buf == FCCL_BUF_INPUT) {
          fccl_pre<T>(dst, src, n, op.redop, op.scalar, tid, nthreads);
          __syncthreads();
          src = dst;
        }
        fccl_reduce<T>(dst, src, (const T*)x, n, premul ? FCCL_OP_SUM : op.redop, op.scalar, tid,
                       nthreads);
        __syncthreads();
        if (s->post) fccl_post<T>(dst, n, op.redop, op.nranks, tid, nthreads);
        break;
      }
      case FCCL_RECV_COPY_SEND:
        fccl_copy(fccl_addr(*w, s->dst, skip, E), x, bytes, tid, nthreads);
        fccl_copy(o, x, bytes, tid, nthreads);
        break;
    }
  }
};

// A `Copy` step: dst = post(pre(src)) in a reducing operation, else a plain copy.
struct FcclLocalCopy {
  template <typename T>
  FCCL_FN void run(const FcclWork* w, const FcclStep* s, uint32_t tid, uint32_t nthreads) {
    const FcclOp& op = w->ops[s->dst.op];
    const uint32_t E = sizeof(T);
    const char* src = fccl_addr(*w, s->src, 0, E);
    char* dst = fccl_addr(*w, s->dst, 0, E);
    const uint64_t n = s->src.len;
    if (op.reducing) {
      fccl_pre<T>((T*)dst, (const T*)src, n, op.redop, op.scalar, tid, nthreads);
      __syncthreads();
      fccl_post<T>((T*)dst, n, op.redop, op.nranks, tid, nthreads);
    } else if (src != dst) {
      const uint64_t bytes = n * E;
      if (dst < src + bytes && src < dst + bytes) {
        // Overlapping ranges: one thread, in the direction that reads before it writes.
        if (tid == 0) {
          if (dst < src) {
            for (uint64_t i = 0; i < bytes; i++) dst[i] = src[i];
          } else {
            for (uint64_t i = bytes; i > 0; i--) dst[i - 1] = src[i - 1];
          }
        }
      } else {
        fccl_copy(dst, src, bytes, tid, nthreads);
      }
    }
  }
};

// A `Reduce` step: dst = a ⊕ b, each operand with the pre-operation if it is this rank's
// contribution (the input), and the post-operation if final. `a` is only the input when
// `b` is not, so writing pre(a) to dst first never overwrites b.
struct FcclLocalReduce {
  template <typename T>
  FCCL_FN void run(const FcclWork* w, const FcclStep* s, uint32_t tid, uint32_t nthreads) {
    const FcclOp& op = w->ops[s->dst.op];
    const uint32_t E = sizeof(T);
    const T* a = (const T*)fccl_addr(*w, s->src, 0, E);
    const T* b = (const T*)fccl_addr(*w, s->b, 0, E);
    T* dst = (T*)fccl_addr(*w, s->dst, 0, E);
    const uint64_t n = s->dst.len;
    const bool premul = op.redop == FCCL_OP_PREMULSUM;
    if (premul && s->src.buf == FCCL_BUF_INPUT) {
      fccl_pre<T>(dst, a, n, op.redop, op.scalar, tid, nthreads);
      __syncthreads();
      a = dst;
    }
    const uint32_t b_op = premul && s->b.buf != FCCL_BUF_INPUT ? FCCL_OP_SUM : op.redop;
    fccl_reduce<T>(dst, a, b, n, b_op, op.scalar, tid, nthreads);
    __syncthreads();
    if (s->post) fccl_post<T>(dst, n, op.redop, op.nranks, tid, nthreads);
  }
};

// Runs one step to its end; sets `st.failed` if it cannot.
FCCL_FN void fccl_run_step(const FcclWork& w, const FcclStep& s, FcclBlockState& st, uint32_t tid,
                           uint32_t nthreads) {
  if (s.kind == FCCL_COPY || s.kind == FCCL_REDUCE) {
    const uint32_t dtype = w.ops[s.dst.op].dtype;
    const bool known = s.kind == FCCL_COPY
                           ? fccl_with_dtype<FcclLocalCopy>(dtype, &w, &s, tid, nthreads)
                           : fccl_with_dtype<FcclLocalReduce>(dtype, &w, &s, tid, nthreads);
    if (!known && tid == 0) st.failed = FCCL_STATUS_BAD_PLAN;
    __syncthreads();
    return;
  }
  const bool recv_only = s.kind == FCCL_RECV || s.kind == FCCL_RECV_COPY_SEND;
  const FcclOp& op = w.ops[recv_only ? s.dst.op : s.src.op];
  const uint32_t elem = fccl_dtype_size(op.dtype);
  const FcclFifo* in = s.recv_fifo >= 0 ? &w.fifos[s.recv_fifo] : nullptr;
  const FcclFifo* out = s.send_fifo >= 0 ? &w.fifos[s.send_fifo] : nullptr;
  const uint64_t len = recv_only ? s.dst.len : s.src.len;
  const FcclFifo* geometry = in ? in : out;
  if (elem == 0 || geometry == nullptr || fccl_payload(*geometry) < elem) {
    if (tid == 0) st.failed = FCCL_STATUS_BAD_PLAN;
    __syncthreads();
    return;
  }
  const uint64_t per_slice = fccl_payload(*geometry) / elem;
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = per_slice < len - done ? per_slice : len - done;
    const uint32_t bytes = (uint32_t)(n * elem);
    // Positions: each end's own counter, which only this block writes.
    if (tid == 0) {
      if (in) st.recv_pos = *in->tail;
      if (out) st.send_pos = *out->head;
    }
    __syncthreads();
    const char* x = nullptr;
    char* o = nullptr;
    if (in) {
      if (in->protocol == FCCL_LL) {
        fccl_ll_receive(*in, st.recv_pos, bytes, w.abort, st, tid, nthreads);
        x = in->stage;
      } else {
        if (tid == 0) {
          if (!fccl_wait_published(*in, st.recv_pos, w.abort)) {
            st.failed = FCCL_STATUS_ABORTED;
          } else if (in->sizes[st.recv_pos & (in->slots - 1)] != bytes) {
            st.failed = FCCL_STATUS_SIZE_MISMATCH;
          }
        }
        x = fccl_slot(*in, st.recv_pos);
      }
    }
    if (out && tid == 0 && st.failed == FCCL_STATUS_OK &&
        !fccl_wait_free(*out, st.send_pos, w.abort)) {
      st.failed = FCCL_STATUS_ABORTED;
    }
    if (out) o = out->protocol == FCCL_LL ? out->stage : fccl_slot(*out, st.send_pos);
    __syncthreads();
    if (st.failed != FCCL_STATUS_OK) return;
    fccl_with_dtype<FcclMoveSlice>(op.dtype, &w, &s, done, n, x, o, tid, nthreads);
    __syncthreads();
    if (out && out->protocol == FCCL_LL) {
      fccl_ll_send(*out, st.send_pos, bytes, tid, nthreads);
      __syncthreads();
    }
    if (tid == 0) {
      if (in) fccl_store_release(in->tail, st.recv_pos + 1);
      if (out) {
        // What the other threads wrote is ordered before the barrier above; make it
        // visible to the peer (another GPU, or the host) before the counter.
        fccl_fence_system();
        if (out->protocol == FCCL_SIMPLE) {
          // The count, then the counter that publishes data and count (release).
          out->sizes[st.send_pos & (out->slots - 1)] = bytes;
        }
        fccl_store_release(out->head, st.send_pos + 1);
      }
    }
    __syncthreads();
    done += n;
  }
}

// Block b runs lane b of `w` and writes its outcome to `w.status[b]`.
FCCL_GLOBAL void ferroccl_execute(FcclWork w) {
  const uint32_t lane = blockIdx.x;
  const uint32_t tid = threadIdx.x;
  const uint32_t nthreads = blockDim.x;
  FCCL_BLOCK_SHARED(FcclBlockState, st);
  if (lane >= w.nlanes) return;
  if (tid == 0) {
    st.failed = FCCL_STATUS_OK;
    st.got_bytes = 0;
  }
  __syncthreads();
  const FcclLane l = w.lanes[lane];
  for (uint32_t i = 0; i < l.count; i++) {
    fccl_run_step(w, w.steps[l.first + i], st, tid, nthreads);
    if (st.failed != FCCL_STATUS_OK) break;
  }
  if (tid == 0) w.status[lane] = st.failed;
}
