// The products of a bfloat16 prefill tile on AMX (Sapphire Rapids and later): each TDPBF16PS
// multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums, 16 times the
// products of a VDPBF16PS. Same tile, softmax, rounding and output layout as Bf16DotProducts
// (prefill_bf16.h), which it extends; only the two products move to the tile unit:
//   Sᵀ = K·Qᵀ   16 key rows read in place from their block (A) against the queries' pairs (B),
//                one output tile per 16 rows of the tile
//   O += P·V    the probabilities transposed to rows x keys (A) against two keys' value rows
//                interleaved by unpack lo/hi (B); O is loaded from and stored back to scratch
// Keys are read 16 rows at a time, so the tile needs blocks of a multiple of 16 tokens: rows past
// the last key are read but never used (their values are zeroed before P·V).

#pragma once

#include <cstdint>

#include "amx.h"
#include "prefill_bf16.h"

#if SHOAL_HAS_AMX
namespace shoal::prefill {

// Eight tiles of 16 rows x 64 bytes: 0-2 float32 outputs (16 x 16), the others bfloat16
// operands: 16 keys x 32 dimensions, 16 query pairs x 16 rows, 16 rows x 32 probabilities,
// 16 key pairs x 16 value dimensions.
inline shoal::TileConfig tile_config() {
  shoal::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

template <int DIM, int NR>
struct AmxProducts : Bf16DotProducts<DIM, NR> {
  using Base = Bf16DotProducts<DIM, NR>;
  using Base::kRows;
  static constexpr int NP = DIM / 32;  // 32-dimension chunks of a row
  static constexpr int NO = DIM / 16;  // 16-column output tiles of a row
  // Keys per online-softmax step: 64, so that each output tile's trip through memory (to be
  // rescaled) carries two full-depth products; at 16 keys it cost more than the products.
  static constexpr int kKeys = 64;
  static_assert(TR == 48 && kKeys <= kMaxKeys, "three 16-row output tiles");

  // Once per tile: the tile configuration (oneDNN may have loaded its own in between).
  static void load_queries(Scratch& w, const uint16_t* const* rows, float scale) {
    static const shoal::TileConfig config = tile_config();
    shoal::load_tiles(config);
    Base::load_queries(w, rows, scale);
  }

  // Sᵀ = K·Qᵀ, 16 keys (contiguous in their block) at a time.
  static void scores(Scratch& w, const uint16_t* const* k, int n, float* sc, float scale) {
    const uint32_t* qt = w.pairs.data();
    const int64_t key_bytes = w.kv_stride * int64_t(sizeof(uint16_t)), pair_bytes = TR * 4;
    for (int j0 = 0; j0 < n; j0 += 16) {  // one output tile per row vector in use
      _tile_zero(0);
      if constexpr (NR > 1) _tile_zero(1);
      if constexpr (NR > 2) _tile_zero(2);
      for (int c = 0; c < NP; ++c) {
        const uint32_t* q = qt + 16 * c * TR;  // pairs 16c..16c+15 of every row
        _tile_loadd(3, k[j0] + 32 * c, key_bytes);
        _tile_loadd(4, q, pair_bytes);
        _tile_dpbf16ps(0, 3, 4);
        if constexpr (NR > 1) {
          _tile_loadd(4, q + 16, pair_bytes);
          _tile_dpbf16ps(1, 3, 4);
        }
        if constexpr (NR > 2) {
          _tile_loadd(4, q + 32, pair_bytes);
          _tile_dpbf16ps(2, 3, 4);
        }
      }
      _tile_stored(0, sc + j0 * TR, pair_bytes);
      if constexpr (NR > 1) _tile_stored(1, sc + j0 * TR + 16, pair_bytes);
      if constexpr (NR > 2) _tile_stored(2, sc + j0 * TR + 32, pair_bytes);
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < n; ++j)
      for (int v = 0; v < NR; ++v)
        _mm512_storeu_ps(sc + j * TR + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(sc + j * TR + 16 * v), s));
  }

  static void values(Scratch& w, const uint16_t* const* v, int n, const float* p,
                     const float* alpha) {
    const int halves = (n + 31) / 32;     // of 32 keys: the products' depth
    uint16_t* probs = w.tiles.data();     // [TR][kKeys] bfloat16, zero past n
    uint16_t* pairs = probs + TR * kKeys; // [NO][kKeys / 2][32]: value tiles, zero past n
    const __m512 zero = _mm512_setzero_ps();
    for (int g = 0; g < NR; ++g) {  // rows 16g..16g+15: keys x rows -> rows x keys
      for (int j0 = 0; j0 < 32 * halves; j0 += 16) {
        __m512 by_key[16], by_row[16];
        for (int j = 0; j < 16; ++j)
          by_key[j] = j0 + j < n ? _mm512_loadu_ps(p + (j0 + j) * TR + 16 * g) : zero;
        transpose16(by_key, by_row);
        for (int r = 0; r < 16; ++r)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + (16 * g + r) * kKeys + j0),
                              (__m256i)_mm512_cvtneps_pbh(by_row[r]));
      }
    }
    const __m512i none = _mm512_setzero_si512();
    for (int jp = 0; jp < 16 * halves; ++jp) {
      for (int c = 0; c < NP; ++c) {
        const __m512i v0 = 2 * jp < n ? _mm512_loadu_si512(v[2 * jp] + 32 * c) : none;
        const __m512i v1 = 2 * jp + 1 < n ? _mm512_loadu_si512(v[2 * jp + 1] + 32 * c) : none;
        _mm512_storeu_si512(pairs + ((2 * c) * (kKeys / 2) + jp) * 32, _mm512_unpacklo_epi16(v0, v1));
        _mm512_storeu_si512(pairs + ((2 * c + 1) * (kKeys / 2) + jp) * 32,
                            _mm512_unpackhi_epi16(v0, v1));
      }
    }
    float* o = w.o.data();
    for (int r = 0; r < kRows; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < NO; ++c)
        _mm512_storeu_ps(o + r * DIM + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + r * DIM + 16 * c), a));
    }
    for (int g = 0; g < NR; ++g) {
      _tile_loadd(3, probs + 16 * g * kKeys, kKeys * 2);
      if (halves > 1) _tile_loadd(4, probs + 16 * g * kKeys + 32, kKeys * 2);
      for (int c = 0; c < NO; ++c) {
        float* block = o + 16 * g * DIM + 16 * c;
        const uint16_t* b = pairs + c * (kKeys / 2) * 32;
        _tile_loadd(0, block, DIM * 4);
        _tile_loadd(6, b, 64);
        _tile_dpbf16ps(0, 3, 6);
        if (halves > 1) {
          _tile_loadd(7, b + 16 * 32, 64);
          _tile_dpbf16ps(0, 4, 7);
        }
        _tile_stored(0, block, DIM * 4);
      }
    }
  }
};

}  // namespace shoal::prefill
#endif
