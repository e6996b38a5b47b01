// What more than one op of the library shares: the eight-float vector type and the exp polynomial (attention's
// softmax, SwiGLU's sigmoid), the row split of the row-wise ops (QuantizeRows, RescaleRows, SwiGLU; QLinear's
// activation quantization), and the task runner over onnxruntime's intra-op thread pool.
//
// Everything here is internal to each translation unit (an anonymous namespace) but parallel_for, which the glue
// (ort_ops.cc) defines: the op files see onnxruntime only as the opaque OrtKernelContext they pass to it.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#if defined(__AVX__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

struct OrtKernelContext;  // onnxruntime's per-call context (ort_api.h): only handed back to parallel_for

#pragma GCC visibility push(hidden)  // shared by this library's files, exported by none
namespace trtbuild::cpu {

// fn(data, t) for t < tasks on onnxruntime's thread pool (ort_ops.cc), or on host threads when ctx is nullptr (a
// call through the C entry points, host_parallel_for); false when the loop was refused (the caller runs it itself).
bool parallel_for(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* data);

// fn(data, t) for t < tasks on the calling thread and the library's own workers, up to the calling C entry's thread
// count in all (c_api.cc); false when that count is below 2.
bool host_parallel_for(void (*fn)(void*, size_t), size_t tasks, void* data);

}  // namespace trtbuild::cpu
#pragma GCC visibility pop

namespace trtbuild::cpu {
namespace {

// Eight floats: GCC/Clang lower it to AVX (or two SSE / NEON registers); loads and stores may be unaligned.
typedef float v8 __attribute__((vector_size(32), aligned(4)));
inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }

// Cephes' expf polynomial: exp(r) for the reduced argument (|r| <= ln 2 / 2), on a float or on eight lanes.
template <typename T>
inline T exp_poly(T r) {
  T y = T{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (a score minus its row's running maximum), Cephes' expf polynomial, within 2 ulp; a plain
// loop over it vectorises (libm's expf does not), which matters: every score takes one.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float y = exp_poly(r);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Eight int32s beside v8, for the exponent arithmetic of exp8.
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

// exp_nonpositive on eight lanes: the same steps (floor by truncation, corrected where it rounded up).
inline v8 exp8_nonpositive(v8 x) {
  x = x < -87.3f ? v8{} - 87.3f : x;
  const v8 t = x * 1.44269504088896341f + 0.5f;
  v8 n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8);
  n = n > t ? n - 1.0f : n;
  const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v8 y = exp_poly(r);
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// fn(data, t) for t < tasks on onnxruntime's pool; all in this thread when `parallel` is false, there is one task,
// or the pool refuses.
inline void run_tasks(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* data,
                      bool parallel = true) {
  if (!parallel || tasks < 2 || !parallel_for(ctx, fn, tasks, data))
    for (size_t t = 0; t < tasks; ++t) fn(data, t);
}

constexpr int64_t kRowsPerTask = 16;

// A row-wise op's tensors, [rows, width] each (its last axis the row); the fields an op does not use stay null.
struct RowsWork {
  const float* x;
  uint8_t* codes;
  float* scale;
  const int32_t* sums;
  const float* col;
  float* out;
  int64_t rows, width;
};

// Rows in tasks of kRowsPerTask on onnxruntime's pool when there is enough work for a second thread.
inline void for_rows(OrtKernelContext* ctx, void (*fn)(void*, size_t), RowsWork* w) {
  const size_t tasks = size_t((w->rows + kRowsPerTask - 1) / kRowsPerTask);
  run_tasks(ctx, fn, tasks, w, w->rows * w->width >= (int64_t(1) << 15));
}

}  // namespace
}  // namespace trtbuild::cpu
