// The mixture-of-experts op `trtbuild::MoE` (moe.cc; plugins/moe/README.md), as the glue (ort_ops.cc) calls it.

#pragma once

#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {

#pragma GCC visibility push(hidden)
// One node's tensors (float32, row-major) and attributes.
struct MoeArgs {
  const float* hidden;   // [T, H]
  const float* logits;   // [T, E]: the router's scores
  const float* gate_up;  // [E, 2I, H]: each expert's gate rows, then its up rows (float experts)
  const float* down;     // [E, H, I] (float experts)
  // Int8 experts instead (both non-null): the same shapes, row r of expert e is q[e, r] * scale[e, r].
  const int8_t* gate_up_q;
  const int8_t* down_q;
  const float* gate_up_scale;  // [E, 2I]
  const float* down_scale;     // [E, H]
  float* out;                  // [T, H]
  int64_t tokens, hidden_size, experts, inter, top_k;
  bool renormalize;
};

// out = the routed experts' weighted outputs (plugins/moe/README.md); reads only the experts some token chose.
void moe(OrtKernelContext* ctx, const MoeArgs& a);
#pragma GCC visibility pop

}  // namespace trtbuild::cpu
