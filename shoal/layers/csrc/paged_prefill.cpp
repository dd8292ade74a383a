// Prefill attention straight from the paged KV cache, flash-style, for the CPU.
//
// A prefill chunk is the last `q_len` of its sequence's `ctx_len` positions. Its own keys and
// values are already in the cache (written by rope_store), so every key, cached or new, is read
// in place from its block and nothing is gathered. One call takes every chunk of a step; work
// items are (chunk, kv head, tile of query tokens) on torch's OpenMP threads, the longest first.
//
// A tile holds the query heads of one kv-head group for a few tokens: TR rows (48 with AVX-512,
// 24 with AVX2), stored transposed (Qᵀ[dim][row]) and pre-scaled once. It walks the keys up to
// its last position a step at a time (16 keys; 64 on AMX) with an online softmax (a running max
// and sum per row), so scores never leave L1:
//   Sᵀ[key][row] = K·Qᵀ      each key element broadcast against row vectors (no transposing K)
//   mask keys past each row's position (only on the diagonal), then per row: new max, rescale
//   P = exp(Sᵀ - max), O[row] = O[row]·α + Pᵀ·V   rows broadcast against value vectors
// The products are a policy: float32 FMAs here (FmaProducts: register-blocked; bfloat16
// queries, keys and values widened as they are loaded), VDPBF16PS (prefill_bf16.h) or AMX tiles
// (prefill_amx.h) for bfloat16; the softmax is plain loops the compiler vectorizes (vector exp).
// Builds without our vector code, float64 and unusual head sizes take the portable one-query
// attention per row (attention_common.h) instead.

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_common.h"
#include "prefill_amx.h"
#include "prefill_bf16.h"
#include "prefill_tile.h"

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
using namespace shoal::prefill;

// st[j][r] = sum_d k[j][d] * qt[d][r] for NK keys given as float rows, the first NR row
// vectors of the tile.
template <int NK, int NR>
inline void key_block(const float* qt, const float* const* k, int64_t dim, float* st) {
  Vec acc[NK][NR];
#pragma GCC unroll 8
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NR; ++v) acc[j][v] = shoal::vzero();
  for (int64_t d = 0; d < dim; ++d) {
    Vec q[NR];
    for (int v = 0; v < NR; ++v) q[v] = shoal::vload(qt + d * TR + v * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < NK; ++j) {
      const Vec kj = shoal::vset1(k[j][d]);
      for (int v = 0; v < NR; ++v) acc[j][v] = shoal::vfma(kj, q[v], acc[j][v]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NR; ++v) shoal::vstore(st + j * TR + v * kLanes, acc[j][v]);
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

// The two products of a tile in float32 FMAs: queries transposed and pre-scaled into qt[d][row],
// keys as float32 rows (widened into L1 for a bfloat16 cache), values read in place.
template <typename T, typename KV, int DIM, int NR>
struct FmaProducts {
  static constexpr int kRows = NR * kLanes;  // rows in use: the first NR row vectors
  static constexpr int NV = DIM / kLanes;
  static constexpr int NVC = NV < 4 ? NV : 4;  // value vectors per register block
  static constexpr int RB = ACC / NVC;         // rows per register block (divides TR)
  static constexpr int kKeys = KEYS;           // keys per online-softmax step
  static_assert(TR % RB == 0 && NV % NVC == 0, "tile shape");

  // Column by column: qt is written in order and a row's cache lines are missed once, by the
  // first column (row by row, the scattered stores cost 6% of the kernel).
  static void load_queries(Scratch& w, const T* const* rows, float scale) {
    static const T zeros[DIM] = {};
    const T* src[kRows];
    for (int r = 0; r < kRows; ++r) src[r] = rows[r] ? rows[r] : zeros;
    for (int64_t d = 0; d < DIM; ++d)
      for (int r = 0; r < kRows; ++r) w.qt[d * TR + r] = widen(src[r][d]) * scale;
  }

  static void scores(Scratch& w, const KV* const* k, int n, float* sc, float /*in queries*/) {
    const float* krows[KEYS];
    for (int j = 0; j < n; ++j) {
      if constexpr (sizeof(KV) == sizeof(float)) {
        krows[j] = reinterpret_cast<const float*>(k[j]);
      } else {  // widen once; the product broadcasts each element NR times
        float* dst = w.keys.data() + j * DIM;
        for (int c = 0; c < NV; ++c) shoal::vstore(dst + c * kLanes, shoal::vload(k[j] + c * kLanes));
        krows[j] = dst;
      }
    }
    int j = 0;
    for (; j + KB <= n; j += KB) key_block<KB, NR>(w.qt.data(), krows + j, DIM, sc + j * TR);
    for (; j < n; ++j) key_block<1, NR>(w.qt.data(), krows + j, DIM, sc + j * TR);
  }

  static void values(Scratch& w, const KV* const* v, int n, const float* p, const float* alpha) {
    for (int r0 = 0; r0 < kRows; r0 += RB)  // RB divides TR: a last block stays in scratch
      for (int64_t d0 = 0; d0 < DIM; d0 += NVC * kLanes)
        value_block<KV, RB, NVC>(p, v, n, alpha, w.o.data(), DIM, r0, d0);
  }

  // Row r of the output, times `inv`, rounded to T.
  static void store_row(const Scratch& w, int64_t r, float inv, T* dst) {
    const float* o = w.o.data() + r * DIM;
#pragma omp simd
    for (int64_t d = 0; d < DIM; ++d) dst[d] = narrow<T>(o[d] * inv);
  }
};

// One tile: rows r = token * group + head in group, for `tokens` tokens from t0.
template <typename T, typename KV, typename P>
void tile(const T* q, const KV* kc, const KV* vc, const int64_t* span, const int64_t* table,
          T* out, const Shape& s, Strides st_, float scale, const Item& it, int64_t tq,
          Scratch& w) {
  const int64_t dim = s.dim, group = s.heads / s.kv_heads, g = it.kv_head;
  const int64_t q_start = span[0], q_len = span[1], offset = span[2] - q_len;
  const int64_t tokens = std::min(tq, q_len - it.t0), rows = tokens * group;
  const int64_t first = offset + it.t0, last = first + tokens - 1;  // positions in the tile
  const int64_t token_stride = s.token_stride();
  w.kv_stride = token_stride;
  float *m = w.m.data(), *l = w.l.data(), *sc = w.st.data(), *alpha = w.alpha.data();
  constexpr int R = P::kRows;  // rows in use (at least `rows`)
  const T* qrows[TR];
  for (int64_t r = 0; r < R; ++r) {
    const bool real = r < rows;
    qrows[r] = real ? q + (q_start + it.t0 + r / group) * st_.q + (g * group + r % group) * dim
                    : nullptr;
    w.pos[r] = real ? first + r / group : last;
    m[r] = kMasked;
    l[r] = 0.0f;
  }
  P::load_queries(w, qrows, scale);
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  const KV* krows[kMaxKeys];
  const KV* vrows[kMaxKeys];
  int n = 0;
  for (int64_t k0 = 0; k0 <= last; k0 += n) {
    n = int(std::min<int64_t>(P::kKeys, last + 1 - k0));  // keys [k0, k0 + n)
    for (int j = 0; j < n;) {  // a block's run of keys at a time
      const int64_t key = k0 + j, in_block = key % s.block_size;
      const int64_t run = std::min<int64_t>(n - j, s.block_size - in_block);
      const int64_t at = (table[key / s.block_size] * s.block_size + in_block) * token_stride;
      for (int64_t i = 0; i < run; ++i, ++j) {
        krows[j] = kc + at + i * token_stride + g * dim;
        vrows[j] = vc + at + i * token_stride + g * dim;
      }
    }
    P::scores(w, krows, n, sc, scale);
    if (k0 + n - 1 > first) {  // the diagonal: some rows must not see some of these keys
      for (int jj = 0; jj < n; ++jj) {
        float* row = sc + jj * TR;
        const int64_t key = k0 + jj;
#pragma omp simd
        for (int r = 0; r < R; ++r) row[r] = key > w.pos[r] ? kMasked : row[r];
      }
    }
    // Online softmax, vectorized over rows: new max, rescale factor, probabilities, sums.
    float mx[R], sum[R];
#pragma omp simd
    for (int r = 0; r < R; ++r) {
      mx[r] = m[r];
      sum[r] = 0.0f;
    }
    for (int jj = 0; jj < n; ++jj) {
      const float* row = sc + jj * TR;
#pragma omp simd
      for (int r = 0; r < R; ++r) mx[r] = row[r] > mx[r] ? row[r] : mx[r];
    }
#pragma omp simd
    for (int r = 0; r < R; ++r) alpha[r] = shoal::exp_nonpositive(m[r] - mx[r]);
    for (int jj = 0; jj < n; ++jj) {
      float* row = sc + jj * TR;
#pragma omp simd
      for (int r = 0; r < R; ++r) {
        row[r] = shoal::exp_nonpositive(row[r] - mx[r]);
        sum[r] += row[r];
      }
    }
#pragma omp simd
    for (int r = 0; r < R; ++r) {
      l[r] = l[r] * alpha[r] + sum[r];
      m[r] = mx[r];
    }
    P::values(w, vrows, n, sc, alpha);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (q_start + it.t0 + r / group) * st_.out + (g * group + r % group) * dim;
    P::store_row(w, r, 1.0f / l[r], dst);
  }
}

template <typename T, typename KV>
using Tile = void (*)(const T*, const KV*, const KV*, const int64_t*, const int64_t*, T*,
                      const Shape&, Strides, float, const Item&, int64_t, Scratch&);

template <typename T, typename KV, int DIM, int NR>
Tile<T, KV> tile_for(const Shape& s) {
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == 2 && sizeof(KV) == 2) {
#if SHOAL_HAS_AMX
    if (s.block_size % shoal::kTileRows == 0 && shoal::amx_ready())
      return tile<T, KV, AmxProducts<DIM, NR>>;
#endif
    return tile<T, KV, Bf16DotProducts<DIM, NR>>;
  }
#endif
  return tile<T, KV, FmaProducts<T, KV, DIM, NR>>;
}

// The tile for each number of row vectors in use, 1 to RV (`tiles[nr - 1]`): a tile of a few
// query tokens (the last of a chunk; a step's verification of draft tokens) computes only the
// rows it holds, not all TR.
template <typename T, typename KV>
using Tiles = std::array<Tile<T, KV>, RV>;

template <typename T, typename KV, int DIM>
Tiles<T, KV> tiles_for(const Shape& s) {
  static_assert(RV == 3, "one entry per row vector");
  return {tile_for<T, KV, DIM, 1>(s), tile_for<T, KV, DIM, 2>(s), tile_for<T, KV, DIM, 3>(s)};
}

template <typename T, typename KV>
Tiles<T, KV> pick_tiles(const Shape& s) {
  if constexpr (sizeof(shoal::acc_t<T>) == sizeof(float)) {
    const int64_t group = s.heads / s.kv_heads;
    if (group <= TR && s.dim == 64) return tiles_for<T, KV, 64>(s);
    if (group <= TR && s.dim == 128) return tiles_for<T, KV, 128>(s);
  }
  return {};
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
  if (const Tiles<T, KV> tiles = pick_tiles<T, KV>(s); tiles[0]) {
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
        const int64_t rows = std::min(tq, spans[it.chunk * 3 + 1] - it.t0) * group;
        tiles[(rows + kLanes - 1) / kLanes - 1](q, kc, vc, spans + it.chunk * 3,
                                                 tables + it.chunk * s.max_blocks, out, s, st,
                                                 float(scale), it, tq, w);
      }
      shoal::release_tiles();
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

// Whether bfloat16 prefill tiles run on AMX here (built for it and granted by the kernel).
extern "C" int shoal_amx_tiles() {
#if SHOAL_HAS_AMX
  return shoal::amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}
