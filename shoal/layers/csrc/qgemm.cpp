// Products of quantized activation rows (blocks of 32 in one or two int8 levels,
// quantize.cpp) with weights kept in their quantized blocks (quant_blocks.h):
// C[m, n] = A[m, k] . W[n, k]^T (+ bias), float32 out. The tiles are qtile.h's.
//
// Threads take groups of 8 rows of W, and every row of A: a group's blocks are read once from
// memory per block of rows and stay in L1 for its tiles, the rows of A in L2.

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "quant_blocks.h"
#include "quant_ops.h"
#include "qtile.h"
#include "qtile512.h"
#include "qtile_amx.h"

namespace {

using namespace shoal::quant;

constexpr int64_t M_BLOCK = 64;  // rows of A kept in L2 while a thread sweeps its groups

// Tiles of up to 4 rows with one level, 2 with two (their sums fill the 16 registers): the
// tile for each count of rows up to that.
template <Fmt F, int LEVELS>
constexpr Tile kTiles[5] = {nullptr, kTile<F, 1, LEVELS>, kTile<F, 2, LEVELS>,
                            kTile<F, 3, 1>, kTile<F, 4, 1>};

#if SHOAL_QGEMM_PAIRS
// Pairs of groups on AVX-512 (qtile512.h): up to 4 rows with either level count (their sums
// and accumulators take 12 of the 32 registers).
constexpr int kPairRows = 4;
template <Fmt F, int LEVELS>
constexpr PairTile kPairTiles[5] = {nullptr, kPairTile<F, 1, LEVELS>, kPairTile<F, 2, LEVELS>,
                                    kPairTile<F, 3, LEVELS>, kPairTile<F, 4, LEVELS>};
#endif

template <Fmt F, int LEVELS>
void groups_of(const int8_t* a, const ActBlock* act, int64_t m, int64_t k, const uint8_t* w,
               int64_t n, float* c, int64_t ldc, const float* bias, int64_t g0, int64_t g1) {
  const int64_t nb = k / kBlock, group_bytes = nb * Layout<F>::kBytes, lda = k * LEVELS;
  constexpr int mr = 4 / LEVELS;
  for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
    const int64_t m1 = std::min(m, m0 + M_BLOCK);
    int64_t g = g0;
#if SHOAL_QGEMM_PAIRS
    for (; g + 1 < g1; g += 2) {
      const int64_t cols = std::min(2 * kRows, n - g * kRows);
      for (int64_t i = m0; i < m1; i += kPairRows) {
        const int rows = int(std::min<int64_t>(kPairRows, m1 - i));
        kPairTiles<F, LEVELS>[rows](a + i * lda, lda, act + i * nb, nb, w + g * group_bytes,
                                    w + (g + 1) * group_bytes, c + i * ldc + g * kRows, ldc,
                                    cols, bias ? bias + g * kRows : nullptr);
      }
    }
#endif
    for (; g < g1; ++g) {
      const int64_t cols = std::min(kRows, n - g * kRows);
      for (int64_t i = m0; i < m1; i += mr) {
        const int rows = int(std::min<int64_t>(mr, m1 - i));
        kTiles<F, LEVELS>[rows](a + i * lda, lda, act + i * nb, nb, w + g * group_bytes,
                                c + i * ldc + g * kRows, ldc, cols,
                                bias ? bias + g * kRows : nullptr);
      }
    }
  }
}

// With AMX-INT8, whole tiles of 16 rows go to the tiles (qtile_amx.h), the rest to qtile.h.
template <Fmt F, int LEVELS>
void rows_of(const int8_t* a, const ActBlock* act, int64_t m, int64_t k, const uint8_t* w,
             int64_t n, float* c, int64_t ldc, const float* bias, int64_t g0, int64_t g1) {
#if SHOAL_HAS_AMX_INT8
  if (m >= 16 && shoal::amx_ready()) {
    amx_groups<F, LEVELS>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
    const int64_t done = m - m % 16, nb = k / kBlock;
    a += done * k * LEVELS, act += done * nb, c += done * ldc, m -= done;
  }
#endif
  groups_of<F, LEVELS>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
}

template <Fmt F>
void groups_of(int levels, const int8_t* a, const ActBlock* act, int64_t m, int64_t k,
               const uint8_t* w, int64_t n, float* c, int64_t ldc, const float* bias,
               int64_t g0, int64_t g1) {
  if (levels == 2) return rows_of<F, 2>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
  rows_of<F, 1>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
}

// Below this many weight blocks times rows a product runs on the calling thread alone.
constexpr int64_t kParallelWork = 1024;

}  // namespace

void shoal::quant::qgemm_groups(Fmt fmt, int levels, const int8_t* a, const ActBlock* act,
                                int64_t m, int64_t k, const uint8_t* w, int64_t n, float* c,
                                int64_t ldc, const float* bias, int64_t g0, int64_t g1) {
  switch (fmt) {
    case Fmt::Q4_0: return groups_of<Fmt::Q4_0>(levels, a, act, m, k, w, n, c, ldc, bias, g0, g1);
    case Fmt::Q4_1: return groups_of<Fmt::Q4_1>(levels, a, act, m, k, w, n, c, ldc, bias, g0, g1);
    case Fmt::Q8_0: return groups_of<Fmt::Q8_0>(levels, a, act, m, k, w, n, c, ldc, bias, g0, g1);
  }
}

// a: m rows of `levels * k` int8 (quantize_rows); act: m x (k / 32) blocks; w: n rows packed
// by quant_formats.py in format `fmt` (quant_blocks.h's Fmt).
extern "C" void qgemm(int64_t fmt, int64_t levels, const int8_t* a, const ActBlock* act,
                      int64_t m, int64_t k, const uint8_t* w, int64_t n, float* c, int64_t ldc,
                      const float* bias, int64_t num_threads) {
  const int64_t groups = (n + kRows - 1) / kRows;
  const int64_t work = groups * (k / kBlock) * m * levels;
  const int threads =
      int(std::max<int64_t>(1, std::min({num_threads, groups, work / kParallelWork + 1})));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    shoal::quant::qgemm_groups(Fmt(fmt), int(levels), a, act, m, k, w, n, c, ldc, bias,
                               groups * t / nt, groups * (t + 1) / nt);
  }
}

// Which integer dot products this build's quantized products use.
extern "C" const char* shoal_qgemm_isa() { return SHOAL_QGEMM_ISA; }

// Whether the tiles take two groups at a time in 512-bit vectors (qtile512.h).
extern "C" int shoal_qgemm_pairs() { return SHOAL_QGEMM_PAIRS; }

// Whether products of 16 rows or more run on AMX-INT8 tiles: built for them, and lent them.
extern "C" int shoal_qgemm_amx() {
#if SHOAL_HAS_AMX_INT8
  return shoal::amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}
