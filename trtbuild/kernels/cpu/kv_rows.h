// The paged attention's cache rows in their three number formats (Attrs::cache_type): stored from float, read back
// as float. Float rows are copied; int8 and FLOAT8E4M3FN rows (fp8 kept as its uint8 bit patterns) hold
// quantize(x / scale) with the per-tensor scales of the op's inputs 7 and 8, as reference.py quantizes them.
// Included by paged_attention.cc only.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"
#include "paged_attention.h"

namespace trtbuild::cpu {
namespace {

// FLOAT8E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN, 448 the largest.
// Decoded without a table, so that a row's loop vectorises: a normal code's 7 exponent/mantissa bits placed at
// float32's exponent/mantissa boundary, exponent rebased by 127 - 7; a subnormal (e = 0) is m * 2^-9. No float32
// subnormal is formed on the way (they cost a microcode assist per operation). Exact: every E4M3 value is a float32.
inline float from_fp8(uint8_t c) {
  const uint32_t mag = c & 0x7F, bits = (mag << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float v = mag == 0x7F ? std::numeric_limits<float>::quiet_NaN() : mag < 8 ? float(mag) * 0x1p-9f : normal;
  return c & 0x80 ? -v : v;
}

// x -> E4M3FN, rounding to nearest even and saturating to +-448 (ONNX QuantizeLinear with saturate=1). Normal
// results by integer rounding of float32's bits (no libm calls: one row per token and layer is stored).
inline uint8_t to_fp8(float x) {
  if (std::isnan(x)) return 0x7F;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0x1p-6f) return sign | uint8_t(std::nearbyint(a * 512.0f));  // subnormal m * 2^-9 (m = 8: min normal)
  bits &= 0x7FFFFFFFu;
  bits += 0x7FFFFu + ((bits >> 20) & 1);  // round the 20 dropped mantissa bits to nearest even
  return sign | uint8_t((bits >> 20) - (120u << 3));  // float32 exponent 127-biased -> 7-biased, 3 mantissa bits
}

// One cache row of `n` values of a head: stored quantized (or copied) from float.
void store_row(const Attrs& a, void* cache, int64_t offset, const float* x, int64_t n, float scale) {
  if (a.cache_type == kCacheFloat) {
    std::memcpy(static_cast<float*>(cache) + offset, x, n * sizeof(float));
  } else if (a.cache_type == kCacheInt8) {
    int8_t* dst = static_cast<int8_t*>(cache) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = int8_t(std::clamp(std::nearbyint(x[i] / scale), -128.0f, 127.0f));
  } else {
    uint8_t* dst = static_cast<uint8_t*>(cache) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = to_fp8(x[i] / scale);
  }
}

// `n` cache rows of one head (row i at offset + i * row_stride, `d` values) -> float rows of `d` in `out`.
void dequantize_rows(const Attrs& a, const void* cache, int64_t offset, int64_t n, int64_t row_stride, int64_t d,
                     float scale, float* __restrict out) {
  if (a.cache_type == kCacheInt8) {
    const int8_t* src = static_cast<const int8_t*>(cache) + offset;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) out[i * d + c] = float(src[i * row_stride + c]) * scale;
    return;
  }
  const uint8_t* src = static_cast<const uint8_t*>(cache) + offset;
  for (int64_t i = 0; i < n; ++i) {
    int64_t c = 0;
#if defined(__F16C__)
    // 8 codes at a time through the CPU's half-precision conversion: E4M3 s.eeee.mmm placed as binary16
    // s.0eeee.mmm0000000 is 2^(e-15) * (1 + m/8), or m * 2^-17 for e = 0 (a binary16 subnormal, which the
    // conversion handles exactly at full speed); times 2^8 both are the E4M3 value. Code 0x7F gets binary16's
    // all-ones exponent (NaN).
    const __m256 scaled = _mm256_set1_ps(scale * 256.0f);
    for (; c + 8 <= d; c += 8) {
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i * row_stride + c)));
      const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7F));
      const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7E00));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
      const __m128i half = _mm_or_si128(_mm_or_si128(sign, _mm_slli_epi16(mag, 7)), nan);
      _mm256_storeu_ps(out + i * d + c, _mm256_mul_ps(_mm256_cvtph_ps(half), scaled));
    }
#endif
    for (; c < d; ++c) out[i * d + c] = from_fp8(src[i * row_stride + c]) * scale;
  }
}

}  // namespace
}  // namespace trtbuild::cpu
