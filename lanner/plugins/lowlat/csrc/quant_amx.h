// Several q8 activation rows against stored-type weights on AMX-INT8 tiles (included inside quant.h's namespace,
// after group_int, whose arithmetic this reproduces). group_int spends 8 vpdpbusd per activation row per 32-element
// unit, so past ~4 rows a verify GEMV outran the memory stream (8 rows: 1.91x a decode row's time, 16: 3.11x on
// Qwen2.5-Coder-1.5B, 2 threads; docs/quantized.md#amx-gemv). Here a unit's code vectors, which the interleaved layout holds as 16
// weight rows x 4 codes per 64 bytes, are a tile product's B operand once unpacked, the rows' codes at the unit are
// A (one tile row per activation row, at the prepared rows' stride), and one tdpbsud (tdpbssd for s8 codes) gives
// every (activation row, weight row) integer sum of the unit. Integer sums are exact, so with group_int's bias and
// then its float epilogue, in its order, every output has group_int's bits: a row's result is the same through
// either path, and the path can follow the step's row count (batch invariance). q16's two planes stay on VNNI: one
// tile set per unit left the tiles slower than vpdpbusd below 16 rows.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define LOWLAT_AMX_INT8 1
#endif

#ifdef __AMX_TILE__
// Linux gives a process AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
#endif
#ifdef LOWLAT_AMX_INT8
inline bool have_amx_int8() { return amx_permitted(); }
#else
inline bool have_amx_int8() { return false; }
#endif
#ifdef __AMX_TILE__
// a tile configuration (palette 1), loaded through inline asm that reads the whole struct: through
// _tile_loadconfig GCC 12 dropped the stores of colsb / rows as dead (it kept only the palette byte)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void load() const { asm volatile("ldtilecfg %0" : : "m"(*this)); }
};
#endif

// qgemv runs steps of at least this many q8 activation rows on AMX tiles (0: never; set_amx_gemv_rows)
static int g_amx_gemv_rows = 0;

#ifdef LOWLAT_AMX_INT8
// tiles for M activation rows and units of ub code bytes per row (32; u6: 16): A 0 / 1 (M x ub), B 2 / 3
// (ub / 4 x 64), C 4 / 5 (M x 64); units alternate between the sets (0, 2, 4) and (1, 3, 5)
static inline void amx_gemv_config(int M, int ub) {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) {
    cfg.colsb[t] = t < 2 ? ub : t < 6 ? 64 : 0;
    cfg.rows[t] = t < 2 || t == 4 || t == 5 ? M : t < 4 ? ub / 4 : 0;
  }
  cfg.load();
}

// group g of a weight of format F against M (<= 16) activation rows whose prepared rows start at xq (stride
// qstride) -> out[r] as group_int<M, false, F> gives it; pf as there
template <int F>
static inline void group_amx(const QW& w, int64_t g, const ARow* xr, const char* xq, int64_t qstride, int M, bool pf,
                             __m512* out) {
  constexpr bool kS = F == kS8, kBias = F == kU6, kOffset = F == kU4 || F == kU5;  // (s8: signed codes, no bias)
  constexpr int kDiv = F == kU6 ? 4 : 1;
  alignas(64) uint8_t bt[2][8 * 64];
  alignas(64) int32_t ch[16 * 16];
  __m512 acc[16], accm[16];
  for (int r = 0; r < M; r++) acc[r] = accm[r] = _mm512_setzero_ps();
  // units in flight: u's codes are stored to bt[u % 2] at its turn, its tile product issued at the next unit's
  // (the stores have landed by then) into C set u % 2, whose sums are stored and scaled at the one after that,
  // while that unit's product runs (tile instructions issue in order: a store waits behind earlier products)
  struct Unit {
    int64_t b, j, h, e0;
  } ring[3];
  auto issue = [&](int64_t u) __attribute__((always_inline)) {
    const char* a = xq + ring[u % 3].e0;
    if ((u & 1) == 0) {
      _tile_loadd(2, bt[0], 64);
      _tile_loadd(0, a, qstride);
      _tile_zero(4);
      if constexpr (kS) _tile_dpbssd(4, 0, 2);
      else _tile_dpbsud(4, 0, 2);
    } else {
      _tile_loadd(3, bt[1], 64);
      _tile_loadd(1, a, qstride);
      _tile_zero(5);
      if constexpr (kS) _tile_dpbssd(5, 1, 3);
      else _tile_dpbsud(5, 1, 3);
    }
  };
  auto store = [&](int64_t u) __attribute__((always_inline)) {
    if ((u & 1) == 0) _tile_stored(4, ch, 64);
    else _tile_stored(5, ch, 64);
  };
  auto scale = [&](int64_t u) __attribute__((always_inline)) {  // group_int's epilogue, unit by unit in order
    const int64_t b = ring[u % 3].b, j = ring[u % 3].j, h = ring[u % 3].h;
    const __m512 dw = w.scale(g, j);
    for (int r = 0; r < M; r++) {
      __m512i s = _mm512_load_si512(ch + 16 * r);
      if constexpr (kBias) {
        const int32_t* n = xr[r].nc;
        s = _mm512_add_epi32(s, _mm512_set1_epi32((h < 0 ? n[2 * b] + n[2 * b + 1] : n[h]) / kDiv));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xr[r].d[b])), dw, acc[r]);
    }
    if constexpr (kOffset) {
      const __m512 mw = w.offset(g, j);
      for (int r = 0; r < M; r++) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr[r].s[b]), accm[r]);
    }
  };
  int64_t n = 0;
  for_units<F>(w, g, pf, [&](auto code, int nvec, int64_t e0, int64_t b, int64_t j, int64_t h)
                              __attribute__((always_inline)) {
    ring[n % 3] = {b, j, h, e0};
    for (int t = 0; t < nvec; t++) _mm512_store_si512(bt[n & 1] + 64 * t, code(t));
    if (n >= 2) store(n - 2);
    if (n >= 1) issue(n - 1);
    if (n >= 2) scale(n - 2);
    n++;
  });
  if (n >= 2) store(n - 2);
  if (n >= 1) issue(n - 1);
  if (n >= 2) scale(n - 2);
  if (n >= 1) {
    store(n - 1);
    scale(n - 1);
  }
  for (int r = 0; r < M; r++) out[r] = kOffset ? _mm512_add_ps(acc[r], accm[r]) : acc[r];
}

static inline void group_amx_fmt(const QW& w, int64_t g, const ARow* xr, const char* xq, int64_t qstride, int M,
                                 bool pf, __m512* out) {
  if (w.fmt == kS8) group_amx<kS8>(w, g, xr, xq, qstride, M, pf, out);
  else if (w.fmt == kU6) group_amx<kU6>(w, g, xr, xq, qstride, M, pf, out);
  else if (w.fmt == kU5) group_amx<kU5>(w, g, xr, xq, qstride, M, pf, out);
  else group_amx<kU4>(w, g, xr, xq, qstride, M, pf, out);
}
#endif
