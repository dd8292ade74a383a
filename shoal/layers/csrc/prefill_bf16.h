// The bfloat16 products of a prefill tile (see paged_prefill.cpp for the tile and its online
// softmax): VDPBF16PS where the CPU has AVX512_BF16.

#pragma once

#include <cstdint>
#include <cstring>

#include "prefill_tile.h"

#if defined(__AVX512BF16__)
namespace shoal::prefill {

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

// bfloat16 queries, keys and values on CPUs with AVX512_BF16: VDPBF16PS multiplies pairs of
// bfloat16 into float32 sums, 32 products an instruction, twice the float32 FMA rate, and
// nothing is widened. Queries are stored as (d, d + 1) pairs per row, each key's pair is
// broadcast against them; the probabilities are rounded to (key, key + 1) pairs (as
// transformers rounds them to bfloat16 before P·V) and meet two keys' value rows interleaved
// by unpack lo/hi, which permutes the dimensions of `o`; `value` undoes it.
template <int DIM, int NR>
struct Bf16DotProducts {
  static constexpr int kRows = NR * 16;         // rows in use: the first NR row vectors
  static constexpr int NP = DIM / 32;           // vectors of 32 bfloat16 per row
  static constexpr int NO = DIM / 16;           // float32 output vectors per row
  static constexpr int RB = ACC / NO;           // rows per register block (divides TR)
  static constexpr int kKeys = KEYS;            // keys per online-softmax step
  static_assert(shoal::kLanes == 16 && TR % RB == 0, "tile shape");

  // Each 16 rows x 16 pairs block transposed in registers (missing rows are zeros).
  static void load_queries(Scratch& w, const uint16_t* const* rows, float) {
    for (int g = 0; g < NR; ++g) {
      for (int e0 = 0; e0 < DIM / 2; e0 += 16) {
        __m512 by_row[16], by_pair[16];
        for (int r = 0; r < 16; ++r) {
          const uint16_t* row = rows[16 * g + r];
          by_row[r] = row ? _mm512_loadu_ps(reinterpret_cast<const float*>(row + 2 * e0))
                        : _mm512_setzero_ps();
        }
        shoal::transpose16(by_row, by_pair);
        float* dst = reinterpret_cast<float*>(w.pairs.data()) + 16 * g;
        for (int e = 0; e < 16; ++e) _mm512_storeu_ps(dst + (e0 + e) * TR, by_pair[e]);
      }
    }
  }

  static void scores(Scratch& w, const uint16_t* const* k, int n, float* sc, float scale) {
    const uint32_t* qt = w.pairs.data();
    int j = 0;
    for (; j + KB <= n; j += KB) key_block<KB>(qt, k + j, sc + j * TR, scale);
    for (; j < n; ++j) key_block<1>(qt, k + j, sc + j * TR, scale);
  }

  template <int NK>
  static void key_block(const uint32_t* qt, const uint16_t* const* k, float* sc, float scale) {
    __m512 acc[NK][NR];
    for (int j = 0; j < NK; ++j)
      for (int v = 0; v < NR; ++v) acc[j][v] = _mm512_setzero_ps();
    for (int64_t e = 0; e < DIM / 2; ++e) {
      __m512bh q[NR];
      for (int v = 0; v < NR; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qt + e * TR + v * 16);
      for (int j = 0; j < NK; ++j) {
        const __m512bh kj = (__m512bh)_mm512_set1_epi32(int(pair_at(k[j] + 2 * e)));
        for (int v = 0; v < NR; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], kj, q[v]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < NK; ++j)
      for (int v = 0; v < NR; ++v) _mm512_storeu_ps(sc + j * TR + v * 16, _mm512_mul_ps(acc[j][v], s));
  }

  static void values(Scratch& w, const uint16_t* const* v, int n, const float* p,
                     const float* alpha) {
    const int np = (n + 1) / 2;  // key pairs; an odd last key pairs with a zero
    uint32_t* pp = w.pairs.data() + (DIM / 2) * TR;
    __m512i vint[KEYS / 2][NO];
    const __m512i zero = _mm512_setzero_si512();
    for (int jp = 0; jp < np; ++jp) {
      const bool two = 2 * jp + 1 < n;
      for (int rv = 0; rv < NR; ++rv) {
        const __m512i lo = _mm512_cvtepu16_epi32(
            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + 2 * jp * TR + rv * 16)));
        const __m512i hi = two ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                                     _mm512_loadu_ps(p + (2 * jp + 1) * TR + rv * 16)))
                               : zero;
        _mm512_storeu_si512(pp + jp * TR + rv * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
      for (int c = 0; c < NP; ++c) {
        const __m512i v0 = _mm512_loadu_si512(v[2 * jp] + 32 * c);
        const __m512i v1 = two ? _mm512_loadu_si512(v[2 * jp + 1] + 32 * c) : zero;
        vint[jp][2 * c] = _mm512_unpacklo_epi16(v0, v1);
        vint[jp][2 * c + 1] = _mm512_unpackhi_epi16(v0, v1);
      }
    }
    float* o = w.o.data();
    for (int r0 = 0; r0 < kRows; r0 += RB) {  // RB divides TR: a last block stays in scratch
      __m512 acc[RB][NO];
      for (int r = 0; r < RB; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
        for (int c = 0; c < NO; ++c)
          acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + r) * DIM + 16 * c), a);
      }
      for (int jp = 0; jp < np; ++jp) {
        for (int r = 0; r < RB; ++r) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(int(pp[jp * TR + r0 + r]));
          for (int c = 0; c < NO; ++c)
            acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)vint[jp][c], b);
        }
      }
      for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NO; ++c) _mm512_storeu_ps(o + (r0 + r) * DIM + 16 * c, acc[r][c]);
    }
  }

  // Row r of the output, times `inv`, in bfloat16. Lane 4k + i of the lo vector of 32-dimension
  // chunk c holds dimension 32c + 8k + i; of the hi vector, 32c + 8k + 4 + i: two two-source
  // permutes put the chunk back in order.
  static void store_row(const Scratch& w, int64_t r, float inv, uint16_t* dst) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 scale = _mm512_set1_ps(inv);
    const float* o = w.o.data() + r * DIM;
    for (int c = 0; c < NP; ++c) {
      const __m512 lo = _mm512_loadu_ps(o + 32 * c), hi = _mm512_loadu_ps(o + 32 * c + 16);
      const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale);
      const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale);
      _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
};

}  // namespace shoal::prefill
#endif
