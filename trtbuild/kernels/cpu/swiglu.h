// The gated MLP's SwiGLU activation (swiglu.cc), as the glue (ort_ops.cc) calls it.

#pragma once

#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {

#pragma GCC visibility push(hidden)
// x float [rows, width] (width = 2 I: the gate in [0, I), the up projection in [I, 2 I)) -> y float [rows, I].
void swiglu(OrtKernelContext* ctx, const float* x, float* y, int64_t rows, int64_t width);
#pragma GCC visibility pop

}  // namespace trtbuild::cpu
