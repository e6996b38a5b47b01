// QLinear's AMX tiles (Intel Xeons from Sapphire Rapids on), beside the AVX-512 VNNI loop for the row counts where
// they pay (amx_fits; docs/decisions/amx-row-ranges.md). Compiled where -march=native has AMX-TILE and AMX-INT8,
// used where Linux grants the tile state. Included by linear.cc.

#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "linear_vnni.h"
#include "linear_work.h"

#if defined(TRTBUILD_LINEAR_AMX)
#include <sys/syscall.h>  // arch_prctl: the AMX permission request
#include <unistd.h>

namespace trtbuild::cpu {
namespace {

// The tiles' float arithmetic in the order written, as linear_vnni.h's.
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")

// AMX (Intel Xeons from Sapphire Rapids on): at the row counts below, when every block is whole 64-byte chunks of
// in-features (in_features and block multiples of 64, or one block per row: the per-token int8 linear, int4 groups
// of 64 or 128), the int32 sums come from tile products, tdpbsud (signed 8-bit activation codes x unsigned 8-bit
// weights, 64 in-features per op, 16 x 16 int32 sums): the same exact integers as vpdpbusd, at a higher rate.
// A 64-byte step of an 8-bit panel is one row of a weight tile as it lies (16 columns x 4 in-features), so a tile
// is 16 consecutive steps; an int4 panel is first unpacked into that layout (a step's low nibbles, then its high
// ones: two 8-bit steps). Tiles: sums 0-3 (2 row halves x 2 panels), activations 4-5, weights 6-7: 32 rows x 32
// columns. The float steps per block (sums less the zero-point term, times the scales) are the VNNI tile's, lane
// for lane, from the stored sums; rows are padded to kAmxRows with zero codes (their results are not stored).
// The row counts where the tiles beat the VNNI loop, and so take the work: 8-bit from kAmxMinRows, int4 from
// kAmxMinRowsInt4 to kAmxMaxRowsInt4 (fewer rows: each group's readout and rescale costs about as much as its
// products; more: the stores of y stall); the measurements are docs/decisions/amx-row-ranges.md.
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kAmxMinRowsInt4 = 64, kAmxMaxRowsInt4 = 256;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands a process AMX's tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults, so a refusal keeps the VNNI tiles.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

bool amx_fits(const LinearWork& w) {
  const LinearAttrs& a = *w.a;
  const bool rows = a.bits == 8 ? w.rows >= kAmxMinRows : w.rows >= kAmxMinRowsInt4 && w.rows <= kAmxMaxRowsInt4;
  return rows && a.in_features % 64 == 0 && (a.block >= a.in_features || a.block % 64 == 0) && amx_permitted();
}

// Rows [r0, r0 + 32) x panels [p0, p0 + P) from the panels' 8-bit weight tiles `panel` (row t: in-features
// 4t..4t+3); acc and d are this thread's scratch. No software prefetch of the weights, unlike the VNNI tiles: it did
// not pay here (docs/decisions/amx-row-ranges.md).
template <int P>
void amx_tile(const LinearWork& w, int64_t r0, int64_t p0, const uint8_t* const* panel, float* acc, int32_t* d) {
  const LinearAttrs& a = *w.a;
  const int64_t N = a.out_features, rows = std::min(kAmxRows, w.rows - r0);
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t k0 = b * a.block, k1 = std::min(k0 + a.block, a.in_features);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (P == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = k0; k < k1; k += 64) {
      const int8_t* q = w.q + code_offset(w, r0, k);  // 16 rows x 64 in-features, contiguous
      _tile_loadd(4, q, 64);
      _tile_loadd(5, q + 16 * w.kpad, 64);
      _tile_loadd(6, panel[0] + 16 * k, 64);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 5, 6);
      if constexpr (P == 2) {
        _tile_loadd(7, panel[1] + 16 * k, 64);
        _tile_dpbsud(2, 4, 7);
        _tile_dpbsud(3, 5, 7);
      }
    }
    _tile_stored(0, d, 64);  // tile 2p + h: rows 16h.., panel p
    _tile_stored(1, d + 256, 64);
    if constexpr (P == 2) {
      _tile_stored(2, d + 512, 64);
      _tile_stored(3, d + 768, 64);
    }
    // Per row and panel: the block's float term, accumulated in acc; the last block's goes straight to y
    // (the per-channel scale applied after the sum, as the VNNI tile).
    const int64_t g = w.grouped ? k0 / a.group : 0;
    const bool last = b + 1 == w.blocks;
    for (int64_t r = 0; r < (last ? rows : kAmxRows); ++r) {
      const int64_t at = (r0 + r) * w.blocks + b;
      const __m512i corr = _mm512_set1_epi32(w.zero_point * w.qsum[at]);
      const __m512 s = _mm512_set1_ps(w.s[at]);
      for (int p = 0; p < P; ++p) {
        const int64_t col = (p0 + p) * kPanel;
        const __m512i sums = _mm512_loadu_si512(d + (2 * p + r / 16) * 256 + (r % 16) * 16);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, corr));
        const __m512 scale = w.grouped ? _mm512_mul_ps(_mm512_loadu_ps(w.ws + g * w.panels * kPanel + col), s) : s;
        float* out = acc + (r * 2 + p) * kPanel;
        const __m512 sum = b == 0 ? _mm512_mul_ps(f, scale) : _mm512_fmadd_ps(f, scale, _mm512_loadu_ps(out));
        if (!last) {
          _mm512_storeu_ps(out, sum);
          continue;
        }
        const __m512 y = w.grouped ? sum : _mm512_mul_ps(sum, _mm512_loadu_ps(w.ws + col));
        _mm512_mask_storeu_ps(w.y + (r0 + r) * N + col, panel_mask(col, N), y);
      }
    }
  }
}

// One task of linear_task's split on the tiles: each panel pair's weight tiles (int4: unpacked once here) against
// the task's rows, 32 at a time. The thread's tile configuration is put back afterwards, for any other AMX user on
// the thread that configures it once (onnxruntime 1.32's MLAS loads its own per call: tests/test_cpu_linear.py).
template <int Bits>
void amx_task(void* data, size_t task) {
  const auto& w = *static_cast<const LinearWork*>(data);
  const auto [r_lo, r_hi, p_lo, p_hi] = task_range(w, task);
  TileConfig saved, cfg{};
  _tile_storeconfig(&saved);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  thread_local float acc[kAmxRows * 2 * kPanel];  // (unaligned accesses: a dlopened library's TLS alignment)
  thread_local int32_t d[4 * 256];
  thread_local std::vector<uint8_t> unpacked;  // int4: two panels' tiles, in-features / 4 rows of 64 bytes each
  const int64_t tile_bytes = w.a->in_features * 16;
  if (Bits == 4 && int64_t(unpacked.size()) < 2 * tile_bytes + 64) unpacked.resize(size_t(2 * tile_bytes + 64));
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t(63));
  for (int64_t p = p_lo; p < p_hi; p += 2) {
    const int pair = p + 1 < p_hi ? 2 : 1;
    const uint8_t* panel[2];
    for (int j = 0; j < pair; ++j) {
      const uint8_t* src = w.w + (p + j) * w.steps * 64;
      if constexpr (Bits == 8) {
        panel[j] = src;
      } else {
        uint8_t* dst = base + j * tile_bytes;
        const __m512i nibble = _mm512_set1_epi8(0x0F);
        for (int64_t t = 0; t < w.steps; ++t) {
          const __m512i raw = _mm512_loadu_si512(src + t * 64);
          _mm512_storeu_si512(dst + 128 * t, _mm512_and_si512(raw, nibble));
          _mm512_storeu_si512(dst + 128 * t + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
        }
        panel[j] = dst;
      }
    }
    for (int64_t r = r_lo; r < r_hi; r += kAmxRows) {
      if (pair == 2) {
        amx_tile<2>(w, r, p, panel, acc, d);
      } else {
        amx_tile<1>(w, r, p, panel, acc, d);
      }
    }
  }
  if (saved.palette == 0) {
    _tile_release();
  } else {
    _tile_loadconfig(&saved);
  }
}

#pragma GCC pop_options

}  // namespace
}  // namespace trtbuild::cpu
#endif
