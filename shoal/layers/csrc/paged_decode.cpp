// Decode attention straight from the paged KV cache, for the CPU.
//
// Each sequence has one query token. Keys and values are read in place from their blocks, so
// nothing is gathered into a padded copy (torch's gather moved ~1 GB per decode step on
// SmolLM2 at 64 sequences). Per sequence, two sequential passes over its blocks: scores of
// every query head against each cached token (all kv heads of a token sit together in
// memory), then the softmax-weighted sum of the values. Threads take sequences one at a time
// (OpenMP's dynamic schedule), so long and short contexts balance; the library links the
// libgomp torch has loaded, so this runs on torch's own thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, block_size, max_blocks;
};

// Keys and values are stored as T, or as bfloat16 (uint16_t, the top half of a float32) next
// to float32 queries: widening is a 16-bit shift, which vectorizes.
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Calls fn(t, row) with each of the first `len` tokens' rows of `cache` (keys or values), block
// by block. Blocks sit anywhere in the pool and the hardware prefetcher stops at page
// boundaries, so the next block is requested while the current one is read (1.7-2x on
// SmolLM2-sized batches whose KV is not in cache).
template <typename T, typename Fn>
inline void for_each_token(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                           int64_t token_stride, Fn&& fn) {
  const int64_t block_stride = block_size * token_stride;
  const int64_t token_bytes = token_stride * int64_t(sizeof(T));
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t n = std::min(block_size, len - start), j = start / block_size;
    const T* block = cache + table[j] * block_stride;
    const char* next =
        start + n < len ? reinterpret_cast<const char*>(cache + table[j + 1] * block_stride)
                        : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      if (next) {
        for (int64_t off = 0; off < token_bytes; off += 64)
          __builtin_prefetch(next + i * token_bytes + off);
      }
      fn(start + i, block + i * token_stride);
    }
  }
}

// DIM > 0 fixes the head size at compile time, so the dot products unroll into registers
// (2.2x on SmolLM2's 64); DIM == 0 takes the head size from `s` at run time.
template <typename T, typename KV, int64_t DIM>
void attend_one(const T* q, const KV* kc, const KV* vc, const int64_t* table, int64_t len,
                T* out, const Shape& s, T scale, std::vector<T>& scores, std::vector<T>& acc) {
  const int64_t group = s.heads / s.kv_heads, dim = DIM > 0 ? DIM : s.dim, heads = s.heads;
  const int64_t token_stride = s.kv_heads * dim;
  scores.resize(heads * len);
  // Pass 1: scores[h][t] = q[h] . k[t][h / group] * scale.
  for_each_token(kc, table, len, s.block_size, token_stride, [&](int64_t t, const KV* k) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* qh = q + h * dim;
      const KV* kh = k + (h / group) * dim;
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * widen(kh[d]);
      scores[h * len + t] = dot * scale;
    }
  });
  // Softmax over each head's row.
  for (int64_t h = 0; h < heads; ++h) {
    T* row = scores.data() + h * len;
    const T m = *std::max_element(row, row + len);
    T total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - m);
      total += row[t];
    }
    const T inv = T(1) / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) row[t] *= inv;
  }
  // Pass 2: out[h] = sum_t p[h][t] * v[t][h / group].
  acc.assign(heads * dim, T(0));
  for_each_token(vc, table, len, s.block_size, token_stride, [&](int64_t t, const KV* v) {
    for (int64_t h = 0; h < heads; ++h) {
      const T p = scores[h * len + t];
      const KV* vh = v + (h / group) * dim;
      T* a = acc.data() + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * widen(vh[d]);
    }
  });
  std::copy(acc.begin(), acc.end(), out);
}

template <typename T, typename KV>
void decode(const T* q, const KV* kc, const KV* vc, const int64_t* tables, const int64_t* lens,
            T* out, int64_t batch, const Shape& s, double scale, int64_t num_threads) {
  const auto attend = s.dim == 64    ? attend_one<T, KV, 64>
                      : s.dim == 128 ? attend_one<T, KV, 128>
                                     : attend_one<T, KV, 0>;
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
