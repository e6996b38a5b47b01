// QLinear's product loop on AVX-512 VNNI (linear.h: the arithmetic and the packed layout): tiles of rows x panels
// of 16 columns, vpdpbusd summing 4 products into each int32 lane. Included by linear.cc (and linear_amx.h, which
// shares panel_mask).

#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear_work.h"

#if defined(TRTBUILD_LINEAR_VNNI)
namespace trtbuild::cpu {
namespace {

// The tiles' float arithmetic in the order written (the library's -fassociative-math would otherwise be free to
// turn (d * s) * ws into d * (s * ws) and lose the per-token linear's bit-exactness).
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")

// The lanes of the panel at column `col` that hold outputs (< N): all 16 but in a last, partial panel.
inline __mmask16 panel_mask(int64_t col, int64_t N) {
  return col + kPanel <= N ? __mmask16(0xFFFF) : __mmask16((1u << (N - col)) - 1);
}

// acc += the 4-byte dot products of unsigned u8 and signed s8 lanes, in place: GCC's intrinsic for this made it copy
// every accumulator once per use (twice the instructions of the loop; docs/decisions/qlinear-tile-loop.md).
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// Rows [r0, r0 + R) x panels [p0, p0 + P): R x P accumulators of 16 columns.
template <int R, int P, int Bits>
void linear_tile(const LinearWork& w, int64_t r0, int64_t p0) {
  constexpr int64_t kStepK = Bits == 8 ? 4 : 8;
  const LinearAttrs& a = *w.a;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][P];
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t k0 = b * a.block, k1 = std::min(k0 + a.block, a.in_features);
    const int64_t t0 = k0 / kStepK, t1 = (k1 + kStepK - 1) / kStepK;
    __m512i d[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) d[r][p] = _mm512_setzero_si512();
    const uint8_t* wp[P];
    for (int p = 0; p < P; ++p) wp[p] = w.w + ((p0 + p) * w.steps + t0) * 64;
    const int8_t* qr[R];
    for (int r = 0; r < R; ++r) qr[r] = w.q + (r0 + r) * w.kpad + t0 * kStepK;
    for (int64_t t = t0; t < t1; ++t) {
      // 16 steps ahead in each panel's stream (docs/decisions/qlinear-tile-loop.md)
      for (int p = 0; p < P; ++p) _mm_prefetch(reinterpret_cast<const char*>(wp[p]) + 1024, _MM_HINT_T0);
      if constexpr (Bits == 8) {
        __m512i wv[P];
        for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(wp[p]);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, qr[r], 4);
          const __m512i av = _mm512_set1_epi32(four);
          for (int p = 0; p < P; ++p) d[r][p] = dpbusd(d[r][p], wv[p], av);
        }
      } else {
        __m512i lo[P], hi[P];
        for (int p = 0; p < P; ++p) {
          const __m512i raw = _mm512_loadu_si512(wp[p]);
          lo[p] = _mm512_and_si512(raw, nibble);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          int32_t first, second;
          std::memcpy(&first, qr[r], 4);
          std::memcpy(&second, qr[r] + 4, 4);
          const __m512i av0 = _mm512_set1_epi32(first), av1 = _mm512_set1_epi32(second);
          for (int p = 0; p < P; ++p) {
            d[r][p] = dpbusd(d[r][p], lo[p], av0);
            d[r][p] = dpbusd(d[r][p], hi[p], av1);
          }
        }
      }
      for (int p = 0; p < P; ++p) wp[p] += 64;
      for (int r = 0; r < R; ++r) qr[r] += kStepK;
    }
    const int64_t g = w.grouped ? k0 / a.group : 0;
    if (w.grouped)  // the next panel's scales of this group: a line of their own, strided by the whole row of panels
      _mm_prefetch(reinterpret_cast<const char*>(w.ws + g * w.panels * kPanel + (p0 + P) * kPanel), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * w.blocks + b;
      const __m512i corr = _mm512_set1_epi32(w.zero_point * w.qsum[at]);
      const __m512 s = _mm512_set1_ps(w.s[at]);
      for (int p = 0; p < P; ++p) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[r][p], corr));
        const __m512 scale =
            w.grouped ? _mm512_mul_ps(_mm512_loadu_ps(w.ws + g * w.panels * kPanel + (p0 + p) * kPanel), s) : s;
        acc[r][p] = b == 0 ? _mm512_mul_ps(f, scale) : _mm512_fmadd_ps(f, scale, acc[r][p]);
      }
    }
  }
  const int64_t N = a.out_features;
  for (int p = 0; p < P; ++p) {
    const int64_t col = (p0 + p) * kPanel;
    const __mmask16 mask = panel_mask(col, N);
    const __m512 ws = _mm512_loadu_ps(w.ws + col);
    for (int r = 0; r < R; ++r) {
      const __m512 y = w.grouped ? acc[r][p] : _mm512_mul_ps(acc[r][p], ws);
      _mm512_mask_storeu_ps(w.y + (r0 + r) * N + col, mask, y);
    }
  }
}

#pragma GCC pop_options

}  // namespace
}  // namespace trtbuild::cpu
#endif
