// lowlat's attention over the paged KV cache: one item (a sequence's run of q heads over its keys, or over one
// 512-key part of them: KeyPart) at a time, with PyTorch's CPU flash attention arithmetic within a part;
// attend_parts folds an item's parts on one thread; Model::attention runs it on its own for tests.
#pragma once
#include "attention_amx.h"
#include "model.h"

namespace lowlat {

// one attention item: the q heads h0 .. h0 + nh - 1 of one kv group (GQA), rows t0..t0+nq-1 of q at positions
// pos[t] over keys 0..ctx-1 (those in part.k0 .. part.k1 - 1; with part.st, the rows' states are written there).
// Each key and value vector is loaded once for all the item's (row, head) pairs.
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
// rows too); the key blocks stay at multiples of 512, so a row's arithmetic still depends on its keys alone.
// q8: kc / vc hold Q8_0 rows (lanner/kvcache/q8.py), dequantized to float32 tiles (exact: q times an fp16 scale)
// and attended with the FMA path's arithmetic
template <typename WT, typename XT>
inline void Model::attend(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, int64_t kv_len,
                          const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc, int64_t h0,
                          int64_t nh, XT* ain, std::vector<float>& S, std::vector<float>& O, const int64_t* anc,
                          int64_t win, bool q8, const KeyPart& part) const {
#ifdef LOWLAT_AMX
  if constexpr (std::is_same<WT, bf16_t>::value)
    if (attn_amx && !q8 && D % 32 == 0)
      return attend_amx<XT>(q, pos, t0, nq, ctx, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win, part);
#endif
#define LOWLAT_ATTEND(NV, Q8) attend_nv<WT, XT, NV, Q8>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, \
                                                        O, anc, win, part)
  switch (D / 16) {  // the head size as a constant: the key, value and accumulator vectors stay in registers
    case 4: return q8 ? LOWLAT_ATTEND(4, true) : LOWLAT_ATTEND(4, false);
    case 8: return q8 ? LOWLAT_ATTEND(8, true) : LOWLAT_ATTEND(8, false);
    case 16: return q8 ? LOWLAT_ATTEND(16, true) : LOWLAT_ATTEND(16, false);
    default: return q8 ? LOWLAT_ATTEND(0, true) : LOWLAT_ATTEND(0, false);
  }
#undef LOWLAT_ATTEND
}

// the parts of an item's keys it reads: first_part .. end_part - 1 (parts of kAttnPart keys at fixed positions)
inline int64_t first_part(int64_t first_pos, int64_t win) {
  return win > 0 ? std::max<int64_t>(0, first_pos - win + 1) / kAttnPart : 0;
}
inline int64_t end_part(int64_t ctx) { return (ctx + kAttnPart - 1) / kAttnPart; }

// a folded row's output: O / sum, rounded as attend rounds it
template <typename WT, typename XT>
inline void store_row(const float* acc, XT* out, int64_t D) {
  const float inv = 1.0f / acc[1];
  for (int64_t d = 0; d < D; d++) stf<XT>(out, d, rnd<WT>(acc[2 + d] * inv));
}

// one item, its parts one after the other on this thread, folded in order: the bits of the same item with its
// parts spread over threads (Model::run), since the part states and the fold are the same
template <typename WT, typename XT>
inline void Model::attend_parts(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx,
                                int64_t kv_len, const std::vector<int64_t>& bt, int64_t bs, const WT* kc,
                                const WT* vc, int64_t h0, int64_t nh, XT* ain, std::vector<float>& S,
                                std::vector<float>& O, const int64_t* anc, int64_t win, bool q8) const {
  const int64_t pa = first_part(pos[t0], win), pb = end_part(ctx);
  if (pb - pa <= 1)  // one part: its fold is the state itself, normalized as attend does
    return attend<WT, XT>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win, q8, KeyPart{});
  const int64_t R = nq * nh, W = D + 2;
  thread_local std::vector<float> acc, st;
  acc.assign(R * W, 0.f);
  st.resize(R * W);
  for (int64_t r = 0; r < R; r++) acc[r * W] = -INFINITY;
  for (int64_t p = pa; p < pb; p++) {
    attend<WT, XT>(q, pos, t0, nq, ctx, kv_len, bt, bs, kc, vc, h0, nh, ain, S, O, anc, win, q8,
                   KeyPart{p * kAttnPart, (p + 1) * kAttnPart, st.data()});
    for (int64_t r = 0; r < R; r++) fold_part(acc.data() + r * W, st.data() + r * W, D);
  }
  for (int64_t r = 0; r < R; r++)
    store_row<WT, XT>(acc.data() + r * W, ain + (t0 + r / nh) * H * D + (h0 + r % nh) * D, D);
}

// one (token, kv head) row of D values as Q8_0 blocks at dst (the layout and rounding of lanner/kvcache/q8.py)
inline void quantize_kv_row(const float* v, int64_t D, uint8_t* dst) {
  for (int64_t b = 0; b < D / 32; b++, dst += 34) {
    float amax = 0.f;
    for (int k = 0; k < 32; k++) amax = std::max(amax, std::fabs(v[b * 32 + k]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(dst, &h, 2);
    for (int k = 0; k < 32; k++)
      dst[2 + k] = uint8_t(int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(v[b * 32 + k] * id)))));
  }
}

template <typename WT, typename XT, int NV, bool Q8>  // NV: D / 16, or 0 for any other head size (read at run time)
inline void Model::attend_nv(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx,
                             int64_t kv_len, const std::vector<int64_t>& bt, int64_t bs, const WT* kc, const WT* vc,
                             int64_t h0, int64_t nh, XT* ain, std::vector<float>& S, std::vector<float>& O,
                             const int64_t* anc, int64_t win,
                             const KeyPart& part) const {
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
  constexpr bool kPairs = kBf && NV > 0 && NV % 2 == 0 && !Q8;
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
  const ItemKeys ks(pos, t0, nq, ctx, bt, bs, anc, win, part);
  const int64_t *lim = ks.lim, *lo = ks.lo, maxlim = ks.maxlim, minlo = ks.minlo, c0 = ks.c0;
  auto slot = [&](int64_t i, int64_t j) { return ks.slot(i, j); };
  std::fill(mx, mx + R, -INFINITY);
  std::fill(sum, sum + R, 0.f);
  std::fill(O.begin(), O.begin() + R * D, 0.f);
  // a cache row's start, and 16 of its values (v: which 16) as float32
  const int64_t row_bytes = Q8 ? D / 32 * 34 : D * int64_t(sizeof(WT));
  auto kv_at = [&](const WT* c, int64_t i, int64_t j, int64_t gg) {
    return reinterpret_cast<const WT*>(reinterpret_cast<const char*>(c) + (slot(i, j) * Hkv + gg) * row_bytes);
  };
  auto ld16 = [&](const WT* row, int64_t v) {
    if constexpr (Q8) {
      const char* b = reinterpret_cast<const char*>(row) + (v >> 1) * 34;
      uint16_t h;
      std::memcpy(&h, b, 2);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + (v & 1) * 16));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), _mm512_set1_ps(_cvtsh_ss(h)));
    } else {
      return load16(row + v * 16);
    }
  };
  // the cache rows of the item's groups for keys j0 .. j0 + n_tiles * 16 - 1 (< end) into L2, each 64-byte line
  // once, ahead of their tiles: blocks sit scattered, so the hardware prefetchers restart at every block and the
  // tiles waited on memory (one decode row at 2000 tokens, 30 layers: 7.6 ms from DRAM, 3.2-4.1 from L3; with
  // this 4.6). Inline asm: GCC 12 dropped _mm_prefetch here. Into L1 it gained nothing (the misses queue there).
  auto prefetch = [&](const WT* c, int64_t j0, int64_t n_tiles, int64_t end) {
    if (g_attn_prefetch == 0) return;
    const int64_t bytes = (g1 - g0) * row_bytes;
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
          for (int64_t v = 0; v < nv; v++) _mm512_storeu_ps(t + v * 16, ld16(p, v));
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
  // a tile's keys (or values) for group gg: in the bf16 pair layout, every group's at the first, else gathered
  auto load_tile = [&](const WT* c, int64_t j0, int64_t nk, int64_t gg, bool keys) {
#ifdef __AVX512BF16__
    if (pairs) {
      if (gg == g0) keys ? fill_keys(j0, nk) : fill_value_pairs(j0, nk);
      return;
    }
#endif
    gather(c, j0, nk, gg);
  };
  // one (row, head)'s score for one key: the 16-wide FMA chain, then the horizontal sum
  auto dot = [&](const float* qi, const WT* kp) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t v = 0; v < nv; v++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + v * 16), ld16(kp, v), acc);
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
        load_tile(kc, j0, nk, gg, true);
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
      const int64_t nvec = (invariant ? n : std::max<int64_t>(0, std::min(n, vec_end - n0 - s0))) / 16 * 16;
      const float corr = softmax_block(S.data() + r * ldS + s0, n, nvec, kBf, mx[r], sum[r]);
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
        load_tile(vc, j0, nk, gg, false);
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
              _mm512_storeu_ps(o + v * 16, _mm512_fmadd_ps(p, ld16(vp, v), _mm512_loadu_ps(o + v * 16)));
          }
        }
      }
  }
  for (int64_t r = 0; r < R; r++) {
    const int64_t i = r / nh, h = h0 + r % nh;
    if (part.st != nullptr) {
      store_part_state(part.st + r * (D + 2), mx[r], sum[r], O.data() + r * D, D);
      continue;
    }
    const float inv = 1.0f / sum[r];
    for (int64_t d = 0; d < D; d++) stf<XT>(ain, (t0 + i) * ldq + h * D + d, rnd<WT>(O[r * D + d] * inv));
  }
}

// the attention kernel on its own, for tests: q [T, H*D] (RoPE applied) over caches [slots, Hkv, D] (or uint8
// Q8_0 rows [slots, Hkv, D / 32 * 34]) that already hold this step's K/V -> [T, H*D] in the model dtype
inline torch::Tensor Model::attention(torch::Tensor qt, torch::Tensor kc, torch::Tensor vc, torch::Tensor positions,
                                      std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens,
                                      std::vector<std::vector<int64_t>> bts, int64_t bs) const {
  const auto wdt = bf16 ? torch::kBFloat16 : torch::kFloat32;
  const int64_t T = qt.size(0), B = (int64_t)q_lens.size();
  const bool q8 = kc.scalar_type() == torch::kUInt8 && D % 32 == 0;
  const auto cdt = q8 ? torch::kUInt8 : wdt;
  TORCH_CHECK(qt.dim() == 2 && qt.size(1) == H * D && T <= kMaxRows && positions.numel() == T &&
                  positions.scalar_type() == torch::kLong && kc.scalar_type() == cdt && vc.sizes() == kc.sizes() &&
                  vc.scalar_type() == cdt && kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 3 &&
                  kc.size(1) == Hkv && kc.size(2) == (q8 ? D / 32 * 34 : D) && B >= 1 &&
                  (int64_t)ctx_lens.size() == B &&
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
      attend_parts<WT, float>(qf.data_ptr<float>(), pos.data_ptr<int64_t>(), row0[b], q_lens[b], ctx_lens[b],
                              kv_len, bts[b], bs, reinterpret_cast<const WT*>(kc.data_ptr()),
                              reinterpret_cast<const WT*>(vc.data_ptr()), item_head(k, n), item_heads(k, n),
                              outf.data(), S, O, nullptr, 0, q8);
    }
  };
  if (bf16) run_all(bf16_t{});
  else run_all(float{});
  return torch::from_blob(outf.data(), {T, H * D}, torch::kFloat32).to(wdt).clone();
}

}  // namespace lowlat
