// Prefill attention straight from the paged KV cache, flash-style, for the CPU.
//
// A prefill chunk is the last `q_len` of its sequence's `ctx_len` positions. Its own keys and
// values are already in the cache (written by rope_store), so every key, cached or new, is read
// in place from its block and nothing is gathered. One call takes every chunk of a step; work
// items are (chunk, kv head, tile of query tokens) on torch's OpenMP threads, the longest first.
//
// A tile holds the query heads of one kv-head group for a few tokens: TR rows (48 with AVX-512,
// 24 with AVX2), stored transposed (Qᵀ[dim][row]) and pre-scaled once. It walks the keys up to
// its last position 16 at a time with an online softmax (a running max and sum per row), so
// scores never leave L1:
//   Sᵀ[key][row] = K·Qᵀ      each key element broadcast against row vectors (no transposing K)
//   mask keys past each row's position (only on the diagonal), then per row: new max, rescale
//   P = exp(Sᵀ - max), O[row] = O[row]·α + Pᵀ·V   rows broadcast against value vectors
// Both products are register-blocked; the softmax is plain loops the compiler vectorizes (vector
// exp). Arithmetic is float32; bfloat16 queries, keys and values are widened as they are loaded.
// Builds without our vector code, float64 and unusual head sizes take the portable one-query
// attention per row (attention_common.h) instead.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_common.h"

namespace {

using shoal::narrow;
using shoal::Shape;
using shoal::widen;

struct Strides {
  int64_t q, out;  // elements between consecutive token rows of q and out
};

struct Item {
  int64_t chunk, kv_head, t0;  // query tokens [t0, t0 + tokens per tile) of the chunk
};

#if SHOAL_HAS_VEC
using shoal::kLanes;
using shoal::Vec;

constexpr int RV = 3;                         // row vectors per tile
constexpr int TR = RV * kLanes;               // rows (token x head of the group) per tile
constexpr int KEYS = 16;                      // keys per online-softmax step
constexpr int KB = kLanes == 16 ? 8 : 4;      // keys per register block of K·Qᵀ
constexpr int ACC = kLanes == 16 ? 24 : 12;   // accumulator registers for P·V
constexpr float kMasked = -1e30f;             // not -inf: fast math assumes finite values

// st[j][r] = sum_d k[j][d] * qt[d][r] for NK keys given as float rows.
template <int NK>
inline void key_block(const float* qt, const float* const* k, int64_t dim, float* st) {
  Vec acc[NK][RV];
#pragma GCC unroll 8
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < RV; ++v) acc[j][v] = shoal::vzero();
  for (int64_t d = 0; d < dim; ++d) {
    const Vec q0 = shoal::vload(qt + d * TR), q1 = shoal::vload(qt + d * TR + kLanes),
              q2 = shoal::vload(qt + d * TR + 2 * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < NK; ++j) {
      const Vec kj = shoal::vset1(k[j][d]);
      acc[j][0] = shoal::vfma(kj, q0, acc[j][0]);
      acc[j][1] = shoal::vfma(kj, q1, acc[j][1]);
      acc[j][2] = shoal::vfma(kj, q2, acc[j][2]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < RV; ++v) shoal::vstore(st + j * TR + v * kLanes, acc[j][v]);
}

// o[r][d0 : d0 + NV lanes] = o[r][...] * alpha[r] + sum_j p[j][r] * v[j][...] for RB rows.
template <typename KV, int RB, int NV>
inline void value_block(const float* pt, const KV* const* v, int nkeys, const float* alpha,
                        float* o, int64_t dim, int r0, int64_t d0) {
  Vec acc[RB][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const Vec a = shoal::vset1(alpha[r0 + r]);
    for (int c = 0; c < NV; ++c)
      acc[r][c] = shoal::vmul(shoal::vload(o + (r0 + r) * dim + d0 + c * kLanes), a);
  }
  for (int j = 0; j < nkeys; ++j) {
    Vec p[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) p[r] = shoal::vset1(pt[j * TR + r0 + r]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      const Vec val = shoal::vload(v[j] + d0 + c * kLanes);
      for (int r = 0; r < RB; ++r) acc[r][c] = shoal::vfma(p[r], val, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) shoal::vstore(o + (r0 + r) * dim + d0 + c * kLanes, acc[r][c]);
}

struct Scratch {
  std::vector<float> qt, st, o, m, l, alpha, keys;
  std::vector<int64_t> pos;
  void size(int64_t dim) {
    qt.resize(dim * TR);
    st.resize(KEYS * TR);
    o.resize(TR * dim);
    m.resize(TR);
    l.resize(TR);
    alpha.resize(TR);
    keys.resize(KEYS * dim);
    pos.resize(TR);
  }
};

// One tile: rows r = token * group + head in group, for `tokens` tokens from t0.
template <typename T, typename KV, int DIM>
void tile(const T* q, const KV* kc, const KV* vc, const int64_t* span, const int64_t* table,
          T* out, const Shape& s, Strides st_, float scale, const Item& it, int64_t tq,
          Scratch& w) {
  constexpr int NV = DIM / kLanes;
  constexpr int NVC = NV < 4 ? NV : 4;  // value vectors per register block
  constexpr int RB = ACC / NVC;         // rows per register block (divides TR)
  static_assert(TR % RB == 0 && NV % NVC == 0, "tile shape");
  const int64_t group = s.heads / s.kv_heads, g = it.kv_head;
  const int64_t q_start = span[0], q_len = span[1], offset = span[2] - q_len;
  const int64_t tokens = std::min(tq, q_len - it.t0), rows = tokens * group;
  const int64_t first = offset + it.t0, last = first + tokens - 1;  // positions in the tile
  const int64_t token_stride = s.kv_heads * DIM;
  float *qt = w.qt.data(), *o = w.o.data(), *m = w.m.data(), *l = w.l.data();
  float *sc = w.st.data(), *alpha = w.alpha.data();
  for (int64_t r = 0; r < TR; ++r) {
    const bool real = r < rows;
    const T* qr = q + (q_start + it.t0 + r / group) * st_.q + (g * group + r % group) * DIM;
    for (int64_t d = 0; d < DIM; ++d) qt[d * TR + r] = real ? widen(qr[d]) * scale : 0.0f;
    w.pos[r] = real ? first + r / group : last;
    m[r] = kMasked;
    l[r] = 0.0f;
  }
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  const float* krows[KEYS];
  const KV* vrows[KEYS];
  int n = 0;
  for (int64_t k0 = 0; k0 <= last; k0 += n) {
    // Keys [k0, k0 + n): at most KEYS, within one block.
    const int64_t block = k0 / s.block_size, in_block = k0 % s.block_size;
    n = int(std::min<int64_t>({KEYS, s.block_size - in_block, last + 1 - k0}));
    const int64_t base = (table[block] * s.block_size + in_block) * token_stride + g * DIM;
    for (int j = 0; j < n; ++j) {
      const KV* kj = kc + base + j * token_stride;
      vrows[j] = vc + base + j * token_stride;
      if constexpr (sizeof(KV) == sizeof(float)) {
        krows[j] = reinterpret_cast<const float*>(kj);
      } else {  // widen once into L1; the product broadcasts each element TR / kLanes times
        float* dst = w.keys.data() + j * DIM;
        for (int c = 0; c < NV; ++c) shoal::vstore(dst + c * kLanes, shoal::vload(kj + c * kLanes));
        krows[j] = dst;
      }
    }
    int j = 0;
    for (; j + KB <= n; j += KB) key_block<KB>(qt, krows + j, DIM, sc + j * TR);
    for (; j < n; ++j) key_block<1>(qt, krows + j, DIM, sc + j * TR);
    if (k0 + n - 1 > first) {  // the diagonal: some rows must not see some of these keys
      for (int jj = 0; jj < n; ++jj) {
        float* row = sc + jj * TR;
        const int64_t key = k0 + jj;
#pragma omp simd
        for (int r = 0; r < TR; ++r) row[r] = key > w.pos[r] ? kMasked : row[r];
      }
    }
    // Online softmax, vectorized over rows: new max, rescale factor, probabilities, sums.
    float mx[TR], sum[TR];
#pragma omp simd
    for (int r = 0; r < TR; ++r) {
      mx[r] = m[r];
      sum[r] = 0.0f;
    }
    for (int jj = 0; jj < n; ++jj) {
      const float* row = sc + jj * TR;
#pragma omp simd
      for (int r = 0; r < TR; ++r) mx[r] = row[r] > mx[r] ? row[r] : mx[r];
    }
#pragma omp simd
    for (int r = 0; r < TR; ++r) alpha[r] = std::exp(m[r] - mx[r]);
    for (int jj = 0; jj < n; ++jj) {
      float* row = sc + jj * TR;
#pragma omp simd
      for (int r = 0; r < TR; ++r) {
        row[r] = std::exp(row[r] - mx[r]);
        sum[r] += row[r];
      }
    }
#pragma omp simd
    for (int r = 0; r < TR; ++r) {
      l[r] = l[r] * alpha[r] + sum[r];
      m[r] = mx[r];
    }
    for (int r0 = 0; r0 < TR; r0 += RB)
      for (int64_t d0 = 0; d0 < DIM; d0 += NVC * kLanes)
        value_block<KV, RB, NVC>(sc, vrows, n, alpha, o, DIM, r0, d0);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (q_start + it.t0 + r / group) * st_.out + (g * group + r % group) * DIM;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < DIM; ++d) dst[d] = narrow<T>(o[r * DIM + d] * inv);
  }
}

template <typename T, typename KV>
using Tile = void (*)(const T*, const KV*, const KV*, const int64_t*, const int64_t*, T*,
                      const Shape&, Strides, float, const Item&, int64_t, Scratch&);

template <typename T, typename KV>
Tile<T, KV> pick_tile(int64_t dim, int64_t group) {
  if constexpr (sizeof(shoal::acc_t<T>) == sizeof(float)) {
    if (group <= TR && dim == 64) return tile<T, KV, 64>;
    if (group <= TR && dim == 128) return tile<T, KV, 128>;
  }
  return nullptr;
}
#endif

// Portable path: each query row is a one-query attention over its first `position + 1` keys.
template <typename T, typename KV>
void rows_portable(const T* q, const KV* kc, const KV* vc, const int64_t* spans,
                   const int64_t* tables, int64_t num_chunks, T* out, const Shape& s,
                   Strides st, double scale, int64_t num_threads) {
  using A = shoal::acc_t<T>;
  const auto attend = shoal::pick_portable<A, KV>(s.dim);
  std::vector<std::pair<int64_t, int64_t>> rows;  // (chunk, token)
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t = spans[c * 3 + 1] - 1; t >= 0; --t) rows.emplace_back(c, t);
  const int64_t n = int64_t(rows.size()), width = s.heads * s.dim;
  const int threads = int(std::max<int64_t>(1, std::min(num_threads, n)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<A> scores, acc, qa(width), oa(width);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const auto [c, t] = rows[i];
      const int64_t* span = spans + c * 3;
      const int64_t token = span[0] + t, len = span[2] - span[1] + t + 1;
      for (int64_t e = 0; e < width; ++e) qa[e] = widen(q[token * st.q + e]);
      attend(qa.data(), kc, vc, tables + c * s.max_blocks, len, oa.data(), s, A(scale), scores,
             acc);
      for (int64_t e = 0; e < width; ++e) out[token * st.out + e] = narrow<T>(oa[e]);
    }
  }
}

template <typename T, typename KV>
void prefill(const T* q, const KV* kc, const KV* vc, const int64_t* spans, const int64_t* tables,
             int64_t num_chunks, T* out, const Shape& s, Strides st, double scale,
             int64_t num_threads) {
#if SHOAL_HAS_VEC
  const int64_t group = s.heads / s.kv_heads;
  if (const auto run = pick_tile<T, KV>(s.dim, group)) {
    const int64_t tq = TR / group;  // query tokens per tile
    std::vector<Item> items;
    for (int64_t c = 0; c < num_chunks; ++c)
      for (int64_t t0 = (spans[c * 3 + 1] - 1) / tq * tq; t0 >= 0; t0 -= tq)
        for (int64_t g = 0; g < s.kv_heads; ++g) items.push_back({c, g, t0});
    // Tiles further into their sequence see more keys: start with the heaviest.
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
      return spans[a.chunk * 3 + 2] - spans[a.chunk * 3 + 1] + a.t0 >
             spans[b.chunk * 3 + 2] - spans[b.chunk * 3 + 1] + b.t0;
    });
    const int64_t n = int64_t(items.size());
    const int threads = int(std::max<int64_t>(1, std::min(num_threads, n)));
#pragma omp parallel num_threads(threads)
    {
      Scratch w;
      w.size(s.dim);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) {
        const Item& it = items[i];
        run(q, kc, vc, spans + it.chunk * 3, tables + it.chunk * s.max_blocks, out, s, st,
            float(scale), it, tq, w);
      }
    }
    return;
  }
#endif
  rows_portable(q, kc, vc, spans, tables, num_chunks, out, s, st, scale, num_threads);
}

}  // namespace

// spans: [num_chunks, 3] of (first query row in q/out, query tokens, context length);
// tables: [num_chunks, max_blocks] block ids of each chunk's sequence.
#define SHOAL_PREFILL(NAME, T, KV)                                                              \
  extern "C" void NAME(const T* q, int64_t q_stride, const KV* kc, const KV* vc,                \
                       const int64_t* spans, const int64_t* tables, int64_t num_chunks, T* out, \
                       int64_t out_stride, int64_t heads, int64_t kv_heads, int64_t dim,        \
                       int64_t block_size, int64_t max_blocks, double scale,                    \
                       int64_t num_threads) {                                                   \
    prefill<T, KV>(q, kc, vc, spans, tables, num_chunks, out,                                   \
                   Shape{heads, kv_heads, dim, block_size, max_blocks},                         \
                   Strides{q_stride, out_stride}, scale, num_threads);                          \
  }

SHOAL_PREFILL(paged_prefill_f32, float, float)
SHOAL_PREFILL(paged_prefill_f64, double, double)
SHOAL_PREFILL(paged_prefill_bf16, uint16_t, uint16_t)
SHOAL_PREFILL(paged_prefill_f32_bf16kv, float, uint16_t)
