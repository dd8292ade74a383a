// bfloat16 projections with VDPBF16PS, for CPUs with AVX512_BF16 (Zen 4/5, Sapphire Rapids):
// C[m, n] = A[m, k] . W[n, k]^T (+ bias), bfloat16 in and out, float32 sums.
//
// VDPBF16PS multiplies 16 pairs of bfloat16 by 16 pairs and adds each pair's two products to
// one float32 lane: 32 multiply-adds an instruction, twice an FMA's. So the weight is packed
// once (by the caller) into panels of 16 output columns holding k in pairs: panel p, pair e is
// the 32 values W[16p + j][2e + i] at [e * 32 + 2j + i]. A row of A needs no packing: its pair
// (A[m][2e], A[m][2e + 1]) is one 32-bit word, broadcast against the panel's pair vector.
// A tile is 6 rows x 4 panels (64 columns): 24 accumulators, and per pair of k four weight
// loads and 24 VDPBF16PS whose broadcast operand comes straight from memory.
//
// Threads take panels (as gemm.cpp does) and every row: rows of A are reused from L1/L2 across
// a thread's panels, each panel from L2 across the tiles of rows, and the next panels are
// prefetched while the current ones are used (they come from DRAM in every decode step).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t NR = 16;       // output columns per panel
constexpr int MR = 6;            // rows per tile
constexpr int NP = 4;            // panels per tile
constexpr int64_t M_BLOCK = 96;  // rows of A kept in L2 while a thread sweeps its panels

inline __m512bh pair_at(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(int(bits));
}

// ROWS x (PANELS x 16) tile over k pairs [0, kp).
template <int ROWS, int PANELS>
void tile(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t kp, uint16_t* c, int64_t ldc,
          int64_t cols, const float* bias) {
  __m512 acc[ROWS][PANELS];
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < PANELS; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t panel = kp * 2 * NR;  // elements between panels
  for (int64_t e = 0; e < kp; ++e) {
    __m512bh wv[PANELS];
    for (int p = 0; p < PANELS; ++p)
      wv[p] = (__m512bh)_mm512_loadu_si512(w + p * panel + e * 2 * NR);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh x = pair_at(a + r * lda + 2 * e);
      for (int p = 0; p < PANELS; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], x, wv[p]);
    }
  }
  for (int p = 0; p < PANELS; ++p) {
    const int64_t n = std::min<int64_t>(NR, cols - p * NR);
    if (n <= 0) break;
    const __mmask16 mask = __mmask16((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + p * NR) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][p], b));
      _mm256_mask_storeu_epi16(c + r * ldc + p * NR, mask, out);
    }
  }
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t,
                      int64_t, const float*);

template <int PANELS>
constexpr Tile tile_for(int rows) {
  switch (rows) {
    case 1: return tile<1, PANELS>;
    case 2: return tile<2, PANELS>;
    case 3: return tile<3, PANELS>;
    case 4: return tile<4, PANELS>;
    case 5: return tile<5, PANELS>;
    default: return tile<6, PANELS>;
  }
}

Tile pick(int rows, int panels) {
  switch (panels) {
    case 1: return tile_for<1>(rows);
    case 2: return tile_for<2>(rows);
    case 3: return tile_for<3>(rows);
    default: return tile_for<4>(rows);
  }
}

}  // namespace

// a: [m, k] rows lda apart (k even); packed: [ceil(n / 16), k / 2, 16, 2]; c: [m, n] rows ldc
// apart; bias: float32 [n] or null.
extern "C" void gemm_bf16(const uint16_t* a, int64_t m, int64_t k, int64_t lda,
                          const uint16_t* packed, int64_t n, uint16_t* c, int64_t ldc,
                          const float* bias, int64_t num_threads) {
  const int64_t panels = (n + NR - 1) / NR, kp = k / 2, panel = kp * 2 * NR;
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, panels)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
      const int64_t m1 = std::min(m, m0 + M_BLOCK);
      for (int64_t p = p0; p < p1; p += NP) {
        const int np = int(std::min<int64_t>(NP, p1 - p));
        // Prefetch the next group's panels a slice per tile of rows.
        const char* next = p + np < p1 ? reinterpret_cast<const char*>(packed + (p + np) * panel)
                                       : nullptr;
        const int64_t next_bytes = std::min<int64_t>(NP, p1 - p - np) * panel * 2;
        const int64_t tiles = (m1 - m0 + MR - 1) / MR;
        const int64_t per_tile = next ? (next_bytes / 64 + tiles) / tiles * 64 : 0;
        int64_t done = 0;
        for (int64_t i = m0; i < m1; i += MR) {
          for (const int64_t end = std::min(next_bytes, done + per_tile); done < end; done += 64)
            __builtin_prefetch(next + done);
          const int rows = int(std::min<int64_t>(MR, m1 - i));
          pick(rows, np)(a + i * lda, lda, packed + p * panel, kp, c + i * ldc + p * NR, ldc,
                         n - p * NR, bias ? bias + p * NR : nullptr);
        }
      }
    }
  }
}

#endif  // AVX512_BF16
