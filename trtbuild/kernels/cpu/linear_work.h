// QLinear's work description, shared by linear.cc and its per-instruction-set product loops (linear_vnni.h,
// linear_avx2.h, linear_amx.h, linear_scalar.h): one call's tensors and sizes, the task split, where an activation
// code lies, and which loops this build has (-march=native decides).

#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common.h"
#include "linear.h"

namespace trtbuild::cpu {
namespace {

struct LinearWork {
  const LinearAttrs* a;
  const int8_t* q;       // [M, kpad] activation codes (padding 0)
  const float* s;        // [M, blocks] activation scales
  const int32_t* qsum;   // [M, blocks] sums of each block's codes
  const uint8_t* w;      // packed weight
  const float* ws;       // [groups, panels * 16]
  const float* wo;       // [groups, panels * 16] weight offsets, or null (no offset term)
  float* y;              // [M, N]
  int64_t rows, kpad, steps, blocks, panels, panels_per_task;
  int32_t zero_point;
  bool grouped;
  bool tiled;  // q laid out in AMX tiles: [rows / 16][kpad / 64][16 rows][64 in-features] (amx_tile)
};

constexpr int64_t kPanel = 16;
constexpr int64_t kRowsPerLinearTask = 64;
constexpr int64_t kMaxPanelChunks = 64;
constexpr int64_t kAmxRows = 32;  // rows of an AMX tile pair (amx_tile); the tiled codes are padded to a multiple

// A task's rows [r_lo, r_hi) and panels [p_lo, p_hi): chunks of kRowsPerLinearTask rows x w.panels_per_task panels,
// the panel chunk varying fastest (linear_task and amx_task split the work alike).
struct TaskRange {
  int64_t r_lo, r_hi, p_lo, p_hi;
};

TaskRange task_range(const LinearWork& w, size_t task) {
  const int64_t panel_chunks = (w.panels + w.panels_per_task - 1) / w.panels_per_task;
  const int64_t r_lo = int64_t(task) / panel_chunks * kRowsPerLinearTask;
  const int64_t p_lo = int64_t(task) % panel_chunks * w.panels_per_task;
  return {r_lo, std::min(w.rows, r_lo + kRowsPerLinearTask), p_lo, std::min(w.panels, p_lo + w.panels_per_task)};
}

// Where activation code (r, k) lies in w.q: row-major [rows, kpad], or tiled (LinearWork::tiled, written only by
// 16-code stores at k % 16 == 0; tiled implies kpad == in_features, a multiple of 64).
inline int64_t code_offset(const LinearWork& w, int64_t r, int64_t k) {
  return w.tiled ? (r / 16) * 16 * w.kpad + (k / 64) * 1024 + (r % 16) * 64 + k % 64 : r * w.kpad + k;
}

// Which tiles this build has: AVX-512 VNNI (linear_vnni.h; AMX tiles beside it where the CPU has them,
// linear_amx.h), AVX2 + FMA (linear_avx2.h), or neither (plain loops, linear_scalar.h).
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TRTBUILD_LINEAR_VNNI 1
#define TRTBUILD_LINEAR_SIMD 1
constexpr int64_t kRowPanels = 2;
#elif defined(__AVX2__) && defined(__FMA__)
#define TRTBUILD_LINEAR_AVX2 1
#define TRTBUILD_LINEAR_SIMD 1
constexpr int64_t kRowPanels = 1;
#else
#define TRTBUILD_LINEAR_SIMD 0
#endif
#if defined(TRTBUILD_LINEAR_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TRTBUILD_LINEAR_AMX 1  // tile products for enough rows (amx_fits)
#endif

}  // namespace
}  // namespace trtbuild::cpu
