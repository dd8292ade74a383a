// Activation rows quantized to int8 blocks of 32 for the quantized products (qgemm.cpp): per
// block, d = max|x| / 127, q = round(x / d) (to nearest even), and s = d * sum(q). A block of
// zeros gets d = 0 and q = 0. Rows run in parallel once a call is big enough.

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

#if defined(__AVX2__) && defined(__FMA__)
inline ActBlock quantize_block(const float* x, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const float d = top / 127.0f;
  const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // Sum before narrowing; then pack 32 int32 into 32 int8, undoing the lane interleave.
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                         _mm256_add_epi32(i32[2], i32[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_hadd_epi32(t, t);
  t = _mm_hadd_epi32(t, t);
  const __m256i w01 = _mm256_packs_epi32(i32[0], i32[1]);
  const __m256i w23 = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i b = _mm256_packs_epi16(w01, w23);
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  return {d, d * float(_mm_cvtsi128_si32(t))};
}
#else
inline ActBlock quantize_block(const float* x, int8_t* q) {
  float top = 0.0f;
  for (int i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(x[i]));
  const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = int8_t(std::nearbyint(x[i] * inv));
    sum += q[i];
  }
  return {d, d * float(sum)};
}
#endif

}  // namespace

void shoal::quant::quantize_row(const float* x, int64_t k, int8_t* q, ActBlock* blocks) {
  for (int64_t b = 0; b < k / kBlock; ++b) blocks[b] = quantize_block(x + b * kBlock, q + b * kBlock);
}

// x: `rows` rows of `k` floats, `ldx` apart (k a multiple of 32); q: rows x k int8;
// blocks: rows x (k / 32) ActBlocks.
extern "C" void quantize_rows_q8(const float* x, int64_t ldx, int64_t rows, int64_t k, int8_t* q,
                                 ActBlock* blocks, int64_t num_threads) {
  const int64_t nb = k / kBlock;
  const int threads = rows * k < (1 << 15) ? 1 : int(std::max<int64_t>(1, std::min(num_threads, rows)));
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) shoal::quant::quantize_row(x + r * ldx, k, q + r * k, blocks + r * nb);
}
