// Whole KV blocks between the pool's per-layer caches and one buffer per block
// `[caches, block_bytes]` (caches = layers x {k, v}), in one call: a demotion to host memory or
// a promotion back is caches x blocks copies of one block each, spread over torch's OpenMP
// threads. Block ids may be anywhere in the pool, buffers anywhere in memory.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

extern "C" void scatter_blocks(const char* const* srcs, char* const* caches, int64_t num_caches,
                               const int64_t* block_ids, int64_t num_blocks, int64_t block_bytes,
                               int64_t num_threads) {
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, num_caches)));
#pragma omp parallel for collapse(2) num_threads(threads)
  for (int64_t c = 0; c < num_caches; ++c) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      std::memcpy(caches[c] + block_ids[b] * block_bytes,
                  srcs[b] + c * block_bytes, size_t(block_bytes));
    }
  }
}

extern "C" void gather_blocks(char* const* dsts, const char* const* caches, int64_t num_caches,
                              const int64_t* block_ids, int64_t num_blocks, int64_t block_bytes,
                              int64_t num_threads) {
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, num_caches)));
#pragma omp parallel for collapse(2) num_threads(threads)
  for (int64_t c = 0; c < num_caches; ++c) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      std::memcpy(dsts[b] + c * block_bytes,
                  caches[c] + block_ids[b] * block_bytes, size_t(block_bytes));
    }
  }
}
