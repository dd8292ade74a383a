// The quantized products' building blocks, for callers that run them on their own threads
// inside one parallel region (the fused decode step) instead of through the entry points.

#pragma once

#include <cstdint>

#include "quant_blocks.h"

namespace shoal::quant {

// Rows [0, m) of A (int8 blocks, qgemm.cpp) against the 8-row groups [g0, g1) of W.
void qgemm_groups(Fmt fmt, const int8_t* a, const ActBlock* act, int64_t m, int64_t k,
                  const uint8_t* w, int64_t n, float* c, int64_t ldc, const float* bias,
                  int64_t g0, int64_t g1);

// One row of `k` floats (k a multiple of 32) as int8 blocks (quantize.cpp).
void quantize_row(const float* x, int64_t k, int8_t* q, ActBlock* blocks);

}  // namespace shoal::quant
