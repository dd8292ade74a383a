// Quantized weight groups (quant_blocks.h) dequantized into gemm.cpp's float32 panels: 16
// output columns (two groups of 8 rows), k-major, panel[kk * 16 + j] = W[16p + j][kk]. Large
// products (prefill) run the float32 kernel on them, one panel at a time: the dequantization
// is a few operations per weight, against one FMA per weight and row of A, and the rows of A
// stay float (exact to float32). AVX2 + FMA + F16C builds, as gemm.cpp.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

namespace shoal::quant {

// One quad vector (8 rows x 4 k, bytes, row after row) as float32 rows d * q + m of its four
// k, each 8 rows wide, stored at out + kk * 16.
template <bool SIGNED>
inline void quad_to_panel(__m256i bytes, __m256 d, __m256 m, float* out) {
  // Within each 128-bit lane (rows 0-3, rows 4-7), bytes k-major; then the dwords of both
  // lanes interleaved, so qword i holds k = i for rows 0-7.
  const __m256i by_k = _mm256_shuffle_epi8(
      bytes, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12,
                              1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m256i rows = _mm256_permutevar8x32_epi32(by_k, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i halves[2] = {_mm256_castsi256_si128(rows), _mm256_extracti128_si256(rows, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
    const __m256i q = SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    _mm256_storeu_ps(out + i * 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m));
  }
}

// One group's `nb` blocks as columns [0, 8) of a panel (`out` at its first column).
template <Fmt F>
void group_to_panel(const uint8_t* group, int64_t nb, float* out) {
  using L = Layout<F>;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const uint8_t* quants = blk + L::kScaleBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256 m = _mm256_setzero_ps();
    if constexpr (L::kMins) {
      m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    } else if constexpr (F == Fmt::Q4_0) {
      m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    }
    float* at = out + b * kBlock * 16;
    if constexpr (L::kNibbles) {
      for (int s = 0; s < 4; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * s));
        quad_to_panel<false>(_mm256_and_si256(v, low4), d, m, at + 4 * s * 16);
        quad_to_panel<false>(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), d, m,
                             at + (16 + 4 * s) * 16);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
        quad_to_panel<true>(v, d, m, at + 4 * j * 16);
      }
    }
  }
}

// Panel p (groups 2p and 2p + 1; zeros past the last group) of a weight of `groups` groups.
inline void dequantize_panel(Fmt fmt, const uint8_t* w, int64_t k, int64_t groups, int64_t p,
                             float* out) {
  const int64_t nb = k / kBlock;
  for (int half = 0; half < 2; ++half) {
    const int64_t g = 2 * p + half;
    float* cols = out + 8 * half;
    if (g >= groups) {
      for (int64_t kk = 0; kk < k; ++kk) std::memset(cols + kk * 16, 0, 8 * sizeof(float));
      continue;
    }
    switch (fmt) {
      case Fmt::Q4_0:
        group_to_panel<Fmt::Q4_0>(w + g * nb * Layout<Fmt::Q4_0>::kBytes, nb, cols);
        break;
      case Fmt::Q4_1:
        group_to_panel<Fmt::Q4_1>(w + g * nb * Layout<Fmt::Q4_1>::kBytes, nb, cols);
        break;
      case Fmt::Q8_0:
        group_to_panel<Fmt::Q8_0>(w + g * nb * Layout<Fmt::Q8_0>::kBytes, nb, cols);
        break;
    }
  }
}

inline int64_t group_bytes(Fmt fmt, int64_t k) {
  const int64_t nb = k / kBlock;
  switch (fmt) {
    case Fmt::Q4_0: return nb * Layout<Fmt::Q4_0>::kBytes;
    case Fmt::Q4_1: return nb * Layout<Fmt::Q4_1>::kBytes;
    case Fmt::Q8_0: return nb * Layout<Fmt::Q8_0>::kBytes;
  }
  return 0;
}

}  // namespace shoal::quant
