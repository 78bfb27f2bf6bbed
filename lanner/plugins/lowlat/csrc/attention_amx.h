// lowlat's attention on AMX tiles: bf16 models with a bf16 KV cache and a head size that is a multiple of 32, on
// CPUs with AMX-BF16 (Intel Sapphire Rapids and later). attend_nv's FMA loops spend ~25 cycles per (key, q head)
// on this arithmetic, so decode attention was compute-bound from ~2k tokens and a k-row verify cost k times a
// decode row; one tile product does 16 x 16 x 32 multiply-adds.
//
// The item contract is attend_nv's (attention.h): the q heads h0 .. h0 + nh - 1 of rows t0 .. t0 + nq - 1, keys in
// blocks of 512 with an online softmax, a draft tree's rows reading their ancestors, sliding windows. Per kv group,
// the item's (row, head) pairs are the columns, 16 to a tile:
//  * scores: C[key][column] = K tile (16 keys as stored, 32 dims) x q pairs, over D / 32 tiles; transposed into
//    rows of 512 scores per column, times the scale;
//  * softmax per column over its own keys: fexp_u20 on 16-wide runs, std::exp on the tail, exponentials rounded to
//    bf16 (exact in float32, so a row of them is already an AMX operand: bf16 in each odd half, zeros in the even
//    ones; shifted right by 16 it is the even-half operand); every key outside the column's range gets 0;
//  * P @ V: tile products with 16 keys of V as stored give the even (odd) dims of 32 from the even (odd)
//    operand; they are summed over the block's 16-key tiles in order, then O = O * correction + block sum.
// Tiles sit at multiples of 16 keys and blocks at multiples of 512, a column's products are independent of every
// other column, and a key outside a column's range contributes an exact zero: a (row, head)'s bits depend only on
// its own q and keys, as attend_nv's do (batch invariance, lossless speculation), though they are not the FMA
// path's bits. Tile rows past the written keys come from a zero-padded copy, never from the cache.
#pragma once
#include "model.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LOWLAT_AMX 1
#endif

namespace lowlat {

static int64_t g_attn_prefetch = 2;  // attention: key / value tiles prefetched ahead (0: off; set_attn_prefetch)

// the keys an attention item's step rows read (attend_nv and attend_amx): row i reads keys lo[i] .. lim[i] - 1 (its
// window and position; a draft tree's rows, their ancestors past the context; both within the part's keys), and
// slot(i, j) is where its j-th key sits in the cache
struct ItemKeys {
  int64_t lim[kMaxRows], lo[kMaxRows], maxlim = 0, minlo, c0;  // c0: position of the step's first row
  int8_t path[64][64];  // tree row i's k-th key past the context is step row path[i][k] (a tree has <= 63 rows)
  const std::vector<int64_t>& bt;
  const int64_t bs;
  const int64_t* anc;
  int shift;
  ItemKeys(const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx, const std::vector<int64_t>& bt_, int64_t bs_,
           const int64_t* anc_, int64_t win, const KeyPart& part)
      : minlo(ctx), c0(ctx - nq), bt(bt_), bs(bs_), anc(anc_) {
    if (anc != nullptr)
      for (int64_t i = 0; i < nq; i++)
        for (int64_t r = 0, k = 0; r <= i; r++)
          if ((anc[i] >> r) & 1) path[i][k++] = int8_t(r);
    for (int64_t i = 0; i < nq; i++) {
      lim[i] = anc != nullptr ? c0 + __builtin_popcountll(uint64_t(anc[i])) : std::min(pos[t0 + i] + 1, ctx);
      lo[i] = win > 0 ? std::max<int64_t>(0, pos[t0 + i] - win + 1) : 0;
      lim[i] = std::min(lim[i], part.k1);
      lo[i] = std::max(lo[i], part.k0);
      maxlim = std::max(maxlim, lim[i]);
      minlo = std::min(minlo, lo[i]);
    }
    // a shift and a mask for the usual power-of-two block size: an int64 division per key costs more than its
    // dot product
    shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll(uint64_t(bs)) : -1;
  }
  int64_t slot(int64_t i, int64_t j) const {
    const int64_t p = anc != nullptr && j >= c0 ? c0 + path[i][j - c0] : j;
    return shift >= 0 ? (bt[p >> shift] << shift) + (p & (bs - 1)) : bt[p / bs] * bs + p % bs;
  }
};

#ifdef LOWLAT_AMX
inline bool have_amx() { return amx_permitted(); }

// row n of out (out + n * ldo) = column n of the 16 x 16 floats at in (rows at in + k * ldi), times s; rows
// n with bit n of `rows` clear are not written. Four stages each swap the off-diagonal blocks of size b.
struct Transpose16Idx {  // stage st, block b = 1 << st: lane c of the low / high row's new value
  alignas(64) int32_t lo[4][16], hi[4][16];
  constexpr Transpose16Idx() : lo(), hi() {
    for (int st = 0; st < 4; st++)
      for (int c = 0, b = 1 << st; c < 16; c++) {
        lo[st][c] = (c & b) ? 16 + c - b : c;
        hi[st][c] = (c & b) ? 16 + c : c + b;
      }
  }
};
static constexpr Transpose16Idx kTranspose16Idx{};

static inline void transpose16(const float* in, int64_t ldi, float* out, int64_t ldo, __m512 s, uint32_t rows) {
  __m512 r[16];
  for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_ps(in + k * ldi);
  for (int st = 0; st < 4; st++) {
    const int b = 1 << st;
    const __m512i lo = _mm512_load_si512(kTranspose16Idx.lo[st]), hi = _mm512_load_si512(kTranspose16Idx.hi[st]);
    for (int i = 0; i < 16; i++)
      if (!(i & b)) {
        const __m512 a = r[i], c = r[i + b];
        r[i] = _mm512_permutex2var_ps(a, lo, c);
        r[i + b] = _mm512_permutex2var_ps(a, hi, c);
      }
  }
  for (int n = 0; n < 16; n++)
    if ((rows >> n) & 1) _mm512_storeu_ps(out + n * ldo, _mm512_mul_ps(r[n], s));
}

template <typename XT>
inline void Model::attend_amx(const float* q, const int64_t* pos, int64_t t0, int64_t nq, int64_t ctx,
                              const std::vector<int64_t>& bt, int64_t bs, const bf16_t* kc, const bf16_t* vc,
                              int64_t h0, int64_t nh, XT* ain, std::vector<float>& S, std::vector<float>& O,
                              const int64_t* anc, int64_t win, const KeyPart& part) const {
  // tiles never cross a block: S rows hold a block (and 16 floats more: a power-of-two stride between a tile
  // operand's 16 rows would put them in two L1 sets)
  constexpr int64_t kBlock = 512, kTile = 16, ldS = kBlock + 16;
  const int64_t rep = H / Hkv, DC = D / 32, ldkv = Hkv * D;  // ldkv: elements from one slot's rows to the next
  const ItemKeys ks(pos, t0, nq, ctx, bt, bs, anc, win, part);
  const int64_t *lim = ks.lim, *lo = ks.lo, maxlim = ks.maxlim, minlo = ks.minlo, c0 = ks.c0;
  auto slot = [&](int64_t i, int64_t j) { return ks.slot(i, j); };
  // 8 tiles of 16 rows x 64 bytes: 0 / 1 operands, 2 / 3 and 6 / 7 accumulators, 4 / 5 the odd / even P operands
  TileConfig cfg;
  for (int t = 0; t < 8; t++) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  cfg.load();
  const __m512 scv = _mm512_set1_ps(float(scale));
  for (int64_t gg = h0 / rep; gg <= (h0 + nh - 1) / rep; gg++) {
    const int64_t ha = std::max(h0, gg * rep), nhg = std::min(h0 + nh, (gg + 1) * rep) - ha;
    const int64_t Rg = nq * nhg, nqc = (Rg + 15) / 16, Rp = nqc * 16;  // columns: (row i, head ha + n % nhg)
    const int64_t need = 2 * Rp * ldS + nqc * DC * 256 + 2 * 8 * D + 4 * 256;
    if ((int64_t)S.size() < need) S.resize(need);
    if ((int64_t)O.size() < Rg * (D + 2)) O.resize(Rg * (D + 2));
    float* sc = S.data();                                          // [Rp][ldS] scores, then exponentials
    uint32_t* ae = reinterpret_cast<uint32_t*>(sc + Rp * ldS);     // [Rp][ldS] exponentials >> 16
    uint32_t* qp = ae + Rp * ldS;                                  // [nqc][DC][16 pairs][16 columns]
    bf16_t* tmp = reinterpret_cast<bf16_t*>(qp + nqc * DC * 256);  // a gathered 16-key tile [16][D]
    float* ce = reinterpret_cast<float*>(tmp + 16 * D);            // tile stores [16][16] x 2
    float* co = ce + 256;
    float* am = co + 256;  // a tree row's masked P operands [16][16] x 2
    float* o = O.data();
    float* mx = o + Rg * D;
    float* sum = mx + Rg;
    // q as bf16 pairs: qp[qc][dc][k][n] = dims 32 dc + 2k, 2k + 1 of column 16 qc + n (zeros past Rg)
    std::fill(qp, qp + nqc * DC * 256, 0u);
    for (int64_t n = 0; n < Rg; n++) {
      const float* qn = q + (t0 + n / nhg) * H * D + (ha + n % nhg) * D;
      for (int64_t dc = 0; dc < DC; dc++) {
        alignas(64) uint32_t w[16];
        _mm512_store_si512(w, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qn + 32 * dc + 16),
                                                           _mm512_loadu_ps(qn + 32 * dc)));
        for (int k = 0; k < 16; k++) qp[((n / 16) * DC + dc) * 256 + k * 16 + n % 16] = w[k];
      }
    }
    std::fill(o, o + Rg * D, 0.f);
    std::fill(mx, mx + Rg, -INFINITY);
    std::fill(sum, sum + Rg, 0.f);
    for (int64_t n = Rg; n < Rp; n++) {  // padded columns: zero operands throughout
      std::fill(sc + n * ldS, sc + (n + 1) * ldS, 0.f);
      std::fill(ae + n * ldS, ae + (n + 1) * ldS, 0u);
    }
    // the 16 keys j0 .. j0 + 15 of this group for step row i (-1: keys every row shares) as (pointer, stride in
    // bytes): straight from the cache when they are written and one block holds them, else copied with zeros
    // for keys past the row's (or the step's) last
    auto tile = [&](const bf16_t* c, int64_t j0, int64_t i) -> std::pair<const bf16_t*, int64_t> {
      const int64_t end = i < 0 ? maxlim : lim[i];
      if (i < 0 && bs % kTile == 0 && j0 + kTile <= end) return {c + (slot(0, j0) * Hkv + gg) * D, ldkv * 2};
      for (int64_t k = 0; k < kTile; k++) {
        if (j0 + k < end) std::memcpy(tmp + k * D, c + (slot(i < 0 ? 0 : i, j0 + k) * Hkv + gg) * D, D * 2);
        else std::memset(tmp + k * D, 0, D * 2);
      }
      return {tmp, D * 2};
    };
    // this group's rows of the 16 keys from j (those before maxlim) into L2, ahead of their tile loads: the
    // values wait there for the block's P @ V (a block's are 128 KB at Qwen's head size)
    auto prefetch = [&](const bf16_t* c, int64_t j) {
      if (g_attn_prefetch == 0 || j >= maxlim || (anc != nullptr && j + kTile > c0)) return;
      for (int64_t k = 0; k < kTile && j + k < maxlim; k++) {
        const char* row = reinterpret_cast<const char*>(c + (slot(0, j + k) * Hkv + gg) * D);
        for (int64_t b = 0; b < D * 2; b += 64) asm volatile("prefetcht1 %0" : : "m"(row[b]));
      }
    };
    // a tree's tiles past its context hold each row's own keys; every other tile is shared
    auto own_keys = [&](int64_t j0) { return anc != nullptr && j0 + kTile > c0; };
    auto row_cols = [&](int64_t i, int64_t qc) {  // bit n: column 16 qc + n is one of step row i's
      uint32_t m = 0;
      for (int64_t n = 0; n < 16; n++) m |= uint32_t((16 * qc + n) / nhg == i && 16 * qc + n < Rg) << n;
      return m;
    };
    for (int64_t n0 = minlo / kBlock * kBlock; n0 < maxlim; n0 += kBlock) {
      const int64_t n1 = std::min(n0 + kBlock, maxlim), ja = std::max(n0, minlo) / kTile * kTile;
      const int64_t jz = (n1 + kTile - 1) / kTile * kTile;  // the block's tiles: ja .. jz - 1
      // scores
      auto scores = [&](std::pair<const bf16_t*, int64_t> kt, int64_t j0, int64_t qc, uint32_t cols) {
        _tile_zero(2);
        for (int64_t dc = 0; dc < DC; dc++) {
          _tile_loadd(0, kt.first + 32 * dc, kt.second);
          _tile_loadd(1, qp + (qc * DC + dc) * 256, 64);
          _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, ce, 64);
        transpose16(ce, 16, sc + qc * 16 * ldS + (j0 - n0), ldS, scv, cols);
      };
      for (int64_t j0 = ja; j0 < jz; j0 += kTile) {
        if (!own_keys(j0)) {
          prefetch(kc, j0 + g_attn_prefetch * kTile);
          prefetch(vc, j0 + g_attn_prefetch * kTile);
          const auto kt = tile(kc, j0, -1);
          for (int64_t qc = 0; qc < nqc; qc++) scores(kt, j0, qc, 0xffffu);
        } else {
          for (int64_t i = 0; i < nq; i++) {
            if (j0 >= lim[i]) continue;
            const auto kt = tile(kc, j0, i);
            for (int64_t qc = i * nhg / 16; qc <= ((i + 1) * nhg - 1) / 16; qc++) scores(kt, j0, qc, row_cols(i, qc));
          }
        }
      }
      // online softmax per column; every key of the block's tiles outside the column's range gets p = 0
      for (int64_t n = 0; n < Rg; n++) {
        const int64_t i = n / nhg;
        const int64_t s0 = std::max(lo[i], n0) - n0, cnt = std::min(lim[i], n1) - n0 - s0;
        float* srow = sc + n * ldS;
        if (cnt <= 0) {
          std::fill(srow + ja - n0, srow + jz - n0, 0.f);
          continue;
        }
        std::fill(srow + ja - n0, srow + s0, 0.f);
        std::fill(srow + s0 + cnt, srow + jz - n0, 0.f);
        const float corr = softmax_block(srow + s0, cnt, cnt / 16 * 16, true, mx[n], sum[n]);  // (o is 0 at first)
        for (int64_t d = 0; d < D; d++) o[n * D + d] *= corr;
      }
      for (int64_t n = 0; n < Rg; n++)  // (padded columns' stay 0)
        for (int64_t j = ja - n0; j < jz - n0; j += 16)
          _mm512_storeu_si512(ae + n * ldS + j,
                              _mm512_srli_epi32(_mm512_loadu_si512((const void*)(sc + n * ldS + j)), 16));
      // P @ V, two 32-dim column ranges (dc, dc + 1) at a time: tiles 2 / 3 (6 / 7) sum the even / odd dims
      for (int64_t dc = 0; dc < DC; dc += 2) {
        const bool two = dc + 1 < DC;
        for (int64_t qc = 0; qc < nqc; qc++) {
          _tile_zero(2);
          _tile_zero(3);
          _tile_zero(6);
          _tile_zero(7);
          auto pv = [&](std::pair<const bf16_t*, int64_t> vt, const void* podd, const void* peven, int64_t ld) {
            _tile_loadd(4, podd, ld);
            _tile_loadd(5, peven, ld);
            _tile_loadd(0, vt.first + 32 * dc, vt.second);
            _tile_dpbf16ps(2, 5, 0);
            _tile_dpbf16ps(3, 4, 0);
            if (two) {
              _tile_loadd(1, vt.first + 32 * dc + 32, vt.second);
              _tile_dpbf16ps(6, 5, 1);
              _tile_dpbf16ps(7, 4, 1);
            }
          };
          for (int64_t j0 = ja; j0 < jz; j0 += kTile) {
            const int64_t off = qc * 16 * ldS + (j0 - n0);
            if (!own_keys(j0)) {
              pv(tile(vc, j0, -1), sc + off, ae + off, ldS * 4);
              continue;
            }
            for (int64_t i = 0; i < nq; i++) {  // each row's own keys, with only its columns' p nonzero
              if (j0 >= lim[i]) continue;
              const uint32_t cols = row_cols(i, qc);
              if (cols == 0) continue;
              for (int64_t n = 0; n < 16; n++) {
                const bool on = (cols >> n) & 1;
                const __m512i p = on ? _mm512_loadu_si512((const void*)(sc + off + n * ldS)) : _mm512_setzero_si512();
                _mm512_storeu_si512(am + n * 16, p);
                _mm512_storeu_si512(am + 256 + n * 16, _mm512_srli_epi32(p, 16));
              }
              pv(tile(vc, j0, i), am, am + 256, 64);
            }
          }
          // o[dims 32 d + 2m, + 1] += even / odd sums m
          const __m512i ilo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
          const __m512i ihi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
          for (int64_t h = 0; h < (two ? 2 : 1); h++) {
            if (h == 0) {
              _tile_stored(2, ce, 64);
              _tile_stored(3, co, 64);
            } else {
              _tile_stored(6, ce, 64);
              _tile_stored(7, co, 64);
            }
            for (int64_t n = 0; n < 16 && 16 * qc + n < Rg; n++) {
              float* on = o + (16 * qc + n) * D + 32 * (dc + h);
              const __m512 e = _mm512_loadu_ps(ce + n * 16), od = _mm512_loadu_ps(co + n * 16);
              _mm512_storeu_ps(on, _mm512_add_ps(_mm512_loadu_ps(on), _mm512_permutex2var_ps(e, ilo, od)));
              _mm512_storeu_ps(on + 16, _mm512_add_ps(_mm512_loadu_ps(on + 16), _mm512_permutex2var_ps(e, ihi, od)));
            }
          }
        }
      }
    }
    for (int64_t n = 0; n < Rg; n++) {
      const int64_t i = n / nhg, h = ha + n % nhg;
      if (part.st != nullptr) {
        store_part_state(part.st + (i * nh + h - h0) * (D + 2), mx[n], sum[n], o + n * D, D);
        continue;
      }
      const float inv = 1.0f / sum[n];
      for (int64_t d = 0; d < D; d++) stf<XT>(ain, (t0 + i) * H * D + h * D + d, rnd<bf16_t>(o[n * D + d] * inv));
    }
  }
  _tile_release();
}
#else
inline bool have_amx() { return false; }
#endif

}  // namespace lowlat
