// The quantized products' building blocks, for callers that run them on their own threads
// inside one parallel region (the fused decode step) instead of through the entry points.
// Activation rows are blocks of 32 in one or two int8 levels (quantize.cpp): `levels * k`
// bytes a row.

#pragma once

#include <cstdint>

#include "quant_blocks.h"

namespace shoal::quant {

// Rows [0, m) of A against the 8-row groups [g0, g1) of W (qgemm.cpp).
void qgemm_groups(Fmt fmt, int levels, const int8_t* a, const ActBlock* act, int64_t m,
                  int64_t k, const uint8_t* w, int64_t n, float* c, int64_t ldc,
                  const float* bias, int64_t g0, int64_t g1);

// One row of `k` floats (k a multiple of 32) as `levels` int8 levels (quantize.cpp).
void quantize_row(const float* x, int64_t k, int levels, int8_t* q, ActBlock* blocks);

}  // namespace shoal::quant
