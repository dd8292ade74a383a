// qtile.h's tiles two groups at a time on AVX-512 VNNI builds: one 512-bit vector holds the
// same four k of 16 rows of W (group g's 32-byte vector beside group g + 1's), so each
// VPDPBUSD, each broadcast activation and each epilogue operation serves twice the rows. At
// batch 1 a step is bound by reading the weights either way; from two rows (or two levels) up
// the 256-bit tiles' instructions start to show beside the memory traffic, and this halves
// them. Same products and the same epilogue as qtile.h, in the same order per column.

#pragma once

#include "qtile.h"

#if SHOAL_QGEMM_VEC && defined(SHOAL_DPBUSD) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SHOAL_QGEMM_PAIRS 1

namespace shoal::quant {

inline __m512i pair_of(const uint8_t* lo, const uint8_t* hi) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// Two blocks' 8 float16 scales (or mins) as 16 float32.
inline __m512 halves_of(const uint8_t* lo, const uint8_t* hi) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

inline __m512i bcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// ROWS rows of A against groups w0 and w1 (16 rows of W) over all `nb` blocks of k:
// C[ROWS, cols] for cols up to 16.
template <Fmt F, int ROWS, int LEVELS>
void tile_pair(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const uint8_t* w0,
               const uint8_t* w1, float* c, int64_t ldc, int64_t cols, const float* bias) {
  using L = Layout<F>;
  constexpr int kOffset = DotI8<F>::kOffset;
  __m512 acc[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = w0 + b * L::kBytes;
    const uint8_t* b1 = w1 + b * L::kBytes;
    const int8_t* ab = a + b * kBlock * LEVELS;
    __m512i sum[LEVELS][ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < LEVELS; ++v) sum[v][r] = _mm512_setzero_si512();
    if constexpr (L::kNibbles) {
#pragma GCC unroll 1
      for (int s = 0; s < 4; ++s) {
        const __m512i v = pair_of(b0 + L::kScaleBytes + 32 * s, b1 + L::kScaleBytes + 32 * s);
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
          for (int v2 = 0; v2 < LEVELS; ++v2) {
            const int8_t* x = ab + r * lda + v2 * kBlock;
            sum[v2][r] = _mm512_dpbusd_epi32(sum[v2][r], lo, bcast4_512(x + 4 * s));
            sum[v2][r] = _mm512_dpbusd_epi32(sum[v2][r], hi, bcast4_512(x + 16 + 4 * s));
          }
        }
      }
    } else {
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_xor_si512(
            pair_of(b0 + L::kScaleBytes + 32 * j, b1 + L::kScaleBytes + 32 * j),
            _mm512_set1_epi8(char(0x80)));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
          for (int l = 0; l < LEVELS; ++l) {
            sum[l][r] = _mm512_dpbusd_epi32(sum[l][r], v, bcast4_512(ab + r * lda + l * kBlock + 4 * j));
          }
        }
      }
    }
    const __m512 d = halves_of(b0, b1);
    __m512 off = _mm512_setzero_ps();
    if constexpr (L::kMins) {
      off = halves_of(b0 + 16, b1 + 16);
    } else if constexpr (kOffset != 0) {
      off = _mm512_mul_ps(d, _mm512_set1_ps(float(kOffset)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const ActBlock s = act[r * nb + b];
      __m512 dot = _mm512_cvtepi32_ps(sum[0][r]);
      if constexpr (LEVELS == 2) {
        dot = _mm512_fmadd_ps(dot, _mm512_set1_ps(254.0f), _mm512_cvtepi32_ps(sum[1][r]));
      }
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s.d)), acc[r]);
      if constexpr (L::kMins || kOffset != 0) {
        acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(s.s), acc[r]);
      }
    }
  }
  const __mmask16 mask = __mmask16((1u << cols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(c + r * ldc, mask, _mm512_add_ps(acc[r], bv));
}

using PairTile = void (*)(const int8_t*, int64_t, const ActBlock*, int64_t, const uint8_t*,
                          const uint8_t*, float*, int64_t, int64_t, const float*);

template <Fmt F, int ROWS, int LEVELS>
constexpr PairTile kPairTile = tile_pair<F, ROWS, LEVELS>;

}  // namespace shoal::quant

#else
#define SHOAL_QGEMM_PAIRS 0
#endif
