// Products of int8-quantized activation rows with weights kept in their quantized blocks
// (quant_blocks.h): C[m, n] = A[m, k] . W[n, k]^T (+ bias), float32 out.
//
// Per block of 32 k, an integer dot product of the weight's 8-row group with a row's block,
// then the scales in the epilogue: C += d_w * d_a * sum(q_w * q_a) + off_w * s_a, where off_w
// is Q4_1's min, -8 d_w for Q4_0 (its values are q - 8) and -128 d_w where the VNNI path reads
// Q8_0 values as unsigned (q + 128). The integer products (unsigned weight byte times signed
// activation byte):
// - AVX-512 VNNI (with VL) or AVX-VNNI: VPDPBUSD, four products added into each int32 lane;
// - AVX2: VPMADDUBSW (pairs into int16) then VPMADDWD. Q4 pairs stay in int16 over the whole
//   block (at most 8 x 2 x 15 x 127 = 30,480); signed Q8_0 weights go as |w| against the
//   activation with w's sign (llama.cpp's trick), a pair at most 2 x 127 x 127.
// The vector paths are 256-bit on every x86 build (a zmm version would help prefill on Intel's
// 512-bit ports, not the memory-bound decode). Other builds run a portable loop over the same
// layout.
//
// Threads take groups of 8 rows of W, and every row of A: a group's blocks are read once from
// memory per tile of rows and stay in L1 for the next tiles, rows of A (int8) in L2.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_blocks.h"
#include "quant_ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SHOAL_QGEMM_VEC 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SHOAL_QGEMM_ISA "avx512vnni"
#define SHOAL_VNNI(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SHOAL_QGEMM_ISA "avxvnni"
#define SHOAL_VNNI(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define SHOAL_QGEMM_ISA "avx2"
#endif
#else
#define SHOAL_QGEMM_VEC 0
#define SHOAL_QGEMM_ISA "generic"
#endif

namespace {

using namespace shoal::quant;

constexpr int MR = 4;            // rows of A per tile
constexpr int64_t M_BLOCK = 64;  // rows of A kept in L2 while a thread sweeps its groups

#if SHOAL_QGEMM_VEC

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// How a format's stored bytes meet an activation vector: `add` accumulates the products of
// one weight vector (8 rows x 4 k) with 4 activation bytes broadcast, `sums` gives the block's
// int32 sums per row, and `kOffset` is the multiple of d_w (Q4_0, VNNI Q8_0) to add times s_a.
template <Fmt F>
struct Dot {
#ifdef SHOAL_VNNI
  static constexpr int kOffset = F == Fmt::Q4_0 ? -8 : F == Fmt::Q8_0 ? -128 : 0;
  static __m256i prepare(__m256i w) {
    return F == Fmt::Q8_0 ? _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))) : w;
  }
  static __m256i add(__m256i acc, __m256i w, __m256i a) { return SHOAL_VNNI(acc, w, a); }
  static __m256i sums(__m256i acc) { return acc; }
#else
  static constexpr int kOffset = F == Fmt::Q4_0 ? -8 : 0;
  static __m256i prepare(__m256i w) { return w; }
  static __m256i add(__m256i acc, __m256i w, __m256i a) {
    if constexpr (F == Fmt::Q8_0) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
      return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    } else {
      return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a));
    }
  }
  static __m256i sums(__m256i acc) {
    if constexpr (F == Fmt::Q8_0) return acc;
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
  }
#endif
};

inline void store8(float* c, __m256 v, int64_t cols, const float* bias) {
  if (bias) {
    alignas(32) float b[kRows] = {};
    std::memcpy(b, bias, cols * sizeof(float));
    v = _mm256_add_ps(v, _mm256_load_ps(b));
  }
  if (cols == kRows) {
    _mm256_storeu_ps(c, v);
    return;
  }
  alignas(32) float tmp[kRows];
  _mm256_store_ps(tmp, v);
  std::memcpy(c, tmp, cols * sizeof(float));
}

// ROWS rows of A against one group (8 rows of W) over all `nb` blocks of k.
template <Fmt F, int ROWS>
void tile(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const uint8_t* w,
          float* c, int64_t ldc, int64_t cols, const float* bias) {
  using L = Layout<F>;
  using D = Dot<F>;
  __m256 acc[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * L::kBytes;
    const uint8_t* quants = blk + L::kScaleBytes;
    const int8_t* ab = a + b * kBlock;
    __m256i sum[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) sum[r] = _mm256_setzero_si256();
    // Not unrolled: GCC would reassociate the sums across the whole block, keep every product
    // live at once and spill them to the stack.
    if constexpr (L::kNibbles) {
#pragma GCC unroll 1
      for (int s = 0; s < 4; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * s));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
          sum[r] = D::add(sum[r], lo, bcast4(ab + r * lda + 4 * s));
          sum[r] = D::add(sum[r], hi, bcast4(ab + r * lda + 16 + 4 * s));
        }
      }
    } else {
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m256i v =
            D::prepare(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j)));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) sum[r] = D::add(sum[r], v, bcast4(ab + r * lda + 4 * j));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256 off = _mm256_setzero_ps();
    if constexpr (L::kMins) {
      off = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    } else if constexpr (D::kOffset != 0) {
      off = _mm256_mul_ps(d, _mm256_set1_ps(float(D::kOffset)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const ActBlock s = act[r * nb + b];
      const __m256 dot = _mm256_cvtepi32_ps(D::sums(sum[r]));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(s.d)), acc[r]);
      if constexpr (L::kMins || D::kOffset != 0) {
        acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(s.s), acc[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) store8(c + r * ldc, acc[r], cols, bias);
}

#else  // portable

template <Fmt F, int ROWS>
void tile(const int8_t* a, int64_t lda, const ActBlock* act, int64_t nb, const uint8_t* w,
          float* c, int64_t ldc, int64_t cols, const float* bias) {
  using L = Layout<F>;
  float acc[ROWS][kRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * L::kBytes;
    const uint8_t* quants = blk + L::kScaleBytes;
    for (int l = 0; l < kRows; ++l) {
      const float d = half_to_float(load_u16(blk + 2 * l));
      const float m = L::kMins ? half_to_float(load_u16(blk + 16 + 2 * l)) : 0.0f;
      int q[kBlock];
      for (int kk = 0; kk < kBlock; ++kk) q[kk] = quant_at<F>(quants, l, kk);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* ar = a + r * lda + b * kBlock;
        int32_t dot = 0;
        for (int kk = 0; kk < kBlock; ++kk) dot += (F == Fmt::Q4_0 ? q[kk] - 8 : q[kk]) * ar[kk];
        const ActBlock s = act[r * nb + b];
        acc[r][l] += d * s.d * float(dot) + m * s.s;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int64_t l = 0; l < cols; ++l) c[r * ldc + l] = acc[r][l] + (bias ? bias[l] : 0.0f);
}

#endif

template <Fmt F>
using Tile = void (*)(const int8_t*, int64_t, const ActBlock*, int64_t, const uint8_t*, float*,
                      int64_t, int64_t, const float*);

template <Fmt F>
constexpr Tile<F> kTiles[MR + 1] = {nullptr, tile<F, 1>, tile<F, 2>, tile<F, 3>, tile<F, 4>};

template <Fmt F>
void groups_of(const int8_t* a, const ActBlock* act, int64_t m, int64_t k, const uint8_t* w,
               int64_t n, float* c, int64_t ldc, const float* bias, int64_t g0, int64_t g1) {
  const int64_t nb = k / kBlock, group_bytes = nb * Layout<F>::kBytes;
  for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
    const int64_t m1 = std::min(m, m0 + M_BLOCK);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cols = std::min(kRows, n - g * kRows);
      for (int64_t i = m0; i < m1; i += MR) {
        const int rows = int(std::min<int64_t>(MR, m1 - i));
        kTiles<F>[rows](a + i * k, k, act + i * nb, nb, w + g * group_bytes,
                        c + i * ldc + g * kRows, ldc, cols, bias ? bias + g * kRows : nullptr);
      }
    }
  }
}

// Below this many weight blocks times rows a product runs on the calling thread alone.
constexpr int64_t kParallelWork = 1024;

void qgemm(Fmt fmt, const int8_t* a, const ActBlock* act, int64_t m, int64_t k,
           const uint8_t* w, int64_t n, float* c, int64_t ldc, const float* bias,
           int64_t num_threads) {
  const int64_t groups = (n + kRows - 1) / kRows;
  const int64_t work = groups * (k / kBlock) * m;
  const int threads =
      int(std::max<int64_t>(1, std::min({num_threads, groups, work / kParallelWork + 1})));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    shoal::quant::qgemm_groups(fmt, a, act, m, k, w, n, c, ldc, bias, groups * t / nt,
                               groups * (t + 1) / nt);
  }
}

}  // namespace

void shoal::quant::qgemm_groups(Fmt fmt, const int8_t* a, const ActBlock* act, int64_t m,
                                int64_t k, const uint8_t* w, int64_t n, float* c, int64_t ldc,
                                const float* bias, int64_t g0, int64_t g1) {
  switch (fmt) {
    case Fmt::Q4_0: return groups_of<Fmt::Q4_0>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
    case Fmt::Q4_1: return groups_of<Fmt::Q4_1>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
    case Fmt::Q8_0: return groups_of<Fmt::Q8_0>(a, act, m, k, w, n, c, ldc, bias, g0, g1);
  }
}

#define SHOAL_QGEMM(NAME, FMT)                                                                \
  extern "C" void NAME(const int8_t* a, const ActBlock* act, int64_t m, int64_t k,            \
                       const uint8_t* w, int64_t n, float* c, int64_t ldc, const float* bias, \
                       int64_t threads) {                                                     \
    qgemm(Fmt::FMT, a, act, m, k, w, n, c, ldc, bias, threads);                               \
  }

SHOAL_QGEMM(qgemm_q4_0, Q4_0)
SHOAL_QGEMM(qgemm_q4_1, Q4_1)
SHOAL_QGEMM(qgemm_q8_0, Q8_0)

// Which integer dot product this build's quantized products use.
extern "C" const char* shoal_qgemm_isa() { return SHOAL_QGEMM_ISA; }
