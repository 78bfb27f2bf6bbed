// lowlat's Gemma 3 pieces of Model: set_gemma / set_rope (the (1 + w) norms, the local layers and their RoPE
// tables), the once-rounded (1 + w) norm and the post-norms on the attention and feed-forward outputs that the
// step (forward.h) applies.
#pragma once
#include "model.h"

namespace lowlat {

// Gemma 3: per layer the float32 (1 + w) of input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
// post_feedforward_layernorm, q_norm and k_norm, then the final norm's; local: 1 for a sliding-window layer;
// embed_scale: sqrt(hidden) as the model dtype rounds it. The constructor's norm weights are then unused.
inline void Model::set_gemma(std::vector<torch::Tensor> in, std::vector<torch::Tensor> pa,
                             std::vector<torch::Tensor> pf, std::vector<torch::Tensor> po,
                             std::vector<torch::Tensor> qn, std::vector<torch::Tensor> kn, torch::Tensor fin,
                             std::vector<int64_t> local, int64_t window_, double embed_scale_) {
  TORCH_CHECK(!qk_norm && !has_bias && E == 0, "lowlat: Gemma 3 layers have no Llama q/k norm, bias or MoE");
  TORCH_CHECK((int64_t)local.size() == L && window_ >= 0, "lowlat: one local flag per layer and a window >= 0");
  auto chk = [&](const torch::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n, "lowlat: gemma ", what,
                " must be contiguous float32 [", n, "]");
  };
  for (auto* v : {&in, &pa, &pf, &po, &qn, &kn}) TORCH_CHECK((int64_t)v->size() == L, "lowlat: gemma norms per layer");
  for (int64_t l = 0; l < L; l++) {
    chk(in[l], hidden, "input_layernorm");
    chk(pa[l], hidden, "post_attention_layernorm");
    chk(pf[l], hidden, "pre_feedforward_layernorm");
    chk(po[l], hidden, "post_feedforward_layernorm");
    chk(qn[l], D, "q_norm");
    chk(kn[l], D, "k_norm");
  }
  chk(fin, hidden, "norm");
  g_in = in; g_pa = pa; g_pf = pf; g_po = po; g_qn = qn; g_kn = kn; g_final = fin;
  is_local.assign(L, 0);
  for (int64_t l = 0; l < L; l++) is_local[l] = local[l] != 0;
  TORCH_CHECK(window_ > 0 || std::find(is_local.begin(), is_local.end(), 1) == is_local.end(),
              "lowlat: local layers need a window");
  window = window_;
  embed_scale = float(embed_scale_);
  gemma = true;
  cos_local = cos;
  sin_local = sin;
}

// the rotary tables [max_pos, D] (float32) of the global and (Gemma) local layers, replaced as positions grow
inline void Model::set_rope(torch::Tensor c, torch::Tensor s, torch::Tensor cl, torch::Tensor sl) {
  for (const auto* t : {&c, &s, &cl, &sl})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(1) == D &&
                    t->size(0) == c.size(0), "lowlat.set_rope: four contiguous float32 [max_pos, ", D, "] tables");
  cos = c; sin = s; cos_local = cl; sin_local = sl;
  max_pos = c.size(0);
}

// Gemma's norm of rows [t0, t1) of x: x / rms(x) * w1 in float32 (w1 = 1 + w), rounded once to the model dtype
template <typename WT, typename DT>
inline void Model::norm1p(const float* x, const float* w1, DT* dst, int64_t t0, int64_t t1) const {
  for (int64_t t = t0; t < t1; t++) {
    const float* xr = x + t * hidden;
    const float r = 1.0f / std::sqrt(sumsq(xr, hidden) / float(hidden) + float(eps));
    for (int64_t i = 0; i < hidden; i++) stf<DT>(dst, t * hidden + i, rnd<WT>(xr[i] * r * w1[i]));
  }
}

// columns [a, b) of T rows of a GEMV output rounded to the model dtype in place
template <typename WT>
inline void Model::round_cols(float* y, int64_t T, int64_t a, int64_t b) const {
  if (std::is_same<WT, bf16_t>::value)
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = a; c < b; c++) y[t * hidden + c] = rbf(y[t * hidden + c]);
}

// Gemma's post-norm + residual over this thread's columns [a, b): y holds the block's output (whole rows,
// already in the model dtype); each thread takes every row's rms (cheap) rather than wait on a barrier more
template <typename WT>
inline void Model::post_norm_add(const float* y, const float* w1, int64_t T, int64_t a, int64_t b) const {
  float* x = buf<float>(off_x);
  for (int64_t t = 0; t < T; t++) {
    const float* yr = y + t * hidden;
    const float r = 1.0f / std::sqrt(sumsq(yr, hidden) / float(hidden) + float(eps));
    for (int64_t c = a; c < b; c++) x[t * hidden + c] = rnd<WT>(x[t * hidden + c] + rnd<WT>(yr[c] * r * w1[c]));
  }
}

// A projection's output columns [a, b) of its rows (y) onto the residual stream: through Gemma's post-norm
// (post_w; it needs whole rows of y: one barrier more), else added as they are.
template <typename WT>
inline void Model::add_residual(float* y, const float* post_w, int64_t T, int64_t a, int64_t b) const {
  if (post_w != nullptr) {
    round_cols<WT>(y, T, a, b);
#pragma omp barrier
    post_norm_add<WT>(y, post_w, T, a, b);
    return;
  }
  float* x = buf<float>(off_x);
  for (int64_t t = 0; t < T; t++)
    for (int64_t n = a; n < b; n++) x[t * hidden + n] = rnd<WT>(x[t * hidden + n] + rnd<WT>(y[t * hidden + n]));
}

}  // namespace lowlat
