// lowlat's matmuls outside the step: the dense and stored-type GEMV on their own (the LM head, the ablation's
// linears), with the LM head's fused argmax, and the dequantized tiles of the engine's own prefill matmuls.
#pragma once
#include "model.h"

namespace lowlat {

// y = x @ W.T (+ bias) for a model-dtype x [M, K] and W [N, K]: the same GEMV as the forward, on its own
// (the ablation's "C++ GEMV in the Python forward", and a fast LM head). out_float: float32 result (no
// rounding to the model dtype).
// (argmax: -> int64 [M], argmax_rows of the result)
inline torch::Tensor Model::linear(torch::Tensor x, torch::Tensor W, c10::optional<torch::Tensor> bias, bool out_float,
                                   bool argmax) const {
  g_invariant = invariant;
  const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(0 + 1) && x.scalar_type() == wdt &&
                  W.scalar_type() == wdt && W.is_contiguous() && x.device().is_cpu() && W.device().is_cpu(),
              "lowlat.linear: expected x [M, K] and contiguous W [N, K] in the model dtype");
  const int64_t M = x.size(0), K = x.size(1), N = W.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->scalar_type() == wdt && bias->is_contiguous()),
              "lowlat.linear: bias must be [N] in the model dtype");
  auto y = torch::empty({M, N}, torch::TensorOptions().dtype(torch::kFloat32));
  if (M == 0 || N == 0)
    return argmax ? torch::zeros({M}, torch::TensorOptions().dtype(torch::kLong)) : out_float ? y : y.to(wdt);
  auto xc = x.contiguous();
  float* yp = y.data_ptr<float>();
  const int nt = nthreads;
  if (!bf16) {
    const float* xp = xc.data_ptr<float>();
    const float* wp = W.data_ptr<float>();
#pragma omp parallel num_threads(nt)
    {
      int64_t a, b;
      split(N, 16, omp_get_thread_num(), omp_get_num_threads(), a, b);
      gemv<float, float>(wp, K, a, b, xp, K, int(M), yp, N);
    }
  } else {
    const bf16_t* wp = reinterpret_cast<const bf16_t*>(W.data_ptr());
    if (dot) {
#ifdef __AVX512BF16__
      const bf16_t* xp = reinterpret_cast<const bf16_t*>(xc.data_ptr());
#pragma omp parallel num_threads(nt)
      {
        int64_t a, b;
        split(N, 16, omp_get_thread_num(), omp_get_num_threads(), a, b);
        gemv<bf16_t, bf16_t>(wp, K, a, b, xp, K, int(M), yp, N);
      }
#endif
    } else {
      auto xf = xc.to(torch::kFloat32);
      const float* xp = xf.data_ptr<float>();
#pragma omp parallel num_threads(nt)
      {
        int64_t a, b;
        split(N, 16, omp_get_thread_num(), omp_get_num_threads(), a, b);
        gemv<bf16_t, float>(wp, K, a, b, xp, K, int(M), yp, N);
      }
    }
  }
  if (bias.has_value()) {
    if (bf16) y = y.to(wdt).add(*bias);  // torch's bf16 addmm: bf16 product, then the bias add rounds again
    else y.add_(*bias);
  }
  if (argmax) return argmax_rows(y.to(torch::kFloat32).contiguous());
  return out_float ? y.to(torch::kFloat32) : y.to(wdt);
}

// y = x @ W.T for a stored-type W (its buffers, or a MixedQuantLinear's row segments; N rows of x's K columns),
// e.g. the tied Q8_0 LM head, with the forward's kernels and activation mode -> [M, N] in the model dtype
// (out_float: float32)
// (argmax: -> int64 [M], argmax_rows of the result: greedy decoding's LM head without the logits)
inline torch::Tensor Model::qlinear(torch::Tensor x, std::vector<torch::Tensor> w, int64_t N, bool out_float,
                                    bool argmax) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(0) <= max_rows, "lowlat.qlinear: x must be [M <= ",
              max_rows, ", K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  const size_t keep = q_keep.size();
  const QMat q = make_qmat(w, N, K, "qlinear weight");
  q_keep.resize(keep);  // the caller holds w for the call
  TORCH_CHECK(q.quant() && q8_stride >= act_row_bytes(q.nbp()), "lowlat.qlinear: needs set_quant and a weight no "
              "wider than the model's");
  const auto t0 = std::chrono::steady_clock::now();
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, torch::TensorOptions().dtype(torch::kFloat32));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num();
    int64_t a, b;
    split(N, 16, tid, omp_get_num_threads(), a, b);
    char* xq = q8buf(tid);
    prepare_rows(xp, K, int(M), K, q.nbp(), xq, q8_stride, act);
    qgemv(q, a, b, xq, q8_stride, act, int(M), yp, N);
  }
  if (argmax) y = argmax_rows(y);
  if (profile) prof[4] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out_float || argmax ? y : y.to(bf16 ? torch::kBFloat16 : torch::kFloat32);
}

// Rows a .. b - 1 (a a multiple of 16) of a stored weight [N, K], dequantized and transposed in one pass:
// [K, ld] (column n - a is row n; ld = b - a rounded up to 16, the caller slices), float32 or bf16. The engine's
// own matmul (QuantLinear.matmul: its forward with prefill_rows=0, or after a fallback) multiplies by it; the torch ops it replaces
// (unpack, widen, scale, offset, cast: each a pass over a float32 tile) took about as long as the matmul itself.
// Each value is quant.dequantize's: float32 q * d, then + m (two roundings, as there), then one cast. One
// 512-byte chunk load holds 4 code bytes of each of the group's 16 rows: byte e of every row is one shift and
// mask away, and the 16 rows of a column are adjacent in the transposed output, so nothing is shuffled.
inline torch::Tensor Model::dequant_t(std::vector<torch::Tensor> w, int64_t N, int64_t K, int64_t a, int64_t b,
                                      bool to_bf16) {
  TORCH_CHECK(a >= 0 && a % kGroup == 0 && a < b && b <= N, "lowlat.dequant_t: rows [", a, ", ", b,
              ") must start at a multiple of 16 and lie in [0, ", N, ")");
  const size_t keep = q_keep.size();
  const QW q = make_qw(w, N, K, "dequant_t weight");
  q_keep.resize(keep);
  TORCH_CHECK(q.quant(), "lowlat.dequant_t: needs a stored (quantized) weight");
  const int64_t ld = (b - a + kGroup - 1) / kGroup * kGroup, g0 = a / kGroup, g1 = (b + kGroup - 1) / kGroup;
  auto out = torch::empty({K, ld}, torch::TensorOptions().dtype(to_bf16 ? torch::kBFloat16 : torch::kFloat32));
  char* base = reinterpret_cast<char*>(out.data_ptr());
  const int64_t esz = to_bf16 ? 2 : 4;
  auto put = [&](int64_t col, int64_t g, __m512 v) {  // the group's 16 rows of one column
    if (col >= K) return;
    char* dst = base + (col * ld + (g - g0) * kGroup) * esz;
    if (to_bf16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rbf16(v)), 16)));
    else
      _mm512_storeu_ps(reinterpret_cast<float*>(dst), v);
  };
  const __m512i nib = _mm512_set1_epi32(15);
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t g = g0; g < g1; g++)
    for (int64_t c = 0; c < q.chunks(); c++) {
      const uint8_t* p = q.chunk(g, c);
      if (q.fmt == kU4) {  // low nibbles: block 2c, high nibbles: block 2c + 1
        const __m512 d0 = q.scale(g, 2 * c), m0 = q.offset(g, 2 * c);
        const __m512 d1 = q.scale(g, 2 * c + 1), m1 = q.offset(g, 2 * c + 1);
        for (int t = 0; t < 8; t++) {
          const __m512i v = _mm512_loadu_si512(p + 64 * t);
          for (int e = 0; e < 4; e++) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(v, 8 * e), nib);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 8 * e + 4), nib);
            put(64 * c + 4 * t + e, g, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d0), m0));
            put(64 * c + 32 + 4 * t + e, g, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d1), m1));
          }
        }
      } else {  // s8 / u6 / u5: one block per chunk (u6: a scale per 16)
        const __m512 d = q.scale(g, q.fmt == kU6 ? 2 * c : c), m = q.mins() ? q.offset(g, c) : _mm512_setzero_ps();
        const __m512 d16 = q.fmt == kU6 ? q.scale(g, 2 * c + 1) : d;
        for (int t = 0; t < 8; t++) {
          const __m512i v = q.six() ? u6_codes(p, t) : _mm512_loadu_si512(p + 64 * t);
          for (int e = 0; e < 4; e++) {
            __m512i x = q.fmt == kS8 ? _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * e), 24)
                                     : _mm512_and_si512(_mm512_srli_epi32(v, 8 * e), _mm512_set1_epi32(63));
            if (q.fmt == kU6) x = _mm512_add_epi32(x, _mm512_set1_epi32(-32));
            const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(x), t < 4 ? d : d16);
            put(32 * c + 4 * t + e, g, q.mins() ? _mm512_add_ps(w, m) : w);
          }
        }
      }
    }
  return out;
}

// y [M, N] float32 logits -> int64 [M]: per row the first index of the largest value in the model dtype, as
// torch's argmax of y.to(model dtype). Each thread scans the columns the LM head's GEMV gave it (the same
// split, so still in its cache); the slices' bests then merge in column order.
inline torch::Tensor Model::argmax_rows(const torch::Tensor& y) const {
  const int64_t M = y.size(0), N = y.size(1);
  const float* yp = y.data_ptr<float>();
  std::vector<ArgBest> best(M * nthreads);
#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num();
    int64_t a, b;
    split(N, 16, tid, omp_get_num_threads(), a, b);
    for (int64_t m = 0; m < M; m++) {
      ArgBest r = slice_argmax(yp + m * N + a, b - a, bf16);
      r.i += a;
      if (b > a) best[m * nthreads + tid] = r;
    }
  }
  auto out = torch::empty({M}, torch::TensorOptions().dtype(torch::kLong));
  for (int64_t m = 0; m < M; m++) {
    ArgBest r;
    for (int t = 0; t < nthreads; t++)
      if (best[m * nthreads + t].beats(r)) r = best[m * nthreads + t];
    out.data_ptr<int64_t>()[m] = r.i;
  }
  return out;
}

}  // namespace lowlat
