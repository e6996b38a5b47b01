// SwiGLU: the gated MLP's activation as one pass, for onnxruntime's CPU engines (domain "trtbuild.cpu", glue in
// ort_ops.cc; backends/onnxruntime/build/native.py fuse_swiglu places it; tests/test_cpu_swiglu.py checks it against
// numpy).
//
// x float [..., 2 I] (the fused gate_up projection: gate in [0, I), up in [I, 2 I)) -> y float [..., I] with
//   y = (g * sigmoid(g)) * u,   sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) otherwise, e = exp(-|g|),
// which is the graph's Split -> Sigmoid -> Mul -> Mul (three passes after onnxruntime fuses the sigmoid product into
// QuickGelu, and their intermediate tensors) in one pass. exp(-|g|) never overflows, so no lane forms an infinity.
// Within 3e-7 of float64 for |g| < 87 (below, exp's clamp at -87.3 leaves a sigmoid of ~1e-38 where it is smaller);
// onnxruntime's own logistic clamps at +-18, so the two differ far out on the negative side (by ~1e-8 absolute).

#include "swiglu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {
namespace {

inline v8 silu_times8(v8 g, v8 u) {
  const v8 a = g < 0.0f ? -g : g;
  const v8 e = exp8_nonpositive(-a);
  const v8 s = (g < 0.0f ? e : v8{} + 1.0f) / (e + 1.0f);
  return (g * s) * u;
}

inline float silu_times(float g, float u) {
  const float e = exp_nonpositive(-std::fabs(g));
  const float s = (g < 0.0f ? e : 1.0f) / (e + 1.0f);
  return (g * s) * u;
}

void swiglu_rows(void* data, size_t task) {
  const auto* w = static_cast<const RowsWork*>(data);
  const int64_t half = w->width / 2;
  const int64_t lo = int64_t(task) * kRowsPerTask, hi = std::min(w->rows, lo + kRowsPerTask);
  for (int64_t r = lo; r < hi; ++r) {
    const float* g = w->x + r * w->width;
    const float* u = g + half;
    float* y = w->out + r * half;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) store8(y + i, silu_times8(load8(g + i), load8(u + i)));
    for (; i < half; ++i) y[i] = silu_times(g[i], u[i]);
  }
}

}  // namespace

void swiglu(OrtKernelContext* ctx, const float* x, float* y, int64_t rows, int64_t width) {
  RowsWork w{};
  w.rows = rows;
  w.width = width;
  w.x = x;
  w.out = y;
  if (w.rows > 0 && w.width > 0) for_rows(ctx, swiglu_rows, &w);
}

}  // namespace trtbuild::cpu
