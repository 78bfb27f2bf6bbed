// lowlat's dense GEMV: the weights streamed as the model holds them ([N, K] row-major) against 1-8 activation
// rows, for float32, bf16 (shift + FMA) and bf16 dot-product (AVX512_BF16) inputs.
#pragma once
#include "common.h"

namespace lowlat {

// ------------------------------------------------------------------------------------------------ GEMV
// out[m * ldo + r] = sum_k X[m, k] * W[r * K + k] for R weight rows and MB activation rows, CH independent
// accumulator chains per (row, activation row) to hide the FMA / dot-product latency. Three input kinds: float W
// x float X (float32 models), bf16 W x float X (AVX512F: bf16 -> fp32 by a shift, then FMA), bf16 W x bf16 X
// (AVX512_BF16 dot products, 32 products per instruction).

struct KF32 {  // float weights, float activations
  using W = float;
  using X = float;
  static constexpr int kStep = 16;
  static constexpr int kPrefetchFrom = 1;  // activation rows from which the L2 prefetch pays (see kPrefetchBytes)
  static inline __m512 wload(const float* w) { return _mm512_loadu_ps(w); }
  static inline void macw(__m512& acc, __m512 w, const float* x) { acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc); }
  static inline void mac_tail(__m512& acc, const float* w, const float* x, int64_t n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w), _mm512_maskz_loadu_ps(m, x), acc);
  }
};
struct KCvt {  // bf16 weights, float activations
  using W = bf16_t;
  using X = float;
  static constexpr int kStep = 16;
  static constexpr int kPrefetchFrom = 3;
  static inline __m512 wload(const bf16_t* w) { return load16(w); }
  static inline void macw(__m512& acc, __m512 w, const float* x) { acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc); }
  static inline void mac_tail(__m512& acc, const bf16_t* w, const float* x, int64_t n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    acc = _mm512_fmadd_ps(load16m(w, m), _mm512_maskz_loadu_ps(m, x), acc);
  }
};
#ifdef __AVX512BF16__
static constexpr bool kHaveDot = true;
struct KDot {  // bf16 weights, bf16 activations, vdpbf16ps
  using W = bf16_t;
  using X = bf16_t;
  static constexpr int kStep = 32;
  static constexpr int kPrefetchFrom = 3;
  static inline __m512i wload(const bf16_t* w) { return _mm512_loadu_si512((const void*)w); }
  static inline void macw(__m512& acc, __m512i w, const bf16_t* x) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512((const void*)x));
  }
  static inline void mac_tail(__m512& acc, const bf16_t* w, const bf16_t* x, int64_t n) {
    const __mmask32 m = (__mmask32)((1ull << n) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w), (__m512bh)_mm512_maskz_loadu_epi16(m, x));
  }
};
#else
static constexpr bool kHaveDot = false;
#endif

// Software prefetch of the weight stream into L2, kPrefetchBytes ahead, once a weight row meets
// Kn::kPrefetchFrom activation rows: the dot products then slow the stream enough that the hardware prefetcher
// falls behind. Full decoder forward, bf16, one core: 4 rows 29 -> 12.7 ms, 6 rows 35 -> 14.5 ms, 9 rows 28 ->
// 20 ms; at 1-2 bf16 rows the stream already runs at memory speed and the extra instructions cost 5-25%, while
// float32 (4x the bytes per product) gains ~8% even at 1 row on two cores.
static constexpr int64_t kPrefetchBytes = 12288;
// Batch-invariant GEMV: every (weight row, activation row) pair runs 2 accumulator chains whatever the number of
// rows in the step, so a decode row and a verify row compute the same bits. Set from
// Model::invariant at each entry (forward, linear, linear_gather); the calls run one at a time.
static bool g_invariant = false;
template <typename Kn, int R, int MB, int CH>
static inline void row_kernel(const typename Kn::W* w, int64_t K, const typename Kn::X* X, int64_t ldx, float* out,
                              int64_t ldo) {
  constexpr int S = Kn::kStep;
  __m512 acc[R][MB][CH];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++)
      for (int c = 0; c < CH; c++) acc[r][m][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + S * CH <= K; k += S * CH) {
    if (MB >= Kn::kPrefetchFrom)
      for (int c = 0; c < CH; c++)
        for (int r = 0; r < R; r++)
          _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + c * S) + kPrefetchBytes, _MM_HINT_T1);
    for (int c = 0; c < CH; c++) {
      decltype(Kn::wload(w)) wv[R];
      for (int r = 0; r < R; r++) wv[r] = Kn::wload(w + r * K + k + c * S);
      for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) Kn::macw(acc[r][m][c], wv[r], X + m * ldx + k + c * S);
    }
  }
  for (; k + S <= K; k += S) {
    for (int r = 0; r < R; r++) {
      const auto wv = Kn::wload(w + r * K + k);
      for (int m = 0; m < MB; m++) Kn::macw(acc[r][m][0], wv, X + m * ldx + k);
    }
  }
  if (k < K)
    for (int r = 0; r < R; r++)
      for (int m = 0; m < MB; m++) Kn::mac_tail(acc[r][m][0], w + r * K + k, X + m * ldx + k, K - k);
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) {
      __m512 a = acc[r][m][0];
      for (int c = 1; c < CH; c++) a = _mm512_add_ps(a, acc[r][m][c]);
      out[m * ldo + r] = _mm512_reduce_add_ps(a);
    }
}

// Accumulator chains per (weight row, activation row) for R weight rows against MB activation rows. One weight
// row against 1-3 activation rows streams with 8 / 4 / 3 chains (fewer leave the dot products latency-bound: 4
// activation rows with 1 chain each took 22 ms per forward on one core, with 2 chains 14 ms). A pair of weight
// rows is for 4 or more activation rows: each activation load then serves two dot products (at 1-2 activation
// rows two interleaved streams cost 25-50% against one sequential stream; from 4 rows on, with the L2 prefetch,
// the pair wins: full forward on one core, bf16, 9 / 16 / 32 rows: 20.6 -> 18.0, 38.2 -> 29.7, 82.7 -> 56.9 ms).
// Batch-invariant (Inv): 2 chains at every size. A pair's sum runs the same instruction sequence whether its
// weight row is streamed alone or in a pair, and whatever the rows beside it, so only the chain count must not
// change with the block.
constexpr int chains(int R, int MB, bool inv) {
  return inv ? 2 : R == 2 ? (MB <= 3 ? 2 : 1) : MB == 1 ? 8 : MB == 2 ? 4 : MB == 3 ? 3 : 2;
}

// R (1 or 2) weight rows against mb activation rows (1..8 for one weight row, 1..6 for a pair)
template <typename Kn, int R, bool Inv>
static inline void row_block(int mb, const typename Kn::W* w, int64_t K, const typename Kn::X* X, int64_t ldx,
                             float* out, int64_t ldo) {
  constexpr int kMax = R == 1 ? 8 : 6;
  switch (mb) {
    case 1: row_kernel<Kn, R, 1, chains(R, 1, Inv)>(w, K, X, ldx, out, ldo); break;
    case 2: row_kernel<Kn, R, 2, chains(R, 2, Inv)>(w, K, X, ldx, out, ldo); break;
    case 3: row_kernel<Kn, R, 3, chains(R, 3, Inv)>(w, K, X, ldx, out, ldo); break;
    case 4: row_kernel<Kn, R, 4, chains(R, 4, Inv)>(w, K, X, ldx, out, ldo); break;
    case 5: row_kernel<Kn, R, 5, chains(R, 5, Inv)>(w, K, X, ldx, out, ldo); break;
    case 6: row_kernel<Kn, R, 6, chains(R, 6, Inv)>(w, K, X, ldx, out, ldo); break;
    case 7:
      if constexpr (R == 1) {
        row_kernel<Kn, 1, 7, chains(1, 7, Inv)>(w, K, X, ldx, out, ldo);
        break;
      }
      [[fallthrough]];
    default: row_kernel<Kn, R, kMax, chains(R, kMax, Inv)>(w, K, X, ldx, out, ldo); break;
  }
}

// rows [n0, n1) of W [N, K]; X [M, ldx]; out [M, ldo] (column n of out = row n of W). The activation rows go in
// balanced blocks (<= 8 rows against one weight row, <= 6 against a pair); the weight rows stay in L1 between
// the blocks.
template <typename Kn>
static void gemv_rows(const typename Kn::W* W, int64_t K, int64_t n0, int64_t n1, const typename Kn::X* X,
                      int64_t ldx, int M, float* out, int64_t ldo) {
  int64_t n = n0;
  const bool inv = g_invariant;
  if (M >= 4) {
    const int nb2 = (M + 5) / 6;
    for (; n + 2 <= n1; n += 2)
      for (int i = 0, m0 = 0; i < nb2; i++) {
        const int mb = M / nb2 + (i < M % nb2 ? 1 : 0);
        (inv ? row_block<Kn, 2, true> : row_block<Kn, 2, false>)(mb, W + n * K, K, X + m0 * ldx, ldx,
                                                                 out + m0 * ldo + n, ldo);
        m0 += mb;
      }
  }
  const int nblk = (M + 7) / 8;
  for (; n < n1; n++)
    for (int i = 0, m0 = 0; i < nblk; i++) {
      const int mb = M / nblk + (i < M % nblk ? 1 : 0);
      (inv ? row_block<Kn, 1, true> : row_block<Kn, 1, false>)(mb, W + n * K, K, X + m0 * ldx, ldx,
                                                               out + m0 * ldo + n, ldo);
      m0 += mb;
    }
}

// the kernel kind for a (weight, activation) storage pair
template <typename WT, typename XT> struct KindOf;
template <> struct KindOf<float, float> { using type = KF32; };
template <> struct KindOf<bf16_t, float> { using type = KCvt; };
#ifdef __AVX512BF16__
template <> struct KindOf<bf16_t, bf16_t> { using type = KDot; };
#endif
template <typename WT, typename XT>
static inline void gemv(const WT* W, int64_t K, int64_t n0, int64_t n1, const XT* X, int64_t ldx, int M, float* out,
                        int64_t ldo) {
  gemv_rows<typename KindOf<WT, XT>::type>(W, K, n0, n1, X, ldx, M, out, ldo);
}

}  // namespace lowlat
