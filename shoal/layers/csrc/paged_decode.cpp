// Decode attention straight from the paged KV cache, for the CPU.
//
// Each sequence has one query token. Keys and values are read in place from their blocks, so
// nothing is gathered into a padded copy (torch's gather moved ~1 GB per decode step on
// SmolLM2 at 64 sequences). Two passes per (sequence, kv head): scores for every cached token
// and every query head of the group, then a softmax-weighted sum of the values.
// Work is split over sequences with std::thread; no OpenMP runtime, so it never fights
// torch's thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

template <typename T>
void decode_range(const T* q, const T* kc, const T* vc, const int64_t* tables,
                  const int64_t* lens, T* out, int64_t heads, int64_t kv_heads,
                  int64_t dim, int64_t block_size, int64_t max_blocks, double scale,
                  int64_t begin, int64_t end) {
  const int64_t group = heads / kv_heads;
  std::vector<T> scores;
  std::vector<T> acc(group * dim);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = lens[b];
    const int64_t* table = tables + b * max_blocks;
    scores.resize(group * len);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      const T* qg = q + (b * heads + kh * group) * dim;
      for (int64_t t = 0; t < len; ++t) {
        const T* k = kc + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kh) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const T* qh = qg + g * dim;
          T s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qh[d] * k[d];
          scores[g * len + t] = s * static_cast<T>(scale);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* sg = scores.data() + g * len;
        const T m = *std::max_element(sg, sg + len);
        T total = 0;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) total += (sg[t] = std::exp(sg[t] - m));
        const T inv = 1 / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vc + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kh) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const T p = scores[g * len + t];
          T* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
        }
      }
      T* o = out + (b * heads + kh * group) * dim;
      std::copy(acc.begin(), acc.end(), o);
    }
  }
}

template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens,
            T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t block_size, int64_t max_blocks, double scale, int64_t num_threads) {
  num_threads = std::max<int64_t>(1, std::min(num_threads, batch));
  std::vector<std::thread> workers;
  const int64_t per = (batch + num_threads - 1) / num_threads;
  for (int64_t i = 1; i < num_threads; ++i) {
    const int64_t begin = i * per, end = std::min(batch, begin + per);
    if (begin < end)
      workers.emplace_back(decode_range<T>, q, kc, vc, tables, lens, out, heads, kv_heads,
                           dim, block_size, max_blocks, scale, begin, end);
  }
  decode_range<T>(q, kc, vc, tables, lens, out, heads, kv_heads, dim, block_size, max_blocks,
                  scale, 0, std::min(batch, per));
  for (auto& w : workers) w.join();
}

}  // namespace

extern "C" {
void paged_decode_f32(const float* q, const float* kc, const float* vc, const int64_t* tables,
                      const int64_t* lens, float* out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks,
                      double scale, int64_t num_threads) {
  decode<float>(q, kc, vc, tables, lens, out, batch, heads, kv_heads, dim, block_size,
                max_blocks, scale, num_threads);
}
void paged_decode_f64(const double* q, const double* kc, const double* vc,
                      const int64_t* tables, const int64_t* lens, double* out, int64_t batch,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                      int64_t max_blocks, double scale, int64_t num_threads) {
  decode<double>(q, kc, vc, tables, lens, out, batch, heads, kv_heads, dim, block_size,
                 max_blocks, scale, num_threads);
}
}
