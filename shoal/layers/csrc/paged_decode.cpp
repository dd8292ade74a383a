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

// Rows of `n` tokens, `stride` apart, as float32: in place for a float32 cache; for bfloat16,
// the first `row_len` values of each (the kv heads attended) widened into `buf`, same stride.
template <typename KV>
inline const float* as_float(const KV* rows, int64_t n, int64_t row_len, int64_t stride,
                             float* buf) {
  if constexpr (sizeof(KV) == sizeof(float)) {
    return reinterpret_cast<const float*>(rows);
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < row_len; i += kLanes)
        shoal::vstore(buf + t * stride + i, shoal::vload(rows + t * stride + i));
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
  const int64_t token_stride = s.token_stride();
  scores.resize(heads * len + TU * token_stride);  // the tail widens bfloat16 rows
  float* sc = scores.data();
  float* wide = sc + heads * len;
  auto walk = [&](const KV* cache, auto&& fn) {
    shoal::for_each_run<TU>(cache, table, len, s.block_size, token_stride,
                            [&](int64_t t, int64_t m, const KV* rows) {
                              fn(t, m, as_float(rows, m, kv_heads * DIM, token_stride, wide));
                            });
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

#if defined(__AVX512BF16__)
// bfloat16 queries over a bfloat16 cache with AVX512_BF16 (Zen 4, Sapphire Rapids): VDPBF16PS
// multiplies pairs of bfloat16 and accumulates in float32, 32 products an instruction, so no
// key or value is ever widened. One streaming pass over the keys, four tokens at a time: each
// kv head's four key rows stay in registers for its query heads, whose four dot products are
// reduced by one shuffle tree. One pass over the values: two tokens' rows interleaved (unpack
// lo/hi) meet the pair of their probabilities, rounded to bfloat16 as transformers rounds them
// before P·V; the unpacks permute the dimensions of the accumulators, the final store undoes it.
template <int DIM>
void attend_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                 int64_t len, uint16_t* out, const Shape& s, float scale, std::vector<float>& sc,
                 std::vector<float>& acc) {
  constexpr int NP = DIM / 32;  // vectors of 32 bfloat16 per head row
  const int64_t group = s.heads / s.kv_heads, heads = s.heads, token_stride = s.token_stride();
  sc.resize(heads * len);
  float* scores = sc.data();
  auto load = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  shoal::for_each_run<TU>(kc, table, len, s.block_size, token_stride, [&](int64_t t, int64_t m, const uint16_t* k) {
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      if (m == TU) {
        __m512bh key[TU][NP];
        for (int i = 0; i < TU; ++i)
          for (int c = 0; c < NP; ++c) key[i][c] = load(k + i * token_stride + g * DIM + c * 32);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          __m512 d[TU];
          for (int i = 0; i < TU; ++i) d[i] = _mm512_setzero_ps();
          for (int c = 0; c < NP; ++c) {
            const __m512bh qh = load(q + h * DIM + c * 32);
            for (int i = 0; i < TU; ++i) d[i] = _mm512_dpbf16_ps(d[i], qh, key[i][c]);
          }
          const __m128 sums = shoal::vsum4(d[0], d[1], d[2], d[3]);
          _mm_storeu_ps(scores + h * len + t, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
        continue;
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          __m512 d = _mm512_setzero_ps();
          for (int c = 0; c < NP; ++c)
            d = _mm512_dpbf16_ps(d, load(q + h * DIM + c * 32),
                                 load(k + i * token_stride + g * DIM + c * 32));
          scores[h * len + t + i] = _mm512_reduce_add_ps(d) * scale;
        }
      }
    }
  });
  shoal::softmax_rows(scores, heads, len);
  acc.assign(heads * DIM, 0.0f);
  float* a = acc.data();
  const __m512i zero = _mm512_setzero_si512();
  shoal::for_each_run<TU>(vc, table, len, s.block_size, token_stride, [&](int64_t t, int64_t m, const uint16_t* v) {
    const int64_t pairs = (m + 1) / 2;  // an odd last token pairs with a zero row
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      __m512bh lo[TU / 2][NP], hi[TU / 2][NP];
      for (int64_t pi = 0; pi < pairs; ++pi) {
        const uint16_t* row = v + 2 * pi * token_stride + g * DIM;
        const bool two = 2 * pi + 1 < m;
        for (int c = 0; c < NP; ++c) {
          const __m512i v0 = _mm512_loadu_si512(row + c * 32);
          const __m512i v1 = two ? _mm512_loadu_si512(row + token_stride + c * 32) : zero;
          lo[pi][c] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
          hi[pi][c] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        }
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* p = scores + h * len + t;
        float* ah = a + h * DIM;
        __m512 x[2 * NP];
        for (int c = 0; c < 2 * NP; ++c) x[c] = _mm512_loadu_ps(ah + 16 * c);
        for (int64_t pi = 0; pi < pairs; ++pi) {
          const uint32_t second = 2 * pi + 1 < m ? shoal::to_bf16(p[2 * pi + 1]) : 0;
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(
              int(shoal::to_bf16(p[2 * pi]) | second << 16));
          for (int c = 0; c < NP; ++c) {
            x[2 * c] = _mm512_dpbf16_ps(x[2 * c], lo[pi][c], pp);
            x[2 * c + 1] = _mm512_dpbf16_ps(x[2 * c + 1], hi[pi][c], pp);
          }
        }
        for (int c = 0; c < 2 * NP; ++c) _mm512_storeu_ps(ah + 16 * c, x[c]);
      }
    }
  });
  // Lane 4k + i of the lo vector of chunk c holds dimension 32c + 8k + i; of hi, 32c + 8k + 4 + i.
  for (int64_t h = 0; h < heads; ++h) {
    const float* ah = a + h * DIM;
    uint16_t* o = out + h * DIM;
    for (int c = 0; c < NP; ++c)
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 4; ++i) {
          o[32 * c + 8 * k + i] = shoal::to_bf16(ah[32 * c + 4 * k + i]);
          o[32 * c + 8 * k + 4 + i] = shoal::to_bf16(ah[32 * c + 16 + 4 * k + i]);
        }
  }
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

template <typename KV>
shoal::Attend<float, KV> shoal::decode_attend(int64_t dim) {
  return pick<float, KV>(dim);
}
template shoal::Attend<float, float> shoal::decode_attend<float>(int64_t);
template shoal::Attend<float, uint16_t> shoal::decode_attend<uint16_t>(int64_t);

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

// bfloat16 queries and outputs over a bfloat16 cache: VDPBF16PS where the build has AVX512_BF16,
// otherwise the float32 path on widened queries.
extern "C" void paged_decode_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                  const int64_t* tables, const int64_t* lens, uint16_t* out,
                                  int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t max_blocks, double scale,
                                  int64_t num_threads) {
  const Shape s{heads, kv_heads, dim, block_size, max_blocks};
  const int64_t width = heads * dim;
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, batch)));
  using Native = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                         int64_t, uint16_t*, const Shape&, float, std::vector<float>&,
                         std::vector<float>&);
  Native native = nullptr;
#if defined(__AVX512BF16__)
  native = dim == 64 ? attend_bf16<64> : dim == 128 ? attend_bf16<128> : nullptr;
#endif
  const auto widened = pick<float, uint16_t>(dim);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, acc, qf(width), of(width);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const uint16_t* qb = q + b * width;
      uint16_t* ob = out + b * width;
      if (native) {
        native(qb, kc, vc, tables + b * max_blocks, lens[b], ob, s, float(scale), scores, acc);
        continue;
      }
      for (int64_t e = 0; e < width; ++e) qf[e] = shoal::widen(qb[e]);
      widened(qf.data(), kc, vc, tables + b * max_blocks, lens[b], of.data(), s, float(scale),
              scores, acc);
      for (int64_t e = 0; e < width; ++e) ob[e] = shoal::to_bf16(of[e]);
    }
  }
}

// What this build's vector code targets: "avx512", "avx2" or "generic".
extern "C" const char* shoal_isa() { return SHOAL_ISA; }
