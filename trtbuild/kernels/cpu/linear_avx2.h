// QLinear's product loop on AVX2 + FMA without AVX-512 VNNI (linear.h: the arithmetic and the packed layout): the
// same integers and float steps as linear_vnni.h, lane for lane. Included by linear.cc.

#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear_work.h"

#if defined(TRTBUILD_LINEAR_AVX2)
namespace trtbuild::cpu {
namespace {

// The tiles' float arithmetic in the order written (the library's -fassociative-math would otherwise be free to
// turn (d * s) * ws into d * (s * ws) and lose the per-token linear's bit-exactness).
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")

// AVX2 without VNNI: vpmaddubsw (unsigned 8-bit x signed 8-bit pairs -> int16, saturating) then vpmaddwd by ones
// (-> int32 lanes of 4 products), each 64-byte step as two halves of 8 columns. int8: u * q pairs could saturate
// int16 (255 * 127 * 2), so the weight is taken signed, c = u ^ 0x80 = u - 128, its magnitude as the unsigned
// operand and its sign moved onto the activation code: |c| * sign(q, c), at most 128 * 127 * 2 = 32512 a pair
// (exact, |q| <= 127), and the sum is d itself (no zero-point term). int4: u in [0, 15] times q stays exact
// (15 * 127 * 2 per pair, twice that for a step's two nibble halves), less the zero-point term as above.
// The float steps are the VNNI tile's, lane for lane.
template <int R, int P, int Bits>
void linear_tile(const LinearWork& w, int64_t r0, int64_t p0) {
  constexpr int64_t kStepK = Bits == 8 ? 4 : 8;
  constexpr int H = 2 * P;  // 8-column halves
  const LinearAttrs& a = *w.a;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  __m256 acc[R][H];
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t k0 = b * a.block, k1 = std::min(k0 + a.block, a.in_features);
    const int64_t t0 = k0 / kStepK, t1 = (k1 + kStepK - 1) / kStepK;
    __m256i d[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) d[r][h] = _mm256_setzero_si256();
    const uint8_t* wp[P];
    for (int p = 0; p < P; ++p) wp[p] = w.w + ((p0 + p) * w.steps + t0) * 64;
    const int8_t* qr[R];
    for (int r = 0; r < R; ++r) qr[r] = w.q + (r0 + r) * w.kpad + t0 * kStepK;
    for (int64_t t = t0; t < t1; ++t) {
      for (int p = 0; p < P; ++p) _mm_prefetch(reinterpret_cast<const char*>(wp[p]) + 1024, _MM_HINT_T0);
      if constexpr (R == 1 && Bits == 4) {
        // One int4 row (decode): each half from load to accumulator in turn (the fewest live registers; the
        // many-row branch below holds every half's nibbles first, which at 4 panels spilled to the stack).
        int32_t first, second;
        std::memcpy(&first, qr[0], 4);
        std::memcpy(&second, qr[0] + 4, 4);
        const __m256i av0 = _mm256_set1_epi32(first), av1 = _mm256_set1_epi32(second);
        for (int h = 0; h < H; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[h / 2] + 32 * (h % 2)));
          const __m256i pairs =
              _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(raw, nibble), av0),
                               _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), av1));
          d[0][h] = _mm256_add_epi32(d[0][h], _mm256_madd_epi16(pairs, ones));
        }
      } else if constexpr (Bits == 8) {
        __m256i c[H], mag[H];
        for (int h = 0; h < H; ++h) {
          c[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[h / 2] + 32 * (h % 2))), flip);
          mag[h] = _mm256_abs_epi8(c[h]);
        }
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, qr[r], 4);
          const __m256i av = _mm256_set1_epi32(four);
          for (int h = 0; h < H; ++h) {
            const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(av, c[h]));
            d[r][h] = _mm256_add_epi32(d[r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      } else {
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[h / 2] + 32 * (h % 2)));
          lo[h] = _mm256_and_si256(raw, nibble);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          int32_t first, second;
          std::memcpy(&first, qr[r], 4);
          std::memcpy(&second, qr[r] + 4, 4);
          const __m256i av0 = _mm256_set1_epi32(first), av1 = _mm256_set1_epi32(second);
          for (int h = 0; h < H; ++h) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], av0), _mm256_maddubs_epi16(hi[h], av1));
            d[r][h] = _mm256_add_epi32(d[r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      for (int p = 0; p < P; ++p) wp[p] += 64;
      for (int r = 0; r < R; ++r) qr[r] += kStepK;
    }
    const int64_t g = w.grouped ? k0 / a.group : 0;
    if (w.grouped)  // the next panel's scales of this group (as linear_vnni.h)
      _mm_prefetch(reinterpret_cast<const char*>(w.ws + g * w.panels * kPanel + (p0 + 1) * kPanel), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * w.blocks + b;
      // int8 codes were flipped to c = u - 128 above, so d = sum (u - 128) q: correct it to sum (u - zero_point) q
      const __m256i corr = _mm256_set1_epi32((Bits == 8 ? w.zero_point - 128 : w.zero_point) * w.qsum[at]);
      const __m256 s = _mm256_set1_ps(w.s[at]);
      for (int h = 0; h < H; ++h) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(d[r][h], corr));
        const float* wsg = w.ws + g * w.panels * kPanel + p0 * kPanel + 8 * h;
        const __m256 scale = w.grouped ? _mm256_mul_ps(_mm256_loadu_ps(wsg), s) : s;
        acc[r][h] = b == 0 ? _mm256_mul_ps(f, scale) : _mm256_fmadd_ps(f, scale, acc[r][h]);
      }
    }
  }
  const int64_t N = a.out_features;
  for (int h = 0; h < H; ++h) {
    const int64_t col = p0 * kPanel + 8 * h;
    if (col >= N) break;
    const __m256 ws = _mm256_loadu_ps(w.ws + col);
    for (int r = 0; r < R; ++r) {
      const __m256 y = w.grouped ? acc[r][h] : _mm256_mul_ps(acc[r][h], ws);
      if (col + 8 <= N) {
        _mm256_storeu_ps(w.y + (r0 + r) * N + col, y);
      } else {  // the last panel's lanes < N - col
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(N - col)), lanes);
        _mm256_maskstore_ps(w.y + (r0 + r) * N + col, mask, y);
      }
    }
  }
}

#pragma GCC pop_options

}  // namespace
}  // namespace trtbuild::cpu
#endif
