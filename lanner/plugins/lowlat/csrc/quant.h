// lowlat's GEMV over GGUF blocks kept in their stored type (issue 18), in the layouts lanner/models/quant.py
// repacks them into without changing a value:
//   u4: 4-bit codes q, a scale d and offset m per block of 32 (w = d * q + m; Q4_1, Q4_0 as m = -8 d, Q4_K).
//       32 bytes of a row hold two blocks: low nibbles the even block's 32 codes in element order, high nibbles
//       the odd block's.
//   s8: int8 codes, a scale d per block of 32 (w = d * q; Q8_0, Q5_0 widened).
//   u6: Q6_K's 6-bit codes u = q + 32 (w = d * (u - 32)), a scale per 16, as two planes (u6_codes): 384 bytes per
//       block and group instead of s8's 512.
//   u5: Q5_K's 5-bit codes q in u6's layout, a scale and offset per block of 32 (w = d * q + m).
// Scales are float16 (int16 bits) per block, or a K-quant's as stored: integer sub-block scales (u4k: uint8 sc and
// mins mn per 32; u6k: int8 sc per 16) and float16 super-block scales (sd, and u4k's sm = -dmin per 256),
// multiplied out per sub-block (exact in float32). Rows have an even block count (zero-padded).
//
// Rows are interleaved in groups of 16 (lanner/models/quant.py, GROUP): a group's codes are 512-byte chunks (a
// u4 block pair or an s8 block; u6: 384 bytes), each 8 (u6: 6) vectors of 64 bytes; vector t holds, for row i of
// the group, bytes 4t..4t+3 of that row's 32 in 32-bit lane i. So one vpdpbusd against 4 activation codes
// broadcast to every lane adds 4 products to each of the 16 rows' sums: no horizontal reductions, the unpacked
// codes serve 16 rows, and the scales of 16 rows are one vector (scales [groups, blocks, 16]). A row's output is
// a lane of its group's.
//
// Activation modes (the row is prepared once per GEMV input per thread, ARow):
//   q8:    per block of 32, int8 codes with a float16-rounded scale, as llama.cpp's quantize_row_q8_0/q8_1.
//   q16:   per block of 32, codes x16 in [-16256, 16256] with a float32 scale (3e-5 of the block's largest
//          magnitude: float quality, where q8 visibly changes a small model's text), held as two int8 planes
//          h = x16 >> 7 and l = x16 & 127 (x16 = 128 h + l): two vpdpbusd per code vector, the same integers.
//   float: x itself; the exact integer codes are FMA'd against it and scaled per block.
// u4 codes (0..15) are vpdpbusd's unsigned operand as they are; s8 codes go in biased (xor 0x80) with the bias
// taken off by starting the sum at -128 * sum(x codes) (per 16 elements, ARow::nc); u6 codes (0..63) are unsigned
// with the bias 32 taken off alike in every build. Without VNNI the same sums
// come from vpmaddubsw + vpmaddwd (s8: |w| and x with w's sign; |128 w| products cannot saturate: |x| <= 127).
// Integer sums are exact, so VNNI, AVX512BW and AVX2 builds give the same bits.
// Batch invariance: a (weight row, activation row) pair is one lane under the same instruction sequence whatever
// the number of rows in the step or how they are grouped, so a row's output bits do not depend on the other rows.
#pragma once
#include "common.h"

namespace lowlat {

enum QFmt : int { kDense = 0, kU4 = 1, kS8 = 2, kU6 = 3, kU5 = 4 };
enum QAct : int { kActFloat = 0, kActQ8 = 1, kActQ16 = 2 };  // the activation modes above
constexpr int64_t kGroup = 16;                                 // weight rows per interleaved group

struct QW {  // one repacked weight [N, K]; the pointers are into tensors the plugin keeps alive
  int fmt = kDense;
  int64_t N = 0, K = 0, nbp = 0;  // nbp: blocks per row, padded to even
  const uint8_t* qs = nullptr;
  const uint16_t* d = nullptr;  // float16 scale (and u4 offset m) per block of 32
  const uint16_t* m = nullptr;
  const uint8_t* sc = nullptr;  // K-quants: sub-block scales (u4k / u5k: uint8 per 32 with mins mn; u6k: int8 per 16)
  const uint8_t* mn = nullptr;
  const uint16_t* sd = nullptr;  // K-quants: float16 super-block scales (u4k: sm = -dmin too)
  const uint16_t* sm = nullptr;
  bool quant() const { return fmt != kDense; }
  bool kq() const { return sd != nullptr; }
  int64_t groups() const { return (N + kGroup - 1) / kGroup; }
  int64_t chunks() const { return fmt == kU4 ? nbp / 2 : nbp; }       // code chunks per group
  bool six() const { return fmt == kU6 || fmt == kU5; }               // codes in u6_codes' layout
  bool mins() const { return fmt == kU4 || fmt == kU5; }              // w = d * q + m
  int64_t chunk_bytes() const { return six() ? 384 : 512; }           // 16 rows x 32 codes (u4: x 64)
  int64_t units() const { return fmt == kU6 ? 2 * nbp : nbp; }         // scales per row
  int64_t supers() const { return nbp / 8; }                           // K-quant super-blocks per row
  const uint8_t* chunk(int64_t g, int64_t c) const { return qs + (g * chunks() + c) * chunk_bytes(); }
  // the 16 rows' float16 super-block values of scale unit j
  __m512 super(const uint16_t* p, int64_t g, int64_t j) const {
    const int64_t s = j / (units() / supers());
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + (g * supers() + s) * kGroup)));
  }
  // the 16 rows' scale (offset) of scale unit j in group g
  __m512 scale(int64_t g, int64_t j) const {
    const int64_t i = (g * units() + j) * kGroup;
    if (!kq()) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + i)));
    const __m128i c = _mm_loadu_si128((const __m128i*)(sc + i));
    const __m512i ci = fmt == kU6 ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c);
    return _mm512_mul_ps(super(sd, g, j), _mm512_cvtepi32_ps(ci));
  }
  __m512 offset(int64_t g, int64_t j) const {
    const int64_t i = (g * units() + j) * kGroup;
    if (!kq()) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + i)));
    const __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mn + i)));
    return _mm512_mul_ps(super(sm, g, j), _mm512_cvtepi32_ps(ci));
  }
  float scale_at(int64_t n, int64_t j) const {
    const int64_t i = ((n / kGroup) * units() + j) * kGroup + n % kGroup;
    if (!kq()) return _cvtsh_ss(d[i]);
    const int64_t s = ((n / kGroup) * supers() + j / (units() / supers())) * kGroup + n % kGroup;
    return _cvtsh_ss(sd[s]) * float(fmt == kU6 ? int(int8_t(sc[i])) : int(sc[i]));
  }
  float offset_at(int64_t n, int64_t j) const {
    const int64_t i = ((n / kGroup) * units() + j) * kGroup + n % kGroup;
    if (!kq()) return _cvtsh_ss(m[i]);
    const int64_t s = ((n / kGroup) * supers() + j / (units() / supers())) * kGroup + n % kGroup;
    return _cvtsh_ss(sm[s]) * float(int(mn[i]));
  }
};

// A weight as row segments of stored-type weights (a fused projection whose pieces differ in format, e.g. Q4_K
// q / k rows beside Q6_K v rows; most weights are one segment). Segments start at multiples of 16 rows.
struct QMat {
  std::vector<QW> seg;
  std::vector<int64_t> row0;  // each segment's first row
  bool quant() const { return !seg.empty(); }
  int64_t nbp() const { return seg[0].nbp; }
};

static inline float f2h2f(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }

// One activation row prepared for the kernels: the codes (q8: q; q16: h in q, l in l) or the float row (x), and
// per block the codes' scale d and s = d * sum(codes) (float: sum(x); u4's offset term), per 16 elements
// nc = -128 * sum(q) and ncl = -128 * sum(l) (the s8 bias under VNNI).
struct ARow {
  int8_t* q;
  int8_t* l;
  float* x;
  float* d;
  float* s;
  int32_t* nc;
  int32_t* ncl;
  static int64_t bytes(int64_t nbp) { return nbp * (128 + 4 + 4 + 8 + 8); }
  static ARow at(char* base, int64_t nbp) {
    char* t = base + nbp * 128;
    return {reinterpret_cast<int8_t*>(base), reinterpret_cast<int8_t*>(base + nbp * 32),
            reinterpret_cast<float*>(base), reinterpret_cast<float*>(t), reinterpret_cast<float*>(t + nbp * 4),
            reinterpret_cast<int32_t*>(t + nbp * 8), reinterpret_cast<int32_t*>(t + nbp * 16)};
  }
};

// block b's 32 activations (zero past K) as two vectors, and their largest magnitude
static inline float load_block(const float* x, int64_t K, int64_t k0, __m512& v0, __m512& v1) {
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k0));
  const __mmask16 m0 = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
  const __mmask16 m1 = (__mmask16)(n >= 32 ? 0xffff : n > 16 ? (1u << (n - 16)) - 1 : 0);
  v0 = _mm512_maskz_loadu_ps(m0, x + k0);
  v1 = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
}

constexpr float kQ16Max = 16256.f;  // 127 * 128: h = x16 >> 7 stays in [-127, 127]

// K floats (the rest of nbp * 32 zero) -> one prepared row in mode act. q8 rounds like llama.cpp: d = amax / 127
// stored as float16, codes round(x * 127 / amax) to nearest even; q16 likewise with 16256 and a float32 d.
static void prepare_row(const float* x, int64_t K, int64_t nbp, int act, ARow r) {
  auto sum16 = [&](__m512i v) { return _mm512_reduce_add_epi32(v); };
  for (int64_t b = 0; b < nbp; b++) {
    const int64_t k0 = b * 32;
    __m512 v0, v1;
    const float amax = load_block(x, K, k0, v0, v1);
    if (act == kActFloat) {
      _mm512_storeu_ps(r.x + k0, v0);
      _mm512_storeu_ps(r.x + k0 + 16, v1);
      r.s[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      continue;
    }
    const float qmax = act == kActQ8 ? 127.f : kQ16Max;
    const float d = amax / qmax, id = amax != 0.f ? qmax / amax : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
    const int32_t sum = sum16(q0) + sum16(q1);
    if (act == kActQ8) {
      _mm_storeu_si128((__m128i*)(r.q + k0), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128((__m128i*)(r.q + k0 + 16), _mm512_cvtsepi32_epi8(q1));
      r.d[b] = f2h2f(d);
      r.s[b] = f2h2f(d * float(sum));
      r.nc[2 * b] = -128 * sum16(q0);
      r.nc[2 * b + 1] = -128 * sum16(q1);
    } else {
      const __m512i h0 = _mm512_srai_epi32(q0, 7), h1 = _mm512_srai_epi32(q1, 7);
      const __m512i l0 = _mm512_and_si512(q0, _mm512_set1_epi32(127)), l1 = _mm512_and_si512(q1, _mm512_set1_epi32(127));
      _mm_storeu_si128((__m128i*)(r.q + k0), _mm512_cvtsepi32_epi8(h0));
      _mm_storeu_si128((__m128i*)(r.q + k0 + 16), _mm512_cvtsepi32_epi8(h1));
      _mm_storeu_si128((__m128i*)(r.l + k0), _mm512_cvtsepi32_epi8(l0));
      _mm_storeu_si128((__m128i*)(r.l + k0 + 16), _mm512_cvtsepi32_epi8(l1));
      r.d[b] = d;
      r.s[b] = d * float(sum);
      r.nc[2 * b] = -128 * sum16(h0);
      r.nc[2 * b + 1] = -128 * sum16(h1);
      r.ncl[2 * b] = -128 * sum16(l0);
      r.ncl[2 * b + 1] = -128 * sum16(l1);
    }
  }
}

static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Software prefetch of the weight stream into L1, g_qprefetch bytes of codes ahead (0: off; set_qprefetch), the
// scales as far ahead in their own streams. Chunks and scales run sequentially across groups, yet the hardware
// prefetchers alone held one core at ~15 GB/s (tools/qgemv_rows.py --prefetch 0,3072, bundled model, q16, 1
// thread: 1 / 4 / 16 rows 4.35 / 7.35 / 24.7 -> 3.36 / 6.18 / 22.2 ms; 2-4 KB ahead alike, at 2 threads too).
// Only the first row block of a group prefetches; the others find its codes in L1. Inline asm: GCC 12 drops
// _mm_prefetch in places.
static int64_t g_qprefetch = 3072;
static inline void prefetch_line(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}
static inline void prefetch_chunk(const QW& w, int64_t g, int64_t c) {
  if (g_qprefetch == 0) return;
  const uint8_t* v = w.chunk(g, c) + g_qprefetch;
  for (int64_t o = 0; o < w.chunk_bytes(); o += 64) prefetch_line(v + o);
  // the chunk's scales (and offsets): float16 per unit, or a K-quant's byte per unit (its float16 super-block
  // scales are 1/8-1/16 of that stream: the hardware prefetcher keeps up)
  const int64_t per_chunk = w.units() / w.chunks(), es = w.kq() ? 1 : 2, sb = per_chunk * kGroup * es;
  const int64_t i = (g * w.units() + c * per_chunk) * kGroup, ahead = g_qprefetch / w.chunk_bytes() * sb;
  const char* d = w.kq() ? reinterpret_cast<const char*>(w.sc + i) : reinterpret_cast<const char*>(w.d + i);
  for (int64_t o = 0; o < sb; o += 64) prefetch_line(d + ahead + o);
  if (w.mins()) {
    const char* m = w.kq() ? reinterpret_cast<const char*>(w.mn + i) : reinterpret_cast<const char*>(w.m + i);
    for (int64_t o = 0; o < sb; o += 64) prefetch_line(m + ahead + o);
  }
}

// one 64-byte code vector (16 rows x 4 codes) made ready for vpdpbusd once, then multiplied against each
// activation row's 4 codes broadcast to every lane
template <bool S8>
struct CodeVec {
  __m512i u;  // unsigned operand: u4 codes; s8 codes + 128 (VNNI) or |codes|
#if !defined(__AVX512VNNI__)
#ifdef __AVX512F__
  __mmask64 neg = 0;
#else
  __m512i raw;
#endif
#endif
  CodeVec(__m512i codes) {
    if constexpr (!S8) {
      u = codes;
    } else {
#ifdef __AVX512VNNI__
      u = _mm512_xor_si512(codes, _mm512_set1_epi8((char)0x80));
#else
      u = _mm512_abs_epi8(codes);
#ifdef __AVX512F__
      neg = _mm512_movepi8_mask(codes);
#else
      raw = codes;
#endif
#endif
    }
  }
  __m512i dot(__m512i acc, int32_t x4) const {
    __m512i x = _mm512_set1_epi32(x4);
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, x);
#else
    if constexpr (S8) {
#ifdef __AVX512F__
      x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
#else
      x = lw::sign_epi8(x, raw);  // 0 where the code is 0, whose |code| is 0 anyway
#endif
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
  }
};

static inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }

// u6 code vector t (0..7) of a 384-byte chunk: elements 4t..4t+3 of the block's 32 in each row's lane, 0..63.
// Vector t % 4 holds their low 4 bits (low nibbles: t < 4, high: t >= 4), vector 4 + t / 4 their high 2 bits at
// bits 2 (t % 4)..+1 of each byte.
static inline __m512i u6_codes(const uint8_t* v, int t) {
  const __m512i nib = load64(v + 64 * (t & 3)), hb = load64(v + 256 + 64 * (t >> 2));
  const int s = 2 * (t & 3);
  const __m512i lo = _mm512_and_si512(t < 4 ? nib : _mm512_srli_epi32(nib, 4), _mm512_set1_epi8(0x0f));
  const __m512i hi = _mm512_and_si512(s <= 4 ? _mm512_slli_epi32(hb, 4 - s) : _mm512_srli_epi32(hb, s - 4),
                                      _mm512_set1_epi8(0x30));
  return _mm512_add_epi32(lo, hi);  // disjoint bits: no carries
}

// Calls unit(code, nvec, e0, b, j, h) for each scale unit of group g in order: code(t) gives code vector t < nvec
// (bytes in 0..15 (u4), 0..63 (u6) or int8 (s8)) of the unit's elements e0.., which lie in activation block b,
// weight scale unit j and activation half-block (16 elements) h (-1: the whole block)
template <int F, typename Unit>
static inline void for_units(const QW& w, int64_t g, bool pf, Unit&& unit) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  if constexpr (F == kU4) {
    for (int64_t p = 0; p < w.nbp / 2; p++) {
      if (pf) prefetch_chunk(w, g, p);
      const uint8_t* v = w.chunk(g, p);
      unit([&](int t) { return _mm512_and_si512(load64(v + 64 * t), lo4); }, 8, 64 * p, 2 * p, 2 * p, -1);
      unit([&](int t) { return _mm512_and_si512(_mm512_srli_epi32(load64(v + 64 * t), 4), lo4); }, 8, 64 * p + 32,
           2 * p + 1, 2 * p + 1, -1);
    }
  } else {
    for (int64_t b = 0; b < w.nbp; b++) {
      if (pf) prefetch_chunk(w, g, b);
      const uint8_t* v = w.chunk(g, b);
      if constexpr (F == kU6) {
        unit([&](int t) { return u6_codes(v, t); }, 4, 32 * b, b, 2 * b, 2 * b);
        unit([&](int t) { return u6_codes(v, 4 + t); }, 4, 32 * b + 16, b, 2 * b + 1, 2 * b + 1);
      } else if constexpr (F == kU5) {
        unit([&](int t) { return u6_codes(v, t); }, 8, 32 * b, b, b, -1);
      } else {
        unit([&](int t) { return load64(v + 64 * t); }, 8, 32 * b, b, b, -1);
      }
    }
  }
}

#ifdef __AVX512VNNI__
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// group g of an integer-code weight of format F against MB q8 / q16 activation rows -> out[r]: the 16 rows'
// results; pf: the first row block of the group prefetches the stream ahead. Biased codes (s8 under VNNI: + 128;
// u6: + 32 by construction) start each sum at -bias * sum(x codes) (ARow::nc holds -128 * sum per 16).
template <int MB, bool Q16, int F>
static inline void group_int(const QW& w, int64_t g, const ARow* xr, bool pf, __m512* out) {
  constexpr bool kS = F == kS8, kBias = F == kU6 || (kS && kVnni), kOffset = F == kU4 || F == kU5;
  constexpr int kDiv = F == kU6 ? 4 : 1;
  __m512 acc[MB], accm[MB];
  for (int r = 0; r < MB; r++) acc[r] = accm[r] = _mm512_setzero_ps();
  // vpdpbusd's 4-cycle latency wants 4 independent sums in flight: with fewer rows x planes each sum runs as C
  // chains over alternate code vectors, added up after (integer sums: the same bits for any C)
  constexpr int C = MB * (Q16 ? 2 : 1) >= 4 ? 1 : MB * (Q16 ? 2 : 1) == 1 ? 4 : 2;
  for_units<F>(w, g, pf, [&](auto code, int nvec, int64_t e0, int64_t b, int64_t j, int64_t h)
                              __attribute__((always_inline)) {
    __m512i ih[MB][C], il[MB][C];
    for (int r = 0; r < MB; r++) {
      for (int c = 0; c < C; c++) ih[r][c] = il[r][c] = _mm512_setzero_si512();
      if constexpr (kBias) {
        auto bias = [&](const int32_t* n) { return (h < 0 ? n[2 * b] + n[2 * b + 1] : n[h]) / kDiv; };
        ih[r][0] = _mm512_set1_epi32(bias(xr[r].nc));
        if constexpr (Q16) il[r][0] = _mm512_set1_epi32(bias(xr[r].ncl));
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nvec; t++) {
      const CodeVec<kS> c(code(t));
      for (int r = 0; r < MB; r++) {
        ih[r][t % C] = c.dot(ih[r][t % C], load4(xr[r].q + e0 + 4 * t));
        if constexpr (Q16) il[r][t % C] = c.dot(il[r][t % C], load4(xr[r].l + e0 + 4 * t));
      }
    }
    for (int r = 0; r < MB; r++)
      for (int c = 1; c < C; c++) {
        ih[r][0] = _mm512_add_epi32(ih[r][0], ih[r][c]);
        if constexpr (Q16) il[r][0] = _mm512_add_epi32(il[r][0], il[r][c]);
      }
    const __m512 dw = w.scale(g, j);
    for (int r = 0; r < MB; r++) {
      const __m512i s = Q16 ? _mm512_add_epi32(_mm512_slli_epi32(ih[r][0], 7), il[r][0]) : ih[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xr[r].d[b])), dw, acc[r]);
    }
    if constexpr (kOffset) {
      const __m512 mw = w.offset(g, j);
      for (int r = 0; r < MB; r++) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr[r].s[b]), accm[r]);
    }
  });
  for (int r = 0; r < MB; r++) out[r] = kOffset ? _mm512_add_ps(acc[r], accm[r]) : acc[r];
}

// group g against MB float activation rows: the exact integer codes FMA'd against x (two chains), per scale unit
// times the 16 rows' scales (+ u4's offsets times the block's sum of x)
template <int MB, int F>
static inline void group_float(const QW& w, int64_t g, const ARow* xr, bool pf, __m512* out) {
  __m512 acc[MB], accm[MB];
  for (int r = 0; r < MB; r++) acc[r] = accm[r] = _mm512_setzero_ps();
  for_units<F>(w, g, pf, [&](auto code, int nvec, int64_t e0, int64_t b, int64_t j, int64_t)
                              __attribute__((always_inline)) {
    __m512 fa[MB][2];
    for (int r = 0; r < MB; r++) fa[r][0] = fa[r][1] = _mm512_setzero_ps();
    for (int t = 0; t < nvec; t++) {
      const __m512i raw = code(t);
      for (int k = 0; k < 4; k++) {
        __m512i c = F == kS8 ? _mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * k), 24)
                             : _mm512_and_si512(_mm512_srli_epi32(raw, 8 * k), _mm512_set1_epi32(0xff));
        if (F == kU6) c = _mm512_add_epi32(c, _mm512_set1_epi32(-32));
        const __m512 cf = _mm512_cvtepi32_ps(c);
        for (int r = 0; r < MB; r++)
          fa[r][k & 1] = _mm512_fmadd_ps(cf, _mm512_set1_ps(xr[r].x[e0 + 4 * t + k]), fa[r][k & 1]);
      }
    }
    const __m512 dw = w.scale(g, j);
    for (int r = 0; r < MB; r++) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(fa[r][0], fa[r][1]), dw, acc[r]);
    if constexpr (F == kU4 || F == kU5) {
      const __m512 mw = w.offset(g, j);
      for (int r = 0; r < MB; r++) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr[r].s[b]), accm[r]);
    }
  });
  for (int r = 0; r < MB; r++) out[r] = F == kU4 || F == kU5 ? _mm512_add_ps(acc[r], accm[r]) : acc[r];
}

template <int MB, int F>
static inline void group_rows(const QW& w, int64_t g, const ARow* xr, int act, bool pf, __m512* out) {
  if (act == kActQ8) group_int<MB, false, F>(w, g, xr, pf, out);
  else if (act == kActQ16) group_int<MB, true, F>(w, g, xr, pf, out);
  else group_float<MB, F>(w, g, xr, pf, out);
}

#include "quant_amx.h"

// activation rows per block: as many as the registers hold with each row's integer sums and float accumulators
// (q16: 2 planes) kept across a unit; more spill. Smaller blocks leave a leftover block of 1-2 rows that costs
// nearly a whole pass (tools/qgemv_rows.py --block-rows 4,5, q16, 1 thread: 5 / 9 rows 8.54 / 13.92 ms in blocks
// of 4, 7.47 / 12.64 in blocks of 5; 8 and 16 rows alike)
static int g_block_rows = 0;  // set: every mode's rows per block (1..6; set_block_rows, for A/B runs)
static inline int block_rows(int act) {
  return g_block_rows ? g_block_rows : act == kActQ8 ? 6 : act == kActQ16 ? 5 : 4;
}

template <int MB>
static inline void block(const QW& w, int64_t g, const ARow* xr, int act, bool pf, __m512* out) {
  if (w.fmt == kS8) group_rows<MB, kS8>(w, g, xr, act, pf, out);
  else if (w.fmt == kU6) group_rows<MB, kU6>(w, g, xr, act, pf, out);
  else if (w.fmt == kU5) group_rows<MB, kU5>(w, g, xr, act, pf, out);
  else group_rows<MB, kU4>(w, g, xr, act, pf, out);
}

// rows [n0, n1) of W against M prepared activation rows (xq, stride qstride bytes): out[m * ldo + n]. Whole
// groups are computed; only the lanes in [n0, n1) are stored. Groups outside, rows inside: a group's codes come
// from memory once, for the first block of rows, and from L1 for the others. With AMX-INT8 and at least
// g_amx_gemv_rows q8 rows, the first rows (all up to 16, else whole 16s) go through group_amx, with the same bits.
static void qgemv(const QW& w, int64_t n0, int64_t n1, char* xq, int64_t qstride, int act, int M, float* out,
                  int64_t ldo) {
  const int rows = block_rows(act);
  int ma = 0;  // rows on AMX tiles
#ifdef LOWLAT_AMX_INT8
  if (g_amx_gemv_rows > 0 && M >= g_amx_gemv_rows && act == kActQ8) {
    ma = M <= 16 ? M : M / 16 * 16;
    amx_gemv_config(std::min(ma, 16), w.fmt == kU6 ? 16 : 32);
  }
#endif
  for (int64_t g = n0 / kGroup; g * kGroup < n1; g++) {
    const int64_t lo = std::max(n0, g * kGroup) - g * kGroup, hi = std::min(n1, (g + 1) * kGroup) - g * kGroup;
    const __mmask16 mk = (__mmask16)(((1u << (hi - lo)) - 1) << lo);
#ifdef LOWLAT_AMX_INT8
    for (int m0 = 0; m0 < ma; m0 += 16) {
      const int mb = std::min(16, ma - m0);
      ARow xr[16];
      for (int r = 0; r < mb; r++) xr[r] = ARow::at(xq + (m0 + r) * qstride, w.nbp);
      __m512 res[16];
      group_amx_fmt(w, g, xr, xq + m0 * qstride, qstride, mb, m0 == 0, res);
      for (int r = 0; r < mb; r++) _mm512_mask_storeu_ps(out + (m0 + r) * ldo + g * kGroup, mk, res[r]);
    }
#endif
    for (int m0 = ma; m0 < M; m0 += rows) {
      const int mb = std::min(rows, M - m0);
      ARow xr[6];
      for (int r = 0; r < mb; r++) xr[r] = ARow::at(xq + (m0 + r) * qstride, w.nbp);
      __m512 res[6];
      const bool pf = m0 == 0;  // (ma > 0: group_amx prefetched)
      switch (mb) {
        case 1: block<1>(w, g, xr, act, pf, res); break;
        case 2: block<2>(w, g, xr, act, pf, res); break;
        case 3: block<3>(w, g, xr, act, pf, res); break;
        case 4: block<4>(w, g, xr, act, pf, res); break;
        case 5: block<5>(w, g, xr, act, pf, res); break;
        default: block<6>(w, g, xr, act, pf, res); break;
      }
      for (int r = 0; r < mb; r++) _mm512_mask_storeu_ps(out + (m0 + r) * ldo + g * kGroup, mk, res[r]);
    }
  }
#ifdef LOWLAT_AMX_INT8
  if (ma) _tile_release();
#endif
}

// rows [n0, n1) of a segmented weight: each segment's share of them
static void qgemv(const QMat& w, int64_t n0, int64_t n1, char* xq, int64_t qstride, int act, int M, float* out,
                  int64_t ldo) {
  for (size_t i = 0; i < w.seg.size(); i++) {
    const int64_t r0 = w.row0[i], a = std::max(n0, r0), b = std::min(n1, r0 + w.seg[i].N);
    if (a < b) qgemv(w.seg[i], a - r0, b - r0, xq, qstride, act, M, out + r0, ldo);
  }
}

// bytes of one prepared activation row of nbp blocks
static inline int64_t act_row_bytes(int64_t nbp) { return ARow::bytes(nbp); }

// prepare M float rows of K columns into xq (stride qstride) for mode act
static inline void prepare_rows(const float* x, int64_t ldx, int M, int64_t K, int64_t nbp, char* xq, int64_t qstride,
                                int act) {
  for (int m = 0; m < M; m++) prepare_row(x + m * ldx, K, nbp, act, ARow::at(xq + m * qstride, nbp));
}

// one row of W as float32 (the embedding lookup): d * q + m rounded once, as the reference dequantization
static inline void qrow(const QW& w, int64_t n, float* dst) {
  const int64_t g = n / kGroup, lane = n % kGroup;
  for (int64_t k = 0; k < w.K; k++) {
    const int64_t b = k / 32, e = k % 32, at = (e / 4) * 64 + lane * 4 + e % 4;
    if (w.fmt == kU4) {
      const uint8_t byte = w.chunk(g, b / 2)[at];
      dst[k] = std::fma(float(b % 2 ? byte >> 4 : byte & 15), w.scale_at(n, b), w.offset_at(n, b));
    } else if (w.six()) {  // u6_codes' layout
      const int64_t half = e / 16, r = e % 16, o = lane * 4 + r % 4;
      const uint8_t nib = w.chunk(g, b)[(r / 4) * 64 + o], hb = w.chunk(g, b)[256 + half * 64 + o];
      const int code = (half ? nib >> 4 : nib & 15) | (((hb >> (2 * (r / 4))) & 3) << 4);
      if (w.fmt == kU6) dst[k] = float(code - 32) * w.scale_at(n, 2 * b + half);
      else dst[k] = std::fma(float(code), w.scale_at(n, b), w.offset_at(n, b));
    } else {
      const int8_t code = static_cast<int8_t>(w.chunk(g, b)[at]);
      dst[k] = float(code) * w.scale_at(n, b);
    }
  }
}

}  // namespace lowlat
