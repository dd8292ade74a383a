// Tiles of quantized activation rows (quantize.cpp's blocks, one or two int8 levels) against
// quantized weight groups; see qtile_common.h for the epilogue.
//
// One int8 level is llama.cpp's activation format, and costs this project's float64
// agreement: a block holding one of SmolLM2's outlier features (20-30x its neighbours) leaves
// the others a few levels, about 1% of each product, and greedy tokens at near-ties part ways
// from the first one. Two levels carry the rounding residual too (q2 at 1/254 of q1's step),
// about int16's precision (products within ~4e-5), and cost a second integer product per
// weight vector and row but no widening of the weights: at batch 1, bound by reading the
// weights, it is close to one level's speed. A block's value is d * (254 q1 + q2).
//
// The integer products, unsigned weight byte times signed activation byte:
// - AVX-512 VNNI (with VL) or AVX-VNNI: VPDPBUSD, four products added into each int32 lane;
// - AVX2: VPMADDUBSW (pairs into int16) then VPMADDWD. Q4 pairs stay in int16 over the whole
//   block (at most 8 x 2 x 15 x 127 = 30,480); signed Q8_0 weights go as |w| against the
//   activation with w's sign (llama.cpp's trick), a pair at most 2 x 127 x 127.

#pragma once

#include <cstdint>
#include <cstring>

#include "qtile_common.h"

namespace shoal::quant {

#if SHOAL_QGEMM_VEC

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// How a format's stored bytes meet an activation vector: `add` accumulates the products of
// one weight vector (8 rows x 4 k) with 4 activation bytes broadcast, `sums` gives the block's
// int32 sums per row, and `kOffset` is the multiple of d_w (Q4_0, VNNI Q8_0) to add times s_a.
template <Fmt F>
struct DotI8 {
#ifdef SHOAL_DPBUSD
  static constexpr int kOffset = F == Fmt::Q4_0 ? -8 : F == Fmt::Q8_0 ? -128 : 0;
  static __m256i prepare(__m256i w) {
    return F == Fmt::Q8_0 ? _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))) : w;
  }
  static __m256i add(__m256i acc, __m256i w, __m256i a) { return SHOAL_DPBUSD(acc, w, a); }
  static __m256i sums(__m256i acc) { return acc; }
#else
  static constexpr int kOffset = F == Fmt::Q4_0 ? -8 : 0;
  static __m256i prepare(__m256i w) { return w; }
  static __m256i add(__m256i acc, __m256i w, __m256i a) {
    if constexpr (F == Fmt::Q8_0) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
      return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    } else {
      return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a));
    }
  }
  static __m256i sums(__m256i acc) {
    if constexpr (F == Fmt::Q8_0) return acc;
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
  }
#endif
};

// ROWS rows of A (LEVELS int8 levels, lda bytes apart) against one group (8 rows of W) over
// all `nb` blocks of k.
template <Fmt F, int ROWS, int LEVELS>
void tile_i8(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const uint8_t* w,
             float* c, int64_t ldc, int64_t cols, const float* bias) {
  using L = Layout<F>;
  using D = DotI8<F>;
  __m256 acc[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * L::kBytes;
    const uint8_t* quants = blk + L::kScaleBytes;
    const int8_t* ab = a + b * kBlock * LEVELS;
    __m256i sum[LEVELS][ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < LEVELS; ++v) sum[v][r] = _mm256_setzero_si256();
    // Not unrolled: GCC would reassociate the sums across the whole block, keep every product
    // live at once and spill them to the stack.
    if constexpr (L::kNibbles) {
#pragma GCC unroll 1
      for (int s = 0; s < 4; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * s));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
          for (int v = 0; v < LEVELS; ++v) {
            const int8_t* x = ab + r * lda + v * kBlock;
            sum[v][r] = D::add(sum[v][r], lo, bcast4(x + 4 * s));
            sum[v][r] = D::add(sum[v][r], hi, bcast4(x + 16 + 4 * s));
          }
        }
      }
    } else {
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m256i v =
            D::prepare(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j)));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
          for (int l = 0; l < LEVELS; ++l) {
            sum[l][r] = D::add(sum[l][r], v, bcast4(ab + r * lda + l * kBlock + 4 * j));
          }
        }
      }
    }
    const __m256 d = halves(blk);
    __m256 off = _mm256_setzero_ps();
    if constexpr (L::kMins) {
      off = halves(blk + 16);
    } else if constexpr (D::kOffset != 0) {
      off = _mm256_mul_ps(d, _mm256_set1_ps(float(D::kOffset)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const ActBlock s = act[r * nb + b];
      __m256 dot = _mm256_cvtepi32_ps(D::sums(sum[0][r]));
      if constexpr (LEVELS == 2) {
        dot = _mm256_fmadd_ps(dot, _mm256_set1_ps(254.0f), _mm256_cvtepi32_ps(D::sums(sum[1][r])));
      }
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(s.d)), acc[r]);
      if constexpr (L::kMins || D::kOffset != 0) {
        acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(s.s), acc[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) store8(c + r * ldc, acc[r], cols, bias);
}

template <Fmt F, int ROWS, int LEVELS>
constexpr Tile kTile = tile_i8<F, ROWS, LEVELS>;

#else

template <Fmt F, int ROWS, int LEVELS>
constexpr Tile kTile = tile_portable<F, ROWS, LEVELS>;

#endif

}  // namespace shoal::quant
