// Decode attention straight from the paged KV cache, for the CPU.
//
// Each sequence has one query token. Keys and values are read in place from their blocks, so
// nothing is gathered into a padded copy (torch's gather moved ~1 GB per decode step on
// SmolLM2 at 64 sequences). Per sequence, two sequential passes over its blocks: scores of
// every query head against each cached token (all kv heads of a token sit together in
// memory), then the softmax-weighted sum of the values. Threads take sequences one at a time
// (OpenMP's dynamic schedule), so long and short contexts balance; the library links the
// libgomp torch has loaded, so this runs on torch's own thread pool.
//
// Float32 queries against a float32 or bfloat16 cache take explicit vector code where the build
// has AVX-512 or AVX2 (simd.h), four tokens at a time (see attend_vec). Float64 (tests) and
// builds without those ISAs take portable loops the compiler vectorizes.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_common.h"

namespace {

using shoal::Shape;

#if SHOAL_HAS_VEC
using shoal::kLanes;
using shoal::Vec;

constexpr int TU = 4;  // tokens per step of the vector path

// Rows of `n` tokens as float32: in place for a float32 cache, widened into `buf` for bfloat16.
template <typename KV>
inline const float* as_float(const KV* rows, int64_t n, int64_t row_len, float* buf) {
  if constexpr (sizeof(KV) == sizeof(float)) {
    return reinterpret_cast<const float*>(rows);
  } else {
    for (int64_t i = 0; i < n * row_len; i += kLanes) shoal::vstore(buf + i, shoal::vload(rows + i));
    return buf;
  }
}

// Float32 queries, head size DIM (a multiple of the vector width). Tokens go TU at a time, all
// kv heads of a token together: the TU dot products of a head are reduced by one shuffle tree,
// and the value pass touches each head's accumulator once per TU tokens.
template <typename KV, int DIM>
void attend_vec(const float* q, const KV* kc, const KV* vc, const int64_t* table, int64_t len,
                float* out, const Shape& s, float scale, std::vector<float>& scores,
                std::vector<float>& acc) {
  constexpr int NV = DIM / kLanes;
  const int64_t group = s.heads / s.kv_heads, heads = s.heads, kv_heads = s.kv_heads;
  const int64_t token_stride = kv_heads * DIM, bs = s.block_size;
  const int64_t token_bytes = token_stride * int64_t(sizeof(KV));
  scores.resize(heads * len + TU * token_stride);  // the tail widens bfloat16 rows
  float* sc = scores.data();
  float* wide = sc + heads * len;
  // Calls fn(first token, count, rows) for runs of up to TU tokens within a block, and
  // prefetches the same tokens of the next block.
  auto walk = [&](const KV* cache, auto&& fn) {
    for (int64_t start = 0; start < len; start += bs) {
      const int64_t n = std::min(bs, len - start), j = start / bs;
      const KV* block = cache + table[j] * bs * token_stride;
      const char* next = start + n < len
                             ? reinterpret_cast<const char*>(cache + table[j + 1] * bs * token_stride)
                             : nullptr;
      for (int64_t i = 0; i < n; i += TU) {
        const int64_t m = std::min<int64_t>(TU, n - i);
        if (next) {
          for (int64_t off = i * token_bytes; off < (i + m) * token_bytes; off += 64)
            __builtin_prefetch(next + off);
        }
        fn(start + i, m, as_float(block + i * token_stride, m, token_stride, wide));
      }
    }
  };
  walk(kc, [&](int64_t t, int64_t m, const float* k) {
    if constexpr (NV * TU <= 16) {  // the TU key rows of a kv head fit in registers
      if (m == TU) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          Vec key[TU][NV];
#pragma GCC unroll 16
          for (int i = 0; i < TU; ++i)
            for (int v = 0; v < NV; ++v)
              key[i][v] = shoal::vload(k + i * token_stride + g * DIM + v * kLanes);
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            Vec dot[TU];
#pragma GCC unroll 16
            for (int i = 0; i < TU; ++i) dot[i] = shoal::vzero();
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) {
              const Vec qv = shoal::vload(q + h * DIM + v * kLanes);
              for (int i = 0; i < TU; ++i) dot[i] = shoal::vfma(qv, key[i][v], dot[i]);
            }
            const __m128 sums = shoal::vsum4(dot[0], dot[1], dot[2], dot[3]);
            _mm_storeu_ps(sc + h * len + t, _mm_mul_ps(sums, _mm_set1_ps(scale)));
          }
        }
        return;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * DIM;
      const float* kh = k + (h / group) * DIM;
      for (int64_t i = 0; i < m; ++i) {
        Vec a = shoal::vzero();
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v)
          a = shoal::vfma(shoal::vload(qh + v * kLanes), shoal::vload(kh + i * token_stride + v * kLanes), a);
        sc[h * len + t + i] = shoal::vsum(a) * scale;
      }
    }
  });
  shoal::softmax_rows(sc, heads, len);
  acc.assign(heads * DIM, 0.0f);
  float* a = acc.data();
  walk(vc, [&](int64_t t, int64_t m, const float* v) {
    if constexpr (NV * TU <= 16) {  // the TU value rows of a kv head fit in registers
      if (m == TU) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          Vec val[TU][NV];
#pragma GCC unroll 16
          for (int i = 0; i < TU; ++i)
            for (int c = 0; c < NV; ++c)
              val[i][c] = shoal::vload(v + i * token_stride + g * DIM + c * kLanes);
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const float* p = sc + h * len + t;
            float* ah = a + h * DIM;
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) {
              Vec x = shoal::vload(ah + c * kLanes);
              for (int i = 0; i < TU; ++i) x = shoal::vfma(shoal::vset1(p[i]), val[i][c], x);
              shoal::vstore(ah + c * kLanes, x);
            }
          }
        }
        return;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* vh = v + (h / group) * DIM;
      const float* p = sc + h * len + t;
      float* ah = a + h * DIM;
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        Vec x = shoal::vload(ah + c * kLanes);
        for (int64_t i = 0; i < m; ++i)
          x = shoal::vfma(shoal::vset1(p[i]), shoal::vload(vh + i * token_stride + c * kLanes), x);
        shoal::vstore(ah + c * kLanes, x);
      }
    }
  });
  std::copy(acc.begin(), acc.end(), out);
}
#endif

template <typename T, typename KV>
shoal::Attend<T, KV> pick(int64_t dim) {
#if SHOAL_HAS_VEC
  if constexpr (sizeof(T) == sizeof(float)) {
    if (dim == 64) return attend_vec<KV, 64>;
    if (dim == 128) return attend_vec<KV, 128>;
  }
#endif
  return shoal::pick_portable<T, KV>(dim);
}

template <typename T, typename KV>
void decode(const T* q, const KV* kc, const KV* vc, const int64_t* tables, const int64_t* lens,
            T* out, int64_t batch, const Shape& s, double scale, int64_t num_threads) {
  const auto attend = pick<T, KV>(s.dim);
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, batch)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      attend(q + b * s.heads * s.dim, kc, vc, tables + b * s.max_blocks, lens[b],
             out + b * s.heads * s.dim, s, static_cast<T>(scale), scores, acc);
    }
  }
}

}  // namespace

#define SHOAL_DECODE(NAME, T, KV)                                                             \
  extern "C" void NAME(const T* q, const KV* kc, const KV* vc, const int64_t* tables,         \
                       const int64_t* lens, T* out, int64_t batch, int64_t heads,             \
                       int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks, \
                       double scale, int64_t num_threads) {                                   \
    decode<T, KV>(q, kc, vc, tables, lens, out, batch,                                        \
                  Shape{heads, kv_heads, dim, block_size, max_blocks}, scale, num_threads);   \
  }

SHOAL_DECODE(paged_decode_f32, float, float)
SHOAL_DECODE(paged_decode_f64, double, double)
SHOAL_DECODE(paged_decode_f32_bf16kv, float, uint16_t)

// What this build's vector code targets: "avx512", "avx2" or "generic".
extern "C" const char* shoal_isa() { return SHOAL_ISA; }
