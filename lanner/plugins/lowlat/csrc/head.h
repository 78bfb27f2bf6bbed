// lowlat's EAGLE-style draft head (Head): its whole greedy draft chain in one call.
#pragma once
#include "attention.h"

namespace lowlat {

// The EAGLE-style draft head's greedy drafting in one call per engine step: the draft-extend over the verified
// tokens (propose) and then k steps of (target embedding of the last draft token,
// two norms, QKV GEMV + RoPE + KV write, attention over the head's own paged cache, o_proj + residual, MLP,
// final norm, LM head over the draft vocabulary, argmax, draft -> target id) with no Python between steps. A
// Model with no layers lends its norm, attention, SiLU*up and scratch. With dense matrices the arithmetic and
// rounding are the plugin's Python head path (DraftHead.forward), so the tokens are the same; after set_quant the
// matrices are Q8_0 blocks (drafts differ within their error; verification keeps the output lossless).
struct Head {
  Model m;
  torch::Tensor fc_w, in_norm, hid_norm, qkv_w, o_w, post_norm, gu_w, down_w, lm_w, d2t;
  QMat q_fc, q_qkv, q_o, q_gu, q_down, q_lm;  // set_quant: the matrices in 8-bit blocks (else the dense ones run)
  int64_t vd, kf;

  // w: the head's tensors by name (plugin.py's pack.head_weights): embed_tokens (the target's), fc, input_layernorm,
  // hidden_norm, qkv_proj, o_proj, post_attention_layernorm, gate_up_proj, down_proj, norm, lm_head, d2t,
  // rope_cos, rope_sin; opt: as a Model's
  Head(const Args& w, const Args& opt)
      : m(w.subset({"embed_tokens", "norm", "rope_cos", "rope_sin"}), opt), fc_w(w.tensor("fc")),
        in_norm(w.tensor("input_layernorm")),
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
    kf = fc_w.size(1);
    chk(fc_w, {hidden, kf}, "fc");
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

  // The six matrices (fc, qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) as stored-type blocks (Model's
  // make_qmat tensors, e.g. Q8_0 as s8) with activations in mode act_mode: half the bytes of bf16 per draft step,
  // which come from DRAM on the first step after the target's (tools/draft_cost.py)
  void set_quant(std::vector<std::vector<torch::Tensor>> ws, int64_t act_mode) {
    TORCH_CHECK(ws.size() == 6, "lowlat head: set_quant takes fc, qkv_proj, o_proj, gate_up_proj, down_proj, lm_head");
    TORCH_CHECK(!m.dot, "lowlat head: stored-type weights take float activations (no bf16 dot products)");
    TORCH_CHECK(act_mode >= kActFloat && act_mode <= kActQ16, "lowlat head: act must be 0, 1 or 2");
    const int64_t h = m.hidden, nqkv = (m.H + 2 * m.Hkv) * m.D;
    q_fc = m.make_qmat(ws[0], h, kf, "fc");
    q_qkv = m.make_qmat(ws[1], nqkv, 2 * h, "qkv_proj");
    q_o = m.make_qmat(ws[2], h, m.H * m.D, "o_proj");
    q_gu = m.make_qmat(ws[3], 2 * m.inter, h, "gate_up_proj");
    q_down = m.make_qmat(ws[4], h, m.inter, "down_proj");
    q_lm = m.make_qmat(ws[5], vd, h, "lm_head");
    int64_t nbp_max = 0;
    for (const QMat* w : {&q_fc, &q_qkv, &q_o, &q_gu, &q_down, &q_lm}) {
      TORCH_CHECK(w->quant(), "lowlat head: set_quant needs all six matrices");
      nbp_max = std::max(nbp_max, w->nbp());
    }
    m.act = int(act_mode);
    m.reserve_q8(nbp_max);
  }

  // rows [n0, n1) of a matrix against M rows of X: its 8-bit blocks after set_quant (in pieces of max_rows rows,
  // the quantized-row buffer's size), else the dense GEMV
  template <typename WT, typename XT>
  void mm(const QMat& q, const torch::Tensor& w, int64_t K, int64_t n0, int64_t n1, const XT* X, int64_t ldx,
          int64_t M, float* out, int64_t ldo, int tid) const {
    if (!q.quant()) return gemv<WT, XT>(ptr<WT>(w), K, n0, n1, X, ldx, int(M), out, ldo);
    for (int64_t m0 = 0; m0 < M; m0 += m.max_rows)
      m.mm<WT, XT>(q, w, K, n0, n1, X + m0 * ldx, ldx, int(std::min(m.max_rows, M - m0)), out + m0 * ldo, ldo, tid);
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
        mm<WT, XT>(q_qkv, qkv_w, 2 * h, h0 * D, h1 * D, xin2.data(), 2 * h, M, qkv, nqkv, tid);
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
          m.attend_parts<WT, XT>(q, pos.data(), row0[it / H], 1, ctx[it / H], kv_len, bts[it / H], bs, kc, vc,
                                 it % H, 1, ain, S, O);
#pragma omp barrier
        split(h, 16, tid, nt, a, b_);
        mm<WT, XT>(q_o, o_w, H * D, a, b_, ain, H * D, M, tmp, h, tid);
        for (int64_t t = 0; t < B; t++)
          for (int64_t n = a; n < b_; n++) x[t * h + n] = rnd<WT>(x[t * h + n] + rnd<WT>(tmp[t * h + n]));
#pragma omp barrier
        XT* xin = reinterpret_cast<XT*>(xn.data());
        if (tid == 0) m.rmsnorm<WT, XT>(x, ptr<WT>(post_norm), xin, 0, B);
#pragma omp barrier
        split(inter, 16, tid, nt, a, b_);
        mm<WT, XT>(q_gu, gu_w, h, a, b_, xin, h, M, gu, 2 * inter, tid);
        mm<WT, XT>(q_gu, gu_w, h, inter + a, inter + b_, xin, h, M, gu, 2 * inter, tid);
        for (int64_t t = 0; t < B; t++)
          Model::silu_mul<WT, XT>(gu + t * 2 * inter + a, gu + t * 2 * inter + inter + a, act + t * inter + a, b_ - a);
#pragma omp barrier
        split(h, 16, tid, nt, a, b_);
        mm<WT, XT>(q_down, down_w, inter, a, b_, act, inter, M, tmp, h, tid);
        for (int64_t t = 0; t < B; t++)
          for (int64_t n = a; n < b_; n++) x[t * h + n] = rnd<WT>(x[t * h + n] + rnd<WT>(tmp[t * h + n]));
#pragma omp barrier
        if (tid == 0) m.rmsnorm<WT, XT>(x, ptr<WT>(m.final_norm), xin, 0, B);
#pragma omp barrier
        split(vd, 16, tid, nt, a, b_);
        mm<WT, XT>(q_lm, lm_w, h, a, b_, xin, h, M, logits.data(), vd, tid);
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

  // The draft-extend's rows before each sequence's last one: fc(features) -> the two norms -> the K / V rows of
  // qkv_proj -> RoPE on K -> the head's cache. Their q, attention and everything after are never read (only a
  // sequence's last row drafts), so they are skipped. The last rows' fused hidden goes to xl [B, h] (model dtype):
  // run() takes them as a chain step's input. rows_of[t] is row t's sequence, last[b] sequence b's last row.
  template <typename WT, typename XT>
  void extend(const WT* f, const int64_t* tok, const int64_t* pos, int64_t T, const std::vector<int64_t>& rows_of,
              const std::vector<int64_t>& last, const std::vector<std::vector<int64_t>>& bts, int64_t bs, WT* kc,
              WT* vc, WT* xl) {
    const int64_t h = m.hidden, H = m.H, Hkv = m.Hkv, D = m.D, nqkv = (H + 2 * Hkv) * D, B = int64_t(last.size());
    std::vector<int64_t> early;  // the rows that only write K / V
    for (int64_t t = 0, b = 0; t < T; t++) {
      if (b < B && t == last[b]) b++;
      else early.push_back(t);
    }
    const int64_t n = int64_t(early.size());
    std::vector<XT> fin;  // the features as GEMV input (bf16 weights with float activations: widened)
    const XT* fx;
    if constexpr (std::is_same<WT, XT>::value) {
      fx = f;
    } else {
      fin.resize(T * kf);
      for (int64_t i = 0; i < T * kf; i++) fin[i] = ldf(f, i);
      fx = fin.data();
    }
    std::vector<float> hid(T * h), e(n * h), kv(n * nqkv);
    std::vector<XT> xin2(n * 2 * h);
    const WT* emb = reinterpret_cast<const WT*>(m.embed.data_ptr());
    const float* cosT = m.cos.data_ptr<float>();
    const float* sinT = m.sin.data_ptr<float>();
#pragma omp parallel num_threads(m.nthreads)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      int64_t a, b_;
      split(h, 16, tid, nt, a, b_);
      mm<WT, XT>(q_fc, fc_w, kf, a, b_, fx, kf, T, hid.data(), h, tid);
      for (int64_t t = 0; t < T; t++)
        for (int64_t i = a; i < b_; i++) hid[t * h + i] = rnd<WT>(hid[t * h + i]);
#pragma omp barrier
      split(n, 1, tid, nt, a, b_);
      for (int64_t r = a; r < b_; r++) {
        const int64_t t = early[r];
        for (int64_t i = 0; i < h; i++) e[r * h + i] = ldf(emb, tok[t] * h + i);
        m.rmsnorm<WT, XT>(e.data() + r * h, ptr<WT>(in_norm), xin2.data() + r * 2 * h, 0, 1);
        m.rmsnorm<WT, XT>(hid.data() + t * h, ptr<WT>(hid_norm), xin2.data() + r * 2 * h + h, 0, 1);
      }
#pragma omp barrier
      int64_t h0, h1;
      split(2 * Hkv, 1, tid, nt, h0, h1);
      h0 += H;
      h1 += H;
      if (n > 0) mm<WT, XT>(q_qkv, qkv_w, 2 * h, h0 * D, h1 * D, xin2.data(), 2 * h, n, kv.data(), nqkv, tid);
      float v[512], rot[512];
      for (int64_t r = 0; r < n; r++) {
        const int64_t t = early[r], p = pos[t];
        const int64_t slot = bts[rows_of[t]][p / bs] * bs + p % bs;
        for (int64_t hh = h0; hh < h1; hh++) {
          const float* src = kv.data() + r * nqkv + hh * D;
          for (int64_t d = 0; d < D; d++) v[d] = rnd<WT>(src[d]);
          if (hh < H + Hkv) rope_row<WT>(v, rot, cosT + p * D, sinT + p * D, D);
          WT* dst = (hh < H + Hkv ? kc : vc) + (slot * Hkv + (hh < H + Hkv ? hh - H : hh - H - Hkv)) * D;
          for (int64_t d = 0; d < D; d++) stf<WT>(dst, d, v[d]);
        }
      }
    }
    for (int64_t b = 0; b < B; b++)
      for (int64_t i = 0; i < h; i++) stf<WT>(xl, b * h + i, hid[last[b] * h + i]);
  }

  // propose(features [T, kf] (the target's, per row), tokens [T], positions [T] (row t: (features at p, token
  // p + 1) at position p), q_lens [B] (rows per sequence, in order), steps, k_cache, v_cache, block_tables,
  // block_size) -> int64 [B, steps]: each sequence's next `steps` greedy draft tokens (target ids), the first from
  // its last row. The draft-extend and the chain in one call: the tokens of DraftHead's extend (the head's
  // arithmetic with lowlat's GEMV) followed by chain().
  torch::Tensor propose(torch::Tensor f, torch::Tensor tokens, torch::Tensor positions, std::vector<int64_t> q_lens,
                        int64_t steps, torch::Tensor kc, torch::Tensor vc, std::vector<std::vector<int64_t>> bts,
                        int64_t bs) {
    const auto wdt = m.bf16 ? torch::kBFloat16 : torch::kFloat32;
    const int64_t T = f.size(0), B = int64_t(q_lens.size());
    TORCH_CHECK(f.dim() == 2 && f.size(1) == kf && f.scalar_type() == wdt && f.is_contiguous() && T >= 1,
                "lowlat head: features must be contiguous [T, ", kf, "] ", wdt);
    TORCH_CHECK(tokens.numel() == T && positions.numel() == T && tokens.scalar_type() == torch::kLong &&
                    positions.scalar_type() == torch::kLong && tokens.is_contiguous() && positions.is_contiguous(),
                "lowlat head: tokens and positions must be int64 [T]");
    TORCH_CHECK(B >= 1 && B <= m.max_rows && (int64_t)bts.size() == B && steps >= 1,
                "lowlat head: 1..", m.max_rows, " sequences with a block table each, steps >= 1");
    check_cache(kc, vc);
    const int64_t* tp = tokens.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    std::vector<int64_t> rows_of(T), last(B);
    for (int64_t b = 0, t = 0; b < B; b++) {
      TORCH_CHECK(q_lens[b] >= 1 && t + q_lens[b] <= T, "lowlat head: q_lens must be >= 1 and sum to T");
      for (int64_t i = 0; i < q_lens[b]; i++, t++) {
        rows_of[t] = b;
        check_row(tp[t], pp[t], i + 1 == q_lens[b] ? steps : 1, bts[b], bs, kc.size(0));
      }
      last[b] = t - 1;
      TORCH_CHECK(b + 1 < B || t == T, "lowlat head: q_lens must sum to T");
    }
    auto xl = torch::empty({B, m.hidden}, f.options());
    std::vector<int64_t> tok(B), pos(B);
    for (int64_t b = 0; b < B; b++) tok[b] = tp[last[b]], pos[b] = pp[last[b]];
    auto out = torch::empty({B, steps}, torch::TensorOptions().dtype(torch::kLong));
    int64_t* op = out.data_ptr<int64_t>();
    pybind11::gil_scoped_release nogil;
    dispatch(kc, vc, [&](auto w, auto x, auto* k, auto* v) {
      using WT = decltype(w);
      using XT = decltype(x);
      auto xp = reinterpret_cast<WT*>(xl.data_ptr());
      extend<WT, XT>(reinterpret_cast<const WT*>(f.data_ptr()), tp, pp, T, rows_of, last, bts, bs, k, v, xp);
      run<WT, XT>(xp, tok.data(), pos.data(), B, steps, bts, bs, k, v, op);
    });
    return out;
  }

  // fn(WT(), XT(), WT* k_cache, WT* v_cache) for the head's (weight, activation) storage types
  template <typename Fn>
  void dispatch(torch::Tensor& kc, torch::Tensor& vc, Fn&& fn) {
    if (m.bf16) {
      auto k = reinterpret_cast<bf16_t*>(kc.data_ptr());
      auto v = reinterpret_cast<bf16_t*>(vc.data_ptr());
      if (m.dot) {
#ifdef __AVX512BF16__
        fn(bf16_t(), bf16_t(), k, v);
#endif
      } else {
        fn(bf16_t(), float(), k, v);
      }
    } else {
      fn(float(), float(), kc.data_ptr<float>(), vc.data_ptr<float>());
    }
  }

  void check_cache(const torch::Tensor& kc, const torch::Tensor& vc) const {
    const auto wdt = m.bf16 ? torch::kBFloat16 : torch::kFloat32;
    TORCH_CHECK(kc.dim() == 3 && kc.size(1) == m.Hkv && kc.size(2) == m.D && kc.scalar_type() == wdt &&
                    vc.sizes() == kc.sizes() && kc.is_contiguous() && vc.is_contiguous(),
                "lowlat head: kv caches must be contiguous [slots, ", m.Hkv, ", ", m.D, "]");
  }

  // a row whose token enters at position p, after which positions p .. p + n - 1 are written (and all before read)
  void check_row(int64_t token, int64_t p, int64_t n, const std::vector<int64_t>& bt, int64_t bs,
                 int64_t slots) const {
    TORCH_CHECK(token >= 0 && token < m.vocab, "lowlat head: token id out of range");
    TORCH_CHECK(p >= 0 && p + n <= m.max_pos && (int64_t)bt.size() * bs >= p + n,
                "lowlat head: positions ", p, " .. ", p + n - 1, " do not fit the block table / rotary table");
    for (int64_t j = 0; j < (p + n + bs - 1) / bs; j++)
      TORCH_CHECK(bt[j] >= 0 && (bt[j] + 1) * bs <= slots, "lowlat head: block outside the cache");
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
    check_cache(kc, vc);
    auto out = torch::empty({B, steps}, torch::TensorOptions().dtype(torch::kLong));
    if (steps == 0) return out;
    const int64_t* tp = tokens.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) check_row(tp[b], pp[b], steps, bts[b], bs, kc.size(0));
    int64_t* op = out.data_ptr<int64_t>();
    pybind11::gil_scoped_release nogil;
    dispatch(kc, vc, [&](auto w, auto x, auto* k, auto* v) {
      using WT = decltype(w);
      run<WT, decltype(x)>(reinterpret_cast<const WT*>(g.data_ptr()), tp, pp, B, steps, bts, bs, k, v, op);
    });
    return out;
  }
};

}  // namespace lowlat
