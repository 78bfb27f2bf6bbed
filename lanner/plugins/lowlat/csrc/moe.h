// lowlat's MoE feed-forward (Qwen3-MoE, Mixtral): the router's softmax and top-k as torch picks them, the
// dispatch of rows to the experts hit, and each hit expert's GEMVs over only its rows.
#pragma once
#include "model.h"

namespace lowlat {

// One thread's routing of a step's rows (every thread computes the same, privately: no barrier): per row the
// top-k experts and weights, then the dispatch: a bitmap of the experts hit, each one's row count, and its rows
// (ascending) with their weights packed from base[e] on, placed by the counts (no sort over the tokens).
struct Model::Route {
  std::vector<int64_t> ids;  // [T, top_k] as torch.topk returns them
  std::vector<float> w, p;   // [T, top_k] weights; p: one row's probabilities
  std::vector<std::pair<float, int64_t>> q;
  std::vector<uint64_t> hit;                        // bitmap over the experts
  std::vector<int32_t> cnt, base, fill, experts;    // per expert; experts: those hit, ascending
  std::vector<int32_t> rows;                        // [T * top_k]: expert e's rows at base[e] .. base[e] + cnt[e]
  std::vector<float> wts;                           // their routing weights
};

// torch.topk's comparator (CPU): larger first, NaN largest
struct Model::TopKCmp {
  bool operator()(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) const {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  }
};

// MoE.forward's router for one row: logits in the model dtype, float32 softmax over all experts (max, exp,
// sum, times 1 / sum like ATen's softmax), top-k picked the way ATen's CPU topk picks them (std::nth_element +
// std::sort, or a heap when k * 64 <= E, on (value, index) pairs with its comparator: the same experts on ties
// of bf16 logits), then optionally divided by their sum
template <typename WT>
inline void Model::topk_row(const float* lr, Route& rt, int64_t* ids, float* w) const {
  const int64_t k = top_k;
  rt.p.resize(E);
  float* p = rt.p.data();
  float m = -INFINITY;
  for (int64_t e = 0; e < E; e++) {
    p[e] = rnd<WT>(lr[e]);
    m = std::max(m, p[e]);
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; e++) p[e] = std::exp(p[e] - m);
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 mk = E - e >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (E - e)) - 1);
    acc = _mm512_mask_add_ps(acc, mk, acc, _mm512_maskz_loadu_ps(mk, p + e));
  }
  const float inv = 1.f / _mm512_reduce_add_ps(acc);
  for (int64_t e = 0; e < E; e++) p[e] *= inv;
  auto& q = rt.q;
  const TopKCmp cmp;
  if (k * 64 <= E) {
    q.resize(k);
    for (int64_t j = 0; j < k; j++) q[j] = {p[j], j};
    std::make_heap(q.begin(), q.end(), cmp);
    for (int64_t j = k; j < E; j++) {
      const std::pair<float, int64_t> v{p[j], j};
      if (cmp(v, q.front())) {
        std::pop_heap(q.begin(), q.end(), cmp);
        q.back() = v;
        std::push_heap(q.begin(), q.end(), cmp);
      }
    }
    std::sort_heap(q.begin(), q.end(), cmp);
  } else {
    q.resize(E);
    for (int64_t j = 0; j < E; j++) q[j] = {p[j], j};
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), cmp);
    std::sort(q.begin(), q.begin() + k - 1, cmp);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < k; j++) sum += q[j].first;
  for (int64_t j = 0; j < k; j++) {
    ids[j] = q[j].second;
    w[j] = renorm ? q[j].first / sum : q[j].first;
  }
}

template <typename WT>
inline void Model::route(const float* logit, int64_t T, Route& rt) const {
  const int64_t k = top_k;
  rt.ids.resize(T * k);
  rt.w.resize(T * k);
  for (int64_t t = 0; t < T; t++) topk_row<WT>(logit + t * E, rt, rt.ids.data() + t * k, rt.w.data() + t * k);
  rt.hit.assign((E + 63) / 64, 0);
  rt.cnt.assign(E, 0);
  for (int64_t i = 0; i < T * k; i++) {
    const int64_t e = rt.ids[i];
    rt.cnt[e]++;
    rt.hit[e >> 6] |= 1ull << (e & 63);
  }
  rt.experts.clear();
  rt.base.resize(E);
  rt.fill.assign(E, 0);
  int32_t o = 0;
  for (int64_t wi = 0; wi < (int64_t)rt.hit.size(); wi++)
    for (uint64_t word = rt.hit[wi]; word; word &= word - 1) {
      const int32_t e = int32_t(wi * 64 + __builtin_ctzll(word));
      rt.experts.push_back(e);
      rt.base[e] = o;
      o += rt.cnt[e];
    }
  rt.rows.resize(T * k);
  rt.wts.resize(T * k);
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      const int64_t e = rt.ids[t * k + j], at = rt.base[e] + rt.fill[e]++;
      rt.rows[at] = int32_t(t);
      rt.wts[at] = rt.w[t * k + j];
    }
}

// MoE feed-forward of layer l over the T rows of xin (this thread's copy of the normalized input), added to x:
// router GEMV (experts split over threads) | routing (each thread) | for each hit expert, the gate and up rows
// of this thread's share of the intermediate size over the expert's rows only, SiLU * up | down rows of this
// thread's share of hidden, weight * output summed per row in expert order (FusedMoE: experts ascending,
// index_add_ into a model-dtype buffer), then the residual add. Two barriers inside (after the router, after
// gate/up), however many experts are hit; the caller's barrier ends it.
template <typename WT, typename XT>
inline void Model::moe_ffn(int64_t l, int tid, int nt, const XT* xin, int64_t T, Route& rt, int64_t& s,
                           std::string& err) {
  float* gu = buf<float>(off_gu);
  XT* mact = buf<XT>(off_mact);
  XT* xg = buf<XT>(off_xg + tid * xg_stride);
  int64_t a, b;
  split(E, 2, tid, nt, a, b);  // even bounds: each row pairs up the same way whatever the thread count
  float* logit = buf<float>(off_logit);
  gemv<WT, XT>(ptr<WT>(router_w[l]), hidden, a, b, xin, hidden, int(T), logit, E);
#pragma omp barrier
  route<WT>(logit, T, rt);
  const WT* w13p = ptr<WT>(w13[l]);
  const WT* w2p = ptr<WT>(w2[l]);
  split(minter, 16, tid, nt, a, b);
  for (const int32_t e : rt.experts) {
    const int64_t n = rt.cnt[e], r0 = rt.base[e];
    const int32_t* rows = rt.rows.data() + r0;
    const XT* X = xin + rows[0] * hidden;
    if (rows[n - 1] - rows[0] != n - 1) {  // not one run of consecutive rows: gather them
      for (int64_t i = 0; i < n; i++) std::memcpy(xg + i * hidden, xin + rows[i] * hidden, hidden * sizeof(XT));
      X = xg;
    }
    if (record_moe && tid == 0) moe_log.push_back({l, e, n});
    const WT* we = w13p + int64_t(e) * 2 * minter * hidden;
    gemv<WT, XT>(we, hidden, a, b, X, hidden, int(n), gu, 2 * minter);
    gemv<WT, XT>(we, hidden, minter + a, minter + b, X, hidden, int(n), gu, 2 * minter);
    for (int64_t i = 0; i < n; i++)
      silu_mul<WT, XT>(gu + i * 2 * minter + a, gu + i * 2 * minter + minter + a, mact + (r0 + i) * minter + a,
                       b - a);
  }
#pragma omp barrier
  split(hidden, 16, tid, nt, a, b);
  float* acc = buf<float>(off_macc);  // the experts' outputs summed per row, then onto the residual stream x
  float* tmp = buf<float>(off_tmp);
  float* x = buf<float>(off_x);
  for (int64_t t = 0; t < T; t++) std::fill(acc + t * hidden + a, acc + t * hidden + b, 0.f);
  for (const int32_t e : rt.experts) {
    const int64_t n = rt.cnt[e], r0 = rt.base[e];
    gemv<WT, XT>(w2p + int64_t(e) * hidden * minter, minter, a, b, mact + r0 * minter, minter, int(n), tmp,
                 hidden);
    for (int64_t i = 0; i < n; i++) {
      float* ar = acc + rt.rows[r0 + i] * hidden;
      const float* yr = tmp + i * hidden;
      const float wt = rnd<WT>(rt.wts[r0 + i]);
      for (int64_t c = a; c < b; c++) ar[c] = rnd<WT>(ar[c] + rnd<WT>(rnd<WT>(yr[c]) * wt));
    }
  }
  if (comm.P > 1) tp_reduce(acc, T, a, b, tid, s++, err);  // the experts' sums are already rounded
  for (int64_t t = 0; t < T; t++)
    for (int64_t c = a; c < b; c++) x[t * hidden + c] = rnd<WT>(x[t * hidden + c] + rnd<WT>(acc[t * hidden + c]));
}

// test hook: the router's top-k on given logits [T, E] (rounded to the model dtype first) -> (ids, weights)
inline std::tuple<torch::Tensor, torch::Tensor> Model::test_route(torch::Tensor logits) const {
  TORCH_CHECK(E > 0 && logits.dim() == 2 && logits.size(1) == E, "lowlat.test_route: an MoE model and [T, ", E,
              "] logits");
  auto lf = logits.to(torch::kFloat32).contiguous();
  const int64_t T = lf.size(0);
  auto ids = torch::empty({T, top_k}, torch::TensorOptions().dtype(torch::kLong));
  auto w = torch::empty({T, top_k}, torch::TensorOptions().dtype(torch::kFloat32));
  Route rt;
  for (int64_t t = 0; t < T; t++) {
    if (bf16) topk_row<bf16_t>(lf.data_ptr<float>() + t * E, rt, ids.data_ptr<int64_t>() + t * top_k,
                               w.data_ptr<float>() + t * top_k);
    else topk_row<float>(lf.data_ptr<float>() + t * E, rt, ids.data_ptr<int64_t>() + t * top_k,
                         w.data_ptr<float>() + t * top_k);
  }
  return {ids, w};
}

}  // namespace lowlat
