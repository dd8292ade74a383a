// Element-wise work on one row, shared by the per-op kernels (elementwise.cpp) and the fused
// decode step (decode_step.cpp), so both round alike. Arithmetic is float32 (double for
// double); where transformers rounds an intermediate to the activation dtype, so do these.

#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace shoal {

// out = rmsnorm(src) * w over one row of h values.
template <typename T>
inline void rms_norm_row(const T* src, const T* w, T* out, int64_t h, double eps) {
  using A = acc_t<T>;
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += widen(src[i]) * widen(src[i]);
  const A inv = A(1) / std::sqrt(sum / A(h) + A(eps));
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(src[i]) * inv)));
}

// Rotate one head of `dim` values in place (rotate-half layout) by a position's cos/sin row.
template <typename T>
inline void rotate_half(T* x, const acc_t<T>* c, const acc_t<T>* s, int64_t dim) {
  using A = acc_t<T>;
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const A a = widen(x[i]), b = widen(x[i + half]);
    x[i] = narrow<T>(a * c[i] - b * s[i]);
    x[i + half] = narrow<T>(b * c[i + half] + a * s[i + half]);
  }
}

}  // namespace shoal
