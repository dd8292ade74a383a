// Decode attention of one bfloat16 sequence on AMX tiles (paged_decode.cpp picks it where the
// CPU has AMX): the VDPBF16PS kernel spent about as long in its dot products and shuffle trees
// as streaming the KV from memory takes; here the products are a few tile multiplies per 16
// tokens and the pass over the cache is left waiting on memory.
//   Sᵀ = K·Qᵀ   per 16 cached tokens (one block's run, read in place) and kv head: the 16 key
//                rows against the head group's query pairs, into token-major scores
//   softmax      the scores transposed to head-major rows (16 x 16 in registers), shared code
//   O += P·V    per kv head and 32 tokens: the group's probabilities (bfloat16, as transformers
//                rounds them) against two tokens' value rows interleaved by unpack lo/hi;
//                the output tiles stay in tile registers for the whole sequence
// Needs blocks of a multiple of 16 tokens (16 key rows a tile load) and at most 16 query heads
// per kv head. Rows past the sequence's end are read from their block but never used.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "attention_common.h"

#if SHOAL_HAS_AMX
namespace shoal::decode {

// For the scores: tile 0 the 16 x group output, 1 the key rows, 2-5 the query pairs of up to
// four 32-dimension chunks. For the values: tiles 0-3 the group x 64 output columns, 4 the
// probabilities, 5 the value pairs.
inline TileConfig score_tiles(int group) {
  TileConfig c;
  const uint16_t out = uint16_t(4 * group);
  c.rows[0] = 16, c.colsb[0] = out;
  c.rows[1] = 16, c.colsb[1] = 64;
  for (int t = 2; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = out;
  return c;
}

inline TileConfig value_tiles(int group) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.rows[t] = uint8_t(group), c.colsb[t] = 64;
  c.rows[5] = 16, c.colsb[5] = 64;
  return c;
}

// The first min(n, 16) lanes (none for n <= 0).
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

struct AmxScratch {
  std::vector<uint32_t> query_pairs;  // [kv head][chunk][16 pairs][group]
  std::vector<float> by_token;        // scores [token][head]
  std::vector<float> by_head;         // scores, then probabilities [head][length]
  std::vector<uint16_t> probs;        // [head][padded length] bfloat16, zero past the end
  std::vector<uint16_t> value_pairs;  // [4 output tiles][16 token pairs][32]
  std::vector<float> out;             // [head][DIM], dimensions permuted as unpack leaves them
};

template <int DIM>
void attend_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                int64_t len, uint16_t* out, const Shape& s, float scale, std::vector<float>&,
                std::vector<float>&) {
  constexpr int NP = DIM / 32;  // 32-dimension chunks: query pair tiles, then value chunks
  static thread_local AmxScratch w;
  const int64_t heads = s.heads, group = heads / s.kv_heads, stride = s.kv_heads * DIM;
  const int64_t padded = (len + 31) / 32 * 32, key_bytes = stride * 2;
  w.query_pairs.resize(s.kv_heads * NP * 16 * group);
  w.by_token.resize(padded * heads + 16);
  w.by_head.resize(heads * len);
  w.probs.resize(heads * padded);
  w.value_pairs.resize(4 * 16 * 32);
  w.out.resize(heads * DIM);
  for (int64_t g = 0; g < s.kv_heads; ++g)  // (d, d + 1) of each head, per 32-dimension chunk
    for (int c = 0; c < NP; ++c)
      for (int e = 0; e < 16; ++e)
        for (int64_t j = 0; j < group; ++j) {
          const uint16_t* qh = q + (g * group + j) * DIM + 32 * c + 2 * e;
          w.query_pairs[((g * NP + c) * 16 + e) * group + j] = qh[0] | uint32_t(qh[1]) << 16;
        }

  const TileConfig scores = score_tiles(int(group));
  load_tiles(scores);
  const int64_t pair_bytes = 4 * group;
  // Runs of 16 tokens (within a block); while one is scored, a slice of the next run's key rows
  // and of this run's value rows (which the value pass reads once per kv head) goes to L2, a
  // slice per kv head: the whole lot at once filled the miss buffers.
  const int64_t run_bytes = 16 * key_bytes, slice = (run_bytes / 64 + s.kv_heads - 1) / s.kv_heads;
  auto at = [&](const uint16_t* cache, int64_t t) {
    return cache + (table[t / s.block_size] * s.block_size + t % s.block_size) * stride;
  };
  for (int64_t t = 0; t < len; t += 16) {
    const uint16_t* k = at(kc, t);
    const char* next_keys = t + 16 < len ? reinterpret_cast<const char*>(at(kc, t + 16)) : nullptr;
    const char* values = reinterpret_cast<const char*>(at(vc, t));
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      for (int64_t line = g * slice; line < std::min((g + 1) * slice, run_bytes / 64); ++line) {
        if (next_keys) __builtin_prefetch(next_keys + 64 * line, 0, 2);
        __builtin_prefetch(values + 64 * line, 0, 2);
      }
      const uint32_t* qp = w.query_pairs.data() + g * NP * 16 * group;
      for (int c = 0; c < NP; ++c) {
        if (c == 0) _tile_loadd(2, qp, pair_bytes);
        if (c == 1) _tile_loadd(3, qp + 16 * group, pair_bytes);
        if (c == 2) _tile_loadd(4, qp + 32 * group, pair_bytes);
        if (c == 3) _tile_loadd(5, qp + 48 * group, pair_bytes);
      }
      _tile_zero(0);
      const uint16_t* kg = k + g * DIM;
      // (Tile numbers are literals: the intrinsics paste them into the instruction.)
      _tile_loadd(1, kg, key_bytes);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(1, kg + 32, key_bytes);
      _tile_dpbf16ps(0, 1, 3);
      if constexpr (NP == 4) {
        _tile_loadd(1, kg + 64, key_bytes);
        _tile_dpbf16ps(0, 1, 4);
        _tile_loadd(1, kg + 96, key_bytes);
        _tile_dpbf16ps(0, 1, 5);
      }
      _tile_stored(0, w.by_token.data() + t * heads + g * group, heads * 4);
    }
  }

  // Token-major scores to head-major rows, scaled; then each row's softmax.
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    for (int64_t h0 = 0; h0 < heads; h0 += 16) {
      __m512 by_token[16], by_head[16];
      for (int i = 0; i < 16; ++i)
        by_token[i] = _mm512_loadu_ps(w.by_token.data() + std::min(t0 + i, padded - 1) * heads + h0);
      transpose16(by_token, by_head);
      const __mmask16 live = tail_mask(len - t0);
      for (int64_t h = h0; h < std::min(heads, h0 + 16); ++h)
        _mm512_mask_storeu_ps(w.by_head.data() + h * len + t0, live, _mm512_mul_ps(by_head[h - h0], sc));
    }
  }
  softmax_rows(w.by_head.data(), heads, len);  // all rows in one call: 8x faster than row by row
  for (int64_t h = 0; h < heads; ++h) {
    const float* row = w.by_head.data() + h * len;
    uint16_t* p = w.probs.data() + h * padded;
    for (int64_t t = 0; t < padded; t += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(tail_mask(len - t), row + t);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }

  // O = P·V, one kv head and four 16-column output tiles (two 32-dimension chunks) at a time.
  const TileConfig values = value_tiles(int(group));
  load_tiles(values);
  const __m512i none = _mm512_setzero_si512();
  for (int64_t g = 0; g < s.kv_heads; ++g) {
    for (int c0 = 0; c0 < NP; c0 += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t0 = 0; t0 < len; t0 += 32) {
        const uint16_t* runs[2];  // tokens t0.. and t0 + 16.. (16 in a row share a block)
        for (int i = 0; i < 2; ++i) {
          const int64_t t = t0 + 16 * i;
          runs[i] = t < len ? vc + (table[t / s.block_size] * s.block_size + t % s.block_size) * stride + g * DIM
                            : nullptr;
        }
        for (int jp = 0; jp < 16; ++jp) {
          const uint16_t* row[2];
          for (int i = 0; i < 2; ++i) {
            const int64_t t = 2 * jp + i;
            row[i] = t0 + t < len ? runs[t / 16] + (t % 16) * stride : nullptr;
          }
          for (int c = 0; c < 2; ++c) {
            const int64_t d = 32 * (c0 + c);
            const __m512i v0 = row[0] ? _mm512_loadu_si512(row[0] + d) : none;
            const __m512i v1 = row[1] ? _mm512_loadu_si512(row[1] + d) : none;
            _mm512_storeu_si512(w.value_pairs.data() + ((2 * c) * 16 + jp) * 32, _mm512_unpacklo_epi16(v0, v1));
            _mm512_storeu_si512(w.value_pairs.data() + ((2 * c + 1) * 16 + jp) * 32,
                                _mm512_unpackhi_epi16(v0, v1));
          }
        }
        _tile_loadd(4, w.probs.data() + g * group * padded + t0, padded * 2);
        const uint16_t* vp = w.value_pairs.data();
        _tile_loadd(5, vp, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, vp + 16 * 32, 64);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, vp + 2 * 16 * 32, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vp + 3 * 16 * 32, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      float* o = w.out.data() + g * group * DIM + 32 * c0;
      _tile_stored(0, o, DIM * 4);
      _tile_stored(1, o + 16, DIM * 4);
      _tile_stored(2, o + 32, DIM * 4);
      _tile_stored(3, o + 48, DIM * 4);
    }
  }
  // Lane 4k + i of the lo tile of chunk c holds dimension 32c + 8k + i; of the hi, 32c + 8k + 4 + i.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t h = 0; h < heads; ++h) {
    const float* o = w.out.data() + h * DIM;
    for (int c = 0; c < NP; ++c) {
      const __m512 lo = _mm512_loadu_ps(o + 32 * c), hi = _mm512_loadu_ps(o + 32 * c + 16);
      const __m512 a = _mm512_permutex2var_ps(lo, first, hi), b = _mm512_permutex2var_ps(lo, second, hi);
      _mm512_storeu_si512(out + h * DIM + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

}  // namespace shoal::decode
#endif
