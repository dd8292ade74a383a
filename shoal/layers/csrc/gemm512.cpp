// Dense projections for AVX-512 CPUs: C[m, n] = A[m, k] . W[n, k]^T (+ bias), float32 sums.
//
// Two element types share one kernel:
// - float32 (AVX-512F): the weight packed once (by the caller) into panels of 16 output
//   columns, k-major: panel p holds W[16p + j][kk] at [kk * 16 + j]. Per kk a tile loads one
//   vector per panel and broadcasts one value of A per row.
// - bfloat16 (AVX512_BF16: Zen 4/5, Sapphire Rapids): VDPBF16PS multiplies 16 pairs of
//   bfloat16 by 16 pairs and adds each pair's two products to one float32 lane, 32 multiply-adds
//   an instruction, twice an FMA's. Panels hold k in pairs: pair e of panel p is the 32 values
//   W[16p + j][2e + i] at [e * 32 + 2j + i]. A row of A needs no packing: its pair
//   (A[m][2e], A[m][2e + 1]) is one 32-bit word, broadcast against the panel's pair vector.
// A tile is 6 rows x 4 panels (64 columns): 24 accumulators, and per step four weight loads and
// 24 FMAs (or VDPBF16PS) whose broadcast operand comes straight from memory.
//
// With `silu`, W is a gate-up product whose gate and up panels alternate (gate panel q, then up
// panel q) and C gets silu(gate) * up, rounded as the separate product and SiLU would round it:
// the [m, 2n] gate-up output is never written or read back.
//
// Threads take panels (pairs of them with `silu`) and every row: rows of A are reused from
// L1/L2 across a thread's panels, each panel from L2 across the tiles of rows, and the next
// panels are prefetched while the current ones are used (they come from DRAM in every decode
// step).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "prefetch.h"
#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t NR = 16;       // output columns per panel
constexpr int MR = 6;            // rows per tile
constexpr int NP = 4;            // panels per tile
constexpr int64_t M_BLOCK = 96;  // rows of A kept in L2 while a thread sweeps its panels

struct F32 {
  using T = float;
  using W = __m512;
  static constexpr int64_t kStep = 1;  // values of k per product
  static W weights(const float* p) { return _mm512_loadu_ps(p); }
  static W row(const float* a) { return _mm512_set1_ps(*a); }
  static __m512 dot(__m512 acc, W x, W w) { return _mm512_fmadd_ps(x, w, acc); }
  static void store(float* c, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(c, mask, v); }
};

#if defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;
  using W = __m512bh;
  static constexpr int64_t kStep = 2;
  static W weights(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W row(const uint16_t* a) {
    uint32_t bits;
    std::memcpy(&bits, a, sizeof bits);
    return (__m512bh)_mm512_set1_epi32(int(bits));
  }
  static __m512 dot(__m512 acc, W x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
  static void store(uint16_t* c, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(c, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#endif

// ROWS x (PANELS x 16) tile over all of k. `cols`: the output columns left from the tile's
// first; `bias`: float32, laid out like the panels; `next`: lines to prefetch meanwhile.
template <typename P, bool SILU, int ROWS, int PANELS>
void tile(const typename P::T* a, int64_t lda, const typename P::T* w, int64_t k,
          typename P::T* c, int64_t ldc, int64_t cols, const float* bias, shoal::Lines next) {
  using T = typename P::T;
  __m512 acc[ROWS][PANELS];
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < PANELS; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t panel = k * NR;  // elements between panels
  shoal::SpreadPrefetch prefetch(next, k / P::kStep);
  for (int64_t kk = 0; kk < k; kk += P::kStep) {
    prefetch.step();
    typename P::W wv[PANELS];
    for (int p = 0; p < PANELS; ++p) wv[p] = P::weights(w + p * panel + kk * NR);
    for (int r = 0; r < ROWS; ++r) {
      const typename P::W x = P::row(a + r * lda + kk);
      for (int p = 0; p < PANELS; ++p) acc[r][p] = P::dot(acc[r][p], x, wv[p]);
    }
  }
  if (bias) {
    for (int p = 0; p < PANELS; ++p) {
      const __m512 b = _mm512_loadu_ps(bias + p * NR);
      for (int r = 0; r < ROWS; ++r) acc[r][p] = _mm512_add_ps(acc[r][p], b);
    }
  }
  if constexpr (SILU) {
    for (int q = 0; q < PANELS / 2; ++q) {
      const int64_t n = std::min<int64_t>(NR, cols - q * NR);
      if (n <= 0) break;
      for (int r = 0; r < ROWS; ++r) {
        alignas(64) float g[NR], u[NR];
        _mm512_store_ps(g, acc[r][2 * q]);
        _mm512_store_ps(u, acc[r][2 * q + 1]);
        T* out = c + r * ldc + q * NR;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          // Rounded to T first, as the gate-up product's output would be.
          const float gj = shoal::widen(shoal::narrow<T>(g[j]));
          out[j] = shoal::silu_times<T>(gj, shoal::widen(shoal::narrow<T>(u[j])));
        }
      }
    }
  } else {
    for (int p = 0; p < PANELS; ++p) {
      const int64_t n = std::min<int64_t>(NR, cols - p * NR);
      if (n <= 0) break;
      const __mmask16 mask = __mmask16((1u << n) - 1);
      for (int r = 0; r < ROWS; ++r) P::store(c + r * ldc + p * NR, acc[r][p], mask);
    }
  }
}

template <typename P, bool SILU>
using Tile = void (*)(const typename P::T*, int64_t, const typename P::T*, int64_t,
                      typename P::T*, int64_t, int64_t, const float*, shoal::Lines);

template <typename P, bool SILU, int PANELS>
Tile<P, SILU> tile_for(int rows) {
  switch (rows) {
    case 1: return tile<P, SILU, 1, PANELS>;
    case 2: return tile<P, SILU, 2, PANELS>;
    case 3: return tile<P, SILU, 3, PANELS>;
    case 4: return tile<P, SILU, 4, PANELS>;
    case 5: return tile<P, SILU, 5, PANELS>;
    default: return tile<P, SILU, 6, PANELS>;
  }
}

template <typename P, bool SILU>
Tile<P, SILU> pick(int rows, int panels) {
  if constexpr (!SILU) {  // with SILU a tile holds whole gate-up pairs of panels
    if (panels == 1) return tile_for<P, SILU, 1>(rows);
    if (panels == 3) return tile_for<P, SILU, 3>(rows);
  }
  return panels == 2 ? tile_for<P, SILU, 2>(rows) : tile_for<P, SILU, 4>(rows);
}

// `panels` packed panels of k x 16; C has n columns (with `silu`, half the product's).
template <typename P, bool SILU>
void gemm(const typename P::T* a, int64_t m, int64_t k, int64_t lda, const typename P::T* packed,
          int64_t panels, int64_t n, typename P::T* c, int64_t ldc, const float* bias,
          int64_t num_threads) {
  constexpr int64_t unit = SILU ? 2 : 1;  // panels that belong together
  const int64_t units = panels / unit, panel = k * NR;
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, units)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = units * t / nt * unit, p1 = units * (t + 1) / nt * unit;
    for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
      const int64_t m1 = std::min(m, m0 + M_BLOCK);
      for (int64_t p = p0; p < p1; p += NP) {
        const int np = int(std::min<int64_t>(NP, p1 - p));
        // The next group's panels (none after the last), prefetched a slice per tile of rows.
        shoal::PanelSlices next(reinterpret_cast<const char*>(packed + (p + np) * panel),
                                std::min<int64_t>(NP, p1 - p - np) * panel *
                                    int64_t(sizeof(typename P::T)),
                                (m1 - m0 + MR - 1) / MR);
        const int64_t col = p / unit * NR;
        for (int64_t i = m0; i < m1; i += MR) {
          const int rows = int(std::min<int64_t>(MR, m1 - i));
          pick<P, SILU>(rows, np)(a + i * lda, lda, packed + p * panel, k, c + i * ldc + col, ldc,
                                  n - col, bias ? bias + p * NR : nullptr, next.take());
        }
      }
    }
  }
}

}  // namespace

// a: [m, k] rows lda apart; packed: `panels` panels (see above; k even for bfloat16); c: [m, n]
// rows ldc apart; bias: float32 [panels * 16] in panel order, or null; silu: 0 or 1.
#define SHOAL_GEMM512(NAME, P)                                                                 \
  extern "C" void NAME(const P::T* a, int64_t m, int64_t k, int64_t lda, const P::T* packed,   \
                       int64_t panels, int64_t n, P::T* c, int64_t ldc, const float* bias,     \
                       int64_t silu, int64_t num_threads) {                                    \
    if (silu) {                                                                                \
      gemm<P, true>(a, m, k, lda, packed, panels, n, c, ldc, bias, num_threads);               \
    } else {                                                                                   \
      gemm<P, false>(a, m, k, lda, packed, panels, n, c, ldc, bias, num_threads);              \
    }                                                                                          \
  }

SHOAL_GEMM512(gemm512_f32, F32)
#if defined(__AVX512BF16__)
SHOAL_GEMM512(gemm512_bf16, Bf16)
#endif

#endif  // AVX-512F
