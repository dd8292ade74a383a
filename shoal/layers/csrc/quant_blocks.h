// Weights kept quantized, in the block formats of GGUF (Q4_0, Q4_1, Q8_0), repacked at load
// into shoal's layout (`layers/quant_formats.py` writes it), and activations quantized per row
// to int8 blocks, as llama.cpp quantizes them before its integer dot products.
//
// A weight block is 32 consecutive values along k of one row, with a float16 scale d (and for
// Q4_1 a float16 min m): Q4_0 values are d * (q - 8), q in 0..15; Q4_1 d * q + m; Q8_0 d * q,
// q in -127..127. Rows are packed 8 at a time (a group), block by block: a group's block b is
// [8 scales | 8 mins (Q4_1) | quants], and its quants are 32-byte vectors each holding four
// consecutive k of all 8 rows, row after row: vector j holds k in [4j, 4j + 4). So one 32-bit
// lane of a vector is one row, an integer dot product of a vector with four activation bytes
// broadcast to every lane advances all 8 rows at once, and the sums never need a horizontal
// add. Q4 vectors store two k-quads per byte: the low nibbles are quad s (k in [4s, 4s + 4)),
// the high nibbles quad s + 4 (k in [16 + 4s, 20 + 4s)), as GGUF splits a block's nibbles.
//
// An activation block is 32 int8 values q with a float scale d (q = round(x / d), |q| <= 127)
// and s = d * sum(q), which carries the part of a product that does not depend on q_w: the
// min of Q4_1, the -8 of Q4_0 and the +128 the VNNI path adds to Q8_0 weights.

#pragma once

#include <cstdint>
#include <cstring>

namespace shoal::quant {

constexpr int64_t kBlock = 32;  // values along k sharing a scale
constexpr int64_t kRows = 8;    // rows interleaved in a group

enum class Fmt : int32_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };  // quant_formats.FORMAT_IDS

template <Fmt F>
struct Layout {
  static constexpr bool kNibbles = F != Fmt::Q8_0;
  static constexpr bool kMins = F == Fmt::Q4_1;
  static constexpr int64_t kScaleBytes = kMins ? 32 : 16;
  static constexpr int64_t kQuantBytes = kNibbles ? 128 : 256;
  static constexpr int64_t kBytes = kScaleBytes + kQuantBytes;  // one block of a group
};

// One activation block's scale and scale times the sum of its values.
struct ActBlock {
  float d, s;
};

// IEEE half to float (the scales; the vector paths use F16C instead).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The stored value of row `row`, position `kk` of a block's quants (0..15 for Q4, else int8).
template <Fmt F>
inline int quant_at(const uint8_t* quants, int row, int kk) {
  if constexpr (Layout<F>::kNibbles) {
    const uint8_t byte = quants[((kk % 16) / 4) * 32 + row * 4 + kk % 4];
    return kk < 16 ? byte & 0x0F : byte >> 4;
  } else {
    return int8_t(quants[(kk / 4) * 32 + row * 4 + kk % 4]);
  }
}

}  // namespace shoal::quant
