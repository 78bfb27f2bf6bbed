// lowlat's EAGLE-style draft head (Head): its whole greedy draft chain in one call.
#pragma once
#include "attention.h"

namespace lowlat {

// The EAGLE-style draft head's greedy chain in one call: k steps of (target embedding of the last draft token,
// two norms, QKV GEMV + RoPE + KV write, attention over the head's own paged cache, o_proj + residual, MLP,
// final norm, LM head over the draft vocabulary, argmax, draft -> target id) with no Python between steps. A
// Model with no layers lends its norm, attention, SiLU*up and scratch; the arithmetic and rounding are the
// plugin's Python head path (DraftHead.forward), so the tokens are the same.
struct Head {
  Model m;
  torch::Tensor in_norm, hid_norm, qkv_w, o_w, post_norm, gu_w, down_w, lm_w, d2t;
  int64_t vd;

  // w: the head's tensors by name (plugin.py's pack.head_weights): embed_tokens (the target's), input_layernorm,
  // hidden_norm, qkv_proj, o_proj, post_attention_layernorm, gate_up_proj, down_proj, norm, lm_head, d2t,
  // rope_cos, rope_sin; opt: as a Model's
  Head(const Args& w, const Args& opt)
      : m(w.subset({"embed_tokens", "norm", "rope_cos", "rope_sin"}), opt), in_norm(w.tensor("input_layernorm")),
        hid_norm(w.tensor("hidden_norm")), qkv_w(w.tensor("qkv_proj")), o_w(w.tensor("o_proj")),
        post_norm(w.tensor("post_attention_layernorm")), gu_w(w.tensor("gate_up_proj")),
        down_w(w.tensor("down_proj")), lm_w(w.tensor("lm_head")), d2t(w.tensor("d2t")) {
    const int64_t hidden = m.hidden, inter = m.inter, H = m.H, Hkv = m.Hkv, D = m.D;
    const bool bf16 = m.bf16;
    const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
    auto chk = [&](const torch::Tensor& t, std::vector<int64_t> shape, const char* what) {
      TORCH_CHECK(t.scalar_type() == wdt && t.is_contiguous() && t.sizes() == shape, "lowlat head: ", what,
                  " must be contiguous ", wdt, " ", c10::IntArrayRef(shape), ", got ", t.scalar_type(), " ",
                  t.sizes());
    };
    vd = lm_w.size(0);
    chk(in_norm, {hidden}, "input_layernorm");
    chk(hid_norm, {hidden}, "hidden_norm");
    chk(qkv_w, {(H + 2 * Hkv) * D, 2 * hidden}, "qkv_proj");
    chk(o_w, {hidden, H * D}, "o_proj");
    chk(post_norm, {hidden}, "post_attention_layernorm");
    chk(gu_w, {2 * inter, hidden}, "gate_up_proj");
    chk(down_w, {hidden, inter}, "down_proj");
    chk(lm_w, {vd, hidden}, "lm_head");
    TORCH_CHECK(d2t.scalar_type() == torch::kLong && d2t.is_contiguous() && d2t.numel() == vd,
                "lowlat head: d2t must be int64 [draft vocab]");
  }

  template <typename WT, typename XT>
  void run(const WT* g0, const int64_t* tok0, const int64_t* pos0, int64_t B, int64_t steps,
           const std::vector<std::vector<int64_t>>& bts, int64_t bs, WT* kc, WT* vc, int64_t* out) {
    const int64_t h = m.hidden, H = m.H, Hkv = m.Hkv, D = m.D, inter = m.inter;
    const int64_t nqkv = (H + 2 * Hkv) * D;
    const int M = int(B);
    float* x = m.buf<float>(m.off_x);  // the chained hidden state, [B, h], values in the model dtype
    float* qkv = m.buf<float>(m.off_qkv);
    float* q = m.buf<float>(m.off_q);
    XT* ain = m.buf<XT>(m.off_ain);
    float* tmp = m.buf<float>(m.off_tmp);
    float* gu = m.buf<float>(m.off_gu);
    XT* act = m.buf<XT>(m.off_act);
    std::vector<XT> xin2(B * 2 * h), xn(B * h);
    std::vector<float> e(B * h), logits(B * vd);
    std::vector<int64_t> tok(tok0, tok0 + B), pos(pos0, pos0 + B), ones(B, 1), ctx(B), row0(B);
    for (int64_t b = 0; b < B; b++) row0[b] = b;
    for (int64_t i = 0; i < B * h; i++) x[i] = ldf(g0, i);
    const WT* emb = reinterpret_cast<const WT*>(m.embed.data_ptr());
    const int64_t* d2tp = d2t.data_ptr<int64_t>();
    const float* cosT = m.cos.data_ptr<float>();
    const float* sinT = m.sin.data_ptr<float>();
#pragma omp parallel num_threads(m.nthreads)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      thread_local std::vector<float> S, O;
      int64_t a, b_;
      for (int64_t step = 0; step < steps; step++) {
        // norms of [embedding(token), hidden] into one [B, 2h] GEMV input
        if (tid == 0) {
          for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < h; i++) e[b * h + i] = ldf(emb, tok[b] * h + i);
            m.rmsnorm<WT, XT>(e.data() + b * h, ptr<WT>(in_norm), xin2.data() + b * 2 * h, 0, 1);
            m.rmsnorm<WT, XT>(x + b * h, ptr<WT>(hid_norm), xin2.data() + b * 2 * h + h, 0, 1);
            ctx[b] = pos[b] + 1;
          }
        }
#pragma omp barrier
        int64_t h0, h1;
        split(H + 2 * Hkv, 1, tid, nt, h0, h1);
        gemv<WT, XT>(ptr<WT>(qkv_w), 2 * h, h0 * D, h1 * D, xin2.data(), 2 * h, M, qkv, nqkv);
        {
          float v[512], rot[512];
          for (int64_t t = 0; t < B; t++) {
            const float* cr = cosT + pos[t] * D;
            const float* sr = sinT + pos[t] * D;
            const int64_t slot = bts[t][pos[t] / bs] * bs + pos[t] % bs;
            for (int64_t hh = h0; hh < h1; hh++) {
              const float* src = qkv + t * nqkv + hh * D;
              for (int64_t d = 0; d < D; d++) v[d] = rnd<WT>(src[d]);
              if (hh < H + Hkv) {
                rope_row<WT>(v, rot, cr, sr, D);
              }
              if (hh < H) {
                std::memcpy(q + t * H * D + hh * D, v, D * sizeof(float));
              } else {
                WT* dst = (hh < H + Hkv ? kc : vc) + (slot * Hkv + (hh < H + Hkv ? hh - H : hh - H - Hkv)) * D;
                for (int64_t d = 0; d < D; d++) stf<WT>(dst, d, v[d]);
              }
            }
          }
        }
#pragma omp barrier
        const int64_t kv_len = *std::max_element(ctx.begin(), ctx.end());
        for (int64_t it = tid; it < B * H; it += nt)
          m.attend<WT, XT>(q, pos.data(), row0[it / H], 1, ctx[it / H], kv_len, bts[it / H], bs, kc, vc, it % H, 1,
                           ain, S, O);
#pragma omp barrier
        split(h, 16, tid, nt, a, b_);
        gemv<WT, XT>(ptr<WT>(o_w), H * D, a, b_, ain, H * D, M, tmp, h);
        for (int64_t t = 0; t < B; t++)
          for (int64_t n = a; n < b_; n++) x[t * h + n] = rnd<WT>(x[t * h + n] + rnd<WT>(tmp[t * h + n]));
#pragma omp barrier
        XT* xin = reinterpret_cast<XT*>(xn.data());
        if (tid == 0) m.rmsnorm<WT, XT>(x, ptr<WT>(post_norm), xin, 0, B);
#pragma omp barrier
        split(inter, 16, tid, nt, a, b_);
        gemv<WT, XT>(ptr<WT>(gu_w), h, a, b_, xin, h, M, gu, 2 * inter);
        gemv<WT, XT>(ptr<WT>(gu_w), h, inter + a, inter + b_, xin, h, M, gu, 2 * inter);
        for (int64_t t = 0; t < B; t++)
          Model::silu_mul<WT, XT>(gu + t * 2 * inter + a, gu + t * 2 * inter + inter + a, act + t * inter + a, b_ - a);
#pragma omp barrier
        split(h, 16, tid, nt, a, b_);
        gemv<WT, XT>(ptr<WT>(down_w), inter, a, b_, act, inter, M, tmp, h);
        for (int64_t t = 0; t < B; t++)
          for (int64_t n = a; n < b_; n++) x[t * h + n] = rnd<WT>(x[t * h + n] + rnd<WT>(tmp[t * h + n]));
#pragma omp barrier
        if (tid == 0) m.rmsnorm<WT, XT>(x, ptr<WT>(m.final_norm), xin, 0, B);
#pragma omp barrier
        split(vd, 16, tid, nt, a, b_);
        gemv<WT, XT>(ptr<WT>(lm_w), h, a, b_, xin, h, M, logits.data(), vd);
#pragma omp barrier
        if (tid == 0) {
          for (int64_t t = 0; t < B; t++) {  // argmax of the model-dtype logits, first index on ties (torch's)
            const float* lr = logits.data() + t * vd;
            int64_t best = 0;
            float bv = rnd<WT>(lr[0]);
            for (int64_t i = 1; i < vd; i++) {
              const float v = rnd<WT>(lr[i]);
              if (v > bv) { bv = v; best = i; }
            }
            tok[t] = d2tp[best];
            out[t * steps + step] = tok[t];
            pos[t] += 1;
          }
        }
#pragma omp barrier
      }
    }
  }

  // chain(hidden [B, h] (the head's output at the last extended position), tokens [B] (the first draft token),
  // positions [B] (where that token enters), steps, k_cache, v_cache [slots, Hkv, D], block_tables, block_size)
  // -> int64 [B, steps]: the next `steps` greedy draft tokens (target ids)
  torch::Tensor chain(torch::Tensor g, torch::Tensor tokens, torch::Tensor positions, int64_t steps, torch::Tensor kc,
                      torch::Tensor vc, std::vector<std::vector<int64_t>> bts, int64_t bs) {
    const auto wdt = m.bf16 ? torch::kBFloat16 : torch::kFloat32;
    const int64_t B = g.size(0);
    TORCH_CHECK(g.dim() == 2 && g.size(1) == m.hidden && g.scalar_type() == wdt && g.is_contiguous() && B >= 1 &&
                    B <= m.max_rows, "lowlat head: hidden must be contiguous [B <= ", m.max_rows, ", ", m.hidden, "]");
    TORCH_CHECK(tokens.numel() == B && positions.numel() == B && tokens.scalar_type() == torch::kLong &&
                    positions.scalar_type() == torch::kLong && tokens.is_contiguous() && positions.is_contiguous() &&
                    (int64_t)bts.size() == B && steps >= 0, "lowlat head: tokens/positions/block tables per row");
    TORCH_CHECK(kc.dim() == 3 && kc.size(1) == m.Hkv && kc.size(2) == m.D && kc.scalar_type() == wdt &&
                    vc.sizes() == kc.sizes() && kc.is_contiguous() && vc.is_contiguous(),
                "lowlat head: kv caches must be contiguous [slots, ", m.Hkv, ", ", m.D, "]");
    const int64_t* tp = tokens.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) {
      TORCH_CHECK(tp[b] >= 0 && tp[b] < m.vocab, "lowlat head: token id out of range");
      TORCH_CHECK(pp[b] >= 0 && pp[b] + steps <= m.max_pos && (int64_t)bts[b].size() * bs >= pp[b] + steps,
                  "lowlat head: row ", b, " does not fit its block table / rotary table");
      for (int64_t j = 0; j < (pp[b] + steps + bs - 1) / bs; j++)
        TORCH_CHECK(bts[b][j] >= 0 && (bts[b][j] + 1) * bs <= kc.size(0), "lowlat head: block outside the cache");
    }
    auto out = torch::empty({B, steps}, torch::TensorOptions().dtype(torch::kLong));
    if (steps == 0) return out;
    int64_t* op = out.data_ptr<int64_t>();
    pybind11::gil_scoped_release nogil;
    if (m.bf16) {
      auto gp = reinterpret_cast<const bf16_t*>(g.data_ptr());
      auto k = reinterpret_cast<bf16_t*>(kc.data_ptr());
      auto v = reinterpret_cast<bf16_t*>(vc.data_ptr());
      if (m.dot) {
#ifdef __AVX512BF16__
        run<bf16_t, bf16_t>(gp, tp, pp, B, steps, bts, bs, k, v, op);
#endif
      } else {
        run<bf16_t, float>(gp, tp, pp, B, steps, bts, bs, k, v, op);
      }
    } else {
      run<float, float>(g.data_ptr<float>(), tp, pp, B, steps, bts, bs, kc.data_ptr<float>(), vc.data_ptr<float>(),
                        op);
    }
    return out;
  }
};

}  // namespace lowlat
