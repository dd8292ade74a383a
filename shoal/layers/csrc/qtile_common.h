// What the quantized product tiles share (qtile.h): which integer dot products this build
// has, the store of a tile row, and the portable tile.
//
// A tile is ROWS rows of A against one group (8 rows of W) over all blocks of k. Per block the
// integer sums of each row meet the scales in the epilogue:
//   C += d_w * d_a * sum(q_w * q_a) + off_w * s_a,
// where off_w is Q4_1's min, -8 d_w for Q4_0 (its values are q - 8), -128 d_w where the
// int8 VNNI path reads Q8_0 values as unsigned (q + 128), and s_a = d_a * sum(q_a).
// The vector tiles are 256-bit (one group); AVX-512 VNNI builds take two groups at a time in
// 512-bit vectors (qtile512.h) and, with AMX-INT8, 16 rows of A at a time on tiles
// (qtile_amx.h).

#pragma once

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SHOAL_QGEMM_VEC 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SHOAL_QGEMM_ISA "avx512vnni"
#define SHOAL_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SHOAL_QGEMM_ISA "avxvnni"
#define SHOAL_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define SHOAL_QGEMM_ISA "avx2"
#endif
#else
#define SHOAL_QGEMM_VEC 0
#define SHOAL_QGEMM_ISA "generic"
#endif

namespace shoal::quant {

using Tile = void (*)(const int8_t*, int64_t, const ActBlock*, int64_t, const uint8_t*, float*,
                      int64_t, int64_t, const float*);

#if SHOAL_QGEMM_VEC

// Row 8 values of C (the first `cols` of them), plus the bias.
inline void store8(float* c, __m256 v, int64_t cols, const float* bias) {
  if (bias) {
    alignas(32) float b[kRows] = {};
    std::memcpy(b, bias, cols * sizeof(float));
    v = _mm256_add_ps(v, _mm256_load_ps(b));
  }
  if (cols == kRows) {
    _mm256_storeu_ps(c, v);
    return;
  }
  alignas(32) float tmp[kRows];
  _mm256_store_ps(tmp, v);
  std::memcpy(c, tmp, cols * sizeof(float));
}

// A block's 8 float16 scales (or mins) as float32.
inline __m256 halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

#else

// Portable loops over the same layout, for one or two activation levels.
template <Fmt F, int ROWS, int LEVELS>
void tile_portable(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb,
                   const uint8_t* w, float* c, int64_t ldc, int64_t cols, const float* bias) {
  using L = Layout<F>;
  float acc[ROWS][kRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * L::kBytes;
    const uint8_t* quants = blk + L::kScaleBytes;
    for (int l = 0; l < kRows; ++l) {
      const float d = half_to_float(load_u16(blk + 2 * l));
      const float m = L::kMins ? half_to_float(load_u16(blk + 16 + 2 * l)) : 0.0f;
      int q[kBlock];
      for (int kk = 0; kk < kBlock; ++kk) q[kk] = quant_at<F>(quants, l, kk);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* ar = a + r * lda + b * kBlock * LEVELS;
        int32_t dot = 0;
        for (int kk = 0; kk < kBlock; ++kk) {
          const int32_t x = LEVELS == 2 ? 254 * ar[kk] + ar[kBlock + kk] : ar[kk];
          dot += (F == Fmt::Q4_0 ? q[kk] - 8 : q[kk]) * x;
        }
        const ActBlock s = act[r * nb + b];
        acc[r][l] += d * s.d * float(dot) + m * s.s;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int64_t l = 0; l < cols; ++l) c[r * ldc + l] = acc[r][l] + (bias ? bias[l] : 0.0f);
}

#endif

}  // namespace shoal::quant
