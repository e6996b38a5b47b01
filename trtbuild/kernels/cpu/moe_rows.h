// The expert weights' dot products of the MoE kernel (moe.cc; plugins/moe/README.md): an expert's rows, float, int8
// with a scale per row or int4 with a scale per block, dotted two at a time with up to four activation rows and
// scaled. Int8 rows are widened to float; int4 rows unpacked to float (AVX-512: 32 codes a step by a table lookup;
// AVX2: 16; else plain loops), each block's products summed apart and scaled by its block's scale.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "moe.h"

namespace trtbuild::cpu {
namespace {

// Eight int8 weights widened to floats (int8 experts): one sign-extending load and a conversion with AVX2 (GCC
// lowers the generic form to a byte-by-byte insert, 3x slower a decode step).
inline v8 load8(const int8_t* p) {
  v8 out;
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &f, sizeof(out));
#else
  typedef int8_t v8b __attribute__((vector_size(8)));
  v8b b;
  std::memcpy(&b, p, sizeof(b));
  out = __builtin_convertvector(b, v8);
#endif
  return out;
}

// A signed int4 code from its nibble: two's complement, [-8, 7].
inline int nibble_value(uint8_t nibble) { return int(nibble ^ 8) - 8; }

// Int4 code c of a packed row: byte c / 2, the low nibble for even c.
inline float code4(const uint8_t* row, int64_t c) { return float(nibble_value((row[c >> 1] >> ((c & 1) * 4)) & 15)); }

// Sixteen int4 codes (eight bytes) widened to floats, in-features [0, 8) in lo and [8, 16) in hi: with AVX2, the
// nibbles split and interleaved back into order, a table lookup (pshufb) to their signed values, two widenings.
inline void load16_q4(const uint8_t* p, v8& lo, v8& hi) {
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m128i codes = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(low, high));
  const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
  const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)));
  std::memcpy(&lo, &f0, sizeof(lo));
  std::memcpy(&hi, &f1, sizeof(hi));
#else
  for (int i = 0; i < 8; ++i) {
    const uint8_t b = p[i];
    v8& half = i < 4 ? lo : hi;
    half[(2 * i) % 8] = float(nibble_value(b & 15));
    half[(2 * i) % 8 + 1] = float(nibble_value(b >> 4));
  }
#endif
}

// Eight int4 codes (four bytes) widened to floats.
inline v8 load8_q4(const uint8_t* p) {
  v8 out;
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = float(nibble_value(p[i] & 15));
    out[2 * i + 1] = float(nibble_value(p[i] >> 4));
  }
  return out;
}

inline float hsum(v8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// The dot products of two weight rows w0, w1 with N vectors x[j], each of length len: out0[j], out1[j]. Each load
// of a row serves every vector and each load of a vector both rows; N is a constant so that the 2 N accumulators
// stay in registers.
template <int N, typename W>
inline void dots2_n(const W* w0, const W* w1, const float* const* x, int64_t len, float* out0, float* out1) {
  v8 a0[N] = {}, a1[N] = {};
  const float* xs[N];
  for (int j = 0; j < N; ++j) xs[j] = x[j];
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const v8 u0 = load8(w0 + i), u1 = load8(w1 + i);
    for (int j = 0; j < N; ++j) {
      const v8 xv = load8(xs[j] + i);
      a0[j] += u0 * xv;
      a1[j] += u1 * xv;
    }
  }
  for (int j = 0; j < N; ++j) {
    float s0 = hsum(a0[j]), s1 = hsum(a1[j]);
    for (int64_t k = i; k < len; ++k) {
      s0 += float(w0[k]) * x[j][k];
      s1 += float(w1[k]) * x[j][k];
    }
    out0[j] = s0;
    out1[j] = s1;
  }
}

// dots2_n for n = 1..4 vectors; W: float or int8 weights (the products then want the rows' scales).
template <typename W>
inline void dots2(const W* w0, const W* w1, const float* const* x, int n, int64_t len, float* out0, float* out1) {
  switch (n) {
    case 1: return dots2_n<1>(w0, w1, x, len, out0, out1);
    case 2: return dots2_n<2>(w0, w1, x, len, out0, out1);
    case 3: return dots2_n<3>(w0, w1, x, len, out0, out1);
    default: return dots2_n<4>(w0, w1, x, len, out0, out1);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Thirty-two int4 codes (sixteen bytes) as two vectors of sixteen floats, in-features [0, 16) in lo and [16, 32) in
// hi: each byte beside itself shifted down a nibble (the codes in order, each in a byte's low four bits), widened to
// 32-bit lanes, and the signed values looked up in a register (vpermps reads the low four bits of each index).
inline void load32_q4(const uint8_t* p, __m512 table, __m512& lo, __m512& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i high = _mm_srli_epi16(bytes, 4);
  lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, high)), table);
  hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(bytes, high)), table);
}

// Sixteen int4 codes (eight bytes) as sixteen floats, as load32_q4.
inline __m512 load16_q4_512(const uint8_t* p, __m512 table) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, _mm_srli_epi16(bytes, 4))), table);
}

// dots2_n for int4 rows w0, w1 (packed, len even) with a scale per block of `group` in-features (s0, s1), on
// AVX-512: each block's products summed apart, thirty-two in-features a step, then scaled and added to the row's
// sum; in-features past the block's last whole sixteen in plain loops.
template <int N>
inline void dots2_q4_n(const uint8_t* w0, const uint8_t* w1, const float* s0, const float* s1,
                       const float* const* x, int64_t len, int64_t group, float* out0, float* out1) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  __m512 a0[N], a1[N];
  float t0[N] = {}, t1[N] = {};
  for (int j = 0; j < N; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < len; k0 += group, ++b) {
    const int64_t k1 = std::min(len, k0 + group);
    __m512 g0[N], g1[N];
    for (int j = 0; j < N; ++j) g0[j] = g1[j] = _mm512_setzero_ps();
    int64_t i = k0;
    for (; i + 32 <= k1; i += 32) {
      __m512 u0a, u0b, u1a, u1b;
      load32_q4(w0 + i / 2, table, u0a, u0b);
      load32_q4(w1 + i / 2, table, u1a, u1b);
      for (int j = 0; j < N; ++j) {
        const __m512 xa = _mm512_loadu_ps(x[j] + i), xb = _mm512_loadu_ps(x[j] + i + 16);
        g0[j] = _mm512_fmadd_ps(u0b, xb, _mm512_fmadd_ps(u0a, xa, g0[j]));
        g1[j] = _mm512_fmadd_ps(u1b, xb, _mm512_fmadd_ps(u1a, xa, g1[j]));
      }
    }
    for (; i + 16 <= k1; i += 16) {
      const __m512 u0 = load16_q4_512(w0 + i / 2, table), u1 = load16_q4_512(w1 + i / 2, table);
      for (int j = 0; j < N; ++j) {
        const __m512 xv = _mm512_loadu_ps(x[j] + i);
        g0[j] = _mm512_fmadd_ps(u0, xv, g0[j]);
        g1[j] = _mm512_fmadd_ps(u1, xv, g1[j]);
      }
    }
    for (int j = 0; j < N; ++j) {
      a0[j] = _mm512_fmadd_ps(g0[j], _mm512_set1_ps(s0[b]), a0[j]);
      a1[j] = _mm512_fmadd_ps(g1[j], _mm512_set1_ps(s1[b]), a1[j]);
      float r0 = 0.0f, r1 = 0.0f;
      for (int64_t k = i; k < k1; ++k) {
        r0 += code4(w0, k) * x[j][k];
        r1 += code4(w1, k) * x[j][k];
      }
      t0[j] += r0 * s0[b];
      t1[j] += r1 * s1[b];
    }
  }
  for (int j = 0; j < N; ++j) {
    out0[j] = _mm512_reduce_add_ps(a0[j]) + t0[j];
    out1[j] = _mm512_reduce_add_ps(a1[j]) + t1[j];
  }
}
#else
// dots2_n for int4 rows w0, w1 (packed, len even) with a scale per block of `group` in-features (s0, s1): each
// block's products are summed apart, sixteen in-features a step, then scaled and added to the row's sum.
template <int N>
inline void dots2_q4_n(const uint8_t* w0, const uint8_t* w1, const float* s0, const float* s1,
                       const float* const* x, int64_t len, int64_t group, float* out0, float* out1) {
  v8 a0[N] = {}, a1[N] = {};
  float t0[N] = {}, t1[N] = {};  // the blocks' scalar tails (in-features past the last whole eight of a block)
  const float* xs[N];
  for (int j = 0; j < N; ++j) xs[j] = x[j];
  for (int64_t k0 = 0, b = 0; k0 < len; k0 += group, ++b) {
    const int64_t k1 = std::min(len, k0 + group);
    v8 g0[N] = {}, g1[N] = {};
    int64_t i = k0;
    for (; i + 16 <= k1; i += 16) {
      v8 u0a, u0b, u1a, u1b;
      load16_q4(w0 + i / 2, u0a, u0b);
      load16_q4(w1 + i / 2, u1a, u1b);
      for (int j = 0; j < N; ++j) {
        const v8 xa = load8(xs[j] + i), xb = load8(xs[j] + i + 8);
        g0[j] += u0a * xa + u0b * xb;
        g1[j] += u1a * xa + u1b * xb;
      }
    }
    for (; i + 8 <= k1; i += 8) {
      const v8 u0 = load8_q4(w0 + i / 2), u1 = load8_q4(w1 + i / 2);
      for (int j = 0; j < N; ++j) {
        const v8 xv = load8(xs[j] + i);
        g0[j] += u0 * xv;
        g1[j] += u1 * xv;
      }
    }
    for (int j = 0; j < N; ++j) {
      a0[j] += g0[j] * s0[b];
      a1[j] += g1[j] * s1[b];
      float r0 = 0.0f, r1 = 0.0f;
      for (int64_t k = i; k < k1; ++k) {
        r0 += code4(w0, k) * xs[j][k];
        r1 += code4(w1, k) * xs[j][k];
      }
      t0[j] += r0 * s0[b];
      t1[j] += r1 * s1[b];
    }
  }
  for (int j = 0; j < N; ++j) {
    out0[j] = hsum(a0[j]) + t0[j];
    out1[j] = hsum(a1[j]) + t1[j];
  }
}

#endif

// An expert's rows as the dot products read them, scaled: float or int8 rows (W) with a scale per row (null for
// float), each row `len` weights.
template <typename W>
struct RowScaled {
  const W* w;
  const float* scale;
  int64_t len;

  // out0[j], out1[j]: rows r0 and r1 dotted with the n <= 4 vectors x[j], times the rows' scales.
  void dots(int64_t r0, int64_t r1, const float* const* x, int n, float* out0, float* out1) const {
    dots2(w + r0 * len, w + r1 * len, x, n, len, out0, out1);
    if (scale == nullptr) return;
    for (int j = 0; j < n; ++j) {
      out0[j] *= scale[r0];
      out1[j] *= scale[r1];
    }
  }
};

// Int4 rows of `len` in-features (len / 2 bytes each) with a scale per block of `group` (`blocks` a row).
struct Int4Rows {
  const uint8_t* w;
  const float* scale;
  int64_t len, group, blocks;

  void dots(int64_t r0, int64_t r1, const float* const* x, int n, float* out0, float* out1) const {
    const uint8_t *w0 = w + r0 * (len / 2), *w1 = w + r1 * (len / 2);
    const float *s0 = scale + r0 * blocks, *s1 = scale + r1 * blocks;
    switch (n) {
      case 1: return dots2_q4_n<1>(w0, w1, s0, s1, x, len, group, out0, out1);
      case 2: return dots2_q4_n<2>(w0, w1, s0, s1, x, len, group, out0, out1);
      case 3: return dots2_q4_n<3>(w0, w1, s0, s1, x, len, group, out0, out1);
      default: return dots2_q4_n<4>(w0, w1, s0, s1, x, len, group, out0, out1);
    }
  }
};

// Expert e's rows of a [E, rows, len] tensor in whichever form the node's experts take.
template <typename Fn>
inline void with_expert_rows(const MoeArgs& a, bool gate_up, int64_t e, Fn&& fn) {
  const int64_t rows = gate_up ? 2 * a.inter : a.hidden_size, len = gate_up ? a.hidden_size : a.inter;
  const float* scale = gate_up ? a.gate_up_scale : a.down_scale;
  if (const uint8_t* q4 = gate_up ? a.gate_up_q4 : a.down_q4) {
    const int64_t blocks = (len + a.group - 1) / a.group;
    fn(Int4Rows{q4 + e * rows * (len / 2), scale + e * rows * blocks, len, a.group, blocks});
  } else if (const int8_t* q8 = gate_up ? a.gate_up_q : a.down_q) {
    fn(RowScaled<int8_t>{q8 + e * rows * len, scale + e * rows, len});
  } else {
    fn(RowScaled<float>{(gate_up ? a.gate_up : a.down) + e * rows * len, nullptr, len});
  }
}

}  // namespace
}  // namespace trtbuild::cpu
