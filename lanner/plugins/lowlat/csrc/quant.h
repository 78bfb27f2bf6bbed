// lowlat's GEMV over GGUF blocks kept in their stored type (issue 18), in the two formats that
// lanner/models/quant.py repacks them into without changing a value:
//   u4: 4-bit codes q, float16 d and m per block of 32 (w = d * q + m; Q4_1, and Q4_0 as m = -8 d). 32 bytes hold
//       two blocks: low nibbles the even block's 32 codes in element order, high nibbles the odd block's.
//   s8: int8 codes, float16 d per block of 32 (w = d * q; Q8_0, Q5_0 widened).
// K-quants keep these code layouts with float32 scales (df, mf: the super-block scale times the sub-block's integer
// scale, exact): u4 with df / mf per block of 32 (Q4_K), s8 with df per 16 elements (Q6_K).
// Rows have an even block count (zero-padded). Two activation modes:
//   q8:    each activation row is quantized per block of 32 to int8 with a float16-rounded scale, as llama.cpp's
//          quantize_row_q8_0/q8_1 do, and a block pair is one 64-byte integer dot product (vpdpbusd with
//          AVX512-VNNI; vpmaddubsw + vpmaddwd with AVX512BW only): unsigned u4 codes x signed activations directly;
//          s8 codes are biased to unsigned (xor 0x80) and the bias removed by starting the sum at -128 * sum(x).
//   q16:   each activation row is quantized per block of 32 to int16 codes in [-16383, 16383] with a float32
//          scale (3e-5 of the block's largest magnitude: float quality, where q8 visibly changes a small model's
//          text) and a block pair is 2 vpmaddwd (2 vpdpwssd with AVX512-VNNI) against the weight codes widened
//          by an in-lane byte shuffle (u4 zero-extended; s8 into the high byte, so 256 w exactly, the 256 taken
//          off at the end);
//   float: the codes are turned into exact float32 weights (d * q + m rounds once, like the reference
//          dequantization) and FMA'd against float activations.
// Each unpacked weight block is reused across up to 4 activation rows. Batch invariance: the arithmetic for
// one (weight row, activation row) pair is the same instruction sequence whatever the number of rows or how
// they are grouped (fixed accumulator chains, fixed reduction order), so a row's output bits do not depend on
// the other rows of the step.
#pragma once

namespace lowlat {

enum QFmt : int { kDense = 0, kU4 = 1, kS8 = 2 };
enum QAct : int { kActFloat = 0, kActQ8 = 1, kActQ16 = 2 };  // the activation modes above

struct QW {  // one repacked weight [N, K]; qs / d / m point into tensors the plugin keeps alive
  int fmt = kDense;
  int64_t N = 0, K = 0, nbp = 0;  // nbp: blocks per row, padded to even
  const uint8_t* qs = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;
  const float* df = nullptr;  // K-quants: float32 scales instead of d / m (u4: per 32 with offsets mf; s8: per 16)
  const float* mf = nullptr;
  bool quant() const { return fmt != kDense; }
  bool kq() const { return df != nullptr; }
  int64_t row_bytes() const { return nbp * 32 / (fmt == kU4 ? 2 : 1); }
};

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline float f2h2f(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }

// One activation row quantized for the q8 kernels: per block pair p, 64 int8 codes, the two blocks' scales
// broadcast to 8 lanes each (the lanes vpdpbusd sums that block into), -128 * (sums of 4 codes) per lane (the s8
// bias), and per block d * sum(q) rounded to float16 (u4's m term, llama.cpp's q8_1 `s`).
struct Q8Row {
  int8_t* q;
  float* db;    // [pairs][16]
  int32_t* nc;  // [pairs][16]
  float* s;     // [blocks], zero-padded to a multiple of 16 (read 16 at a time)
  static int64_t bytes(int64_t nbp) { return nbp * 32 + (nbp / 2) * 64 * 2 + (nbp + 15) / 16 * 16 * 4; }
  static Q8Row at(char* base, int64_t nbp) {
    return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + nbp * 32),
            reinterpret_cast<int32_t*>(base + nbp * 32 + nbp / 2 * 64), reinterpret_cast<float*>(base + nbp * 32 + nbp * 64)};
  }
};

static inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // u4 codes (<= 15) and |s| <= 127 cannot saturate the 16-bit pair sums; the s8 path never calls this
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// block b's 32 activations (zero past K) as two vectors, and their largest magnitude
static inline float load_block(const float* x, int64_t K, int64_t k0, __m512& v0, __m512& v1) {
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k0));
  const __mmask16 m0 = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
  const __mmask16 m1 = (__mmask16)(n >= 32 ? 0xffff : n > 16 ? (1u << (n - 16)) - 1 : 0);
  v0 = _mm512_maskz_loadu_ps(m0, x + k0);
  v1 = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
}

// quantize K floats (K <= nbp * 32; the rest are zero) like llama.cpp: d = amax / 127 stored as float16,
// codes round(x * 127 / amax) to nearest even
static void quantize_q8(const float* x, int64_t K, int64_t nbp, Q8Row r) {
  for (int64_t b = 0; b < nbp; b++) {
    const int64_t k0 = b * 32;
    __m512 v0, v1;
    const float amax = load_block(x, K, k0, v0, v1);
    const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i*)(r.q + k0), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(r.q + k0 + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    r.s[b] = f2h2f(d * float(sum));
    const float dh = f2h2f(d);
    float* db = r.db + (b / 2) * 16 + (b % 2) * 8;
    for (int i = 0; i < 8; i++) db[i] = dh;
  }
  for (int64_t b = nbp; b % 16; b++) r.s[b] = 0.f;
  for (int64_t p = 0; p < nbp / 2; p++) {  // -128 * sum of each lane's 4 codes
    const __m512i xv = _mm512_loadu_si512((const void*)(r.q + p * 64));
    const __m512i s4 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), xv), _mm512_set1_epi16(1));
    _mm512_storeu_si512((void*)(r.nc + p * 16), _mm512_mullo_epi32(s4, _mm512_set1_epi32(-128)));
  }
}

// One activation row quantized for the q16 kernels: per block pair p, 64 int16 codes in the order the weight
// shuffle produces (first 32: elements 4i, 4i+1; then 32: elements 4i+2, 4i+3, i = 0..15; so vpmaddwd's lane i of
// the two halves, added, sums elements 4i..4i+3, the lanes of q8's layout), the two blocks' scales broadcast to 8
// lanes each, and per block d * sum(q) (u4's m term).
struct Q16Row {
  static constexpr float kMax = 16383.f;  // 4 products of |256 w| <= 32768 with |x| <= 16383 fit an int32 lane
  int16_t* q;
  float* db;  // [pairs][16]
  float* s;   // [blocks], zero-padded to a multiple of 16
  static int64_t bytes(int64_t nbp) { return nbp * 64 + (nbp / 2) * 64 + (nbp + 15) / 16 * 16 * 4; }
  static Q16Row at(char* base, int64_t nbp) {
    return {reinterpret_cast<int16_t*>(base), reinterpret_cast<float*>(base + nbp * 64),
            reinterpret_cast<float*>(base + nbp * 64 + nbp / 2 * 64)};
  }
};

static void quantize_q16(const float* x, int64_t K, int64_t nbp, Q16Row r) {
  alignas(64) int32_t c[32];
  for (int64_t b = 0; b < nbp; b++) {
    const int64_t k0 = b * 32;
    __m512 v0, v1;
    const float amax = load_block(x, K, k0, v0, v1);
    const float d = amax / Q16Row::kMax, id = amax != 0.f ? Q16Row::kMax / amax : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, _mm512_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
    _mm512_storeu_si512((void*)c, q0);
    _mm512_storeu_si512((void*)(c + 16), q1);
    int16_t* qp = r.q + (b / 2) * 64;
    const int64_t e0 = (b % 2) * 32;  // this block's first element in its pair
    int32_t sum = 0;
    for (int e = 0; e < 32; e++) {
      const int64_t pe = e0 + e;  // element of the pair -> its slot
      qp[(pe % 4 < 2 ? 0 : 32) + (pe / 4) * 2 + pe % 2] = (int16_t)c[e];
      sum += c[e];
    }
    r.s[b] = d * float(sum);
    float* db = r.db + (b / 2) * 16 + (b % 2) * 8;
    for (int i = 0; i < 8; i++) db[i] = d;
  }
  for (int64_t b = nbp; b % 16; b++) r.s[b] = 0.f;
}

// The weight scale of each lane of a block pair (vpdpbusd's lane i sums elements 4i..4i+3): lanes 0-7 the even
// block's, 8-15 the odd one's, from the float32 scales of the two blocks (f2) or of a Q6_K's four 16-element
// sub-blocks (f4)
static inline __m512 pair_lanes(const float* f2) {
#ifdef __AVX512F__
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double*)f2))));
#else
  return {_mm256_broadcast_ss(f2), _mm256_broadcast_ss(f2 + 1)};
#endif
}
static inline __m512 quad_lanes(const float* f4) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(f4)));
}

// the weight scales of block pair p of row n, per lane of q8's layout (lane i: elements 4i..4i+3)
template <bool KQ>
static inline __m512 pair_scales(const QW& w, int64_t n, int64_t p) {
  if constexpr (!KQ) {
    const uint16_t* d = w.d + n * w.nbp;
    return _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(h2f(d[2 * p])), _mm512_set1_ps(h2f(d[2 * p + 1])));
  }
  if (w.fmt == kS8) return quad_lanes(w.df + n * 2 * w.nbp + 4 * p);
  return pair_lanes(w.df + n * w.nbp + 2 * p);
}

// pair(p, acc, weight scales) over the block pairs of row n: even pairs into acc0, odd ones into acc1, two pairs a
// turn so that both chains stay in registers (indexed by p & 1 they went through memory)
template <bool KQ, typename Pair>
static inline void each_pair(const QW& w, int64_t n, __m512* acc0, __m512* acc1, Pair&& pair) {
  const int64_t np = w.nbp / 2;
  int64_t p = 0;
  for (; p + 2 <= np; p += 2) {
    pair(p, acc0, pair_scales<KQ>(w, n, p));
    pair(p + 1, acc1, pair_scales<KQ>(w, n, p + 1));
  }
  if (p < np) pair(p, acc0, pair_scales<KQ>(w, n, p));
}

// u4's offset term of weight row n: sum over blocks of m * s (s: the activation row's per-block d * sum(q), zero
// past its blocks), 16 blocks per step
template <bool KQ>
static inline float u4_mterm(const QW& w, int64_t n, const float* s) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nbp; b += 16) {
    const bool whole = w.nbp - b >= 16;  // (the masked loads cost more on AVX2)
    const __mmask16 mk = (__mmask16)(whole ? 0xffff : (1u << (w.nbp - b)) - 1);
    const float* mf = KQ ? w.mf + n * w.nbp + b : nullptr;
    const uint16_t* mh = KQ ? nullptr : w.m + n * w.nbp + b;
    const __m512 mv = KQ ? (whole ? _mm512_loadu_ps(mf) : _mm512_maskz_loadu_ps(mk, mf))
                         : _mm512_cvtph_ps(whole ? _mm256_loadu_si256((const __m256i*)mh)
                                                 : _mm256_maskz_loadu_epi16(mk, mh));
    a = _mm512_fmadd_ps(mv, _mm512_loadu_ps(s + b), a);
  }
  return _mm512_reduce_add_ps(a);
}

// weight row n against MB q8 activation rows -> out[r * ldo] (two accumulator chains: each_pair)
template <int MB, bool KQ>
static inline void q8_rows(const QW& w, int64_t n, const Q8Row* xr, float* out, int64_t ldo) {
  const int64_t np = w.nbp / 2;
  __m512 acc0[MB], acc1[MB];
  for (int r = 0; r < MB; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
  auto pairs = [&](auto&& pair) { each_pair<KQ>(w, n, acc0, acc1, pair); };
  if (w.fmt == kU4) {
    const uint8_t* qs = w.qs + n * np * 32;
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    pairs([&](int64_t p, __m512* acc, __m512 dw) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + p * 32));
      const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, lo4)),
                                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4), 1);
      for (int r = 0; r < MB; r++) {
        const __m512i s = dot_u8s8(_mm512_setzero_si512(), wq, _mm512_loadu_si512((const void*)(xr[r].q + p * 64)));
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(xr[r].db + p * 16));
        acc[r] = _mm512_fmadd_ps(t, dw, acc[r]);
      }
    });
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(w.qs) + n * w.nbp * 32;
    pairs([&](int64_t p, __m512* acc, __m512 dw) {
      const __m512i raw = _mm512_loadu_si512((const void*)(qs + p * 64));
#ifdef __AVX512VNNI__
      const __m512i wq = _mm512_xor_si512(raw, _mm512_set1_epi8((char)0x80));
#else
      const __m512i wq = _mm512_abs_epi8(raw);
#ifdef __AVX512F__
      const __mmask64 neg = _mm512_movepi8_mask(raw);
#endif
#endif
      for (int r = 0; r < MB; r++) {
        const __m512i xv = _mm512_loadu_si512((const void*)(xr[r].q + p * 64));
#ifdef __AVX512VNNI__
        const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void*)(xr[r].nc + p * 16)), wq, xv);
#else
#ifdef __AVX512F__
        const __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
#else  // AVX2's psignb: x negated where the code is negative (0 where it is 0, whose |code| is 0 anyway)
        const __m512i xs = lw::sign_epi8(xv, raw);
#endif
        const __m512i s = _mm512_madd_epi16(_mm512_maddubs_epi16(wq, xs), _mm512_set1_epi16(1));
#endif
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(xr[r].db + p * 16));
        acc[r] = _mm512_fmadd_ps(t, dw, acc[r]);
      }
    });
  }
  for (int r = 0; r < MB; r++) {
    float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
    if (w.fmt == kU4) v += u4_mterm<KQ>(w, n, xr[r].s);
    out[r * ldo] = v;
  }
}

// byte shuffles widening a pair's 64 codes to the two int16 halves of Q16Row's order, per 128-bit lane: element
// 4i + t (+ 2 for the second half) into slot 2i + t, zero-extended (u4) or as the high byte (s8: 256 w)
static inline __m128i q16_shuffle(bool second, bool high) {
  alignas(16) int8_t idx[16];
  for (int s = 0; s < 8; s++) {
    const int8_t src = (int8_t)(4 * (s / 2) + s % 2 + (second ? 2 : 0));
    idx[2 * s] = high ? (int8_t)-128 : src;
    idx[2 * s + 1] = high ? src : (int8_t)-128;
  }
  return _mm_load_si128((const __m128i*)idx);
}

// weight row n against MB q16 activation rows -> out[r * ldo]; the same accumulator chains as q8_rows
template <int MB, bool KQ>
static inline void q16_rows(const QW& w, int64_t n, const Q16Row* xr, float* out, int64_t ldo) {
  const int64_t np = w.nbp / 2;
  const bool s8 = w.fmt == kS8;
  const __m512i sh0 = _mm512_broadcast_i32x4(q16_shuffle(false, s8)), sh1 = _mm512_broadcast_i32x4(q16_shuffle(true, s8));
  __m512 acc0[MB], acc1[MB];
  for (int r = 0; r < MB; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const uint8_t* qu = w.qs + n * np * 32;
  const int8_t* qb = reinterpret_cast<const int8_t*>(w.qs) + n * w.nbp * 32;
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  auto pair = [&](int64_t p, __m512* acc, __m512 dw) {
    __m512i wq;
    if (s8) {
      wq = _mm512_loadu_si512((const void*)(qb + p * 64));
    } else {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qu + p * 32));
      wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, lo4)),
                              _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4), 1);
    }
    const __m512i wa = _mm512_shuffle_epi8(wq, sh0), wb = _mm512_shuffle_epi8(wq, sh1);
    for (int r = 0; r < MB; r++) {
      const int16_t* xq = xr[r].q + p * 64;
      const __m512i xa = _mm512_loadu_si512((const void*)xq), xb = _mm512_loadu_si512((const void*)(xq + 32));
#ifdef __AVX512VNNI__  // vpdpwssd: the same wrapping int32 sums (nothing here overflows), one instruction less
      const __m512i s = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), wa, xa), wb, xb);
#else
      const __m512i s = _mm512_add_epi32(_mm512_madd_epi16(wa, xa), _mm512_madd_epi16(wb, xb));
#endif
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(xr[r].db + p * 16));
      acc[r] = _mm512_fmadd_ps(t, dw, acc[r]);
    }
  };
  each_pair<KQ>(w, n, acc0, acc1, pair);
  for (int r = 0; r < MB; r++) {
    float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
    if (s8) v *= 1.f / 256.f;  // a power of two: the same bits as taking it off every product
    if (w.fmt == kU4) v += u4_mterm<KQ>(w, n, xr[r].s);
    out[r * ldo] = v;
  }
}

// the 64 exact float32 weights of block pair p of row n, as 4 vectors of 16
static inline void unpack_pair(const QW& w, int64_t n, int64_t p, __m512 v[4]) {
  float d[4], m[2];  // the scale of each vector of 16, u4's offset of each block of 32
  if (w.kq() && w.fmt == kS8) {
    for (int h = 0; h < 4; h++) d[h] = w.df[n * 2 * w.nbp + 4 * p + h];
  } else {
    for (int b = 0; b < 2; b++) {
      const int64_t i = n * w.nbp + 2 * p + b;
      d[2 * b] = d[2 * b + 1] = w.kq() ? w.df[i] : h2f(w.d[i]);
      if (w.fmt == kU4) m[b] = w.kq() ? w.mf[i] : h2f(w.m[i]);
    }
  }
  if (w.fmt == kU4) {
    const uint8_t* qs = w.qs + (n * (w.nbp / 2) + p) * 32;
    const __m512i lo4 = _mm512_set1_epi32(0x0f);
    for (int h = 0; h < 2; h++) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qs + h * 16)));
      v[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, lo4)), _mm512_set1_ps(d[0]), _mm512_set1_ps(m[0]));
      v[2 + h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), _mm512_set1_ps(d[2]),
                                 _mm512_set1_ps(m[1]));
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(w.qs) + (n * w.nbp + 2 * p) * 32;
    for (int h = 0; h < 4; h++)
      v[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + h * 16)))),
                           _mm512_set1_ps(d[h]));
  }
}

// weight row n against MB float activation rows (x + r * ldx; K columns, zero padding past K is never read:
// the pair's lanes past K are masked)
template <int MB>
static inline void f32_rows(const QW& w, int64_t n, const float* x, int64_t ldx, float* out, int64_t ldo) {
  const int64_t np = w.nbp / 2;
  __m512 acc[MB][4];
  for (int r = 0; r < MB; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; p++) {
    __m512 v[4];
    unpack_pair(w, n, p, v);
    const int64_t k0 = p * 64;
    if (k0 + 64 <= w.K) {
      for (int r = 0; r < MB; r++)
        for (int c = 0; c < 4; c++)
          acc[r][c] = _mm512_fmadd_ps(v[c], _mm512_loadu_ps(x + r * ldx + k0 + c * 16), acc[r][c]);
    } else {
      for (int c = 0; c < 4; c++) {
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, w.K - k0 - c * 16));
        const __mmask16 mk = (__mmask16)((1u << left) - 1);
        for (int r = 0; r < MB; r++)
          acc[r][c] = _mm512_fmadd_ps(v[c], _mm512_maskz_loadu_ps(mk, x + r * ldx + k0 + c * 16), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MB; r++)
    out[r * ldo] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

// rows [n0, n1) of W against M activation rows: out[m * ldo + n]. act q8 / q16: `xq` holds the M quantized rows
// (stride `qstride` bytes), else `x` the float rows.
template <bool KQ>
static void qgemv_t(const QW& w, int64_t n0, int64_t n1, const float* x, int64_t ldx, char* xq, int64_t qstride,
                    int act, int M, float* out, int64_t ldo) {
  Q8Row r8[4];
  Q16Row r16[4];
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int mb = std::min(4, M - m0);
    for (int r = 0; r < mb; r++) {
      if (act == kActQ8) r8[r] = Q8Row::at(xq + (m0 + r) * qstride, w.nbp);
      if (act == kActQ16) r16[r] = Q16Row::at(xq + (m0 + r) * qstride, w.nbp);
    }
    for (int64_t n = n0; n < n1; n++) {
      float* o = out + m0 * ldo + n;
      const float* xm = x + m0 * ldx;
      switch (mb * 4 + act) {
        case 4 + kActQ8: q8_rows<1, KQ>(w, n, r8, o, ldo); break;
        case 8 + kActQ8: q8_rows<2, KQ>(w, n, r8, o, ldo); break;
        case 12 + kActQ8: q8_rows<3, KQ>(w, n, r8, o, ldo); break;
        case 16 + kActQ8: q8_rows<4, KQ>(w, n, r8, o, ldo); break;
        case 4 + kActQ16: q16_rows<1, KQ>(w, n, r16, o, ldo); break;
        case 8 + kActQ16: q16_rows<2, KQ>(w, n, r16, o, ldo); break;
        case 12 + kActQ16: q16_rows<3, KQ>(w, n, r16, o, ldo); break;
        case 16 + kActQ16: q16_rows<4, KQ>(w, n, r16, o, ldo); break;
        case 4: f32_rows<1>(w, n, xm, ldx, o, ldo); break;
        case 8: f32_rows<2>(w, n, xm, ldx, o, ldo); break;
        case 12: f32_rows<3>(w, n, xm, ldx, o, ldo); break;
        default: f32_rows<4>(w, n, xm, ldx, o, ldo); break;
      }
    }
  }
}

static inline void qgemv(const QW& w, int64_t n0, int64_t n1, const float* x, int64_t ldx, char* xq,
                         int64_t qstride, int act, int M, float* out, int64_t ldo) {
  (w.kq() ? qgemv_t<true> : qgemv_t<false>)(w, n0, n1, x, ldx, xq, qstride, act, M, out, ldo);
}

// bytes of one quantized activation row of nbp blocks (both modes fit)
static inline int64_t act_row_bytes(int64_t nbp) { return std::max(Q8Row::bytes(nbp), Q16Row::bytes(nbp)); }

// quantize M float rows of K columns into xq (stride qstride) for the q8 / q16 kernels
static inline void quantize_rows(const float* x, int64_t ldx, int M, int64_t K, int64_t nbp, char* xq, int64_t qstride,
                                 int act) {
  for (int m = 0; m < M; m++) {
    if (act == kActQ8) quantize_q8(x + m * ldx, K, nbp, Q8Row::at(xq + m * qstride, nbp));
    else quantize_q16(x + m * ldx, K, nbp, Q16Row::at(xq + m * qstride, nbp));
  }
}

// one row of W as float32 (the embedding lookup)
static inline void qrow(const QW& w, int64_t n, float* dst) {
  for (int64_t p = 0; p < w.nbp / 2; p++) {
    __m512 v[4];
    unpack_pair(w, n, p, v);
    for (int c = 0; c < 4; c++) {
      const int64_t k = p * 64 + c * 16, left = std::max<int64_t>(0, std::min<int64_t>(16, w.K - k));
      if (left) _mm512_mask_storeu_ps(dst + k, (__mmask16)((1u << left) - 1), v[c]);
    }
  }
}

}  // namespace lowlat
