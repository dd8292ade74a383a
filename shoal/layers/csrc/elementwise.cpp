// The element-wise work of a decoder layer, fused so each activation is read and written once:
// - RMSNorm, optionally after adding the residual (the sum is kept as the new residual);
// - SiLU(gate) * up over the fused gate-up product;
// - rotary embedding of q and k in place, with k and v written to their KV-cache slots.
//
// Activations are float32, float64 or bfloat16 (uint16_t); arithmetic is float32 (double for
// double). Where transformers rounds an intermediate to the activation dtype (the residual sum,
// the normalized row before the weight, SiLU's output) so do these, so bfloat16 results follow
// the reference's roundings; for float32 those roundings are no-ops. Loops are plain C++ that
// the compiler vectorizes for the -march it builds with; rows run in parallel on torch's OpenMP
// pool once a call is big enough to pay for waking the threads.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "row_ops.h"
#include "simd.h"

namespace {

using shoal::narrow;
using shoal::widen;

// Below this many elements a call runs on the calling thread alone.
constexpr int64_t kParallelElems = 1 << 16;

inline int threads_for(int64_t elems, int64_t rows, int64_t num_threads) {
  if (elems < kParallelElems) return 1;
  return int(std::max<int64_t>(1, std::min(num_threads, rows)));
}

// out = rmsnorm(x (+ residual)) * w; with a residual, residual <- x + residual first.
template <typename T>
void rms_norm(const T* x, int64_t ldx, T* residual, const T* w, T* out, int64_t rows, int64_t h,
              double eps, int64_t num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * h, rows, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;
    const T* src = xr;
    if (residual) {
      T* res = residual + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) res[i] = narrow<T>(widen(xr[i]) + widen(res[i]));
      src = res;
    }
    shoal::rms_norm_row(src, w, out + r * h, h, eps);
  }
}

// out[r] = silu(gate_up[r, :n]) * gate_up[r, n:].
template <typename T>
void silu_mul(const T* gate_up, int64_t ld, T* out, int64_t rows, int64_t n,
              int64_t num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * n, rows, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * ld;
    const T* u = g + n;
    T* o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = shoal::silu_times<T>(widen(g[i]), widen(u[i]));
  }
}

// qkv rows (`ld` apart) are [q heads | k heads | v heads] x dim. q and k are rotated in place
// (rotate-half layout) with the cos/sin rows of each token's position; k and v are then stored at the
// token's slot of the caches ([slots, kv_heads, dim], in the cache's dtype).
template <typename T, typename KV>
void rope_store(T* qkv, int64_t ld, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                const shoal::acc_t<T>* cos, const shoal::acc_t<T>* sin, const int64_t* positions,
                const int64_t* slots, KV* k_cache, KV* v_cache, int64_t num_threads) {
  using A = shoal::acc_t<T>;
  const int64_t width = (heads + 2 * kv_heads) * dim;  // per token
#pragma omp parallel for num_threads(threads_for(tokens * width, tokens, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = qkv + t * ld;
    const A* c = cos + positions[t] * dim;
    const A* s = sin + positions[t] * dim;
    for (int64_t hd = 0; hd < heads + kv_heads; ++hd) shoal::rotate_half(row + hd * dim, c, s, dim);
    const T* k = row + heads * dim;
    const T* v = k + kv_heads * dim;
    KV* kd = k_cache + slots[t] * kv_heads * dim;
    KV* vd = v_cache + slots[t] * kv_heads * dim;
#pragma omp simd
    for (int64_t i = 0; i < kv_heads * dim; ++i) {
      kd[i] = narrow<KV>(widen(k[i]));
      vd[i] = narrow<KV>(widen(v[i]));
    }
  }
}

}  // namespace

#define SHOAL_ELEMENTWISE(SUFFIX, T)                                                           \
  extern "C" void rms_norm_##SUFFIX(const T* x, int64_t ldx, T* residual, const T* w, T* out, \
                                    int64_t rows, int64_t h, double eps, int64_t threads) {    \
    rms_norm<T>(x, ldx, residual, w, out, rows, h, eps, threads);                             \
  }                                                                                            \
  extern "C" void silu_mul_##SUFFIX(const T* gate_up, int64_t ld, T* out, int64_t rows,        \
                                    int64_t n, int64_t threads) {                              \
    silu_mul<T>(gate_up, ld, out, rows, n, threads);                                           \
  }                                                                                            \
  extern "C" void rope_store_##SUFFIX(T* qkv, int64_t ld, int64_t tokens, int64_t heads,      \
                                      int64_t kv_heads, int64_t dim, const shoal::acc_t<T>* cos,                 \
                                      const shoal::acc_t<T>* sin, const int64_t* positions,    \
                                      const int64_t* slots, T* k_cache, T* v_cache,            \
                                      int64_t threads) {                                       \
    rope_store<T, T>(qkv, ld, tokens, heads, kv_heads, dim, cos, sin, positions, slots, k_cache,   \
                     v_cache, threads);                                                        \
  }

SHOAL_ELEMENTWISE(f32, float)
SHOAL_ELEMENTWISE(f64, double)
SHOAL_ELEMENTWISE(bf16, uint16_t)

// float32 activations over a bfloat16 KV cache (bfloat16 weights on CPUs without native bf16).
extern "C" void rope_store_f32_bf16kv(float* qkv, int64_t ld, int64_t tokens, int64_t heads,
                                      int64_t kv_heads, int64_t dim, const float* cos, const float* sin,
                                      const int64_t* positions, const int64_t* slots,
                                      uint16_t* k_cache, uint16_t* v_cache, int64_t threads) {
  rope_store<float, uint16_t>(qkv, ld, tokens, heads, kv_heads, dim, cos, sin, positions, slots,
                              k_cache, v_cache, threads);
}
