// Activation rows quantized for the quantized products (qgemm.cpp), in blocks of 32, with one
// or two int8 levels per value (qtile.h says why two). Per block, with A = max|x|:
// - one level: d = A / 127, q = round(x / d);
// - two: d = A / (127 * 254), q1 = round(x / (254 d)), q2 = round((x - 254 d q1) / d), so a
//   value is d (254 q1 + q2), within d / 2 of x;
// both to nearest even, and s = d * (the sum of the block's values in units of d). A block of
// zeros gets d = 0 and zeros. A row's bytes are, block after block, q (or q1 then q2).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant_blocks.h"
#include "quant_ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using shoal::quant::ActBlock;
using shoal::quant::kBlock;

constexpr float kFine = 254.0f;  // q1 steps in q2 steps

#if defined(__AVX2__) && defined(__FMA__)
inline float block_max(const __m256* v) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t total(const __m256i* q) {
  const __m256i t8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(t8), _mm256_extracti128_si256(t8, 1));
  t = _mm_hadd_epi32(t, t);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(t, t));
}

// 32 int32 (each in [-127, 127]) as 32 int8, in order: the saturating packs work within
// 128-bit lanes, the permute restores the order.
inline void store_bytes(const __m256i* q, int8_t* out) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(b, idx));
}

template <int LEVELS>
inline ActBlock quantize_block(const float* x, int8_t* q) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const float top = block_max(v);
  const float d = LEVELS == 1 ? top / 127.0f : top / (127.0f * kFine);
  const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  __m256i q1[4];
  for (int i = 0; i < 4; ++i) q1[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  store_bytes(q1, q);
  if constexpr (LEVELS == 1) return {d, d * float(total(q1))};
  const __m256 step = _mm256_set1_ps(d * kFine), fine = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i q2[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q1[i]), step, v[i]);
    q2[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, fine));
  }
  store_bytes(q2, q + kBlock);
  return {d, d * (kFine * float(total(q1)) + float(total(q2)))};
}
#else
template <int LEVELS>
inline ActBlock quantize_block(const float* x, int8_t* q) {
  float top = 0.0f;
  for (int i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(x[i]));
  const float d = LEVELS == 1 ? top / 127.0f : top / (127.0f * kFine);
  const float inv = top > 0.0f ? 127.0f / top : 0.0f, fine = d > 0.0f ? 1.0f / d : 0.0f;
  float units = 0.0f;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = int8_t(std::nearbyint(x[i] * inv));
    if constexpr (LEVELS == 2) {
      const float rest = x[i] - float(q[i]) * (d * kFine);
      q[kBlock + i] = int8_t(std::nearbyint(rest * fine));
      units += kFine * float(q[i]) + float(q[kBlock + i]);
    } else {
      units += float(q[i]);
    }
  }
  return {d, d * units};
}
#endif

}  // namespace

void shoal::quant::quantize_row(const float* x, int64_t k, int levels, int8_t* q,
                                ActBlock* blocks) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    int8_t* out = q + b * kBlock * levels;
    blocks[b] = levels == 2 ? quantize_block<2>(x + b * kBlock, out)
                            : quantize_block<1>(x + b * kBlock, out);
  }
}

// x: `rows` rows of `k` floats, `ldx` apart (k a multiple of 32); q: rows x (levels * k)
// int8; blocks: rows x (k / 32) ActBlocks.
extern "C" void quantize_rows(const float* x, int64_t ldx, int64_t rows, int64_t k,
                              int64_t levels, int8_t* q, ActBlock* blocks, int64_t num_threads) {
  const int64_t nb = k / kBlock;
  const int threads =
      rows * k < (1 << 15) ? 1 : int(std::max<int64_t>(1, std::min(num_threads, rows)));
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    shoal::quant::quantize_row(x + r * ldx, k, int(levels), q + r * k * levels, blocks + r * nb);
  }
}
