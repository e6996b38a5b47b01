// QuantizeRows and RescaleRows (domain "trtbuild.cpu"; contract in row_ops.h, glue in ort_ops.cc): the per-token
// int8 linear's row ops, tested bit-exact against numpy in tests/test_cpu_kernel.py. QLinear's activation
// quantization (linear.cc: quantize_blocks) repeats encode_row's arithmetic per block.

#include "row_ops.h"

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "row_amax.h"

namespace trtbuild::cpu {
namespace {

// The per-element arithmetic in exact IEEE order: a true division (no reciprocal of the loop-invariant scale) and
// the two products unreassociated. Builtins only: a function of other optimisation flags inlines no std:: calls.
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")
float row_scale(float amax) {  // the graph's max(amax / 127, FLT_MIN)
  const float s = amax / 127.0f;
  return s > __FLT_MIN__ ? s : __FLT_MIN__;
}

void encode_row(const float* x, float s, uint8_t* codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float q = __builtin_nearbyintf(x[i] / s);  // the current rounding mode: to nearest, ties to even
    q = q > 127.0f ? 127.0f : (q < -128.0f ? -128.0f : q);
    codes[i] = uint8_t(int32_t(q) + 128);
  }
}

void rescale_row(const int32_t* sums, float row, const float* col, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = (float(sums[i]) * row) * col[i];
}
#pragma GCC pop_options

void quantize_rows_task(void* data, size_t task) {
  const auto* w = static_cast<const RowsWork*>(data);
  const int64_t lo = int64_t(task) * kRowsPerTask, hi = std::min(w->rows, lo + kRowsPerTask);
  for (int64_t r = lo; r < hi; ++r) {
    const float* x = w->x + r * w->width;
    const float s = row_scale(row_amax(x, w->width));
    w->scale[r] = s;
    encode_row(x, s, w->codes + r * w->width, w->width);
  }
}

void rescale_rows_task(void* data, size_t task) {
  const auto* w = static_cast<const RowsWork*>(data);
  const int64_t lo = int64_t(task) * kRowsPerTask, hi = std::min(w->rows, lo + kRowsPerTask);
  for (int64_t r = lo; r < hi; ++r)
    rescale_row(w->sums + r * w->width, w->scale[r], w->col, w->out + r * w->width, w->width);
}

}  // namespace

void quantize_rows(OrtKernelContext* ctx, const float* x, uint8_t* codes, float* scale, int64_t rows, int64_t width) {
  RowsWork w{};
  w.rows = rows;
  w.width = width;
  w.x = x;
  w.codes = codes;
  w.scale = scale;
  if (w.rows > 0 && w.width > 0) for_rows(ctx, quantize_rows_task, &w);
}

void rescale_rows(OrtKernelContext* ctx, const int32_t* sums, const float* row, const float* col, float* out,
                  int64_t rows, int64_t width) {
  RowsWork w{};
  w.rows = rows;
  w.width = width;
  w.sums = sums;
  w.scale = const_cast<float*>(row);  // read only here
  w.col = col;
  w.out = out;
  if (w.rows > 0 && w.width > 0) for_rows(ctx, rescale_rows_task, &w);
}

}  // namespace trtbuild::cpu
