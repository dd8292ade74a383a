// Dense projections for AVX2 + FMA CPUs: C[m, n] = A[m, k] . W[n, k]^T (+ bias), float32
// activations and accumulation, the weight in float32, bfloat16 or quantized blocks (the
// large products of quantized models; dequant_panel.h).
//
// The weight is packed once (by the caller, in torch) into panels of 16 output columns, each
// panel k-major: panel p holds W[16p + j][kk] at [kk * 16 + j], so a micro-kernel step reads
// 16 consecutive weights. A 6 x 16 micro-kernel keeps its tile in 12 ymm accumulators: per kk,
// two weight loads, six broadcasts of A and twelve FMAs, which Zen 3's two FMA pipes retire in
// six cycles. A bfloat16 panel is widened once per block of rows into a float32 copy in L1/L2
// (a 16-bit shift: bf16 is the top half of a float32), so the inner loop is the float32 one
// and the weight's memory traffic is halved.
//
// Threads share the panels through OpenMP; the library links the libgomp torch already loaded
// (same soname), so these products run on torch's own thread pool instead of fighting it.

#include "prefetch.h"
#include "simd.h"

// Only builds for AVX2 + FMA (or wider) have the kernel; the loader looks for its symbols.
#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>
#include <omp.h>

#include "dequant_panel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NR = 16;      // output columns per panel
constexpr int64_t MR = 6;       // rows per micro-kernel tile
constexpr int64_t M_BLOCK = 96;  // rows of A kept in L2 while a thread sweeps its panels

inline void store_row(float* out, __m256 lo, __m256 hi, int64_t cols, const float* bias) {
  if (bias) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
  }
  if (cols == NR) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    return;
  }
  alignas(32) float tmp[NR];  // the last, partial panel
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::memcpy(out, tmp, cols * sizeof(float));
}

// ROWS x 16 tile. The accumulators are named variables, not an array: GCC keeps an array of
// vectors in memory and stores it back on every iteration.
// `next`: lines prefetched into L2 along the way.
template <int ROWS>
void tile(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc,
          int64_t cols, const float* bias, shoal::Lines next) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m256 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  const float* a0 = a;
  const float* a1 = a + lda;
  const float* a2 = a + 2 * lda;
  const float* a3 = a + 3 * lda;
  const float* a4 = a + 4 * lda;
  const float* a5 = a + 5 * lda;
#define SHOAL_ROW(R)                                        \
  if constexpr (ROWS > R) {                                 \
    const __m256 x = _mm256_broadcast_ss(a##R + kk);        \
    c##R##0 = _mm256_fmadd_ps(x, b0, c##R##0);              \
    c##R##1 = _mm256_fmadd_ps(x, b1, c##R##1);              \
  }
  shoal::SpreadPrefetch prefetch(next, k);
#pragma GCC unroll 4
  for (int64_t kk = 0; kk < k; ++kk) {
    prefetch.step();
    const __m256 b0 = _mm256_loadu_ps(b + kk * NR), b1 = _mm256_loadu_ps(b + kk * NR + 8);
    SHOAL_ROW(0) SHOAL_ROW(1) SHOAL_ROW(2) SHOAL_ROW(3) SHOAL_ROW(4) SHOAL_ROW(5)
  }
#undef SHOAL_ROW
  store_row(c, c00, c01, cols, bias);
  if constexpr (ROWS > 1) store_row(c + ldc, c10, c11, cols, bias);
  if constexpr (ROWS > 2) store_row(c + 2 * ldc, c20, c21, cols, bias);
  if constexpr (ROWS > 3) store_row(c + 3 * ldc, c30, c31, cols, bias);
  if constexpr (ROWS > 4) store_row(c + 4 * ldc, c40, c41, cols, bias);
  if constexpr (ROWS > 5) store_row(c + 5 * ldc, c50, c51, cols, bias);
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                      const float*, shoal::Lines);
constexpr Tile TILES[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Rows [m0, m1) of C against one panel (float32, k x NR). Meanwhile the next panel (`next`,
// `next_bytes`, or null; it is in DRAM when the weight is larger than the caches, as in every
// decode step) is prefetched (prefetch.h): otherwise the first tile of each panel waits on it.
inline void rows_by_panel(const float* a, int64_t lda, int64_t m0, int64_t m1, const float* panel,
                          int64_t k, float* c, int64_t ldc, int64_t cols, const float* bias,
                          const char* next, int64_t next_bytes) {
  shoal::PanelSlices slices(next, next ? next_bytes : 0, (m1 - m0 + MR - 1) / MR);
  for (int64_t i = m0; i < m1; i += MR) {
    const int64_t rows = std::min(MR, m1 - i);
    TILES[rows](a + i * lda, lda, panel, k, c + i * ldc, ldc, cols, bias, slices.take());
  }
}

inline void widen_bf16(const uint16_t* src, float* dst, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
  }
  for (; i < count; ++i) {
    const uint32_t bits = uint32_t(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

// Where a thread's panels come from: the packed float32 weight itself, bfloat16 panels widened
// into a buffer, or quantized groups dequantized into it (dequant_panel.h). `get` returns
// panel p as float32; `bytes(p)` is where its memory starts, for the prefetch.
struct F32Panels {
  const float* packed;
  int64_t k;
  static constexpr bool kBuffered = false;
  const float* get(int64_t p, float*) const { return packed + p * k * NR; }
  const char* bytes(int64_t p) const { return reinterpret_cast<const char*>(packed + p * k * NR); }
  int64_t panel_bytes() const { return k * NR * int64_t(sizeof(float)); }
};

struct Bf16Panels {
  const uint16_t* packed;
  int64_t k;
  static constexpr bool kBuffered = true;
  const float* get(int64_t p, float* wide) const {
    widen_bf16(packed + p * k * NR, wide, k * NR);
    return wide;
  }
  const char* bytes(int64_t p) const { return reinterpret_cast<const char*>(packed + p * k * NR); }
  int64_t panel_bytes() const { return k * NR * int64_t(sizeof(uint16_t)); }
};

struct QuantPanels {
  shoal::quant::Fmt fmt;
  const uint8_t* w;
  int64_t k, groups;
  static constexpr bool kBuffered = true;
  const float* get(int64_t p, float* wide) const {
    shoal::quant::dequantize_panel(fmt, w, k, groups, p, wide);
    return wide;
  }
  const char* bytes(int64_t p) const {
    return reinterpret_cast<const char*>(w + 2 * p * shoal::quant::group_bytes(fmt, k));
  }
  int64_t panel_bytes() const { return 2 * shoal::quant::group_bytes(fmt, k); }
};

template <typename Panels>
void gemm(const float* a, int64_t m, int64_t k, int64_t lda, const Panels& src, int64_t n,
          float* c, int64_t ldc, const float* bias, int64_t num_threads) {
  const int64_t panels = (n + NR - 1) / NR;
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, panels)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    std::vector<float> wide(Panels::kBuffered ? k * NR : 0);
    for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
      const int64_t m1 = std::min(m, m0 + M_BLOCK);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min(NR, n - p * NR);
        const float* panel = src.get(p, wide.data());
        const char* next = p + 1 < p1 ? src.bytes(p + 1) : nullptr;
        rows_by_panel(a, lda, m0, m1, panel, k, c + p * NR, ldc, cols,
                      bias ? bias + p * NR : nullptr, next, src.panel_bytes());
      }
    }
  }
}

}  // namespace

extern "C" void gemm_f32(const float* a, int64_t m, int64_t k, int64_t lda, const float* packed,
                         int64_t n, float* c, int64_t ldc, const float* bias,
                         int64_t num_threads) {
  gemm(a, m, k, lda, F32Panels{packed, k}, n, c, ldc, bias, num_threads);
}

extern "C" void gemm_bf16w(const float* a, int64_t m, int64_t k, int64_t lda,
                           const uint16_t* packed, int64_t n, float* c, int64_t ldc,
                           const float* bias, int64_t num_threads) {
  gemm(a, m, k, lda, Bf16Panels{packed, k}, n, c, ldc, bias, num_threads);
}

// A weight kept in quantized groups (quant_formats.py; `fmt` is quant_blocks.h's Fmt),
// dequantized a panel at a time: the large products of quantized models.
extern "C" void gemm_quant(const float* a, int64_t m, int64_t k, int64_t lda, int64_t fmt,
                           const uint8_t* w, int64_t n, float* c, int64_t ldc, const float* bias,
                           int64_t num_threads) {
  const int64_t groups = (n + shoal::quant::kRows - 1) / shoal::quant::kRows;
  const QuantPanels src{shoal::quant::Fmt(fmt), w, k, groups};
  gemm(a, m, k, lda, src, n, c, ldc, bias, num_threads);
}

#endif  // AVX2 + FMA
