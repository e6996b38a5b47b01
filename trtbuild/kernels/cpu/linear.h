// QLinear: an integer linear of float rows against packed 8- or 4-bit weights, for onnxruntime's CPU engines
// (backends/onnxruntime/build/native_linear.py makes the nodes and packs the weights; tests/test_cpu_linear.py
// checks it against a numpy statement of the arithmetic below, bit for bit). The kernel is linear.cc with its
// product loops per instruction set in linear_vnni.h, linear_avx2.h, linear_amx.h and linear_scalar.h; the glue
// that reads the node's tensors is ort_ops.cc.
//
// y[m, n] for float rows x [M, K] and weight codes c[k, n] (int8, or int4 in [-8, 7]) with float scales ws:
//   1. each row's activation blocks of `block` in-features (the last one may be shorter) are quantized to int8:
//      s[m, b] = max(amax / 127, FLT_MIN) (true division), q = round_half_even(x / s) (|x / s| <= 127);
//   2. per block an exact int32 dot product:  d[m, b, n] = sum_k q[m, k] * c[k, n];
//   3. blocks of the weight's own groups (`group` in-features, `group` % `block` == 0; group >= K: per channel):
//      per channel:  y = (sum_b float(d) * s[m, b]) * ws[n]     (the sum in block order; one block: (d * s) * ws)
//      per group:    y =  sum_b float(d) * (ws[g(b), n] * s[m, b])
//   With one block per row (block >= K) and a per-channel weight this is exactly QuantizeRows -> MatMulInteger ->
//   RescaleRows (the per-token int8 linear), and with blocks of 16 the arithmetic of MatMulNBits' int8 path.
//
// The product in step 2 runs on AVX-512 VNNI (vpdpbusd: unsigned 8-bit x signed 8-bit, 4 products summed into each
// int32 lane): the weights are the unsigned operand, stored as u = c + zero_point (128 for int8, 8 for int4), and
// the activation codes the signed one, so d = sum_k u * q - zero_point * sum_k q (exact). Packed layout (input 1,
// uint8 [panels, steps, 64]): panel p holds output columns 16p..16p+15, step t 4 in-features (8 for int4); byte
// 4j + i of a step is column 16p + j at in-feature 4t + i, for int4 the low nibble at 8t + i and the high one at
// 8t + 4 + i. Padding (in-features to a whole step, columns to a whole panel) holds zero codes. Without VNNI, AVX2
// sums the same integers with vpmaddubsw (see its linear_tile); without AVX2, plain loops (same results, slower).
//
// Inputs: 0 x float [..., K], 1 packed weight uint8, 2 weight scale float [groups, panels * 16] (padded columns:
// zero), 3 (optional) weight offset float [groups, panels * 16]. Output: 0 y float [..., N]. Attributes: bits
// (8 | 4), in_features K, out_features N, group, block.
//
// With offsets (llama.cpp's Q4_1 and Q5_K: w = u * ws[g, n] + wo[g, n], the stored codes u themselves, 0..15 or
// 0..255, zero point 0), step 3
// is followed by the offset term, per row and column in block order after the products' result:
//   y = fma(s[m, b] * float(sum_k q[m, k] over block b), wo[g(b), n], y) for b = 0, 1, ...
// the quantized activation's block sums, as llama.cpp's Q8_1 carries them: y is then the quantized rows times the
// exact weights (docs/decisions/q4-1-offset-from-code-sums.md).

#pragma once

#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {

struct LinearAttrs {  // the node's attributes
  int64_t bits, in_features, out_features, group, block;
};

#pragma GCC visibility push(hidden)
// y [num_rows, out_features] for x [num_rows, in_features], the packed weight and its scales (and offsets, or null),
// laid out as above.
void qlinear(OrtKernelContext* ctx, const LinearAttrs& a, const float* x, int64_t num_rows, const uint8_t* packed,
             const float* ws, const float* wo, float* y);
#pragma GCC visibility pop

}  // namespace trtbuild::cpu
