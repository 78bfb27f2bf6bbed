// lowlat: Lanner's reference CPU kernel plugin. One call runs the whole Llama-family forward (embedding, all
// decoder layers over the paged KV cache, dense or MoE feed-forwards, final norm, captured layer outputs) for
// small batches: decode, verify of k drafts, small prefill chunks. At these sizes a step streams every weight
// once and does little arithmetic per byte, so the design goal is to read the weights at memory bandwidth with
// few synchronisations:
//
//  * one OpenMP parallel region for the whole forward; threads split each GEMV over output rows and fuse the
//    epilogue that needs only their rows (bias, q/k norm, RoPE, the KV-cache write, residual adds, SiLU*up),
//    so a layer costs 5 barriers;
//  * GEMV: the weights as the model holds them ([N, K] row-major, no repacked copy), streamed front to back:
//    one row at a time against 1-3 activation rows (memory-bound: one sequential stream per core is what the
//    prefetcher follows best), row pairs with an L2 software prefetch from 4 rows on (the dot products become
//    the bottleneck); float32 accumulation; bf16 weights use `vdpbf16ps` when the CPU has AVX512_BF16
//    (activations packed to bf16 once per GEMV input), else a bf16 -> fp32 shift + FMA; float32 models an FMA
//    GEMV;
//  * MoE feed-forwards (Qwen3-MoE, Mixtral; dense and MoE layers may mix): router GEMV, then per row a float32
//    softmax and top-k that picks the experts torch.topk picks (ties included); the dispatch is a bitmap of the
//    experts hit plus per-expert row counts, each expert's rows placed by the counts (no sort over the tokens),
//    and each hit expert's gate/up and down GEMVs run once over exactly the rows that picked it, so rows that
//    share an expert stream its weights once (a decode step of B rows reads at most B * top_k experts); an MoE
//    layer costs one barrier more than a dense one (the router's), however many experts are hit;
//  * bf16 models round to bf16 exactly where the PyTorch module rounds (GEMV outputs, norms, RoPE terms, SiLU,
//    residual adds; for MoE also the router logits, the routing weight, weight * expert output and each
//    expert's add into the sum, FusedMoE's order) and attention follows PyTorch's CPU flash attention, so the
//    plugin tracks the engine's own forward bit for bit in nearly all elements; float32 models are float32
//    throughout.
//  * Gemma 3 (set_gemma): (1 + w) norms rounded once, post-norms on the attention and feed-forward outputs (whole
//    rows of a row-split GEMV: one barrier more each), GeGLU, the scaled embedding, sliding-window local layers
//    (each row reads the window of its own position) with their own RoPE tables; one rank only.
//  * tensor parallelism: each rank runs its shard (heads, intermediate size, vocabulary rows) and the all-reduces
//    happen inside the call, in the epilogue of the row-parallel GEMVs: each thread publishes its hidden columns
//    to a memory segment the ranks share as soon as they are done and sums the other ranks' copies of them (see
//    Comm), so a reduce costs no barrier beyond the one the layer already has and about 2 us of waiting, against
//    ~1 ms for a gloo all-reduce on the 2-core VM.
// Only the headers it needs (Tensor with its methods, two factory ops, the pybind11 casters): torch/extension.h
// would pull in every operator and double the one-time compile.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <immintrin.h>
#include <omp.h>

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#ifndef __AVX512F__
#include "avx2.h"  // AVX2 + FMA + F16C: the same kernels on pairs of 256-bit halves
#endif

namespace lowlat {

namespace torch {  // the few names used below, from ATen
using at::Tensor;
using at::TensorOptions;
using at::empty;
using at::from_blob;
using at::zeros;
using at::kBFloat16;
constexpr auto kFloat32 = at::kFloat;
using at::kLong;
constexpr auto kUInt8 = at::kByte;
}  // namespace torch

using bf16_t = uint16_t;
using Tables = std::vector<std::vector<std::vector<int64_t>>>;  // per layer group, per sequence: block ids
static constexpr int64_t kMaxRows = 256;  // rows per forward (stack arrays in attention)

// ------------------------------------------------------------------------------------------------ scalars
static inline float bf2f(bf16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline bf16_t f2bf(float f) {  // round to nearest even, like torch's float -> bfloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t(u >> 16);
}
static inline float rbf(float f) { return bf2f(f2bf(f)); }

template <typename T> static inline float ldf(const T* p, int64_t i);
template <> inline float ldf<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float ldf<bf16_t>(const bf16_t* p, int64_t i) { return bf2f(p[i]); }
template <typename T> static inline void stf(T* p, int64_t i, float v);
template <> inline void stf<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void stf<bf16_t>(bf16_t* p, int64_t i, float v) { p[i] = f2bf(v); }
// round like the model dtype: bf16 models keep bf16-exact values in float buffers
template <typename T> static inline float rnd(float v) { return std::is_same<T, bf16_t>::value ? rbf(v) : v; }

// ------------------------------------------------------------------------------------------------ vectors
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16m(const bf16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// round float32 lanes to the nearest bf16 value (ties to even), kept as float32
static inline __m512 rbf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

// The first index of the largest of y[0, n) rounded to the model dtype (bf16: as torch's .to(bfloat16)), a NaN
// counting as the largest: torch's argmax over model-dtype logits -> (value, index). A max pass, then a pass for its
// first occurrence; both over data the caller's GEMV just wrote.
struct ArgBest {
  float v = -INFINITY;
  int64_t i = -1;
  bool beats(const ArgBest& o) const {  // this slice's best lies after o's: it wins only by a larger value
    return i >= 0 && (o.i < 0 || (!std::isnan(o.v) && (std::isnan(v) || v > o.v)));
  }
};
static ArgBest slice_argmax(const float* y, int64_t n, bool bf16) {
  ArgBest best;
  if (n <= 0) return best;
  const int64_t nv = n / 16 * 16;
  __m512 m = _mm512_set1_ps(-INFINITY);
  unsigned nan = 0;
  for (int64_t i = 0; i < nv; i += 16) {
    const __m512 v = _mm512_loadu_ps(y + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, bf16 ? rbf16(v) : v);
  }
  float mx = _mm512_reduce_max_ps(m);
  for (int64_t i = nv; i < n; i++) {
    if (std::isnan(y[i])) nan = 1;
    mx = std::max(mx, bf16 ? rbf(y[i]) : y[i]);
  }
  if (nan) {  // torch: the first NaN
    for (int64_t i = 0; i < n; i++)
      if (std::isnan(y[i])) return {y[i], i};
  }
  const __m512 target = _mm512_set1_ps(mx);
  for (int64_t i = 0; i < nv; i += 16) {
    const __m512 v = _mm512_loadu_ps(y + i);
    const unsigned hit = _mm512_cmp_ps_mask(bf16 ? rbf16(v) : v, target, _CMP_EQ_OQ);
    if (hit) return {mx, i + __builtin_ctz(hit)};
  }
  for (int64_t i = nv; i < n; i++)
    if ((bf16 ? rbf(y[i]) : y[i]) == mx) return {mx, i};
  return best;
}

#ifdef __AVX512BF16__
// acc + the bf16 pair products of a and the 64 bytes at p: vdpbf16ps with p as its memory operand. Through the
// intrinsic GCC 12 bounced each loaded tile vector through the stack in attend_nv's loops (a store and a reload
// per product); the instruction is the same, so are the bits.
static inline __m512 dpbf16_mem(__m512 acc, __m512bh a, const void* p) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const __m512i*>(p)));
  return acc;
}
#endif

// exp(x) for float32 lanes: Cephes-style range reduction + degree-6 polynomial, ~1-2 ulp; 2^n by scalef
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.72f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// exp with ~20 ulp (ATen's Vectorized<float>::exp_u20), which PyTorch's CPU flash attention uses for float32
// softmax; at float32 the choice is invisible next to the 1e-4 verify tolerance
static inline __m512 exp512_u20(__m512 x) {
  const __m512 ln_flt_min = _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50));
  const __m512 ln_flt_max = _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, ln_flt_min, _CMP_LT_OS);
  __m512 src = _mm512_max_ps(_mm512_min_ps(x, ln_flt_max), ln_flt_min);
  __m512 fx = _mm512_fmadd_ps(src, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)), _mm512_set1_ps(0.5f));
  fx = _mm512_cvtepi32_ps(_mm512_cvt_roundps_epi32(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218)), src);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_sub_ps(fx, _mm512_set1_ps(1.f))), _mm512_set1_epi32(127));
  __m512 pow2 = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  pow2 = _mm512_mask_blend_ps(tiny, pow2, _mm512_setzero_ps());
  return _mm512_mul_ps(_mm512_mul_ps(p, pow2), _mm512_set1_ps(2.f));
}

// PyTorch's fexp_u20 (Malossi et al., "Fast Exponential Computation on SIMD Architectures": 2^x with a cubic
// correction of the mantissa), which its CPU flash attention applies to bf16 inputs: relative error ~1e-5,
// invisible after the bf16 rounding of the exponentials except where it decides the rounding, so it is
// reproduced exactly here
static inline __m512 exp512_fast(__m512 x) {
  const __mmask16 lo = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50)), _CMP_LT_OS);
  const __mmask16 hi = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
  __m512 src = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)));
  const __m512 frac = _mm512_sub_ps(src, _mm512_floor_ps(src));
  __m512 r = _mm512_fmadd_ps(frac, _mm512_set1_ps(-0.079204240219773236f), _mm512_set1_ps(-0.22433836478672356f));
  r = _mm512_fmadd_ps(frac, r, _mm512_set1_ps(0.30354260500649682f));
  r = _mm512_fmadd_ps(frac, r, _mm512_set1_ps(0.00010703434948458272f));
  src = _mm512_sub_ps(src, r);
  const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), src, _mm512_set1_ps(8388608.0f * 127.f));
  __m512i v = _mm512_cvttps_epi32(t);
  v = _mm512_mask_mov_epi32(v, lo, _mm512_setzero_si512());
  v = _mm512_mask_mov_epi32(v, hi, _mm512_set1_epi32(0x7F800000));
  return _mm512_castsi512_ps(v);
}

// sum of squares in 16 float32 lanes, then across lanes: close to PyTorch's vectorized mean of x^2 in
// F.rms_norm (bf16 results agree in all but ~1e-6 of elements; a sequential sum disagrees in ~1e-4)
// lane k = _mm512_reduce_add_ps(a[k]), bit for bit (GCC adds halves, then quarters, then (x0 + x2) + (x1 + x3);
// the same pairs are added here, 16 vectors at a time, in 45 shuffles and adds instead of 16 x 8)
static inline __m512 reduce16(const __m512* a) {
#ifdef __AVX512F__
  __m512 q[4];
  for (int g = 0; g < 4; g++) {  // q[g]'s 128-bit lane m: key g + 4 m, its 256-bit halves and quarters added
    auto half = [&](int x, int y) {  // [x.lo256 + x.hi256 | y.lo256 + y.hi256]
      return _mm512_add_ps(_mm512_shuffle_f32x4(a[x], a[y], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a[x], a[y], _MM_SHUFFLE(3, 2, 3, 2)));
    };
    const __m512 p1 = half(g, g + 4), p2 = half(g + 8, g + 12);
    q[g] = _mm512_add_ps(_mm512_shuffle_f32x4(p1, p2, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p1, p2, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // per 128-bit lane [t0, t1, t2, t3] of each q: (t0 + t2) and (t1 + t3), then their sum
  const __m512 r01 = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
  const __m512 r23 = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(r01, r23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(r01, r23, _MM_SHUFFLE(3, 2, 3, 2)));
#else
  alignas(64) float s[16];
  for (int k = 0; k < 16; k++) s[k] = _mm512_reduce_add_ps(a[k]);
  return _mm512_loadu_ps(s);
#endif
}

static inline float sumsq(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < n) {
    const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

static inline void split(int64_t n, int64_t unit, int tid, int nt, int64_t& a, int64_t& b) {
  int64_t units = (n + unit - 1) / unit, per = units / nt, rem = units % nt;
  int64_t ua = tid * per + std::min<int64_t>(tid, rem), ub = ua + per + (tid < rem ? 1 : 0);
  a = std::min(n, ua * unit);
  b = std::min(n, ub * unit);
}

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
static int64_t g_attn_prefetch = 2;  // attention: key / value tiles prefetched ahead (0: off; _set_attn_prefetch)
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
#include "quant.h"
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

// ------------------------------------------------------------------------------------------------ model
template <typename T>
static const T* ptr(const torch::Tensor& t) {
  return t.defined() && t.numel() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

struct Model {
  // geometry
  int64_t hidden, inter, L, H, Hkv, D, vocab, max_pos, max_rows;
  double eps, scale;
  bool bf16, dot, has_bias, qk_norm;
  int nthreads;
  // MoE feed-forward (layers with is_moe[l]): E experts of intermediate size minter, top_k per row, the top-k
  // weights renormalized when renorm (Mixtral, Qwen3-MoE with norm_topk_prob)
  int64_t minter = 0, E = 0, top_k = 0;
  bool renorm = false;
  std::vector<char> is_moe;
  // test hook: with record_moe, each forward logs one (layer, expert, rows) entry per expert GEMV pass
  bool record_moe = false;
  std::vector<std::vector<int64_t>> moe_log;
  // weights: the model's own tensors (no copies)
  torch::Tensor embed, final_norm, cos, sin;
  std::vector<torch::Tensor> in_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, post_norm, gu_w, down_w;
  // MoE layers (an empty tensor on dense ones): [E, hidden], [E, 2 * minter, hidden] (gate rows, then up rows),
  // [E, hidden, minter]
  std::vector<torch::Tensor> router_w, w13, w2;
  torch::Tensor scratch;  // activations for max_rows rows, exposed so the plugin can account for it
  // GGUF weights in their stored type (set_quant, quant.h): per layer qkv / o / gate_up / down, and the embedding
  // (also the LM head); a kDense entry means the dense tensor above. act: QAct, the activation mode; the
  // quantized-row buffers: per thread max_rows rows of q8_stride bytes
  std::vector<QW> q_qkv, q_o, q_gu, q_down;
  QW q_embed;
  std::vector<torch::Tensor> q_keep;
  int act = kActQ8;
  int64_t off_q8 = 0, q8_stride = 0;
  // batch invariance: a row's attention arithmetic depends only on its own context length (PyTorch's flash
  // attention, which the default path mirrors, switches exp variants at the padded batch's length)
  bool invariant = false;
  // bf16 models: attention's products through vdpbf16ps (see attend_nv; the same bits as the FMA path)
  bool attn_dot = false;
  std::vector<std::vector<int64_t>> tree_;  // forward()'s draft-tree rows per sequence (see attend)
  // Gemma 3 (set_gemma): every norm is x / rms(x) * (1 + w) with the float32 (1 + w) passed in (one rounding, as
  // transformers' Gemma3RMSNorm); post-norms on the attention and feed-forward outputs before their residual
  // adds; GeGLU (tanh GELU); the embedding times sqrt(hidden) (the factor rounded to the model dtype); local
  // layers read the last `window` positions and take their own RoPE tables (set_rope)
  bool gemma = false;
  float embed_scale = 1.f;
  int64_t window = 0;
  std::vector<char> is_local;
  std::vector<torch::Tensor> g_in, g_pa, g_pf, g_po, g_qn, g_kn;
  torch::Tensor g_final, cos_local, sin_local;
  // per-phase seconds seen by thread 0 (profile = true): GEMV, attention, barrier waits, the rest (norms, RoPE,
  // KV writes, residuals, embedding), the stored-type LM head (qlinear); prof_calls: forwards + LM-head calls
  bool profile = false;
  std::vector<double> prof = std::vector<double>(5, 0.0);
  int64_t prof_calls = 0;
  // tensor parallelism (set_tp): this rank's heads / intermediate / vocab rows are its shards of the weights;
  // the embedding holds vocab rows [vocab0, vocab0 + vocab) of vocab_total
  Comm comm;
  int64_t vocab0 = 0, vocab_total = 0;
  std::vector<int64_t> vocab_sizes;  // every rank's vocab rows (the logits gather)
  // scratch carve-up (bytes)
  int64_t off_x, off_xin, xin_stride, off_qkv, off_q, off_ain, off_tmp, off_gu, off_act;
  int64_t off_logit = 0, off_macc = 0, off_mact = 0, off_xg = 0, xg_stride = 0;  // MoE

  Model(int64_t hidden_, int64_t inter_, int64_t L_, int64_t H_, int64_t Hkv_, int64_t D_, double eps_, double scale_,
        bool bf16_, bool dot_, int64_t nthreads_, int64_t max_rows_, torch::Tensor embed_,
        std::vector<torch::Tensor> in_norm_, std::vector<torch::Tensor> qkv_w_, std::vector<torch::Tensor> qkv_b_,
        std::vector<torch::Tensor> q_norm_, std::vector<torch::Tensor> k_norm_, std::vector<torch::Tensor> o_w_,
        std::vector<torch::Tensor> post_norm_, std::vector<torch::Tensor> gu_w_, std::vector<torch::Tensor> down_w_,
        torch::Tensor final_norm_, torch::Tensor cos_, torch::Tensor sin_, int64_t moe_inter_, int64_t top_k_,
        bool renorm_, std::vector<int64_t> moe_, std::vector<torch::Tensor> router_w_,
        std::vector<torch::Tensor> w13_, std::vector<torch::Tensor> w2_)
      : hidden(hidden_), inter(inter_), L(L_), H(H_), Hkv(Hkv_), D(D_), max_rows(max_rows_), eps(eps_),
        scale(scale_), bf16(bf16_), dot(dot_ && bf16_ && kHaveDot), nthreads(int(nthreads_)), minter(moe_inter_),
        top_k(top_k_), renorm(renorm_), embed(embed_), final_norm(final_norm_), cos(cos_), sin(sin_),
        in_norm(in_norm_), qkv_w(qkv_w_), qkv_b(qkv_b_), q_norm(q_norm_), k_norm(k_norm_), o_w(o_w_),
        post_norm(post_norm_), gu_w(gu_w_), down_w(down_w_), router_w(router_w_), w13(w13_), w2(w2_) {
    const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
    TORCH_CHECK(D % 16 == 0 && D % 2 == 0, "lowlat: head_dim must be a multiple of 16, got ", D);
    TORCH_CHECK(H % Hkv == 0, "lowlat: num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(nthreads >= 1 && max_rows >= 1 && max_rows <= kMaxRows,
                "lowlat: threads must be >= 1 and max_rows in 1..", kMaxRows);
    TORCH_CHECK(D <= 512, "lowlat: head_dim must be <= 512, got ", D);
    vocab = vocab_total = embed.size(0);
    max_pos = cos.size(0);
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.size(1) == D && sin.sizes() == cos.sizes(),
                "lowlat: rotary tables must be contiguous float32 [max_pos, head_dim]");
    auto chk = [&](const torch::Tensor& t, std::vector<int64_t> shape, const char* what) {
      if (shape.size() == 2 && t.dim() == 2 && t.size(0) == shape[0] && t.size(1) == 0) return;  // set_quant's
      TORCH_CHECK(t.scalar_type() == wdt && t.is_contiguous() && t.device().is_cpu() && t.sizes() == shape,
                  "lowlat: ", what, " must be a contiguous CPU ", (bf16 ? "bfloat16" : "float32"), " tensor of shape ",
                  c10::IntArrayRef(shape), ", got ", t.scalar_type(), " ", t.sizes());
    };
    chk(embed, {vocab, hidden}, "embed_tokens.weight");
    chk(final_norm, {hidden}, "norm.weight");
    has_bias = !qkv_b.empty();
    qk_norm = !q_norm.empty();
    const int64_t nqkv = (H + 2 * Hkv) * D;
    is_moe.assign(L, 0);
    TORCH_CHECK(moe_.empty() || (int64_t)moe_.size() == L,
                "lowlat: the MoE layer flags must be empty or one per layer");
    for (int64_t l = 0; l < (int64_t)moe_.size(); l++) is_moe[l] = moe_[l] != 0;
    const bool any_moe = std::find(is_moe.begin(), is_moe.end(), 1) != is_moe.end();
    TORCH_CHECK((int64_t)in_norm.size() == L && (int64_t)qkv_w.size() == L && (int64_t)o_w.size() == L &&
                    (int64_t)post_norm.size() == L && (int64_t)gu_w.size() == L && (int64_t)down_w.size() == L &&
                    (!has_bias || (int64_t)qkv_b.size() == L) &&
                    (!qk_norm || ((int64_t)q_norm.size() == L && (int64_t)k_norm.size() == L)) &&
                    (!any_moe || ((int64_t)router_w.size() == L && (int64_t)w13.size() == L &&
                                  (int64_t)w2.size() == L)),
                "lowlat: one weight of each kind per layer expected (MoE weights: an empty tensor on dense layers)");
    if (any_moe) {
      for (int64_t l = 0; l < L; l++)
        if (is_moe[l]) { E = router_w[l].size(0); break; }
      TORCH_CHECK(E >= 1 && minter >= 1 && top_k >= 1 && top_k <= E,
                  "lowlat: MoE needs experts >= 1, intermediate size >= 1 and 1 <= top_k <= experts; got ", E, ", ",
                  minter, ", ", top_k);
    }
    for (int64_t l = 0; l < L; l++) {
      chk(in_norm[l], {hidden}, "input_layernorm.weight");
      chk(qkv_w[l], {nqkv, hidden}, "qkv_proj.weight");
      if (has_bias) chk(qkv_b[l], {nqkv}, "qkv_proj.bias");
      if (qk_norm) { chk(q_norm[l], {D}, "q_norm.weight"); chk(k_norm[l], {D}, "k_norm.weight"); }
      chk(o_w[l], {hidden, H * D}, "o_proj.weight");
      chk(post_norm[l], {hidden}, "post_attention_layernorm.weight");
      if (is_moe[l]) {
        chk(router_w[l], {E, hidden}, "mlp.gate.weight (MoE router)");
        chk(w13[l], {E, 2 * minter, hidden}, "mlp.experts.w13");
        chk(w2[l], {E, hidden, minter}, "mlp.experts.w2");
      } else {
        chk(gu_w[l], {2 * inter, hidden}, "gate_up_proj.weight");
        chk(down_w[l], {hidden, inter}, "down_proj.weight");
      }
    }
    // scratch: x [T, hidden] f32 | xin[nthreads] [T, hidden] X | qkv [T, nqkv] f32 | q [T, H*D] f32 |
    //          ain [T, H*D] X | tmp [T, hidden] f32 | gu [T, 2*max(inter, minter)] f32 | act [T, inter] X
    // MoE:     logit [T, E] f32 | macc [T, hidden] f32 | mact [T*top_k, minter] X | xg[nthreads] [T, hidden] X
    const int64_t T = max_rows, xs = dot ? 2 : 4;
    auto al = [](int64_t b) { return (b + 63) / 64 * 64; };
    int64_t o = 0;
    off_x = o; o += al(T * hidden * 4);
    off_xin = o; xin_stride = al(T * hidden * xs); o += nthreads * xin_stride;
    off_qkv = o; o += al(T * nqkv * 4);
    off_q = o; o += al(T * H * D * 4);
    off_ain = o; o += al(T * H * D * xs);
    off_tmp = o; o += al(T * hidden * 4);
    off_gu = o; o += al(T * 2 * std::max(inter, any_moe ? minter : 0) * 4);
    off_act = o; o += al(T * inter * xs);
    if (any_moe) {
      off_logit = o; o += al(T * E * 4);
      off_macc = o; o += al(T * hidden * 4);
      off_mact = o; o += al(T * top_k * minter * xs);
      off_xg = o; xg_stride = al(T * hidden * xs); o += nthreads * xg_stride;
    }
    scratch = torch::zeros({o + 64}, torch::kUInt8);
    q_qkv.assign(L, QW());
    q_o.assign(L, QW());
    q_gu.assign(L, QW());
    q_down.assign(L, QW());
  }

  template <typename X> X* buf(int64_t off) const {
    auto base = reinterpret_cast<uintptr_t>(scratch.data_ptr());
    return reinterpret_cast<X*>((base + 63) / 64 * 64 + off);
  }

  // a repacked weight from [qs, d(, m)] (lanner/models/quant.py), rows interleaved in groups of 16: qs uint8
  // [groups, blocks / 2, 8, 16, 4] is u4 (with m), int8 [groups, blocks, 8, 16, 4] s8; int16 scales
  // [groups, blocks, 16] are float16 per block of 32, int32 ones a K-quant's float32 (per 32 for u4, per 16 for s8)
  QW make_qw(const std::vector<torch::Tensor>& t, int64_t N, int64_t K, const std::string& what) {
    QW w;
    if (t.empty()) return w;
    TORCH_CHECK(t.size() == 2 || t.size() == 3, "lowlat: ", what, ": expected [qs, d] or [qs, d, m]");
    for (const auto& x : t) TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "lowlat: ", what, ": CPU contiguous");
    const auto& qs = t[0];
    w.fmt = qs.scalar_type() == torch::kUInt8 ? kU4 : kS8;
    w.N = N;
    w.K = K;
    w.nbp = ((K + 31) / 32 + 1) / 2 * 2;
    const int64_t G = w.groups();
    const bool kq = t[1].scalar_type() == at::kInt;
    const int64_t nd = kq && w.fmt == kS8 ? 2 * w.nbp : w.nbp;
    TORCH_CHECK(t[1].sizes() == c10::IntArrayRef({G, nd, kGroup}) && (kq || t[1].scalar_type() == at::kShort),
                "lowlat: ", what, ": scales must be int16 (float16 bits) or int32 (float32 bits) [", G, ", ", nd,
                ", 16]");
    TORCH_CHECK(!kq || w.nbp * 32 == K, "lowlat: ", what, ": K-quant rows must be whole blocks, got K = ", K);
    if (w.fmt == kU4) {
      TORCH_CHECK(t.size() == 3 && qs.sizes() == c10::IntArrayRef({G, w.nbp / 2, 8, kGroup, 4}) &&
                      t[2].sizes() == t[1].sizes() && t[2].scalar_type() == t[1].scalar_type(),
                  "lowlat: ", what, ": u4 needs qs [", G, ", ", w.nbp / 2, ", 8, 16, 4] uint8 and m like d");
    } else {
      TORCH_CHECK(qs.scalar_type() == at::kChar && qs.sizes() == c10::IntArrayRef({G, w.nbp, 8, kGroup, 4}),
                  "lowlat: ", what, ": s8 needs qs int8 [", G, ", ", w.nbp, ", 8, 16, 4]");
    }
    w.qs = reinterpret_cast<const uint8_t*>(qs.data_ptr());
    if (kq) {
      w.df = reinterpret_cast<const float*>(t[1].data_ptr());
      if (w.fmt == kU4) w.mf = reinterpret_cast<const float*>(t[2].data_ptr());
    } else {
      w.d = reinterpret_cast<const uint16_t*>(t[1].data_ptr());
      if (w.fmt == kU4) w.m = reinterpret_cast<const uint16_t*>(t[2].data_ptr());
    }
    for (const auto& x : t) q_keep.push_back(x);
    return w;
  }

  // GGUF weights in their stored type: ws = per layer [qkv, o, gate_up, down] (4 L entries, an empty list for a
  // dense one), then the embedding; act_mode: QAct (float, q8 or q16 activations). Sizes the quantized-row buffers.
  void set_quant(std::vector<std::vector<torch::Tensor>> ws, int64_t act_mode) {
    TORCH_CHECK(act_mode >= kActFloat && act_mode <= kActQ16, "lowlat.set_quant: act must be 0, 1 or 2");
    TORCH_CHECK((int64_t)ws.size() == 4 * L + 1, "lowlat.set_quant: expected ", 4 * L + 1, " weights");
    TORCH_CHECK(!dot, "lowlat: stored-type weights take float activations (no bf16 dot products)");
    const int64_t nqkv = (H + 2 * Hkv) * D;
    int64_t nbp_max = 0;
    for (int64_t l = 0; l < L; l++) {
      TORCH_CHECK(!is_moe[l] || (ws[4 * l + 2].empty() && ws[4 * l + 3].empty()), "lowlat: MoE layers stay dense");
      q_qkv[l] = make_qw(ws[4 * l], nqkv, hidden, "qkv_proj");
      q_o[l] = make_qw(ws[4 * l + 1], hidden, H * D, "o_proj");
      q_gu[l] = make_qw(ws[4 * l + 2], 2 * inter, hidden, "gate_up_proj");
      q_down[l] = make_qw(ws[4 * l + 3], hidden, inter, "down_proj");
      for (const QW* w : {&q_qkv[l], &q_o[l], &q_gu[l], &q_down[l]}) nbp_max = std::max(nbp_max, w->nbp);
    }
    q_embed = make_qw(ws[4 * L], vocab, hidden, "embed_tokens");
    nbp_max = std::max(nbp_max, q_embed.nbp);
    for (int64_t l = 0; l < L; l++) {  // every placeholder must have been supplied
      TORCH_CHECK((q_qkv[l].quant() || qkv_w[l].numel()) && (q_o[l].quant() || o_w[l].numel()) &&
                      (is_moe[l] || ((q_gu[l].quant() || gu_w[l].numel()) && (q_down[l].quant() || down_w[l].numel()))),
                  "lowlat: layer ", l, " lacks a weight (neither dense nor stored)");
    }
    TORCH_CHECK(q_embed.quant() || embed.numel(), "lowlat: the embedding is neither dense nor stored");
    act = int(act_mode);
    q8_stride = (act_row_bytes(nbp_max) + 63) / 64 * 64;
    off_q8 = scratch.numel();
    auto grown = torch::zeros({off_q8 + nthreads * max_rows * q8_stride + 64}, torch::kUInt8);
    grown.narrow(0, 0, off_q8).copy_(scratch);
    scratch = grown;
    off_q8 -= 64;  // buf() offsets start at the aligned base, at most 63 bytes in
    off_q8 = (off_q8 + 63) / 64 * 64;
  }
  char* q8buf(int tid) const { return buf<char>(off_q8 + tid * max_rows * q8_stride); }

  // Gemma 3: per layer the float32 (1 + w) of input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
  // post_feedforward_layernorm, q_norm and k_norm, then the final norm's; local: 1 for a sliding-window layer;
  // embed_scale: sqrt(hidden) as the model dtype rounds it. The constructor's norm weights are then unused.
  void set_gemma(std::vector<torch::Tensor> in, std::vector<torch::Tensor> pa, std::vector<torch::Tensor> pf,
                 std::vector<torch::Tensor> po, std::vector<torch::Tensor> qn, std::vector<torch::Tensor> kn,
                 torch::Tensor fin, std::vector<int64_t> local, int64_t window_, double embed_scale_) {
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
  void set_rope(torch::Tensor c, torch::Tensor s, torch::Tensor cl, torch::Tensor sl) {
    for (const auto* t : {&c, &s, &cl, &sl})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(1) == D &&
                      t->size(0) == c.size(0), "lowlat.set_rope: four contiguous float32 [max_pos, ", D, "] tables");
    cos = c; sin = s; cos_local = cl; sin_local = sl;
    max_pos = c.size(0);
  }

  // Gemma's norm of rows [t0, t1) of x: x / rms(x) * w1 in float32 (w1 = 1 + w), rounded once to the model dtype
  template <typename WT, typename DT>
  void norm1p(const float* x, const float* w1, DT* dst, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < t1; t++) {
      const float* xr = x + t * hidden;
      const float r = 1.0f / std::sqrt(sumsq(xr, hidden) / float(hidden) + float(eps));
      for (int64_t i = 0; i < hidden; i++) stf<DT>(dst, t * hidden + i, rnd<WT>(xr[i] * r * w1[i]));
    }
  }

  // columns [a, b) of T rows of a GEMV output rounded to the model dtype in place
  template <typename WT>
  void round_cols(float* y, int64_t T, int64_t a, int64_t b) const {
    if (std::is_same<WT, bf16_t>::value)
      for (int64_t t = 0; t < T; t++)
        for (int64_t c = a; c < b; c++) y[t * hidden + c] = rbf(y[t * hidden + c]);
  }

  // Gemma's post-norm + residual over this thread's columns [a, b): y holds the block's output (whole rows,
  // already in the model dtype); each thread takes every row's rms (cheap) rather than wait on a barrier more
  template <typename WT>
  void post_norm_add(const float* y, const float* w1, int64_t T, int64_t a, int64_t b) const {
    float* x = buf<float>(off_x);
    for (int64_t t = 0; t < T; t++) {
      const float* yr = y + t * hidden;
      const float r = 1.0f / std::sqrt(sumsq(yr, hidden) / float(hidden) + float(eps));
      for (int64_t c = a; c < b; c++) x[t * hidden + c] = rnd<WT>(x[t * hidden + c] + rnd<WT>(yr[c] * r * w1[c]));
    }
  }

  // one of the forward's matmuls: the stored-type kernel when the weight is quantized, else the dense GEMV.
  // quantize=false reuses the quantized rows the previous call left in this thread's buffer (same X)
  template <typename WT, typename XT>
  void mm(const QW& q, const torch::Tensor& dense, int64_t K, int64_t n0, int64_t n1, const XT* X, int64_t ldx, int M,
          float* out, int64_t ldo, int tid, bool quantize = true) const {
    if (!q.quant()) return gemv<WT, XT>(ptr<WT>(dense), K, n0, n1, X, ldx, M, out, ldo);
    if constexpr (std::is_same<XT, float>::value) {
      char* xq = q8buf(tid);
      if (quantize) prepare_rows(X, ldx, M, K, q.nbp, xq, q8_stride, act);
      qgemv(q, n0, n1, xq, q8_stride, act, M, out, ldo);
    }
  }

  // Joins a tensor-parallel group of P ranks as `rank`: `segment` is the shared segment (one host; every rank maps
  // the same file, zero-filled, of at least tp_segment_bytes()), or undefined to reduce with `py_reduce` (a
  // callable summing a float tensor in place over the ranks, False when it timed out). vocab_sizes: every rank's
  // vocabulary rows, in rank order.
  void set_tp(int64_t P, int64_t rank, std::vector<int64_t> vocab_sizes_, double timeout_s,
              c10::optional<torch::Tensor> segment, pybind11::object py_reduce) {
    TORCH_CHECK(P >= 2 && rank >= 0 && rank < P && (int64_t)vocab_sizes_.size() == P &&
                    vocab_sizes_[rank] == vocab && timeout_s > 0,
                "lowlat.set_tp: P >= 2 ranks, rank in 0..P-1, one vocab size per rank (this rank's = ", vocab,
                ") and a timeout > 0");
    TORCH_CHECK(!q_embed.quant() && q8_stride == 0, "lowlat: stored-type (GGUF) weights run on one rank only");
    comm = Comm();
    comm.P = P;
    comm.rank = rank;
    comm.nt = nthreads;
    comm.hidden = hidden;
    comm.rows = max_rows;
    comm.timeout_s = timeout_s;
    comm.seq = 1;  // the segment starts zeroed: flag 0 is "nothing published"
    vocab_sizes = vocab_sizes_;
    vocab0 = 0;
    for (int64_t r = 0; r < rank; r++) vocab0 += vocab_sizes[r];
    vocab_total = vocab0;
    for (int64_t r = rank; r < P; r++) vocab_total += vocab_sizes[r];
    comm.gather_cols = *std::max_element(vocab_sizes.begin(), vocab_sizes.end());
    comm.gather_rows = std::min<int64_t>(max_rows, kGatherRows);
    if (segment.has_value()) comm.map(*segment);
    else comm.py_reduce = py_reduce;
    // every rank must split the hidden columns alike: no team smaller than asked (OMP_DYNAMIC, thread limits)
    omp_set_dynamic(0);
    int team = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
      team = omp_get_num_threads();
    }
    TORCH_CHECK(team == nthreads, "lowlat: tensor parallelism needs teams of exactly ", nthreads,
                " OpenMP threads on every rank, this rank gets ", team);
  }
  static constexpr int64_t kGatherRows = 16;  // logits rows per gather exchange (bounds the segment's size)
  int64_t tp_segment_bytes(int64_t P, int64_t local_vocab_max) const {
    return Comm::bytes(P, nthreads, max_rows, hidden, std::min<int64_t>(max_rows, kGatherRows), local_vocab_max);
  }
  bool tp_aborted() const { return comm.aborted; }
  // (exchanges, seconds thread 0 waited for the other ranks in them) since the last call
  std::tuple<int64_t, double> tp_wait_stats() {
    std::tuple<int64_t, double> r{comm.exchanges, comm.wait_s};
    comm.exchanges = 0;
    comm.wait_s = 0;
    return r;
  }

  // Under TP: sums p (this rank's partial of columns [a, b) = split(hidden, 16) of thread tid, T rows, already in
  // the model's rounding) over the ranks, in place, as collective s. Every thread of every rank calls it.
  void tp_reduce(float* p, int64_t T, int64_t a, int64_t b, int tid, int64_t s, std::string& err) {
    if (comm.shared()) {
      float* mine = comm.red(s, comm.rank);
      for (int64_t t = 0; t < T; t++) std::memcpy(mine + t * hidden + a, p + t * hidden + a, (b - a) * sizeof(float));
      if (!comm.exchange(tid, s)) return;  // aborted: the step's result is dropped
      for (int64_t t = 0; t < T; t++)
        for (int64_t c = a; c < b; c++) {
          float v = 0.f;
          for (int64_t r = 0; r < comm.P; r++) v += comm.red(s, r)[t * hidden + c];
          p[t * hidden + c] = v;
        }
      return;
    }
#pragma omp barrier
    if (tid == 0 && err.empty()) {  // the process group: every collective is still issued after a timeout
      try {
        pybind11::gil_scoped_acquire gil;
        const bool ok = comm.py_reduce(torch::from_blob(p, {T, hidden}, torch::kFloat32)).cast<bool>();
        if (!ok) comm.aborted = true;
      } catch (const std::exception& e) {  // a failed peer: no exception may leave the parallel region
        err = e.what();
        comm.aborted = true;
      }
    }
#pragma omp barrier
  }

  // a row-parallel GEMV's raw partial (columns [a, b)): rounded as the module's output is, then summed over ranks
  template <typename WT>
  void tp_partial(float* p, int64_t T, int64_t a, int64_t b, int tid, int64_t s, std::string& err) {
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = a; c < b; c++) p[t * hidden + c] = rnd<WT>(p[t * hidden + c]);
    tp_reduce(p, T, a, b, tid, s, err);
  }

  // rms-normalize `rows` rows of x (float) with weight w into dst (packed GEMV input or model-dtype output):
  // the module computes weight * rms_norm(x.float()).to(dtype) with the product in the model dtype
  template <typename WT, typename DT>
  void rmsnorm(const float* x, const WT* w, DT* dst, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < t1; t++) {
      const float* xr = x + t * hidden;
      const float ss = sumsq(xr, hidden);
      const float r = 1.0f / std::sqrt(ss / float(hidden) + float(eps));
      for (int64_t i = 0; i < hidden; i++) stf<DT>(dst, t * hidden + i, rnd<WT>(ldf(w, i) * rnd<WT>(xr[i] * r)));
    }
  }

  // out = act(gate) * up over n elements: gate and up are raw GEMV outputs (float); like the module, bf16 models
  // round them, the activation and the product to bf16. Both activations are g * sigmoid(z): SiLU with z = g;
  // Gemma's GeGLU gelu_tanh(g) = 0.5 g (1 + tanh(v)), v = sqrt(2 / pi) (g + 0.044715 g^3) (ATen's inner term),
  // with z = 2 v: the same function without tanh's cancellation near 0
  template <typename WT, typename XT, bool kGelu>
  static void gated_mul(const float* g, const float* u, XT* out, int64_t n) {
    constexpr bool kBf = std::is_same<WT, bf16_t>::value;
    const float beta = float(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
      if (kBf) { gv = rbf16(gv); uv = rbf16(uv); }
      __m512 negz;
      if constexpr (kGelu) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
        const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_fmadd_ps(_mm512_set1_ps(kappa), cube, gv));
        negz = _mm512_mul_ps(_mm512_set1_ps(-2.f), inner);
      } else {
        negz = _mm512_sub_ps(_mm512_setzero_ps(), gv);
      }
      __m512 act = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(negz)));
      act = kBf ? rbf16(_mm512_mul_ps(rbf16(act), uv)) : _mm512_mul_ps(act, uv);
      float r16[16];
      _mm512_storeu_ps(r16, act);
      for (int e = 0; e < 16; e++) stf<XT>(out, i + e, r16[e]);
    }
    for (; i < n; i++) {
      const float gv = rnd<WT>(g[i]);
      const float negz = kGelu ? -2.f * (beta * (gv + kappa * gv * gv * gv)) : -gv;
      stf<XT>(out, i, rnd<WT>(rnd<WT>(gv / (1.f + std::exp(negz))) * rnd<WT>(u[i])));
    }
  }
  template <typename WT, typename XT>
  static void silu_mul(const float* g, const float* u, XT* out, int64_t n) { gated_mul<WT, XT, false>(g, u, out, n); }
  template <typename WT, typename XT>
  static void gelu_mul(const float* g, const float* u, XT* out, int64_t n) { gated_mul<WT, XT, true>(g, u, out, n); }

  // one attention item: the q heads h0 .. h0 + nh - 1 of one kv group (GQA), rows t0..t0+nq-1 of q at positions
  // pos[t] over keys 0..ctx-1. Each key and value vector is loaded once for all the item's (row, head) pairs.
  // The arithmetic follows PyTorch's CPU flash attention (what the engine's SDPA runs), so that bf16 results
  // agree bit for bit in nearly all elements: keys in blocks of 512 with an online softmax (running max,
  // rescaled sum and output); fexp_u20 (bf16) / exp_u20 (float32) on the 16-wide part of a block and std::exp
  // on its tail, where the block length is that of the padded batch (kv_len = max ctx over the batch); the sum
  // over float32 exponentials; bf16 models round the exponentials to bf16 for P @ V; output times 1 / sum.
  // Every (row, head) pair runs the same instructions in the same order whatever else shares its item, so how
  // heads are grouped into items (a scheduling choice) never changes a result.
  // anc: a draft tree's rows (nullptr: causal rows): row i reads the context before the step's first row and, of
  // the step's rows, those whose bit is set in anc[i] (its ancestors and itself), in that order: the keys, and so
  // the arithmetic, of a one-row step at its position (the depth) after its path was accepted.
  // win > 0 (a sliding-window layer): row i reads only the keys at positions > pos - win (its own position, tree
  // rows too); the key blocks stay at multiples of 512, so a row's arithmetic still depends on its keys alone
  template <typename WT, typename XT>
  void attend(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, int64_t kv_len,
              const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc, int64_t h0, int64_t nh,
              XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc = nullptr,
              int64_t win = 0) const {
    switch (D / 16) {  // the head size as a constant: the key, value and accumulator vectors stay in registers
      case 4: return attend_nv<WT, XT, 4>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win);
      case 8: return attend_nv<WT, XT, 8>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win);
      case 16: return attend_nv<WT, XT, 16>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win);
      default: return attend_nv<WT, XT, 0>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win);
    }
  }

  template <typename WT, typename XT, int NV>  // NV: D / 16, or 0 for any other head size (read at run time)
  void attend_nv(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, int64_t kv_len,
                 const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc, int64_t h0, int64_t nh,
                 XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc, int64_t win) const {
    constexpr int64_t kBlock = 512, kTile = 16, ldS = kBlock + kTile;  // (a tile's 16 scores may pass a block's end)
    constexpr bool kBf = std::is_same<WT, bf16_t>::value;
    constexpr int kReg = NV > 0 ? NV : 1;
    const int64_t nv = NV > 0 ? NV : D / 16;
    // the item's kv groups g0 .. g1 - 1 (adjacent in each cache row, read together); item row r = (step row r / nh,
    // head h0 + r % nh)
    const int64_t rep = H / Hkv, g0 = h0 / rep, g1 = (h0 + nh - 1) / rep + 1, ldq = H * D, R = nq * nh;
    auto heads_of = [&](int64_t gg, int64_t& a, int64_t& b) {  // the item's heads (offsets from h0) in group gg
      a = std::max(h0, gg * rep) - h0;
      b = std::min(h0 + nh, (gg + 1) * rep) - h0;
    };
    const int64_t ng = g1 - g0;
    const int64_t need = R * ldS + (ng * kTile + 1) * D + (R + ng * kTile) * D / 2;
    if ((int64_t)S.size() < need) S.resize(need);
    if ((int64_t)O.size() < R * (D + 2)) O.resize(R * (D + 2));
    // per kv group of the item, 16 keys or values as float32, then a zero row. The tiles are filled for all the
    // item's groups at once, key by key, so that the cache is read in address order (group by group the reads
    // strided through each row and the hardware prefetchers lagged: decode attention took 1.5-2.4x longer)
    float* tile = S.data() + R * ldS;
    float* zero = tile + ng * kTile * D;
    std::fill(zero, zero + D, 0.f);
#ifdef __AVX512BF16__
    // bf16 dot products: with bf16-exact q, keys, values and exponentials every product is exact in float32, and
    // vdpbf16ps adds a lane's odd element pair, then its even one, each sum rounded to nearest: the two roundings
    // of two FMAs. q and the keys are permuted so that lane l's odd / even elements are dims 32c + l / 32c + 16 + l
    // (the FMA path's chain order over its vectors 2c, 2c + 1), value pairs so that they are keys k / k + 1. So
    // the bits are the FMA path's (vdpbf16ps flushes denormals, which these values do not reach), with half the
    // multiply instructions and no float32 copy of the keys and values.
    constexpr bool kPairs = kBf && NV > 0 && NV % 2 == 0;
    const bool pairs = kPairs && attn_dot;
    // lanes 2l / 2l + 1 <- elements 16 + l / l of a 32-element vector
    const __m512i perm = _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24, 7, 23, 6, 22,
                                          5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
    uint16_t* qb = reinterpret_cast<uint16_t*>(zero + D);  // the item's q rows, bf16, permuted: [R][D]
    uint16_t* bt16 = qb + R * D;  // per kv group, 16 keys or 8 value pairs, permuted (filled as the tiles above)
    if (pairs)
      for (int64_t r = 0; r < R; r++) {
        const float* qi = q + (t0 + r / nh) * ldq + (h0 + r % nh) * D;
        for (int64_t c = 0; c < D / 32; c++) {
          const __m512i b =
              (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qi + 32 * c + 16), _mm512_loadu_ps(qi + 32 * c));
          _mm512_storeu_si512(qb + r * D + 32 * c, _mm512_permutexvar_epi16(perm, b));
        }
      }
#endif
    float* mx = O.data() + R * D;  // running max and sum per item row
    float* sum = mx + R;
    const __m512 scv = _mm512_set1_ps(float(scale));
    int64_t lim[kMaxRows], lo[kMaxRows];
    int64_t maxlim = 0, minlo = ctx;
    const int64_t c0 = ctx - nq;  // slot position of the step's first row
    int8_t path[64][64];  // tree row i's k-th key past the context is step row path[i][k] (a tree has <= 63 rows)
    if (anc != nullptr)
      for (int64_t i = 0; i < nq; i++)
        for (int64_t r = 0, k = 0; r <= i; r++)
          if ((anc[i] >> r) & 1) path[i][k++] = int8_t(r);
    // the cache slot of row i's j-th key (a shift and a mask for the usual power-of-two block size: an int64
    // division per key costs more than its dot product)
    const int shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll(uint64_t(bs)) : -1;
    auto slot = [&](int64_t i, int64_t j) {
      const int64_t p = anc != nullptr && j >= c0 ? c0 + path[i][j - c0] : j;
      return shift >= 0 ? (bt[p >> shift] << shift) + (p & (bs - 1)) : bt[p / bs] * bs + p % bs;
    };
    for (int64_t i = 0; i < nq; i++) {
      lim[i] = anc != nullptr ? c0 + __builtin_popcountll(uint64_t(anc[i])) : std::min(pos[t0 + i] + 1, ctx);
      lo[i] = win > 0 ? std::max<int64_t>(0, pos[t0 + i] - win + 1) : 0;
      maxlim = std::max(maxlim, lim[i]);
      minlo = std::min(minlo, lo[i]);
    }
    std::fill(mx, mx + R, -INFINITY);
    std::fill(sum, sum + R, 0.f);
    std::fill(O.begin(), O.begin() + R * D, 0.f);
    auto kv_at = [&](const WT* c, int64_t i, int64_t j, int64_t gg) { return c + (slot(i, j) * Hkv + gg) * D; };
    // the cache rows of the item's groups for keys j0 .. j0 + n_tiles * 16 - 1 (< end) into L2, each 64-byte line
    // once, ahead of their tiles: blocks sit scattered, so the hardware prefetchers restart at every block and the
    // tiles waited on memory (one decode row at 2000 tokens, 30 layers: 7.6 ms from DRAM, 3.2-4.1 from L3; with
    // this 4.6). Inline asm: GCC 12 dropped _mm_prefetch here. Into L1 it gained nothing (the misses queue there).
    auto prefetch = [&](const WT* c, int64_t j0, int64_t n_tiles, int64_t end) {
      if (g_attn_prefetch == 0) return;
      const int64_t bytes = (g1 - g0) * D * int64_t(sizeof(WT));
      uintptr_t next = 0;  // the first line not yet prefetched (rows of one block are adjacent)
      for (int64_t j = std::max<int64_t>(j0, 0), je2 = std::min(j0 + n_tiles * kTile, end); j < je2; j++) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(kv_at(c, 0, j, g0));
        for (uintptr_t l = std::max(a & ~uintptr_t(63), next); l < a + bytes; l += 64)
          asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(l)));
        next = (a + bytes + 63) & ~uintptr_t(63);
      }
    };
    // keys (or values) j0 .. j0 + nk - 1, shared by all rows, as float32 rows; zeros past nk
    const float* rows[kTile];
    auto gather = [&](const WT* c, int64_t j0, int64_t nk, int64_t gg) {
      for (int64_t k = 0; k < kTile; k++) {
        if (k >= nk) {
          rows[k] = zero;
          continue;
        }
        if (gg == g0)
          for (int64_t g = g0; g < g1; g++) {
            const WT* p = kv_at(c, 0, j0 + k, g);
            float* t = tile + ((g - g0) * kTile + k) * D;
            for (int64_t v = 0; v < nv; v++) _mm512_storeu_ps(t + v * 16, load16(p + v * 16));
          }
        rows[k] = tile + ((gg - g0) * kTile + k) * D;
      }
    };
#ifdef __AVX512BF16__
    // the keys j0 .. j0 + nk - 1 of all the item's groups (zeros past nk), permuted
    auto fill_keys = [&](int64_t j0, int64_t nk) {
      for (int64_t k = 0; k < kTile; k++)
        for (int64_t g = g0; g < g1; g++) {
          const WT* p = k < nk ? kv_at(kc, 0, j0 + k, g) : reinterpret_cast<const WT*>(zero);
          for (int64_t c = 0; c < NV / 2; c++)
            _mm512_storeu_si512(bt16 + ((g - g0) * kTile + k) * D + 32 * c,
                                _mm512_permutexvar_epi16(perm, _mm512_loadu_si512((const void*)(p + 32 * c))));
        }
    };
    // the values as 8 pairs [v(k) | v(k + 1)] per 16 dims, permuted
    auto fill_value_pairs = [&](int64_t j0, int64_t nk) {
      for (int64_t m = 0; m < kTile / 2; m++)
        for (int64_t g = g0; g < g1; g++) {
          const WT* pa = 2 * m < nk ? kv_at(vc, 0, j0 + 2 * m, g) : reinterpret_cast<const WT*>(zero);
          const WT* pb = 2 * m + 1 < nk ? kv_at(vc, 0, j0 + 2 * m + 1, g) : reinterpret_cast<const WT*>(zero);
          for (int64_t v = 0; v < NV; v++) {
            const __m512i ab =
                _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(pa + 16 * v))),
                                   _mm256_loadu_si256((const __m256i*)(pb + 16 * v)), 1);
            _mm512_storeu_si512(bt16 + (g - g0) * kTile * D + (m * NV + v) * 32, _mm512_permutexvar_epi16(perm, ab));
          }
        }
    };
#endif
    // one (row, head)'s score for one key: the 16-wide FMA chain, then the horizontal sum
    auto dot = [&](const float* qi, const WT* kp) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t v = 0; v < nv; v++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + v * 16), load16(kp + v * 16), acc);
      return _mm512_reduce_add_ps(acc) * float(scale);
    };
    for (int64_t n0 = minlo / kBlock * kBlock; n0 < maxlim; n0 += kBlock) {
      const int64_t n1 = std::min(n0 + kBlock, maxlim);
      const int64_t vec_end = n0 + (std::min(kBlock, kv_len - n0) / 16) * 16;  // exp_u20 below, std::exp above
      const int64_t jb = std::max(n0, minlo);
      // keys every row shares: jb .. je - 1; a draft tree's rows read their own keys from c0 on
      const int64_t je = anc != nullptr ? std::min(n1, std::max(c0, jb)) : n1, jt = std::max(jb, je);
      // scores of this block: S[r][j - n0]; 16 keys at a time, summed across lanes together (reduce16: the
      // bits of _mm512_reduce_add_ps per key)
      if (n0 == minlo / kBlock * kBlock) prefetch(kc, jb, g_attn_prefetch, je);
      for (int64_t j0 = jb; j0 < je; j0 += kTile) {
        const int64_t nk = std::min(kTile, je - j0);
        prefetch(kc, j0 + g_attn_prefetch * kTile, 1, je);
        for (int64_t gg = g0, ha, hb; gg < g1; gg++) {
          heads_of(gg, ha, hb);
#ifdef __AVX512BF16__
          if (pairs) {
            if (gg == g0) fill_keys(j0, nk);
          } else
#endif
            gather(kc, j0, nk, gg);
          for (int64_t i = 0; i < nq; i++) {
            if (j0 >= lim[i] || j0 + nk <= lo[i]) continue;
            for (int64_t hh = ha; hh < hb; hh++) {
              const float* qi = q + (t0 + i) * ldq + (h0 + hh) * D;
              __m512 acc[kTile];
              for (int64_t k = 0; k < kTile; k++) acc[k] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
              if (pairs) {
                const uint16_t* qr = qb + (i * nh + hh) * D;
                const uint16_t* kt = bt16 + (gg - g0) * kTile * D;
                __m512bh qv[kPairs ? NV / 2 : 1];
                for (int c = 0; c < NV / 2; c++) qv[c] = (__m512bh)_mm512_loadu_si512((const void*)(qr + 32 * c));
                for (int64_t k = 0; k < kTile; k++)
                  for (int c = 0; c < NV / 2; c++) acc[k] = dpbf16_mem(acc[k], qv[c], kt + k * D + 32 * c);
              } else
#endif
              if constexpr (NV > 0) {
                __m512 qv[kReg];
                for (int v = 0; v < NV; v++) qv[v] = _mm512_loadu_ps(qi + v * 16);
                for (int64_t k = 0; k < kTile; k++)
                  for (int v = 0; v < NV; v++)
                    acc[k] = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(rows[k] + v * 16), acc[k]);
              } else {
                for (int64_t v = 0; v < nv; v++) {
                  const __m512 qv = _mm512_loadu_ps(qi + v * 16);
                  for (int64_t k = 0; k < kTile; k++)
                    acc[k] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[k] + v * 16), acc[k]);
                }
              }
              _mm512_storeu_ps(S.data() + (i * nh + hh) * ldS + j0 - n0, _mm512_mul_ps(reduce16(acc), scv));
            }
          }
        }
      }
      for (int64_t j = jt; j < n1; j++)  // a draft tree's own rows
        for (int64_t i = 0; i < nq; i++) {
          if (j >= lim[i] || j < lo[i]) continue;
          for (int64_t gg = g0, ha, hb; gg < g1; gg++) {
            const WT* kp = kv_at(kc, i, j, gg);
            heads_of(gg, ha, hb);
            for (int64_t hh = ha; hh < hb; hh++)
              S[(i * nh + hh) * ldS + j - n0] = dot(q + (t0 + i) * ldq + (h0 + hh) * D, kp);
          }
        }
      prefetch(vc, jb, g_attn_prefetch, je);  // the first value tiles load while the softmax runs
      // online softmax update per item row
      for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / nh;
        const int64_t s0 = std::max(lo[i], n0) - n0;  // valid keys of row i in this block: s0 .. s0 + n - 1
        const int64_t n = std::min(lim[i], n1) - n0 - s0;
        if (n <= 0) continue;
        float* srow = S.data() + r * ldS + s0;
        __m512 mv = _mm512_set1_ps(mx[r]);  // the running max (a max is exact: the order is free)
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 mk = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
          const __m512 x = _mm512_mask_blend_ps(mk, _mm512_set1_ps(-INFINITY), _mm512_maskz_loadu_ps(mk, srow + j));
          mv = _mm512_max_ps(mv, x);
        }
        const float m = _mm512_reduce_max_ps(mv);
        mv = _mm512_set1_ps(m);
        const int64_t nvec = (invariant ? n : std::max<int64_t>(0, std::min(n, vec_end - n0 - s0))) / 16 * 16;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < nvec; j += 16) {
          const __m512 xm = _mm512_sub_ps(_mm512_loadu_ps(srow + j), mv);
          __m512 e = kBf ? exp512_fast(xm) : exp512_u20(xm);
          acc = _mm512_add_ps(acc, e);
          if (kBf) e = rbf16(e);
          _mm512_storeu_ps(srow + j, e);
        }
        float bsum = _mm512_reduce_add_ps(acc);
        for (int64_t j = nvec; j < n; j++) {
          const float e = std::exp(srow[j] - m);
          bsum += e;
          srow[j] = kBf ? rbf(e) : e;
        }
        const float corr = std::exp(mx[r] - m);  // exp(-inf) = 0 on the first block
        sum[r] = bsum + corr * sum[r];
        mx[r] = m;
        if (n0 > 0) {  // (zeros times 0 on a windowed row's first block)
          float* o = O.data() + r * D;
          for (int64_t d = 0; d < D; d++) o[d] *= corr;
        }
      }
      // P @ V for this block, keys in ascending order: the shared ones 16 at a time, each (row, head)'s output
      // held in registers over the tile, then a tree's own rows
      for (int64_t j0 = jb; j0 < je; j0 += kTile) {
        const int64_t nk = std::min(kTile, je - j0);
        prefetch(vc, j0 + g_attn_prefetch * kTile, 1, je);
        if (j0 + kTile >= je && n1 < maxlim) prefetch(kc, n1, g_attn_prefetch, std::min(n1 + kBlock, maxlim));
        for (int64_t gg = g0, ha, hb; gg < g1; gg++) {
          heads_of(gg, ha, hb);
#ifdef __AVX512BF16__
          if (pairs) {
            if (gg == g0) fill_value_pairs(j0, nk);
          } else
#endif
            gather(vc, j0, nk, gg);
          for (int64_t i = 0; i < nq; i++) {
            const int64_t ka = std::max(j0, lo[i]) - j0, kb = std::min(j0 + nk, lim[i]) - j0;
            if (ka >= kb) continue;
            for (int64_t hh = ha; hh < hb; hh++) {
              const int64_t r = i * nh + hh;
              const float* sr = S.data() + r * ldS + j0 - n0;
              float* o = O.data() + r * D;
#ifdef __AVX512BF16__
              if (pairs) {
                // the exponentials as bf16 pairs (p(k) in the odd half, p(k + 1) in the even one); a key outside
                // [ka, kb) gets p = 0: a zero product leaves a sum unchanged (o is never -0)
                const uint16_t* vt = bt16 + (gg - g0) * kTile * D;
                const __mmask16 mk = (__mmask16)(((1u << kb) - 1) & ~((1u << ka) - 1));
                alignas(32) uint32_t pp[kTile / 2];
                const __m256i pb16 = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, sr));
                _mm256_store_si256((__m256i*)pp, _mm256_rol_epi32(pb16, 16));
                __m512 ov[kReg];
                for (int v = 0; v < NV; v++) ov[v] = _mm512_loadu_ps(o + v * 16);
                const uint16_t* vp = vt + (ka / 2) * NV * 32;
                for (int64_t m = ka / 2; 2 * m < kb; m++, vp += NV * 32) {
                  const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pp[m]));
                  for (int v = 0; v < NV; v++) ov[v] = dpbf16_mem(ov[v], pv, vp + v * 32);
                }
                for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + v * 16, ov[v]);
              } else
#endif
              if constexpr (NV > 0) {
                __m512 ov[kReg];
                for (int v = 0; v < NV; v++) ov[v] = _mm512_loadu_ps(o + v * 16);
                for (int64_t k = ka; k < kb; k++) {
                  const __m512 p = _mm512_set1_ps(sr[k]);
                  for (int v = 0; v < NV; v++) ov[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows[k] + v * 16), ov[v]);
                }
                for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + v * 16, ov[v]);
              } else {
                for (int64_t k = ka; k < kb; k++) {
                  const __m512 p = _mm512_set1_ps(sr[k]);
                  for (int64_t v = 0; v < nv; v++)
                    _mm512_storeu_ps(o + v * 16, _mm512_fmadd_ps(p, _mm512_loadu_ps(rows[k] + v * 16),
                                                                 _mm512_loadu_ps(o + v * 16)));
                }
              }
            }
          }
        }
      }
      for (int64_t j = jt; j < n1; j++)
        for (int64_t i = 0; i < nq; i++) {
          if (j >= lim[i] || j < lo[i]) continue;
          for (int64_t gg = g0, ha, hb; gg < g1; gg++) {
            const WT* vp = kv_at(vc, i, j, gg);
            heads_of(gg, ha, hb);
            for (int64_t hh = ha; hh < hb; hh++) {
              const int64_t r = i * nh + hh;
              const __m512 p = _mm512_set1_ps(S[r * ldS + j - n0]);
              float* o = O.data() + r * D;
              for (int64_t v = 0; v < nv; v++)
                _mm512_storeu_ps(o + v * 16, _mm512_fmadd_ps(p, load16(vp + v * 16), _mm512_loadu_ps(o + v * 16)));
            }
          }
        }
    }
    for (int64_t r = 0; r < R; r++) {
      const int64_t i = r / nh, h = h0 + r % nh;
      const float inv = 1.0f / sum[r];
      for (int64_t d = 0; d < D; d++) stf<XT>(ain, (t0 + i) * ldq + h * D + d, rnd<WT>(O[r * D + d] * inv));
    }
  }

  // the attention items of a step with B sequences: (sequence, run of its q heads), numbered sequence-major. One
  // item per sequence reads each cache row (all kv groups, adjacent) in one pass; a single sequence splits its
  // heads into one run per thread.
  int64_t items_per_sequence(int64_t B, int nt) const { return std::min<int64_t>(H, (nt + B - 1) / B); }
  int64_t item_head(int64_t k, int64_t n) const { return k * H / n; }  // item k of n: heads item_head(k) ..
  int64_t item_heads(int64_t k, int64_t n) const { return (k + 1) * H / n - k * H / n; }
  // ---------------------------------------------------------------------------------------------- MoE
  // One thread's routing of a step's rows (every thread computes the same, privately: no barrier): per row the
  // top-k experts and weights, then the dispatch: a bitmap of the experts hit, each one's row count, and its rows
  // (ascending) with their weights packed from base[e] on, placed by the counts (no sort over the tokens).
  struct Route {
    std::vector<int64_t> ids;  // [T, top_k] as torch.topk returns them
    std::vector<float> w, p;   // [T, top_k] weights; p: one row's probabilities
    std::vector<std::pair<float, int64_t>> q;
    std::vector<uint64_t> hit;                        // bitmap over the experts
    std::vector<int32_t> cnt, base, fill, experts;    // per expert; experts: those hit, ascending
    std::vector<int32_t> rows;                        // [T * top_k]: expert e's rows at base[e] .. base[e] + cnt[e]
    std::vector<float> wts;                           // their routing weights
  };

  // torch.topk's comparator (CPU): larger first, NaN largest
  struct TopKCmp {
    bool operator()(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) const {
      return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
    }
  };

  // MoE.forward's router for one row: logits in the model dtype, float32 softmax over all experts (max, exp,
  // sum, times 1 / sum like ATen's softmax), top-k picked the way ATen's CPU topk picks them (std::nth_element +
  // std::sort, or a heap when k * 64 <= E, on (value, index) pairs with its comparator: the same experts on ties
  // of bf16 logits), then optionally divided by their sum
  template <typename WT>
  void topk_row(const float* lr, Route& rt, int64_t* ids, float* w) const {
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
  void route(const float* logit, int64_t T, Route& rt) const {
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
  void moe_ffn(int64_t l, int tid, int nt, const XT* xin, int64_t T, Route& rt, int64_t& s, std::string& err) {
    float* x = buf<float>(off_x);
    float* logit = buf<float>(off_logit);
    float* gu = buf<float>(off_gu);
    float* tmp = buf<float>(off_tmp);
    float* acc = buf<float>(off_macc);
    XT* mact = buf<XT>(off_mact);
    XT* xg = buf<XT>(off_xg + tid * xg_stride);
    int64_t a, b;
    split(E, 2, tid, nt, a, b);  // even bounds: each row pairs up the same way whatever the thread count
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
  std::tuple<torch::Tensor, torch::Tensor> test_route(torch::Tensor logits) const {
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

  template <typename WT, typename XT>
  void run(const int64_t* ids, const int64_t* pos, int64_t T, const std::vector<int64_t>& q_lens,
           const std::vector<int64_t>& ctx_lens, const Tables& gbts, int64_t bs,
           const std::vector<WT*>& kcs, const std::vector<WT*>& vcs, const std::vector<std::vector<int64_t>>& gslots,
           const std::vector<int64_t>& lgroup, const std::vector<int64_t>& row0, const std::vector<WT*>& cap_at,
           WT* out) {
    const int64_t B = (int64_t)q_lens.size(), nqkv = (H + 2 * Hkv) * D, half = D / 2;
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
                for (int64_t d = 0; d < half; d++) { rot[d] = -v[d + half]; rot[d + half] = v[d]; }
                for (int64_t d = 0; d < D; d++) {
                  const float c = rnd<WT>(cr[d]), s = rnd<WT>(sr[d]);
                  v[d] = rnd<WT>(rnd<WT>(v[d] * c) + rnd<WT>(rot[d] * s));
                }
              }
              if (hh < H) {
                std::memcpy(q + t * H * D + hh * D, v, D * sizeof(float));
              } else {
                WT* dst = (hh < H + Hkv ? kc : vc) + (slots[t] * Hkv + (hh < H + Hkv ? hh - H : hh - H - Hkv)) * D;
                for (int64_t d = 0; d < D; d++) stf<WT>(dst, d, v[d]);
              }
            }
          }
        }
        mark(3);
#pragma omp barrier
        mark(2);
        // --- attention over the paged cache: this thread's items (sequence, run of q heads)
        for (int64_t it = ia; it < ib; it++) {
          const int64_t sb = it / items_per_seq, k = it % items_per_seq;
          attend<WT, XT>(q, pos, row0[sb], q_lens[sb], ctx_lens[sb], kv_len, gbts[lgroup[l]][sb], bs, kcs[l], vcs[l],
                         item_head(k, items_per_seq), item_heads(k, items_per_seq), ain, S, O,
                         tree_[sb].empty() ? nullptr : tree_[sb].data(), local ? window : 0);
        }
        mark(1);
#pragma omp barrier
        mark(2);
        // --- o_proj + residual
        split(hidden, 16, tid, nt, a, b);
        mm<WT, XT>(q_o[l], o_w[l], H * D, a, b, ain, H * D, M, tmp, hidden, tid);
        mark(0);
        if (tp) tp_partial<WT>(tmp, T, a, b, tid, s++, err);
        if (gemma) {  // the post-norm needs whole rows of o_proj's output: one barrier more
          round_cols<WT>(tmp, T, a, b);
#pragma omp barrier
          post_norm_add<WT>(tmp, g_pa[l].data_ptr<float>(), T, a, b);
        } else {
          for (int64_t t = 0; t < T; t++)
            for (int64_t n = a; n < b; n++)
              x[t * hidden + n] = rnd<WT>(x[t * hidden + n] + rnd<WT>(tmp[t * hidden + n]));
        }
        mark(3);
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
        split(hidden, 16, tid, nt, a, b);
        mm<WT, XT>(q_down[l], down_w[l], inter, a, b, act, inter, M, tmp, hidden, tid);
        mark(0);
        if (tp) tp_partial<WT>(tmp, T, a, b, tid, s++, err);
        if (gemma) {
          round_cols<WT>(tmp, T, a, b);
#pragma omp barrier
          post_norm_add<WT>(tmp, g_po[l].data_ptr<float>(), T, a, b);
        } else {
          for (int64_t t = 0; t < T; t++)
            for (int64_t n = a; n < b; n++)
              x[t * hidden + n] = rnd<WT>(x[t * hidden + n] + rnd<WT>(tmp[t * hidden + n]));
        }
        mark(3);
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
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(
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
    for (int64_t l = 0; l < L; l++) {
      TORCH_CHECK(kv[l].size() == 2, "lowlat: kv_caches[", l, "] must be a (k_cache, v_cache) pair");
      for (int i = 0; i < 2; i++) {
        const auto& c = kv[l][i];
        TORCH_CHECK(c.dim() == 3 && c.size(1) == Hkv && c.size(2) == D && c.is_contiguous() &&
                        c.scalar_type() == wdt && c.device().is_cpu(),
                    "lowlat: kv cache of layer ", l, " must be a contiguous CPU ", wdt, " tensor [slots, ", Hkv, ", ",
                    D, "], got ", c.scalar_type(), " ", c.sizes());
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

  // the attention kernel on its own, for tests: q [T, H*D] (RoPE applied) over caches [slots, Hkv, D] that
  // already hold this step's K/V -> [T, H*D] in the model dtype
  torch::Tensor attention(torch::Tensor qt, torch::Tensor kc, torch::Tensor vc, torch::Tensor positions,
                          std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens,
                          std::vector<std::vector<int64_t>> bts, int64_t bs) const {
    const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
    const int64_t T = qt.size(0), B = (int64_t)q_lens.size();
    TORCH_CHECK(qt.dim() == 2 && qt.size(1) == H * D && T <= kMaxRows && positions.numel() == T &&
                    positions.scalar_type() == torch::kLong && kc.scalar_type() == wdt && vc.sizes() == kc.sizes() &&
                    vc.scalar_type() == wdt && kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 3 &&
                    kc.size(1) == Hkv && kc.size(2) == D && B >= 1 && (int64_t)ctx_lens.size() == B &&
                    (int64_t)bts.size() == B && bs >= 1,
                "lowlat.attention: bad inputs");
    auto qf = qt.to(torch::kFloat32).contiguous();
    auto pos = positions.contiguous();
    std::vector<int64_t> row0(B);
    for (int64_t b = 0, t = 0; b < B; t += q_lens[b], b++) {
      row0[b] = t;
      TORCH_CHECK(q_lens[b] >= 1 && ctx_lens[b] >= q_lens[b] && (int64_t)bts[b].size() * bs >= ctx_lens[b],
                  "lowlat.attention: sequence ", b, " does not fit its block table");
      for (int64_t j = 0; j < (ctx_lens[b] + bs - 1) / bs; j++)
        TORCH_CHECK(bts[b][j] >= 0 && (bts[b][j] + 1) * bs <= kc.size(0), "lowlat.attention: block out of range");
      for (int64_t i = 0; i < q_lens[b]; i++)
        TORCH_CHECK(t + i < T && pos.data_ptr<int64_t>()[t + i] == ctx_lens[b] - q_lens[b] + i,
                    "lowlat.attention: positions do not match q_lens/ctx_lens");
    }
    const int64_t kv_len = *std::max_element(ctx_lens.begin(), ctx_lens.end());
    std::vector<float> S, O, outf(T * H * D);
    auto run_all = [&](auto tag) {
      using WT = decltype(tag);
      const int64_t n = items_per_sequence(B, 1);  // the forward's items on one thread
      for (int64_t it = 0; it < B * n; it++) {
        const int64_t b = it / n, k = it % n;
        attend<WT, float>(qf.data_ptr<float>(), pos.data_ptr<int64_t>(), row0[b], q_lens[b], ctx_lens[b], kv_len,
                          bts[b], bs, reinterpret_cast<const WT*>(kc.data_ptr()),
                          reinterpret_cast<const WT*>(vc.data_ptr()), item_head(k, n), item_heads(k, n), outf.data(),
                          S, O);
      }
    };
    if (bf16) run_all(bf16_t{});
    else run_all(float{});
    return torch::from_blob(outf.data(), {T, H * D}, torch::kFloat32).to(wdt).clone();
  }

  // y = x @ W.T (+ bias) for a model-dtype x [M, K] and W [N, K]: the same GEMV as the forward, on its own
  // (the ablation's "C++ GEMV in the Python forward", and a fast LM head). out_float: float32 result (no
  // rounding to the model dtype).
  // (argmax: -> int64 [M], argmax_rows of the result)
  torch::Tensor linear(torch::Tensor x, torch::Tensor W, c10::optional<torch::Tensor> bias, bool out_float,
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

  // y = x @ W.T for a stored-type W ([qs, d(, m)], N rows of x's K columns), e.g. the tied Q8_0 LM head, with the
  // forward's kernels and activation mode -> [M, N] in the model dtype (out_float: float32)
  // (argmax: -> int64 [M], argmax_rows of the result: greedy decoding's LM head without the logits)
  torch::Tensor qlinear(torch::Tensor x, std::vector<torch::Tensor> w, int64_t N, bool out_float, bool argmax) {
    TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(0) <= max_rows, "lowlat.qlinear: x must be [M <= ",
                max_rows, ", K] on the CPU");
    const int64_t M = x.size(0), K = x.size(1);
    const size_t keep = q_keep.size();
    const QW q = make_qw(w, N, K, "qlinear weight");
    q_keep.resize(keep);  // the caller holds w for the call
    TORCH_CHECK(q.quant() && q8_stride >= act_row_bytes(q.nbp), "lowlat.qlinear: needs set_quant and a weight no "
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
      prepare_rows(xp, K, int(M), K, q.nbp, xq, q8_stride, act);
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
  torch::Tensor dequant_t(std::vector<torch::Tensor> w, int64_t N, int64_t K, int64_t a, int64_t b, bool to_bf16) {
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
        } else {  // s8: one block per chunk (K-quant "s8k": a scale per 16)
          for (int t = 0; t < 8; t++) {
            const __m512 d = q.kq() ? q.scale(g, 2 * c + t / 4) : q.scale(g, c);
            const __m512i v = _mm512_loadu_si512(p + 64 * t);
            for (int e = 0; e < 4; e++) {
              const __m512i x = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * e), 24);
              put(32 * c + 4 * t + e, g, _mm512_mul_ps(_mm512_cvtepi32_ps(x), d));
            }
          }
        }
      }
    return out;
  }

  // y [M, N] float32 logits -> int64 [M]: per row the first index of the largest value in the model dtype, as
  // torch's argmax of y.to(model dtype). Each thread scans the columns the LM head's GEMV gave it (the same
  // split, so still in its cache); the slices' bests then merge in column order.
  torch::Tensor argmax_rows(const torch::Tensor& y) const {
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

  // The LM head over a vocab-split weight under TP: every rank's x [M, hidden] @ its W shard [vocab, hidden].T,
  // gathered through the shared segment into the full [M, vocab_total] logits (in the model dtype) on every rank,
  // in chunks of gather_rows rows. Every rank calls it for the same M. Sets `aborted` (and returns garbage) when
  // the exchange timed out.
  torch::Tensor linear_gather(torch::Tensor x, torch::Tensor W) {
    g_invariant = invariant;
    TORCH_CHECK(comm.P > 1 && comm.shared(), "lowlat.linear_gather: needs set_tp with a shared segment");
    TORCH_CHECK(!comm.aborted, "lowlat: an earlier tensor-parallel step was aborted; this kernel is retired");
    TORCH_CHECK(W.dim() == 2 && W.size(0) == vocab_sizes[comm.rank], "lowlat.linear_gather: W must be this rank's ",
                vocab_sizes[comm.rank], " vocabulary rows");
    const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
    auto y = linear(x, W, c10::nullopt, true, false);  // [M, local vocab] float32
    const int64_t M = y.size(0), n = y.size(1), ld = comm.gather_cols;
    auto out = torch::empty({M, vocab_total}, torch::TensorOptions().dtype(torch::kFloat32));
    float* o = out.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t m0 = 0; m0 < M; m0 += comm.gather_rows) {
      const int64_t m1 = std::min(M, m0 + comm.gather_rows), s = comm.seq++;
      float* mine = comm.gat(s, comm.rank);
      for (int64_t m = m0; m < m1; m++) std::memcpy(mine + (m - m0) * ld, yp + m * n, n * sizeof(float));
      if (!comm.exchange(0, s)) break;
      for (int64_t r = 0, c0 = 0; r < comm.P; c0 += vocab_sizes[r], r++)
        for (int64_t m = m0; m < m1; m++)
          std::memcpy(o + m * vocab_total + c0, comm.gat(s, r) + (m - m0) * ld, vocab_sizes[r] * sizeof(float));
    }
    return out.to(wdt);
  }
};


// ------------------------------------------------------------------------------------------------ draft chain
// The EAGLE-style draft head's greedy chain in one call: k steps of (target embedding of the last draft token,
// two norms, QKV GEMV + RoPE + KV write, attention over the head's own paged cache, o_proj + residual, MLP,
// final norm, LM head over the draft vocabulary, argmax, draft -> target id) with no Python between steps. A
// Model with no layers lends its norm, attention, SiLU*up and scratch; the arithmetic and rounding are the
// plugin's Python head path (DraftHead.forward), so the tokens are the same.
struct Head {
  Model m;
  torch::Tensor in_norm, hid_norm, qkv_w, o_w, post_norm, gu_w, down_w, lm_w, d2t;
  int64_t vd;

  Head(int64_t hidden, int64_t inter, int64_t H, int64_t Hkv, int64_t D, double eps, double scale, bool bf16,
       bool dot, int64_t nthreads, int64_t max_rows, torch::Tensor embed, torch::Tensor in_norm_,
       torch::Tensor hid_norm_, torch::Tensor qkv_w_, torch::Tensor o_w_, torch::Tensor post_norm_,
       torch::Tensor gu_w_, torch::Tensor down_w_, torch::Tensor final_norm, torch::Tensor lm_w_, torch::Tensor d2t_,
       torch::Tensor cos, torch::Tensor sin)
      : m(hidden, inter, 0, H, Hkv, D, eps, scale, bf16, dot, nthreads, max_rows, embed, {}, {}, {}, {}, {}, {}, {},
          {}, {}, final_norm, cos, sin, 0, 0, false, {}, {}, {}, {}),
        in_norm(in_norm_), hid_norm(hid_norm_), qkv_w(qkv_w_), o_w(o_w_), post_norm(post_norm_), gu_w(gu_w_),
        down_w(down_w_), lm_w(lm_w_), d2t(d2t_) {
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
    const int64_t h = m.hidden, H = m.H, Hkv = m.Hkv, D = m.D, inter = m.inter, half = D / 2;
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
                for (int64_t d = 0; d < half; d++) { rot[d] = -v[d + half]; rot[d + half] = v[d]; }
                for (int64_t d = 0; d < D; d++) {
                  const float c = rnd<WT>(cr[d]), s = rnd<WT>(sr[d]);
                  v[d] = rnd<WT>(rnd<WT>(v[d] * c) + rnd<WT>(rot[d] * s));
                }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("have_avx512_bf16") = lowlat::kHaveDot;
#ifdef __AVX512F__
  m.attr("isa") = "avx512";
#else
  m.attr("isa") = "avx2";
#endif
  m.def("_set_attn_prefetch", [](int64_t tiles) { lowlat::g_attn_prefetch = tiles; },
        "attention: how many 16-key tiles ahead the cache rows are prefetched (0: off)");
  m.def("_set_qprefetch", [](int64_t bytes) { lowlat::g_qprefetch = bytes; },
        "stored-type GEMV: how many bytes of codes ahead the weight stream is prefetched into L1 (0: off)");
  m.def("_set_block_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 0 && rows <= 6, "lowlat: block rows must be in 0..6 (0: the mode's own)");
    lowlat::g_block_rows = int(rows);
  }, "stored-type GEMV: activation rows per block (0: the activation mode's own, q16 5, q8 6, float 4)");
  pybind11::class_<lowlat::Model>(m, "Model", pybind11::module_local())  // the AVX2 build loads beside it
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool, bool, int64_t,
                          int64_t, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, bool,
                          std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>>())
      .def("forward", &lowlat::Model::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_quant", &lowlat::Model::set_quant)
      .def("set_gemma", &lowlat::Model::set_gemma)
      .def("set_rope", &lowlat::Model::set_rope)
      .def_readonly("max_pos", &lowlat::Model::max_pos)
      .def("qlinear", &lowlat::Model::qlinear, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("n"), pybind11::arg("out_float") = false,
           pybind11::arg("argmax") = false)
      .def_readwrite("invariant", &lowlat::Model::invariant)
      .def_readwrite("attn_dot", &lowlat::Model::attn_dot)
      .def_readwrite("profile", &lowlat::Model::profile)
      .def_readwrite("prof", &lowlat::Model::prof)
      .def_readwrite("prof_calls", &lowlat::Model::prof_calls)
      .def("test_route", &lowlat::Model::test_route)
      .def_readwrite("record_moe", &lowlat::Model::record_moe)
      .def_readonly("moe_log", &lowlat::Model::moe_log)
      .def("attention", &lowlat::Model::attention)
      .def("dequant_t", &lowlat::Model::dequant_t)
      .def("set_tp", &lowlat::Model::set_tp)
      .def("tp_segment_bytes", &lowlat::Model::tp_segment_bytes)
      .def_property_readonly("tp_aborted", &lowlat::Model::tp_aborted)
      .def("tp_wait_stats", &lowlat::Model::tp_wait_stats)
      .def("linear_gather", &lowlat::Model::linear_gather, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("linear", &lowlat::Model::linear, pybind11::arg("x"), pybind11::arg("weight"),
           pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_float") = false,
           pybind11::arg("argmax") = false)
      .def_readonly("scratch", &lowlat::Model::scratch)
      .def_readonly("dot", &lowlat::Model::dot)
      .def_readonly("nthreads", &lowlat::Model::nthreads)
      .def_readonly("max_rows", &lowlat::Model::max_rows);
  pybind11::class_<lowlat::Head>(m, "Head", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool, bool, int64_t, int64_t,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("chain", &lowlat::Head::chain);
}
