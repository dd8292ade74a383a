// qtile.h's tiles two groups at a time on AVX-512 VNNI builds: one 512-bit vector holds the
// same four k of 16 rows of W (group g's 32-byte vector beside group g + 1's), so each
// VPDPBUSD, each broadcast activation and each epilogue operation serves twice the rows. At
// batch 1 a step is bound by reading the weights either way; from two rows (or two levels) up
// the 256-bit tiles' instructions start to show beside the memory traffic, and this halves
// them. The tile is qtile.h's `tile_i8` over `Vec512`: the same products and epilogue, in the
// same order per column.

#pragma once

#include "qtile.h"

#if SHOAL_QGEMM_VEC && defined(SHOAL_DPBUSD) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SHOAL_QGEMM_PAIRS 1

namespace shoal::quant {

// VPDPBUSD on 512 bits: the same operands and offsets as qtile.h's VNNI products (Q8_0 read
// unsigned).
template <Fmt F>
struct Dot512 {
  static constexpr int kOffset = DotI8<F>::kOffset;
  static __m512i prepare(__m512i w) {
    return F == Fmt::Q8_0 ? _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))) : w;
  }
  static __m512i add(__m512i acc, __m512i w, __m512i a) { return _mm512_dpbusd_epi32(acc, w, a); }
  static __m512i sums(__m512i acc) { return acc; }
};

// qtile.h's Vec256 twice as wide: group w0's 32 bytes in the low half, w1's in the high.
struct Vec512 {
  using Int = __m512i;
  using Float = __m512;
  template <Fmt F>
  using Dot = Dot512<F>;

  static Int load(const uint8_t* w0, const uint8_t* w1) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
  static Int bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
  }
  static void nibbles(Int v, Int& lo, Int& hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(v, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  // Two blocks' 8 float16 scales (or mins) as 16 float32.
  static Float halves(const uint8_t* b0, const uint8_t* b1) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
  }
  static Int zeros() { return _mm512_setzero_si512(); }
  static Float zero() { return _mm512_setzero_ps(); }
  static Float splat(float x) { return _mm512_set1_ps(x); }
  static Float to_float(Int v) { return _mm512_cvtepi32_ps(v); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* c, Float v, int64_t cols, const float* bias) {
    const __mmask16 mask = __mmask16((1u << cols) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(c, mask, _mm512_add_ps(v, bv));
  }
};

// ROWS rows of A against groups w0 and w1 (16 rows of W): C[ROWS, cols] for cols up to 16.
using PairTile = void (*)(const int8_t*, int64_t, const ActBlock*, int64_t, const uint8_t*,
                          const uint8_t*, float*, int64_t, int64_t, const float*);

template <Fmt F, int ROWS, int LEVELS>
constexpr PairTile kPairTile = tile_i8<Vec512, F, ROWS, LEVELS>;

}  // namespace shoal::quant

#else
#define SHOAL_QGEMM_PAIRS 0
#endif
