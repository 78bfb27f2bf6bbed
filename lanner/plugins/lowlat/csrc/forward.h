// lowlat's step: Model::run, the whole forward (embedding, every decoder layer, final norm) in one OpenMP
// parallel region, and Model::forward, which checks a step's inputs and runs it in the model's types.
#pragma once
#include "attention_split.h"
#include "gemma.h"
#include "moe.h"
#include "tp.h"

namespace lowlat {

template <typename WT, typename XT>
inline void Model::run(const int64_t* ids, const int64_t* pos, int64_t T, const std::vector<int64_t>& q_lens,
                       const std::vector<int64_t>& ctx_lens, const Tables& gbts, int64_t bs,
                       const std::vector<WT*>& kcs, const std::vector<WT*>& vcs,
                       const std::vector<std::vector<int64_t>>& gslots, const std::vector<int64_t>& lgroup,
                       const std::vector<int64_t>& row0, const std::vector<WT*>& cap_at, WT* out) {
  const int64_t B = (int64_t)q_lens.size(), nqkv = (H + 2 * Hkv) * D;
  const int64_t kv_len = *std::max_element(ctx_lens.begin(), ctx_lens.end());
  float* x = buf<float>(off_x);
  float* qkv = buf<float>(off_qkv);
  float* q = buf<float>(off_q);
  XT* ain = buf<XT>(off_ain);
  float* tmp = buf<float>(off_tmp);
  float* gu = buf<float>(off_gu);
  XT* act = buf<XT>(off_act);
  const WT* emb = reinterpret_cast<const WT*>(embed.data_ptr());
  const float* cosT = cos.data_ptr<float>();
  const float* sinT = sin.data_ptr<float>();
  const int M = int(T);
  const bool tp = comm.P > 1;
  int64_t seq_end = comm.seq;
  std::string err;
  // attention's work for full and for sliding-window layers (attention_split.h)
  const AttnPlan plan_full = plan_attention(*this, pos, row0, q_lens, ctx_lens, 0, nthreads);
  const AttnPlan plan_win = gemma ? plan_attention(*this, pos, row0, q_lens, ctx_lens, window, nthreads) : AttnPlan{};
  if ((int64_t)part_buf.size() < std::max(plan_full.floats, plan_win.floats))
    part_buf.resize(std::max(plan_full.floats, plan_win.floats));
  float* parts = part_buf.data();

#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    XT* xin = buf<XT>(off_xin + tid * xin_stride);
    thread_local std::vector<float> S, O;
    thread_local Route rt;
    // this thread's attention items: a contiguous run (a kv group split over two items stays on one core)
    const int64_t items_per_seq = items_per_sequence(B, nt);
    int64_t ia, ib;
    split(B * items_per_seq, 1, tid, nt, ia, ib);
    auto t_last = std::chrono::steady_clock::now();
    // thread 0 books the time since its last mark to phase `slot` (0 GEMV, 1 attention, 2 barrier, 3 other)
    auto mark = [&](int slot) {
      if (!profile || tid != 0) return;
      const auto now = std::chrono::steady_clock::now();
      prof[slot] += std::chrono::duration<double>(now - t_last).count();
      t_last = now;
    };
    int64_t a, b, s = comm.seq;  // s: this step's next collective
    // a projection's output columns, split over the threads (summed over the ranks under TP), onto the residual
    // stream (post_w: Gemma's post-norm)
    auto project_add = [&](const QMat& qw, const torch::Tensor& w, int64_t K, const XT* in, const float* post_w) {
      split(hidden, 16, tid, nt, a, b);
      mm<WT, XT>(qw, w, K, a, b, in, K, M, tmp, hidden, tid);
      mark(0);
      if (tp) tp_partial<WT>(tmp, T, a, b, tid, s++, err);
      add_residual<WT>(tmp, post_w, T, a, b);
      mark(3);
    };
    // embedding (under TP: this rank's vocab rows, zeros elsewhere, summed over the ranks)
    if (tp) {
      split(hidden, 16, tid, nt, a, b);
      for (int64_t t = 0; t < T; t++) {
        const int64_t row = ids[t] - vocab0;
        for (int64_t i = a; i < b; i++) tmp[t * hidden + i] = row >= 0 && row < vocab ? ldf(emb, row * hidden + i) : 0.f;
      }
      tp_reduce(tmp, T, a, b, tid, s++, err);
      for (int64_t t = 0; t < T; t++) std::memcpy(x + t * hidden + a, tmp + t * hidden + a, (b - a) * sizeof(float));
    } else {
      split(T, 1, tid, nt, a, b);
      for (int64_t t = a; t < b; t++) {
        if (q_embed.quant()) qrow(q_embed, ids[t], x + t * hidden);
        else for (int64_t i = 0; i < hidden; i++) x[t * hidden + i] = ldf(emb, ids[t] * hidden + i);
        if (gemma)  // the row in the model dtype times the rounded factor (Gemma3Model.embed_scale)
          for (int64_t i = 0; i < hidden; i++) x[t * hidden + i] = rnd<WT>(rnd<WT>(x[t * hidden + i]) * embed_scale);
      }
    }
#pragma omp barrier
    for (int64_t l = 0; l < L; l++) {
      // --- attention block: norm (every thread, private copy) -> QKV GEMV over this thread's heads + epilogue
      if (gemma) norm1p<WT, XT>(x, g_in[l].data_ptr<float>(), xin, 0, T);
      else rmsnorm<WT, XT>(x, ptr<WT>(in_norm[l]), xin, 0, T);
      const bool local = gemma && is_local[l];
      int64_t h0, h1;
      split(H + 2 * Hkv, 1, tid, nt, h0, h1);
      mark(3);
      mm<WT, XT>(q_qkv[l], qkv_w[l], hidden, h0 * D, h1 * D, xin, hidden, M, qkv, nqkv, tid);
      mark(0);
      {
        const WT* bias = has_bias ? ptr<WT>(qkv_b[l]) : nullptr;
        const WT* qn = qk_norm ? ptr<WT>(q_norm[l]) : nullptr;
        const WT* kn = qk_norm ? ptr<WT>(k_norm[l]) : nullptr;
        const float* gqn = gemma ? g_qn[l].data_ptr<float>() : nullptr;
        const float* gkn = gemma ? g_kn[l].data_ptr<float>() : nullptr;
        const float* cosL = local ? cos_local.data_ptr<float>() : cosT;
        const float* sinL = local ? sin_local.data_ptr<float>() : sinT;
        WT* kc = kcs[l];
        WT* vc = vcs[l];
        const std::vector<int64_t>& slots = gslots[lgroup[l]];
        float v[512], rot[512];
        for (int64_t t = 0; t < T; t++) {
          const float* cr = cosL + pos[t] * D;
          const float* sr = sinL + pos[t] * D;
          for (int64_t hh = h0; hh < h1; hh++) {
            const float* src = qkv + t * nqkv + hh * D;
            for (int64_t d = 0; d < D; d++) v[d] = rnd<WT>(bias ? src[d] + ldf(bias, hh * D + d) : src[d]);
            if (hh < H + Hkv) {
              if (qk_norm) {
                const WT* w = hh < H ? qn : kn;
                const float ss = sumsq(v, D);
                const float r = 1.0f / std::sqrt(ss / float(D) + float(eps));
                for (int64_t d = 0; d < D; d++) v[d] = rnd<WT>(ldf(w, d) * rnd<WT>(v[d] * r));
              } else if (gemma) {
                const float* w1 = hh < H ? gqn : gkn;
                const float r = 1.0f / std::sqrt(sumsq(v, D) / float(D) + float(eps));
                for (int64_t d = 0; d < D; d++) v[d] = rnd<WT>(v[d] * r * w1[d]);
              }
              rope_row<WT>(v, rot, cr, sr, D);
            }
            if (hh < H) {
              std::memcpy(q + t * H * D + hh * D, v, D * sizeof(float));
            } else {
              const int64_t row = slots[t] * Hkv + (hh < H + Hkv ? hh - H : hh - H - Hkv);
              WT* c = hh < H + Hkv ? kc : vc;
              if (kv_q8) {
                quantize_kv_row(v, D, reinterpret_cast<uint8_t*>(c) + row * (D / 32 * 34));
              } else {
                for (int64_t d = 0; d < D; d++) stf<WT>(c + row * D, d, v[d]);
              }
            }
          }
        }
      }
      mark(3);
#pragma omp barrier
      mark(2);
      // --- attention over the paged cache: this thread's items (sequence, run of q heads), or the step's units
      // (sequence, run of q heads, key part) taken as threads come free, then the fold of their parts
      const AttnPlan& ap = local ? plan_win : plan_full;
      const int64_t win = local ? window : 0;
      if (!ap.split) {
        for (int64_t it = ia; it < ib; it++) {
          const int64_t sb = it / items_per_seq, k = it % items_per_seq;
          attend_parts<WT, XT>(q, pos, row0[sb], q_lens[sb], ctx_lens[sb], kv_len, gbts[lgroup[l]][sb], bs, kcs[l],
                               vcs[l], item_head(k, items_per_seq), item_heads(k, items_per_seq), ain, S, O,
                               tree_[sb].empty() ? nullptr : tree_[sb].data(), win, kv_q8);
        }
      } else {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t u = 0; u < ap.units; u++) {
          int64_t sb = 0;
          while (sb + 1 < B && ap.unit0[sb + 1] <= u) sb++;
          const int64_t v = u - ap.unit0[sb], k = v / ap.np[sb], part = v % ap.np[sb], p0 = ap.pa[sb] + part;
          attend<WT, XT>(q, pos, row0[sb], q_lens[sb], ctx_lens[sb], kv_len, gbts[lgroup[l]][sb], bs, kcs[l], vcs[l],
                         item_head(k, ap.items), item_heads(k, ap.items), ain, S, O,
                         tree_[sb].empty() ? nullptr : tree_[sb].data(), win, kv_q8,
                         KeyPart{p0 * kAttnPart, (p0 + 1) * kAttnPart,
                                 part_states(*this, ap, parts, sb, q_lens[sb], k, part)});
        }
        mark(1);
#pragma omp barrier
        mark(2);
        split(T * H, 1, tid, nt, a, b);
        fold_rows<WT, XT>(*this, ap, parts, row0, q_lens, a, b, ain);
      }
      mark(1);
#pragma omp barrier
      mark(2);
      // --- o_proj + residual
      project_add(q_o[l], o_w[l], H * D, ain, gemma ? g_pa[l].data_ptr<float>() : nullptr);
#pragma omp barrier
      mark(2);
      // --- MLP: norm (private) -> gate/up rows [a, b) of both halves -> SiLU(gate) * up
      if (gemma) norm1p<WT, XT>(x, g_pf[l].data_ptr<float>(), xin, 0, T);
      else rmsnorm<WT, XT>(x, ptr<WT>(post_norm[l]), xin, 0, T);
      if (is_moe[l]) {
        moe_ffn<WT, XT>(l, tid, nt, xin, T, rt, s, err);
#pragma omp barrier
        if (cap_at[l] != nullptr) {
          split(T, 1, tid, nt, a, b);
          for (int64_t t = a; t < b; t++)
            for (int64_t i = 0; i < hidden; i++) stf<WT>(cap_at[l], t * hidden + i, x[t * hidden + i]);
        }
        continue;
      }
      split(inter, 16, tid, nt, a, b);
      mark(3);
      mm<WT, XT>(q_gu[l], gu_w[l], hidden, a, b, xin, hidden, M, gu, 2 * inter, tid);
      mm<WT, XT>(q_gu[l], gu_w[l], hidden, inter + a, inter + b, xin, hidden, M, gu, 2 * inter, tid, false);
      mark(0);
      for (int64_t t = 0; t < T; t++)
        (gemma ? gelu_mul<WT, XT> : silu_mul<WT, XT>)(gu + t * 2 * inter + a, gu + t * 2 * inter + inter + a,
                                                     act + t * inter + a, b - a);
      mark(3);
#pragma omp barrier
      mark(2);
      // --- down + residual
      project_add(q_down[l], down_w[l], inter, act, gemma ? g_po[l].data_ptr<float>() : nullptr);
#pragma omp barrier
      mark(2);
      if (cap_at[l] != nullptr) {
        split(T, 1, tid, nt, a, b);
        for (int64_t t = a; t < b; t++)
          for (int64_t i = 0; i < hidden; i++) stf<WT>(cap_at[l], t * hidden + i, x[t * hidden + i]);
      }
    }
    split(T, 1, tid, nt, a, b);
    if (gemma) norm1p<WT, WT>(x, g_final.data_ptr<float>(), out, a, b);
    else rmsnorm<WT, WT>(x, ptr<WT>(final_norm), out, a, b);
    mark(3);
    if (tid == 0) seq_end = s;
  }
  if (profile) prof_calls++;
  comm.seq = seq_end;
  TORCH_CHECK(err.empty(), "lowlat: the tensor-parallel all-reduce failed: ", err);
}

// forward(input_ids, positions, kv (per layer (k_cache, v_cache)), q_lens, ctx_lens, block_tables, block_size,
// capture_layers, tree, group_tables, layer_group) -> (hidden [T, hidden], [captured [T, hidden]]). tree: per
// sequence, empty (causal rows at consecutive positions) or a draft tree's rows as bit masks of the rows each
// reads (see attend); its rows take consecutive slots, their positions are the first row's plus their depth.
// group_tables, layer_group: a grouped KV layout (lanner.kvcache.layout): the block tables of groups 1.. (per
// sequence; -1: a block let go, allowed only before the window of a group of local layers) and each layer's
// group; both empty: every layer uses block_tables
inline std::tuple<torch::Tensor, std::vector<torch::Tensor>> Model::forward(
                  torch::Tensor ids, torch::Tensor positions, std::vector<std::vector<torch::Tensor>> kv,
                  std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens, std::vector<std::vector<int64_t>> bts,
                  int64_t bs, std::vector<int64_t> capture, std::vector<std::vector<int64_t>> tree, Tables group_tables,
                  std::vector<int64_t> layer_group) {
  g_invariant = invariant;
  const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "lowlat: input_ids must be a contiguous CPU int64 vector");
  TORCH_CHECK(positions.sizes() == ids.sizes() && positions.scalar_type() == torch::kLong &&
                  positions.is_contiguous(), "lowlat: positions must match input_ids (int64)");
  const int64_t T = ids.size(0), B = (int64_t)q_lens.size();
  TORCH_CHECK(T >= 1 && T <= max_rows, "lowlat: ", T, " rows, this build handles 1..", max_rows);
  TORCH_CHECK(B >= 1 && (int64_t)ctx_lens.size() == B && (int64_t)bts.size() == B && bs >= 1,
              "lowlat: q_lens, ctx_lens and block_tables must have one entry per sequence");
  TORCH_CHECK((int64_t)kv.size() == L, "lowlat: kv_caches has ", kv.size(), " layers, the model ", L);
  Tables gbts;
  gbts.push_back(std::move(bts));
  for (auto& g : group_tables) {
    TORCH_CHECK((int64_t)g.size() == B, "lowlat: group_tables must have one table per sequence");
    gbts.push_back(std::move(g));
  }
  const int64_t G = (int64_t)gbts.size();
  if (layer_group.empty()) layer_group.assign(L, 0);
  TORCH_CHECK((int64_t)layer_group.size() == L, "lowlat: layer_group must have one entry per layer");
  std::vector<char> windowed(G, 1);  // a group of local layers only: it reads the window alone
  for (int64_t l = 0; l < L; l++) {
    TORCH_CHECK(layer_group[l] >= 0 && layer_group[l] < G, "lowlat: layer ", l, ": group ", layer_group[l],
                " without tables");
    if (!(gemma && is_local[l])) windowed[layer_group[l]] = 0;
  }
  std::vector<int64_t> row0(B);
  std::vector<std::vector<int64_t>> gslots(G, std::vector<int64_t>(T));
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  int64_t nslots = -1;
  std::vector<void*> kcs(L), vcs(L);
  // the model dtype, or Q8_0 rows (lanner/kvcache/q8.py) as uint8
  kv_q8 = L > 0 && kv[0].size() == 2 && kv[0][0].scalar_type() == torch::kUInt8;
  TORCH_CHECK(!kv_q8 || D % 32 == 0, "lowlat: a q8 KV cache needs head_dim a multiple of 32, not ", D);
  const auto cdt = kv_q8 ? torch::kUInt8 : wdt;
  const int64_t row = kv_q8 ? D / 32 * 34 : D;
  for (int64_t l = 0; l < L; l++) {
    TORCH_CHECK(kv[l].size() == 2, "lowlat: kv_caches[", l, "] must be a (k_cache, v_cache) pair");
    for (int i = 0; i < 2; i++) {
      const auto& c = kv[l][i];
      TORCH_CHECK(c.dim() == 3 && c.size(1) == Hkv && c.size(2) == row && c.is_contiguous() &&
                      c.scalar_type() == cdt && c.device().is_cpu(),
                  "lowlat: kv cache of layer ", l, " must be a contiguous CPU ", cdt, " tensor [slots, ", Hkv, ", ",
                  row, "], got ", c.scalar_type(), " ", c.sizes());
      if (nslots < 0) nslots = c.size(0);
      TORCH_CHECK(c.size(0) == nslots, "lowlat: kv caches differ in slot count");
    }
    kcs[l] = kv[l][0].data_ptr();
    vcs[l] = kv[l][1].data_ptr();
  }
  TORCH_CHECK(!comm.aborted, "lowlat: an earlier tensor-parallel step was aborted; this kernel is retired");
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < vocab_total, "lowlat: token id ", idp[t], " out of range");
  if (tree.empty()) tree.resize(B);
  TORCH_CHECK((int64_t)tree.size() == B, "lowlat: tree must be empty or have one entry per sequence");
  int64_t t = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t ql = q_lens[b], cl = ctx_lens[b];
    TORCH_CHECK(ql >= 1 && cl >= ql && cl <= max_pos, "lowlat: sequence ", b, ": q_len ", ql, ", ctx_len ", cl);
    for (int64_t g = 0; g < G; g++) {
      const auto& bt = gbts[g][b];
      TORCH_CHECK((int64_t)bt.size() * bs >= cl, "lowlat: sequence ", b, ": block table too short");
      // the first block a row of this step can read (a tree row's position is at least the step's first slot)
      const int64_t first = windowed[g] ? std::max<int64_t>(0, cl - ql - window + 1) / bs : 0;
      for (int64_t blk = first; blk < (cl + bs - 1) / bs; blk++)
        TORCH_CHECK(bt[blk] >= 0 && (bt[blk] + 1) * bs <= nslots, "lowlat: sequence ", b, ": block ", bt[blk],
                    " outside the cache");
    }
    row0[b] = t;
    const bool is_tree = !tree[b].empty();
    TORCH_CHECK(!is_tree || ((int64_t)tree[b].size() == ql && ql <= 63),
                "lowlat: sequence ", b, ": a tree needs one mask per row, at most 63 rows");
    for (int64_t i = 0; i < ql; i++, t++) {
      const int64_t p = cl - ql + i;  // the row's slot position
      TORCH_CHECK(t < T && (is_tree ? pos[t] >= cl - ql && pos[t] <= p : pos[t] == p),
                  "lowlat: positions do not match q_lens/ctx_lens");
      TORCH_CHECK(!is_tree || ((tree[b][i] >> i) & 1 && tree[b][i] >> (i + 1) == 0),
                  "lowlat: a tree row reads itself and earlier rows only");
      for (int64_t g = 0; g < G; g++) gslots[g][t] = gbts[g][b][p / bs] * bs + p % bs;
    }
  }
  TORCH_CHECK(t == T, "lowlat: sum(q_lens) = ", t, " but ", T, " input ids");
  tree_ = std::move(tree);
  moe_log.clear();
  auto opts = torch::TensorOptions().dtype(wdt);
  torch::Tensor out = torch::empty({T, hidden}, opts);
  std::vector<torch::Tensor> captured;
  std::vector<void*> cap_at(L, nullptr);
  for (int64_t c : capture) {
    TORCH_CHECK(c >= 0 && c < L, "lowlat: capture layer ", c, " out of range");
    if (cap_at[c] == nullptr) {
      captured.push_back(torch::empty({T, hidden}, opts));
      cap_at[c] = captured.back().data_ptr();
    } else {  // the same layer twice: share one tensor
      for (auto& ct : captured) if (ct.data_ptr() == cap_at[c]) { captured.push_back(ct); break; }
    }
  }
  if (bf16) {
    auto cv = [](const std::vector<void*>& v) {
      std::vector<bf16_t*> r(v.size());
      for (size_t i = 0; i < v.size(); i++) r[i] = reinterpret_cast<bf16_t*>(v[i]);
      return r;
    };
    auto o = reinterpret_cast<bf16_t*>(out.data_ptr());
    if (dot) {
#ifdef __AVX512BF16__
      run<bf16_t, bf16_t>(idp, pos, T, q_lens, ctx_lens, gbts, bs, cv(kcs), cv(vcs), gslots, layer_group, row0,
                          cv(cap_at), o);
#endif
    } else {
      run<bf16_t, float>(idp, pos, T, q_lens, ctx_lens, gbts, bs, cv(kcs), cv(vcs), gslots, layer_group, row0,
                         cv(cap_at), o);
    }
  } else {
    auto cv = [](const std::vector<void*>& v) {
      std::vector<float*> r(v.size());
      for (size_t i = 0; i < v.size(); i++) r[i] = reinterpret_cast<float*>(v[i]);
      return r;
    };
    run<float, float>(idp, pos, T, q_lens, ctx_lens, gbts, bs, cv(kcs), cv(vcs), gslots, layer_group, row0,
                      cv(cap_at), out.data_ptr<float>());
  }
  return {out, captured};
}

}  // namespace lowlat
