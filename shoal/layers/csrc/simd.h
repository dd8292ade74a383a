// The few vector operations the kernels need, for the widest ISA this build targets.
//
// A build for AVX-512 (-march=native on Zen 4, Sapphire Rapids...) gets 16-lane vectors, one for
// AVX2 + FMA (Zen 3, Haswell...) 8-lane vectors, and anything else (Arm, older x86) no `Vec` at
// all: callers then take their portable loops, which the compiler vectorizes as it can.
// `SHOAL_ISA` names what was compiled in, so a caller can say which path ran.
//
// Values are float32 in registers; bfloat16 (the top half of a float32, stored as uint16_t) is
// widened by a 16-bit shift on load and rounded to nearest even on store.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace shoal {

inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even (inputs are finite activations; NaN payloads are not preserved).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

template <typename T, typename A>
inline T narrow(A x) {
  if constexpr (sizeof(T) == 2) {
    return to_bf16(float(x));
  } else {
    return T(x);
  }
}

// The arithmetic type for a storage type: float for float32 and bfloat16, double for double.
template <typename T>
using acc_t = decltype(widen(T{}));

// silu(g) * u, rounded to T after the SiLU and after the product, as transformers rounds them.
template <typename T>
inline T silu_times(acc_t<T> g, acc_t<T> u) {
  using A = acc_t<T>;
  return narrow<T>(widen(narrow<T>(g / (A(1) + std::exp(-g)))) * u);
}

#if defined(__AVX512F__)
#define SHOAL_ISA "avx512"
#define SHOAL_HAS_VEC 1
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(Vec v) { return _mm512_reduce_max_ps(v); }
// Whether any lane of `a` equals its lane of `b`.
inline bool vany_eq(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) != 0; }
// The four sums {sum(a), sum(b), sum(c), sum(d)}: one shuffle tree instead of four reductions.
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const Vec ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const Vec cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const Vec u = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(
      _mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
// out[i] = column i of the 16 x 16 block `in` (one row a vector).
inline void transpose16(const __m512* in, __m512* out) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: rows 4i..4i+3 of column 4L + k
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 a = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);  // columns k, k + 8
    const __m512 b = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);  // columns k + 4, k + 12
    const __m512 c = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    out[k] = _mm512_shuffle_f32x4(a, c, 0x88);
    out[k + 8] = _mm512_shuffle_f32x4(a, c, 0xDD);
    out[k + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
    out[k + 12] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SHOAL_ISA "avx2"
#define SHOAL_HAS_VEC 1
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vhmax(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline bool vany_eq(Vec a, Vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)) != 0; }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#else
#define SHOAL_ISA "generic"
#define SHOAL_HAS_VEC 0
#endif

}  // namespace shoal
