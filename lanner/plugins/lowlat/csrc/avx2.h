// lowlat on AVX2 + FMA + F16C CPUs (no AVX-512): the AVX-512 intrinsics lowlat uses, each on a pair of 256-bit
// halves. common.h includes this after <immintrin.h> when the compiler targets no AVX-512F (an AVX2-only CPU,
// or the plugin's isa="avx2"); the macros at the end map the _mm512 names onto these functions, so the kernels
// stay one source. Lane-wise arithmetic is the same instruction per lane, and the reductions add in the order
// GCC's _mm512_reduce_* do, so results are bit-identical to the AVX-512F build (tests/test_lowlat_avx2.py).
#pragma once
#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "lowlat needs AVX-512F, or AVX2 with FMA and F16C"
#endif

namespace lw {

struct f512 {
  __m256 lo, hi;
};
struct i512 {
  __m256i lo, hi;
};

// int32 lanes all-ones where a bit of `bits` is set (bit i: lane i)
static inline __m256i lanes(unsigned bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits & 0xff)), sel), sel);
}
#define LW_F2(name, op) \
  static inline f512 name(f512 a, f512 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
#define LW_I2(name, op) \
  static inline i512 name(i512 a, i512 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
LW_F2(add_ps, _mm256_add_ps)
LW_F2(sub_ps, _mm256_sub_ps)
LW_F2(mul_ps, _mm256_mul_ps)
LW_F2(div_ps, _mm256_div_ps)
LW_F2(max_ps, _mm256_max_ps)
LW_F2(min_ps, _mm256_min_ps)
LW_I2(add_epi32, _mm256_add_epi32)
LW_I2(and_si512, _mm256_and_si256)
LW_I2(xor_si512, _mm256_xor_si256)
LW_I2(mullo_epi32, _mm256_mullo_epi32)
LW_I2(madd_epi16, _mm256_madd_epi16)
LW_I2(maddubs_epi16, _mm256_maddubs_epi16)
LW_I2(shuffle_epi8, _mm256_shuffle_epi8)
#undef LW_F2
#undef LW_I2

static inline f512 set1_ps(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline f512 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline f512 loadu_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
static inline void storeu_ps(void* p, f512 a) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, a.lo);
  _mm256_storeu_ps(f + 8, a.hi);
}
// masked lanes are not read (no fault past the end) and read as 0
static inline f512 maskz_loadu_ps(unsigned m, const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_maskload_ps(f, lanes(m)), _mm256_maskload_ps(f + 8, lanes(m >> 8))};
}
static inline void mask_storeu_ps(void* p, unsigned m, f512 a) {
  float* f = static_cast<float*>(p);
  _mm256_maskstore_ps(f, lanes(m), a.lo);
  _mm256_maskstore_ps(f + 8, lanes(m >> 8), a.hi);
}
static inline f512 fmadd_ps(f512 a, f512 b, f512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline f512 fnmadd_ps(f512 a, f512 b, f512 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline f512 abs_ps(f512 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
static inline f512 floor_ps(f512 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
template <int kRound>  // the rounding-control bits (scale 0, the only use)
static inline f512 roundscale_ps(f512 a) {
  return {_mm256_round_ps(a.lo, kRound & 0xf), _mm256_round_ps(a.hi, kRound & 0xf)};
}
// a * 2^floor(b) in one rounding, as vscalefps: two exact steps of 2^k with k in the normal range
static inline __m256 pow2i(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
static inline __m256 scalef8(__m256 a, __m256 b) {
  const __m256i n = _mm256_cvttps_epi32(_mm256_floor_ps(b)), h = _mm256_srai_epi32(n, 1);
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2i(h)), pow2i(_mm256_sub_epi32(n, h)));
}
static inline f512 scalef_ps(f512 a, f512 b) { return {scalef8(a.lo, b.lo), scalef8(a.hi, b.hi)}; }

// GCC's _mm512_reduce_add_ps / _max_ps order: halves, quarters, then pairs
static inline float reduce_add_ps(f512 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
static inline float reduce_max_ps(f512 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
static inline int reduce_add_epi32(i512 a) {
  const __m256i t3 = _mm256_add_epi32(a.hi, a.lo);
  const __m128i t6 = _mm_add_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
  const __m128i t8 = _mm_add_epi32(t6, _mm_shuffle_epi32(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(t8) + _mm_cvtsi128_si32(_mm_shuffle_epi32(t8, 1));
}

template <int kCmp>
static inline unsigned cmp_ps_mask(f512 a, f512 b) {
  return unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kCmp))) |
         (unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kCmp))) << 8);
}
static inline f512 mask_blend_ps(unsigned m, f512 a, f512 b) {  // b where the bit is set
  return {_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(lanes(m))),
          _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(lanes(m >> 8)))};
}
static inline f512 mask_add_ps(f512 src, unsigned m, f512 a, f512 b) { return mask_blend_ps(m, src, add_ps(a, b)); }
static inline i512 mask_mov_epi32(i512 src, unsigned m, i512 a) {
  return {_mm256_blendv_epi8(src.lo, a.lo, lanes(m)), _mm256_blendv_epi8(src.hi, a.hi, lanes(m >> 8))};
}
static inline __m256 perm16(__m256i k, __m256 lo, __m256 hi) {  // lanes k & 15 of {lo, hi}
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, k), _mm256_permutevar8x32_ps(hi, k),
                          _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)));
}
static inline f512 permutexvar_ps(i512 idx, f512 a) { return {perm16(idx.lo, a.lo, a.hi), perm16(idx.hi, a.lo, a.hi)}; }

// conversions and casts
static inline f512 cvtepi32_ps(i512 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline i512 cvtps_epi32(f512 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
static inline i512 cvttps_epi32(f512 a) { return {_mm256_cvttps_epi32(a.lo), _mm256_cvttps_epi32(a.hi)}; }
template <int kRound>
static inline i512 cvt_roundps_epi32(f512 a) { return cvtps_epi32(roundscale_ps<kRound>(a)); }
static inline f512 castsi512_ps(i512 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
static inline i512 castps_si512(f512 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
static inline f512 castps128_ps512(__m128 a) { return {_mm256_castps128_ps256(a), _mm256_setzero_ps()}; }
static inline i512 castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }
static inline i512 inserti64x4(i512 a, __m256i b, int hi) { return hi ? i512{a.lo, b} : i512{b, a.hi}; }
static inline i512 cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
static inline i512 cvtepu8_epi32(__m128i a) { return {_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))}; }
static inline i512 cvtepi8_epi32(__m128i a) { return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))}; }
static inline __m128i cvtsepi32_epi8(i512 a) {  // int32 -> int16 -> int8, both saturating: the int32 -> int8 clamp
  const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(a.lo), _mm256_extracti128_si256(a.lo, 1));
  const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(a.hi), _mm256_extracti128_si256(a.hi, 1));
  return _mm_packs_epi16(w0, w1);
}
static inline f512 cvtph_ps(__m256i a) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}

// integers
static inline i512 set1_epi32(int a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
static inline i512 set1_epi16(short a) { return {_mm256_set1_epi16(a), _mm256_set1_epi16(a)}; }
static inline i512 set1_epi8(char a) { return {_mm256_set1_epi8(a), _mm256_set1_epi8(a)}; }
static inline i512 broadcast_i32x4(__m128i a) { return {_mm256_broadcastsi128_si256(a), _mm256_broadcastsi128_si256(a)}; }
static inline i512 setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline i512 set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7, int e6,
                             int e5, int e4, int e3, int e2, int e1, int e0) {
  return {_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0), _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8)};
}
static inline i512 loadu_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
static inline void storeu_si512(void* p, i512 a) {
  __m256i* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, a.lo);
  _mm256_storeu_si256(q + 1, a.hi);
}
static inline i512 slli_epi32(i512 a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
static inline i512 srli_epi32(i512 a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
static inline i512 srai_epi32(i512 a, int n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }
// the low 16 bits of each int32 lane (lanes holding 0 .. 65535), in lane order
static inline __m256i cvtepi32_epi16(i512 a) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a.lo, a.hi), 0xd8);
}
static inline i512 abs_epi8(i512 a) { return {_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)}; }
static inline i512 sign_epi8(i512 a, i512 b) { return {_mm256_sign_epi8(a.lo, b.lo), _mm256_sign_epi8(a.hi, b.hi)}; }
// 16 x 16-bit lanes, masked ones not read: the AVX512BW/VL load. Whole vectors are one load, and masks that keep
// or drop lanes in pairs (the even block counts of the quantized rows) one 32-bit maskload; only odd masks copy
// lane by lane (a store-forwarding stall: slow)
static inline __m256i maskz_loadu_epi16_256(unsigned m, const void* p) {
  m &= 0xffff;
  if (m == 0xffff) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  if (((m ^ (m >> 1)) & 0x5555) == 0) {  // pairs: bit 2i == bit 2i + 1; keep the even bits, packed into 8
    unsigned e = m & 0x5555;
    e = (e | (e >> 1)) & 0x3333;
    e = (e | (e >> 2)) & 0x0f0f;
    e = (e | (e >> 4)) & 0x00ff;
    return _mm256_maskload_epi32(static_cast<const int*>(p), lanes(e));
  }
  alignas(32) uint16_t b[16] = {};
  const uint16_t* s = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; i++)
    if (m >> i & 1) b[i] = s[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}

}  // namespace lw

#define __m512 lw::f512
#define __m512i lw::i512
#define _mm512_add_ps lw::add_ps
#define _mm512_sub_ps lw::sub_ps
#define _mm512_mul_ps lw::mul_ps
#define _mm512_div_ps lw::div_ps
#define _mm512_max_ps lw::max_ps
#define _mm512_min_ps lw::min_ps
#define _mm512_add_epi32 lw::add_epi32
#define _mm512_and_si512 lw::and_si512
#define _mm512_xor_si512 lw::xor_si512
#define _mm512_mullo_epi32 lw::mullo_epi32
#define _mm512_madd_epi16 lw::madd_epi16
#define _mm512_maddubs_epi16 lw::maddubs_epi16
#define _mm512_shuffle_epi8 lw::shuffle_epi8
#define _mm512_set1_ps lw::set1_ps
#define _mm512_setzero_ps lw::setzero_ps
#define _mm512_loadu_ps lw::loadu_ps
#define _mm512_storeu_ps lw::storeu_ps
#define _mm512_maskz_loadu_ps lw::maskz_loadu_ps
#define _mm512_mask_storeu_ps lw::mask_storeu_ps
#define _mm512_fmadd_ps lw::fmadd_ps
#define _mm512_fnmadd_ps lw::fnmadd_ps
#define _mm512_abs_ps lw::abs_ps
#define _mm512_floor_ps lw::floor_ps
#define _mm512_roundscale_ps(a, r) lw::roundscale_ps<(r)>(a)
#define _mm512_scalef_ps lw::scalef_ps
#define _mm512_reduce_add_ps lw::reduce_add_ps
#define _mm512_reduce_max_ps lw::reduce_max_ps
#define _mm512_reduce_add_epi32 lw::reduce_add_epi32
#define _mm512_cmp_ps_mask(a, b, c) lw::cmp_ps_mask<(c)>(a, b)
#define _mm512_mask_blend_ps lw::mask_blend_ps
#define _mm512_mask_add_ps lw::mask_add_ps
#define _mm512_mask_mov_epi32 lw::mask_mov_epi32
#define _mm512_permutexvar_ps lw::permutexvar_ps
#define _mm512_cvtepi32_ps lw::cvtepi32_ps
#define _mm512_cvtepi32_epi16 lw::cvtepi32_epi16
#define _mm512_cvtps_epi32 lw::cvtps_epi32
#define _mm512_cvttps_epi32 lw::cvttps_epi32
#define _mm512_cvt_roundps_epi32(a, r) lw::cvt_roundps_epi32<(r)>(a)
#define _mm512_castsi512_ps lw::castsi512_ps
#define _mm512_castps_si512 lw::castps_si512
#define _mm512_castps128_ps512 lw::castps128_ps512
#define _mm512_castsi256_si512 lw::castsi256_si512
#define _mm512_inserti64x4 lw::inserti64x4
#define _mm512_cvtepu16_epi32 lw::cvtepu16_epi32
#define _mm512_cvtepu8_epi32 lw::cvtepu8_epi32
#define _mm512_cvtepi8_epi32 lw::cvtepi8_epi32
#define _mm512_cvtsepi32_epi8 lw::cvtsepi32_epi8
#define _mm512_cvtph_ps lw::cvtph_ps
#define _mm512_set1_epi32 lw::set1_epi32
#define _mm512_set1_epi16 lw::set1_epi16
#define _mm512_set1_epi8 lw::set1_epi8
#define _mm512_setzero_si512 lw::setzero_si512
#define _mm512_broadcast_i32x4 lw::broadcast_i32x4
#define _mm512_set_epi32 lw::set_epi32
#define _mm512_loadu_si512 lw::loadu_si512
#define _mm512_storeu_si512 lw::storeu_si512
#define _mm512_slli_epi32 lw::slli_epi32
#define _mm512_srli_epi32 lw::srli_epi32
#define _mm512_srai_epi32 lw::srai_epi32
#define _mm512_abs_epi8 lw::abs_epi8
#define _mm256_maskz_loadu_epi16 lw::maskz_loadu_epi16_256
