// The per-token int8 linear's two row ops (row_ops.cc), as the glue (ort_ops.cc) calls them: the two ends around
// onnxruntime's MatMulInteger (backends/onnxruntime/build/weights.integer_gemms_per_token), each one pass over its
// tensor instead of five / three standard ops.

#pragma once

#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {

#pragma GCC visibility push(hidden)
// QuantizeRows: x float [rows, width] -> codes uint8 [rows, width], scale float [rows]. Per row
// s = max(amax / 127, FLT_MIN) and codes = round_half_even(x / s) + 128 (the graph's int8 codes plus MatMulInteger's
// zero point 128; |x / s| <= 127, so nothing saturates). The division is a true division (no reciprocal), as the
// graph's Div.
void quantize_rows(OrtKernelContext* ctx, const float* x, uint8_t* codes, float* scale, int64_t rows, int64_t width);

// RescaleRows: sums int32 [rows, width], row scale float [rows], column scale float [width] -> out float
// [rows, width] = (float(sums) * row) * col, the graph's Cast -> Mul -> Mul in the same order.
void rescale_rows(OrtKernelContext* ctx, const int32_t* sums, const float* row, const float* col, float* out,
                  int64_t rows, int64_t width);
#pragma GCC visibility pop

}  // namespace trtbuild::cpu
