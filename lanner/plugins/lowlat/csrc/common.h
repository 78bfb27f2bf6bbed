// lowlat's basics, shared by every kernel: the includes, bf16 <-> float32 scalars and vectors, the exp variants
// PyTorch's kernels use, horizontal sums, the argmax of a logits slice, and the split of work over threads.
#pragma once
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
#include <sys/syscall.h>
#include <unistd.h>

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

// Rotate-half RoPE of one head's row v (D floats) by its position's cos / sin rows, rounded as WT stores them;
// rot: D floats of scratch.
template <typename WT>
static inline void rope_row(float* v, float* rot, const float* cr, const float* sr, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d++) { rot[d] = -v[d + half]; rot[d + half] = v[d]; }
  for (int64_t d = 0; d < D; d++) {
    const float c = rnd<WT>(cr[d]), s = rnd<WT>(sr[d]);
    v[d] = rnd<WT>(rnd<WT>(v[d] * c) + rnd<WT>(rot[d] * s));
  }
}

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

// one row's online-softmax step over the n scores of a key block at s (replaced by their exponentials, rounded to
// bf16 for bf16 models): the first nvec (a multiple of 16) through the vector exp (fexp_u20 for bf16, exp_u20
// else), the rest through std::exp; m / sum: the row's running max and sum. Returns the factor its output so far
// is scaled by (0 on its first block: exp(-inf))
static inline float softmax_block(float* s, int64_t n, int64_t nvec, bool bf16, float& m, float& sum) {
  __m512 mv = _mm512_set1_ps(m);  // (a max is exact: the order is free)
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
    mv = _mm512_max_ps(mv, _mm512_mask_blend_ps(mk, _mm512_set1_ps(-INFINITY), _mm512_maskz_loadu_ps(mk, s + j)));
  }
  const float mnew = _mm512_reduce_max_ps(mv);
  mv = _mm512_set1_ps(mnew);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < nvec; j += 16) {
    const __m512 xm = _mm512_sub_ps(_mm512_loadu_ps(s + j), mv);
    __m512 e = bf16 ? exp512_fast(xm) : exp512_u20(xm);
    acc = _mm512_add_ps(acc, e);
    if (bf16) e = rbf16(e);
    _mm512_storeu_ps(s + j, e);
  }
  float bsum = _mm512_reduce_add_ps(acc);
  for (int64_t j = nvec; j < n; j++) {
    const float e = std::exp(s[j] - mnew);
    bsum += e;
    s[j] = bf16 ? rbf(e) : e;
  }
  const float corr = std::exp(m - mnew);
  sum = bsum + corr * sum;
  m = mnew;
  return corr;
}

// a key partition of an attention item (see Model::attend_parts): keys k0 .. k1 - 1 only, and with st set, each item
// row's unnormalized state (max, sum, output [D]) written to st + r * (D + 2) instead of the normalized output
struct KeyPart {
  int64_t k0 = 0, k1 = INT64_MAX;
  float* st = nullptr;
};

inline void store_part_state(float* st, float m, float sum, const float* o, int64_t D) {
  st[0] = m;
  st[1] = sum;
  std::memcpy(st + 2, o, D * sizeof(float));
}

// keys per attention partition. A row's keys are split at multiples of this; each part is attended on its own and
// the parts are folded in ascending order (fold_part). So threads can share one sequence's context
// (flash-decoding), and a row's bits still depend on its own keys alone, however the parts are scheduled.
constexpr int64_t kAttnPart = 512;

// acc (max, sum, output [D]) <- acc folded with the next part's state p (each relative to its own max)
inline void fold_part(float* acc, const float* p, int64_t D) {
  if (p[0] == -INFINITY) return;  // none of the row's keys lie in this part
  if (acc[0] == -INFINITY) {
    std::memcpy(acc, p, (D + 2) * sizeof(float));
    return;
  }
  const float m = std::max(acc[0], p[0]), ea = std::exp(acc[0] - m), ep = std::exp(p[0] - m);
  acc[1] = std::fma(p[1], ep, acc[1] * ea);
  const __m512 va = _mm512_set1_ps(ea), vp = _mm512_set1_ps(ep);
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(acc + 2 + d, _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 + d), vp,
                                                  _mm512_mul_ps(_mm512_loadu_ps(acc + 2 + d), va)));
  acc[0] = m;
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

}  // namespace lowlat
