// QLinear (domain "trtbuild.cpu"; the arithmetic, the packed layout and the inputs: linear.h; glue: ort_ops.cc): the
// activation rows quantized per block, the products on this build's loop (linear_vnni.h, linear_avx2.h,
// linear_amx.h or linear_scalar.h), the offset term after them, all on onnxruntime's thread pool.

#include "linear.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "linear_amx.h"
#include "linear_avx2.h"
#include "linear_scalar.h"
#include "linear_vnni.h"
#include "linear_work.h"
#include "row_amax.h"

namespace trtbuild::cpu {
namespace {

// Step 1 for rows [lo, hi): the per-token row ops' exact IEEE arithmetic (encode_row's order), per block.
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")
void quantize_blocks(const float* x, const LinearWork& w, int64_t lo, int64_t hi) {
  const int64_t K = w.a->in_features, B = w.a->block;
  for (int64_t r = lo; r < hi; ++r) {
    const float* xr = x + r * K;
    int8_t* qr = const_cast<int8_t*>(w.q) + r * w.kpad;  // row-major: the loops after the AVX-512 one
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int64_t k0 = b * B, k1 = std::min(k0 + B, K);
      float s = row_amax(xr + k0, k1 - k0) / 127.0f;
      s = s > __FLT_MIN__ ? s : __FLT_MIN__;
      int32_t sum = 0;
      int64_t k = k0;
#if defined(__AVX512F__)
      // 16 lanes at a time (GCC left this loop scalar): the same true division, round to nearest even and clamp
      const __m512 sv = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
      __m512i sums = _mm512_setzero_si512();
      for (; k < k1; k += 16) {
        const __mmask16 m = k + 16 <= k1 ? __mmask16(0xFFFF) : __mmask16((1u << (k1 - k)) - 1);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, xr + k), sv);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, hi), lo));
        _mm512_mask_cvtepi32_storeu_epi8(const_cast<int8_t*>(w.q) + code_offset(w, r, k), m, c);
        sums = _mm512_add_epi32(sums, c);  // masked-off lanes loaded 0: code 0
      }
      sum = _mm512_reduce_add_epi32(sums);
#endif
      for (; k < k1; ++k) {
        float v = __builtin_nearbyintf(xr[k] / s);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        qr[k] = int8_t(v);
        sum += int32_t(v);
      }
      const_cast<float*>(w.s)[r * w.blocks + b] = s;
      const_cast<int32_t*>(w.qsum)[r * w.blocks + b] = sum;
    }
    for (int64_t k = K; k < w.kpad; ++k) qr[k] = 0;
  }
}
#pragma GCC pop_options

// One task: a chunk of rows x a chunk of panels, row tiles innermost so the chunk's weights come from memory once
// and from cache for the other row tiles. A one-row (decode) tile spans one panel, so that a task reads its panels
// as one sequential stream (the panels lie one after another; its prefetch runs on into the next panel) rather than
// one stream per panel of a wider tile (docs/decisions/qlinear-tile-loop.md).
template <int Bits>
void linear_task(void* data, size_t task) {
  const auto& w = *static_cast<const LinearWork*>(data);
  const auto [r_lo, r_hi, p_lo, p_hi] = task_range(w, task);
#if TRTBUILD_LINEAR_SIMD
  if (r_hi - r_lo < 4) {  // decode rows: tiles of one row x one panel (above)
    // the task's first 1 KB, which no tile prefetches (each prefetches 1 KB ahead of itself), and its first scales
    const char* start = reinterpret_cast<const char*>(w.w + p_lo * w.steps * 64);
    for (int i = 0; i < 16; ++i) _mm_prefetch(start + 64 * i, _MM_HINT_T0);
    if (w.grouped)
      for (int64_t g = 0; g * w.a->group < w.a->in_features; ++g)
        _mm_prefetch(reinterpret_cast<const char*>(w.ws + g * w.panels * kPanel + p_lo * kPanel), _MM_HINT_T0);
    for (int64_t p = p_lo; p < p_hi; ++p)
      for (int64_t r = r_lo; r < r_hi; ++r) linear_tile<1, 1, Bits>(w, r, p);
    return;
  }
  // Many rows: 4 rows x kRowPanels panels per tile (AVX-512: 2, on par with or faster than 4 x 4 at 64-128 rows;
  // AVX2: 1, its 8 accumulators of 8 columns already half of the 16 registers).
  int64_t p = p_lo;
  for (; p + kRowPanels <= p_hi; p += kRowPanels) {
    int64_t r = r_lo;
    for (; r + 4 <= r_hi; r += 4) linear_tile<4, kRowPanels, Bits>(w, r, p);
    for (; r < r_hi; ++r) linear_tile<1, kRowPanels, Bits>(w, r, p);
  }
  for (; p < p_hi; ++p) {
    int64_t r = r_lo;
    for (; r + 4 <= r_hi; r += 4) linear_tile<4, 1, Bits>(w, r, p);
    for (; r < r_hi; ++r) linear_tile<1, 1, Bits>(w, r, p);
  }
#else
  for (int64_t p = p_lo; p < p_hi; ++p)
    for (int64_t r = r_lo; r < r_hi; ++r) linear_tile_scalar(w, r, p);
#endif
}

// The offset term of a task's rows and panels (linear.h): one fma per block, in block order.
void offset_task(void* data, size_t task) {
  const auto& w = *static_cast<const LinearWork*>(data);
  const LinearAttrs& a = *w.a;
  const auto [r_lo, r_hi, p_lo, p_hi] = task_range(w, task);
  const int64_t N = a.out_features, stride = w.panels * kPanel;
  const int64_t c_lo = p_lo * kPanel, c_hi = std::min(N, p_hi * kPanel);
  for (int64_t r = r_lo; r < r_hi; ++r) {
    float* yr = w.y + r * N;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int64_t at = r * w.blocks + b;
      const float f = w.s[at] * float(w.qsum[at]);
      const float* wo = w.wo + (b * a.block / a.group) * stride;
      for (int64_t c = c_lo; c < c_hi; ++c) yr[c] = __builtin_fmaf(f, wo[c], yr[c]);
    }
  }
}

// A task's products and then its offset term, in one dispatch of the pool (the same arithmetic, in the same order,
// as two dispatches in turn: the offset term of a task's rows and panels reads only what its products wrote).
using TaskFn = void (*)(void*, size_t);
template <TaskFn Products>
void products_then_offsets(void* data, size_t task) {
  Products(data, task);
  offset_task(data, task);
}
template <TaskFn Products>
TaskFn products_task(bool offsets) {
  return offsets ? products_then_offsets<Products> : Products;
}

struct QuantizeWork {
  const float* x;
  const LinearWork* w;
};

void quantize_task(void* data, size_t task) {
  const auto* qw = static_cast<const QuantizeWork*>(data);
  const int64_t lo = int64_t(task) * kRowsPerTask;
  quantize_blocks(qw->x, *qw->w, lo, std::min(qw->w->rows, lo + kRowsPerTask));
}

}  // namespace

void qlinear(OrtKernelContext* ctx, const LinearAttrs& a, const float* x, int64_t num_rows, const uint8_t* packed,
             const float* ws, const float* wo, float* y) {
  LinearWork w{};
  w.a = &a;
  w.rows = num_rows;
  if (w.rows == 0) return;
  const int64_t step_k = a.bits == 8 ? 4 : 8;
  w.steps = (a.in_features + step_k - 1) / step_k;
  w.kpad = w.steps * step_k;
  w.blocks = (a.in_features + a.block - 1) / a.block;
  w.panels = (a.out_features + kPanel - 1) / kPanel;
  w.grouped = a.group < a.in_features;
  w.zero_point = wo ? 0 : a.bits == 8 ? 128 : 8;  // with offsets the stored codes are the codes
  // Scratch for the activation codes: per calling thread, grown as needed (onnxruntime runs a node on one thread;
  // its pool's workers only read it).
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> sums;
#if defined(TRTBUILD_LINEAR_AMX)
  const bool amx = amx_fits(w);
  const int64_t rows = amx ? (w.rows + kAmxRows - 1) / kAmxRows * kAmxRows : w.rows;  // the tiles' padding rows
#else
  const bool amx = false;
  const int64_t rows = w.rows;
#endif
  w.tiled = amx;
  if (int64_t(codes.size()) < rows * w.kpad) codes.resize(size_t(rows * w.kpad));
  if (int64_t(scales.size()) < rows * w.blocks) {
    scales.resize(size_t(rows * w.blocks));
    sums.resize(size_t(rows * w.blocks));
  }
  if (rows > w.rows) {  // padding rows: zero codes; tiled, they lie among the last 32 rows', so zero those first
    std::fill(codes.begin() + (rows - kAmxRows) * w.kpad, codes.begin() + rows * w.kpad, int8_t(0));
    std::fill(scales.begin() + w.rows * w.blocks, scales.begin() + rows * w.blocks, 0.0f);
    std::fill(sums.begin() + w.rows * w.blocks, sums.begin() + rows * w.blocks, 0);
  }
  w.q = codes.data();
  w.s = scales.data();
  w.qsum = sums.data();
  w.w = packed;
  w.ws = ws;
  w.wo = wo;
  w.y = y;
  QuantizeWork qw{x, &w};
  run_tasks(ctx, quantize_task, size_t((w.rows + kRowsPerTask - 1) / kRowsPerTask), &qw);
  // Tasks of kRowsPerLinearTask rows x a multiple of 4 panels, at most kMaxPanelChunks of them across the columns:
  // small enough to balance onnxruntime's pool, large enough that a task outweighs its dispatch.
  w.panels_per_task = std::max<int64_t>(4, ((w.panels + kMaxPanelChunks - 1) / kMaxPanelChunks + 3) / 4 * 4);
  const int64_t panel_chunks = (w.panels + w.panels_per_task - 1) / w.panels_per_task;
  const size_t tasks = size_t(panel_chunks * ((w.rows + kRowsPerLinearTask - 1) / kRowsPerLinearTask));
  const bool offsets = w.wo != nullptr;
#if defined(TRTBUILD_LINEAR_AMX)
  if (amx)
    run_tasks(ctx, a.bits == 8 ? products_task<amx_task<8>>(offsets) : products_task<amx_task<4>>(offsets), tasks, &w);
  else
#endif
    run_tasks(ctx, a.bits == 8 ? products_task<linear_task<8>>(offsets) : products_task<linear_task<4>>(offsets),
              tasks, &w);
}

}  // namespace trtbuild::cpu
