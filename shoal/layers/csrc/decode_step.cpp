// Every decoder layer of one decode step of a Llama-family model with quantized projections,
// in one call: at batch 1 the layer's work is a few dozen microseconds of products, and the
// per-op path paid more than that again in Python dispatch and thread wake-ups (nine calls a
// layer, each its own OpenMP region). Here one parallel region runs all layers, five barriers
// a layer (|):
//
//   every row, each thread   residual += x; rmsnorm(residual) * w -> activation blocks
//   groups of 8 rows of W    qkv = h . Wqkv (+ bias)                                      |
//   (sequence, kv head)      rotate q and k, store k and v in the cache, attend, the
//                            heads' output -> activation blocks                           |
//   groups                   x = attn . Wo                                                |
//   every row, each thread   residual += x; rmsnorm(residual) * w -> activation blocks
//   groups                   gate_up = h . Wgu                                            |
//   every row, each thread   silu(gate) * up -> activation blocks
//   groups                   x = act . Wdown                                              |
//
// Each thread computes the element-wise rows itself (identically), so the products after them
// need no barrier; at small batches that is a few thousand values. At the end hidden = x +
// residual. The arithmetic is the per-op path's (row_ops.h, paged_decode.cpp, qgemm.cpp), so
// the two agree but for a rounding (a sum in another order can round an activation the other
// way).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_common.h"
#include "quant_ops.h"
#include "row_ops.h"
#include "simd.h"

namespace {

using shoal::quant::ActBlock;
using shoal::quant::Fmt;
using shoal::quant::kBlock;
using shoal::quant::kRows;

struct QWeight {  // a weight packed by quant_formats.py
  const uint8_t* data;
  int64_t n, k, fmt;
};

// A projection's rows as runs of one format each, in row order (a GGUF mix keeps a Q4_K_M
// file's v in other blocks than its q and k); n == 0 ends the list.
struct Product {
  QWeight runs[3];
};

struct Layer {
  const float* input_norm;
  const float* post_norm;
  Product qkv, o, gate_up, down;
  const float* qkv_bias;  // or null
  void* k_cache;          // [blocks, block_size, kv_heads, dim] of the step's KV type
  void* v_cache;
};

struct Dims {
  int64_t hidden, heads, kv_heads, dim, inter, layers, block_size, max_blocks;
  double eps;
  int64_t levels;  // int8 levels per activation value (quantize.cpp)
};

// The blocks of a product's input rows, `width` values a row (the product's k).
struct Quantized {
  int levels;
  std::vector<int8_t> q;
  std::vector<ActBlock> blocks;
  Quantized(int levels, int64_t rows, int64_t width)
      : levels(levels), q(rows * width * levels), blocks(rows * width / kBlock) {}
  int8_t* row_q(int64_t r, int64_t width) { return q.data() + r * width * levels; }
  ActBlock* row_blocks(int64_t r, int64_t width) { return blocks.data() + r * (width / kBlock); }
  // Columns [first, first + count) of row r, quantized from x.
  void set(int64_t r, int64_t width, const float* x, int64_t first, int64_t count) {
    shoal::quant::quantize_row(x, count, levels, row_q(r, width) + first * levels,
                               row_blocks(r, width) + first / kBlock);
  }
};

// residual (+)= x, then rmsnorm(residual) * w, quantized into row r.
void norm_row(const float* x, float* residual, bool first, const float* w, int64_t h, double eps,
              float* scratch, Quantized& act, int64_t r) {
  for (int64_t i = 0; i < h; ++i) residual[i] = first ? x[i] : x[i] + residual[i];
  shoal::rms_norm_row(residual, w, scratch, h, eps);
  act.set(r, h, scratch, 0, h);
}

template <typename KV>
void decode_step(const Layer* layers, const Dims& d, float* x, int64_t batch,
                 const int64_t* positions, const int64_t* slots, const int64_t* tables,
                 const int64_t* lens, const float* cos, const float* sin, int64_t num_threads) {
  const int64_t h = d.hidden, dim = d.dim, group = d.heads / d.kv_heads;
  const int64_t q_width = d.heads * dim, qkv_width = (d.heads + 2 * d.kv_heads) * dim;
  const float scale = 1.0f / std::sqrt(float(dim));
  const auto attend = shoal::decode_attend<KV>(dim);
  std::vector<float> qkv(batch * qkv_width), attn(batch * q_width), gate_up(batch * 2 * d.inter);
  Quantized heads(int(d.levels), batch, q_width);  // the attention's output, o's input
  const int threads = int(std::max<int64_t>(1, num_threads));

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Each thread keeps the residual and the other products' inputs itself, computing every
    // row (a few thousand values at small batches): no barrier before those products.
    std::vector<float> residual(batch * h), scratch(std::max(h, d.inter)), scores, acc;
    Quantized mine(int(d.levels), batch, std::max(h, d.inter));
    // Each run's groups of rows are split over the threads; the run writes its columns.
    auto product = [&](const Quantized& in, const Product& p, float* out, int64_t ldc,
                       const float* bias) {
      int64_t col = 0;
      for (const QWeight& w : p.runs) {
        if (w.n == 0) break;
        const int64_t groups = (w.n + kRows - 1) / kRows;
        shoal::quant::qgemm_groups(Fmt(w.fmt), in.levels, in.q.data(), in.blocks.data(), batch,
                                   w.k, w.data, w.n, out + col, ldc, bias ? bias + col : nullptr,
                                   groups * t / nt, groups * (t + 1) / nt);
        col += w.n;
      }
    };
    auto norms = [&](const float* w, bool first) {
      for (int64_t b = 0; b < batch; ++b)
        norm_row(x + b * h, residual.data() + b * h, first, w, h, d.eps, scratch.data(), mine, b);
    };
    for (int64_t l = 0; l < d.layers; ++l) {
      const Layer& L = layers[l];
      norms(L.input_norm, l == 0);
      product(mine, L.qkv, qkv.data(), qkv_width, L.qkv_bias);
#pragma omp barrier
      for (int64_t u = t; u < batch * d.kv_heads; u += nt) {
        const int64_t b = u / d.kv_heads, g = u % d.kv_heads;
        float* row = qkv.data() + b * qkv_width;
        const float* c = cos + positions[b] * dim;
        const float* s = sin + positions[b] * dim;
        for (int64_t hd = g * group; hd < (g + 1) * group; ++hd)
          shoal::rotate_half(row + hd * dim, c, s, dim);
        float* k = row + (d.heads + g) * dim;
        const float* v = row + (d.heads + d.kv_heads + g) * dim;
        shoal::rotate_half(k, c, s, dim);
        KV* kc = static_cast<KV*>(L.k_cache);
        KV* vc = static_cast<KV*>(L.v_cache);
        const int64_t at = (slots[b] * d.kv_heads + g) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          kc[at + i] = shoal::narrow<KV>(k[i]);
          vc[at + i] = shoal::narrow<KV>(v[i]);
        }
        const shoal::Shape one{group, 1, dim, d.block_size, d.max_blocks, d.kv_heads * dim};
        float* out = attn.data() + b * q_width + g * group * dim;
        attend(row + g * group * dim, kc + g * dim, vc + g * dim, tables + b * d.max_blocks,
               lens[b], out, one, scale, scores, acc);
        // The group's heads are whole blocks of the row (group * dim is a multiple of 32).
        heads.set(b, q_width, out, g * group * dim, group * dim);
      }
#pragma omp barrier
      product(heads, L.o, x, h, nullptr);
#pragma omp barrier
      norms(L.post_norm, false);
      product(mine, L.gate_up, gate_up.data(), 2 * d.inter, nullptr);
#pragma omp barrier
      for (int64_t b = 0; b < batch; ++b) {
        const float* g = gate_up.data() + b * 2 * d.inter;
        for (int64_t i = 0; i < d.inter; ++i)
          scratch[i] = shoal::silu_times<float>(g[i], g[d.inter + i]);
        mine.set(b, d.inter, scratch.data(), 0, d.inter);
      }
      product(mine, L.down, x, h, nullptr);
#pragma omp barrier
    }
    for (int64_t b = t; b < batch; b += nt)
      for (int64_t i = 0; i < h; ++i) x[b * h + i] += residual[b * h + i];
  }
}

}  // namespace

// x: [batch, hidden] float32, the step's embeddings in, its final hidden states out (before
// the model's last norm). positions, slots, lens: [batch]; tables: [batch, max_blocks].
#define SHOAL_DECODE_STEP(NAME, KV)                                                           \
  extern "C" void NAME(const Layer* layers, const Dims* dims, float* x, int64_t batch,       \
                       const int64_t* positions, const int64_t* slots, const int64_t* tables, \
                       const int64_t* lens, const float* cos, const float* sin,               \
                       int64_t threads) {                                                     \
    decode_step<KV>(layers, *dims, x, batch, positions, slots, tables, lens, cos, sin,        \
                    threads);                                                                 \
  }

SHOAL_DECODE_STEP(decode_step_f32, float)
SHOAL_DECODE_STEP(decode_step_bf16kv, uint16_t)
