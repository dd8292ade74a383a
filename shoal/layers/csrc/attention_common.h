// What the decode and prefill attention kernels share: the cache geometry, a walk over a
// sequence's tokens run by run, a row softmax and the portable one-query attention that
// builds without our vector code take (and float64, which the tests use).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace shoal {

struct Shape {
  int64_t heads, kv_heads, dim, block_size, max_blocks;
  // Elements between consecutive tokens of the cache: kv_heads * dim unless set, as when a
  // caller attends one kv head (kv_heads 1) of a cache that holds several.
  int64_t stride = 0;
  int64_t token_stride() const { return stride ? stride : kv_heads * dim; }
};

// Calls fn(t, m, rows) for runs of up to RUN consecutive tokens of `cache` (keys or values)
// within one block, in order, over the first `len` tokens. Blocks sit anywhere in the pool and
// the hardware prefetcher stops at page boundaries, so while a run is read the same tokens of
// the next block are requested into L2 (prefetcht1). Into L1 (prefetcht0) the requests stalled
// on full miss buffers: decode read 12 GB/s on Zen 4 at 64 sequences, 19.5 into L2, of the ~25
// GB/s that two cores stream.
template <int64_t RUN, typename T, typename Fn>
inline void for_each_run(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                         int64_t token_stride, Fn&& fn) {
  const int64_t block_stride = block_size * token_stride;
  const int64_t token_bytes = token_stride * int64_t(sizeof(T));
  const int64_t blocks = (len + block_size - 1) / block_size;
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t start = j * block_size, n = std::min(block_size, len - start);
    const T* block = cache + table[j] * block_stride;
    const char* next =
        j + 1 < blocks ? reinterpret_cast<const char*>(cache + table[j + 1] * block_stride)
                       : nullptr;
    for (int64_t i = 0; i < n; i += RUN) {
      const int64_t m = std::min(RUN, n - i);
      if (next) {
        for (int64_t off = i * token_bytes; off < (i + m) * token_bytes; off += 64)
          __builtin_prefetch(next + off, 0, 2);
      }
      fn(start + i, m, block + i * token_stride);
    }
  }
}

// exp(x) for x <= 0 (a score less its row's max), with x raised to at least -87: libmvec's
// vector exp hands every lane below about -87.3 (masked keys, a first rescale from the -1e30
// start) to the scalar expf, one call a lane, and e^-87 (1.6e-38) weighs nothing beside the
// row's largest term, 1.
template <typename T>
inline T exp_nonpositive(T x) {
  return std::exp(std::max(x, T(-87)));
}

// Softmax over each head's row of scores, in place.
template <typename T>
void softmax_rows(T* scores, int64_t heads, int64_t len) {
  for (int64_t h = 0; h < heads; ++h) {
    T* row = scores + h * len;
    const T m = *std::max_element(row, row + len);
    T total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      row[t] = exp_nonpositive(row[t] - m);
      total += row[t];
    }
    const T inv = T(1) / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) row[t] *= inv;
  }
}

// Portable path. DIM > 0 fixes the head size at compile time, so the dot products unroll;
// DIM == 0 takes it from `s` at run time.
template <typename T, typename KV, int64_t DIM>
void attend_portable(const T* q, const KV* kc, const KV* vc, const int64_t* table, int64_t len,
                     T* out, const Shape& s, T scale, std::vector<T>& scores,
                     std::vector<T>& acc) {
  const int64_t group = s.heads / s.kv_heads, dim = DIM > 0 ? DIM : s.dim, heads = s.heads;
  const int64_t token_stride = s.token_stride();
  scores.resize(heads * len);
  for_each_run<1>(kc, table, len, s.block_size, token_stride, [&](int64_t t, int64_t, const KV* k) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* qh = q + h * dim;
      const KV* kh = k + (h / group) * dim;
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * widen(kh[d]);
      scores[h * len + t] = dot * scale;
    }
  });
  softmax_rows(scores.data(), heads, len);
  acc.assign(heads * dim, T(0));
  for_each_run<1>(vc, table, len, s.block_size, token_stride, [&](int64_t t, int64_t, const KV* v) {
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
using Attend = void (*)(const T*, const KV*, const KV*, const int64_t*, int64_t, T*, const Shape&,
                        T, std::vector<T>&, std::vector<T>&);

template <typename T, typename KV>
Attend<T, KV> pick_portable(int64_t dim) {
  if (dim == 64) return attend_portable<T, KV, 64>;
  if (dim == 128) return attend_portable<T, KV, 128>;
  return attend_portable<T, KV, 0>;
}

// The one-query attention this build runs for float32 queries over a float32 (KV = float) or
// bfloat16 (KV = uint16_t) cache (paged_decode.cpp), for callers with their own threads.
template <typename KV>
Attend<float, KV> decode_attend(int64_t dim);

}  // namespace shoal
