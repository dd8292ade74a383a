// What the prefill kernel's tiles share, whichever products they run: the tile's shape (rows
// of query heads x tokens, keys per online-softmax step) and each thread's scratch.

#pragma once

#include <cstdint>
#include <vector>

#include "simd.h"

#if SHOAL_HAS_VEC
namespace shoal::prefill {

constexpr int RV = 3;                               // row vectors per tile
constexpr int TR = RV * shoal::kLanes;              // rows (token x head of the group) per tile
constexpr int KEYS = 16;                            // keys per online-softmax step
constexpr int kMaxKeys = 64;                       // ... of any product (AMX takes more)
constexpr int KB = shoal::kLanes == 16 ? 8 : 4;     // keys per register block of K·Qᵀ
constexpr int ACC = shoal::kLanes == 16 ? 24 : 12;  // accumulator registers for P·V
constexpr float kMasked = -1e30f;                   // not -inf: fast math assumes finite values

struct Scratch {
  std::vector<float> qt, st, o, m, l, alpha, keys;
  std::vector<uint32_t> pairs;  // bfloat16 pairs: queries, then probabilities (Bf16Dot)
  std::vector<uint16_t> tiles;  // AMX operands built per step: probabilities, value pairs
  std::vector<int64_t> pos;
  int64_t kv_stride = 0;        // elements from one cached token's row to the next's
  void size(int64_t dim) {
    qt.resize(dim * TR);
    st.resize(kMaxKeys * TR);
    o.resize(TR * dim);
    m.resize(TR);
    l.resize(TR);
    alpha.resize(TR);
    keys.resize(KEYS * dim);
    pairs.resize((dim / 2 + KEYS / 2) * TR);
    tiles.resize(TR * kMaxKeys + dim * kMaxKeys);
    pos.resize(TR);
  }
};

}  // namespace shoal::prefill
#endif
