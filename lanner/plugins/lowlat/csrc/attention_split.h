// lowlat's flash-decoding. Where a sequence's keys span several partitions (kAttnPart keys each), the step's
// attention runs as units (sequence, run of q heads, part) spread over the threads, each writing its rows' part
// states; after a barrier every (row, head) folds its parts in ascending order. attend_parts folds the same states
// in the same order on one thread, so a row's bits do not depend on how its parts were scheduled: with few kv
// groups (Qwen2.5: 2 for 12 q heads) all threads share one sequence's context instead of re-reading a group's keys.
#pragma once
#include "attention.h"

namespace lowlat {

struct AttnPlan {
  bool split = false;
  int64_t items = 1;                        // runs of q heads per sequence
  std::vector<int64_t> pa, np, unit0, st0;  // per sequence: first part, parts, first unit, first state float
  int64_t units = 0, floats = 0;
};

constexpr int64_t kMaxSplitFloats = int64_t(1) << 22;  // the part states of a split step (16 MB); past it, no split

// a step's attention work for one kind of layer (win > 0: sliding-window layers): split where some sequence has
// more than one part, the buffer allows and a thread would otherwise idle or re-read keys
inline AttnPlan plan_attention(const Model& m, const int64_t* pos, const std::vector<int64_t>& row0,
                               const std::vector<int64_t>& q_lens, const std::vector<int64_t>& ctx_lens,
                               int64_t win, int nt) {
  AttnPlan p;
  const int64_t B = (int64_t)q_lens.size(), W = m.D + 2;
  int64_t parts = 0, floats = 0;
  p.pa.resize(B);
  p.np.resize(B);
  p.unit0.resize(B);
  p.st0.resize(B);
  for (int64_t sb = 0; sb < B; sb++) {
    p.pa[sb] = first_part(pos[row0[sb]], win);
    p.np[sb] = end_part(ctx_lens[sb]) - p.pa[sb];
    parts += p.np[sb];
    p.st0[sb] = floats;
    floats += q_lens[sb] * m.H * p.np[sb] * W;
  }
  if (!m.attn_split || nt <= 1 || parts <= B || floats > kMaxSplitFloats) return p;
  p.split = true;
  p.floats = floats;
  // at least two units per thread (parts differ in length: the last is partial, causal rows end early), heads
  // split at kv-group boundaries first, so that a unit reads each of its keys once
  while (p.items * parts < 2 * nt && p.items < m.H) p.items = p.items < m.Hkv ? m.Hkv : std::min(m.H, 2 * p.items);
  for (int64_t sb = 0; sb < B; sb++) {
    p.unit0[sb] = p.units;
    p.units += p.items * p.np[sb];
  }
  return p;
}

// where unit v of sequence sb (item k, part index v % np) keeps its rows' states: part-major, then the items'
// runs of heads in order, each [row][head of the run][D + 2]
inline float* part_states(const Model& m, const AttnPlan& p, float* base, int64_t sb, int64_t nq, int64_t k,
                          int64_t part) {
  return base + p.st0[sb] + (part * m.H + m.item_head(k, p.items)) * nq * (m.D + 2);
}

// the fold of every (row, head) of rows a .. b - 1 (x = row * H + head) into ain
template <typename WT, typename XT>
inline void fold_rows(const Model& m, const AttnPlan& p, float* base, const std::vector<int64_t>& row0,
                      const std::vector<int64_t>& q_lens, int64_t a, int64_t b, XT* ain) {
  thread_local std::vector<float> acc;
  const int64_t W = m.D + 2;
  acc.resize(W);
  int64_t sb = 0;
  for (int64_t x = a; x < b; x++) {
    const int64_t t = x / m.H, h = x % m.H;
    while (t >= row0[sb] + q_lens[sb]) sb++;
    const int64_t i = t - row0[sb], nq = q_lens[sb];
    int64_t k = 0;
    while (m.item_head(k + 1, p.items) <= h) k++;
    const int64_t r = i * m.item_heads(k, p.items) + h - m.item_head(k, p.items);
    acc[0] = -INFINITY;
    for (int64_t part = 0; part < p.np[sb]; part++)
      fold_part(acc.data(), part_states(m, p, base, sb, nq, k, part) + r * W, m.D);
    store_row<WT, XT>(acc.data(), ain + t * m.H * m.D + h * m.D, m.D);
  }
}

}  // namespace lowlat
