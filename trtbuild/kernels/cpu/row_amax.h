// max |x| of a row: the activation scale (amax / 127) of QuantizeRows (row_ops.cc) and of QLinear's per-block
// quantization (linear.cc), each of the two files with its own copy. Kept out of line (noinline), as GCC compiled it
// on AVX2 and AVX-512 when the two ops were one file (QLinear's caller, compiled with other float flags, cannot
// inline it): the split into files changed no instruction of these loops.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace trtbuild::cpu {
namespace {

// max |x| (NaNs skipped): exact in any order, so vectorised by hand (GCC leaves std::max of floats scalar without
// -ffinite-math-only: a 4-cycle dependency chain; docs/decisions/row-amax-by-hand.md). vmaxps returns its second
// operand when either is NaN, as std::max(amax, nan) keeps amax.
__attribute__((noinline)) float row_amax(const float* x, int64_t n) {
  float amax = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
  amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

}  // namespace
}  // namespace trtbuild::cpu
