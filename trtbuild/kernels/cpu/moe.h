// The mixture-of-experts op `trtbuild::MoE` (moe.cc; plugins/moe/README.md), as the glue (ort_ops.cc) calls it.

#pragma once

#include <cstdint>

#include "common.h"
#include "linear.h"

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
  const float* gate_up_scale;  // [E, 2I] (int8), [E, 2I, ceil(H / group)] (int4)
  const float* down_scale;     // [E, H] (int8), [E, H, ceil(I / group)] (int4)
  // Int4 experts instead (both non-null, with the scales above): two codes a byte, in-feature 2j in the low nibble
  // of byte j, [E, 2I, H / 2] and [E, H, I / 2]; in-feature c of row r of expert e is q * scale[e, r, c / group]
  // (H, I and group even; a last partial block where group does not divide the in-features).
  const uint8_t* gate_up_q4;
  const uint8_t* down_q4;
  // Packed experts instead (the integer path; all four non-null, the fields above null): expert e's gate_up is the
  // weight of QLinear `gate_up_linear` (linear.h: H in-features, 2I out, packed [panels, steps, 64] with scales
  // [groups, panels * 16]) at expert_weight(a, true, e), its down that of `down_linear` (I in, H out) likewise;
  // both linears quantize their inputs per block of the node's activation_block.
  const uint8_t* gate_up_packed;
  const uint8_t* down_packed;
  const float* gate_up_ws;
  const float* down_ws;
  LinearAttrs gate_up_linear, down_linear;
  float* out;  // [T, H]
  int64_t tokens, hidden_size, experts, inter, top_k;
  int64_t group;  // int4 experts: in-features per scale (unused otherwise)
  bool renormalize;
};

// The bytes of one expert's packed weight and the floats of its scales, for a QLinear of these attributes
// (linear.h's layout; the glue checks the tensors' shapes against them).
inline int64_t packed_bytes(const LinearAttrs& l) {
  const int64_t step = l.bits == 8 ? 4 : 8;
  return (l.out_features + 15) / 16 * ((l.in_features + step - 1) / step) * 64;
}
inline int64_t scale_floats(const LinearAttrs& l) {
  return (l.in_features + l.group - 1) / l.group * ((l.out_features + 15) / 16 * 16);
}

// out = the routed experts' weighted outputs (plugins/moe/README.md); reads only the experts some token chose.
void moe(OrtKernelContext* ctx, const MoeArgs& a);
#pragma GCC visibility pop

}  // namespace trtbuild::cpu
