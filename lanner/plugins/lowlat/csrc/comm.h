// lowlat's tensor-parallel collectives: the memory segment the ranks on one host share, and its wait protocol.
#pragma once
#include "common.h"

namespace lowlat {

// ------------------------------------------------------------------------------------------------ TP comm
// Tensor parallelism: the row-parallel outputs (o_proj, down / MoE experts, the vocab-split embedding) are summed
// over the ranks inside the forward call, and the vocab-split logits gathered inside `linear_gather`. Ranks on one
// host share a memory segment (a file every rank maps): each thread writes its rounded partial of its own hidden
// columns to its rank's slot and publishes it by storing the collective's sequence number into its flag (values
// tagged with the step's collective number, no separate ready/clear handshake), then waits for the same thread's
// flags of the other ranks to reach that number and sums the slots in rank order (the same bits on every rank).
// Slots alternate by the number's parity: a rank can run at most one collective ahead of another (it needs the
// other's partial to finish), so it never overwrites a slot still being read. A wait longer than `timeout_s`
// (shorter than the engine's watchdog) marks the late flag with -1 by compare-and-swap, and publishing is a
// compare-and-swap too: either the late rank published in time or it finds its flag marked, never both, and
// every other rank waits on that flag too, so all ranks give up the step together and no rank needs to ask the
// others afterwards. An aborted forward runs to its end without waiting and reports `aborted`. Ranks on several
// hosts use the process group instead (a Python callable, called by thread 0 between barriers).
struct Comm {
  int64_t P = 1, rank = 0, nt = 1, hidden = 0, rows = 0, gather_cols = 0;
  double timeout_s = 0;
  torch::Tensor shm;  // the mapped segment (keeps the mapping alive)
  char* base = nullptr;
  int64_t off_red = 0, off_gather = 0, gather_rows = 0;
  int64_t seq = 0;  // collectives this rank has started (the same sequence on every rank)
  bool aborted = false;
  int64_t exchanges = 0;  // thread 0's exchanges and its seconds spent waiting in them (benchmarks)
  double wait_s = 0;
  pybind11::object py_reduce;  // multi-host: sums a float tensor in place; returns False when it timed out

  // segment: [abort word][flags: P x nt][reduce slots: 2 x P x rows x hidden f32][gather slots: 2 x P x
  // gather_rows x gather_cols f32]; every flag on its own cache line
  static int64_t bytes(int64_t P, int64_t nt, int64_t rows, int64_t hidden, int64_t gather_rows, int64_t gather_cols) {
    return 64 * (1 + P * nt) + 2 * P * (rows * hidden + gather_rows * gather_cols) * 4 + 64;
  }
  void map(torch::Tensor seg) {
    shm = seg;
    base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(seg.data_ptr()) + 63) / 64 * 64);
    off_red = 64 * (1 + P * nt);
    off_gather = off_red + 2 * P * rows * hidden * 4;
    TORCH_CHECK(seg.numel() >= bytes(P, nt, rows, hidden, gather_rows, gather_cols),
                "lowlat: the shared TP segment is too small");
  }
  int64_t* abort_word() const { return reinterpret_cast<int64_t*>(base); }
  int64_t* flag(int64_t r, int64_t t) const { return reinterpret_cast<int64_t*>(base + 64 * (1 + r * nt + t)); }
  float* red(int64_t s, int64_t r) const {
    return reinterpret_cast<float*>(base + off_red) + ((s & 1) * P + r) * rows * hidden;
  }
  float* gat(int64_t s, int64_t r) const {
    return reinterpret_cast<float*>(base + off_gather) + ((s & 1) * P + r) * gather_rows * gather_cols;
  }
  bool shared() const { return base != nullptr; }

  // publish thread t's part of collective s, then wait for every other rank's; false when the step is aborted
  bool exchange(int t, int64_t s) {
    int64_t* mine = flag(rank, t);
    int64_t prev = __atomic_load_n(mine, __ATOMIC_ACQUIRE);
    if (prev < 0 || !__atomic_compare_exchange_n(mine, &prev, s, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      return give_up();  // another rank marked this thread late
    if (__atomic_load_n(&aborted, __ATOMIC_RELAXED)) return false;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < P; r++) {
      if (r == rank) continue;
      int64_t* f = flag(r, t);
      for (uint64_t spin = 1;; spin++) {
        int64_t v = __atomic_load_n(f, __ATOMIC_ACQUIRE);
        if (v >= s) break;
        if (v < 0 || __atomic_load_n(abort_word(), __ATOMIC_ACQUIRE) != 0) return give_up();
        _mm_pause();
        if (spin % 1024 == 0) {
          if (spin > 32768) sched_yield();  // the other rank is slow: let it have this core
          const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (waited > timeout_s && __atomic_compare_exchange_n(f, &v, -1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            __atomic_store_n(abort_word(), 1, __ATOMIC_RELEASE);  // a fast path for the others; the mark decides
            return give_up();
          }  // else it published just now: v >= s on the next load
        }
      }
    }
    if (t == 0) {
      exchanges++;
      wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return true;
  }
  bool give_up() {
    __atomic_store_n(&aborted, true, __ATOMIC_RELAXED);  // this rank's threads may all get here
    return false;
  }
};

}  // namespace lowlat
