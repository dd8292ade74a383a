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

// The vectors of a tile: 256-bit, one group (8 rows of W; `w1` unused). qtile512.h has the
// 512-bit pair of groups with the same members.
struct Vec256 {
  using Int = __m256i;
  using Float = __m256;
  template <Fmt F>
  using Dot = DotI8<F>;

  static Int load(const uint8_t* w0, const uint8_t*) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0));
  }
  static Int bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
  }
  static void nibbles(Int v, Int& lo, Int& hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(v, low4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  static Float halves(const uint8_t* b0, const uint8_t*) { return quant::halves(b0); }
  static Int zeros() { return _mm256_setzero_si256(); }
  static Float zero() { return _mm256_setzero_ps(); }
  static Float splat(float x) { return _mm256_set1_ps(x); }
  static Float to_float(Int v) { return _mm256_cvtepi32_ps(v); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* c, Float v, int64_t cols, const float* bias) {
    store8(c, v, cols, bias);
  }
};

// ROWS rows of A (LEVELS int8 levels, lda bytes apart) against the groups of V's width at w0
// (and w1) over all `nb` blocks of k: C[ROWS, cols].
template <class V, Fmt F, int ROWS, int LEVELS>
void tile_i8(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const uint8_t* w0,
             const uint8_t* w1, float* c, int64_t ldc, int64_t cols, const float* bias) {
  using L = Layout<F>;
  using D = typename V::template Dot<F>;
  typename V::Float acc[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) acc[r] = V::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = w0 + b * L::kBytes;
    const uint8_t* b1 = w1 + b * L::kBytes;
    const int8_t* ab = a + b * kBlock * LEVELS;
    typename V::Int sum[LEVELS][ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
      for (int l = 0; l < LEVELS; ++l) sum[l][r] = V::zeros();
    // Not unrolled: GCC would reassociate the sums across the whole block, keep every product
    // live at once and spill them to the stack.
    if constexpr (L::kNibbles) {
#pragma GCC unroll 1
      for (int s = 0; s < 4; ++s) {
        const int64_t at = L::kScaleBytes + 32 * s;
        typename V::Int lo, hi;
        V::nibbles(V::load(b0 + at, b1 + at), lo, hi);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
          for (int l = 0; l < LEVELS; ++l) {
            const int8_t* x = ab + r * lda + l * kBlock;
            sum[l][r] = D::add(sum[l][r], lo, V::bcast4(x + 4 * s));
            sum[l][r] = D::add(sum[l][r], hi, V::bcast4(x + 16 + 4 * s));
          }
        }
      }
    } else {
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const int64_t at = L::kScaleBytes + 32 * j;
        const typename V::Int v = D::prepare(V::load(b0 + at, b1 + at));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
          for (int l = 0; l < LEVELS; ++l) {
            sum[l][r] = D::add(sum[l][r], v, V::bcast4(ab + r * lda + l * kBlock + 4 * j));
          }
        }
      }
    }
    const typename V::Float d = V::halves(b0, b1);
    typename V::Float off = V::zero();
    if constexpr (L::kMins) {
      off = V::halves(b0 + 16, b1 + 16);
    } else if constexpr (D::kOffset != 0) {
      off = V::mul(d, V::splat(float(D::kOffset)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const ActBlock s = act[r * nb + b];
      typename V::Float dot = V::to_float(D::sums(sum[0][r]));
      if constexpr (LEVELS == 2) {
        dot = V::fmadd(dot, V::splat(254.0f), V::to_float(D::sums(sum[1][r])));
      }
      acc[r] = V::fmadd(dot, V::mul(d, V::splat(s.d)), acc[r]);
      if constexpr (L::kMins || D::kOffset != 0) {
        acc[r] = V::fmadd(off, V::splat(s.s), acc[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) V::store(c + r * ldc, acc[r], cols, bias);
}

template <Fmt F, int ROWS, int LEVELS>
void tile_group(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const uint8_t* w,
                float* c, int64_t ldc, int64_t cols, const float* bias) {
  tile_i8<Vec256, F, ROWS, LEVELS>(a, lda, act, nb, w, w, c, ldc, cols, bias);
}

template <Fmt F, int ROWS, int LEVELS>
constexpr Tile kTile = tile_group<F, ROWS, LEVELS>;

#else

template <Fmt F, int ROWS, int LEVELS>
constexpr Tile kTile = tile_portable<F, ROWS, LEVELS>;

#endif

}  // namespace shoal::quant
