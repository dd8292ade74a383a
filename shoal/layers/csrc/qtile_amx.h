// Quantized products on AMX-INT8 tiles (Sapphire, Emerald, Granite Rapids), for 16 rows of A
// at a time: prefill, and decode steps of 16 sequences or more. Same operands and epilogue as
// qtile.h: per block of 32 k, the integer sums of each row of A and column of W meet
// d_w * d_a (and off_w * s_a) in float32, so the tile products run one block (K = 32) at a time:
//   C_v[16 x 16] = A_v[16 rows x 32 bytes] . B[8 rows x 64 bytes], one per activation level v,
// TDPBSSD for signed weights (Q8_0, and Q4_0 unpacked as q - 8), TDPBSUD for Q4_1's nibbles.
//
// A panel is two groups (16 columns of W). Its blocks are unpacked once per 256 rows of A into
// B's layout: row j of a block's tile holds k in [4j, 4j + 4) of the 16 columns, column after
// column (the groups' 32-byte vectors side by side, Q4's nibbles split), and its scales and
// offsets become float32 vectors of 16. The rows of A are loaded as tiles in place.

#pragma once

#include "amx.h"
#include "quant_blocks.h"

#if SHOAL_HAS_AMX && defined(__AMX_INT8__) && defined(__AVX512F__)
#define SHOAL_HAS_AMX_INT8 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shoal::quant {

constexpr int64_t kPanel = 2 * kRows;         // columns of W in one B tile
constexpr int64_t kTileBytes = kBlock * kPanel;  // one block of a panel, unpacked
constexpr int64_t kAmxRowBlock = 256;         // rows of A a panel's unpacking serves

// A panel unpacked: nb blocks of tile bytes, and per block 16 scales and 16 offsets.
struct Panel {
  std::vector<int8_t> quads;
  std::vector<float> d, off;
  void resize(int64_t nb) {
    quads.resize(nb * kTileBytes);
    d.resize(nb * kPanel);
    off.resize(nb * kPanel);
  }
};

// Group `g` (of `groups`) as columns [8 * half, 8 * half + 8) of the panel; zeros past the end.
template <Fmt F>
void unpack_group(const uint8_t* w, int64_t nb, int64_t g, int64_t groups, int half, Panel& p) {
  using L = Layout<F>;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t* tile = p.quads.data() + b * kTileBytes + half * 32;
    float* d = p.d.data() + b * kPanel + half * kRows;
    float* off = p.off.data() + b * kPanel + half * kRows;
    if (g >= groups) {
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 64 * j),
                                                      _mm256_setzero_si256());
      _mm256_storeu_ps(d, _mm256_setzero_ps());
      _mm256_storeu_ps(off, _mm256_setzero_ps());
      continue;
    }
    const uint8_t* blk = w + (g * nb + b) * L::kBytes;
    const uint8_t* quants = blk + L::kScaleBytes;
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    _mm256_storeu_ps(d, dv);
    __m256 ov = _mm256_setzero_ps();  // Q4_0 (unpacked as q - 8) and Q8_0 are signed
    if constexpr (L::kMins) {
      ov = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    }
    _mm256_storeu_ps(off, ov);
    for (int j = 0; j < 8; ++j) {
      __m256i v;
      if constexpr (L::kNibbles) {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * (j % 4)));
        if (j >= 4) v = _mm256_srli_epi16(v, 4);
        v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
        if constexpr (F == Fmt::Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
      } else {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 64 * j), v);
    }
  }
}

// Tiles: 0 and 1 the activation levels, 2 the weights, 3-4 and 5-6 the sums of each level for
// two blocks in turn: a block's products run while the previous block's epilogue does.
inline const TileConfig& qgemm_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 32;
    c.rows[2] = 8, c.colsb[2] = 64;
    for (int t : {3, 4, 5, 6}) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  return config;
}

// GCC's tile intrinsics paste their tile numbers into the instruction: literals only.
#define SHOAL_QTILE_DP(S, A)     \
  if constexpr (kSigned<F>) {    \
    _tile_dpbssd(S, A, 2);       \
  } else {                       \
    _tile_dpbsud(S, A, 2);       \
  }
#define SHOAL_QTILE_PRODUCTS(S0, S1)      \
  _tile_loadd(2, quads, 64);              \
  _tile_loadd(0, ab, lda);                \
  _tile_zero(S0);                         \
  SHOAL_QTILE_DP(S0, 0)                   \
  if constexpr (LEVELS == 2) {            \
    _tile_loadd(1, ab + kBlock, lda);     \
    _tile_zero(S1);                       \
    SHOAL_QTILE_DP(S1, 1)                 \
  }
#define SHOAL_QTILE_STORE(S0, S1)                                \
  _tile_stored(S0, sums[0], 64);                                 \
  if constexpr (LEVELS == 2) _tile_stored(S1, sums[LEVELS - 1], 64);

// Signed weights (Q8_0, Q4_0 unpacked as q - 8) meet the activations with TDPBSSD.
template <Fmt F>
constexpr bool kSigned = !Layout<F>::kMins;

// Block products into the tiles of set SET (3-4 or 5-6).
template <Fmt F, int LEVELS, int SET>
inline void block_products(const int8_t* ab, int64_t lda, const int8_t* quads) {
  if constexpr (SET == 0) {
    SHOAL_QTILE_PRODUCTS(3, 4)
  } else {
    SHOAL_QTILE_PRODUCTS(5, 6)
  }
}

// Block b's sums (tile set SET) scaled into the 16 rows' accumulators.
template <Fmt F, int LEVELS, int SET>
inline void block_epilogue(const ActBlock* act, int64_t nb, int64_t b, const Panel& p,
                           __m512* acc) {
  alignas(64) int32_t sums[LEVELS][16 * kPanel];
  if constexpr (SET == 0) {
    SHOAL_QTILE_STORE(3, 4)
  } else {
    SHOAL_QTILE_STORE(5, 6)
  }
  const __m512 d = _mm512_loadu_ps(p.d.data() + b * kPanel);
  const __m512 off = _mm512_loadu_ps(p.off.data() + b * kPanel);
  for (int r = 0; r < 16; ++r) {
    const ActBlock s = act[r * nb + b];
    __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(sums[0] + r * kPanel));
    if constexpr (LEVELS == 2) {
      dot = _mm512_fmadd_ps(dot, _mm512_set1_ps(254.0f),
                            _mm512_cvtepi32_ps(_mm512_load_si512(sums[LEVELS - 1] + r * kPanel)));
    }
    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s.d)), acc[r]);
    if constexpr (Layout<F>::kMins) acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(s.s), acc[r]);
  }
}

#undef SHOAL_QTILE_STORE
#undef SHOAL_QTILE_PRODUCTS
#undef SHOAL_QTILE_DP

// 16 rows of A against an unpacked panel: C[16, cols] (+ bias).
template <Fmt F, int LEVELS>
void amx_rows(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const Panel& p,
              float* c, int64_t ldc, int64_t cols, const float* bias) {
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const int8_t* quads = p.quads.data();
  constexpr int64_t step = kBlock * LEVELS;
  block_products<F, LEVELS, 0>(a, lda, quads);
  for (int64_t b = 0; b < nb; b += 2) {  // block b in tile set 0, b + 1 in set 1
    const int8_t* a1 = a + (b + 1) * step;
    if (b + 1 < nb) block_products<F, LEVELS, 1>(a1, lda, quads + (b + 1) * kTileBytes);
    block_epilogue<F, LEVELS, 0>(act, nb, b, p, acc);
    if (b + 1 == nb) break;
    const int8_t* a2 = a + (b + 2) * step;
    if (b + 2 < nb) block_products<F, LEVELS, 0>(a2, lda, quads + (b + 2) * kTileBytes);
    block_epilogue<F, LEVELS, 1>(act, nb, b + 1, p, acc);
  }
  const __mmask16 mask = __mmask16((1u << cols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(c + r * ldc, mask, _mm512_add_ps(acc[r], bv));
}

// Rows [0, m - m % 16) of A against the groups [g0, g1) of W, a panel (two groups) at a time;
// the caller takes the remaining rows. Loads the tile configuration and releases the tiles.
template <Fmt F, int LEVELS>
void amx_groups(const int8_t* a, const ActBlock* act, int64_t m, int64_t k, const uint8_t* w,
                int64_t n, float* c, int64_t ldc, const float* bias, int64_t g0, int64_t g1) {
  thread_local Panel panel;
  const int64_t nb = k / kBlock, lda = k * LEVELS, groups = (n + kRows - 1) / kRows;
  panel.resize(nb);
  load_tiles(qgemm_tiles());
  for (int64_t m0 = 0; m0 + 16 <= m; m0 += kAmxRowBlock) {
    const int64_t m1 = std::min(m - m % 16, m0 + kAmxRowBlock);
    for (int64_t g = g0; g < g1; g += 2) {
      unpack_group<F>(w, nb, g, groups, 0, panel);
      unpack_group<F>(w, nb, g + 1 < g1 ? g + 1 : groups, groups, 1, panel);
      const int64_t cols = std::min(g + 1 < g1 ? kPanel : kRows, n - g * kRows);
      for (int64_t i = m0; i < m1; i += 16) {
        amx_rows<F, LEVELS>(a + i * lda, lda, act + i * nb, nb, panel, c + i * ldc + g * kRows,
                            ldc, cols, bias ? bias + g * kRows : nullptr);
      }
    }
  }
  release_tiles();
}

}  // namespace shoal::quant

#else
#define SHOAL_HAS_AMX_INT8 0
#endif
