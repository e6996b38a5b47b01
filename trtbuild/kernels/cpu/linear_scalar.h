// QLinear's plain loops, for CPUs with neither AVX-512 VNNI nor AVX2: the same integers and float steps as the SIMD
// tiles (linear_vnni.h), one row x one panel at a time. Included by linear.cc.

#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "linear_work.h"

#if !TRTBUILD_LINEAR_SIMD
namespace trtbuild::cpu {
namespace {

// The float arithmetic in the order written, as linear_vnni.h's.
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")

// The same integers by plain loops, one row x one panel (CPUs without AVX-512 VNNI or AVX2).
void linear_tile_scalar(const LinearWork& w, int64_t r, int64_t p) {
  const LinearAttrs& a = *w.a;
  const int64_t step_k = a.bits == 8 ? 4 : 8, N = a.out_features;
  float acc[kPanel] = {0};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t k0 = b * a.block, k1 = std::min(k0 + a.block, a.in_features);
    int32_t d[kPanel] = {0};
    for (int64_t t = k0 / step_k; t < (k1 + step_k - 1) / step_k; ++t) {
      const uint8_t* wt = w.w + (p * w.steps + t) * 64;
      const int8_t* qt = w.q + r * w.kpad + t * step_k;
      for (int64_t j = 0; j < kPanel; ++j)
        for (int64_t i = 0; i < 4; ++i) {
          const uint8_t byte = wt[4 * j + i];
          if (a.bits == 8) {
            d[j] += int32_t(byte) * qt[i];
          } else {
            d[j] += int32_t(byte & 0x0F) * qt[i] + int32_t(byte >> 4) * qt[4 + i];
          }
        }
    }
    const int64_t g = w.grouped ? k0 / a.group : 0, at = r * w.blocks + b;
    for (int64_t j = 0; j < kPanel; ++j) {
      const float f = float(d[j] - w.zero_point * w.qsum[at]);
      const float scale = w.grouped ? w.ws[g * w.panels * kPanel + p * kPanel + j] * w.s[at] : w.s[at];
      acc[j] = b == 0 ? f * scale : __builtin_fmaf(f, scale, acc[j]);
    }
  }
  for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
    w.y[r * N + p * kPanel + j] = w.grouped ? acc[j] : acc[j] * w.ws[p * kPanel + j];
}

#pragma GCC pop_options

}  // namespace
}  // namespace trtbuild::cpu
#endif
